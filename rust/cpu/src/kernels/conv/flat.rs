//! Dense f32 convolution on AVX-512 over a flattened, phase-split padded input.
//!
//! The AVX2 kernel (`shifted`) vectorizes along one output row, so a 16-lane vector would
//! leave half its lanes idle on the 8- and 7-wide rows of a CNN's last stages. Here the
//! vectors run along the flattened output plane instead. Along each axis the zero-padded
//! input is split into `stride` phases (phase r holds padded indices r, r + s, r + 2s, …)
//! of `positions = out + (kernel - 1)·dilation / stride` entries, and the plane of each
//! phase combination is stored row-major with rows of `positions` (not `out`) entries.
//! Output (od, oh, ow) then has the *virtual* position p = (od·P_h + oh)·P_w + ow, and for
//! every tap its input sits at p + a per-tap constant: 16 consecutive virtual positions
//! read 16 consecutive inputs, whichever rows they fall in. Positions with ow ≥ out (the
//! few columns a row carries for the taps' reach) compute values nobody stores: a 3×3
//! conv on 8×8 outputs keeps 64 of 80 lanes, against 64 of 128 along rows.
//!
//! The tile is `sgemm`'s: `R` (≤ 6) output channels of the packed weight by `V` (≤ 4)
//! vectors, a broadcast of the weight and `V` loads of the input per step of k (every tap
//! of every input channel). Stores are masked per output row a vector touches.

use super::{fill_channels, for_shares, with_padded, Geom, OutPtr, PhaseCols};
use crate::kernels::sgemm::{Packed, MR};
use crate::kernels::window::Axis;

/// Lanes per vector: virtual output positions one load covers.
const LANES: usize = 16;
/// Most vectors one tile call takes (6 × 4 accumulators, 4 loads and a broadcast: 29 of
/// the 32 registers).
const MAX_VECTORS: usize = 4;
/// Vectors per block of work: every weight panel runs over a block before the next block,
/// so the block's inputs stay in L1 while the panels stream from L2.
const VECTORS_PER_BLOCK: usize = 16;

/// Whether the kernel runs here (AVX-512) and suits this conv: at least half the lanes of
/// its vectors are outputs.
pub fn suits(g: &Geom) -> bool {
    crate::simd::avx512_available()
        && g.ax
            .iter()
            .all(|a| a.kernel > 0 && a.out > 0 && a.stride > 0)
        && {
            let lay = Layout::new(g);
            g.out_plane() * 2 >= lay.lanes()
        }
}

/// One axis of the padded copy.
struct Split {
    /// Phases (padded index mod stride) some tap reads; a phase's slot is its index here.
    phases: Vec<usize>,
    /// Entries per phase.
    positions: usize,
}

impl Split {
    fn new(a: &Axis) -> Split {
        let mut phases: Vec<usize> = (0..a.kernel).map(|k| k * a.dilation % a.stride).collect();
        phases.sort_unstable();
        phases.dedup();
        Split {
            phases,
            positions: a.out + (a.kernel - 1) * a.dilation / a.stride,
        }
    }

    /// The slot and the position offset of tap `k`.
    fn tap(&self, a: &Axis, k: usize) -> (usize, usize) {
        let off = k * a.dilation;
        let slot = self.phases.iter().position(|&r| r == off % a.stride);
        (slot.expect("every tap's phase has a slot"), off / a.stride)
    }
}

/// An output row's share of one vector: the lanes it holds (`mask`) and where lane 0
/// would be written, relative to the output plane (lanes outside `mask` are never
/// written; the offset may point before the row, or before the plane).
#[derive(Clone, Copy)]
struct Segment {
    mask: u16,
    offset: isize,
}

/// Where things lie in the padded copy of one image and group, and where each vector's
/// lanes go.
pub(super) struct Layout {
    splits: [Split; 3],
    /// Floats per virtual (d, h) step: P_h·P_w and P_w.
    pub(super) plane: usize,
    pub(super) row: usize,
    /// Floats per input channel (every phase combination).
    pub(super) chan: usize,
    /// Offset of each kernel tap (weight order) from a virtual position.
    pub(super) taps: Vec<isize>,
    /// Vectors covering the virtual positions of every output.
    vectors: usize,
}

