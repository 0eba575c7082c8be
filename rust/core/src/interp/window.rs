//! `Conv` and `Pool`, literally: every output element is a loop over its window, summed in
//! f64. Spatial dims are seen as three (missing leading ones have size 1), so one loop nest
//! serves 1-, 2- and 3-d.

use super::value::{checked_numel, Data, Value};
use super::R;
use crate::ir::window::{conv_out_len, pool_out_len};
use crate::ir::PoolKind;

/// Window geometry along one spatial dim.
#[derive(Clone, Copy)]
struct Axis {
    len: i64,
    out: i64,
    kernel: i64,
    stride: i64,
    dilation: i64,
    /// Padding before the first element (a window starts at `o·stride - pad`).
    pad: i64,
}

impl Axis {
    const UNIT: Axis = Axis {
        len: 1,
        out: 1,
        kernel: 1,
        stride: 1,
        dilation: 1,
        pad: 0,
    };
}

/// Pads a list of up to three axes to exactly three, unit axes first.
fn three(axes: Vec<Axis>) -> R<[Axis; 3]> {
    if axes.is_empty() || axes.len() > 3 {
        return Err(format!("{} spatial dims (1 to 3 supported)", axes.len()));
    }
    let mut a = [Axis::UNIT; 3];
    a[3 - axes.len()..].copy_from_slice(&axes);
    Ok(a)
}

fn floats(v: &Value) -> R<&[f64]> {
    match &v.data {
        Data::F(x) => Ok(x),
        Data::I(_) => Err(format!("needs a float tensor, got {}", v.dtype)),
    }
}

/// Input position of kernel tap `k` for output `o`, if it lies inside the input.
fn tap(a: &Axis, o: i64, k: i64) -> Option<usize> {
    let i = o * a.stride - a.pad + k * a.dilation;
    (0..a.len).contains(&i).then_some(i as usize)
}

pub(crate) struct ConvParams<'a> {
    pub stride: &'a [i64],
    pub padding: &'a [(i64, i64)],
    pub dilation: &'a [i64],
    pub groups: i64,
}

pub(crate) fn conv(x: &Value, w: &Value, bias: Option<&Value>, p: &ConvParams) -> R<Value> {
    let k = p.stride.len();
    if x.shape.len() != k + 2 || w.shape.len() != k + 2 {
        return Err(format!(
            "conv{k}d of {:?} with weight {:?}",
            x.shape, w.shape
        ));
    }
    let (n, c, o) = (x.shape[0], x.shape[1], w.shape[0]);
    let g = p.groups as usize;
    let (cg, og) = (w.shape[1], o / g.max(1));
    if g == 0 || cg * g != c || og * g != o {
        return Err(format!(
            "groups={g} for input {:?} and weight {:?}",
            x.shape, w.shape
        ));
    }
    let axes: Vec<Axis> = (0..k)
        .map(|i| {
            let (len, kern) = (x.shape[i + 2] as i64, w.shape[i + 2] as i64);
            Axis {
                len,
                out: conv_out_len(len, p.padding[i], kern, p.stride[i], p.dilation[i]),
                kernel: kern,
                stride: p.stride[i],
                dilation: p.dilation[i],
                pad: p.padding[i].0,
            }
        })
        .collect();
    let mut shape = vec![n, o];
    shape.extend(axes.iter().map(|a| a.out.max(0) as usize));
    let [ad, ah, aw] = three(axes)?;
    let (xs, ws) = (floats(x)?, floats(w)?);
    let bs = bias.map(floats).transpose()?;
    let total = checked_numel(&shape).ok_or("shape overflows")?;
    let mut out = Vec::with_capacity(total);
    let (sd, sh, sw) = (ad.len as usize, ah.len as usize, aw.len as usize);
    let (kd, kh, kw) = (ad.kernel as usize, ah.kernel as usize, aw.kernel as usize);
    for b in 0..n {
        for oc in 0..o {
            let grp = oc / og;
            for od in 0..ad.out {
                for oh in 0..ah.out {
                    for ow in 0..aw.out {
                        let mut acc = bs.map_or(0.0, |bs| bs[oc]);
                        for ic in 0..cg {
                            let xc = (b * c + grp * cg + ic) * sd * sh * sw;
                            let wc = (oc * cg + ic) * kd * kh * kw;
                            for i in 0..kd {
                                let Some(id) = tap(&ad, od, i as i64) else {
                                    continue;
                                };
                                for j in 0..kh {
                                    let Some(ih) = tap(&ah, oh, j as i64) else {
                                        continue;
                                    };
                                    for l in 0..kw {
                                        let Some(iw) = tap(&aw, ow, l as i64) else {
                                            continue;
                                        };
                                        acc += xs[xc + (id * sh + ih) * sw + iw]
                                            * ws[wc + (i * kh + j) * kw + l];
                                    }
                                }
                            }
                        }
                        out.push(acc);
                    }
                }
            }
        }
    }
    Ok(Value::from_f64(x.dtype, shape, out))
}

