//! Test helpers the conv kernels share: the conv by its definition, odd geometries, and a
//! speed run on the benchmark CNN's shapes.

use super::{Geom, Params};
use crate::kernels::sgemm::{Packed, Strided};
pub use crate::kernels::testing::data;

/// A kernel under test: `y = conv(x) + bias` for one image and group.
pub type Kernel = fn(&Geom, &Packed, &[f32], Option<&[f32]>, &mut [f32], usize, bool);

/// (channels in, out, spatial dims, kernel, stride, dilation, padding)
pub type Case = (usize, usize, Vec<usize>, Vec<usize>, usize, usize, usize);

/// The conv of one image, one group, by its definition.
pub fn reference(g: &Geom, x: &[f32], w: &[f32]) -> Vec<f64> {
    let [d, h, wa] = &g.ax;
    let inside = |v: isize, a: &crate::kernels::window::Axis| v >= 0 && (v as usize) < a.len;
    let mut y = vec![0.0f64; g.og * g.out_plane()];
    for oc in 0..g.og {
        for od in 0..d.out {
            for oh in 0..h.out {
                for ow in 0..wa.out {
                    let mut s = 0.0f64;
                    for c in 0..g.cg {
                        let mut t = 0;
                        for i in 0..d.kernel {
                            for j in 0..h.kernel {
                                for l in 0..wa.kernel {
                                    let id = (od * d.stride) as isize + d.tap_offset(i);
                                    let ih = (oh * h.stride) as isize + h.tap_offset(j);
                                    let iw = (ow * wa.stride) as isize + wa.tap_offset(l);
                                    if inside(id, d) && inside(ih, h) && inside(iw, wa) {
                                        let xi = ((c * d.len + id as usize) * h.len + ih as usize)
                                            * wa.len
                                            + iw as usize;
                                        s +=
                                            x[xi] as f64 * w[(oc * g.cg + c) * g.taps() + t] as f64;
                                    }
                                    t += 1;
                                }
                            }
                        }
                    }
                    y[((oc * d.out + od) * h.out + oh) * wa.out + ow] = s;
                }
            }
        }
    }
    y
}

pub fn out_len(len: usize, k: usize, s: usize, d: usize, p: (usize, usize)) -> usize {
    (len + p.0 + p.1 - d * (k - 1) - 1) / s + 1
}

/// Geometries off the beaten path: strides, dilations, padding wider than the stride,
/// 1-D and 3-D, channel counts that leave partial weight panels.
pub fn odd_geometries() -> Vec<Case> {
    vec![
        (3, 32, vec![17, 19], vec![3, 3], 1, 1, 1),
        (5, 7, vec![9, 21], vec![3, 3], 2, 1, 1),
        (4, 13, vec![11, 12], vec![5, 3], 3, 1, 2),
        (6, 8, vec![10, 16], vec![3, 3], 1, 2, 2),
        (2, 3, vec![30], vec![4], 1, 1, 0),
        (3, 6, vec![4, 5, 9], vec![2, 3, 3], 1, 1, 1),
        (8, 12, vec![8, 8], vec![1, 1], 2, 1, 0),
        (3, 1, vec![7, 33], vec![3, 3], 1, 1, 1),
        // Padding wider than the stride: each phase starts with its own zeros.
        (2, 4, vec![7, 23], vec![5, 5], 2, 1, 3),
        (3, 9, vec![6, 29], vec![3, 4], 3, 2, 4),
    ]
}

pub fn geom(case: &Case) -> (Geom, [Vec<usize>; 2]) {
    let (cg, og, dims, kernel, s, dil, pad) = case;
    let k = dims.len();
    let out: Vec<usize> = (0..k)
        .map(|a| out_len(dims[a], kernel[a], *s, *dil, (*pad, *pad)))
        .collect();
    let xs: Vec<usize> = [1, *cg].into_iter().chain(dims.iter().copied()).collect();
    let ws: Vec<usize> = [*og, *cg]
        .into_iter()
        .chain(kernel.iter().copied())
        .collect();
    let ys: Vec<usize> = [1, *og].into_iter().chain(out.iter().copied()).collect();
    let (stride, dilation, padding) = (
        vec![*s as i64; k],
        vec![*dil as i64; k],
        vec![(*pad as i64, *pad as i64); k],
    );
    let p = Params {
        stride: &stride,
        padding: &padding,
        dilation: &dilation,
        groups: 1,
    };
    (Geom::new(&xs, &ws, &ys, &p).unwrap(), [xs, ws])
}

/// How a kernel takes the weight: `sgemm`'s left operand (og × k) or its right (k × og).
#[derive(Clone, Copy)]
pub enum Weights {
    Left,
    Right,
}

fn packed(og: usize, kk: usize, w: &[f32], how: Weights) -> Packed {
    // SAFETY: w is og×kk, contiguous (its transpose: unit row stride, kk column stride).
    unsafe {
        match how {
            Weights::Left => Packed::a(
                og,
                kk,
                Strided {
                    ptr: w.as_ptr(),
                    rs: kk as isize,
                    cs: 1,
                },
            ),
            Weights::Right => Packed::b(
                kk,
                og,
                Strided {
                    ptr: w.as_ptr(),
                    rs: 1,
                    cs: kk as isize,
                },
            ),
        }
    }
}

