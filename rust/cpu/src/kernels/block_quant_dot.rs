//! `BlockQuantDot`: a product whose weight stays block-quantized (2-, 4- or 8-bit values,
//! a scale and a zero point per block of a row; ONNX Runtime's `MatMulNBits`).
//!
//! Values are unpacked by bit position (all low values of a block's bytes, then the next
//! ones) so unpacking is a plain vector loop; x's columns are put in that order once per
//! call (`reorder_x`), which leaves every sum unchanged. For a few rows of x (decode), each
//! block is unpacked in registers as it is multiplied, `GROUP_ROWS` rows of x a pass, so the
//! weight is read at its packed size and never held in float. From `GEMM_ROWS` rows on
//! (prefill), each part of the weight is unpacked once per call into a cache-sized buffer
//! and multiplied by the GEMM kernel; without AVX2, past `FEW_ROWS` rows the whole weight
//! is unpacked for the portable GEMM.

use ember_core::dtype::DType;

use super::elementwise::cast;
use super::{dot, sgemm};
use crate::buffer::{Layout, Val};
use crate::error::{CpuError, KResult};
use crate::par::{self, SendPtr};

/// Rows of x up to which each block is unpacked and used in place, `GROUP_ROWS` rows at a
/// time; past it the GEMM on the weight unpacked once per call wins.
const FEW_ROWS: usize = 64;
/// Rows of x one pass over the weights serves (their sums stay in registers).
const GROUP_ROWS: usize = 4;
/// Rows of x from which the weights are unpacked into the GEMM kernel (`unpacked_in_parts`):
/// one thread, K = N = 2048, 4 bits, it ran at 17, 25 and 32 G multiply-adds/s for 8, 12
/// and 16 rows, the grouped kernel at 24 for each (`block_quant_speed`).
const GEMM_ROWS: usize = 12;
/// Unpacked weights per part of `unpacked_in_parts`, in floats, and the row count they
/// are rounded to (four of the GEMM kernel's 6-row tiles).
const PART_FLOATS: usize = 65536;
const PART_ROWS: usize = 24;

/// The shapes of one `BlockQuantDot`.
#[derive(Clone, Copy)]
struct Dims {
    m: usize,
    k: usize,
    n: usize,
    bits: usize,
    block: usize,
    blocks: usize,
    row_bytes: usize,
}

impl Dims {
    /// Values per byte.
    fn per_byte(&self) -> usize {
        8 / self.bits
    }

    /// Bytes per block.
    fn block_bytes(&self) -> usize {
        self.block * self.bits / 8
    }
}

