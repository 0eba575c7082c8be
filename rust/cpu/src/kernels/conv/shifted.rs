//! Dense f32 convolution on AVX2 + FMA without im2col.
//!
//! im2col writes every input value once per kernel tap (nine times the input for a 3×3
//! conv) only for the GEMM to read it back. Here `sgemm`'s 6×16 register tile reads its
//! right operand straight from a zero-padded copy of the input: for one tap and 8
//! consecutive outputs along the last spatial axis, the inputs read are consecutive in that
//! copy once each padded row is split into `stride` phases (phase φ holds padded columns
//! φ, φ + s, φ + 2s, …), so a step of k is two unaligned 8-lane loads at a per-tap offset,
//! six weight broadcasts and twelve FMAs, as in the GEMM. The weight is the conv's packed
//! left operand (`sgemm::Packed::a`: panels of `MR` output channels, k-major, with
//! k = input channel · taps + tap), packed once at compile time.
//!
//! The padded copy costs about one pass over the input; output rows narrower than 8 leave
//! lanes idle, so `suits` keeps narrow outputs on the im2col path.

use super::{fill_channels, for_shares, with_padded, Geom, OutPtr, PhaseCols};
use crate::kernels::sgemm::{Packed, MR};

/// Lanes per vector: outputs along the last spatial axis that one load covers.
const LANES: usize = 8;
/// Pairs of vectors (one register tile's columns) per block of work: a weight panel is read
/// once per block. Measured single-threaded on the ResNet shapes (`shifted_speed`): 8 was
/// up to 10 % faster than 1 on the large planes and no slower elsewhere.
const PAIRS_PER_BLOCK: usize = 8;

/// Whether the shifted kernel should run this conv: enough of each output row fills whole
/// vectors (7 of 8 lanes for a row of 7, 12 of 16 for a row of 12).
pub fn suits(g: &Geom) -> bool {
    let wo = g.ax[2].out;
    g.ax.iter().all(|a| a.kernel > 0 && a.out > 0) && wo * 10 >= wo.next_multiple_of(LANES) * 7
}

/// Where things lie in the padded input of one image and group.
struct Layout {
    /// Floats per input channel, per padded depth plane, per padded row (all its phases),
    /// per phase.
    chan: usize,
    plane: usize,
    row: usize,
    phase: usize,
    /// Offset of each kernel tap (weight order) from a vector's origin.
    taps: Vec<isize>,
}

impl Layout {
    fn new(g: &Geom) -> Layout {
        let [d, h, w] = &g.ax;
        // Padded extent an axis's outputs read: up to the last output's last tap.
        let extent = |a: &crate::kernels::window::Axis| {
            (a.out - 1) * a.stride + (a.kernel - 1) * a.dilation + 1
        };
        // Each phase holds the columns of its outputs' vectors, rounded up to whole vectors,
        // plus the furthest tap's shift: no load runs past its phase.
        let phase = w.out.next_multiple_of(LANES) + (w.kernel - 1) * w.dilation / w.stride;
        let row = phase * w.stride;
        let plane = row * extent(h);
        let chan = plane * extent(d);
        let mut taps = Vec::with_capacity(g.taps());
        for i in 0..d.kernel {
            for j in 0..h.kernel {
                for l in 0..w.kernel {
                    let col = l * w.dilation;
                    taps.push(
                        (i * d.dilation * plane
                            + j * h.dilation * row
                            + (col % w.stride) * phase
                            + col / w.stride) as isize,
                    );
                }
            }
        }
        Layout {
            chan,
            plane,
            row,
            phase,
            taps,
        }
    }

