//! Batched matrix products. f32, bf16 and f16 run on Ember's own GEMM (`sgemm`) where the
//! CPU has AVX2/FMA — a 16-bit right operand read in its own type, the left one widened, the
//! sums rounded once — and one-row products on the row-wise kernel; f64 (and f16 on other
//! CPUs) go to the `gemm` crate, which reads operands through any row/column strides
//! (transposed or broadcast operands need no copy); integers and bool use plain loops
//! (integers wrap).

use ember_core::dtype::DType;
use half::{bf16, f16};

use super::elementwise::cast;
use super::rowdot::{bf16_pairs_available, rows_dot, rows_dot_bf16, RowWeight};
use super::sgemm::{self, Operand, Packed, PanelElem, Strided};
use crate::arena::Dest;
use crate::buffer::{Val, View};
use crate::elem::{Elem, IntElem, B8};
use crate::error::{CpuError, KResult};
use crate::par;
use crate::strided::batch_offsets;

/// Products at least this large (m·n·k) let gemm use several threads.
const GEMM_PAR_MIN: usize = 48 * 48 * 48;

/// Types the gemm crate multiplies.
pub trait GemmElem: Copy + Send + Sync + 'static {
    const ZERO: Self;
    const ONE: Self;

    /// Runs the product on Ember's own kernel where there is one for this type and CPU;
    /// false leaves it to the gemm crate.
    ///
    /// # Safety
    /// As `gemm_into`.
    unsafe fn own_gemm(
        _dst: &mut [Self],
        _dst_rs: usize,
        _dims: (usize, usize, usize),
        _a: Mat<Self>,
        _b: Mat<Self>,
        _threads: usize,
    ) -> bool {
        false
    }

    /// `dst = a · b` with `a` packed at compile time; false where this type has no such path.
    ///
    /// # Safety
    /// As `gemm_into`, with `a` of shape m×k.
    unsafe fn gemm_packed_a(
        _dst: &mut [Self],
        _dst_rs: usize,
        _dims: (usize, usize, usize),
        _a: &Packed,
        _b: Mat<Self>,
        _threads: usize,
    ) -> bool {
        false
    }

    /// The same memory as f32s, for kernels with an f32-only fast path.
    fn as_f32(_s: &[Self]) -> Option<&[f32]> {
        None
    }

    fn as_f32_mut(_s: &mut [Self]) -> Option<&mut [f32]> {
        None
    }
}
impl GemmElem for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;

    fn as_f32(s: &[f32]) -> Option<&[f32]> {
        Some(s)
    }

    fn as_f32_mut(s: &mut [f32]) -> Option<&mut [f32]> {
        Some(s)
    }

    unsafe fn own_gemm(
        dst: &mut [f32],
        dst_rs: usize,
        dims: (usize, usize, usize),
        a: Mat<f32>,
        b: Mat<f32>,
        threads: usize,
    ) -> bool {
        if !sgemm::available() {
            return false;
        }
        let (a, b) = (Operand::Strided(a.into()), Operand::Strided(b.into()));
        // SAFETY: gemm_into checked dst's size; the operands by its contract.
        unsafe { sgemm::sgemm(dims, a, b, dst.as_mut_ptr(), dst_rs, threads) };
        true
    }

    unsafe fn gemm_packed_a(
        dst: &mut [f32],
        dst_rs: usize,
        (m, n, k): (usize, usize, usize),
        a: &Packed,
        b: Mat<f32>,
        threads: usize,
    ) -> bool {
        if !a.is_left() || a.rows != m || a.cols != k || m == 0 || n == 0 {
            return false;
        }
        assert!(
            dst.len() >= (m - 1) * dst_rs + n,
            "gemm destination too small"
        );
        let (a, b) = (Operand::Packed(a), Operand::Strided(b.into()));
        // SAFETY: dst checked above; b by the contract; packed operands exist only where
        // `sgemm::available()`.
        unsafe { sgemm::sgemm((m, n, k), a, b, dst.as_mut_ptr(), dst_rs, threads) };
        true
    }
}
impl GemmElem for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
}
impl GemmElem for f16 {
    const ZERO: Self = f16::ZERO;
    const ONE: Self = f16::ONE;
}

/// A matrix operand: its first element and its row and column strides (in elements).
#[derive(Clone, Copy)]
pub struct Mat<T> {
    pub ptr: *const T,
    pub rs: isize,
    pub cs: isize,
}

impl From<Mat<f32>> for Strided {
    fn from(m: Mat<f32>) -> Strided {
        Strided {
            ptr: m.ptr,
            rs: m.rs,
            cs: m.cs,
        }
    }
}

