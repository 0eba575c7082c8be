//! Convolution. Dense f32 convs with a packed weight read a padded copy of the input tap by
//! tap (no im2col) where the CPU allows: on AVX-512, `channels` (output channels along the
//! lanes; small planes with a multiple of 64 channels, chosen at compile time from static
//! shapes, which also pick the weight's packing) or `flat` (output positions of the
//! flattened plane along the lanes); on AVX2, `shifted` (positions of one output row) where
//! rows fill whole vectors. Other dense and grouped convs run im2col + GEMM (as `dot`);
//! a 1×1, stride-1, unpadded conv skips im2col (the input already is the column matrix);
//! depthwise-style convs (one input channel per group) accumulate shifted input rows
//! directly, since a GEMM with one row of K = taps would be mostly call overhead.
//! Work is split over batch × groups (`par.rs`) when there are several; a single image with
//! one group gives its threads to the GEMM instead.

mod channels;
mod flat;
mod shifted;
#[cfg(test)]
mod testing;

use std::cell::RefCell;

use ember_core::dtype::DType;

use super::dot::{gemm_into, GemmElem, Mat};
use super::elementwise::cast;
use super::fused::Pass;
use super::sgemm::{self, Operand, Packed};
use super::window::{size, three, Axis};
use crate::arena::Dest;
use crate::buffer::Val;
use crate::elem::Real;
use crate::error::{CpuError, KResult};
use crate::par;

/// Runs `f` with `len` floats of this thread's scratch (`scratch.rs`; arbitrary contents):
/// the padded input copy the kernels without im2col read.
fn with_padded<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    crate::scratch::with_scratch(len.div_ceil(2), |words| {
        // SAFETY: the scratch holds ⌈len/2⌉ 8-byte-aligned words, ours while `f` runs; every
        // bit pattern is an f32.
        f(unsafe { std::slice::from_raw_parts_mut(words as *mut f32, len) })
    })
}

/// Floats of a padded copy worth filling on several threads (below, the hand-off costs
/// more than half the copy).
const MIN_SPLIT_FILL: usize = 16 * 1024;

/// Fills the padded copy `copy` (whole channels of `chan` floats) by `fill(first, part)`,
/// `part` holding the channels from `first`: on one thread, or with `threads` split by
/// channels between them (a serial copy was 10–25 % of a two-thread conv on a small plane).
fn fill_channels(
    copy: &mut [f32],
    chan: usize,
    threads: usize,
    fill: impl Fn(usize, &mut [f32]) + Sync,
) {
    let channels = copy.len() / chan.max(1);
    let tasks = match threads {
        1 => 1,
        _ => par::threads().min(channels),
    };
    if tasks <= 1 || copy.len() < MIN_SPLIT_FILL {
        return fill(0, copy);
    }
    let per = channels.div_ceil(tasks) * chan;
    par::for_chunks_mut(copy, per, |start, part| fill(start / chan, part));
}

/// Runs `block(first, end)` over `[0, len)` in even blocks of at most `per_block`: in order
/// on one thread; with `threads`, each thread takes one contiguous, even share (at least
/// `min_share` long). Interleaved blocks would put the cache lines at their edges in every
/// output plane into both threads' writes (that cost a 3-channel stem conv all of its
/// second thread), and uneven shares leave a thread idle on small planes.
fn for_shares(
    len: usize,
    per_block: usize,
    min_share: usize,
    threads: usize,
    block: impl Fn(usize, usize) + Sync,
) {
    let share = |t: usize, tasks: usize| {
        let (first, end) = (t * len / tasks, (t + 1) * len / tasks);
        let blocks = (end - first).div_ceil(per_block);
        for b in 0..blocks {
            let at = first + b * (end - first) / blocks;
            block(at, first + (b + 1) * (end - first) / blocks);
        }
    };
    let tasks = match threads {
        1 => 1,
        _ => par::threads().min(len.div_ceil(min_share.max(1))),
    };
    match tasks {
        0 | 1 => share(0, 1),
        _ => par::for_each(tasks, |t| share(t, tasks)),
    }
}

/// Which columns of a phase row along `w` hold input (`q0..q1`, from input index `first`
/// on, every `stride`-th); the rest are padding. Fixed per phase: computing it per row (two
/// divisions) was most of the copy's time.
#[derive(Clone, Copy)]
pub(super) struct PhaseCols {
    pub q0: usize,
    pub q1: usize,
    pub first: usize,
}