impl Layout {
    pub(super) fn new(g: &Geom) -> Layout {
        let splits = [
            Split::new(&g.ax[0]),
            Split::new(&g.ax[1]),
            Split::new(&g.ax[2]),
        ];
        let row = splits[2].positions;
        let plane = splits[1].positions * row;
        let block = splits[0].positions * plane;
        let slots = |i: usize| splits[i].phases.len();
        let chan = slots(0) * slots(1) * slots(2) * block;
        let mut taps = Vec::with_capacity(g.taps());
        let [d, h, w] = &g.ax;
        for i in 0..d.kernel {
            let (sd, qd) = splits[0].tap(d, i);
            for j in 0..h.kernel {
                let (sh, qh) = splits[1].tap(h, j);
                for l in 0..w.kernel {
                    let (sw, qw) = splits[2].tap(w, l);
                    let slot = (sd * slots(1) + sh) * slots(2) + sw;
                    taps.push((slot * block + qd * plane + qh * row + qw) as isize);
                }
            }
        }
        let last = (d.out - 1) * plane + (h.out - 1) * row + w.out - 1;
        Layout {
            plane,
            row,
            chan,
            taps,
            vectors: (last + 1).div_ceil(LANES),
            splits,
        }
    }

    /// Lanes of the vectors that cover every output.
    pub(super) fn lanes(&self) -> usize {
        self.vectors * LANES
    }

    /// Floats the padded copy of `cg` channels takes, with room for the last vectors'
    /// loads past the last channel (lanes no output keeps).
    pub(super) fn len(&self, cg: usize) -> usize {
        let reach = self.taps.iter().copied().max().unwrap_or(0) as usize;
        (cg * self.chan).max((cg - 1) * self.chan + reach + self.vectors * LANES)
    }

    /// Writes the padded, phase-split copy of `x` (`cg` input planes) into `buf`: every
    /// entry of every channel, zero where it is padding. With `threads`, channels are
    /// split between them: a serial copy was 10–20 % of a two-thread conv on a small plane.
    /// Requires AVX-512F (as the kernels that read the copy).
    pub(super) fn fill(&self, g: &Geom, x: &[f32], buf: &mut [f32], threads: usize) {
        assert!(
            crate::simd::avx512_available(),
            "the padded copy is for AVX-512 kernels"
        );
        fill_channels(
            &mut buf[..g.cg * self.chan],
            self.chan,
            threads,
            |first, part| {
                // SAFETY: AVX-512F is present (asserted); `part` holds whole channels from
                // `first`.
                unsafe { self.fill_avx512(g, x, first, part) }
            },
        );
    }

    /// `fill`, compiled for AVX-512 so the row copies inline: a copy is a few vectors, and
    /// calls and loop setup per row were most of a stride-2 fill's time.
    #[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx512f"))]
    unsafe fn fill_avx512(&self, g: &Geom, x: &[f32], first: usize, buf: &mut [f32]) {
        let [d, h, w] = &g.ax;
        let [sd, sh, sw] = &self.splits;
        let ip = g.in_plane();
        // Input index of position `pos` of phase `r` along `a`, if inside the input.
        let input = |a: &Axis, r: usize, pos: usize| {
            (pos * a.stride + r)
                .checked_sub(a.pad)
                .filter(|&i| i < a.len)
        };
        let cols: Vec<PhaseCols> = sw
            .phases
            .iter()
            .map(|&r| PhaseCols::new(w, r, self.row))
            .collect();
        for (i, dst) in buf.chunks_mut(self.chan).enumerate() {
            let c = first + i;
            let xc = &x[c * ip..(c + 1) * ip];
            let mut rows = dst.chunks_mut(self.row);
            for &rd in &sd.phases {
                for &rh in &sh.phases {
                    for &pc in &cols {
                        for pd in 0..sd.positions {
                            for ph in 0..sh.positions {
                                let out = rows.next().expect("the copy holds every row");
                                let (Some(id), Some(ih)) = (input(d, rd, pd), input(h, rh, ph))
                                else {
                                    out.fill(0.0);
                                    continue;
                                };
                                let src = &xc[(id * h.len + ih) * w.len..][..w.len];
                                copy_row(w.stride, pc, src, out);
                            }
                        }
                    }
                }
            }
        }
    }