impl<T> Mat<T> {
    /// The matrix at `off` in `v` whose rows and columns are v's dims `r` and `r + 1`.
    pub fn of(v: &View<T>, off: isize, r: usize) -> Mat<T> {
        Mat {
            ptr: v.ptr.wrapping_offset(off),
            rs: v.strides[r],
            cs: v.strides[r + 1],
        }
    }

    pub fn transposed(self) -> Mat<T> {
        Mat {
            ptr: self.ptr,
            rs: self.cs,
            cs: self.rs,
        }
    }
}

/// `dst[m×n] (row stride dst_rs, unit column stride) = a[m×k] · b[k×n]`.
///
/// # Safety
/// `a` and `b` must address `m×k` and `k×n` readable elements (callers derive them from the
/// shapes and strides of checked values that stay alive for the call).
pub unsafe fn gemm_into<T: GemmElem>(
    dst: &mut [T],
    dst_rs: usize,
    (m, n, k): (usize, usize, usize),
    a: Mat<T>,
    b: Mat<T>,
    threads: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        dst.len() >= (m - 1) * dst_rs + n,
        "gemm destination too small"
    );
    if k == 0 {
        dst.iter_mut().for_each(|d| *d = T::ZERO);
        return;
    }
    // SAFETY: as this function's contract.
    if unsafe { T::own_gemm(dst, dst_rs, (m, n, k), a, b, threads) } {
        return;
    }
    let par = if m * n * k >= GEMM_PAR_MIN && threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the destination is large enough (checked above); the operands by the contract.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            false,
            a.ptr,
            a.cs,
            a.rs,
            b.ptr,
            b.cs,
            b.rs,
            T::ZERO,
            T::ONE,
            false,
            false,
            false,
            par,
        )
    }
}

/// `GroupedDot`: rows `ends[g-1]..ends[g]` of x `[S, K]` times w[g] (`[G, K, N]`), each
/// group one GEMM on strided views (a transposed w needs no copy), or for a few rows
/// (`few_rows_f32`) products that stream the expert once; rows past the last end stay
/// zero. Ends are clamped into `[previous end, S]`.
pub fn grouped_dot(x: &Val, w: &Val, ends: &Val, threads: usize) -> KResult<Val> {
    let (sx, sw) = (x.shape(), w.shape());
    let ([s, k], [g, k2, n]) = (sx, sw) else {
        return Err(CpuError::Shape(format!("grouped dot of {sx:?} and {sw:?}")));
    };
    let (s, k, n) = (*s, *k, *n);
    if k != *k2 || ends.shape() != [*g] || x.dtype != w.dtype {
        return Err(CpuError::Shape(format!(
            "grouped dot of {} {sx:?} and {} {sw:?} by {:?}",
            x.dtype,
            w.dtype,
            ends.shape()
        )));
    }
    let ends: Vec<i64> = crate::with_dtype!(ends.dtype, E => {
        let v = ends.view::<E>()?;
        (0..*g as isize).map(|i| v.at(i * v.strides[0]).to_i64()).collect()
    });
    let mut groups = Vec::with_capacity(ends.len());
    let mut start = 0usize;
    for &end in &ends {
        let end = (end.clamp(0, s as i64) as usize).max(start);
        groups.push(start..end);
        start = end;
    }
    let dims = (s, k, n);
    match x.dtype {
        DType::F32 => grouped_gemm::<f32>(x, w, &groups, dims, threads),
        DType::F64 => grouped_gemm::<f64>(x, w, &groups, dims, threads),
        DType::F16 => grouped_gemm::<f16>(x, w, &groups, dims, threads),
        DType::BF16 => {
            let (x, w) = (cast(x, DType::F32)?, cast(w, DType::F32)?);
            cast(
                &grouped_gemm::<f32>(&x, &w, &groups, dims, threads)?,
                DType::BF16,
            )
        }
        d => Err(CpuError::Unsupported(format!("grouped dot of {d}"))),
    }
}

