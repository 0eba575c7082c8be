//! Max and average pooling: each plane (all leading dims together) is swept directly, in
//! parallel over planes. The taps of an output that land inside the input are found per
//! axis once, so the inner loops carry no bounds checks on padding.

use ember_core::dtype::DType;
use ember_core::ir::PoolKind;

#[cfg(target_arch = "x86_64")]
mod max256;
#[cfg(target_arch = "x86_64")]
mod max512;

use super::elementwise::cast;
use super::window::{size, three, Axis};
use crate::arena::Dest;
use crate::buffer::Val;
use crate::elem::{as_f32, as_f32_mut, Real};
use crate::error::{CpuError, KResult};
use crate::{par, simd};

pub struct Params<'a> {
    pub kind: PoolKind,
    pub kernel: &'a [i64],
    pub stride: &'a [i64],
    pub padding: &'a [i64],
    pub dilation: &'a [i64],
}

pub fn pool(x: &Val, p: &Params, out: &[usize]) -> KResult<Val> {
    match x.dtype {
        DType::F32 => Val::build::<f32>(x.dtype, out, |y| pool_t(x, p, out, y)),
        DType::F64 => Val::build::<f64>(x.dtype, out, |y| pool_t(x, p, out, y)),
        // Half types go through f32 (exact for max; one rounding for the average).
        DType::F16 | DType::BF16 => cast(&pool(&cast(x, DType::F32)?, p, out)?, x.dtype),
        other => Err(CpuError::Unsupported(format!("pooling of {other}"))),
    }
}

/// Whether `pool_into` takes this dtype (the half types go through `pool`'s f32 copy).
pub fn pool_in_place(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64)
}

/// The pool written into `dest` (an arena or caller buffer, any contents: every output is
/// written), not into a fresh zeroed buffer, whose page faults were a third of the
/// benchmark CNN's max pool.
pub fn pool_into(x: &Val, p: &Params, dest: &mut Dest) -> KResult<()> {
    let out = dest.shape.clone();
    match (x.dtype, dest.dtype) {
        (DType::F32, DType::F32) => pool_t::<f32>(x, p, &out, dest.slice()?),
        (DType::F64, DType::F64) => pool_t::<f64>(x, p, &out, dest.slice()?),
        (a, b) => Err(CpuError::Internal(format!("pooling of {a} into {b}"))),
    }
}

/// The pool of `x` into `y` (contiguous, of shape `out`; every element written).
fn pool_t<T: Real>(x: &Val, p: &Params, out: &[usize], y: &mut [T]) -> KResult<()> {
    let k = p.kernel.len();
    let xs = x.shape();
    if xs.len() < k + 1 || out.len() != xs.len() || out[..xs.len() - k] != xs[..xs.len() - k] {
        return Err(CpuError::Shape(format!("pool{k}d of {xs:?} to {out:?}")));
    }
    if y.len() != out.iter().product::<usize>() {
        return Err(CpuError::Internal(format!(
            "pool{k}d output buffer for {out:?}"
        )));
    }
    let lead = xs.len() - k;
    let mut axes = Vec::with_capacity(k);
    for i in 0..k {
        axes.push(Axis {
            len: xs[lead + i],
            out: out[lead + i],
            kernel: size(p.kernel[i], "kernel")?,
            stride: size(p.stride[i], "stride")?,
            dilation: size(p.dilation[i], "dilation")?,
            pad: size(p.padding[i], "padding")?,
        });
    }
    if axes.iter().any(|a| a.stride == 0 || a.dilation == 0) {
        return Err(CpuError::Shape(format!(
            "pool{k}d with a zero stride or dilation"
        )));
    }
    let a = three(&axes)?;
    let ip: usize = a.iter().map(|a| a.len).product();
    let op: usize = a.iter().map(|a| a.out).product();
    let xc = x.contiguous()?;
    let xview = xc.view::<T>()?;
    // SAFETY: `xc` is contiguous with numel elements from its view's start, alive below.
    let xv = unsafe { std::slice::from_raw_parts(xview.ptr, xc.numel()) };
    // Per axis and output: the in-bounds taps, and the window clipped to input + padding
    // (the `count_include_pad` divisor).
    let taps = window_taps(&a);
    let padded: Vec<Vec<usize>> = a
        .iter()
        .map(|ax| {
            (0..ax.out)
                .map(|o| {
                    let start = (o * ax.stride) as isize - ax.pad as isize;
                    let end = (start + ax.kernel as isize).min((ax.len + ax.pad) as isize);
                    (end - start).max(0) as usize
                })
                .collect()
        })
        .collect();
    if op == 0 || ip == 0 {
        // Nothing to read (the zeros a fresh buffer held before results were written in place).
        y.fill(T::ZERO);
        return Ok(());
    }
    // Chunks of whole planes, a few per thread.
    let planes = y.len() / op;
    let per = planes.div_ceil(par::threads() * 4).max(1);
    par::for_chunks_mut(y, per * op, |start, ys| {
        if matches!(p.kind, PoolKind::Max) {
            let first = start / op;
            return max_planes(&a, &xv[first * ip..(first + ys.len() / op) * ip], ys, &taps);
        }
        for (i, yp) in ys.chunks_mut(op).enumerate() {
            let plane = start / op + i;
            let xp = &xv[plane * ip..(plane + 1) * ip];
            plane_rows(p.kind, &a, xp, yp, &taps, &padded);
        }
    });
    Ok(())
}