/// Runs `kernel` on every case, with and without bias, ReLU and threads, against the
/// definition.
/// `poison()` fills the kernel's reused scratch with NaNs first, so a read of anything
/// the kernel did not write shows up.
pub fn check_cases(cases: &[Case], kernel: Kernel, how: Weights, poison: impl Fn()) {
    for (i, case) in cases.iter().enumerate() {
        let (g, [xs, ws]) = geom(case);
        let og = case.1;
        let x = data(xs.iter().product(), i as u32 * 2 + 1);
        let w = data(ws.iter().product(), i as u32 * 2 + 2);
        let pa = packed(og, case.0 * g.taps(), &w, how);
        let bias = data(og, i as u32 + 100);
        let (with_bias, relu) = (i % 2 == 1, i % 4 >= 2);
        let mut want = reference(&g, &x, &w);
        for (j, v) in want.iter_mut().enumerate() {
            if with_bias {
                *v += bias[j / g.out_plane()] as f64;
            }
            if relu {
                *v = v.max(0.0);
            }
        }
        for threads in [1, 2] {
            // NaN sentinels in the output: an output never written shows up too.
            let mut y = vec![f32::NAN; og * g.out_plane()];
            poison();
            // Two threads for real: the caller and a helper split the work.
            let helpers = crate::par::Helpers::for_threads(threads);
            crate::par::with_helpers(&helpers, threads, || {
                kernel(
                    &g,
                    &pa,
                    &x,
                    with_bias.then_some(&bias[..]),
                    &mut y,
                    threads,
                    relu,
                )
            });
            for (j, (&a, &b)) in y.iter().zip(&want).enumerate() {
                assert!(
                    (a as f64 - b).abs() <= 1e-4 * (1.0 + b.abs()),
                    "case {i} {case:?} output {j}: {a} vs {b}"
                );
            }
        }
    }
}

/// Single-thread speed of `kernel` on the benchmark CNN's shapes (and a larger plane).
pub fn speed(kernel: Kernel, how: Weights) {
    for (cg, og, hw, s) in [
        (3, 32, 64, 1),
        (32, 32, 32, 1),
        (64, 64, 16, 1),
        (128, 128, 8, 1),
        (64, 64, 56, 1),
        (32, 64, 32, 2),
        (256, 256, 7, 1),
    ] {
        // EMBER_SPEED_ONLY=32-64 times only the shapes whose `cg-og-hw-sS` label contains it.
        if let Ok(only) = std::env::var("EMBER_SPEED_ONLY") {
            if !format!("{cg}-{og}-{hw}-s{s}").contains(&only) {
                continue;
            }
        }
        let (g, [xs, ws]) = geom(&(cg, og, vec![hw, hw], vec![3, 3], s, 1, 1));
        // EMBER_SPEED_BATCH=4 cycles through that many images' inputs and outputs, as a
        // model's batch does: a batch outgrows L2 where one image's data stays in it.
        let batch: usize = std::env::var("EMBER_SPEED_BATCH")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1)
            .max(1);
        let xs: Vec<Vec<f32>> = (0..batch)
            .map(|i| data(xs.iter().product(), 1 + 3 * i as u32))
            .collect();
        let w = data(ws.iter().product(), 2);
        let kk = cg * 9;
        let pa = packed(og, kk, &w, how);
        let mut ys = vec![vec![0.0f32; og * g.out_plane()]; batch];
        let flop = 2.0 * (og * g.out_plane() * kk) as f64;
        // EMBER_SPEED_THREADS=2 times the kernel on two threads (the caller and a helper).
        let threads: usize = std::env::var("EMBER_SPEED_THREADS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1);
        let helpers = crate::par::Helpers::for_threads(threads);
        let mut best = f64::MAX;
        crate::par::with_helpers(&helpers, threads, || {
            for _ in 0..7 {
                let t = std::time::Instant::now();
                let n = (2e8 / flop).ceil() as usize;
                for i in 0..n {
                    let b = i % batch;
                    kernel(&g, &pa, &xs[b], None, &mut ys[b], threads, false);
                }
                best = best.min(t.elapsed().as_secs_f64() / n as f64);
            }
        });
        println!(
            "{cg}->{og} {hw}x{hw} s{s}: {:.1} us {:.1} GFLOP/s",
            best * 1e6,
            flop / best / 1e9
        );
    }
}

/// Fills this thread's scratch (where the kernels keep their padded copy) with NaNs, so a
/// kernel reading anything its fill did not write shows up in the result.
pub fn poison_scratch() {
    crate::scratch::with_scratch(1 << 20, |words| {
        // SAFETY: the scratch holds at least 2^20 words (2^21 floats), ours while this runs.
        let floats = unsafe { std::slice::from_raw_parts_mut(words as *mut f32, 1 << 21) };
        floats.fill(f32::NAN);
    });
}