impl PhaseCols {
    /// Column q of phase `r` (of `cols` columns) holds input q·stride + r - pad.
    pub fn new(w: &Axis, r: usize, cols: usize) -> PhaseCols {
        let s = w.stride;
        let q0 = w.pad.saturating_sub(r).div_ceil(s).min(cols);
        let q1 = (w.len + w.pad)
            .saturating_sub(r)
            .div_ceil(s)
            .clamp(q0, cols);
        PhaseCols {
            q0,
            q1,
            first: (q0 * s + r).saturating_sub(w.pad),
        }
    }
}

/// A conv's output, shared so that tasks write disjoint outputs of one exclusively
/// borrowed buffer.
struct OutPtr(*mut f32);
// SAFETY: each kernel hands every output element to exactly one task.
unsafe impl Sync for OutPtr {}

pub struct Params<'a> {
    pub stride: &'a [i64],
    pub padding: &'a [(i64, i64)],
    pub dilation: &'a [i64],
    pub groups: i64,
}

/// The concrete geometry of one conv call.
struct Geom {
    n: usize,
    c: usize,
    o: usize,
    groups: usize,
    /// Input channels per group, output channels per group.
    cg: usize,
    og: usize,
    ax: [Axis; 3],
}

impl Geom {
    fn new(xs: &[usize], ws: &[usize], out: &[usize], p: &Params) -> KResult<Geom> {
        let k = p.stride.len();
        let bad = || CpuError::Shape(format!("conv{k}d of {xs:?} with weight {ws:?}"));
        if xs.len() != k + 2 || ws.len() != k + 2 || out.len() != k + 2 {
            return Err(bad());
        }
        let groups = size(p.groups, "groups")?;
        let (n, c, o, cg) = (xs[0], xs[1], ws[0], ws[1]);
        if groups == 0 || cg * groups != c || o % groups != 0 {
            return Err(bad());
        }
        let mut axes = Vec::with_capacity(k);
        for i in 0..k {
            axes.push(Axis {
                len: xs[i + 2],
                out: out[i + 2],
                kernel: ws[i + 2],
                stride: size(p.stride[i], "stride")?,
                dilation: size(p.dilation[i], "dilation")?,
                pad: size(p.padding[i].0, "padding")?,
            });
        }
        Ok(Geom {
            n,
            c,
            o,
            groups,
            cg,
            og: o / groups,
            ax: three(&axes)?,
        })
    }

    fn in_plane(&self) -> usize {
        self.ax.iter().map(|a| a.len).product()
    }

    fn out_plane(&self) -> usize {
        self.ax.iter().map(|a| a.out).product()
    }

    fn taps(&self) -> usize {
        self.ax.iter().map(|a| a.kernel).product()
    }

    fn pointwise(&self) -> bool {
        self.ax
            .iter()
            .all(|a| a.kernel == 1 && a.stride == 1 && a.pad == 0 && a.out == a.len)
    }

    /// Calls `f(tap, d_off, h_off, w_off)` for every kernel tap, in weight order.
    fn for_taps(&self, mut f: impl FnMut(usize, isize, isize, isize)) {
        let [d, h, w] = &self.ax;
        let mut t = 0;
        for i in 0..d.kernel {
            for j in 0..h.kernel {
                for l in 0..w.kernel {
                    f(t, d.tap_offset(i), h.tap_offset(j), w.tap_offset(l));
                    t += 1;
                }
            }
        }
    }

    /// Calls `f(out_row, in_row)` for every output row (fixed od, oh) whose tap at
    /// (d_off, h_off) lies inside the input; `in_row` indexes the input plane.
    fn for_rows(&self, d_off: isize, h_off: isize, mut f: impl FnMut(usize, usize)) {
        let [d, h, w] = &self.ax;
        let (dlo, dhi) = d.valid_outputs(d_off);
        let (hlo, hhi) = h.valid_outputs(h_off);
        for od in dlo..dhi {
            let id = (od * d.stride) as isize + d_off;
            for oh in hlo..hhi {
                let ih = (oh * h.stride) as isize + h_off;
                f(
                    (od * h.out + oh) * w.out,
                    (id as usize * h.len + ih as usize) * w.len,
                );
            }
        }
    }
}