pub fn block_quant_dot(
    x: &Val,
    packed: &Val,
    scales: &Val,
    zeros: &Val,
    (bits, block): (u8, usize),
    threads: usize,
) -> KResult<Val> {
    let (bits, block) = (bits as usize, block);
    let ([m, k], [n, row_bytes]) = (x.shape(), packed.shape()) else {
        return Err(CpuError::Shape(format!(
            "block_quant_dot of {:?} and {:?}",
            x.shape(),
            packed.shape()
        )));
    };
    let (m, k, n, row_bytes) = (*m, *k, *n, *row_bytes);
    let blocks = k.div_ceil(block.max(1));
    let fits = matches!(bits, 2 | 4 | 8)
        && block >= 8
        && block.is_multiple_of(8)
        && row_bytes * 8 == blocks * block * bits
        && packed.dtype == DType::U8
        && scales.shape() == [n, blocks]
        && zeros.shape() == [n, blocks]
        && scales.dtype == DType::F32
        && zeros.dtype == DType::F32;
    if !fits {
        return Err(CpuError::Shape(format!(
            "block_quant_dot: {bits}-bit blocks of {block} for K={k} do not fit packed {} {:?}, \
             scales {} {:?}, zeros {} {:?}",
            packed.dtype,
            packed.shape(),
            scales.dtype,
            scales.shape(),
            zeros.dtype,
            zeros.shape()
        )));
    }
    if m == 0 || n == 0 {
        return cast(
            &Val::build::<f32>(DType::F32, &[m, n], |_| Ok(()))?,
            x.dtype,
        );
    }
    if x.dtype != DType::F32 {
        let x32 = cast(x, DType::F32)?;
        let out = block_quant_dot(&x32, packed, scales, zeros, (bits as u8, block), threads)?;
        return cast(&out, x.dtype);
    }
    let d = Dims {
        m,
        k,
        n,
        bits,
        block,
        blocks,
        row_bytes,
    };
    let (x, packed, scales, zeros) = (
        x.contiguous()?,
        packed.contiguous()?,
        scales.contiguous()?,
        zeros.contiguous()?,
    );
    let (xv, qv, sv, zv) = (
        x.view::<f32>()?,
        packed.view::<u8>()?,
        scales.view::<f32>()?,
        zeros.view::<f32>()?,
    );
    let (xs, q) = (xv.run(0, m * k), qv.run(0, n * row_bytes));
    let (s, z) = (sv.run(0, n * blocks), zv.run(0, n * blocks));
    let in_parts = m >= GEMM_ROWS && sgemm::available();
    if m <= FEW_ROWS || in_parts {
        Val::build::<f32>(DType::F32, &[m, n], |out| {
            let mut xr = vec![0f32; m * blocks * block];
            reorder_x(&mut xr, xs, d);
            match in_parts {
                true => unpacked_in_parts(out, &xr, q, (s, z), d),
                false => few_rows(out, &xr, q, (s, z), d),
            }
            Ok(())
        })
    } else {
        // Both operands in the unpacking order: the same sums, a GEMM's speed.
        let padded = blocks * block;
        let xr = Val::build::<f32>(DType::F32, &[m, padded], |dst| {
            reorder_x(dst, xs, d);
            Ok(())
        })?;
        let w = Val::build::<f32>(DType::F32, &[n, padded], |w| {
            unpack_all(w, q, (s, z), d);
            Ok(())
        })?;
        // x · wᵀ: the GEMM reads the transposed weight as a strided view.
        let wt = w.with_layout(Layout {
            shape: vec![padded, n],
            strides: vec![1, padded as isize],
            offset: 0,
        })?;
        dot::dot(&xr, &wt, threads)
    }
}

/// x's columns per block in the unpacking order (`unpack_bit_order`), into `out`
/// (`[m, blocks · block]`, zeroed: the columns past K stay 0).
fn reorder_x(out: &mut [f32], xs: &[f32], d: Dims) {
    let padded = d.blocks * d.block;
    let (per, stream) = (d.per_byte(), d.block_bytes());
    for i in 0..d.m {
        let (row, dest) = (&xs[i * d.k..][..d.k], &mut out[i * padded..][..padded]);
        // Value j of a block sits in byte j / per at bit position j % per: bit position t's
        // values are every per-th from t (loops rather than two divisions by run-time
        // sizes per value).
        for (src, dst) in row.chunks(d.block).zip(dest.chunks_exact_mut(d.block)) {
            for (t, part) in dst.chunks_exact_mut(stream).enumerate() {
                for (v, &x) in part.iter_mut().zip(src.iter().skip(t).step_by(per)) {
                    *v = x;
                }
            }
        }
    }
}

/// Rows of `out` `[m, n]` for a few rows of x (`xr`, in `reorder_x`'s order): parallel
/// over chunks of weight rows.
fn few_rows(out: &mut [f32], xr: &[f32], q: &[u8], sz: (&[f32], &[f32]), d: Dims) {
    let padded = d.blocks * d.block;
    // Σ x over each block of each row: the zero point's share of a block's sum.
    let block_sums: Vec<f32> = xr.chunks_exact(d.block).map(|b| b.iter().sum()).collect();
    let chunk = d.n.div_ceil(par::threads().max(1) * 4).clamp(4, 256);
    let parts = d.n.div_ceil(chunk);
    // Weight rows are the output's columns: each part fills its own columns of every row,
    // taking x's rows a group at a time while the part's weights stay in cache.
    let base = SendPtr(out.as_mut_ptr());
    par::for_each(parts, |p| {
        let rows = p * chunk..((p + 1) * chunk).min(d.n);
        let base = &base;
        let mut sums = vec![0f32; GROUP_ROWS * rows.len()];
        for first in (0..d.m).step_by(GROUP_ROWS) {
            let group = Dims {
                m: GROUP_ROWS.min(d.m - first),
                ..d
            };
            let x = (&xr[first * padded..], &block_sums[first * d.blocks..]);
            rows_dot(&mut sums, x, q, sz, group, rows.clone());
            for i in 0..group.m {
                for (r, &v) in rows.clone().zip(&sums[i * rows.len()..]) {
                    // SAFETY: (first + i, r) lies inside `out` ([m, n]); parts cover
                    // disjoint columns.
                    unsafe { *base.0.add((first + i) * d.n + r) = v };
                }
            }
        }
    });
}

