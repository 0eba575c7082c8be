//! `IntegerDot`: `[B.., M, K] · [B.., K, N]` of 8-bit integers (uint8 or int8, each operand
//! either) summed exactly in int32: the matrix products of quantized models.
//!
//! With AVX-512 VNNI the sums run on `vpdpbusd`, which multiplies four unsigned bytes by four
//! signed bytes and adds the four products to an int32 lane: 64 multiply-adds an
//! instruction, four times an f32 FMA's. The instruction fixes the signedness (A unsigned, B
//! signed), so the operands are moved to it by 128 (a flip of the top bit) and the shift is
//! taken out again by sums. With `α = 128` for a signed A (else 0), `β = 128` for an
//! unsigned B (else 0), `A' = A + α` and `B' = B − β`:
//!
//! `A·B = A'·B' + β·rowsum(A) − α·colsum(B')`
//!
//! (`β·rowsum(A') − α·β·K` is `β·rowsum(A)`). B' is packed once (at compile time for a
//! weight) into panels of `WIDTH` columns, four consecutive k of a column in each 32-bit
//! lane, with the column terms beside it; the row terms are summed once per call, and only
//! for an unsigned B. Where the CPU has AMX and Linux
//! lends the tiles (`amx.rs`; `EMBER_CPU_AMX=0` turns it off), products whose k is a
//! multiple of 64 run on its tile instructions, about twice as fast again at the batch
//! sizes of inference. Elsewhere (no VNNI, or `EMBER_CPU_SIMD=0`) f32 GEMMs over exact
//! chunks of k compute the same sums.

use ember_core::dtype::DType;

use crate::buffer::Val;
use crate::error::{CpuError, KResult};

/// Columns per packed panel: four 16-lane vectors.
pub const WIDTH: usize = 64;
/// Rows of A per tile.
const MR: usize = 6;

/// Whether the VNNI kernels run: AVX-512 kernels are on and the CPU has VNNI and BW.
pub fn vnni_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| {
            crate::simd::avx512_available()
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vnni")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn check_dtype(d: DType, what: &str) -> KResult<bool> {
    match d {
        DType::U8 => Ok(false),
        DType::I8 => Ok(true),
        other => Err(CpuError::Shape(format!(
            "integer_dot needs uint8 or int8 operands, {what} is {other}"
        ))),
    }
}

/// Where quad `q`, column `c` of a panel start, in bytes from the panel's start (see
/// `PackedB::data`).
#[inline(always)]
fn tile_offset(q: usize, c: usize) -> usize {
    ((q / 16 * (WIDTH / 16) + c / 16) * 16 + q % 16) * 64 + c % 16 * 4
}

/// B' (`[K, N]`, see the module comment) in `WIDTH`-column panels, for one dtype of A.
pub struct PackedB {
    k: usize,
    n: usize,
    /// Four-k groups, rounded up to whole tiles of 16 (zeros past K).
    quads: usize,
    /// `panels × quads × WIDTH × 4` bytes in 1 KiB tiles of 16 quads × 16 columns: panel
    /// p, quad q, column c of the panel holds B'[4q..4q + 4, p·WIDTH + c] (zeros past K
    /// and N) at [`tile_offset`]`(q, c)` from the panel's start. An AMX B tile is then one
    /// contiguous KiB, and a VNNI vector (16 columns of one quad) 64 bytes.
    data: Vec<i8>,
    /// `−α·colsum(B')` per column, zero-padded to whole panels: the VNNI kernel's term for
    /// the flip of a signed A (AMX reads A as it is).
    col_fix: Vec<i32>,
    /// Whether A is int8 (the VNNI kernel flips its bytes to unsigned).
    a_signed: bool,
    /// Whether B was unsigned (so rows of A need the `β·rowsum(A)` term: `row_terms`).
    b_unsigned: bool,
}

