//! Dense f32 convolution on AVX-512 with output channels along the vector lanes.
//!
//! `flat` puts output positions along the lanes, so a small plane leaves lanes idle
//! (80 lanes for the 64 outputs of an 8×8 plane, after the taps' reach) and every input
//! load straddles cache lines. Here the roles swap, as in the NCHWc kernels of oneDNN and
//! ONNX Runtime, without their blocked layout: the tile is `R` (≤ 6) output positions by
//! `P` (≤ 4) vectors of 16 output channels. Per step of k (one tap of one input channel)
//! it loads `P` aligned vectors of the weight (packed at compile time as `sgemm`'s right
//! operand, k × output channels) and broadcasts `R` inputs from the padded copy `flat`
//! builds, where each position's input for every tap sits at a fixed offset. Every lane is
//! an output. The tile's result is output-channel-major per position, so it is stored
//! transposed: `R` consecutive outputs of each channel's plane (a few percent of a tile's
//! time at the k of the channel counts this runs on).

use super::flat::Layout;
use super::{for_shares, with_padded, Geom, OutPtr};
use crate::kernels::sgemm::{Packed, NR};

/// Output positions per tile.
const ROWS: usize = 6;
/// Most vectors of output channels per tile (6 × 4 accumulators, 4 loads, a broadcast).
const MAX_PANELS: usize = 4;
/// Steps of k per slice of the weight: 128 steps of 4 vectors (32 KiB) stay in L1.
const KC: usize = 128;
/// Output positions per block of work: every group of output channels runs over a block
/// before the next, so the block's inputs stay in L1 while the weight streams from L2.
const ROWS_PER_BLOCK: usize = 48;

/// Floats of a block's parked sums: every tile's ROWS × MAX_PANELS vectors.
const PARTIAL: usize = ROWS_PER_BLOCK.div_ceil(ROWS) * ROWS * MAX_PANELS * NR;

/// Whether the kernel runs here (AVX-512) and beats `flat` on this conv: output channels
/// fill whole tiles (a multiple of 64 keeps every tile 6 × 4) and `flat` would leave more
/// than one lane in twelve idle (planes of 16 × 16 and smaller, for 3 × 3 taps).
pub fn suits(g: &Geom) -> bool {
    crate::simd::avx512_available()
        && g.ax
            .iter()
            .all(|a| a.kernel > 0 && a.out > 0 && a.stride > 0)
        && g.og.is_multiple_of(MAX_PANELS * NR)
        && {
            let lay = Layout::new(g);
            g.out_plane() * 12 < lay.lanes() * 11
        }
}