pub(crate) struct PoolParams<'a> {
    pub kind: PoolKind,
    pub kernel: &'a [i64],
    pub stride: &'a [i64],
    pub padding: &'a [i64],
    pub dilation: &'a [i64],
    pub ceil_mode: bool,
}

pub(crate) fn pool(x: &Value, p: &PoolParams) -> R<Value> {
    let k = p.kernel.len();
    let r = x.shape.len();
    if r < k + 1 {
        return Err(format!("pool{k}d of shape {:?}", x.shape));
    }
    let lead = r - k;
    let planes: usize = x.shape[..lead].iter().product();
    let axes: Vec<Axis> = (0..k)
        .map(|i| {
            let len = x.shape[lead + i] as i64;
            Axis {
                len,
                out: pool_out_len(
                    len,
                    p.padding[i],
                    p.kernel[i],
                    p.stride[i],
                    p.dilation[i],
                    p.ceil_mode,
                ),
                kernel: p.kernel[i],
                stride: p.stride[i],
                dilation: p.dilation[i],
                pad: p.padding[i],
            }
        })
        .collect();
    let mut shape = x.shape[..lead].to_vec();
    shape.extend(axes.iter().map(|a| a.out.max(0) as usize));
    let a = three(axes)?;
    let xs = floats(x)?;
    let plane = (a[0].len * a[1].len * a[2].len) as usize;
    let mut out = Vec::with_capacity(checked_numel(&shape).ok_or("shape overflows")?);
    for pl in 0..planes {
        let xp = &xs[pl * plane..(pl + 1) * plane];
        for od in 0..a[0].out {
            for oh in 0..a[1].out {
                for ow in 0..a[2].out {
                    let o = [od, oh, ow];
                    let mut max = f64::NEG_INFINITY;
                    let mut nan = false;
                    let (mut sum, mut count) = (0.0, 0i64);
                    for i in 0..a[0].kernel {
                        let Some(id) = tap(&a[0], o[0], i) else {
                            continue;
                        };
                        for j in 0..a[1].kernel {
                            let Some(ih) = tap(&a[1], o[1], j) else {
                                continue;
                            };
                            for l in 0..a[2].kernel {
                                let Some(iw) = tap(&a[2], o[2], l) else {
                                    continue;
                                };
                                let v = xp[(id * a[1].len as usize + ih) * a[2].len as usize + iw];
                                nan |= v.is_nan();
                                max = max.max(v);
                                sum += v;
                                count += 1;
                            }
                        }
                    }
                    out.push(match p.kind {
                        // torch's max pooling propagates NaN.
                        PoolKind::Max if nan => f64::NAN,
                        PoolKind::Max => max,
                        PoolKind::Avg {
                            count_include_pad,
                            divisor,
                        } => {
                            let d = match divisor {
                                Some(d) => d,
                                None if count_include_pad => padded_window(&a, o),
                                None => count,
                            };
                            sum / d as f64
                        }
                    });
                }
            }
        }
    }
    Ok(Value::from_f64(x.dtype, shape, out))
}

/// The window's size clipped to the input plus its padding (torch's `count_include_pad`
/// divisor: padding counts, the extra right margin of `ceil_mode` does not).
fn padded_window(a: &[Axis; 3], o: [i64; 3]) -> i64 {
    (0..3)
        .map(|i| {
            let start = o[i] * a[i].stride - a[i].pad;
            let end = (start + a[i].kernel).min(a[i].len + a[i].pad);
            end - start
        })
        .product()
}