    /// Writes the zero-padded, phase-split copy of `x` (`cg` channels of the input plane)
    /// into `buf` (`cg · chan` floats).
    /// Rows, planes and phases no tap reads (a strided 1×1 conv reads one row in `stride`
    /// and one phase) are left zero, not copied.
    /// With `threads`, channels are split between them (as `flat`'s copy).
    fn fill(&self, g: &Geom, x: &[f32], buf: &mut [f32], threads: usize) {
        let [d, h, w] = &g.ax;
        let ip = g.in_plane();
        let (rows_d, rows_h) = (self.chan / self.plane, self.plane / self.row);
        // Whether padded row `r` of axis `a` is read by some output's tap.
        let read = |a: &crate::kernels::window::Axis, rows: usize| -> Vec<bool> {
            let mut used = vec![false; rows];
            for o in 0..a.out {
                for k in 0..a.kernel {
                    used[o * a.stride + k * a.dilation] = true;
                }
            }
            used
        };
        let (used_d, used_h) = (read(d, rows_d), read(h, rows_h));
        let mut used_phase = vec![false; w.stride];
        for l in 0..w.kernel {
            used_phase[l * w.dilation % w.stride] = true;
        }
        // Input index of padded row `r` along `a`, if it is not padding.
        let inside = |r: usize, a: &crate::kernels::window::Axis| {
            r.checked_sub(a.pad).filter(|&i| i < a.len)
        };
        let cols: Vec<PhaseCols> = (0..w.stride)
            .map(|phi| PhaseCols::new(w, phi, self.phase))
            .collect();
        let channel = |c: usize, dst: &mut [f32]| {
            // One zeroing pass over the channel (a single `memset`), then the input rows over
            // it: zeroing each padded row was a library call per row (LLVM turns a short
            // loop of stores into `memset`), slower than the extra stores.
            dst.fill(0.0);
            let xc = &x[c * ip..(c + 1) * ip];
            for rd in (0..rows_d).filter(|&r| used_d[r]) {
                let Some(id) = inside(rd, d) else { continue };
                for rh in (0..rows_h).filter(|&r| used_h[r]) {
                    let Some(ih) = inside(rh, h) else { continue };
                    let out = &mut dst[rd * self.plane + rh * self.row..][..self.row];
                    let src = &xc[(id * h.len + ih) * w.len..][..w.len];
                    for (phi, part) in out.chunks_mut(self.phase).enumerate() {
                        let PhaseCols { q0, q1, first } = cols[phi];
                        if !used_phase[phi] || q0 == q1 {
                            continue;
                        }
                        let (part, src) = (&mut part[q0..q1], &src[first..]);
                        match w.stride {
                            1 => part.copy_from_slice(&src[..part.len()]),
                            // SAFETY: `conv_shifted` runs only where AVX2 is present;
                            // `PhaseCols` keeps column q1 - 1 inside the row.
                            2 => unsafe { x86::every_other(src, part) },
                            s => {
                                for (v, c) in part.iter_mut().zip(src.chunks(s)) {
                                    *v = c[0];
                                }
                            }
                        }
                    }
                }
            }
        };
        fill_channels(
            &mut buf[..g.cg * self.chan],
            self.chan,
            threads,
            |first, part| {
                for (i, dst) in part.chunks_mut(self.chan).enumerate() {
                    channel(first + i, dst);
                }
            },
        );
    }
}

/// One output vector: 8 (or `live`) consecutive outputs of one output row.
#[derive(Clone, Copy)]
struct Vector {
    /// Offset of its first tap-0 input in the padded copy, and of its first output in an
    /// output plane.
    input: usize,
    output: usize,
    live: usize,
}

fn vector(g: &Geom, lay: &Layout, v: usize) -> Vector {
    let [d, h, w] = &g.ax;
    let per_row = w.out.div_ceil(LANES);
    let (orow, ow0) = (v / per_row, v % per_row * LANES);
    let (od, oh) = (orow / h.out, orow % h.out);
    Vector {
        input: od * d.stride * lay.plane + oh * h.stride * lay.row + ow0,
        output: orow * w.out + ow0,
        live: LANES.min(w.out - ow0),
    }
}

/// `y = conv(x) + bias` (then `max(·, 0)` if `relu`) for one image and group (`x`: its
/// `cg` input planes; `y`: its `og` output planes, every element written), with the weight
/// packed as `pa` (`og` × `cg · taps`) and `bias` (`og` values) added. Requires
/// `sgemm::available()`.
pub fn conv_shifted(
    g: &Geom,
    pa: &Packed,
    x: &[f32],
    bias: Option<&[f32]>,
    y: &mut [f32],
    threads: usize,
    relu: bool,
) {
    conv_shifted_plus(g, pa, x, bias, None, y, threads, relu)
}

