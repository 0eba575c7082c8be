//! f32 matrix products on AVX2 + FMA (and AVX-512 where the CPU has it): Ember's own GEMM
//! for the shapes of inference.
//!
//! The right operand is packed into panels (the BLIS scheme) of `NR` columns (`NR` values
//! per step of k), zero-padded at the edges; a `b` not packed already is packed panel by
//! panel inside each task, into a buffer that stays in L1. A left operand whose rows have
//! unit stride (activations, as a rule) is read in place, as MLAS does: the tile broadcasts
//! from `MR` row pointers. Packing it into `MR`-row panels first (k-major) was a serial pass
//! the other threads waited on (two threads ran a 64×256·256×256 product slower than one);
//! other left operands (weights packed at compile time, transposed views) are packed. A
//! 6×16 register tile (12 accumulators of 8 lanes) then multiplies `MR` rows of `a` by one
//! `b` panel with two vector loads, six broadcasts and twelve FMAs per step of k. Loops are
//! blocked so a `b` panel slice (`KC`×16) stays in L1 and an `a` block (`MC`×`KC`) in L2.
//! On AVX-512 CPUs tiles of three rows or more span two panels at once (6×32: twelve
//! 16-lane accumulators), the same FMAs in the same order — about twice the arithmetic per
//! cycle, as ONNX Runtime's MLAS gets there (`EMBER_CPU_AVX512=0` keeps the AVX2 tile).
//!
//! A bf16 or f16 weight is packed in its own type (`Packed::b_half`; or per task, read in
//! place: `Operand::Bf16`/`F16`) and the tiles widen each panel row as they load it (exact),
//! so a 16-bit model's products run this same f32
//! arithmetic while its packed weights take the weights' bytes, not twice them. The
//! conversion costs the compute-bound tiles ~10–20 % (it shares the FMA ports); products of
//! a few rows, bound by reading the weight, run faster for the halved bytes. Where the CPU
//! has AMX, bf16 weights are packed as AMX tiles instead (`Packed::b_bf16`, `bf16_kernel`)
//! and their products run in `amx_bf16`, 3–5× faster than these tiles; on AMD CPUs with
//! AVX512-BF16 they are packed as `vdpbf16ps` pair panels for `bf16_pairs`,
//! 2.2–2.6× faster there (on Intel Xeons such tiles ran 1.45× slower than these).
//!
//! A weight operand is packed once at compile time (`Packed::a` / `Packed::b`), so a call
//! packs at most its activations (none when their rows are contiguous): for the skinny
//! products of inference (few rows, wide weights) packing the weight per call costs as much
//! as the product. Products of one row (decode) with a `linear` weight skip this module:
//! `rowdot` streams the weight's rows as stored, faster than these panels and with no
//! packed copy. Measured against the `gemm` crate on the benchmark shapes
//! (`cargo run -p ember-cpu --release --example gemm_bench`).
//! Work is split into (row block × column group) tasks through `par.rs`, so it runs on the
//! caller's thread with the pool helping, never behind a thread hand-off.
//!
//! The result differs from a plain loop only by rounding: every output is a sequence of FMAs
//! over k in order (blocks of `KC` added in order); tiles of one or two rows accumulate even
//! and odd steps of k separately and add the two at the end.

use std::cell::RefCell;

use half::{bf16, f16};

#[cfg(target_arch = "x86_64")]
use super::bf16_kernel::{Bf16Kernel, Bf16Packed};
use super::rowdot::RowWeight;
use crate::par::{self, SendPtr};

/// Rows of the register tile.
pub const MR: usize = 6;
/// Columns of the register tile (two AVX vectors).
pub const NR: usize = 16;
/// Steps of k per block: a `b` panel slice of KC×NR floats (16 KiB) fits L1.
const KC: usize = 256;
/// Rows per block: an `a` block of MC×KC floats (96 KiB) fits L2.
const MC: usize = 96;
/// Multiply-adds below which a product runs on one thread: waking a helper costs ≈ 10–20 µs
/// on our VMs, about 1M multiply-adds.
const PAR_MIN_WORK: usize = 1 << 21;
/// Right-operand elements from which even a product of one row runs on every thread: a
/// matrix-vector product (one-token decode) is bound by streaming its weight from L3, which
/// two cores do nearly twice as fast, and 128 KiB takes longer than a pool thread takes to
/// join. Measured on the decode benchmark, alternating in one process: 1.35 → 1.01 ms.
const PAR_MIN_STREAM: usize = 1 << 15;

/// Whether this CPU runs the kernel: AVX2, FMA and F16C, which the AVX2 tile is compiled
/// with for its f16 panels (every AVX2 CPU made has it; checked all the same).
/// `EMBER_CPU_SIMD=0` turns it off.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::simd::fma_available() && <f32 as RowWeight>::loads_available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// A strided matrix (of f32 unless said): element (i, j) at `ptr + i·rs + j·cs`.
pub struct Strided<T = f32> {
    pub ptr: *const T,
    pub rs: isize,
    pub cs: isize,
}

impl<T> Clone for Strided<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Strided<T> {}

// SAFETY: a `Strided` only reads, and `sgemm`'s contract keeps its memory alive and unwritten
// for the call.
unsafe impl<T> Send for Strided<T> {}
unsafe impl<T> Sync for Strided<T> {}

impl<T> Strided<T> {
    /// Where element (i, j) lies (a method, so closures capture the whole `Sync` struct).
    fn at(&self, i: usize, j: usize) -> *const T {
        self.ptr
            .wrapping_offset(i as isize * self.rs + j as isize * self.cs)
    }
}

/// An operand packed into panels (of `MR` rows for a left operand, `NR` columns for a
/// right one). Clones share the panels: products of one weight read one copy (an unrolled
/// recurrent layer's steps, whose copies each would stream the weight from memory).
#[derive(Clone)]
pub struct Packed {
    /// Rows and columns of the matrix it holds.
    pub rows: usize,
    pub cols: usize,
    /// Whether it is a left (`a`) operand: panels of rows; else panels of columns.
    left: bool,
    data: std::sync::Arc<PanelData>,
}

/// Packed values, in the type they were packed from: a bf16 or f16 right operand keeps its
/// 16 bits (the tiles widen each step's panel row as they load it, exactly), so a
/// half-precision model's packed weights take as many bytes as the weights, not twice.
pub enum PanelData {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
    /// A bf16 right operand packed for a kernel of its own (`bf16_kernel`: AMX tiles or
    /// `vdpbf16ps` pair panels), not this module's panels.
    #[cfg(target_arch = "x86_64")]
    Bf16Kernel(Bf16Packed),
}

