//! f16/bf16 ↔ f32 conversions written branch-free, so that loops over slices vectorize.
//! `half`'s own conversions are right but do not vectorize: its f16 ones pick F16C or
//! software per element (a runtime check and a call each), and its bf16 rounding branches
//! on NaN; a bf16 `mul` ran 2× slower than the f32 one and an f16 `mul` 18× slower than
//! eager's. Each function returns what `half` returns for every input (NaN payloads
//! included); the tests compare them over every f16 and bf16 and a dense sweep of f32.

use half::{bf16, f16};

/// bf16 → f32, exact: a bf16 is the high half of an f32 (a NaN quieted).
#[inline(always)]
pub fn bf16_to_f32(h: bf16) -> f32 {
    let x = (h.to_bits() as u32) << 16;
    let quiet = if x & 0x7FFF_FFFF > 0x7F80_0000 {
        0x0040_0000
    } else {
        0
    };
    f32::from_bits(x | quiet)
}

/// f32 → bf16, rounded to nearest even; a NaN stays NaN (quieted, sign and high payload
/// kept).
#[inline(always)]
pub fn f32_to_bf16(v: f32) -> bf16 {
    let x = v.to_bits();
    // Adding just under half an ulp, plus one more when the kept part is odd, rounds ties to
    // even; a carry out of the mantissa steps the exponent (to infinity past the largest).
    let rounded = x.wrapping_add(0x7FFF + ((x >> 16) & 1)) >> 16;
    let nan = (x >> 16) | 0x40;
    bf16::from_bits(if v.is_nan() { nan } else { rounded } as u16)
}

/// f16 → f32, exact.
#[inline(always)]
pub fn f16_to_f32(h: f16) -> f32 {
    let h = h.to_bits() as u32;
    let sign = (h & 0x8000) << 16;
    let em = h & 0x7FFF;
    let shifted = em << 13;
    // Normal numbers: rebias the exponent (15 → 127).
    let normal = shifted + ((127 - 15) << 23);
    // Infinity and NaN: an all-ones exponent, the mantissa (payload) kept and, for a NaN,
    // quieted.
    let special = shifted | 0x7F80_0000 | if em > 0x7C00 { 0x0040_0000 } else { 0 };
    // Zero and subnormals: the mantissa counts units of 2⁻²⁴ (exact in f32).
    let small = (em as f32 * (1.0 / 16_777_216.0)).to_bits();
    let bits = if em >= 0x7C00 {
        special
    } else if em < 0x0400 {
        small
    } else {
        normal
    };
    f32::from_bits(sign | bits)
}

/// f32 → f16, rounded to nearest even; overflow goes to infinity, a NaN stays NaN
/// (quieted, sign and high payload kept).
#[inline(always)]
pub fn f32_to_f16(v: f32) -> f16 {
    let x = v.to_bits();
    let sign = (x >> 16) & 0x8000;
    let a = x & 0x7FFF_FFFF;
    // Normal results: rebias (127 → 15), then round at bit 13 as `f32_to_bf16` does at 16.
    let rebiased = a.wrapping_sub((127 - 15) << 23);
    let normal = (rebiased.wrapping_add(0x0FFF + ((a >> 13) & 1)) >> 13).min(0x7C00);
    // Below f16's smallest normal (2⁻¹⁴): adding 0.5 in f32 leaves the subnormal's
    // mantissa, rounded to nearest even by the addition itself, in the low bits.
    let small = (f32::from_bits(a) + 0.5)
        .to_bits()
        .wrapping_sub(0x3F00_0000);
    let nan = 0x7E00 | ((a >> 13) & 0x03FF);
    let bits = if a > 0x7F80_0000 {
        nan
    } else if a >= 0x4780_0000 {
        0x7C00 // |v| ≥ 65536, infinity included
    } else if a < 0x3880_0000 {
        small
    } else {
        normal
    };
    f16::from_bits((sign | bits) as u16)
}

/// Whether `widen_f16` and `narrow_f16` convert with F16C here (`EMBER_CPU_SIMD` not 0).
pub fn f16_vectors() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::simd::avx2_enabled() && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `dst[i] = src[i]` widened, eight at a time by F16C where the CPU has it: even
/// branch-free, the element-wise conversion takes about ten instructions.
pub fn widen_f16(src: &[f16], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let mut i = 0;
    #[cfg(target_arch = "x86_64")]
    if f16_vectors() {
        // SAFETY: F16C and AVX are present; both slices hold n elements.
        unsafe { i = x86::widen(src.as_ptr(), dst.as_mut_ptr(), n) };
    }
    for (d, &h) in dst[i..n].iter_mut().zip(&src[i..n]) {
        *d = f16_to_f32(h);
    }
}