    /// The segments of every vector, in vector order, and where each vector's start
    /// (`starts[v]..starts[v + 1]`).
    fn segments(&self, g: &Geom) -> (Vec<Segment>, Vec<usize>) {
        let [d, h, w] = &g.ax;
        let mut segs = Vec::with_capacity(self.vectors * 2);
        let mut owner = Vec::with_capacity(self.vectors * 2);
        for od in 0..d.out {
            for oh in 0..h.out {
                let base = od * self.plane + oh * self.row;
                let first = (od * h.out + oh) * w.out;
                for v in base / LANES..=(base + w.out - 1) / LANES {
                    let lo = base.max(v * LANES) - v * LANES;
                    let hi = (base + w.out).min((v + 1) * LANES) - v * LANES;
                    let mask = (((1u32 << hi) - 1) & !((1u32 << lo) - 1)) as u16;
                    segs.push(Segment {
                        mask,
                        offset: first as isize + (v * LANES) as isize - base as isize,
                    });
                    owner.push(v);
                }
            }
        }
        let mut starts = vec![0usize; self.vectors + 1];
        for &v in &owner {
            starts[v + 1] += 1;
        }
        for v in 0..self.vectors {
            starts[v + 1] += starts[v];
        }
        (segs, starts)
    }
}

/// Writes into `out` (one phase row of the padded copy) the entries of input row `src`
/// that `pc` names, zero elsewhere.
#[inline(always)]
fn copy_row(stride: usize, pc: PhaseCols, src: &[f32], out: &mut [f32]) {
    let PhaseCols { q0, q1, first } = pc;
    // SAFETY: AVX-512F is present (as above).
    unsafe {
        x86::zero(&mut out[..q0]);
        x86::zero(&mut out[q1..]);
    }
    if q0 == q1 {
        return;
    }
    let out = &mut out[q0..q1];
    let src = &src[first..];
    match stride {
        1 => out.copy_from_slice(&src[..out.len()]),
        2 => {
            assert!(
                src.len() > 2 * (out.len() - 1),
                "phase row reads past the input row"
            );
            // SAFETY: `conv_flat` runs only where AVX-512F is present; lengths checked above.
            unsafe { x86::every_other(src, out) }
        }
        s => {
            for (v, c) in out.iter_mut().zip(src.chunks(s)) {
                *v = c[0];
            }
        }
    }
}