pub fn conv(
    x: &Val,
    w: &Val,
    bias: Option<&Val>,
    p: &Params,
    out: &[usize],
    threads: usize,
) -> KResult<Val> {
    let g = Geom::new(x.shape(), w.shape(), out, p)?;
    match x.dtype {
        DType::F32 => Val::build::<f32>(x.dtype, out, |y| {
            conv_t(x, w, bias, &g, &[], y, None, threads)
        }),
        DType::F64 => Val::build::<f64>(x.dtype, out, |y| {
            conv_t(x, w, bias, &g, &[], y, None, threads)
        }),
        // Half types compute in f32 and round once at the end, as torch's CPU kernels do.
        DType::F16 | DType::BF16 => {
            let b = bias.map(|b| cast(b, DType::F32)).transpose()?;
            let (xf, wf) = (cast(x, DType::F32)?, cast(w, DType::F32)?);
            let y = Val::build::<f32>(DType::F32, out, |y| {
                conv_t(&xf, &wf, b.as_ref(), &g, &[], y, None, threads)
            })?;
            cast(&y, x.dtype)
        }
        other => Err(CpuError::Unsupported(format!("conv of {other}"))),
    }
}

/// Dtypes whose conv writes its result straight into a buffer (`conv_into`).
pub fn conv_in_place(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64)
}

/// Whether a conv with weight shape `ws` in `groups` groups runs im2col + GEMM (whose weight
/// can be packed at compile time), not the direct loop.
pub fn uses_gemm(ws: &[usize], groups: usize) -> bool {
    ws.len() >= 2 && groups > 0 && !(ws[1] == 1 && ws[0] / groups <= 4)
}

/// Whether a conv of these static shapes wants its weight packed as `sgemm`'s right
/// operand (k × output channels, for the channel-lane kernel) rather than its left.
pub fn packs_right(xs: &[usize], ws: &[usize], out: &[usize], p: &Params) -> bool {
    Geom::new(xs, ws, out, p).is_ok_and(|g| !g.pointwise() && channels::suits(&g))
}

/// The conv written into `dest` (a reused arena buffer or the caller's output), so that no
/// fresh buffer is zeroed per call, then `epilogue` (a fused elementwise pass over `dest`)
/// run in place: on each image's outputs right after they are written, while they are
/// still in cache, when images run as separate tasks. `packed` holds the weight of each
/// group packed at compile time, or nothing.
#[allow(clippy::too_many_arguments)]
pub fn conv_into(
    x: &Val,
    w: &Val,
    bias: Option<&Val>,
    p: &Params,
    packed: &[Packed],
    dest: &mut Dest,
    epilogue: Option<&Pass>,
    threads: usize,
) -> KResult<()> {
    let shape = dest.shape.clone();
    let g = Geom::new(x.shape(), w.shape(), &shape, p)?;
    if x.dtype != dest.dtype {
        return Err(CpuError::Internal(format!(
            "conv of {} into {}",
            x.dtype, dest.dtype
        )));
    }
    match x.dtype {
        DType::F32 => conv_t::<f32>(x, w, bias, &g, packed, dest.slice()?, epilogue, threads),
        DType::F64 => conv_t::<f64>(x, w, bias, &g, &[], dest.slice()?, epilogue, threads),
        d => Err(CpuError::Internal(format!("conv into a buffer of {d}"))),
    }
}

/// The contiguous elements of `v` (copied first when strided).
fn elems<T: Copy>(v: &Val) -> KResult<(Val, *const T, usize)> {
    let c = v.contiguous()?;
    let view = c.view::<T>()?;
    let (ptr, n) = (view.ptr, c.numel());
    Ok((c, ptr, n))
}