/// `dst[i] = src[i]` rounded to f16 (nearest even), eight at a time by F16C where the CPU
/// has it.
pub fn narrow_f16(src: &[f32], dst: &mut [f16]) {
    let n = src.len().min(dst.len());
    let mut i = 0;
    #[cfg(target_arch = "x86_64")]
    if f16_vectors() {
        // SAFETY: F16C and AVX are present; both slices hold n elements.
        unsafe { i = x86::narrow(src.as_ptr(), dst.as_mut_ptr(), n) };
    }
    for (d, &v) in dst[i..n].iter_mut().zip(&src[i..n]) {
        *d = f32_to_f16(v);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use half::f16;
    use std::arch::x86_64::*;

    /// The whole vectors of `n` elements; returns how many were converted.
    #[target_feature(enable = "avx,f16c")]
    pub unsafe fn widen(src: *const f16, dst: *mut f32, n: usize) -> usize {
        let mut i = 0;
        // SAFETY: i + 8 ≤ n elements on both sides (caller: n readable and writable).
        unsafe {
            while i + 8 <= n {
                let h = _mm_loadu_si128(src.add(i) as *const __m128i);
                _mm256_storeu_ps(dst.add(i), _mm256_cvtph_ps(h));
                i += 8;
            }
        }
        i
    }

    /// As `widen`, the other way (`vcvtps2ph`, rounding to nearest even: what `half` and
    /// `f32_to_f16` compute, NaN payloads included).
    #[target_feature(enable = "avx,f16c")]
    pub unsafe fn narrow(src: *const f32, dst: *mut f16, n: usize) -> usize {
        let mut i = 0;
        // SAFETY: as `widen`.
        unsafe {
            while i + 8 <= n {
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(src.add(i)));
                _mm_storeu_si128(dst.add(i) as *mut __m128i, h);
                i += 8;
            }
        }
        i
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits()
    }

    #[test]
    fn every_half_widens_as_half_does() {
        for bits in 0..=u16::MAX {
            let h = f16::from_bits(bits);
            assert!(same(f16_to_f32(h), h.to_f32()), "f16 {bits:#06x}");
            let b = bf16::from_bits(bits);
            assert!(same(bf16_to_f32(b), b.to_f32()), "bf16 {bits:#06x}");
        }
    }

    #[test]
    fn f32_rounds_to_halves_as_half_does() {
        // Every 61st f32 bit pattern (all signs, exponents and rounding cases are hit), plus
        // every pattern near f16's and bf16's rounding and range edges.
        let edges = [
            0x3300_0000u32,
            0x3380_0000,
            0x3880_0000,
            0x477F_E000,
            0x4780_0000,
        ];
        let near = edges
            .iter()
            .flat_map(|&e| (e - 0x4000..e + 0x4000).flat_map(|b| [b, b | 0x8000_0000]));
        let specials = [
            0x7F80_0000u32,
            0xFF80_0000,
            0x7F80_0001,
            0x7FC0_0000,
            0xFFFF_FFFF,
        ];
        for bits in (0..=u32::MAX).step_by(61).chain(near).chain(specials) {
            let v = f32::from_bits(bits);
            assert_eq!(
                f32_to_f16(v).to_bits(),
                f16::from_f32(v).to_bits(),
                "f16 of {bits:#010x} ({v:e})"
            );
            let (mut hw, mut wide) = ([f16::ZERO; 8], [0.0f32; 8]);
            narrow_f16(&[v; 8], &mut hw);
            assert_eq!(
                hw[7].to_bits(),
                f32_to_f16(v).to_bits(),
                "F16C {bits:#010x}"
            );
            widen_f16(&hw, &mut wide);
            assert!(same(wide[7], f16_to_f32(hw[7])), "F16C back {bits:#010x}");
            assert_eq!(
                f32_to_bf16(v).to_bits(),
                bf16::from_f32(v).to_bits(),
                "bf16 of {bits:#010x} ({v:e})"
            );
        }
    }
}