fn grouped_gemm<T: GemmElem + Elem>(
    x: &Val,
    w: &Val,
    groups: &[std::ops::Range<usize>],
    (s, k, n): (usize, usize, usize),
    threads: usize,
) -> KResult<Val> {
    let (xv, wv) = (x.view::<T>()?, w.view::<T>()?);
    Val::build::<T>(x.dtype, &[s, n], |out| {
        for (group, rows) in groups.iter().enumerate() {
            if rows.is_empty() {
                continue;
            }
            let a = Mat {
                ptr: xv.ptr.wrapping_offset(rows.start as isize * xv.strides[0]),
                rs: xv.strides[0],
                cs: xv.strides[1],
            };
            let b = Mat {
                ptr: wv.ptr.wrapping_offset(group as isize * wv.strides[0]),
                rs: wv.strides[1],
                cs: wv.strides[2],
            };
            let dst = &mut out[rows.start * n..rows.end * n];
            if rows.len() <= FEW_ROWS && n > 0 && k > 0 {
                if let Some(dst) = T::as_f32_mut(dst) {
                    if few_rows_f32(dst, &xv, &wv, rows, group, (k, n), threads) {
                        continue;
                    }
                }
            }
            // SAFETY: a addresses rows.len()×k elements of x and b k×n of w's group (both
            // inside the checked views, alive for the call); dst holds rows.len()×n.
            unsafe { gemm_into(dst, n, (rows.len(), n, k), a, b, threads) };
        }
        Ok(())
    })
}

/// Groups of at most this many rows (a decoded token's experts) skip the GEMM, which would
/// pack the whole expert weight to use it for one or two rows: each output row streams the
/// weight once instead (memory-bound, as the matrix-vector product of decode is).
const FEW_ROWS: usize = 4;

/// Output columns per parallel task of a few-row product.
const COLUMN_BLOCK: usize = 256;

/// `dst = x[rows] · w[group]` in f32 for a few rows, by dot products when w's K is
/// contiguous (experts stored `[G, N, K]`, read transposed) or by rows of w scaled and
/// summed when its N is. False (nothing written) for other layouts.
fn few_rows_f32<T: GemmElem>(
    dst: &mut [f32],
    xv: &View<T>,
    wv: &View<T>,
    rows: &std::ops::Range<usize>,
    group: usize,
    (k, n): (usize, usize),
    threads: usize,
) -> bool {
    let (w_ks, w_ns) = (wv.strides[1], wv.strides[2]);
    if w_ks < 0 || w_ns < 0 || (w_ks != 1 && w_ns != 1) || xv.strides[1] != 1 {
        return false;
    }
    // The run spans exactly the elements the view addresses for this group.
    let extent = (k - 1) * w_ks as usize + (n - 1) * w_ns as usize + 1;
    let Some(w) = T::as_f32(wv.run(group as isize * wv.strides[0], extent)) else {
        return false;
    };
    let parallel = threads > 1 && n * k >= 1 << 16;
    for (i, out_row) in rows.clone().zip(dst.chunks_mut(n)) {
        let Some(x) = T::as_f32(xv.run(i as isize * xv.strides[0], k)) else {
            return false;
        };
        if w_ks == 1 {
            // Dot products over contiguous K, a block of output columns per task.
            let cs = w_ns as usize;
            let block = |start: usize, o: &mut [f32]| rows_dot(x, &w[start * cs..], cs, o);
            if parallel {
                par::for_chunks_mut(out_row, COLUMN_BLOCK, block);
            } else {
                block(0, out_row);
            }
        } else {
            // Rows of w scaled by x and summed, streaming w row after row; in parallel, each
            // task sums a slice of K into its own partial row.
            let rs = w_ks as usize;
            let accumulate = |ks: std::ops::Range<usize>, acc: &mut [f32]| {
                crate::simd::wide(|| {
                    for p in ks {
                        axpy(acc, x[p], &w[p * rs..p * rs + n]);
                    }
                })
            };
            let parts = if parallel { (2 * threads).min(k) } else { 1 };
            if parts == 1 {
                out_row.fill(0.0);
                accumulate(0..k, out_row);
            } else {
                let mut partial = vec![0.0f32; parts * n];
                par::for_chunks_mut(&mut partial, n, |start, acc| {
                    let part = start / n;
                    accumulate(part * k / parts..(part + 1) * k / parts, acc);
                });
                out_row.copy_from_slice(&partial[..n]);
                for more in partial[n..].chunks(n) {
                    for (o, &v) in out_row.iter_mut().zip(more) {
                        *o += v;
                    }
                }
            }
        }
    }
    true
}

/// `acc += a·y` (slices as arguments, so the vectorizer knows they do not alias).
#[inline(always)]
fn axpy(acc: &mut [f32], a: f32, y: &[f32]) {
    for (s, &v) in acc.iter_mut().zip(y) {
        *s += a * v;
    }
}