/// The conv into `y` (contiguous `[N, O, *S']`; every element is written), then `epilogue`
/// over it.
#[allow(clippy::too_many_arguments)]
fn conv_t<T: GemmElem + Real>(
    x: &Val,
    w: &Val,
    bias: Option<&Val>,
    g: &Geom,
    packed: &[Packed],
    y: &mut [T],
    epilogue: Option<&Pass>,
    threads: usize,
) -> KResult<()> {
    let (_xk, xp, xn) = elems::<T>(x)?;
    let (_wk, wp, wn) = elems::<T>(w)?;
    let bias: Option<Vec<T>> = bias.map(|b| b.to_vec::<T>()).transpose()?;
    if xn != g.n * g.c * g.in_plane()
        || wn != g.o * g.cg * g.taps()
        || y.len() != g.n * g.o * g.out_plane()
    {
        return Err(CpuError::Internal("conv operand sizes".into()));
    }
    // SAFETY: both values are contiguous with exactly these many elements (checked above)
    // and stay alive (`_xk`, `_wk`) for the whole call.
    let xs = unsafe { std::slice::from_raw_parts(xp, xn) };
    let ws = unsafe { std::slice::from_raw_parts(wp, wn) };
    let (ip, op) = (g.in_plane(), g.out_plane());
    let tasks = g.n * g.groups;
    if op == 0 || tasks == 0 {
        return Ok(());
    }
    if epilogue.is_some_and(|e| e.len() != y.len()) {
        return Err(CpuError::Internal("conv epilogue of another size".into()));
    }
    // An epilogue that is only a ReLU of the conv runs inside the panel kernels (in
    // registers, before the store) where one takes the conv; a pass over the outputs was a
    // quarter of a 3-channel stem conv's time.
    let relu_in_kernel = epilogue.is_some_and(Pass::is_relu_of_head);
    // A residual block's `relu(conv + bias + residual)`: the AVX2 kernel adds the residual
    // in registers too (the pass after the conv was ~30 µs of a 32-channel 32×32 conv of
    // four images). The AVX-512 kernels leave it to the pass.
    // The f32 kernel that reads a padded copy of the input instead of im2col, if one suits
    // this geometry on this CPU (AVX-512 first: it also keeps the lanes of narrow rows busy).
    type NoIm2col = fn(&Geom, &Packed, &[f32], Option<&[f32]>, &mut [f32], usize, bool);
    let runs_shifted = !flat::suits(g) && shifted::suits(g);
    let no_im2col: Option<NoIm2col> = if flat::suits(g) {
        Some(flat::conv_flat)
    } else if runs_shifted {
        Some(shifted::conv_shifted)
    } else {
        None
    };
    let residual = epilogue
        .and_then(Pass::relu_of_head_plus)
        .filter(|_| runs_shifted);
    // One task: image `t / groups`, group `t % groups`; its outputs are contiguous.
    let run = |t: usize, y: &mut [T], threads: usize| {
        let (b, grp) = (t / g.groups, t % g.groups);
        let x0 = (b * g.c + grp * g.cg) * ip;
        let xg = &xs[x0..x0 + g.cg * ip];
        let wg = &ws[grp * g.og * g.cg * g.taps()..(grp + 1) * g.og * g.cg * g.taps()];
        let bg = bias.as_ref().map(|b| &b[grp * g.og..(grp + 1) * g.og]);
        // The panel paths need the weight packed as this group's og×k left operand (or,
        // for the channel-lane kernel, k×og right operand).
        let k = g.cg * g.taps();
        let fits = |pa: &Packed| match pa.is_left() {
            true => pa.rows == g.og && pa.cols == k,
            false => pa.rows == k && pa.cols == g.og && crate::simd::avx512_available(),
        };
        let panels = match (packed.get(grp), T::as_f32(xg)) {
            (Some(pa), Some(x32)) if sgemm::available() && !g.pointwise() && fits(pa) => {
                Some((pa, x32))
            }
            _ => None,
        };
        let mut add_bias = bg;
        let mut relu_done = false;
        let residual = residual.map(|r| &r[t * g.og * op..(t + 1) * g.og * op]);
        // (f32 throughout: `residual` is only found for f32 outputs.)
        if let (Some(res), Some((pa, x32)), Some(y32), Some(b32)) = (
            residual,
            panels.filter(|(pa, _)| pa.is_left()),
            T::as_f32_mut(y),
            match bg {
                None => Some(None),
                Some(b) => T::as_f32(b).map(Some),
            },
        ) {
            shifted::conv_shifted_plus(g, pa, x32, b32, Some(res), y32, threads, true);
            return true;
        }
        if !uses_gemm(&[g.o, g.cg], g.groups) {
            direct(g, xg, wg, y);
        } else if let (Some((pa, x32)), Some(y32)) = (panels, T::as_f32_mut(y)) {
            let no_im2col = match pa.is_left() {
                true => no_im2col,
                false => Some(channels::conv_channels as NoIm2col),
            };
            match (no_im2col, bg.map(|b| T::as_f32(b))) {
                // These kernels start their sums from the bias and clamp them in registers.
                (Some(kernel), Some(Some(b32))) => {
                    kernel(g, pa, x32, Some(b32), y32, threads, relu_in_kernel);
                    add_bias = None;
                    relu_done = relu_in_kernel;
                }
                (Some(kernel), None) => {
                    kernel(g, pa, x32, None, y32, threads, relu_in_kernel);
                    relu_done = relu_in_kernel;
                }
                _ => gemm_from_panels(g, pa, x32, y32, threads),
            }
        } else {
            let k = g.cg * g.taps();
            with_cols(
                g.pointwise().then_some(xg),
                k * op,
                |col| im2col(g, xg, col),
                |cols| {
                    let a = Mat {
                        ptr: wg.as_ptr(),
                        rs: k as isize,
                        cs: 1,
                    };
                    let bm = Mat {
                        ptr: cols.as_ptr(),
                        rs: op as isize,
                        cs: 1,
                    };
                    // SAFETY: `wg` is og×k and `cols` is k×op, both contiguous row-major.
                    let done = match packed.get(grp) {
                        Some(pa) => unsafe {
                            T::gemm_packed_a(y, op, (g.og, op, k), pa, bm, threads)
                        },
                        None => false,
                    };
                    if !done {
                        // SAFETY: as above.
                        unsafe { gemm_into(y, op, (g.og, op, k), a, bm, threads) };
                    }
                },
            );
        }
        if let Some(bias) = add_bias {
            for (row, &bv) in y.chunks_mut(op).zip(bias) {
                row.iter_mut().for_each(|v| *v = *v + bv);
            }
        }
        relu_done
    };
    let chunk = g.og * op;
    if tasks == 1 {
        // `run` says whether its kernel did the epilogue's work (the ReLU).
        if run(0, y, threads) {
            return Ok(());
        }
        return epilogue.map_or(Ok(()), Pass::all);
    }
    // Each task runs the epilogue over its own outputs; the first error is kept.
    let failed = std::sync::Mutex::new(None);
    par::for_chunks_mut(y, chunk, |start, y| {
        if run(start / chunk, y, 1) {
            return;
        }
        if let Some(Err(e)) = epilogue.map(|e| e.range(start, start + y.len())) {
            failed
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert(e);
        }
    });
    match failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

thread_local! {
    /// Per-thread im2col buffer, reused across calls (a fresh one of this size would be
    /// page-faulted in on every call). `u64` elements so it is aligned for f32 and f64.
    static COLS: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

/// Calls `use_cols` with the column matrix: `given` when there is one, else `len` zeros
/// filled by `fill` in a reused per-thread buffer.
fn with_cols<T: Real, R>(
    given: Option<&[T]>,
    len: usize,
    fill: impl FnOnce(&mut [T]),
    use_cols: impl FnOnce(&[T]) -> R,
) -> R {
    if let Some(cols) = given {
        return use_cols(cols);
    }
    let words = (len * std::mem::size_of::<T>()).div_ceil(8);
    let run = |buf: &mut Vec<u64>| {
        buf.clear();
        buf.resize(words, 0);
        // SAFETY: the buffer holds `len` T's (T is f32 or f64: 8-byte alignment suffices,
        // every bit pattern is a value, and all-zero bits are 0.0).
        let col = unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr() as *mut T, len) };
        fill(col);
        use_cols(col)
    };
    COLS.with(|c| match c.try_borrow_mut() {
        Ok(mut buf) => run(&mut buf),
        // Re-entered on this thread: a fresh buffer.
        Err(_) => run(&mut Vec::new()),
    })
}