impl PanelData {
    fn slice(&self) -> PanelSlice<'_> {
        match self {
            PanelData::F32(v) => PanelSlice::new(ElemKind::F32, v),
            PanelData::Bf16(v) => PanelSlice::new(ElemKind::Bf16, v),
            PanelData::F16(v) => PanelSlice::new(ElemKind::F16, v),
            #[cfg(target_arch = "x86_64")]
            PanelData::Bf16Kernel(_) => panic!("a bf16 kernel's packing is its operand only"),
        }
    }

    fn f32(&self) -> &[f32] {
        match self {
            PanelData::F32(v) => v,
            _ => panic!("16-bit panels are right operands of `sgemm` only"),
        }
    }
}

/// The element types a right operand's panels may hold (`Packed::b_half`, `Operand::Bf16`
/// and `Operand::F16`).
pub trait PanelElem: RowWeight + Default {
    #[doc(hidden)]
    fn wrap(data: Vec<Self>) -> PanelData;
    /// `src` as a right operand read in place.
    fn in_place(src: Strided<Self>) -> Operand<'static>;
}

impl PanelElem for bf16 {
    fn wrap(data: Vec<bf16>) -> PanelData {
        PanelData::Bf16(data)
    }

    fn in_place(src: Strided<bf16>) -> Operand<'static> {
        Operand::Bf16(src)
    }
}

impl PanelElem for f16 {
    fn wrap(data: Vec<f16>) -> PanelData {
        PanelData::F16(data)
    }

    fn in_place(src: Strided<f16>) -> Operand<'static> {
        Operand::F16(src)
    }
}

impl Packed {
    /// `src` (`rows`×`cols`) packed as the left operand of a product.
    ///
    /// # Safety
    /// `src` must address `rows`×`cols` readable elements.
    pub unsafe fn a(rows: usize, cols: usize, src: Strided) -> Packed {
        let mut data = vec![0.0; rows.div_ceil(MR) * MR * cols];
        // SAFETY: by the contract; `data` has room for every panel.
        unsafe { pack_a(&mut data, rows, cols, src, par::threads()) };
        Packed {
            rows,
            cols,
            left: true,
            data: std::sync::Arc::new(PanelData::F32(data)),
        }
    }

    /// `src` (`rows`×`cols`) packed as the right operand of a product.
    ///
    /// # Safety
    /// `src` must address `rows`×`cols` readable elements.
    pub unsafe fn b(rows: usize, cols: usize, src: Strided) -> Packed {
        let mut data = vec![0.0; panels_len(rows, cols)];
        // SAFETY: by the contract; `data` has room for every panel.
        unsafe { pack_b(&mut data, rows, cols, src, par::threads()) };
        Packed {
            rows,
            cols,
            left: false,
            data: std::sync::Arc::new(PanelData::F32(data)),
        }
    }

    /// `src` (`rows`×`cols` of bf16 or f16) packed as the right operand of a product, in its
    /// own type.
    ///
    /// # Safety
    /// `src` must address `rows`×`cols` readable elements.
    pub unsafe fn b_half<T: PanelElem>(rows: usize, cols: usize, src: Strided<T>) -> Packed {
        let mut data = vec![T::default(); panels_len(rows, cols)];
        // SAFETY: by the contract; `data` has room for every panel.
        unsafe { pack_b(&mut data, rows, cols, src, par::threads()) };
        Packed {
            rows,
            cols,
            left: false,
            data: std::sync::Arc::new(T::wrap(data)),
        }
    }

    /// `src` (`rows`×`cols` of bf16) packed as the right operand of products: for this
    /// CPU's bf16 kernel of its own (`Bf16Kernel::of_this_cpu`), else as `b_half` panels.
    ///
    /// # Safety
    /// `src` must address `rows`×`cols` readable elements.
    pub unsafe fn b_bf16(rows: usize, cols: usize, src: Strided<bf16>) -> Packed {
        #[cfg(target_arch = "x86_64")]
        if let Some(kernel) = Bf16Kernel::of_this_cpu() {
            return Packed {
                rows,
                cols,
                left: false,
                // SAFETY: by the contract.
                data: std::sync::Arc::new(PanelData::Bf16Kernel(unsafe {
                    kernel.pack(rows, cols, src)
                })),
            };
        }
        // SAFETY: by the contract.
        unsafe { Packed::b_half(rows, cols, src) }
    }

    /// Bytes `b_bf16` packs a `rows`×`cols` operand into.
    pub fn b_bf16_bytes(rows: usize, cols: usize) -> usize {
        #[cfg(target_arch = "x86_64")]
        if let Some(kernel) = Bf16Kernel::of_this_cpu() {
            return kernel.packed_bytes(rows, cols);
        }
        panels_len(rows, cols) * std::mem::size_of::<bf16>()
    }

    /// Its values, where it was packed for a bf16 kernel of its own (`b_bf16`) rather than
    /// for this module's tiles.
    #[cfg(target_arch = "x86_64")]
    pub fn bf16_packing(&self) -> Option<&Bf16Packed> {
        match &*self.data {
            PanelData::Bf16Kernel(packed) => Some(packed),
            _ => None,
        }
    }

    /// Whether it was packed for a bf16 kernel of its own, whose products only
    /// `dot::dot_half_packed` runs.
    pub fn for_bf16_kernel(&self) -> bool {
        #[cfg(target_arch = "x86_64")]
        let own = self.bf16_packing().is_some();
        #[cfg(not(target_arch = "x86_64"))]
        let own = false;
        own
    }

    /// Whether both hold the same panels (one copy, shared).
    #[cfg(test)]
    pub fn shares_panels_with(&self, other: &Packed) -> bool {
        std::sync::Arc::ptr_eq(&self.data, &other.data)
    }

    pub fn is_left(&self) -> bool {
        self.left
    }

    /// Bytes its panels take.
    pub fn bytes(&self) -> usize {
        #[cfg(target_arch = "x86_64")]
        if let Some(packed) = self.bf16_packing() {
            return packed.bytes();
        }
        let panels = self.data.slice();
        panels.len * panels.kind.size()
    }

    /// Panel `q` of an f32 right operand: `rows` steps of `NR` values (columns `q·NR..`,
    /// zero past the last column).
    pub fn right_panel(&self, q: usize) -> &[f32] {
        assert!(!self.left, "a left operand has no column panels");
        &self.data.f32()[q * NR * self.rows..(q + 1) * NR * self.rows]
    }