/// `GEMM_ROWS` rows of x or more (a prompt): each part of the weight rows is unpacked once
/// into a buffer that stays in cache and multiplied by every row of x with the GEMM
/// kernel (the grouped kernel unpacks the weights again for each group of rows: a third of
/// its work at 32 rows). The GEMM computes outᵀ = w · xᵀ, so that x, shared by every part,
/// is packed for the kernel once and the unpacked rows are read in their own order.
fn unpacked_in_parts(out: &mut [f32], xr: &[f32], q: &[u8], sz: (&[f32], &[f32]), d: Dims) {
    let padded = d.blocks * d.block;
    let x_cols = sgemm::Strided {
        ptr: xr.as_ptr(),
        rs: 1,
        cs: padded as isize,
    };
    let mut xp = vec![0f32; sgemm::panels_len(padded, d.m)];
    // SAFETY: xr holds m rows of `padded` values, read as the padded × m matrix xᵀ; xp
    // holds its panels.
    unsafe { sgemm::pack_right(&mut xp, padded, d.m, x_cols) };
    // At most 256 KiB of unpacked weights a part (whole tiles of the kernel's rows), and
    // parts enough for the threads.
    let most = (PART_FLOATS / padded).max(PART_ROWS) / PART_ROWS * PART_ROWS;
    let chunk =
        d.n.div_ceil(par::threads().max(1) * 2)
            .clamp(PART_ROWS, most);
    let base = SendPtr(out.as_mut_ptr());
    par::for_each(d.n.div_ceil(chunk), |p| {
        let rows = p * chunk..((p + 1) * chunk).min(d.n);
        let mut w = vec![0f32; rows.len() * padded];
        unpack_some(&mut w, rows.start, q, sz, d);
        let w_rows = sgemm::Strided {
            ptr: w.as_ptr(),
            rs: padded as isize,
            cs: 1,
        };
        let mut t = vec![0f32; rows.len() * d.m];
        let (w_rows, x) = (
            sgemm::Operand::Strided(w_rows),
            sgemm::Operand::PanelsB(&xp),
        );
        // SAFETY: w holds rows·padded values, xp the panels of all m columns, t rows·m.
        unsafe { sgemm::sgemm((rows.len(), d.m, padded), w_rows, x, t.as_mut_ptr(), d.m, 1) };
        for (j, r) in rows.clone().enumerate() {
            for (i, &v) in t[j * d.m..][..d.m].iter().enumerate() {
                // SAFETY: (i, r) lies inside `out` ([m, n]); parts cover disjoint columns.
                unsafe { *base.get().add(i * d.n + r) = v };
            }
        }
    });
}