/// Checks `[B.., M, K] × [B.., K, N]` and returns (batch dims, M, K, N).
fn dims(a: &Val, b: &Val) -> KResult<(Vec<usize>, usize, usize, usize)> {
    let (sa, sb) = (a.shape(), b.shape());
    let r = sa.len();
    if r < 2 || sb.len() != r || sa[..r - 2] != sb[..r - 2] || sa[r - 1] != sb[r - 2] {
        return Err(CpuError::Shape(format!("dot of {sa:?} and {sb:?}")));
    }
    Ok((sa[..r - 2].to_vec(), sa[r - 2], sa[r - 1], sb[r - 1]))
}

pub fn dot(a: &Val, b: &Val, threads: usize) -> KResult<Val> {
    if a.dtype != b.dtype {
        return Err(CpuError::Shape(format!(
            "dot of {} and {}",
            a.dtype, b.dtype
        )));
    }
    match a.dtype {
        _ if takes_rowwise(a, b) => dot_rowwise(a, b, threads),
        DType::F32 => dot_gemm::<f32>(a, b, threads),
        DType::F64 => dot_gemm::<f64>(a, b, threads),
        DType::F16 if sgemm::available() => dot_half::<f16>(a, b, threads),
        DType::BF16 if sgemm::available() => dot_half::<bf16>(a, b, threads),
        DType::F16 => dot_gemm::<f16>(a, b, threads),
        DType::BF16 => {
            let out = dot_gemm::<f32>(&cast(a, DType::F32)?, &cast(b, DType::F32)?, threads)?;
            cast(&out, DType::BF16)
        }
        DType::U8 => dot_int::<u8>(a, b),
        DType::I8 => dot_int::<i8>(a, b),
        DType::I16 => dot_int::<i16>(a, b),
        DType::I32 => dot_int::<i32>(a, b),
        DType::I64 => dot_int::<i64>(a, b),
        DType::Bool => dot_bool(a, b),
    }
}

fn dot_gemm<T: GemmElem>(a: &Val, b: &Val, threads: usize) -> KResult<Val> {
    let (batch, m, _, n) = dims(a, b)?;
    let mut shape = batch;
    shape.extend([m, n]);
    Val::build::<T>(a.dtype, &shape, |out| gemm_batched::<T>(a, b, out, threads))
}

/// `a · b` of bf16 or f16 operands (`sgemm::available()`): `half_gemm_batched`.
fn dot_half<T: PanelElem + Elem>(a: &Val, b: &Val, threads: usize) -> KResult<Val> {
    let (mut shape, m, _, n) = dims(a, b)?;
    shape.extend([m, n]);
    Val::build::<T>(a.dtype, &shape, |out| {
        half_gemm_batched::<T>(a, b, out, threads)
    })
}

/// The batched product of bf16 or f16 operands into `out` (contiguous `[B.., M, N]`):
/// `a` widened once, `b` read in place by `sgemm` (each task packs the panels it reaches
/// in b's type and the tiles widen them), each output rounded once. The arithmetic of
/// the f32 product of the widened operands, without an f32 copy of `b` per call (a weight
/// not packed at compile time, or the keys and values of attention).
fn half_gemm_batched<T: PanelElem>(a: &Val, b: &Val, out: &mut [T], threads: usize) -> KResult<()> {
    let (batch, m, k, n) = dims(a, b)?;
    if m * n == 0 {
        return Ok(());
    }
    let r = batch.len();
    let wide = cast(a, DType::F32)?;
    let (va, vb) = (wide.view::<f32>()?, b.view::<T>()?);
    let offs = batch_offsets(&batch, [&va.strides, &vb.strides]);
    let mut sums = vec![0.0f32; out.len()];
    let one = |o: &mut [f32], &[oa, ob]: &[isize; 2], t: usize| {
        let (ma, mb) = (Mat::of(&va, oa, r), Mat::of(&vb, ob, r));
        let right = T::in_place(Strided {
            ptr: mb.ptr,
            rs: mb.rs,
            cs: mb.cs,
        });
        // SAFETY: the matrices are batch slices of the checked views va and vb; `o` holds
        // m×n outputs; the caller checked `sgemm::available()`.
        unsafe {
            sgemm::sgemm(
                (m, n, k),
                Operand::Strided(ma.into()),
                right,
                o.as_mut_ptr(),
                n,
                t,
            )
        }
    };
    if offs.len() > 1 && m * n * k < GEMM_PAR_MIN * 4 {
        par::for_chunks_mut(&mut sums, m * n, |start, o| {
            one(o, &offs[start / (m * n)], 1)
        });
    } else {
        for (o, off) in sums.chunks_mut(m * n).zip(&offs) {
            one(o, off, threads);
        }
    }
    T::from_f32_slice(&sums, out);
    Ok(())
}