    /// Panel `p` of a left operand: `cols` steps of `MR` values (rows `p·MR..`, zero past
    /// the last row).
    pub fn left_panel(&self, p: usize) -> &[f32] {
        assert!(self.left, "a right operand has no row panels");
        &self.data.f32()[p * MR * self.cols..(p + 1) * MR * self.cols]
    }
}

/// An operand of `sgemm`: strided (packed per call) or packed already.
#[derive(Clone, Copy)]
pub enum Operand<'a> {
    Strided(Strided),
    /// A bf16 or f16 right operand read in place: each task packs the panels it reaches in
    /// their own type, as `Packed::b_half` would, and the tiles widen them (a 16-bit
    /// product of activations, or a weight not packed at compile time, needs no f32 copy).
    Bf16(Strided<bf16>),
    F16(Strided<f16>),
    Packed(&'a Packed),
    /// A right operand a kernel wrote straight into panel layout (`panels_len`,
    /// `write_panel_row`): im2col, which would otherwise write a column matrix only for
    /// `sgemm` to read it back into panels.
    PanelsB(&'a [f32]),
}

/// Floats a `k`×`n` right operand takes in panel layout.
pub fn panels_len(k: usize, n: usize) -> usize {
    n.div_ceil(NR) * NR * k
}

/// Packs `src` (`k`×`cols`) into `dst` as a right operand in panel layout (for
/// `Operand::PanelsB`), on this thread. The panels of its first `n` columns are a prefix of
/// `dst`: `dst[..panels_len(k, n)]` is the right operand of its first `n` columns.
///
/// # Safety
/// `src` must address `k`×`cols` readable elements; `dst` must hold `panels_len(k, cols)`.
pub unsafe fn pack_right(dst: &mut [f32], k: usize, cols: usize, src: Strided) {
    // SAFETY: by the contract.
    unsafe { pack_b(dst, k, cols, src, 1) }
}

/// Writes `row` (row `r` of a `k`×`row.len()` right operand) into `panels`, zero past its
/// last column.
///
/// # Safety
/// `panels` must address `panels_len(k, row.len())` writable floats and `r < k`; threads may
/// write different rows at once.
pub unsafe fn write_panel_row(panels: *mut f32, k: usize, r: usize, row: &[f32]) {
    let n = row.len();
    for q in 0..n.div_ceil(NR) {
        let c0 = q * NR;
        // SAFETY: panel q holds k×NR floats at q·NR·k; row r's slot is NR floats inside it.
        unsafe {
            let dst = panels.add(q * NR * k + r * NR);
            if c0 + NR <= n {
                let src = row.as_ptr().add(c0) as *const [f32; NR];
                (dst as *mut [f32; NR]).write_unaligned(src.read_unaligned());
            } else {
                let live = n - c0;
                std::ptr::copy_nonoverlapping(row.as_ptr().add(c0), dst, live);
                std::ptr::write_bytes(dst.add(live), 0, NR - live);
            }
        }
    }
}

/// Copies `n` panels' worth of work to threads (or runs them here for small work).
fn split(n: usize, threads: usize, work: usize, body: impl Fn(usize) + Sync) {
    if threads > 1 && work >= PAR_MIN_WORK {
        par::for_each(n, body);
    } else {
        (0..n).for_each(body);
    }
}

/// Packs `src` (`rows`×`k`) into `dst` as panels of `MR` rows, each `k`×`MR` (k-major).
///
/// # Safety
/// `src` must address `rows`×`k` readable elements; `dst` holds ⌈rows/MR⌉·MR·k floats.
unsafe fn pack_a(dst: &mut [f32], rows: usize, k: usize, src: Strided, threads: usize) {
    let panels = rows.div_ceil(MR);
    assert!(dst.len() >= panels * MR * k);
    let base = SendPtr(dst.as_mut_ptr());
    let base = &base;
    split(panels, threads, rows * k, |i| {
        // SAFETY: panel i owns dst[i·MR·k..(i+1)·MR·k]; reads by the contract.
        unsafe {
            let out = base.0.add(i * MR * k);
            let r0 = i * MR;
            let live = MR.min(rows - r0);
            for r in 0..MR {
                if r >= live {
                    for p in 0..k {
                        *out.add(p * MR + r) = 0.0;
                    }
                } else if src.cs == 1 {
                    // Rows of a row-major matrix: a contiguous read per row (computing each
                    // element's address made this pack ~15 % of a narrow product's time).
                    let row = std::slice::from_raw_parts(src.at(r0 + r, 0), k);
                    for (p, &v) in row.iter().enumerate() {
                        *out.add(p * MR + r) = v;
                    }
                } else {
                    for p in 0..k {
                        *out.add(p * MR + r) = *src.at(r0 + r, p);
                    }
                }
            }
        }
    });
}

/// Packs `src` (`k`×`cols`) into `dst` as panels of `NR` columns, each `k`×`NR`.
///
/// # Safety
/// `src` must address `k`×`cols` readable elements; `dst` holds ⌈cols/NR⌉·NR·k values.
unsafe fn pack_b<T: Copy + Default>(
    dst: &mut [T],
    k: usize,
    cols: usize,
    src: Strided<T>,
    threads: usize,
) {
    let panels = cols.div_ceil(NR);
    assert!(dst.len() >= panels * NR * k);
    let base = SendPtr(dst.as_mut_ptr());
    let base = &base;
    split(panels, threads, cols * k, |j| {
        // SAFETY: panel j owns dst[j·NR·k..(j+1)·NR·k]; reads by the contract.
        unsafe { pack_b_panel(base.0.add(j * NR * k), src, 0, k, j * NR, cols) };
    });
}

/// Packs rows `k0..k0 + kc` of columns `c0..c0 + NR` of `src` (`cols` columns in all; those
/// past it read as zero) into `out` (`kc`×`NR`).
///
/// # Safety
/// `src` must address rows `k0..k0 + kc` of `cols` columns; `out` holds kc·NR values.
unsafe fn pack_b_panel<T: Copy + Default>(
    out: *mut T,
    src: Strided<T>,
    k0: usize,
    kc: usize,
    c0: usize,
    cols: usize,
) {
    let live = NR.min(cols - c0);
    // SAFETY (whole body): reads inside the rows and live columns; writes inside `out`.
    unsafe {
        if src.cs == 1 && live == NR {
            // A fixed-size copy compiles to vector moves (a `copy_nonoverlapping` of a
            // run-time length is a `memmove` call per row).
            for p in 0..kc {
                let row = src.at(k0 + p, c0) as *const [T; NR];
                (out.add(p * NR) as *mut [T; NR]).write_unaligned(row.read_unaligned());
            }
        } else if src.cs == 1 {
            for p in 0..kc {
                let o = out.add(p * NR);
                std::ptr::copy_nonoverlapping(src.at(k0 + p, c0), o, live);
                for c in live..NR {
                    *o.add(c) = T::default();
                }
            }
        } else {
            // A transposed weight (`rs` = 1) is read down its columns; `STEPS` rows at a
            // time, so the panel lines being written stay in L1 across the `NR` columns.
            const STEPS: usize = 128;
            for p0 in (0..kc).step_by(STEPS) {
                let p1 = (p0 + STEPS).min(kc);
                for c in 0..NR {
                    for p in p0..p1 {
                        *out.add(p * NR + c) = match c < live {
                            true => *src.at(k0 + p, c0 + c),
                            false => T::default(),
                        };
                    }
                }
            }
        }
    }
}

thread_local! {
    /// Per-thread scratch for packed activations, reused across calls (a fresh allocation
    /// of this size would be page-faulted in on every call).
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `c[m×n] (row stride ldc, unit column stride) = a[m×k] · b[k×n]`, every element written.
///
/// # Safety
/// `available()` must be true; strided operands must address `m×k` / `k×n` readable
/// elements; packed ones must have those shapes (and sides); `c` must address `m` rows of
/// `n` writable elements at stride `ldc`, overlapping neither operand.
pub unsafe fn sgemm(
    (m, n, k): (usize, usize, usize),
    a: Operand,
    b: Operand,
    c: *mut f32,
    ldc: usize,
    threads: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        for i in 0..m {
            // SAFETY: row i of c by the contract.
            unsafe { std::slice::from_raw_parts_mut(c.add(i * ldc), n).fill(0.0) };
        }
        return;
    }
    let threads = if m * n * k >= PAR_MIN_WORK || n * k >= PAR_MIN_STREAM {
        threads
    } else {
        1
    };
    let b = match b {
        Operand::Packed(p) => Panels::Packed(p.data.slice()),
        Operand::PanelsB(p) => Panels::Packed(PanelSlice::new(ElemKind::F32, p)),
        Operand::Strided(s) => Panels::Strided(AnyStrided::of(ElemKind::F32, s)),
        Operand::Bf16(s) => Panels::Strided(AnyStrided::of(ElemKind::Bf16, s)),
        Operand::F16(s) => Panels::Strided(AnyStrided::of(ElemKind::F16, s)),
    };
    match a {
        // SAFETY: the packed operands have the shapes of the contract; c by the contract.
        Operand::Packed(pa) => unsafe {
            multiply((m, n, k), Left::Packed(pa.data.f32()), b, c, ldc, threads)
        },
        Operand::PanelsB(_) | Operand::Bf16(_) | Operand::F16(_) => {
            panic!("panel-layout and 16-bit operands are right operands")
        }
        // Rows with unit stride: the tiles broadcast straight from them, as MLAS does;
        // packing them cost a serial pass that the other threads waited on.
        // SAFETY: sa addresses m×k elements; c by the contract.
        Operand::Strided(sa) if sa.cs == 1 || k == 1 => unsafe {
            multiply((m, n, k), Left::Rows(sa), b, c, ldc, threads)
        },
        Operand::Strided(sa) => SCRATCH.with(|s| {
            let mut fresh = Vec::new();
            // Re-entered on this thread (a kernel calling a GEMM per task): a fresh buffer.
            let mut held = s.try_borrow_mut();
            let buf = match held.as_mut() {
                Ok(b) => &mut **b,
                Err(_) => &mut fresh,
            };
            // `pack_a` writes every element (padding rows too): grow, never re-zero.
            let need = m.div_ceil(MR) * MR * k;
            if buf.len() < need {
                buf.resize(need, 0.0);
            }
            let buf = &mut buf[..need];
            // SAFETY: sa addresses m×k elements; c by the contract.
            unsafe {
                pack_a(buf, m, k, sa, threads);
                multiply((m, n, k), Left::Packed(buf), b, c, ldc, threads)
            }
        }),
    }
}

/// The right operand: panels packed already, or a matrix whose panels each task packs as
/// it reaches them (into a buffer that stays in L1), so the packing costs no extra pass over
/// memory.
#[derive(Clone, Copy)]
enum Panels<'a> {
    Packed(PanelSlice<'a>),
    Strided(AnyStrided),
}

/// A strided matrix of any `ElemKind` (strides in elements).
#[derive(Clone, Copy)]
struct AnyStrided {
    kind: ElemKind,
    ptr: *const u8,
    rs: isize,
    cs: isize,
}

// SAFETY: as `Strided`: read only, kept alive and unwritten by `sgemm`'s contract.
unsafe impl Send for AnyStrided {}
unsafe impl Sync for AnyStrided {}

impl AnyStrided {
    fn of<T>(kind: ElemKind, s: Strided<T>) -> Self {
        debug_assert_eq!(std::mem::size_of::<T>(), kind.size());
        AnyStrided {
            kind,
            ptr: s.ptr.cast(),
            rs: s.rs,
            cs: s.cs,
        }
    }

    /// The matrix as `T`s (`T` of its kind's size).
    fn typed<T>(&self) -> Strided<T> {
        Strided {
            ptr: self.ptr.cast(),
            rs: self.rs,
            cs: self.cs,
        }
    }

    /// Packs rows `kb..kb + kc` of the panel of columns `c0..` (`n` in all) into `dst`
    /// (room for kc·NR values of its kind), in its own type.
    ///
    /// # Safety
    /// As `pack_b_panel`.
    unsafe fn pack_panel(&self, dst: *mut u8, kb: usize, kc: usize, c0: usize, n: usize) {
        // SAFETY: by the contract.
        unsafe {
            match self.kind {
                ElemKind::F32 => pack_b_panel(dst.cast::<f32>(), self.typed(), kb, kc, c0, n),
                ElemKind::Bf16 => pack_b_panel(dst.cast::<bf16>(), self.typed(), kb, kc, c0, n),
                ElemKind::F16 => pack_b_panel(dst.cast::<f16>(), self.typed(), kb, kc, c0, n),
            }
        }
    }
}

/// The element type of a right operand's panels.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum ElemKind {
    F32,
    Bf16,
    F16,
}