/// `sums[i · rows + j]` = x row i · weight row `rows.start + j` (x in `reorder_x`'s order).
fn rows_dot(
    sums: &mut [f32],
    (xr, block_sums): (&[f32], &[f32]),
    q: &[u8],
    sz: (&[f32], &[f32]),
    d: Dims,
    rows: std::ops::Range<usize>,
) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::fma_available() && d.block_bytes().is_multiple_of(8) {
        // SAFETY: the CPU has AVX2 and FMA (checked above); the slices hold the weight
        // rows, their scales and zeros, and `m` rows of `blocks · block` reordered x values
        // (with their block sums); bb is a multiple of 8, as both kernels read it. The 4-bit
        // kernel takes exactly M rows (constant loop bounds), the other at most M.
        unsafe {
            match (d.bits, d.m) {
                (4, 1) => x86::rows_dot4::<1>(sums, (xr, block_sums), q, sz, d, rows),
                (4, 2) => x86::rows_dot4::<2>(sums, (xr, block_sums), q, sz, d, rows),
                (4, 3) => x86::rows_dot4::<3>(sums, (xr, block_sums), q, sz, d, rows),
                (4, GROUP_ROWS) => {
                    x86::rows_dot4::<GROUP_ROWS>(sums, (xr, block_sums), q, sz, d, rows)
                }
                (_, 1..=GROUP_ROWS) => x86::rows_dot::<GROUP_ROWS>(sums, xr, q, sz, d, rows),
                _ => rows_dot_portable(sums, xr, q, sz, d, rows),
            }
        }
        return;
    }
    rows_dot_portable(sums, xr, q, sz, d, rows)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::Dims;

    /// `rows_dot` for up to `M` rows of x (`d.m` ≤ M; the sums stay in registers), 8 weights a
    /// step: bytes widened to 32 bits, shifted to the step's bit position, masked,
    /// converted, less the block's zero point, multiplied into each row's block sum; each
    /// block sum is scaled once into the row's total.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn rows_dot<const M: usize>(
        sums: &mut [f32],
        xr: &[f32],
        q: &[u8],
        (s, z): (&[f32], &[f32]),
        d: Dims,
        rows: std::ops::Range<usize>,
    ) {
        let (m, padded, bb) = (d.m.min(M), d.blocks * d.block, d.block_bytes());
        let mask = _mm256_set1_epi32((1 << d.bits) - 1);
        let count = rows.len();
        for (j, row) in rows.enumerate() {
            let mut total = [_mm256_setzero_ps(); M];
            for b in 0..d.blocks {
                let at = row * d.blocks + b;
                let zero = _mm256_set1_ps(z[at]);
                let bytes = &q[row * d.row_bytes + b * bb..][..bb];
                let mut block = [_mm256_setzero_ps(); M];
                for t in 0..d.per_byte() {
                    let shift = _mm_cvtsi32_si128((t * d.bits) as i32);
                    let x0 = b * d.block + t * bb;
                    for c in (0..bb).step_by(8) {
                        // SAFETY: bytes c..c + 8 lie in the block (bb is a multiple of 8);
                        // x columns x0 + c.. x0 + c + 8 lie in each of the m padded rows.
                        unsafe {
                            let raw = _mm_loadl_epi64(bytes.as_ptr().add(c) as *const __m128i);
                            let v = _mm256_srl_epi32(_mm256_cvtepu8_epi32(raw), shift);
                            let w =
                                _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, mask)), zero);
                            for (i, acc) in block.iter_mut().enumerate().take(m) {
                                let x = _mm256_loadu_ps(xr.as_ptr().add(i * padded + x0 + c));
                                *acc = _mm256_fmadd_ps(w, x, *acc);
                            }
                        }
                    }
                }
                let scale = _mm256_set1_ps(s[at]);
                for i in 0..m {
                    total[i] = _mm256_fmadd_ps(block[i], scale, total[i]);
                }
            }
            for (i, t) in total.iter().enumerate().take(m) {
                sums[i * count + j] = hsum(*t);
            }
        }
    }

    /// `rows_dot` for 4-bit weights, 16 a step: eight bytes widened once give the eight
    /// low values (masked) and the eight high ones (shifted); a block's sum is of the raw
    /// values, `Σ q·x`, and its zero point enters once per block as `zero · Σ x`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn rows_dot4<const M: usize>(
        sums: &mut [f32],
        (xr, block_sums): (&[f32], &[f32]),
        q: &[u8],
        (s, z): (&[f32], &[f32]),
        d: Dims,
        rows: std::ops::Range<usize>,
    ) {
        // `rows_dot` calls this with exactly M rows, so the row loops have constant bounds.
        debug_assert_eq!(d.m, M);
        let (padded, bb) = (d.blocks * d.block, d.block_bytes());
        let low = _mm256_set1_epi32(15);
        let count = rows.len();
        for (j, row) in rows.enumerate() {
            let (s_row, z_row) = (
                &s[row * d.blocks..][..d.blocks],
                &z[row * d.blocks..][..d.blocks],
            );
            let q_row = &q[row * d.row_bytes..][..d.row_bytes];
            let mut total = [_mm256_setzero_ps(); M];
            for (b, &scale) in s_row.iter().enumerate() {
                // Several sums per row (low and high values; for one row, of alternate
                // steps too): one chain of dependent multiply-adds would wait on each
                // one's latency.
                let mut block = [[_mm256_setzero_ps(); 4]; M];
                let x0 = b * d.block;
                if M == 1 {
                    // Steps in pairs, the second into the other two sums (constant
                    // indices keep the sums in registers).
                    for c in (0..bb).step_by(16) {
                        // SAFETY: bytes b·bb + c.. (8, and 8 more when c + 8 < bb) lie in
                        // the row's block b (bb is a multiple of 8); x columns x0 + c.. and
                        // x0 + bb + c.. (as many) lie in the padded row.
                        unsafe {
                            let p = q_row.as_ptr().add(b * bb + c);
                            let x = xr.as_ptr().add(x0 + c);
                            let acc = &mut block[0];
                            let (lo, hi) = nibbles(p, low);
                            acc[0] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x), acc[0]);
                            acc[1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x.add(bb)), acc[1]);
                            if c + 8 < bb {
                                let (lo, hi) = nibbles(p.add(8), low);
                                let x = x.add(8);
                                acc[2] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x), acc[2]);
                                acc[3] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x.add(bb)), acc[3]);
                            }
                        }
                    }
                } else {
                    // Rows enough for independent chains: two sums a row (registers for
                    // four would spill; so would eight rows, measured).
                    for c in (0..bb).step_by(8) {
                        // SAFETY: bytes b·bb + c..+8 lie in the row's block b; x columns
                        // x0 + c.. and x0 + bb + c.. (8 each) lie in each padded row.
                        unsafe {
                            let (lo, hi) = nibbles(q_row.as_ptr().add(b * bb + c), low);
                            for (i, acc) in block.iter_mut().enumerate() {
                                let x = xr.as_ptr().add(i * padded + x0 + c);
                                acc[0] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x), acc[0]);
                                acc[1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x.add(bb)), acc[1]);
                            }
                        }
                    }
                }
                let scale = _mm256_set1_ps(scale);
                for i in 0..M {
                    let [a, b2, c2, d2] = block[i];
                    let sum = if M == 1 {
                        _mm256_add_ps(_mm256_add_ps(a, b2), _mm256_add_ps(c2, d2))
                    } else {
                        _mm256_add_ps(a, b2)
                    };
                    total[i] = _mm256_fmadd_ps(sum, scale, total[i]);
                }
            }
            for i in 0..M {
                let x_sums = &block_sums[i * d.blocks..][..d.blocks];
                let shift = zero_shift(z_row, s_row, x_sums);
                sums[i * count + j] = hsum(total[i]) - shift;
            }
        }
    }

    /// Σ_b zero[b] · scale[b] · Σx[b]: the zero points' share of a row's sum.
    #[target_feature(enable = "avx2,fma")]
    fn zero_shift(z: &[f32], s: &[f32], x_sums: &[f32]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let full = z.len() / 8 * 8;
        for b in (0..full).step_by(8) {
            // SAFETY: b + 8 ≤ full ≤ the length of all three slices.
            unsafe {
                let zs = _mm256_mul_ps(
                    _mm256_loadu_ps(z.as_ptr().add(b)),
                    _mm256_loadu_ps(s.as_ptr().add(b)),
                );
                acc = _mm256_fmadd_ps(zs, _mm256_loadu_ps(x_sums.as_ptr().add(b)), acc);
            }
        }
        let tail: f32 = (full..z.len()).map(|b| z[b] * s[b] * x_sums[b]).sum();
        hsum(acc) + tail
    }

    /// The low and the high 4-bit values of the 8 bytes at `p`, as floats.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn nibbles(p: *const u8, low: __m256i) -> (__m256, __m256) {
        // SAFETY: the caller's 8 bytes at p.
        let v = _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(p as *const __m128i) });
        let lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, low));
        (lo, _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)))
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn hsum(v: __m256) -> f32 {
        let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)))
    }

    /// `super::unpack_rows` for 4-bit weights (block bytes a multiple of 8), 16 a step.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn unpack_rows4(
        w: &mut [f32],
        first: usize,
        q: &[u8],
        (s, z): (&[f32], &[f32]),
        d: Dims,
    ) {
        let (bb, low) = (d.block_bytes(), _mm256_set1_epi32(15));
        for (r, row) in w.chunks_exact_mut(d.blocks * d.block).enumerate() {
            let n = first + r;
            let q_row = &q[n * d.row_bytes..][..d.row_bytes];
            for (b, part) in row.chunks_exact_mut(d.block).enumerate() {
                let at = n * d.blocks + b;
                let (scale, zero) = (_mm256_set1_ps(s[at]), _mm256_set1_ps(z[at]));
                for c in (0..bb).step_by(8) {
                    // SAFETY: bytes b·bb + c..+8 lie in the row (bb is a multiple of 8);
                    // values c..c + 8 and bb + c..bb + c + 8 lie in the block's part.
                    unsafe {
                        let (lo, hi) = nibbles(q_row.as_ptr().add(b * bb + c), low);
                        let out = part.as_mut_ptr().add(c);
                        _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_sub_ps(lo, zero), scale));
                        let hi = _mm256_mul_ps(_mm256_sub_ps(hi, zero), scale);
                        _mm256_storeu_ps(out.add(bb), hi);
                    }
                }
            }
        }
    }

    /// `super::unpack_rows` compiled for AVX2 (its loop vectorizes).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn unpack_rows(
        w: &mut [f32],
        first: usize,
        q: &[u8],
        sz: (&[f32], &[f32]),
        d: Dims,
    ) {
        super::unpack_rows(w, first, q, sz, d)
    }
}