/// `a · b` written into `dest` (contiguous, of the product's shape) for the dtypes gemm
/// multiplies (f32, f64, f16); every element is overwritten.
pub fn dot_into(a: &Val, b: &Val, dest: &mut Dest, threads: usize) -> KResult<()> {
    if a.dtype != b.dtype || a.dtype != dest.dtype {
        return Err(CpuError::Shape(format!(
            "dot of {} and {} into {}",
            a.dtype, b.dtype, dest.dtype
        )));
    }
    let (batch, m, _, n) = dims(a, b)?;
    if dest.numel() != batch.iter().product::<usize>() * m * n {
        return Err(CpuError::Shape(format!(
            "dot into {:?} from {:?} and {:?}",
            dest.shape,
            a.shape(),
            b.shape()
        )));
    }
    match a.dtype {
        DType::F32 if takes_rowwise(a, b) => {
            rowwise_into_slice::<f32>(a, b, dest.slice()?, threads)
        }
        DType::F16 if takes_rowwise(a, b) => {
            rowwise_into_slice::<f16>(a, b, dest.slice()?, threads)
        }
        DType::F32 => gemm_batched::<f32>(a, b, dest.slice()?, threads),
        DType::F64 => gemm_batched::<f64>(a, b, dest.slice()?, threads),
        DType::F16 if sgemm::available() => half_gemm_batched::<f16>(a, b, dest.slice()?, threads),
        DType::F16 => gemm_batched::<f16>(a, b, dest.slice()?, threads),
        d => Err(CpuError::Internal(format!("dot into a buffer of {d}"))),
    }
}

/// `a · b` into `dest` for a 2-D f32 `a` and a right operand packed at compile time.
pub fn dot_into_packed(a: &Val, b: &Packed, dest: &mut Dest, threads: usize) -> KResult<()> {
    match dest.dtype {
        DType::F32 => packed_product(a, b, dest.slice::<f32>()?, threads),
        DType::F16 => half_packed_product(a, b, dest.slice::<f16>()?, threads),
        d => Err(CpuError::Shape(format!(
            "dot of {} and a packed operand into {d}",
            a.dtype
        ))),
    }
}

/// `a · b` for a bf16 or f16 `a` and a right operand packed at compile time in its own type
/// (`Program::packed`; the tiles widen its values as they load them): `a` widened, the f32
/// product, each output rounded once — the arithmetic of `dot` on half types, without
/// converting the whole weight every call or holding an f32 copy of it.
pub fn dot_half_packed(a: &Val, b: &Packed, threads: usize) -> KResult<Val> {
    #[cfg(target_arch = "x86_64")]
    if let Some(packing) = b.bf16_packing() {
        return bf16_kernel_product(a, b, packing);
    }
    let shape = [a.shape().first().copied().unwrap_or(0), b.cols];
    match a.dtype {
        DType::BF16 => Val::build::<bf16>(a.dtype, &shape, |out| {
            half_packed_product(a, b, out, threads)
        }),
        DType::F16 => Val::build::<f16>(a.dtype, &shape, |out| {
            half_packed_product(a, b, out, threads)
        }),
        d => Err(CpuError::Internal(format!(
            "a half-precision packed product of {d}"
        ))),
    }
}

/// `a · b` for a 2-D bf16 `a` and a weight packed for a bf16 kernel of its own (AMX tiles,
/// `vdpbf16ps` pair panels): rows of `a` read in place (copied where its columns are not
/// contiguous).
#[cfg(target_arch = "x86_64")]
fn bf16_kernel_product(
    a: &Val,
    b: &Packed,
    packing: &super::bf16_kernel::Bf16Packed,
) -> KResult<Val> {
    let sa = a.shape();
    if a.dtype != DType::BF16 || sa.len() != 2 || sa[1] != b.rows {
        return Err(CpuError::Shape(format!(
            "dot of {}{sa:?} and a bf16 weight packed as [{}, {}]",
            a.dtype, b.rows, b.cols
        )));
    }
    let (m, k, n) = (sa[0], sa[1], b.cols);
    let strides = &a.layout.strides;
    let a = match (strides[1] == 1 || k <= 1) && strides[0] >= 0 {
        true => a.clone(),
        false => a.contiguous()?,
    };
    let va = a.view::<bf16>()?;
    let lda = va.strides[0] as usize;
    Val::build::<bf16>(DType::BF16, &[m, n], |out| {
        // SAFETY: a bf16 kernel's packing exists only where that kernel runs
        // (`Packed::b_bf16`); va addresses m rows of k elements `lda` apart with unit column
        // stride (checked above); the weight was packed from k×n (the `Packed`'s shape);
        // out holds m×n.
        unsafe { packing.product((m, n, k), va.ptr, lda, out.as_mut_ptr()) };
        Ok(())
    })
}