/// Panels of any `ElemKind`: a slice without its type, so one `multiply` serves them all
/// and only the register tiles are compiled per type.
#[derive(Clone, Copy)]
struct PanelSlice<'a> {
    kind: ElemKind,
    ptr: *const u8,
    len: usize,
    _slice: std::marker::PhantomData<&'a [u8]>,
}

// SAFETY: a shared slice of plain values (f32, bf16 or f16), read only.
unsafe impl Send for PanelSlice<'_> {}
unsafe impl Sync for PanelSlice<'_> {}

impl<'a> PanelSlice<'a> {
    fn new<T>(kind: ElemKind, values: &'a [T]) -> Self {
        debug_assert_eq!(std::mem::size_of::<T>(), kind.size());
        PanelSlice {
            kind,
            ptr: values.as_ptr().cast(),
            len: values.len(),
            _slice: std::marker::PhantomData,
        }
    }

    /// Where its element `i` lies.
    fn at(&self, i: usize) -> PanelPtr {
        assert!(i < self.len, "panel element {i} of {}", self.len);
        PanelPtr {
            kind: self.kind,
            ptr: self.ptr.wrapping_add(i * self.kind.size()),
        }
    }
}

impl ElemKind {
    fn size(self) -> usize {
        match self {
            ElemKind::F32 => 4,
            ElemKind::Bf16 | ElemKind::F16 => 2,
        }
    }
}