/// Per axis and output: the taps that land inside the input (`Axis::valid_taps`).
fn window_taps(a: &[Axis; 3]) -> Vec<Vec<(usize, usize)>> {
    a.iter()
        .map(|ax| (0..ax.out).map(|o| ax.valid_taps(o)).collect())
        .collect()
}

/// Sets `starts` to the offsets in its plane of the input rows (along the last axis) under
/// the window of output row (`od`, `oh`), in tap order. Nested loops into a reused buffer:
/// a `flat_map` iterator here cost the AVX-512 max pool a fifth of its time.
fn window_rows(
    a: &[Axis; 3],
    taps: &[Vec<(usize, usize)>],
    od: usize,
    oh: usize,
    starts: &mut Vec<usize>,
) {
    let (ti, tj) = (taps[0][od], taps[1][oh]);
    let (d, h, w) = (a[0], a[1], a[2]);
    starts.clear();
    for i in ti.0..ti.1 {
        let id = od * d.stride + i * d.dilation - d.pad;
        for j in tj.0..tj.1 {
            let ih = oh * h.stride + j * h.dilation - h.pad;
            starts.push((id * h.len + ih) * w.len);
        }
    }
}

/// One plane, an output row (fixed od, oh) at a time: each tap row in bounds is swept across
/// the row's outputs, so the inner loop is a strided pass with no per-element tap search.
/// Per output, values combine in the same (tap) order as a per-element loop would, so
/// averages round identically. (Max pooling runs `max_planes`.)
fn plane_rows<T: Real>(
    kind: PoolKind,
    a: &[Axis; 3],
    xp: &[T],
    yp: &mut [T],
    taps: &[Vec<(usize, usize)>],
    padded: &[Vec<usize>],
) {
    let w = a[2];
    for od in 0..a[0].out {
        for oh in 0..a[1].out {
            let row = &mut yp[(od * a[1].out + oh) * w.out..][..w.out];
            row.fill(T::ZERO);
            let (ti, tj) = (taps[0][od], taps[1][oh]);
            for i in ti.0..ti.1 {
                let id = od * a[0].stride + i * a[0].dilation - a[0].pad;
                for j in tj.0..tj.1 {
                    let ih = oh * a[1].stride + j * a[1].dilation - a[1].pad;
                    let xr = &xp[(id * a[1].len + ih) * w.len..][..w.len];
                    for l in 0..w.kernel {
                        let off = w.tap_offset(l);
                        let (lo, hi) = w.valid_outputs(off);
                        for (ow, y) in row.iter_mut().enumerate().take(hi).skip(lo) {
                            *y = *y + xr[((ow * w.stride) as isize + off) as usize];
                        }
                    }
                }
            }
            if let PoolKind::Avg {
                count_include_pad,
                divisor,
            } = kind
            {
                for (ow, y) in row.iter_mut().enumerate() {
                    let tl = taps[2][ow];
                    let d = match divisor {
                        Some(d) => d as f64,
                        None if count_include_pad => {
                            (padded[0][od] * padded[1][oh] * padded[2][ow]) as f64
                        }
                        None => ((ti.1 - ti.0) * (tj.1 - tj.0) * (tl.1 - tl.0)) as f64,
                    };
                    *y = T::of(y.f64() / d);
                }
            }
        }
    }
}