fn half_packed_product<T: RowWeight>(
    a: &Val,
    b: &Packed,
    out: &mut [T],
    threads: usize,
) -> KResult<()> {
    let wide = cast(a, DType::F32)?;
    let mut sums = vec![0.0f32; out.len()];
    packed_product(&wide, b, &mut sums, threads)?;
    T::from_f32_slice(&sums, out);
    Ok(())
}

/// `out = a · b` for a 2-D f32 `a` and a packed right operand.
fn packed_product(a: &Val, b: &Packed, out: &mut [f32], threads: usize) -> KResult<()> {
    let sa = a.shape();
    if a.dtype != DType::F32
        || b.is_left()
        || sa.len() != 2
        || sa[1] != b.rows
        || out.len() != sa[0] * b.cols
    {
        return Err(CpuError::Shape(format!(
            "dot of {}{sa:?} and a packed [{}, {}] into {} outputs",
            a.dtype,
            b.rows,
            b.cols,
            out.len()
        )));
    }
    if b.for_bf16_kernel() {
        // A bf16 weight packed for its own kernel is not `sgemm` panels (its `slice` would
        // panic): only `dot_half_packed` reads it.
        return Err(CpuError::Internal(format!(
            "an f32 product of a bf16 weight [{}, {}] packed for a bf16 kernel",
            b.rows, b.cols
        )));
    }
    let (m, k, n) = (sa[0], sa[1], b.cols);
    let va = a.view::<f32>()?;
    let sa = Strided {
        ptr: va.ptr,
        rs: va.strides[0],
        cs: va.strides[1],
    };
    // SAFETY: `a`'s view addresses m×k elements; `out` holds m×n (checked above); packed
    // operands exist only where `sgemm::available()`.
    unsafe {
        sgemm::sgemm(
            (m, n, k),
            Operand::Strided(sa),
            Operand::Packed(b),
            out.as_mut_ptr(),
            n,
            threads,
        )
    };
    Ok(())
}

/// The batched product into `out` (contiguous `[B.., M, N]`).
fn gemm_batched<T: GemmElem>(a: &Val, b: &Val, out: &mut [T], threads: usize) -> KResult<()> {
    let (batch, m, k, n) = dims(a, b)?;
    let r = batch.len();
    let (va, vb) = (a.view::<T>()?, b.view::<T>()?);
    let offs = batch_offsets(&batch, [&va.strides, &vb.strides]);
    if m * n == 0 {
        return Ok(());
    }
    let one = |o: &mut [T], &[oa, ob]: &[isize; 2], t: usize| {
        let (ma, mb) = (Mat::of(&va, oa, r), Mat::of(&vb, ob, r));
        // SAFETY: the matrices are batch slices of the checked views va and vb.
        unsafe { gemm_into(o, n, (m, n, k), ma, mb, t) }
    };
    if offs.len() > 1 && m * n * k < GEMM_PAR_MIN * 4 {
        par::for_chunks_mut(out, m * n, |start, o| one(o, &offs[start / (m * n)], 1));
    } else {
        for (o, off) in out.chunks_mut(m * n).zip(&offs) {
            one(o, off, threads);
        }
    }
    Ok(())
}

fn dot_int<T: IntElem>(a: &Val, b: &Val) -> KResult<Val> {
    dot_loops::<T, T>(a, b, T::ZERO, |acc, x, y| acc.wadd(x.wmul(y)), |x| x)
}

fn dot_bool(a: &Val, b: &Val) -> KResult<Val> {
    dot_loops::<B8, bool>(a, b, false, |acc, x, y| acc | (x.get() & y.get()), B8::new)
}

