//! Pooling: max/avg pooling (1-, 2-, 3-d, with or without the indices output) become `Pool`
//! nodes; adaptive pooling becomes a `Pool` when every output bin has the same size, and
//! per-axis bins (slice, reduce, concat) otherwise.

use super::{tensor, Handler};
use crate::dim::{format_shape, Dim};
use crate::error::{Error, Result};
use crate::frontend::pt2::args::NodeArgs;
use crate::frontend::pt2::translate::{Ctx, Out};
use crate::ir::{Op, PoolKind, ReduceOp, ValueId};

pub fn handler(name: &str, overload: &str) -> Option<Handler> {
    if overload != "default" {
        return None;
    }
    Some(match name {
        "max_pool1d" | "max_pool2d" | "max_pool3d" => |c, n| max_pool(c, n, false),
        "max_pool1d_with_indices" | "max_pool2d_with_indices" | "max_pool3d_with_indices" => {
            |c, n| max_pool(c, n, true)
        }
        "avg_pool1d" | "avg_pool2d" | "avg_pool3d" => avg_pool,
        "adaptive_avg_pool1d"
        | "adaptive_avg_pool2d"
        | "adaptive_avg_pool3d"
        | "_adaptive_avg_pool2d"
        | "_adaptive_avg_pool3d" => |c, n| adaptive(c, n, false),
        "adaptive_max_pool1d" | "adaptive_max_pool2d" | "adaptive_max_pool3d" => {
            |c, n| adaptive(c, n, true)
        }
        _ => return None,
    })
}

/// The spatial rank from the op name (`max_pool2d…` → 2).
fn spatial_rank(n: &NodeArgs) -> Result<usize> {
    let name = n.target.rsplit("pool").next().unwrap_or("");
    match name.chars().next() {
        Some('1') => Ok(1),
        Some('2') => Ok(2),
        Some('3') => Ok(3),
        _ => Err(Error::Compile(format!(
            "node '{}': cannot tell the rank of {}",
            n.name, n.target
        ))),
    }
}

/// A per-dim list where torch allows one value for all dims (`default` when empty).
fn per_dim(n: &NodeArgs, name: &str, pos: usize, k: usize, default: &[i64]) -> Result<Vec<i64>> {
    let v = n.opt_ints(name, pos)?.unwrap_or_default();
    match v.len() {
        0 => Ok(default.to_vec()),
        1 => Ok(vec![v[0]; k]),
        l if l == k => Ok(v),
        l => Err(Error::Shape(format!(
            "node '{}' ({}): {name} has {l} values for {k} spatial dims",
            n.name, n.target
        ))),
    }
}

fn max_pool(ctx: &mut Ctx, n: &NodeArgs, with_indices: bool) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let k = spatial_rank(n)?;
    let kernel = per_dim(n, "kernel_size", 1, k, &[])?;
    if kernel.len() != k {
        return Err(Error::Shape(format!("node '{}': no kernel_size", n.name)));
    }
    let op = Op::Pool {
        kind: PoolKind::Max,
        stride: per_dim(n, "stride", 2, k, &kernel)?,
        padding: per_dim(n, "padding", 3, k, &vec![0; k])?,
        dilation: per_dim(n, "dilation", 4, k, &vec![1; k])?,
        ceil_mode: n.bool("ceil_mode", 5, false)?,
        kernel,
    };
    let y = ctx.b.op(op, &[x])?;
    // The indices output is for max_unpool and training; Ember does not produce it.
    Ok(if with_indices {
        Out::Values(vec![Some(y), None])
    } else {
        Out::Value(y)
    })
}

fn avg_pool(ctx: &mut Ctx, n: &NodeArgs) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let k = spatial_rank(n)?;
    let kernel = per_dim(n, "kernel_size", 1, k, &[])?;
    if kernel.len() != k {
        return Err(Error::Shape(format!("node '{}': no kernel_size", n.name)));
    }
    // avg_pool1d has no divisor_override argument.
    let divisor = if k == 1 {
        None
    } else {
        n.opt_int("divisor_override", 6)?
    };
    let op = Op::Pool {
        kind: PoolKind::Avg {
            count_include_pad: n.bool("count_include_pad", 5, true)?,
            divisor,
        },
        stride: per_dim(n, "stride", 2, k, &kernel)?,
        padding: per_dim(n, "padding", 3, k, &vec![0; k])?,
        dilation: vec![1; k],
        ceil_mode: n.bool("ceil_mode", 4, false)?,
        kernel,
    };
    Ok(Out::Value(ctx.b.op(op, &[x])?))
}

/// torch's adaptive bins: output `o` of `out` covers `[⌊o·L/out⌋, ⌈(o+1)·L/out⌉)`.
fn bin(o: i64, len: i64, out: i64) -> (i64, i64) {
    ((o * len) / out, ((o + 1) * len + out - 1) / out)
}

fn adaptive(ctx: &mut Ctx, n: &NodeArgs, max: bool) -> Result<Out> {
    let x = tensor(ctx, n, "self", 0)?;
    let k = spatial_rank(n)?;
    let shape = ctx.b.shape(x);
    let out = per_dim(n, "output_size", 1, k, &[])?;
    if out.len() != k || shape.len() < k + 1 || out.iter().any(|&o| o < 1) {
        return Err(Error::Shape(format!(
            "node '{}' ({}): output size {out:?} for input {}",
            n.name,
            n.target,
            format_shape(&shape)
        )));
    }
    let lead = shape.len() - k;
    let lens: Vec<i64> = shape[lead..]
        .iter()
        .map(Dim::as_const)
        .collect::<Option<_>>()
        .ok_or_else(|| {
            Error::unsupported_because(
                n.target.trim_start_matches("torch.ops."),
                &n.name,
                "symbolic spatial dims",
            )
        })?;
    let y = if lens.iter().zip(&out).all(|(l, o)| l % o == 0) {
        let kernel: Vec<i64> = lens.iter().zip(&out).map(|(l, o)| l / o).collect();
        let kind = if max {
            PoolKind::Max
        } else {
            PoolKind::Avg {
                count_include_pad: true,
                divisor: None,
            }
        };
        let op = Op::Pool {
            kind,
            stride: kernel.clone(),
            padding: vec![0; k],
            dilation: vec![1; k],
            ceil_mode: false,
            kernel,
        };
        ctx.b.op(op, &[x])?
    } else {
        // Bins are rectangles, so pooling them axis by axis is exact (each row of a bin has
        // as many elements as every other for the average).
        let mut v = x;
        for i in 0..k {
            v = adaptive_axis(ctx, v, lead + i, lens[i], out[i], max)?;
        }
        v
    };
    Ok(if max {
        Out::Values(vec![Some(y), None])
    } else {
        Out::Value(y)
    })
}

fn adaptive_axis(
    ctx: &mut Ctx,
    x: ValueId,
    axis: usize,
    len: i64,
    out: i64,
    max: bool,
) -> Result<ValueId> {
    if len == out {
        return Ok(x);
    }
    let mut parts = Vec::with_capacity(out as usize);
    for o in 0..out {
        let (s, e) = bin(o, len, out);
        let part = ctx.b.slice(x, axis, Dim::Const(s), Dim::Const(e), 1)?;
        parts.push(if max {
            ctx.b.op(
                Op::Reduce {
                    op: ReduceOp::Max,
                    axes: vec![axis],
                    keepdim: true,
                },
                &[part],
            )?
        } else {
            ctx.b.mean(part, vec![axis], true)?
        });
    }
    if parts.len() == 1 {
        return Ok(parts[0]);
    }
    ctx.b.op(Op::Concat { axis }, &parts)
}