/// Fills `col` (`[cg·taps, out_plane]`) with the input value each tap of each output reads
/// (zero where it reads padding).
fn im2col<T: Real>(g: &Geom, x: &[T], col: &mut [T]) {
    let (ip, op) = (g.in_plane(), g.out_plane());
    let per_channel = g.taps() * op;
    // Chunks of whole channels, at least four each.
    let per = g.cg.div_ceil(par::threads() * 2).max(4);
    par::for_chunks_mut(col, per * per_channel, |start, rows| {
        for (i, rows) in rows.chunks_mut(per_channel).enumerate() {
            let c = start / per_channel + i;
            let xc = &x[c * ip..(c + 1) * ip];
            g.for_taps(|t, d_off, h_off, w_off| {
                tap_row(
                    g,
                    xc,
                    (d_off, h_off, w_off),
                    &mut rows[t * op..(t + 1) * op],
                );
            });
        }
    });
}

/// Writes into `row` (`out_plane`, zeroed) the value of input channel `xc` that one tap
/// (offsets `d_off, h_off, w_off`) reads for each output.
fn tap_row<T: Real>(
    g: &Geom,
    xc: &[T],
    (d_off, h_off, w_off): (isize, isize, isize),
    row: &mut [T],
) {
    let w = g.ax[2];
    let (lo, hi) = w.valid_outputs(w_off);
    if lo == hi {
        // The tap reads only padding along w (a kernel wider than the padded input's
        // interior): the start below would lie before the row.
        return;
    }
    g.for_rows(d_off, h_off, |o, i| {
        let dst = &mut row[o + lo..o + hi];
        let start = (i as isize + w_off + (lo * w.stride) as isize) as usize;
        if w.stride == 1 {
            dst.copy_from_slice(&xc[start..start + dst.len()]);
        } else {
            for (k, d) in dst.iter_mut().enumerate() {
                *d = xc[start + k * w.stride];
            }
        }
    });
}