fn dot_loops<T: Copy + Send + Sync + Default, A: Copy + Send + Sync>(
    a: &Val,
    b: &Val,
    zero: A,
    step: impl Fn(A, T, T) -> A + Sync,
    finish: impl Fn(A) -> T + Sync,
) -> KResult<Val> {
    let (batch, m, k, n) = dims(a, b)?;
    let r = batch.len();
    let (va, vb) = (a.view::<T>()?, b.view::<T>()?);
    let offs = batch_offsets(&batch, [&va.strides, &vb.strides]);
    let (ars, acs, brs, bcs) = (
        va.strides[r],
        va.strides[r + 1],
        vb.strides[r],
        vb.strides[r + 1],
    );
    let mut shape = batch.clone();
    shape.extend([m, n]);
    Val::build::<T>(a.dtype, &shape, |out| {
        if m * n == 0 {
            return Ok(());
        }
        par::for_chunks_mut(out, n, |start, o| {
            let row = start / n;
            let (bi, i) = (row / m, row % m);
            let [oa, ob] = offs[bi];
            let mut acc = vec![zero; n];
            for kk in 0..k as isize {
                let x = va.at(oa + i as isize * ars + kk * acs);
                for (j, s) in acc.iter_mut().enumerate() {
                    *s = step(*s, x, vb.at(ob + kk * brs + j as isize * bcs));
                }
            }
            for (d, s) in o.iter_mut().zip(acc) {
                *d = finish(s);
            }
        });
        Ok(())
    })
}

/// Outputs per parallel task of the row-wise product (enough to amortize a task).
const ROWWISE_CHUNK: usize = 64;

/// Multiply-adds from which a row-wise product runs on every thread: as `sgemm`'s
/// matrix-vector products, a stream of 128 KiB of weight pays for a helper.
const ROWWISE_PAR_MIN: usize = 1 << 15;

/// `a · b`, one output at a time as a dot product over contiguous K (kernel
/// `cpu.rowwise`), for f32, bf16 and f16 (summed in f32, as the GEMM paths do). This is
/// the matrix-vector shape of one-token decode, where a GEMM's packing costs more than it
/// saves. `b` is read as `[N, K]` rows (the layout of a `linear` weight, which `dot` sees
/// transposed); operands in any other layout are copied once per call.
pub fn dot_rowwise(a: &Val, b: &Val, threads: usize) -> KResult<Val> {
    match (a.dtype, b.dtype) {
        (DType::F32, DType::F32) => rowwise::<f32>(a, b, threads),
        (DType::BF16, DType::BF16) => rowwise::<bf16>(a, b, threads),
        (DType::F16, DType::F16) => rowwise::<f16>(a, b, threads),
        (x, y) => Err(CpuError::Unsupported(format!(
            "the row-wise dot kernel takes f32, bf16 or f16 operands of one type, got {x} and {y}"
        ))),
    }
}

fn rowwise<T: RowWeight + Elem>(a: &Val, b: &Val, threads: usize) -> KResult<Val> {
    let (mut shape, m, _, n) = dims(a, b)?;
    shape.extend([m, n]);
    Val::build::<T>(a.dtype, &shape, |out| {
        rowwise_into_slice::<T>(a, b, out, threads)
    })
}

/// `a · b` into `out` (contiguous, the product's shape) by `rowwise_into`; a `b` whose K is
/// not contiguous is copied once (the kernel streams `[N, K]` rows).
fn rowwise_into_slice<T: RowWeight>(
    a: &Val,
    b: &Val,
    out: &mut [T],
    threads: usize,
) -> KResult<()> {
    let r = a.shape().len() - 2;
    let k = a.shape()[r + 1];
    let bt = transposed(b)?;
    let bt = if bt.layout.strides[r + 1] == 1 || k <= 1 {
        bt
    } else {
        bt.contiguous()?
    };
    rowwise_into(&a.view::<T>()?, &bt.view::<T>()?, out, threads);
    Ok(())
}

/// `b` (`[B.., K, N]`) with its last two dims swapped: a view.
fn transposed(b: &Val) -> KResult<Val> {
    let r = b.shape().len();
    let mut swap: Vec<usize> = (0..r - 2).collect();
    swap.extend([r - 1, r - 2]);
    crate::kernels::movement::permute(b, &swap)
}

/// Whether `a · b` takes the row-wise kernel without being asked: f32, bf16 or f16
/// products of one row per batch (one-token decode) whose `b` has K contiguous, as a
/// `linear` weight read transposed does (the same test as the compile's, which then packs
/// no copy: `compile::single_row`). A GEMM would pack such a `b` on
/// every call (or hold a packed copy as large as the weight; for half types, convert it
/// whole); streaming its rows once is all the product needs.
pub fn takes_rowwise(a: &Val, b: &Val) -> bool {
    if a.dtype != b.dtype || !matches!(a.dtype, DType::F32 | DType::BF16 | DType::F16) {
        return false;
    }
    let r = a.shape().len();
    r >= 2 && b.shape().len() == r && a.shape()[r - 2] == 1 && b.layout.strides[r - 2] == 1
}