/// Where a tile's panel slice starts, and the type of its values.
#[derive(Clone, Copy)]
struct PanelPtr {
    kind: ElemKind,
    ptr: *const u8,
}

impl PanelPtr {
    const NONE: PanelPtr = PanelPtr {
        kind: ElemKind::F32,
        ptr: std::ptr::null(),
    };
}

/// The left operand: panels packed already, or rows read in place (unit column stride,
/// or one column).
#[derive(Clone, Copy)]
enum Left<'a> {
    Packed(&'a [f32]),
    Rows(Strided),
}

impl Left<'_> {
    /// Where the tile of rows from `row0` (a multiple of `MR` when packed) starts at step
    /// `kb` of k, and the row stride the tile reads it with (`None`: packed, `MR` values
    /// per step).
    fn tile_start(&self, row0: usize, kb: usize, k: usize) -> (*const f32, Option<isize>) {
        match self {
            Left::Packed(pa) => (pa[row0 * k + kb * MR..].as_ptr(), None),
            Left::Rows(s) => (s.at(row0, kb), Some(s.rs)),
        }
    }
}

/// The register tiles (first row, rows) of rows `lo..hi`: `MR` rows each, except that
/// where the left operand is read in place and the AVX-512 tile runs, a last tile of one
/// or two rows (which would run the narrow tile) shares rows with the one before: 32 rows
/// as 6·4 + 4 + 4, not 6·5 + 2.
fn row_tiles(
    pa: &Left,
    (lo, hi): (usize, usize),
    wide: bool,
) -> impl Iterator<Item = (usize, usize)> {
    let n = hi - lo;
    let rest = n % MR;
    let merge = wide && matches!(pa, Left::Rows(_)) && n > MR && rest > 0 && rest < WIDE_MIN_ROWS;
    let full = if merge { n / MR - 1 } else { n.div_ceil(MR) };
    let tail = if merge {
        // The last MR + rest rows as two tiles of at least WIDE_MIN_ROWS.
        let first = (MR + rest).div_ceil(2);
        vec![
            (lo + full * MR, first),
            (lo + full * MR + first, MR + rest - first),
        ]
    } else {
        Vec::new()
    };
    (0..full)
        .map(move |t| (lo + t * MR, MR.min(hi - lo - t * MR)))
        .chain(tail)
}

/// The blocked product into `c`.
///
/// # Safety
/// A packed `pa` holds ⌈m/MR⌉ panels of k×MR, rows address m×k elements (unit column
/// stride unless k = 1); packed `pb` ⌈n/NR⌉ panels of k×NR, a strided one addresses k×n
/// elements; `c` as in `sgemm`.
unsafe fn multiply(
    (m, n, k): (usize, usize, usize),
    pa: Left,
    pb: Panels,
    c: *mut f32,
    ldc: usize,
    threads: usize,
) {
    let (a_panels, b_panels) = (m.div_ceil(MR), n.div_ceil(NR));
    if let Left::Packed(pa) = pa {
        assert!(pa.len() >= a_panels * MR * k);
    }
    if let Panels::Packed(pb) = pb {
        assert!(pb.len >= b_panels * NR * k);
    }
    let row_blocks = m.div_ceil(MC);
    let wide = crate::simd::avx512_available();
    // Column groups: enough tasks for every thread to get several, each at least one panel
    // (an even number for the AVX-512 tile, which takes panels in pairs).
    let want = (threads * 4).div_ceil(row_blocks).max(1);
    let mut per_group = b_panels.div_ceil(want).max(1);
    if wide && per_group > 1 {
        per_group = per_group.next_multiple_of(2);
    }
    let groups = b_panels.div_ceil(per_group);
    let c = SendPtr(c);
    let c = &c;
    split(row_blocks * groups, threads, usize::MAX, |t| {
        let (rb, g) = (t / groups, t % groups);
        let (p0, p1) = (rb * MC / MR, ((rb + 1) * MC / MR).min(a_panels));
        let (q0, q1) = (g * per_group, ((g + 1) * per_group).min(b_panels));
        // Written by `pack_b_panel` before each read (two panels: the AVX-512 tile spans
        // a pair); left uninitialized because packed weights never use it, and zeroing it
        // per task cost a matrix-vector product as much as reading its slice of the weight.
        let mut panels = std::mem::MaybeUninit::<[f32; 2 * KC * NR]>::uninit();
        let mut kb = 0;
        while kb < k {
            let kc = KC.min(k - kb);
            let mut q = q0;
            while q < q1 {
                // The AVX-512 tile takes two panels at once (32 columns: twelve 16-lane
                // accumulators for six rows).
                let pair = wide && q + 1 < q1;
                let cols = (if pair { 2 * NR } else { NR }).min(n - q * NR);
                let mut bp = [PanelPtr::NONE; 2];
                for (h, bp) in bp.iter_mut().enumerate().take(1 + pair as usize) {
                    *bp = match pb {
                        Panels::Packed(pb) => pb.at((q + h) * NR * k + kb * NR),
                        Panels::Strided(s) => {
                            // SAFETY: s addresses k×n elements; the buffer holds two panels
                            // of KC·NR floats (room for as many 16-bit values).
                            unsafe {
                                let dst = panels.as_mut_ptr().cast::<f32>().add(h * KC * NR);
                                s.pack_panel(dst.cast(), kb, kc, (q + h) * NR, n);
                                PanelPtr {
                                    kind: s.kind,
                                    ptr: dst.cast(),
                                }
                            }
                        }
                    };
                }
                for (row0, rows) in row_tiles(&pa, (p0 * MR, (p1 * MR).min(m)), wide) {
                    let a = pa.tile_start(row0, kb, k);
                    // SAFETY: the tile (rows row0.., q..) lies inside c; tasks own disjoint
                    // tiles; the panel slices (or rows) hold kc steps; `wide` only where
                    // AVX-512F is present.
                    unsafe {
                        let ct = c.0.add(row0 * ldc + q * NR);
                        let shape = (rows, cols, kc, wide);
                        match bp[0].kind {
                            ElemKind::F32 => tiles::<f32>(shape, a, bp, ct, ldc, kb > 0),
                            ElemKind::Bf16 => tiles::<bf16>(shape, a, bp, ct, ldc, kb > 0),
                            ElemKind::F16 => tiles::<f16>(shape, a, bp, ct, ldc, kb > 0),
                        }
                    }
                }
                q += 1 + pair as usize;
            }
            kb += kc;
        }
    });
}