/// `rows_dot` without SIMD intrinsics: each block unpacked (`unpack_bit_order`), then
/// multiplied with every row.
fn rows_dot_portable(
    sums: &mut [f32],
    xr: &[f32],
    q: &[u8],
    (s, z): (&[f32], &[f32]),
    d: Dims,
    rows: std::ops::Range<usize>,
) {
    let padded = d.blocks * d.block;
    let count = rows.len();
    let mut w = vec![0f32; d.block];
    for (j, row) in rows.enumerate() {
        let mut total = vec![0f32; d.m];
        for b in 0..d.blocks {
            let at = row * d.blocks + b;
            let bytes = &q[row * d.row_bytes + b * d.block_bytes()..][..d.block_bytes()];
            unpack_bit_order(&mut w, bytes, (s[at], z[at]), d.bits);
            for (i, t) in total.iter_mut().enumerate() {
                let xb = &xr[i * padded + b * d.block..][..d.block];
                *t += w.iter().zip(xb).map(|(a, b)| a * b).sum::<f32>();
            }
        }
        for (i, t) in total.iter().enumerate() {
            sums[i * count + j] = *t;
        }
    }
}

/// One block's weights, `(q − zero) · scale`, by bit position: every byte's lowest value,
/// then the next ones (`reorder_x` puts x in the same order).
#[inline(always)]
fn unpack_bit_order(w: &mut [f32], bytes: &[u8], (scale, zero): (f32, f32), bits: usize) {
    let mask = ((1u16 << bits) - 1) as u8;
    for (t, part) in w.chunks_exact_mut(bytes.len()).enumerate() {
        let shift = t * bits;
        for (v, &byte) in part.iter_mut().zip(bytes) {
            *v = (((byte >> shift) & mask) as f32 - zero) * scale;
        }
    }
}