impl PackedB {
    /// Packs `b` (`[K, N]`, uint8 or int8 bytes, contiguous) for products with an A of
    /// `a_dtype`.
    pub fn new(b: &[u8], (k, n): (usize, usize), b_dtype: DType, a_dtype: DType) -> KResult<Self> {
        let a_signed = check_dtype(a_dtype, "A")?;
        let b_unsigned = !check_dtype(b_dtype, "B")?;
        if b.len() != k * n {
            return Err(CpuError::Shape(format!(
                "packing {} bytes as [{k}, {n}]",
                b.len()
            )));
        }
        let quads = k.div_ceil(4).div_ceil(16) * 16;
        let panels = n.div_ceil(WIDTH);
        let flip = if b_unsigned { 0x80 } else { 0 };
        let mut data = vec![0i8; panels * quads * WIDTH * 4];
        let mut col_sum = vec![0i32; panels * WIDTH];
        for kk in 0..k {
            let (q, j) = (kk / 4, kk % 4);
            for (col, &byte) in b[kk * n..(kk + 1) * n].iter().enumerate() {
                let v = (byte ^ flip) as i8;
                let (p, c) = (col / WIDTH, col % WIDTH);
                data[p * quads * WIDTH * 4 + tile_offset(q, c) + j] = v;
                col_sum[col] = col_sum[col].wrapping_add(i32::from(v));
            }
        }
        let alpha = if a_signed { 128i32 } else { 0 };
        // Padding columns summed zeros: their terms are 0.
        let col_fix = col_sum
            .iter()
            .map(|&s| alpha.wrapping_mul(s).wrapping_neg())
            .collect();
        Ok(PackedB {
            k,
            n,
            quads,
            data,
            col_fix,
            a_signed,
            b_unsigned,
        })
    }

    fn panels(&self) -> usize {
        self.n.div_ceil(WIDTH)
    }
}

/// A right operand prepared once, at compile time, for the kernel this CPU runs.
pub enum PreparedRight {
    Vnni(PackedB),
    /// B as f32, for `generic`.
    Floats(Val),
}

impl PreparedRight {
    /// `b` (`[K, N]`, contiguous bytes of `b_dtype`) prepared for products with an A of
    /// `a_dtype`.
    pub fn new(b: &[u8], (k, n): (usize, usize), b_dtype: DType, a_dtype: DType) -> KResult<Self> {
        match vnni_available() {
            true => PackedB::new(b, (k, n), b_dtype, a_dtype).map(PreparedRight::Vnni),
            false => right_floats(b, (k, n), b_dtype).map(PreparedRight::Floats),
        }
    }
}

/// The shape of `a · b`, checked.
fn product_shape(a: &Val, b: &Val) -> KResult<Vec<usize>> {
    let (sa, sb) = (a.shape(), b.shape());
    let r = sa.len();
    if r < 2 || sb.len() != r || sa[..r - 2] != sb[..r - 2] || sa[r - 1] != sb[r - 2] {
        return Err(CpuError::Shape(format!("integer_dot of {sa:?} and {sb:?}")));
    }
    check_dtype(a.dtype, "A")?;
    check_dtype(b.dtype, "B")?;
    let mut shape = sa[..r - 1].to_vec();
    shape.push(sb[r - 1]);
    Ok(shape)
}

