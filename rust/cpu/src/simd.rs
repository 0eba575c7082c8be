//! Runtime dispatch to wider vectors. The wheel targets baseline x86-64 (SSE2), so hot loops
//! are also compiled for AVX2 (8 f32 lanes instead of 4) and picked when the CPU has it.
//! The arithmetic is the same IEEE operations in the same order (no FMA contraction), so
//! results are bit for bit those of the SSE2 build. (The f32 transcendental kernels of
//! `elem::vecmath` and `sgemm` use FMA and are the exception.) `EMBER_CPU_SIMD=0` (read once)
//! turns the dispatch off, for comparisons.

use std::sync::OnceLock;

/// Runs `f`, compiled for AVX2 when the CPU supports it. `f` should hold the whole loop: it
/// is inlined into the AVX2 copy, and code it calls is widened only where inlined too.
#[inline(always)]
pub fn wide<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        if avx2_enabled() {
            // SAFETY: the CPU supports AVX2 (checked at run time).
            return unsafe { avx2(f) };
        }
    }
    f()
}

/// Generates `$name(slices.., out, f)`: `out[i] = f(x[i], ..)`, with an AVX2 copy. The slices
/// are arguments (not captures) so the compiler knows they do not alias, which the AVX2
/// vectorizer needs (with captured slices it left GELU scalar: 3× slower than SSE2).
macro_rules! map_n {
    ($name:ident, $base:ident, $avx:ident, $($x:ident: $A:ident),+) => {
        #[inline(always)]
        pub fn $name<$($A: Copy,)+ R>($($x: &[$A],)+ out: &mut [R], f: impl Fn($($A),+) -> R) {
            #[cfg(target_arch = "x86_64")]
            {
                if avx2_enabled() {
                    // SAFETY: the CPU supports AVX2 (checked at run time).
                    unsafe { $avx($($x,)+ out, &f) };
                    return;
                }
            }
            $base($($x,)+ out, &f)
        }

        #[inline(always)]
        fn $base<$($A: Copy,)+ R>($($x: &[$A],)+ out: &mut [R], f: &impl Fn($($A),+) -> R) {
            let n = out.len();
            $(let $x = &$x[..n];)+
            for i in 0..n {
                out[i] = f($($x[i]),+);
            }
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2")]
        unsafe fn $avx<$($A: Copy,)+ R>($($x: &[$A],)+ out: &mut [R], f: &impl Fn($($A),+) -> R) {
            $base($($x,)+ out, f)
        }
    };
}

map_n!(map1, map1_base, map1_avx2, x: A);
map_n!(map2, map2_base, map2_avx2, x: A, y: B);
map_n!(map3, map3_base, map3_avx2, x: A, y: B, z: C);

/// The AVX-512 mask of the first `n` of 16 lanes (all 16 for `n ≥ 16`): the lanes a loop's
/// last, partial vector loads and stores.
#[inline(always)]
pub fn first_lanes(n: usize) -> u16 {
    if n >= 16 {
        u16::MAX
    } else {
        (1u16 << n) - 1
    }
}

/// Whether wide SIMD code may be used: false when `EMBER_CPU_SIMD=0` (read once). Every
/// run-time dispatch (these loops, `sgemm`) asks here, so one switch turns them all off.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub fn requested() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("EMBER_CPU_SIMD").map_or(true, |v| v.trim() != "0"))
}

/// Whether AVX2 and FMA kernels may run (`sgemm`, `vecmath`): the CPU has both and
/// `EMBER_CPU_SIMD` is not 0.
pub fn fma_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static ON: OnceLock<bool> = OnceLock::new();
        *ON.get_or_init(|| avx2_enabled() && std::arch::is_x86_feature_detected!("fma"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the AVX-512 `sgemm` tile may run: AVX2/FMA kernels are on, the CPU has AVX-512F,
/// and `EMBER_CPU_AVX512` is not 0 (read once; for comparisons with the AVX2 tile).
pub fn avx512_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static ON: OnceLock<bool> = OnceLock::new();
        *ON.get_or_init(|| {
            fma_available()
                && std::arch::is_x86_feature_detected!("avx512f")
                && std::env::var("EMBER_CPU_AVX512").map_or(true, |v| v.trim() != "0")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether AVX2 copies of hot loops run: the CPU has AVX2 and `EMBER_CPU_SIMD` is not 0.
#[cfg(target_arch = "x86_64")]
pub fn avx2_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| requested() && std::arch::is_x86_feature_detected!("avx2"))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}

#[cfg(not(target_arch = "x86_64"))]
#[allow(dead_code)]
pub fn avx2_enabled() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::elem::Real;

    /// The AVX2 copies round exactly like the baseline build (no FMA contraction).
    #[test]
    fn avx2_copies_match_the_baseline_bit_for_bit() {
        let x: Vec<f32> = (0..4099).map(|i| (i as f32 - 2000.0) * 0.013).collect();
        let y: Vec<f32> = x.iter().map(|v| v.sin() * 3.0).collect();
        let gelu = |c: f32| c.fast_gelu();
        let mix = |a: f32, b: f32| a.fast_tanh() * b.fast_sigmoid() + (a - b).fast_exp();
        let (mut base, mut wide) = (vec![0f32; x.len()], vec![0f32; x.len()]);
        map1_base(&x, &mut base, &gelu);
        map1(&x, &mut wide, gelu);
        assert!(base
            .iter()
            .zip(&wide)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        map2_base(&x, &y, &mut base, &mix);
        map2(&x, &y, &mut wide, mix);
        assert!(base
            .iter()
            .zip(&wide)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}