/// Max pooling of consecutive planes (`xs`: their inputs, `ys`: their outputs): f32 with a
/// width stride of 1 or 2 on AVX-512 in `max512`, on AVX2 in `max256`; otherwise here, in an AVX2 copy where the
/// CPU has it (8 lanes, and three-operand selects: the SSE2 build spends as many moves as
/// selects).
fn max_planes<T: Real>(a: &[Axis; 3], xs: &[T], ys: &mut [T], taps: &[Vec<(usize, usize)>]) {
    #[cfg(target_arch = "x86_64")]
    if max512::suits(a) && a.iter().all(|a| a.kernel > 0) {
        if let (Some(xs), Some(ys)) = (as_f32(xs), as_f32_mut(ys)) {
            // SAFETY: the CPU has AVX-512F and the stride and kernels fit (`suits`, above).
            return unsafe { max512::max_planes(a, xs, ys, taps) };
        }
    }
    #[cfg(target_arch = "x86_64")]
    if max256::suits(a) && a.iter().all(|a| a.kernel > 0) {
        if let (Some(xs), Some(ys)) = (as_f32(xs), as_f32_mut(ys)) {
            // SAFETY: the CPU has AVX2 and the stride and kernels fit (`suits`, above).
            return unsafe { max256::max_planes(a, xs, ys, taps) };
        }
    }
    #[cfg(target_arch = "x86_64")]
    if simd::avx2_enabled() {
        // SAFETY: the CPU supports AVX2 (checked at run time).
        return unsafe { max_planes_avx2(a, xs, ys, taps) };
    }
    max_planes_here(a, xs, ys, taps)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn max_planes_avx2<T: Real>(
    a: &[Axis; 3],
    xs: &[T],
    ys: &mut [T],
    taps: &[Vec<(usize, usize)>],
) {
    max_planes_here(a, xs, ys, taps)
}

/// The planes one at a time, sharing the row buffers (allocated once per chunk, not per
/// plane).
#[inline(always)]
fn max_planes_here<T: Real>(a: &[Axis; 3], xs: &[T], ys: &mut [T], taps: &[Vec<(usize, usize)>]) {
    let w = a[2];
    let ip: usize = a.iter().map(|a| a.len).product();
    let op: usize = a.iter().map(|a| a.out).product();
    let mut bufs = RowBuffers {
        rowmax: vec![-T::INF; w.len],
        spare: vec![-T::INF; w.len.max(w.out)],
        phases: vec![
            -T::INF;
            if w.stride > 1 {
                w.len.next_multiple_of(w.stride)
            } else {
                0
            }
        ],
        starts: Vec::new(),
    };
    for (yp, xp) in ys.chunks_mut(op).zip(xs.chunks(ip)) {
        max_plane(a, xp, yp, taps, &mut bufs);
    }
}

/// Scratch of `max_plane`: the reduced row, a spare for ping-pong, the phase split, the
/// window's row offsets.
struct RowBuffers<T> {
    rowmax: Vec<T>,
    spare: Vec<T>,
    phases: Vec<T>,
    /// Where the rows under the window start (`window_rows`).
    starts: Vec<usize>,
}

/// Max pooling of one plane, an output row at a time: the input rows under the window are
/// first reduced elementwise (contiguous, so it vectorizes), then the window slides along
/// that one row. Outputs whose whole window lies in the row (all but the edges) take one
/// tap at a time across all of them: with the reduced row split into `stride` phases
/// (phase r holds elements r, r + stride, …), a tap reads consecutive elements for
/// consecutive outputs, so that loop vectorizes too (a per-output loop over the taps is a
/// serial chain of selects). Max is order-free, so this equals the per-tap loop; NaN wins,
/// as in torch.
#[inline(always)]
fn max_plane<T: Real>(
    a: &[Axis; 3],
    xp: &[T],
    yp: &mut [T],
    taps: &[Vec<(usize, usize)>],
    bufs: &mut RowBuffers<T>,
) {
    let w = a[2];
    let s = w.stride;
    let plen = w.len.div_ceil(s);
    let RowBuffers {
        rowmax,
        spare,
        phases,
        starts,
    } = bufs;
    let full = |ow: &usize| taps[2][*ow] == (0, w.kernel);
    let lo = (0..w.out).find(full).unwrap_or(0);
    let hi = (0..w.out).rfind(full).map_or(0, |ow| ow + 1);
    for od in 0..a[0].out {
        for oh in 0..a[1].out {
            window_rows(a, taps, od, oh, starts);
            max_into(starts.iter().map(|&s| &xp[s..][..w.len]), rowmax, spare);
            let row = &mut yp[(od * a[1].out + oh) * w.out..][..w.out];
            for ow in (0..lo).chain(hi..w.out) {
                let (l0, l1) = taps[2][ow];
                let start = ow * s;
                let mut m = -T::INF;
                for l in l0..l1 {
                    m = pick(m, rowmax[start + l * w.dilation - w.pad]);
                }
                row[ow] = m;
            }
            if lo >= hi {
                continue;
            }
            let src: &[T] = if s == 1 {
                rowmax
            } else {
                deinterleave(rowmax, s, plen, phases);
                phases
            };
            // Tap l of output lo + t is element lo·s + l·dilation - pad + t·s.
            let runs = (0..w.kernel).map(|l| {
                let first = lo * s + l * w.dilation - w.pad;
                &src[(first % s) * plen + first / s..][..hi - lo]
            });
            max_into(runs, &mut row[lo..hi], spare);
        }
    }
}

/// NaN-sticky max: `v` when it is larger or NaN. A select, not a branch: on real data the
/// comparison is unpredictable.
#[inline(always)]
fn pick<T: Real>(m: T, v: T) -> T {
    if (v > m) | v.is_nan() {
        v
    } else {
        m
    }
}

/// `out[i]` = the max (`pick`) of `src[i]` over the slices of `srcs` (each at least as
/// long as `out`; none: -inf). Every step writes a buffer it does not read (ping-pong with
/// `spare`, at least as long as `out`): a select stored back over its own input becomes a
/// masked store under AVX2, microcoded on AMD and twice as slow as SSE2 overall.
#[inline(always)]
fn max_into<'a, T: Real + 'a>(
    mut srcs: impl Iterator<Item = &'a [T]>,
    out: &mut [T],
    spare: &mut [T],
) {
    let n = out.len();
    let spare = &mut spare[..n];
    let Some(first) = srcs.next() else {
        out.fill(-T::INF);
        return;
    };
    let Some(second) = srcs.next() else {
        out.copy_from_slice(&first[..n]);
        return;
    };
    let both = |d: &mut [T], x: &[T], y: &[T]| {
        for ((d, &x), &y) in d.iter_mut().zip(x).zip(y) {
            *d = pick(x, y);
        }
    };
    both(out, first, second);
    let mut in_out = true;
    for src in srcs {
        if in_out {
            both(spare, out, src);
        } else {
            both(out, spare, src);
        }
        in_out = !in_out;
    }
    if !in_out {
        out.copy_from_slice(spare);
    }
}

/// Splits `src` into `s` phases of `plen` elements in `dst`: phase r holds `src[r]`,
/// `src[r + s]`, …. Strides 2 and 3 (the common pools) get loops the compiler unrolls.
#[inline(always)]
fn deinterleave<T: Copy>(src: &[T], s: usize, plen: usize, dst: &mut [T]) {
    fn fixed<T: Copy, const S: usize>(src: &[T], plen: usize, dst: &mut [T]) {
        let whole = src.len() / S;
        for (q, c) in src.chunks_exact(S).enumerate() {
            for r in 0..S {
                dst[r * plen + q] = c[r];
            }
        }
        for (r, &v) in src[whole * S..].iter().enumerate() {
            dst[r * plen + whole] = v;
        }
    }
    match s {
        2 => fixed::<T, 2>(src, plen, dst),
        3 => fixed::<T, 3>(src, plen, dst),
        _ => {
            for (i, &v) in src.iter().enumerate() {
                dst[(i % s) * plen + i / s] = v;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::data;

    /// (spatial input dims, kernel, stride, padding, dilation, ceil mode) per axis.
    type Case = (
        Vec<usize>,
        Vec<usize>,
        Vec<usize>,
        Vec<usize>,
        Vec<usize>,
        bool,
    );

    fn axes(c: &Case) -> [Axis; 3] {
        let (len, k, s, p, d, ceil) = c;
        let axes: Vec<Axis> = (0..len.len())
            .map(|i| {
                let span = len[i] + 2 * p[i] - d[i] * (k[i] - 1) - 1;
                let mut out = if *ceil {
                    span.div_ceil(s[i])
                } else {
                    span / s[i]
                } + 1;
                // torch's ceil mode: the last window must start inside the input or left pad.
                if *ceil && (out - 1) * s[i] >= len[i] + p[i] {
                    out -= 1;
                }
                Axis {
                    len: len[i],
                    out,
                    kernel: k[i],
                    stride: s[i],
                    dilation: d[i],
                    pad: p[i],
                }
            })
            .collect();
        three(&axes).unwrap()
    }

    /// Every geometry's max, through whichever kernel this CPU picks, against the plain
    /// per-output definition, bit for bit (NaNs as NaNs).
    fn check_against_definition(cases: &[Case]) {
        for (n, c) in cases.iter().enumerate() {
            let a = axes(c);
            let planes = 3;
            let ip: usize = a.iter().map(|a| a.len).product();
            let op: usize = a.iter().map(|a| a.out).product();
            let mut x = data(planes * ip, n as u32);
            for i in (0..x.len()).step_by(37) {
                x[i] = f32::NAN;
            }
            let taps = window_taps(&a);
            let mut y = vec![0.0f32; planes * op];
            max_planes(&a, &x, &mut y, &taps);
            let mut at = 0;
            for p in 0..planes {
                for od in 0..a[0].out {
                    for oh in 0..a[1].out {
                        for ow in 0..a[2].out {
                            let mut m = f32::NEG_INFINITY;
                            let pos = [od, oh, ow];
                            let each = |i: usize| {
                                let (lo, hi) = taps[i][pos[i]];
                                (lo..hi).map(move |t| {
                                    pos[i] * a[i].stride + t * a[i].dilation - a[i].pad
                                })
                            };
                            for id in each(0) {
                                for ih in each(1) {
                                    for iw in each(2) {
                                        let v = x[p * ip + (id * a[1].len + ih) * a[2].len + iw];
                                        m = pick(m, v);
                                    }
                                }
                            }
                            assert!(
                                y[at] == m || (y[at].is_nan() && m.is_nan()),
                                "case {c:?}: output {at} is {}, want {m}",
                                y[at]
                            );
                            at += 1;
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn max_pooling_matches_its_definition() {
        let v = |x: &[usize]| x.to_vec();
        let mut cases: Vec<Case> = Vec::new();
        for ceil in [false, true] {
            cases.extend([
                (
                    v(&[64, 64]),
                    v(&[3, 3]),
                    v(&[2, 2]),
                    v(&[1, 1]),
                    v(&[1, 1]),
                    ceil,
                ),
                (
                    v(&[9, 8]),
                    v(&[3, 3]),
                    v(&[2, 2]),
                    v(&[1, 1]),
                    v(&[1, 1]),
                    ceil,
                ),
                (
                    v(&[7, 33]),
                    v(&[3, 2]),
                    v(&[2, 1]),
                    v(&[1, 0]),
                    v(&[2, 1]),
                    ceil,
                ),
                (
                    v(&[5, 40]),
                    v(&[5, 5]),
                    v(&[1, 1]),
                    v(&[2, 2]),
                    v(&[1, 1]),
                    ceil,
                ),
                (v(&[71]), v(&[5]), v(&[2]), v(&[2]), v(&[3]), ceil),
                (v(&[70]), v(&[4]), v(&[3]), v(&[2]), v(&[1]), ceil),
                (
                    v(&[2, 2]),
                    v(&[5, 5]),
                    v(&[1, 1]),
                    v(&[2, 2]),
                    v(&[1, 1]),
                    ceil,
                ),
                (
                    v(&[3, 5, 35]),
                    v(&[2, 2, 2]),
                    v(&[2, 2, 2]),
                    v(&[0, 0, 0]),
                    v(&[1, 1, 1]),
                    ceil,
                ),
                (
                    v(&[1, 17]),
                    v(&[1, 1]),
                    v(&[1, 2]),
                    v(&[0, 0]),
                    v(&[1, 1]),
                    ceil,
                ),
            ]);
        }
        check_against_definition(&cases);
    }

    /// ns per output of the benchmark CNN's pool (3×3, stride 2, pad 1 on 32 planes of
    /// 64×64), single thread: `cargo test --release -p ember-cpu max_pool_speed -- --ignored
    /// --nocapture`.
    #[test]
    #[ignore]
    fn max_pool_speed() {
        let c: Case = (
            vec![64, 64],
            vec![3, 3],
            vec![2, 2],
            vec![1, 1],
            vec![1, 1],
            false,
        );
        let a = axes(&c);
        let planes = 32;
        let ip: usize = a.iter().map(|a| a.len).product();
        let op: usize = a.iter().map(|a| a.out).product();
        let x = data(planes * ip, 1);
        let taps = window_taps(&a);
        let mut y = vec![0.0f32; planes * op];
        let mut best = f64::INFINITY;
        for _ in 0..200 {
            let t = std::time::Instant::now();
            max_planes(&a, &x, &mut y, &taps);
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!(
            "max pool 3x3/2: {:.3} ns/output",
            best * 1e9 / y.len() as f64
        );
    }
}