/// `a · b` (see the module comment) written into `out` (contiguous, the product's shape;
/// every element written); `prepared`, when given, is `b` prepared at compile time.
pub fn integer_dot_into(
    a: &Val,
    b: &Val,
    prepared: Option<&PreparedRight>,
    out: &mut [i32],
    threads: usize,
) -> KResult<()> {
    let shape = product_shape(a, b)?;
    let r = shape.len();
    let (m, k, n) = (shape[r - 2], a.shape()[r - 1], shape[r - 1]);
    let batches: usize = shape[..r - 2].iter().product();
    if out.len() != batches * m * n {
        return Err(CpuError::Shape(format!(
            "integer_dot into {} elements, not {shape:?}",
            out.len()
        )));
    }
    if prepared.is_some() && batches != 1 {
        return Err(CpuError::Internal(
            "a prepared integer_dot operand in a batched product".into(),
        ));
    }
    // A contiguous operand is read in place (activations almost always are).
    let a = a.contiguous()?;
    let a_view = a.view::<u8>()?;
    // SAFETY: `a` is contiguous with batches·m·k elements from its view's first element,
    // kept alive by `a` for this call.
    let a_bytes = unsafe { std::slice::from_raw_parts(a_view.ptr, batches * m * k) };
    let b_bytes = match prepared {
        Some(_) => Vec::new(),
        None => b.to_vec::<u8>()?,
    };
    for t in 0..batches {
        let a_t = &a_bytes[t * m * k..(t + 1) * m * k];
        let out_t = &mut out[t * m * n..(t + 1) * m * n];
        let fresh;
        let right = match prepared {
            Some(p) => p,
            None => {
                let b_t = &b_bytes[t * k * n..(t + 1) * k * n];
                fresh = PreparedRight::new(b_t, (k, n), b.dtype, a.dtype)?;
                &fresh
            }
        };
        match right {
            PreparedRight::Vnni(p) => {
                if (p.k, p.n, p.a_signed) != (k, n, a.dtype == DType::I8) || !vnni_available() {
                    return Err(CpuError::Internal(
                        "a packed integer_dot operand does not fit its product".into(),
                    ));
                }
                // SAFETY: VNNI is available (checked); `a_t` holds m×k bytes and `out_t`
                // m×n int32, `p` packs a [k, n] operand (checked).
                unsafe { packed_product(a_t, m, p, out_t) };
            }
            PreparedRight::Floats(f) => generic(a_t, a.dtype, f, (m, k, n), out_t, threads)?,
        }
    }
    Ok(())
}

/// `a` (`[m, k]`) times `p` on the fastest kernel this CPU has: AMX tiles where they take
/// the product, else VNNI vectors.
///
/// # Safety
/// As `vnni::product`.
unsafe fn packed_product(a: &[u8], m: usize, p: &PackedB, out: &mut [i32]) {
    let rows = row_terms(a, m, p);
    if amx::available() && amx::takes(p) {
        // SAFETY: checked above; the rest is this function's contract.
        return unsafe { amx::product(a, m, p, &rows, out) };
    }
    // SAFETY: this function's contract.
    unsafe { vnni::product(a, m, p, &rows, out) }
}

/// `β·rowsum(A)` for each of A's `m` rows (`a`: `[m, k]`, read as `p`'s A dtype): the row
/// terms of an unsigned B, zeros for a signed one. Both kernels add them as they store.
fn row_terms(a: &[u8], m: usize, p: &PackedB) -> Vec<i32> {
    if !p.b_unsigned || p.k == 0 {
        return vec![0; m];
    }
    a.chunks_exact(p.k)
        .take(m)
        .map(|row| {
            let sum = row.iter().fold(0i32, |s, &x| {
                s.wrapping_add(match p.a_signed {
                    true => i32::from(x as i8),
                    false => i32::from(x),
                })
            });
            sum.wrapping_mul(128)
        })
        .collect()
}

/// Steps of k whose f32 sums are exact: each product of two 8-bit integers is at most
/// 255² < 2¹⁶ in magnitude, so 256 of them sum below 2²⁴, and every partial sum is an
/// integer f32 holds, whatever the order of the additions.
const EXACT_STEPS: usize = 256;

/// B as f32 (`[K, N]`): the right operand of `generic`, converted once for a weight.
pub fn right_floats(b: &[u8], (k, n): (usize, usize), b_dtype: DType) -> KResult<Val> {
    let signed = check_dtype(b_dtype, "B")?;
    Val::build::<f32>(DType::F32, &[k, n], |o| {
        for (o, &byte) in o.iter_mut().zip(b) {
            *o = widen(signed, byte);
        }
        Ok(())
    })
}

#[inline(always)]
fn widen(signed: bool, byte: u8) -> f32 {
    match signed {
        true => f32::from(byte as i8),
        false => f32::from(byte),
    }
}