/// The register tile(s) over one panel, or two adjacent ones (`cols > NR`), of `E` values:
/// one AVX-512 tile over both, or an AVX2 tile per panel.
///
/// # Safety
/// As `multiply`; `rows ≤ MR`, `cols ≤ 2·NR`; `bp` hold `E` values (`bp[1]` when
/// `cols > NR`); `wide` only where AVX-512F is present.
#[inline]
unsafe fn tiles<E: RowWeight>(
    (rows, cols, kc, wide): (usize, usize, usize, bool),
    a: (*const f32, Option<isize>),
    bp: [PanelPtr; 2],
    c: *mut f32,
    ldc: usize,
    add: bool,
) {
    let bp = bp.map(|p| p.ptr.cast::<E>());
    // SAFETY: by the contract.
    unsafe {
        if wide && rows >= WIDE_MIN_ROWS {
            wide_tile(rows, cols, kc, a, bp, c, ldc, add);
        } else {
            tile(rows, cols.min(NR), kc, a, bp[0], c, ldc, add);
            if cols > NR {
                tile(rows, cols - NR, kc, a, bp[1], c.add(NR), ldc, add);
            }
        }
    }
}

/// Rows from which a tile runs on AVX-512 where the CPU has it: fewer rows give too few
/// independent accumulators to hide FMA latency at 16 lanes, and the AVX2 tile's even/odd
/// interleave serves matrix-vector products (bound by memory, not arithmetic) as well.
const WIDE_MIN_ROWS: usize = 3;

/// One AVX-512 register tile over one or two adjacent `b` panels (`cols ≤ 2·NR`): the
/// same FMAs in the same order as `tile`, sixteen lanes at a time.
///
/// # Safety
/// As `multiply`; `rows ≤ MR`; `bp[1]` is a panel when `cols > NR`; AVX-512F present.
#[allow(clippy::too_many_arguments)]
#[inline]
unsafe fn wide_tile<E: RowWeight>(
    rows: usize,
    cols: usize,
    kc: usize,
    (a, lda): (*const f32, Option<isize>),
    bp: [*const E; 2],
    c: *mut f32,
    ldc: usize,
    add: bool,
) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: by the contract.
    unsafe {
        use x86_512::tile as t;
        macro_rules! by_layout {
            ($r:literal, $p:literal) => {
                match lda {
                    None => t::<E, $r, $p, false>(cols, kc, a, 0, bp, c, ldc, add),
                    Some(lda) => t::<E, $r, $p, true>(cols, kc, a, lda, bp, c, ldc, add),
                }
            };
        }
        match (rows, cols > NR) {
            (3, false) => by_layout!(3, 1),
            (4, false) => by_layout!(4, 1),
            (5, false) => by_layout!(5, 1),
            (_, false) => by_layout!(6, 1),
            (3, true) => by_layout!(3, 2),
            (4, true) => by_layout!(4, 2),
            (5, true) => by_layout!(5, 2),
            (_, true) => by_layout!(6, 2),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (rows, cols, kc, a, lda, bp, c, ldc, add);
        unreachable!("the AVX-512 tile runs only where avx512_available() is true");
    }
}

/// One register tile: `c[rows×cols] (+)= a_panel · b_panel` over `kc` steps.
///
/// # Safety
/// As `multiply`; `rows ≤ MR`, `cols ≤ NR`.
#[allow(clippy::too_many_arguments)]
#[inline]
unsafe fn tile<E: RowWeight>(
    rows: usize,
    cols: usize,
    kc: usize,
    (a, lda): (*const f32, Option<isize>),
    b: *const E,
    c: *mut f32,
    ldc: usize,
    add: bool,
) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `sgemm`'s contract includes `available()`, so AVX2, FMA and F16C are present.
    unsafe {
        macro_rules! by_layout {
            ($r:literal) => {
                match lda {
                    None => x86::tile::<E, $r, false>(cols, kc, a, 0, b, c, ldc, add),
                    Some(lda) => x86::tile::<E, $r, true>(cols, kc, a, lda, b, c, ldc, add),
                }
            };
        }
        match rows {
            1 => by_layout!(1),
            2 => by_layout!(2),
            3 => by_layout!(3),
            4 => by_layout!(4),
            5 => by_layout!(5),
            _ => by_layout!(6),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (rows, cols, kc, a, lda, b, c, ldc, add);
        unreachable!("sgemm runs only where available() is true");
    }
}

/// A tile's left operand: `R` rows read in place, `lda` apart (`ROWS`), or a packed panel
/// (`MR` values per step of k). Row starts are computed once per tile, so each step's
/// broadcasts address `start + p`.
#[derive(Clone, Copy)]
struct LeftTile<const R: usize, const ROWS: bool> {
    start: [*const f32; R],
}

impl<const R: usize, const ROWS: bool> LeftTile<R, ROWS> {
    #[inline(always)]
    fn new(a: *const f32, lda: isize) -> Self {
        let start = std::array::from_fn(|r| {
            if ROWS {
                a.wrapping_offset(r as isize * lda)
            } else {
                a.wrapping_add(r)
            }
        });
        LeftTile { start }
    }