/// `y = conv(x) + bias` (then `max(·, 0)` if `relu`) for one image and group (`x`: its
/// `cg` input planes; `y`: its `og` output planes, every element written), with the weight
/// packed as `pa` (`og` × `cg · taps`). Requires AVX-512F.
pub fn conv_flat(
    g: &Geom,
    pa: &Packed,
    x: &[f32],
    bias: Option<&[f32]>,
    y: &mut [f32],
    threads: usize,
    relu: bool,
) {
    // Not `suits(g)`: that builds the layout a second time; lane use is the caller's choice.
    assert!(
        crate::simd::avx512_available(),
        "the flat conv kernel needs AVX-512"
    );
    let lay = Layout::new(g);
    let op = g.out_plane();
    assert!(
        pa.is_left() && pa.rows == g.og && pa.cols == g.cg * g.taps(),
        "conv weight packed for another shape"
    );
    assert!(y.len() >= g.og * op && x.len() >= g.cg * g.in_plane());
    assert!(
        bias.is_none_or(|b| b.len() == g.og),
        "conv bias of another length"
    );
    // Bias per panel row (zero past the last channel): the tile starts its sums from it.
    let mut starts = vec![0.0f32; g.og.next_multiple_of(MR)];
    if let Some(b) = bias {
        starts[..g.og].copy_from_slice(b);
    }
    let (segs, seg_starts) = lay.segments(g);
    let panels = g.og.div_ceil(MR);
    let out = OutPtr(y.as_mut_ptr());
    let run = |buf: &mut [f32]| {
        lay.fill(g, x, buf, threads);
        let (buf, lay, out, segs, seg_starts) = (&buf[..], &lay, &out, &segs, &seg_starts);
        // Vectors [first, end): every panel over them (a block's inputs stay in L1).
        let block = |first: usize, end: usize| {
            for p in 0..panels {
                let rows = MR.min(g.og - p * MR);
                // Tiles as even as the block allows: 5 vectors as 3 + 2, not 4 + 1 (a
                // one-vector tile is bound by its six weight broadcasts).
                let tiles = (end - first).div_ceil(MAX_VECTORS);
                for t in 0..tiles {
                    let at = first + t * (end - first) / tiles;
                    let n = first + (t + 1) * (end - first) / tiles - at;
                    let vs: [&[Segment]; MAX_VECTORS] = std::array::from_fn(|j| {
                        let v = (at + j).min(lay.vectors - 1);
                        &segs[seg_starts[v]..seg_starts[v + 1]]
                    });
                    // SAFETY: the copy holds every float the vectors' taps read (`len`); the
                    // panel holds cg·taps steps of MR; segments address outputs of the
                    // `rows` planes of op inside y, and these vectors belong to this task;
                    // AVX-512F is present (`suits`).
                    unsafe {
                        x86::dispatch(
                            rows,
                            Steps {
                                channels: g.cg,
                                chan: lay.chan,
                                taps: &lay.taps,
                                relu,
                            },
                            buf.as_ptr().add(at * LANES),
                            &vs[..n],
                            pa.left_panel(p).as_ptr(),
                            &starts[p * MR..(p + 1) * MR],
                            out.0.add(p * MR * op),
                            op,
                        )
                    };
                }
            }
        };
        for_shares(lay.vectors, VECTORS_PER_BLOCK, 1, threads, block);
    };
    with_padded(lay.len(g.cg), run);
}