/// Any CPU, any pair of 8-bit dtypes: f32 GEMMs over chunks of k short enough to be exact
/// (`EXACT_STEPS`), their sums converted and added in int32: an order of magnitude faster
/// than an integer loop where there is no VNNI. `b` is B as f32 (`right_floats`).
fn generic(
    a: &[u8],
    a_dtype: DType,
    b: &Val,
    (m, k, n): (usize, usize, usize),
    out: &mut [i32],
    threads: usize,
) -> KResult<()> {
    let signed = a_dtype == DType::I8;
    out.fill(0);
    for k0 in (0..k).step_by(EXACT_STEPS) {
        let kc = EXACT_STEPS.min(k - k0);
        let a_part = Val::build::<f32>(DType::F32, &[m, kc], |o| {
            for (row, o) in o.chunks_exact_mut(kc).enumerate() {
                let src = &a[row * k + k0..row * k + k0 + kc];
                for (o, &byte) in o.iter_mut().zip(src) {
                    *o = widen(signed, byte);
                }
            }
            Ok(())
        })?;
        let b_part = super::movement::slice(b, 0, k0 as i64, (k0 + kc) as i64, 1)?;
        let sums = super::dot::dot(&a_part, &b_part, threads)?;
        let sums = sums.view::<f32>()?;
        // SAFETY: `dot` returns a fresh contiguous [m, n] value.
        let sums = unsafe { std::slice::from_raw_parts(sums.ptr, m * n) };
        for (o, &s) in out.iter_mut().zip(sums) {
            *o = o.wrapping_add(s as i32);
        }
    }
    Ok(())
}

#[cfg(target_arch = "x86_64")]
mod amx;

#[cfg(target_arch = "x86_64")]
mod vnni {
    use std::arch::x86_64::*;

    use super::{PackedB, MR, WIDTH};
    use crate::par;

    const NV: usize = WIDTH / 16;

    /// One tile's operands: `R` rows of A from `a` (rows `k` bytes apart) times one panel.
    struct Tile {
        a: *const u8,
        k: usize,
        /// 0x80808080 when A's bytes flip to unsigned, else 0.
        flip: i32,
        panel: *const i8,
        col_fix: *const i32,
        row_fix: [i32; MR],
        out: *mut i32,
        ldc: usize,
        /// Columns of the panel inside the output (≤ WIDTH).
        cols: usize,
    }

    /// The four bytes `a[at..at + len]` (len ≤ 4) as one little-endian word, zeros after.
    #[inline(always)]
    unsafe fn word(a: *const u8, len: usize) -> i32 {
        if len == 4 {
            return (a as *const i32).read_unaligned();
        }
        let mut w = 0u32;
        for j in 0..len {
            w |= u32::from(*a.add(j)) << (8 * j);
        }
        w as i32
    }