thread_local! {
    /// Per-thread buffer for im2col written in `sgemm` panel layout, reused across calls and
    /// never zeroed (every element is written).
    static PANELS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

struct PanelPtr(*mut f32);
// SAFETY: shared only so that threads write different rows of one exclusively borrowed
// panel buffer (`write_panel_row`'s contract).
unsafe impl Sync for PanelPtr {}

/// `y = w · im2col(x)` for one image and group on f32 with the weight packed: im2col is
/// written straight into `sgemm`'s panel layout, a row (one channel's tap) at a time through
/// an L1-sized buffer, so the column matrix is never written out and read back.
fn gemm_from_panels(g: &Geom, pa: &Packed, x: &[f32], y: &mut [f32], threads: usize) {
    let (ip, op, taps) = (g.in_plane(), g.out_plane(), g.taps());
    let k = g.cg * taps;
    let len = sgemm::panels_len(k, op);
    assert!(y.len() >= g.og * op, "conv destination too small");
    let yp = y.as_mut_ptr();
    let run = |buf: &mut Vec<f32>| {
        if buf.len() < len {
            buf.resize(len, 0.0);
        }
        let base = PanelPtr(buf.as_mut_ptr());
        let per = g.cg.div_ceil(par::threads() * 2).max(4);
        par::for_each(g.cg.div_ceil(per), |chunk| {
            let base = &base;
            let mut row = vec![0.0f32; op];
            for c in chunk * per..((chunk + 1) * per).min(g.cg) {
                let xc = &x[c * ip..(c + 1) * ip];
                g.for_taps(|t, d_off, h_off, w_off| {
                    row.fill(0.0);
                    tap_row(g, xc, (d_off, h_off, w_off), &mut row);
                    // SAFETY: the buffer holds panels_len(k, op) floats; row c·taps + t < k
                    // is written by this chunk alone.
                    unsafe { sgemm::write_panel_row(base.0, k, c * taps + t, &row) };
                });
            }
        });
        // SAFETY: every panel element was written above; `pa` is og×k (packed for this
        // conv's weight group); y holds og rows of op.
        unsafe {
            sgemm::sgemm(
                (g.og, op, k),
                Operand::Packed(pa),
                Operand::PanelsB(&buf[..len]),
                yp,
                op,
                threads,
            )
        };
    };
    PANELS.with(|p| match p.try_borrow_mut() {
        Ok(mut buf) => run(&mut buf),
        // Re-entered on this thread: a fresh buffer.
        Err(_) => run(&mut Vec::new()),
    });
}

/// `y[oc] = Σ_tap w[oc, tap] · shifted x` for a group with a single input channel.
fn direct<T: Real>(g: &Geom, x: &[T], w: &[T], y: &mut [T]) {
    let op = g.out_plane();
    let taps = g.taps();
    let ax = g.ax[2];
    for (oc, yo) in y.chunks_mut(op).enumerate() {
        yo.iter_mut().for_each(|v| *v = <T as Real>::ZERO);
        let wo = &w[oc * taps..(oc + 1) * taps];
        g.for_taps(|t, d_off, h_off, w_off| {
            let wt = wo[t];
            let (lo, hi) = ax.valid_outputs(w_off);
            if lo == hi {
                return; // only padding along w (see `tap_row`)
            }
            g.for_rows(d_off, h_off, |o, i| {
                let dst = &mut yo[o + lo..o + hi];
                let start = (i as isize + w_off + (lo * ax.stride) as isize) as usize;
                let n = dst.len();
                if ax.stride == 1 {
                    for (d, &s) in dst.iter_mut().zip(&x[start..start + n]) {
                        *d = *d + wt * s;
                    }
                } else {
                    for (k, d) in dst.iter_mut().enumerate() {
                        *d = *d + wt * x[start + k * ax.stride];
                    }
                }
            });
        });
    }
}