/// `y = conv(x) + bias` (then `max(·, 0)` if `relu`) for one image and group (`x`: its
/// `cg` input planes; `y`: its `og` output planes, every element written), with the weight
/// packed as the right operand `pb` (`cg · taps` × `og`). Requires AVX-512F.
pub fn conv_channels(
    g: &Geom,
    pb: &Packed,
    x: &[f32],
    bias: Option<&[f32]>,
    y: &mut [f32],
    threads: usize,
    relu: bool,
) {
    assert!(
        crate::simd::avx512_available(),
        "the channel-lane conv kernel needs AVX-512"
    );
    let lay = Layout::new(g);
    let op = g.out_plane();
    assert!(
        !pb.is_left() && pb.rows == g.cg * g.taps() && pb.cols == g.og,
        "conv weight packed for another shape"
    );
    assert!(y.len() >= g.og * op && x.len() >= g.cg * g.in_plane());
    assert!(
        bias.is_none_or(|b| b.len() == g.og),
        "conv bias of another length"
    );
    // Bias per lane (zero past the last channel): the tile starts its sums from it.
    let mut starts = vec![0.0f32; g.og.next_multiple_of(NR)];
    if let Some(b) = bias {
        starts[..g.og].copy_from_slice(b);
    }
    // Where each output position's inputs start in the padded copy.
    let [d, h, w] = &g.ax;
    let mut origins = Vec::with_capacity(op);
    for od in 0..d.out {
        for oh in 0..h.out {
            let base = od * lay.plane + oh * lay.row;
            origins.extend((base..base + w.out).map(|p| p as isize));
        }
    }
    let panels = g.og.div_ceil(NR);
    let out = OutPtr(y.as_mut_ptr());
    let run = |buf: &mut [f32]| {
        lay.fill(g, x, buf, threads);
        let (buf, lay, out, origins, starts) = (&buf[..], &lay, &out, &origins, &starts);
        // Output positions [first, end): every group of output channels over them.
        let block = |first: usize, end: usize| {
            // Tiles as even as the block allows (49 positions as 9 tiles of 5–6, not 8 of
            // 6 and one of 1, which is bound by its weight loads).
            let tiles = (end - first).div_ceil(ROWS);
            let tile_at = |t: usize| first + t * (end - first) / tiles;
            // On the stack: a fresh heap buffer per block was a calloc and free per call.
            let mut partial = [0.0f32; PARTIAL];
            for q in (0..panels).step_by(MAX_PANELS) {
                let n = MAX_PANELS.min(panels - q);
                let weights: [*const f32; MAX_PANELS] =
                    std::array::from_fn(|h| pb.right_panel((q + h).min(panels - 1)).as_ptr());
                let live = (g.og - q * NR).min(n * NR);
                // Input channels a slice of the weight (KC steps of every vector) holds: the
                // slice stays in L1 while every tile of the block runs over it, the tiles'
                // sums parked in `partial` between slices.
                let per = (KC / g.taps()).max(1);
                for c0 in (0..g.cg).step_by(per) {
                    let chans = c0..(c0 + per).min(g.cg);
                    let (from_bias, to_out) = (c0 == 0, chans.end == g.cg);
                    for t in 0..tiles {
                        let (at, to) = (tile_at(t), tile_at(t + 1));
                        // SAFETY: the copy holds every float these positions' taps read
                        // (`Layout::len`); each panel holds cg·taps steps of NR; the
                        // outputs (channels q·NR.., positions at..to) lie in y and belong to
                        // this task; `partial` holds this tile's sums; AVX-512F is present
                        // (asserted above).
                        unsafe {
                            x86::dispatch(
                                (to - at, n),
                                Steps {
                                    chans: chans.clone(),
                                    chan: lay.chan,
                                    taps: &lay.taps,
                                },
                                buf.as_ptr(),
                                &origins[at..to],
                                &weights[..n],
                                Sums {
                                    bias: from_bias.then(|| starts[q * NR..].as_ptr()),
                                    partial: partial[t * ROWS * MAX_PANELS * NR..].as_mut_ptr(),
                                    out: to_out.then(|| out.0.add(q * NR * op + at)),
                                    relu,
                                },
                                (op, live),
                            )
                        };
                    }
                }
            }
        };
        // Blocks as even as the plane allows (49 positions as 25 + 24, not 48 + 1).
        for_shares(op, ROWS_PER_BLOCK, ROWS, threads, block);
    };
    with_padded(lay.len(g.cg), run);
}

/// The steps of k a tile call runs: every tap of some input channels.
#[derive(Clone)]
struct Steps<'a> {
    chans: std::ops::Range<usize>,
    /// Floats per channel of the padded copy.
    chan: usize,
    taps: &'a [isize],
}