/// `conv_shifted` with `residual` (laid out as `y`) added to the sums before the clamp and
/// the store: a block's `relu(conv(x) + bias + residual)` in one pass over the outputs,
/// rounding as the unfused add does (`(conv + bias) + residual`).
#[allow(clippy::too_many_arguments)]
pub fn conv_shifted_plus(
    g: &Geom,
    pa: &Packed,
    x: &[f32],
    bias: Option<&[f32]>,
    residual: Option<&[f32]>,
    y: &mut [f32],
    threads: usize,
    relu: bool,
) {
    let lay = Layout::new(g);
    let op = g.out_plane();
    assert!(
        pa.is_left() && pa.rows == g.og && pa.cols == g.cg * g.taps(),
        "conv weight packed for another shape"
    );
    assert!(y.len() >= g.og * op && x.len() >= g.cg * g.in_plane());
    assert!(
        residual.is_none_or(|r| r.len() >= g.og * op),
        "conv residual shorter than the output"
    );
    assert!(
        bias.is_none_or(|b| b.len() == g.og),
        "conv bias of another length"
    );
    // Bias per panel row (zero past the last channel), so the tile starts its sums from it.
    let mut starts = vec![0.0f32; g.og.next_multiple_of(MR)];
    if let Some(b) = bias {
        starts[..g.og].copy_from_slice(b);
    }
    let vectors = op / g.ax[2].out * g.ax[2].out.div_ceil(LANES);
    let pairs = vectors.div_ceil(2);
    let panels = g.og.div_ceil(MR);
    let out = OutPtr(y.as_mut_ptr());
    let run = |buf: &mut [f32]| {
        lay.fill(g, x, buf, threads);
        let (buf, lay, out) = (&buf[..], &lay, &out);
        // Pairs [first, end): every panel of the weight over their vectors in turn, so a
        // panel is read from L2 once per block.
        let block = |first: usize, end: usize| {
            let (first, end) = (2 * first, (2 * end).min(vectors));
            for p in 0..panels {
                let rows = MR.min(g.og - p * MR);
                let per = vectors_per_tile(rows);
                for at in (first..end).step_by(per) {
                    let n = per.min(end - at);
                    let mut vs = [vector(g, lay, at); MAX_VECTORS];
                    for (j, v) in vs.iter_mut().enumerate().take(n).skip(1) {
                        *v = vector(g, lay, at + j);
                    }
                    // SAFETY: the padded copy holds every input any tap of these vectors
                    // reads (`Layout`); the panel holds cg·taps steps of MR; the outputs lie
                    // inside y (rows of op), and these vectors belong to this task.
                    unsafe {
                        x86::dispatch(
                            rows,
                            Steps {
                                channels: g.cg,
                                chan: lay.chan,
                                taps: &lay.taps,
                                relu,
                                addend: residual.map(|r| &r[p * MR * op..]),
                            },
                            buf.as_ptr(),
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
        for_shares(pairs, PAIRS_PER_BLOCK, 1, threads, block);
    };
    with_padded(g.cg * lay.chan, run);
}

/// Most vectors one tile call takes.
const MAX_VECTORS: usize = 4;

/// Vectors per tile call for a panel of `rows` output channels: enough accumulators
/// (rows × vectors) to cover the FMA latency (two pipes × 4–5 cycles on the AMD and
/// Intel cores we target), within the 16 vector registers (accumulators + loaded vectors + one
/// broadcast). A full panel takes a pair (12 accumulators); the last panel of a channel
/// count that is not a multiple of 6 (2 rows for 32 channels) would otherwise sit at 4.
fn vectors_per_tile(rows: usize) -> usize {
    match rows {
        1 | 2 => 4,
        3 => 3,
        _ => 2,
    }
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
    /// Values to add to the sums before the clamp, laid out as the outputs (`y`, `ldc`).
    addend: Option<&'a [f32]>,
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Steps, Vector, LANES};
    use crate::kernels::sgemm::MR;
    use std::arch::x86_64::*;

    /// `out[i] = src[2i]`: 8 outputs from two loads, a shuffle picking the wanted lanes of
    /// each 128-bit half and a permute joining the halves; the last 8 overlap the previous
    /// ones. (A scalar gather was a quarter of a stride-2 conv's time; a scalar tail, half
    /// of a 16-column phase row.)
    ///
    /// # Safety
    /// AVX2 present.
    #[target_feature(enable = "avx2")]
    pub unsafe fn every_other(src: &[f32], out: &mut [f32]) {
        let n = out.len();
        assert!(
            n == 0 || src.len() > 2 * (n - 1),
            "phase row reads past the input row"
        );
        if n < LANES {
            for (j, v) in out.iter_mut().enumerate() {
                *v = src[2 * j];
            }
            return;
        }
        let (s, o) = (src.as_ptr(), out.as_mut_ptr());
        // Outputs [i, i + 8) are src[2i], …, src[2i + 14]: the second load starts at 2i + 7
        // (not 2i + 8) so that it ends at src[2i + 14], inside src even for the last block.
        let block = |i: usize| {
            // SAFETY: i + 8 <= n, so the loads cover [2i, 2i + 15) within src (whose length
            // is at least 2n - 1) and the store [i, i + 8) within out.
            unsafe {
                let lo = _mm256_loadu_ps(s.add(2 * i));
                let hi = _mm256_loadu_ps(s.add(2 * i + 7));
                // [lo0 lo2 hi1 hi3 | lo4 lo6 hi5 hi7] → [lo0 lo2 lo4 lo6 hi1 hi3 hi5 hi7].
                let picked = _mm256_shuffle_ps::<0b11_01_10_00>(lo, hi);
                let joined = _mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(picked));
                _mm256_storeu_ps(o.add(i), _mm256_castpd_ps(joined));
            }
        };
        for i in (0..n - LANES).step_by(LANES) {
            block(i);
        }
        block(n - LANES);
    }

    /// Runs the tile for `rows` (1..=MR) output channels and `v` (1..=4) vectors.
    ///
    /// # Safety
    /// AVX2 and FMA present; `x` holds every input the vectors' taps read; `a` holds
    /// `channels · taps` steps of `MR` floats; `start` holds `rows` initial sums (the bias);
    /// `y` addresses `rows` output planes of `ldc` floats, each containing the vectors'
    /// outputs.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn dispatch(
        rows: usize,
        k: Steps,
        x: *const f32,
        v: &[Vector],
        a: *const f32,
        start: &[f32],
        y: *mut f32,
        ldc: usize,
    ) {
        macro_rules! go {
            ($r:literal, $($n:literal)+) => {
                match v.len() {
                    $($n => tile::<$r, $n>(k, x, std::array::from_fn(|j| v[j]), a, start, y, ldc),)+
                    // A count not instantiated for this row count: one vector at a time.
                    _ => v.iter().for_each(|&vj| tile::<$r, 1>(k, x, [vj], a, start, y, ldc)),
                }
            };
        }
        // SAFETY: by the contract. (`vectors_per_tile` picks the counts each row count
        // gets; only those are instantiated, any other runs vector by vector.)
        unsafe {
            match rows {
                1 => go!(1, 1 2 3 4),
                2 => go!(2, 1 2 3 4),
                3 => go!(3, 1 2 3),
                4 => go!(4, 1 2),
                5 => go!(5, 1 2),
                _ => go!(6, 1 2),
            }
        }
    }

    /// `R` output channels × `V` vectors, accumulated over every step of k.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::needless_range_loop)] // `r` and `j` index the accumulators
    unsafe fn tile<const R: usize, const V: usize>(
        k: Steps,
        x: *const f32,
        v: [Vector; V],
        a: *const f32,
        start: &[f32],
        y: *mut f32,
        ldc: usize,
    ) {
        // SAFETY (whole body): reads stay inside the padded copy and the panel, writes inside
        // the vectors' outputs, by `dispatch`'s contract.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); V]; R];
            for r in 0..R {
                acc[r] = [_mm256_set1_ps(start[r]); V];
            }
            // Each vector's inputs sit at a fixed distance from the first one's.
            let mut shift = [0isize; V];
            for j in 0..V {
                shift[j] = v[j].input as isize - v[0].input as isize;
            }
            let mut a = a;
            let mut step = |p: *const f32, a: *const f32| {
                let mut b = [_mm256_setzero_ps(); V];
                for j in 0..V {
                    b[j] = _mm256_loadu_ps(p.offset(shift[j]));
                }
                for r in 0..R {
                    let s = _mm256_broadcast_ss(&*a.add(r));
                    for j in 0..V {
                        acc[r][j] = _mm256_fmadd_ps(s, b[j], acc[r][j]);
                    }
                }
            };
            if let Ok(taps) = <&[isize; 9]>::try_from(k.taps) {
                // 3×3 kernels, the common case: the taps unrolled.
                for c in 0..k.channels {
                    let xc = x.add(c * k.chan + v[0].input);
                    for (i, &t) in taps.iter().enumerate() {
                        step(xc.offset(t), a.add(i * MR));
                    }
                    a = a.add(9 * MR);
                }
            } else {
                for c in 0..k.channels {
                    let xc = x.add(c * k.chan + v[0].input);
                    for &t in k.taps {
                        step(xc.offset(t), a);
                        a = a.add(MR);
                    }
                }
            }
            if let Some(res) = k.addend {
                for r in 0..R {
                    for j in 0..V {
                        let src = res.as_ptr().add(r * ldc + v[j].output);
                        let add = if v[j].live == LANES {
                            _mm256_loadu_ps(src)
                        } else {
                            let mut tmp = [0.0f32; LANES];
                            std::ptr::copy_nonoverlapping(src, tmp.as_mut_ptr(), v[j].live);
                            _mm256_loadu_ps(tmp.as_ptr())
                        };
                        acc[r][j] = _mm256_add_ps(acc[r][j], add);
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
                        acc[r][j] = _mm256_max_ps(_mm256_setzero_ps(), acc[r][j]);
                    }
                }
            }
            for r in 0..R {
                for j in 0..V {
                    let out = y.add(r * ldc + v[j].output);
                    if v[j].live == LANES {
                        _mm256_storeu_ps(out, acc[r][j]);
                    } else {
                        let mut tmp = [0.0f32; LANES];
                        _mm256_storeu_ps(tmp.as_mut_ptr(), acc[r][j]);
                        std::ptr::copy_nonoverlapping(tmp.as_ptr(), out, v[j].live);
                    }
                }
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    use super::{Steps, Vector};

    /// Never called, as `dispatch`.
    pub unsafe fn every_other(_src: &[f32], _out: &mut [f32]) {
        unreachable!("the shifted conv runs only where sgemm::available() is true");
    }

    /// Never called: the kernel runs only where `sgemm::available()` holds (x86-64).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn dispatch(
        _rows: usize,
        _k: Steps,
        _x: *const f32,
        _v: &[Vector],
        _a: *const f32,
        _start: &[f32],
        _y: *mut f32,
        _ldc: usize,
    ) {
        unreachable!("the shifted conv runs only where sgemm::available() is true");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::conv::testing;

    #[test]
    fn matches_the_definition_on_odd_geometries() {
        if !crate::kernels::sgemm::available() {
            return;
        }
        // Stale NaNs in the scratch: a tap reading a row or phase the fill skipped shows
        // up in the result.
        testing::check_cases(
            &testing::odd_geometries(),
            conv_shifted,
            testing::Weights::Left,
            testing::poison_scratch,
        );
    }

    #[test]
    fn matches_the_definition_with_stride_two() {
        if !crate::kernels::sgemm::available() {
            return;
        }
        // Phase rows of exactly 8 columns (the deinterleave's loads end on the row's last
        // input), of 16 and 24 (a block ending short of the row), 1×1 convs reading one
        // phase, and padding of 2.
        let cases: Vec<testing::Case> = vec![
            (3, 8, vec![8, 16], vec![3, 3], 2, 1, 1),
            (5, 7, vec![9, 32], vec![3, 3], 2, 1, 1),
            (4, 6, vec![5, 47], vec![3, 3], 2, 1, 1),
            (6, 5, vec![6, 34], vec![1, 1], 2, 1, 0),
            (2, 9, vec![7, 30], vec![5, 5], 2, 1, 2),
        ];
        assert!(cases.iter().all(|c| suits(&testing::geom(c).0)));
        testing::check_cases(
            &cases,
            conv_shifted,
            testing::Weights::Left,
            testing::poison_scratch,
        );
    }

    /// Single-thread speed on the benchmark CNN's shapes:
    /// `cargo test --release -p ember-cpu shifted_speed -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn shifted_speed() {
        if crate::kernels::sgemm::available() {
            testing::speed(conv_shifted, testing::Weights::Left);
        }
    }
}