/// The steps of k of one conv: every tap of every input channel.
#[derive(Clone, Copy)]
struct Steps<'a> {
    channels: usize,
    /// Floats per channel of the padded copy.
    chan: usize,
    taps: &'a [isize],
    /// Clamp the sums at zero before storing them (a ReLU fused into the conv).
    relu: bool,
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Segment, Steps, LANES};
    use crate::kernels::sgemm::MR;
    use crate::simd::first_lanes;
    use std::arch::x86_64::*;

    /// Runs the tile for `rows` (1..=MR) output channels and `v.len()` (1..=4) consecutive
    /// vectors starting at `x` (the first vector's virtual position in channel 0).
    ///
    /// # Safety
    /// AVX-512F present; every tap of every vector reads inside the padded copy; `a` holds
    /// `channels · taps` steps of `MR` floats; `start` holds `rows` initial sums; `y`
    /// addresses `rows` output planes of `ldc` floats and the segments' lanes lie in them.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn dispatch(
        rows: usize,
        k: Steps,
        x: *const f32,
        v: &[&[Segment]],
        a: *const f32,
        start: &[f32],
        y: *mut f32,
        ldc: usize,
    ) {
        macro_rules! go {
            ($r:literal) => {
                match v.len() {
                    1 => tile::<$r, 1>(k, x, [v[0]], a, start, y, ldc),
                    2 => tile::<$r, 2>(k, x, [v[0], v[1]], a, start, y, ldc),
                    3 => tile::<$r, 3>(k, x, [v[0], v[1], v[2]], a, start, y, ldc),
                    _ => tile::<$r, 4>(k, x, [v[0], v[1], v[2], v[3]], a, start, y, ldc),
                }
            };
        }
        // SAFETY: by the contract.
        unsafe {
            match rows {
                1 => go!(1),
                2 => go!(2),
                3 => go!(3),
                4 => go!(4),
                5 => go!(5),
                _ => go!(6),
            }
        }
    }

    /// Zeros `out` with masked stores: the padding of a phase row is a few floats, and
    /// `fill` called memset for each.
    ///
    /// # Safety
    /// AVX-512F present.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn zero(out: &mut [f32]) {
        for o in out.chunks_mut(LANES) {
            // SAFETY: the mask keeps the store inside `o`.
            unsafe {
                _mm512_mask_storeu_ps(o.as_mut_ptr(), first_lanes(o.len()), _mm512_setzero_ps())
            };
        }
    }

    /// `out[i] = src[2i]` (`src` holds at least `2·out.len() - 1` floats), 16 outputs a
    /// step: two loads (masked at the row's end) and a permute keeping the even lanes. The
    /// scalar loop was a third of a stride-2 conv's time.
    ///
    /// # Safety
    /// AVX-512F present.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn every_other(src: &[f32], out: &mut [f32]) {
        let evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        for (i, o) in out.chunks_mut(LANES).enumerate() {
            let left = src.len() - 2 * i * LANES;
            let p = src.as_ptr().add(2 * i * LANES);
            // SAFETY: the masks keep the loads inside `src`, the store inside `o`.
            unsafe {
                let lo = _mm512_maskz_loadu_ps(first_lanes(left), p);
                let hi =
                    _mm512_maskz_loadu_ps(first_lanes(left.saturating_sub(LANES)), p.add(LANES));
                let v = _mm512_permutex2var_ps(lo, evens, hi);
                _mm512_mask_storeu_ps(o.as_mut_ptr(), first_lanes(o.len()), v);
            }
        }
    }

    /// `R` output channels × `V` vectors, accumulated over every step of k.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::needless_range_loop)] // `r` and `j` index the accumulators
    unsafe fn tile<const R: usize, const V: usize>(
        k: Steps,
        x: *const f32,
        segs: [&[Segment]; V],
        a: *const f32,
        start: &[f32],
        y: *mut f32,
        ldc: usize,
    ) {
        // SAFETY (whole body): reads stay inside the padded copy and the panel, writes on
        // the segments' lanes, by `dispatch`'s contract.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); V]; R];
            for r in 0..R {
                acc[r] = [_mm512_set1_ps(start[r]); V];
            }
            let mut a = a;
            let mut step = |p: *const f32, a: *const f32| {
                let mut b = [_mm512_setzero_ps(); V];
                for j in 0..V {
                    b[j] = _mm512_loadu_ps(p.add(j * LANES));
                }
                for r in 0..R {
                    let s = _mm512_set1_ps(*a.add(r));
                    for j in 0..V {
                        acc[r][j] = _mm512_fmadd_ps(s, b[j], acc[r][j]);
                    }
                }
            };
            if let Ok(taps) = <&[isize; 9]>::try_from(k.taps) {
                // 3×3 kernels, the common case: the taps unrolled.
                for c in 0..k.channels {
                    let xc = x.add(c * k.chan);
                    for (i, &t) in taps.iter().enumerate() {
                        step(xc.offset(t), a.add(i * MR));
                    }
                    a = a.add(9 * MR);
                }
            } else {
                for c in 0..k.channels {
                    let xc = x.add(c * k.chan);
                    for &t in k.taps {
                        step(xc.offset(t), a);
                        a = a.add(MR);
                    }
                }
            }
            if k.relu {
                // max(0, v) keeps v where it is NaN (the second operand wins), and -0.0, as
                // the unfused `if v < 0 { 0 } else { v }` does.
                // Indexed, not `iter_mut().flatten()`: an iterator over the accumulators
                // made LLVM keep them in memory, and the whole tile ran 2.5× slower.
                for r in 0..R {
                    for j in 0..V {
                        acc[r][j] = _mm512_max_ps(_mm512_setzero_ps(), acc[r][j]);
                    }
                }
            }
            for r in 0..R {
                let plane = y.add(r * ldc);
                for j in 0..V {
                    for s in segs[j] {
                        // Lane 0's address may lie outside the plane; only the mask's
                        // lanes, which lie inside it, are written (and the address is
                        // computed without claiming it is in bounds).
                        _mm512_mask_storeu_ps(plane.wrapping_offset(s.offset), s.mask, acc[r][j]);
                    }
                }
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    use super::{Segment, Steps};

    /// Never called: the kernel runs only where AVX-512 is present (x86-64).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn dispatch(
        _rows: usize,
        _k: Steps,
        _x: *const f32,
        _v: &[&[Segment]],
        _a: *const f32,
        _start: &[f32],
        _y: *mut f32,
        _ldc: usize,
    ) {
        unreachable!("the flat conv runs only where AVX-512 is present");
    }

    /// Never called, as `dispatch`.
    pub unsafe fn zero(_out: &mut [f32]) {
        unreachable!("the flat conv runs only where AVX-512 is present");
    }

    /// Never called, as `dispatch`.
    pub unsafe fn every_other(_src: &[f32], _out: &mut [f32]) {
        unreachable!("the flat conv runs only where AVX-512 is present");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::conv::testing::{self, Case};

    #[test]
    fn matches_the_definition_on_odd_geometries() {
        if !crate::simd::avx512_available() {
            return;
        }
        let mut cases = testing::odd_geometries();
        // Narrow planes, where vectors span several rows (and a plane's end), and the
        // shapes of a CNN's last stages.
        let more: Vec<Case> = vec![
            (16, 20, vec![8, 8], vec![3, 3], 1, 1, 1),
            (9, 13, vec![7, 7], vec![3, 3], 1, 1, 1),
            (5, 6, vec![14, 14], vec![3, 3], 2, 1, 1),
            (4, 7, vec![3, 4, 5], vec![3, 3, 3], 1, 1, 1),
            (3, 5, vec![5, 6, 7], vec![3, 1, 3], 2, 1, 1),
            (6, 4, vec![40], vec![3], 1, 3, 3),
            (7, 11, vec![9, 9], vec![1, 1], 2, 1, 0),
            (2, 3, vec![2, 2], vec![3, 3], 1, 1, 1),
        ];
        cases.extend(more);
        let runs: Vec<Case> = cases
            .into_iter()
            .filter(|c| {
                let (g, _) = testing::geom(c);
                suits(&g)
            })
            .collect();
        assert!(
            runs.len() >= 14,
            "only {} cases suit the kernel",
            runs.len()
        );
        testing::check_cases(
            &runs,
            conv_flat,
            testing::Weights::Left,
            testing::poison_scratch,
        );
    }

    /// Single-thread speed on the benchmark CNN's shapes:
    /// `cargo test --release -p ember-cpu flat_speed -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn flat_speed() {
        if crate::simd::avx512_available() {
            testing::speed(conv_flat, testing::Weights::Left);
        }
    }

    /// The padded copy's time for the CNN's 32-channel 32×32 input at stride 1 and 2:
    /// `cargo test --release -p ember-cpu fill_speed -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn fill_speed() {
        if !crate::simd::avx512_available() {
            return;
        }
        for s in [1, 2] {
            let (g, [xs, _]) = testing::geom(&(32, 64, vec![32, 32], vec![3, 3], s, 1, 1));
            let x = testing::data(xs.iter().product(), 1);
            let lay = Layout::new(&g);
            let mut buf = vec![0.0f32; lay.len(g.cg)];
            let mut best = f64::MAX;
            for _ in 0..2000 {
                let t = std::time::Instant::now();
                lay.fill(&g, &x, &mut buf, 1);
                best = best.min(t.elapsed().as_secs_f64());
            }
            println!("s{s} fill {:.2} us, {} floats", best * 1e6, buf.len());
        }
    }
}