    // Indexed loops over constant bounds keep the accumulators in registers; iterator
    // forms (`iter_mut().flatten()`) once kept a conv's in memory (docs/LESSONS.md).
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn run_tile<const R: usize>(t: &Tile) {
        let mut acc = [[_mm512_setzero_si512(); NV]; R];
        let flip = _mm512_set1_epi32(t.flip);
        let quads = t.k.div_ceil(4);
        for q in 0..quads {
            let len = (t.k - 4 * q).min(4);
            let mut bv = [_mm512_setzero_si512(); NV];
            for (v, b) in bv.iter_mut().enumerate() {
                let at = super::tile_offset(q, v * 16);
                *b = _mm512_loadu_si512(t.panel.add(at) as *const _);
            }
            for r in 0..R {
                let w = word(t.a.add(r * t.k + 4 * q), len);
                let av = _mm512_xor_si512(_mm512_set1_epi32(w), flip);
                for v in 0..NV {
                    acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], av, bv[v]);
                }
            }
        }
        for r in 0..R {
            let row_fix = _mm512_set1_epi32(t.row_fix[r]);
            for v in 0..NV {
                let lanes = t.cols.saturating_sub(v * 16).min(16);
                if lanes == 0 {
                    break;
                }
                let fix = _mm512_loadu_si512(t.col_fix.add(v * 16) as *const _);
                let res = _mm512_add_epi32(_mm512_add_epi32(acc[r][v], fix), row_fix);
                let mask = crate::simd::first_lanes(lanes);
                _mm512_mask_storeu_epi32(t.out.add(r * t.ldc + v * 16), mask, res);
            }
        }
    }

    struct Out(*mut i32);
    // SAFETY: tiles write disjoint parts of the output, which outlives the loop.
    unsafe impl Sync for Out {}

    /// `a` (`[m, k]`) times `p` into `out` (`[m, n]`).
    ///
    /// # Safety
    /// The CPU has AVX-512F, BW and VNNI; `a` holds m·k bytes, `rows` m row terms
    /// (`row_terms`) and `out` m·n int32 for p's k and n.
    pub unsafe fn product(a: &[u8], m: usize, p: &PackedB, rows: &[i32], out: &mut [i32]) {
        let (k, n) = (p.k, p.n);
        if m == 0 || n == 0 {
            return;
        }
        let flip = if p.a_signed { 0x8080_8080u32 as i32 } else { 0 };
        let blocks = m.div_ceil(MR);
        let panels = p.panels();
        let out_ptr = Out(out.as_mut_ptr());
        // Panel-major: consecutive tiles reuse a panel from cache.
        par::for_each(blocks * panels, |t| {
            let out_ptr = &out_ptr;
            let (panel, block) = (t / blocks, t % blocks);
            let row0 = block * MR;
            let block_rows = (m - row0).min(MR);
            let mut row_fix = [0i32; MR];
            row_fix[..block_rows].copy_from_slice(&rows[row0..row0 + block_rows]);
            let tile = Tile {
                a: a.as_ptr().add(row0 * k),
                k,
                flip,
                panel: p.data.as_ptr().add(panel * p.quads * WIDTH * 4),
                col_fix: p.col_fix.as_ptr().add(panel * WIDTH),
                row_fix,
                out: out_ptr.0.add(row0 * n + panel * WIDTH),
                ldc: n,
                cols: (n - panel * WIDTH).min(WIDTH),
            };
            match block_rows {
                1 => run_tile::<1>(&tile),
                2 => run_tile::<2>(&tile),
                3 => run_tile::<3>(&tile),
                4 => run_tile::<4>(&tile),
                5 => run_tile::<5>(&tile),
                _ => run_tile::<MR>(&tile),
            }
        });
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod amx {
    use super::PackedB;

    pub fn available() -> bool {
        false
    }

    pub fn takes(_: &PackedB) -> bool {
        false
    }

    pub unsafe fn product(_: &[u8], _: usize, _: &PackedB, _: &[i32], _: &mut [i32]) {
        unreachable!("AMX kernels exist only on x86-64")
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod vnni {
    use super::PackedB;

    pub unsafe fn product(_: &[u8], _: usize, _: &PackedB, _: &[i32], _: &mut [i32]) {
        unreachable!("VNNI kernels exist only on x86-64")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::bytes;

    fn reference(
        a: &[u8],
        ad: DType,
        b: &[u8],
        bd: DType,
        (m, k, n): (usize, usize, usize),
    ) -> Vec<i32> {
        let w = |s: bool, x: u8| if s { i64::from(x as i8) } else { i64::from(x) };
        let mut out = vec![0; m * n];
        for i in 0..m {
            for j in 0..n {
                let s: i64 = (0..k)
                    .map(|p| w(ad == DType::I8, a[i * k + p]) * w(bd == DType::I8, b[p * n + j]))
                    .sum();
                out[i * n + j] = s as i32;
            }
        }
        out
    }

    /// Every pair of dtypes, shapes with ragged tiles, panels and k tails, packed and not.
    #[test]
    fn matches_the_reference_for_every_dtype_pair() {
        for (m, k, n) in [
            (1, 1, 1),
            (7, 5, 70),
            (13, 64, 130),
            (6, 259, 64),
            (32, 256, 33),
        ] {
            for (ad, bd) in [
                (DType::U8, DType::I8),
                (DType::U8, DType::U8),
                (DType::I8, DType::I8),
                (DType::I8, DType::U8),
            ] {
                let a = bytes(m * k, 1);
                let b = bytes(k * n, 2);
                let want = reference(&a, ad, &b, bd, (m, k, n));
                let mut got = vec![0; m * n];
                let floats = right_floats(&b, (k, n), bd).unwrap();
                generic(&a, ad, &floats, (m, k, n), &mut got, 1).unwrap();
                assert_eq!(got, want, "generic {ad}×{bd} {m}×{k}×{n}");
                if vnni_available() {
                    let p = PackedB::new(&b, (k, n), bd, ad).unwrap();
                    let rows = row_terms(&a, m, &p);
                    // Two threads for real: the caller and a helper split the tiles.
                    for threads in [1, 2] {
                        let mut got = vec![0; m * n];
                        let helpers = crate::par::Helpers::for_threads(threads);
                        crate::par::with_helpers(&helpers, threads, || unsafe {
                            vnni::product(&a, m, &p, &rows, &mut got)
                        });
                        assert_eq!(got, want, "vnni {ad}×{bd} {m}×{k}×{n} {threads} threads");
                    }
                    if amx::available() && amx::takes(&p) {
                        let mut got = vec![0; m * n];
                        unsafe { amx::product(&a, m, &p, &rows, &mut got) };
                        assert_eq!(got, want, "amx {ad}×{bd} {m}×{k}×{n}");
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod speed {
    use super::*;
    use crate::kernels::testing::bytes;

    /// `cargo test -p ember-cpu --release --lib -- --ignored integer_dot_speed --nocapture`
    /// (`EMBER_SPEED_THREADS=2`: VNNI on two threads)
    #[test]
    #[ignore]
    fn integer_dot_speed() {
        for (m, k, n) in [
            (32, 256, 1024),
            (32, 1024, 256),
            (1, 4096, 4096),
            (256, 1024, 1024),
        ] {
            let a = bytes(m * k, 1);
            let b = bytes(k * n, 2);
            let mut out = vec![0; m * n];
            let reps = 20;
            let t = std::time::Instant::now();
            let floats = right_floats(&b, (k, n), DType::I8).unwrap();
            for _ in 0..reps {
                generic(&a, DType::U8, &floats, (m, k, n), &mut out, 1).unwrap();
            }
            let generic_us = t.elapsed().as_secs_f64() * 1e6 / reps as f64;
            let mut vnni_us = f64::NAN;
            if vnni_available() {
                let p = PackedB::new(&b, (k, n), DType::I8, DType::U8).unwrap();
                let rows = row_terms(&a, m, &p);
                // EMBER_SPEED_THREADS=2 times VNNI on two threads (the caller and a helper).
                let threads: usize = std::env::var("EMBER_SPEED_THREADS")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(1);
                let helpers = crate::par::Helpers::for_threads(threads);
                let t = std::time::Instant::now();
                crate::par::with_helpers(&helpers, threads, || {
                    for _ in 0..reps {
                        unsafe { vnni::product(&a, m, &p, &rows, &mut out) };
                    }
                });
                vnni_us = t.elapsed().as_secs_f64() * 1e6 / reps as f64;
                if amx::available() && amx::takes(&p) {
                    let t = std::time::Instant::now();
                    for _ in 0..reps {
                        unsafe { amx::product(&a, m, &p, &rows, &mut out) };
                    }
                    let amx_us = t.elapsed().as_secs_f64() * 1e6 / reps as f64;
                    println!("{m}x{k}x{n}: amx {amx_us:.1} us");
                }
            }
            let gops = (2 * m * k * n) as f64 / vnni_us / 1e3;
            println!(
                "{m}x{k}x{n}: generic {generic_us:.1} us, vnni {vnni_us:.1} us ({gops:.0} GOP/s)"
            );
        }
    }
}