/// `out = a · bᵀ` (contiguous `[B.., M, N]`) for `a` `[B.., M, K]` and `bt` `[B.., N, K]`,
/// `bt` with K contiguous (or K ≤ 1): runs of outputs in one row are `rows_dot` calls.
/// Rows of `a` other than contiguous f32 are gathered into f32 once, outputs rounded once.
fn rowwise_into<T: RowWeight>(va: &View<T>, vbt: &View<T>, out: &mut [T], threads: usize) {
    let r = va.shape.len() - 2;
    let (m, k, n) = (va.shape[r], va.shape[r + 1], vbt.shape[r]);
    if out.is_empty() {
        return;
    }
    if k == 0 {
        out.fill(T::from_f32(0.0));
        return;
    }
    let offs = batch_offsets(&va.shape[..r], [&va.strides, &vbt.strides]);
    let ars = va.strides[r];
    let (row_start, acs) = (
        |row: usize| offs[row / m][0] + (row % m) as isize * ars,
        va.strides[r + 1],
    );
    // Every row of `a` back to back, rows being few in this one-row shape: bf16 kept bf16
    // against bf16 rows where `vdpbf16ps` takes them, else in f32 unless `a` is f32 with K
    // contiguous (read in place).
    let bf16_pairs = crate::elem::as_bf16::<T>(&[]).is_some() && bf16_pairs_available();
    let in_place = acs == 1 && crate::elem::as_f32::<T>(&[]).is_some();
    let all_rows = || {
        (0..offs.len() * m)
            .flat_map(|row| (0..k as isize).map(move |p| va.at(row_start(row) + p * acs).to_f32()))
    };
    let gathered_bf16: Vec<bf16> = match bf16_pairs {
        // Exact: the values were bf16.
        true => all_rows().map(bf16::from_f32).collect(),
        false => Vec::new(),
    };
    let gathered: Vec<f32> = match in_place || bf16_pairs {
        true => Vec::new(),
        false => all_rows().collect(),
    };
    let x_row = |row: usize| -> &[f32] {
        match in_place {
            true => crate::elem::as_f32(va.run(row_start(row), k)).unwrap_or(&[]),
            false => &gathered[row * k..(row + 1) * k],
        }
    };
    let dot_rows =
        |row: usize, w: &[T], stride: usize, dst: &mut [f32]| match crate::elem::as_bf16(w)
            .filter(|_| bf16_pairs)
        {
            Some(w) => rows_dot_bf16(&gathered_bf16[row * k..(row + 1) * k], w, stride, dst),
            None => rows_dot(x_row(row), w, stride, dst),
        };
    let brs = vbt.strides[r];
    // Outputs `start..` of a task: runs of one output row each (at most a chunk), the
    // weight rows they read `brs` apart (one by one if the stride is negative).
    let one = |start: usize, o: &mut [T]| {
        let mut sums = [0.0f32; ROWWISE_CHUNK];
        let mut done = 0;
        while done < o.len() {
            let flat = start + done;
            let (row, j) = (flat / n, flat % n);
            let count = (n - j).min(o.len() - done).min(ROWWISE_CHUNK);
            let ob = offs[row / m][1];
            let dst = &mut sums[..count];
            match usize::try_from(brs) {
                Ok(stride) => {
                    let w = vbt.run(ob + j as isize * brs, (count - 1) * stride + k);
                    dot_rows(row, w, stride, dst);
                }
                Err(_) => {
                    for (t, d) in dst.iter_mut().enumerate() {
                        let w = vbt.run(ob + (j + t) as isize * brs, k);
                        dot_rows(row, w, 0, std::slice::from_mut(d));
                    }
                }
            }
            for (o, &v) in o[done..done + count].iter_mut().zip(dst.iter()) {
                *o = T::from_f32(v);
            }
            done += count;
        }
    };
    if threads > 1 && out.len() * k >= ROWWISE_PAR_MIN {
        par::for_chunks_mut(out, ROWWISE_CHUNK, one);
    } else {
        one(0, out);
    }
}

/// `out[j] = x · w[j]` for rows `row_stride` apart (`rows_dot`), on every thread when the
/// weight is large enough, as the row-wise product runs it.
pub fn rows_dot_parallel(x: &[f32], w: &[f32], row_stride: usize, out: &mut [f32], threads: usize) {
    if threads > 1 && out.len() * x.len() >= ROWWISE_PAR_MIN {
        par::for_chunks_mut(out, ROWWISE_CHUNK, |start, o| {
            rows_dot(x, &w[start * row_stride..], row_stride, o)
        });
    } else {
        rows_dot(x, w, row_stride, out);
    }
}