    /// Element (row `r`, step `p`).
    ///
    /// # Safety
    /// It must lie inside the operand the tile was given.
    #[inline(always)]
    unsafe fn at(&self, r: usize, p: usize) -> *const f32 {
        // SAFETY: by the contract.
        unsafe {
            if ROWS {
                self.start[r].add(p)
            } else {
                self.start[r].add(p * MR)
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{LeftTile, NR};
    use crate::kernels::rowdot::RowWeight;
    use std::arch::x86_64::*;

    /// The `R`-row tile. Two passes over k interleave (even and odd steps into separate
    /// accumulators) when R is small, so FMA latency is hidden by independent chains.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // `r` indexes the accumulators and the a panel
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn tile<E: RowWeight, const R: usize, const ROWS: bool>(
        cols: usize,
        kc: usize,
        a: *const f32,
        lda: isize,
        b: *const E,
        c: *mut f32,
        ldc: usize,
        add: bool,
    ) {
        let left = LeftTile::<R, ROWS>::new(a, lda);
        // SAFETY (whole body): pointers stay inside the panels (kc steps) and the c tile
        // (R rows, `cols` columns), by the caller's contract.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            if R <= 2 {
                let mut odd = [[_mm256_setzero_ps(); 2]; R];
                let mut p = 0;
                while p + 1 < kc {
                    let (b0, b1) = (E::load8(b.add(p * NR)), E::load8(b.add(p * NR + 8)));
                    let (b2, b3) = (
                        E::load8(b.add(p * NR + NR)),
                        E::load8(b.add(p * NR + NR + 8)),
                    );
                    for r in 0..R {
                        let x = _mm256_broadcast_ss(&*left.at(r, p));
                        let y = _mm256_broadcast_ss(&*left.at(r, p + 1));
                        acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
                        acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
                        odd[r][0] = _mm256_fmadd_ps(y, b2, odd[r][0]);
                        odd[r][1] = _mm256_fmadd_ps(y, b3, odd[r][1]);
                    }
                    p += 2;
                }
                if p < kc {
                    let (b0, b1) = (E::load8(b.add(p * NR)), E::load8(b.add(p * NR + 8)));
                    for r in 0..R {
                        let x = _mm256_broadcast_ss(&*left.at(r, p));
                        acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
                        acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
                    }
                }
                for r in 0..R {
                    acc[r][0] = _mm256_add_ps(acc[r][0], odd[r][0]);
                    acc[r][1] = _mm256_add_ps(acc[r][1], odd[r][1]);
                }
            } else {
                for p in 0..kc {
                    let (b0, b1) = (E::load8(b.add(p * NR)), E::load8(b.add(p * NR + 8)));
                    for r in 0..R {
                        let x = _mm256_broadcast_ss(&*left.at(r, p));
                        acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
                        acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
                    }
                }
            }
            for (r, acc) in acc.iter().enumerate() {
                let row = c.add(r * ldc);
                if cols == NR {
                    let (mut v0, mut v1) = (acc[0], acc[1]);
                    if add {
                        v0 = _mm256_add_ps(v0, _mm256_loadu_ps(row));
                        v1 = _mm256_add_ps(v1, _mm256_loadu_ps(row.add(8)));
                    }
                    _mm256_storeu_ps(row, v0);
                    _mm256_storeu_ps(row.add(8), v1);
                } else {
                    let mut tmp = [0.0f32; NR];
                    _mm256_storeu_ps(tmp.as_mut_ptr(), acc[0]);
                    _mm256_storeu_ps(tmp.as_mut_ptr().add(8), acc[1]);
                    for (j, &v) in tmp.iter().enumerate().take(cols) {
                        let d = row.add(j);
                        *d = if add { *d + v } else { v };
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86_512 {
    use super::{LeftTile, NR};
    use crate::kernels::rowdot::RowWeight;
    use std::arch::x86_64::*;

    /// The `R`-row tile over `P` adjacent panels (`P`·16 columns, the last `cols` live):
    /// per step of k, `P` vector loads of `b`, `R` broadcasts of `a` and `R`·`P` FMAs.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::needless_range_loop)] // `r` indexes the accumulators and the a panel
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn tile<E: RowWeight, const R: usize, const P: usize, const ROWS: bool>(
        cols: usize,
        kc: usize,
        a: *const f32,
        lda: isize,
        bp: [*const E; 2],
        c: *mut f32,
        ldc: usize,
        add: bool,
    ) {
        let left = LeftTile::<R, ROWS>::new(a, lda);
        // SAFETY (whole body): pointers stay inside the panels (kc steps) and the c tile
        // (R rows, `cols` columns: stores and loads past them are masked off).
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); P]; R];
            for p in 0..kc {
                let mut b = [_mm512_setzero_ps(); P];
                for h in 0..P {
                    b[h] = E::load16(bp[h].add(p * NR));
                }
                for r in 0..R {
                    let x = _mm512_set1_ps(*left.at(r, p));
                    for h in 0..P {
                        acc[r][h] = _mm512_fmadd_ps(x, b[h], acc[r][h]);
                    }
                }
            }
            let mut masks = [0u16; P];
            for (h, mask) in masks.iter_mut().enumerate() {
                *mask = crate::simd::first_lanes(cols.saturating_sub(h * NR));
            }
            for (r, acc) in acc.iter().enumerate() {
                let row = c.add(r * ldc);
                for h in 0..P {
                    let at = row.add(h * NR);
                    let mut v = acc[h];
                    if add {
                        v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(masks[h], at));
                    }
                    _mm512_mask_storeu_ps(at, masks[h], v);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(m: usize, n: usize, k: usize, a: &[f32], b: &[f32]) -> Vec<f64> {
        let mut c = vec![0.0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k)
                    .map(|p| a[i * k + p] as f64 * b[p * n + j] as f64)
                    .sum();
            }
        }
        c
    }

    fn data(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| {
                ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 16) as f32 / 32768.0
                    - 1.0
            })
            .collect()
    }

    #[test]
    fn matches_a_plain_product_in_every_operand_form() {
        if !available() {
            return;
        }
        let helpers = par::Helpers::for_threads(2);
        for &(m, n, k) in &[
            (1, 1, 1),
            (1, 17, 3),
            (7, 33, 300),
            (13, 16, 257),
            (100, 40, 600),
            (6, 512, 64),
            // Matrix-vector products past PAR_MIN_STREAM: split over threads; the second
            // reuses a larger scratch that is not re-zeroed.
            (1, 135, 300),
            (2, 700, 260),
            (1, 45, 70),
            // AVX-512 tiles: a pair of panels whose second is partly live (20 columns), and
            // pairs then a partial single panel (70 columns) on 5-row tiles.
            (9, 20, 40),
            (5, 70, 33),
            // Rows read in place whose last tile would hold 1 or 2 rows: the last 8 (7)
            // rows run as 4 + 4 (4 + 3).
            (32, 48, 100),
            (8, 40, 50),
            (103, 36, 20),
        ] {
            let (a, b) = (data(m * k, 1), data(k * n, 2));
            let want = reference(m, n, k, &a, &b);
            // a row-major, b given transposed (column-major) to exercise both pack paths.
            let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
            let sa = Strided {
                ptr: a.as_ptr(),
                rs: k as isize,
                cs: 1,
            };
            let sb = Strided {
                ptr: b.as_ptr(),
                rs: n as isize,
                cs: 1,
            };
            let sbt = Strided {
                ptr: bt.as_ptr(),
                rs: 1,
                cs: k as isize,
            };
            // a given transposed too: its pack reads a column per row.
            let at: Vec<f32> = (0..m * k).map(|i| a[(i % m) * k + i / m]).collect();
            let sat = Strided {
                ptr: at.as_ptr(),
                rs: 1,
                cs: m as isize,
            };
            // SAFETY: the operands address exactly these shapes.
            let (pa, pb) = unsafe { (Packed::a(m, k, sa), Packed::b(k, n, sb)) };
            let forms = [
                (Operand::Strided(sa), Operand::Strided(sb)),
                (Operand::Strided(sa), Operand::Strided(sbt)),
                (Operand::Packed(&pa), Operand::Strided(sb)),
                (Operand::Strided(sa), Operand::Packed(&pb)),
                (Operand::Packed(&pa), Operand::Packed(&pb)),
                (Operand::Strided(sat), Operand::Packed(&pb)),
            ];
            for (f, (oa, ob)) in forms.into_iter().enumerate() {
                for threads in [1, 2] {
                    let ldc = n + 3;
                    let mut c = vec![f32::NAN; m * ldc];
                    par::with_helpers(&helpers, threads, || {
                        // SAFETY: c has m rows of stride ldc.
                        unsafe { sgemm((m, n, k), oa, ob, c.as_mut_ptr(), ldc, threads) }
                    });
                    for i in 0..m {
                        for j in 0..n {
                            let (got, w) = (c[i * ldc + j] as f64, want[i * n + j]);
                            assert!(
                                (got - w).abs() <= 1e-5 * (k as f64).sqrt() * (1.0 + w.abs()),
                                "{m}x{n}x{k} form {f} threads {threads} at ({i},{j}): {got} vs {w}"
                            );
                        }
                        assert!(
                            c[i * ldc + n..(i + 1) * ldc].iter().all(|v| v.is_nan()),
                            "wrote past a row"
                        );
                    }
                }
            }
        }
    }

    /// 16-bit panels hold the weight as it is and widen it in the tiles: every output is
    /// the f32 product of the widened weight, bit for bit, in every tile shape (narrow and
    /// AVX-512, one to six rows, partial panels), from row-major and transposed sources,
    /// packed at once (half the bytes of f32 panels) or per task from the weight in place.
    #[test]
    fn half_panels_give_the_f32_panels_product_bit_for_bit() {
        if !available() {
            return;
        }
        fn check<T: PanelElem>(name: &str) {
            let helpers = par::Helpers::for_threads(2);
            for &(m, n, k) in &[
                (1, 17, 3),
                (2, 33, 257),
                (5, 70, 33),
                (9, 20, 40),
                (13, 48, 300),
                (32, 40, 100),
            ] {
                let a = data(m * k, 3);
                let b: Vec<T> = data(k * n, 4).into_iter().map(T::from_f32).collect();
                let wide: Vec<f32> = b.iter().map(|v| v.to_f32()).collect();
                let bt: Vec<T> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
                let sa = Strided {
                    ptr: a.as_ptr(),
                    rs: k as isize,
                    cs: 1,
                };
                // SAFETY (all three packs): the operands address exactly these shapes.
                let f32_panels = unsafe {
                    Packed::b(
                        k,
                        n,
                        Strided {
                            ptr: wide.as_ptr(),
                            rs: n as isize,
                            cs: 1,
                        },
                    )
                };
                let rows = unsafe {
                    Packed::b_half(
                        k,
                        n,
                        Strided {
                            ptr: b.as_ptr(),
                            rs: n as isize,
                            cs: 1,
                        },
                    )
                };
                let columns = unsafe {
                    Packed::b_half(
                        k,
                        n,
                        Strided {
                            ptr: bt.as_ptr(),
                            rs: 1,
                            cs: k as isize,
                        },
                    )
                };
                assert_eq!(2 * rows.bytes(), f32_panels.bytes());
                // Read in place, each task packing the panels it reaches.
                let in_place = |ptr: *const T, rs: usize, cs: usize| {
                    T::in_place(Strided {
                        ptr,
                        rs: rs as isize,
                        cs: cs as isize,
                    })
                };
                for threads in [1, 2] {
                    let run = |ob: Operand| {
                        let mut c = vec![f32::NAN; m * n];
                        par::with_helpers(&helpers, threads, || {
                            // SAFETY: c has m rows of n; the operands address m×k and k×n.
                            unsafe {
                                sgemm(
                                    (m, n, k),
                                    Operand::Strided(sa),
                                    ob,
                                    c.as_mut_ptr(),
                                    n,
                                    threads,
                                )
                            }
                        });
                        c
                    };
                    let want = run(Operand::Packed(&f32_panels));
                    for (form, ob) in [
                        ("row-major", Operand::Packed(&rows)),
                        ("transposed", Operand::Packed(&columns)),
                        ("row-major in place", in_place(b.as_ptr(), n, 1)),
                        ("transposed in place", in_place(bt.as_ptr(), 1, k)),
                    ] {
                        let got = run(ob);
                        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                            assert!(
                                g.to_bits() == w.to_bits(),
                                "{name} {form} {m}x{n}x{k} threads {threads} at {i}: {g} vs {w}"
                            );
                        }
                    }
                }
            }
        }
        check::<bf16>("bf16");
        check::<f16>("f16");
    }
}