/// Where a tile call's sums start and go.
struct Sums {
    /// The bias per lane (`P · NR` floats) when this call runs the first channels; else
    /// the sums continue from `partial`.
    bias: Option<*const f32>,
    /// The tile's parked sums (`ROWS · MAX_PANELS · NR` floats).
    partial: *mut f32,
    /// The first output of the first channel's plane when this call runs the last
    /// channels; else the sums are parked in `partial`.
    out: Option<*mut f32>,
    /// Clamp the sums at zero before storing them to `out` (a ReLU fused into the conv).
    relu: bool,
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Steps, Sums, MAX_PANELS, ROWS};
    use crate::kernels::sgemm::NR;
    use std::arch::x86_64::*;

    /// Runs the tile for `rows` (1..=6) output positions at `origins` and `panels` (1..=4)
    /// vectors of output channels.
    ///
    /// # Safety
    /// AVX-512F present; every tap of every position reads inside the padded copy `x`; each
    /// weight panel holds `k.chans.end · taps` steps of `NR`; `sums` addresses what its
    /// fields say, the output's planes `ldc` apart with the `live` channels' `rows`
    /// outputs inside the destination.
    pub unsafe fn dispatch(
        (rows, panels): (usize, usize),
        k: Steps,
        x: *const f32,
        origins: &[isize],
        weights: &[*const f32],
        sums: Sums,
        (ldc, live): (usize, usize),
    ) {
        let o: [isize; ROWS] = std::array::from_fn(|r| origins[r.min(rows - 1)]);
        let w: [*const f32; MAX_PANELS] = std::array::from_fn(|h| weights[h.min(panels - 1)]);
        macro_rules! go {
            ($r:literal) => {
                match panels {
                    1 => tile::<$r, 1>(k, x, o, w, sums, (ldc, live)),
                    2 => tile::<$r, 2>(k, x, o, w, sums, (ldc, live)),
                    3 => tile::<$r, 3>(k, x, o, w, sums, (ldc, live)),
                    _ => tile::<$r, 4>(k, x, o, w, sums, (ldc, live)),
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

    /// `R` output positions × `P` vectors of output channels over the steps of `k`.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::needless_range_loop)] // `r` and `h` index the accumulators
    unsafe fn tile<const R: usize, const P: usize>(
        k: Steps,
        x: *const f32,
        origins: [isize; ROWS],
        weights: [*const f32; MAX_PANELS],
        sums: Sums,
        (ldc, live): (usize, usize),
    ) {
        // SAFETY (whole body): reads stay inside the padded copy, the panels, the bias and
        // `partial`; writes inside `partial` or the live channels' R outputs, by
        // `dispatch`'s contract.
        unsafe {
            let parked = |r: usize, h: usize| sums.partial.add((r * MAX_PANELS + h) * NR);
            let mut acc = [[_mm512_setzero_ps(); P]; R];
            for h in 0..P {
                for r in 0..R {
                    acc[r][h] = match sums.bias {
                        Some(b) => _mm512_loadu_ps(b.add(h * NR)),
                        None => _mm512_loadu_ps(parked(r, h)),
                    };
                }
            }
            let taps = k.taps.len();
            let mut step = |off: isize, kk: usize| {
                let mut b = [_mm512_setzero_ps(); P];
                for h in 0..P {
                    b[h] = _mm512_loadu_ps(weights[h].add(kk * NR));
                }
                for r in 0..R {
                    let s = _mm512_set1_ps(*x.offset(origins[r] + off));
                    for h in 0..P {
                        acc[r][h] = _mm512_fmadd_ps(s, b[h], acc[r][h]);
                    }
                }
            };
            for c in k.chans {
                let base = (c * k.chan) as isize;
                for (t, &tap) in k.taps.iter().enumerate() {
                    step(base + tap, c * taps + t);
                }
            }
            let Some(y) = sums.out else {
                for h in 0..P {
                    for r in 0..R {
                        _mm512_storeu_ps(parked(r, h), acc[r][h]);
                    }
                }
                return;
            };
            if sums.relu {
                // max(0, v) keeps v where it is NaN (the second operand wins), and -0.0, as
                // the unfused `if v < 0 { 0 } else { v }` does.
                // Indexed, not `iter_mut().flatten()`: an iterator over the accumulators
                // made LLVM keep them in memory, and the whole tile ran 2.5× slower.
                for r in 0..R {
                    for h in 0..P {
                        acc[r][h] = _mm512_max_ps(_mm512_setzero_ps(), acc[r][h]);
                    }
                }
            }
            // Transposed store: lane j of acc[r][h] is output position r of channel
            // h·16 + j.
            let mut tmp = [[0.0f32; NR]; R];
            for h in 0..P {
                for r in 0..R {
                    _mm512_storeu_ps(tmp[r].as_mut_ptr(), acc[r][h]);
                }
                for j in 0..NR.min(live.saturating_sub(h * NR)) {
                    let dst = y.add((h * NR + j) * ldc);
                    for r in 0..R {
                        *dst.add(r) = tmp[r][j];
                    }
                }
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    use super::{Steps, Sums};

    /// Never called: the kernel runs only where AVX-512 is present (x86-64).
    pub unsafe fn dispatch(
        _shape: (usize, usize),
        _k: Steps,
        _x: *const f32,
        _origins: &[isize],
        _weights: &[*const f32],
        _sums: Sums,
        _ldc: (usize, usize),
    ) {
        unreachable!("the channel-lane conv runs only where AVX-512 is present");
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
        // Channel counts off the 16-lane grid (partial last vector and tile), planes whose
        // size is no multiple of six, strides, dilation, 1-D and 3-D.
        let mut cases = testing::odd_geometries();
        let more: Vec<Case> = vec![
            (16, 64, vec![8, 8], vec![3, 3], 1, 1, 1),
            (9, 70, vec![7, 7], vec![3, 3], 1, 1, 1),
            (5, 33, vec![14, 14], vec![3, 3], 2, 1, 1),
            (4, 17, vec![3, 4, 5], vec![3, 3, 3], 1, 1, 1),
            (6, 128, vec![40], vec![3], 1, 3, 3),
            (7, 64, vec![9, 9], vec![1, 1], 2, 1, 0),
            (2, 20, vec![2, 2], vec![3, 3], 1, 1, 1),
        ];
        cases.extend(more);
        testing::check_cases(
            &cases,
            conv_channels,
            testing::Weights::Right,
            testing::poison_scratch,
        );
    }

    /// Single-thread speed on the benchmark CNN's shapes:
    /// `cargo test --release -p ember-cpu channels_speed -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn channels_speed() {
        if crate::simd::avx512_available() {
            testing::speed(conv_channels, testing::Weights::Right);
        }
    }
}
