//! Max and average pooling: each plane (all leading dims together) is swept directly, in
//! parallel over planes. The taps of an output that land inside the input are found per
//! axis once, so the inner loops carry no bounds checks on padding.

use ember_core::dtype::DType;
use ember_core::ir::PoolKind;
use rayon::prelude::*;

use super::elementwise::cast;
use super::window::{size, three, Axis};
use crate::buffer::Val;
use crate::elem::Real;
use crate::error::{CpuError, KResult};

pub struct Params<'a> {
    pub kind: PoolKind,
    pub kernel: &'a [i64],
    pub stride: &'a [i64],
    pub padding: &'a [i64],
    pub dilation: &'a [i64],
}

pub fn pool(x: &Val, p: &Params, out: &[usize]) -> KResult<Val> {
    match x.dtype {
        DType::F32 => pool_t::<f32>(x, p, out),
        DType::F64 => pool_t::<f64>(x, p, out),
        // Half types go through f32 (exact for max; one rounding for the average).
        DType::F16 | DType::BF16 => cast(&pool_t::<f32>(&cast(x, DType::F32)?, p, out)?, x.dtype),
        other => Err(CpuError::Unsupported(format!("pooling of {other}"))),
    }
}

fn pool_t<T: Real>(x: &Val, p: &Params, out: &[usize]) -> KResult<Val> {
    let k = p.kernel.len();
    let xs = x.shape();
    if xs.len() < k + 1 || out.len() != xs.len() || out[..xs.len() - k] != xs[..xs.len() - k] {
        return Err(CpuError::Shape(format!("pool{k}d of {xs:?} to {out:?}")));
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
    let a = three(&axes)?;
    let ip: usize = a.iter().map(|a| a.len).product();
    let op: usize = a.iter().map(|a| a.out).product();
    let xc = x.contiguous()?;
    let xv = xc.to_vec::<T>()?;
    // Per axis and output: the in-bounds taps, and the window clipped to input + padding
    // (the `count_include_pad` divisor).
    let taps: Vec<Vec<(usize, usize)>> = a
        .iter()
        .map(|ax| (0..ax.out).map(|o| ax.valid_taps(o)).collect())
        .collect();
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
    Val::build::<T>(x.dtype, out, |y| {
        if op == 0 || ip == 0 {
            return Ok(());
        }
        y.par_chunks_mut(op)
            .zip(xv.par_chunks(ip))
            .with_min_len(4)
            .for_each(|(yp, xp)| {
                let mut o = 0;
                for od in 0..a[0].out {
                    for oh in 0..a[1].out {
                        for ow in 0..a[2].out {
                            yp[o] = window(p.kind, &a, xp, [od, oh, ow], &taps, &padded);
                            o += 1;
                        }
                    }
                }
            });
        Ok(())
    })
}

/// One output element.
fn window<T: Real>(
    kind: PoolKind,
    a: &[Axis; 3],
    xp: &[T],
    o: [usize; 3],
    taps: &[Vec<(usize, usize)>],
    padded: &[Vec<usize>],
) -> T {
    let t = [taps[0][o[0]], taps[1][o[1]], taps[2][o[2]]];
    let start = |i: usize, k: usize| o[i] * a[i].stride + k * a[i].dilation - a[i].pad;
    let mut max = -T::INF;
    let mut sum = T::ZERO;
    for i in t[0].0..t[0].1 {
        for j in t[1].0..t[1].1 {
            let row = (start(0, i) * a[1].len + start(1, j)) * a[2].len;
            for l in t[2].0..t[2].1 {
                let v = xp[row + start(2, l)];
                // NaN wins, as in torch.
                if v > max || v.is_nan() {
                    max = v;
                }
                sum = sum + v;
            }
        }
    }
    match kind {
        PoolKind::Max => max,
        PoolKind::Avg {
            count_include_pad,
            divisor,
        } => {
            let d = match divisor {
                Some(d) => d as f64,
                None if count_include_pad => {
                    (padded[0][o[0]] * padded[1][o[1]] * padded[2][o[2]]) as f64
                }
                None => ((t[0].1 - t[0].0) * (t[1].1 - t[1].0) * (t[2].1 - t[2].0)) as f64,
            };
            T::of(sum.f64() / d)
        }
    }
}