/// The whole weight unpacked, `[n, blocks · block]` with each block in `reorder_x`'s
/// order (so a GEMM with the reordered x sums the same terms), rows in parallel.
fn unpack_all(w: &mut [f32], q: &[u8], sz: (&[f32], &[f32]), d: Dims) {
    let padded = d.blocks * d.block;
    par::for_chunks_mut(w, padded * 16, |start, part| {
        unpack_some(part, start / padded, q, sz, d)
    });
}

/// Weight rows `first..` unpacked into `w` (whole padded rows), by the fastest kernel the
/// CPU has.
fn unpack_some(w: &mut [f32], first: usize, q: &[u8], sz: (&[f32], &[f32]), d: Dims) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::fma_available() {
        // SAFETY: the CPU has AVX2 and FMA (checked above); 4-bit rows as rows_dot4.
        unsafe {
            if d.bits == 4 && d.block_bytes().is_multiple_of(8) {
                x86::unpack_rows4(w, first, q, sz, d)
            } else {
                x86::unpack_rows(w, first, q, sz, d)
            }
        };
        return;
    }
    unpack_rows(w, first, q, sz, d)
}

/// Weight rows `first..` unpacked into `w` (whole padded rows).
#[inline(always)]
fn unpack_rows(w: &mut [f32], first: usize, q: &[u8], (s, z): (&[f32], &[f32]), d: Dims) {
    let bb = d.block_bytes();
    for (r, row) in w.chunks_exact_mut(d.blocks * d.block).enumerate() {
        let n = first + r;
        for (b, part) in row.chunks_exact_mut(d.block).enumerate() {
            let at = n * d.blocks + b;
            let bytes = &q[n * d.row_bytes + b * bb..][..bb];
            unpack_bit_order(part, bytes, (s[at], z[at]), d.bits);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use crate::buffer::Storage;

    pub(super) fn val<T: Copy>(dtype: DType, shape: &[usize], data: &[T]) -> Val {
        let bytes = unsafe {
            std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data))
        };
        Val::new(
            dtype,
            Arc::new(Storage::copy_of(bytes)),
            Layout::contiguous(shape),
        )
        .unwrap()
    }

    /// The product against the weight unpacked by hand, for each width, a K that ends in a
    /// partial block, and row counts for each kernel (grouped, in parts, several parts).
    #[test]
    fn matches_the_unpacked_product() {
        let mut seed = 7u32;
        let mut next = move || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            seed >> 8
        };
        for bits in [2usize, 4, 8] {
            for (m, k, n, block) in [
                (1usize, 40usize, 5usize, 16usize),
                (3, 64, 7, 32),
                (12, 64, 7, 32),
                (40, 50, 9, 16),
                (70, 96, 50, 32),
            ] {
                let blocks = k.div_ceil(block);
                let row_bytes = blocks * block * bits / 8;
                let q: Vec<u8> = (0..n * row_bytes).map(|_| next() as u8).collect();
                let s: Vec<f32> = (0..n * blocks)
                    .map(|_| (next() % 100) as f32 / 400.0)
                    .collect();
                let z: Vec<f32> = (0..n * blocks)
                    .map(|_| (next() % (1 << bits)) as f32)
                    .collect();
                let x: Vec<f32> = (0..m * k)
                    .map(|_| (next() % 200) as f32 / 100.0 - 1.0)
                    .collect();
                let got = block_quant_dot(
                    &val(DType::F32, &[m, k], &x),
                    &val(DType::U8, &[n, row_bytes], &q),
                    &val(DType::F32, &[n, blocks], &s),
                    &val(DType::F32, &[n, blocks], &z),
                    (bits as u8, block),
                    1,
                )
                .unwrap()
                .to_vec::<f32>()
                .unwrap();
                for i in 0..m {
                    for r in 0..n {
                        let want: f64 = (0..k)
                            .map(|c| {
                                let byte = q[r * row_bytes + c * bits / 8];
                                let v = (byte >> (c * bits % 8)) & ((1u16 << bits) - 1) as u8;
                                let at = r * blocks + c / block;
                                x[i * k + c] as f64 * ((v as f64 - z[at] as f64) * s[at] as f64)
                            })
                            .sum();
                        let g = got[i * n + r] as f64;
                        assert!(
                            (g - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "{bits} bits, m={m} k={k} n={n}: [{i},{r}] {g} vs {want}"
                        );
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod speed {
    use super::tests::val;
    use super::*;

    /// `cargo test --release -p ember-cpu block_quant_speed -- --ignored --nocapture`
    /// (`K=704 N=256` for other shapes).
    #[test]
    #[ignore]
    fn block_quant_speed() {
        let env = |v: &str, d: usize| std::env::var(v).map_or(d, |s| s.parse().unwrap());
        let (k, n, block) = (env("K", 2048), env("N", 2048), 32usize);
        let blocks = k / block;
        let q: Vec<u8> = (0..n * blocks * block / 2)
            .map(|i| (i * 37 % 251) as u8)
            .collect();
        let s = vec![0.01f32; n * blocks];
        let z = vec![8f32; n * blocks];
        // m rows of x: the shapes, the rows, and the rows in `reorder_x`'s order.
        let rows_of = |m: usize| {
            let d = Dims {
                m,
                k,
                n,
                bits: 4,
                block,
                blocks,
                row_bytes: blocks * block / 2,
            };
            let xs: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 - 3.0).collect();
            let mut xr = vec![0f32; m * blocks * block];
            reorder_x(&mut xr, &xs, d);
            (d, xs, xr)
        };
        for m in [1usize, GROUP_ROWS] {
            let (d, _, xr) = rows_of(m);
            let sums_x: Vec<f32> = xr.chunks_exact(block).map(|b| b.iter().sum()).collect();
            let mut out = vec![0f32; m * n];
            let t = std::time::Instant::now();
            let reps = 100;
            for _ in 0..reps {
                rows_dot(&mut out, (&xr, &sums_x), &q, (&s, &z), d, 0..n);
            }
            let per = t.elapsed().as_secs_f64() / reps as f64;
            println!(
                "{m} rows x {} weights: {:.1} us, {:.2} G multiply-adds/s (one thread)",
                k * n,
                per * 1e6,
                (m * k * n) as f64 / per / 1e9
            );
        }
        // The whole call on one row, as a decode step makes it (x reordered, the output
        // allocated, the weight rows split over the threads).
        let vals = [
            val(DType::U8, &[n, blocks * block / 2], &q),
            val(DType::F32, &[n, blocks], &s),
            val(DType::F32, &[n, blocks], &z),
        ];
        let x1 = val(DType::F32, &[1, k], &rows_of(1).1);
        for threads in [1usize, 2] {
            let helpers = par::Helpers::for_threads(threads);
            let mut times: Vec<f64> = par::with_helpers(&helpers, threads, || {
                (0..2000)
                    .map(|_| {
                        let t = std::time::Instant::now();
                        let call = (&x1, &vals[0], &vals[1], &vals[2]);
                        block_quant_dot(call.0, call.1, call.2, call.3, (4, block), threads)
                            .unwrap();
                        t.elapsed().as_secs_f64()
                    })
                    .collect()
            });
            times.sort_by(f64::total_cmp);
            let per = times[times.len() / 2];
            println!(
                "whole call, 1 row x {} weights, {threads} threads: {:.1} us, {:.2} G multiply-adds/s",
                k * n,
                per * 1e6,
                (k * n) as f64 / per / 1e9
            );
        }
        // Prompts: the grouped kernel, unpacking into the GEMM a part at a time, and the
        // whole weight unpacked for one GEMM.
        let paths = ["grouped", "in parts", "whole"];
        for m in [5usize, 8, 16, 32, 64, 256] {
            let (d, xs, xr) = rows_of(m);
            let mut out = vec![0f32; m * n];
            let x = Val::build::<f32>(DType::F32, &[m, k], |v| {
                v.copy_from_slice(&xs);
                Ok(())
            })
            .unwrap();
            for path in paths {
                // The fastest of 10 runs: this machine's neighbours add noise, never speed.
                let per = (0..10)
                    .map(|_| {
                        let t = std::time::Instant::now();
                        match path {
                            "grouped" => few_rows(&mut out, &xr, &q, (&s, &z), d),
                            "in parts" => unpacked_in_parts(&mut out, &xr, &q, (&s, &z), d),
                            _ => {
                                let w = Val::build::<f32>(DType::F32, &[n, k], |w| {
                                    unpack_all(w, &q, (&s, &z), d);
                                    Ok(())
                                })
                                .unwrap();
                                let wt = w
                                    .with_layout(Layout {
                                        shape: vec![k, n],
                                        strides: vec![1, k as isize],
                                        offset: 0,
                                    })
                                    .unwrap();
                                dot::dot(&x, &wt, 1).unwrap();
                            }
                        }
                        t.elapsed().as_secs_f64()
                    })
                    .fold(f64::INFINITY, f64::min);
                println!(
                    "{m} rows x {} weights, {path}: {:.1} us, {:.2} G multiply-adds/s (one thread)",
                    k * n,
                    per * 1e6,
                    (m * k * n) as f64 / per / 1e9
                );
            }
        }
    }
}
