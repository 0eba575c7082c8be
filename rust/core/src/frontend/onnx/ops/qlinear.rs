//! ONNX Runtime's QOperator format: quantized ops that carry their inputs' and output's
//! scales and zero points (`QLinearConv`, `QLinearMatMul`, `ConvInteger`, and the
//! `com.microsoft` ops `QGemm`, `QLinearAdd`, ...), what `quantize_static` writes with
//! `QuantFormat.QOperator` and what many published int8 models use.
//!
//! Products are exact int32 accumulations, as ONNX defines them, requantized once as ONNX
//! Runtime does: `saturate(round(acc · (x_scale·w_scale / y_scale)) + y_zero_point)`. The
//! other ops are their float op between a dequantization and a quantization (ONNX
//! Runtime's tables and fixed-point kernels compute the same values; a result sitting on
//! a rounding boundary may differ by one quantum).

use super::quant::{dequantize_with, integer_product, quantize_with, range, round_into};
use super::{bin, one, Handler};
use crate::dim::{format_shape, Dim};
use crate::dtype::{DType, Scalar};
use crate::error::Result;
use crate::frontend::builder::Operand;
use crate::frontend::onnx::node::Node;
use crate::frontend::onnx::translate::{Ctx, Val};
use crate::ir::{BinaryOp, ValueId};

pub fn handler(op: &str) -> Option<Handler> {
    Some(match op {
        "QLinearConv" => qlinear_conv,
        "ConvInteger" => conv_integer,
        "QLinearMatMul" => qlinear_matmul,
        _ => return None,
    })
}

/// The `com.microsoft` ops Ember reads, with their translations.
const MICROSOFT: &[(&str, Handler)] = &[
    ("QGemm", qgemm),
    ("QLinearAdd", qlinear_binary),
    ("QLinearAveragePool", qlinear_average_pool),
    ("QLinearConcat", qlinear_concat),
    ("QLinearGlobalAveragePool", qlinear_global_average_pool),
    ("QLinearLeakyRelu", qlinear_activation),
    ("QLinearMul", qlinear_binary),
    ("QLinearSigmoid", qlinear_activation),
];

pub fn microsoft_handler(op: &str) -> Option<Handler> {
    MICROSOFT
        .iter()
        .find(|(name, _)| *name == op)
        .map(|&(_, h)| h)
}

/// The names of the quantized `com.microsoft` ops Ember reads.
pub fn microsoft_ops() -> Vec<&'static str> {
    MICROSOFT.iter().map(|&(name, _)| name).collect()
}

/// Every integer up to 2^24 in magnitude is a float32, so a float32 sum of integers is
/// exact while its partial sums stay within this bound.
const EXACT_IN_F32: f64 = 16_777_216.0;

/// A per-tensor scale or zero point (0-d, or one element) as a 0-d value.
fn per_tensor(ctx: &mut Ctx, n: &Node, v: ValueId, what: &str) -> Result<ValueId> {
    let shape = ctx.b.shape(v);
    match shape.as_slice() {
        [] => Ok(v),
        [d] if *d == Dim::Const(1) => ctx.b.reshape(v, vec![]),
        _ => Err(n.unsupported(format!(
            "{what} of shape {} (Ember reads a per-tensor {what} here)",
            format_shape(&shape)
        ))),
    }
}

/// A per-tensor or per-output-channel parameter of a convolution (0-d, one element, or
/// `outs` elements): 0-d, or `[O, 1, ..]` of `dims` dims, which broadcasts against the
/// weight `[O, C/group, *kernel]` (`dims` its rank) or the output `[N, O, *spatial]`
/// (`dims` one less than its rank).
fn per_output_channel(
    ctx: &mut Ctx,
    n: &Node,
    v: ValueId,
    outs: &Dim,
    dims: usize,
    what: &str,
) -> Result<ValueId> {
    let shape = ctx.b.shape(v);
    match shape.as_slice() {
        [] => Ok(v),
        [d] if *d == Dim::Const(1) => ctx.b.reshape(v, vec![]),
        [d] if d == outs => {
            let mut to = vec![Dim::Const(1); dims];
            to[0] = d.clone();
            ctx.b.reshape(v, to)
        }
        _ => Err(n.err(format!(
            "{what} {} must be a scalar or one per output channel ({outs})",
            format_shape(&shape)
        ))),
    }
}

/// Input `k` of `n`, an 8-bit quantized tensor, and its dtype.
fn quantized_input(ctx: &mut Ctx, n: &Node, k: usize) -> Result<(ValueId, DType)> {
    let q = ctx.input(n, k)?;
    let dtype = ctx.b.dtype(q);
    range(n, dtype).map_err(|_| {
        n.err(format!(
            "input {k} must be uint8 or int8 (quantized), got {dtype}"
        ))
    })?;
    Ok((q, dtype))
}

/// The optional zero point at input `k` for a tensor of `dtype`, per tensor.
fn zero_point(ctx: &mut Ctx, n: &Node, k: usize, dtype: DType) -> Result<Option<ValueId>> {
    let Some(z) = ctx.opt_input(n, k)? else {
        return Ok(None);
    };
    if ctx.b.dtype(z) != dtype {
        return Err(n.err(format!(
            "zero point (input {k}) is {} but its tensor is {dtype}",
            ctx.b.dtype(z)
        )));
    }
    per_tensor(ctx, n, z, "zero point").map(Some)
}

/// The float values of the per-tensor quantized input at `q` with scale at `q + 1` and
/// zero point at `q + 2` (the layout of every QOperator op's inputs).
fn dequantized_input(ctx: &mut Ctx, n: &Node, q: usize) -> Result<(ValueId, DType)> {
    let (x, dtype) = quantized_input(ctx, n, q)?;
    let scale = ctx.input(n, q + 1)?;
    let scale = per_tensor(ctx, n, scale, "scale")?;
    let zero = zero_point(ctx, n, q + 2, dtype)?;
    Ok((dequantize_with(ctx, x, scale, zero)?, dtype))
}

/// `x` quantized with the per-tensor scale at input `s` and zero point at `s + 1`, to the
/// zero point's type (`default` without one).
fn quantized_output(
    ctx: &mut Ctx,
    n: &Node,
    x: ValueId,
    s: usize,
    default: DType,
) -> Result<ValueId> {
    let scale = ctx.input(n, s)?;
    let scale = per_tensor(ctx, n, scale, "output scale")?;
    let to = match ctx.opt_input(n, s + 1)? {
        Some(z) => ctx.b.dtype(z),
        None => default,
    };
    let zero = zero_point(ctx, n, s + 1, to)?;
    quantize_with(ctx, n, x, scale, zero, to)
}

/// `saturate(round(acc · multiplier) + zero)` of int32 accumulators, in float32 (ONNX
/// Runtime's requantization).
fn requantize(
    ctx: &mut Ctx,
    n: &Node,
    acc: ValueId,
    multiplier: ValueId,
    zero: Option<ValueId>,
    to: DType,
) -> Result<ValueId> {
    let acc = ctx.b.cast(acc, DType::F32)?;
    let scaled = bin(ctx, BinaryOp::Mul, acc, multiplier)?;
    round_into(ctx, n, scaled, zero, to)
}

/// The translation of the float op `op` applied to `inputs` (absent ones `None`), with
/// `n`'s name and attributes: a QOperator op reuses its float op's translation between
/// dequantization and quantization.
fn float_op(
    ctx: &mut Ctx,
    n: &Node,
    op: &'static str,
    inputs: &[Option<ValueId>],
) -> Result<ValueId> {
    let mut proto = n.proto.clone();
    proto.op_type = Some(op.to_owned());
    proto.domain = None;
    proto.input = inputs
        .iter()
        .enumerate()
        .map(|(k, v)| match v {
            Some(id) => {
                // A name no ONNX model gives a value: an ONNX name has no NUL.
                let name = format!("{}\0{op}\0{k}", n.name);
                ctx.bind(name.clone(), *id);
                name
            }
            None => String::new(),
        })
        .collect();
    let node = Node {
        proto: &proto,
        name: n.name.clone(),
        op,
        opset: n.opset,
    };
    let translate = super::handler(op).expect("a float op Ember translates");
    translate(ctx, &node)?
        .into_iter()
        .next()
        .and_then(|v| v.id)
        .ok_or_else(|| n.err(format!("the {op} it computes gave no tensor")))
}

/// The reach of `v - zero` over the range `(lo, hi)` of an 8-bit type: the largest
/// `|v - zero|`, over every zero point in `zeros` (all of the type's range when unknown).
fn reach((lo, hi): (f64, f64), zeros: Option<&[f64]>) -> f64 {
    match zeros {
        Some(z) => z.iter().map(|&z| (z - lo).max(hi - z)).fold(0.0, f64::max),
        None => hi - lo,
    }
}

/// `Conv(x - x_zero, w - w_zero)` of 8-bit integers, exactly, into int32. Inputs of `n`:
/// `[x, x_zero, w, w_zero]` at the given positions (zero points optional: per tensor for
/// x, per tensor or per output channel for w). Padding is by `x_zero` (by 0 after the
/// shift), as ONNX defines it.
///
/// It runs as the float32 convolution of the shifted integers, on the backends' own
/// convolution kernels: exact while every partial sum stays within 2^24 in magnitude,
/// which `|x - x_zero| ≤ reach` times the sum of `|w - w_zero|` over one output's window
/// bounds. The weight is constant in every quantized model, so that sum is known; input
/// channels are split into groups whose sums stay in bounds, each group's exact result
/// cast to int32 and added.
fn integer_conv(ctx: &mut Ctx, n: &Node, at: [usize; 4]) -> Result<ValueId> {
    let [ix, ixz, iw, iwz] = at;
    let (x, x_type) = quantized_input(ctx, n, ix)?;
    let (w, w_type) = quantized_input(ctx, n, iw)?;
    let x_zero = zero_point(ctx, n, ixz, x_type)?;
    let ws = ctx.b.shape(w);
    let dims: Option<Vec<i64>> = ws.iter().map(Dim::as_const).collect();
    let Some(dims) = dims.filter(|d| d.len() >= 3) else {
        return Err(n.err(format!(
            "weight {} must be [O, C/group, *kernel] with constant dims",
            format_shape(&ws)
        )));
    };
    let (outs, per_group) = (dims[0] as usize, dims[1] as usize);
    let taps: usize = dims[2..].iter().map(|&d| d as usize).product();
    // w's zero point: per tensor, or one per output channel.
    let mut w_zero = None;
    if let Some(z) = ctx.opt_input(n, iwz)? {
        if ctx.b.dtype(z) != w_type {
            return Err(n.err("the weight's zero point must have the weight's type"));
        }
        let outs = Dim::Const(outs as i64);
        w_zero = Some(per_output_channel(
            ctx,
            n,
            z,
            &outs,
            dims.len(),
            "w_zero_point",
        )?);
    }
    let x_zeros = match x_zero {
        None => Some(vec![0.0]),
        Some(_) => ctx.const_floats(n, ixz),
    };
    let x_reach = reach(range(n, x_type)?, x_zeros.as_deref());
    let w_zeros = match w_zero {
        None => Some(vec![0.0]),
        Some(_) => ctx.const_floats(n, iwz),
    };
    // Per output channel and input channel, the largest sum of |w - w_zero| one window
    // can take.
    let sums: Vec<Vec<f64>> = match (ctx.const_floats(n, iw), &w_zeros) {
        (Some(wv), Some(z)) => (0..outs)
            .map(|o| {
                let zero = z[if z.len() == 1 { 0 } else { o }];
                (0..per_group)
                    .map(|c| {
                        let at = (o * per_group + c) * taps;
                        wv[at..at + taps].iter().map(|&v| (v - zero).abs()).sum()
                    })
                    .collect()
            })
            .collect(),
        _ => {
            let w_reach = reach(range(n, w_type)?, w_zeros.as_deref());
            vec![vec![taps as f64 * w_reach; per_group]; outs]
        }
    };
    let limit = EXACT_IN_F32 / x_reach.max(1.0);
    let groups = n.int("group", 1)?;
    let chunks = channel_chunks(&sums, limit).ok_or_else(|| {
        n.unsupported(format!(
            "a kernel of {taps} taps whose int32 sums float32 cannot carry exactly"
        ))
    })?;
    if groups != 1 && chunks.len() > 1 {
        return Err(n.unsupported(
            "a grouped convolution whose int32 sums float32 cannot carry exactly in one pass",
        ));
    }
    let mut xf = ctx.b.cast(x, DType::F32)?;
    if let Some(z) = x_zero {
        xf = bin(ctx, BinaryOp::Sub, xf, z)?;
    }
    let mut wf = ctx.b.cast(w, DType::F32)?;
    if let Some(z) = w_zero {
        wf = bin(ctx, BinaryOp::Sub, wf, z)?;
    }
    let mut acc: Option<ValueId> = None;
    for &(start, end) in &chunks {
        let (xc, wc) = match chunks.len() {
            1 => (xf, wf),
            _ => {
                let (s, e) = (Dim::Const(start as i64), Dim::Const(end as i64));
                let xc = ctx.b.slice(xf, 1, s.clone(), e.clone(), 1)?;
                (xc, ctx.b.slice(wf, 1, s, e, 1)?)
            }
        };
        let part = float_op(ctx, n, "Conv", &[Some(xc), Some(wc)])?;
        let part = ctx.b.cast(part, DType::I32)?;
        acc = Some(match acc {
            None => part,
            Some(a) => bin(ctx, BinaryOp::Add, a, part)?,
        });
    }
    Ok(acc.expect("a weight has at least one input channel"))
}

/// Consecutive input channels `[start, end)` whose window sums, added over the chunk,
/// stay within `limit` for every output channel; `None` when one channel alone does not.
fn channel_chunks(sums: &[Vec<f64>], limit: f64) -> Option<Vec<(usize, usize)>> {
    let channels = sums.first().map_or(0, Vec::len);
    let mut chunks = Vec::new();
    let mut start = 0;
    let mut total = vec![0.0; sums.len()];
    for c in 0..channels {
        let fits = sums.iter().zip(&total).all(|(s, t)| t + s[c] <= limit);
        if !fits {
            if c == start {
                return None;
            }
            chunks.push((start, c));
            start = c;
            total.iter_mut().for_each(|t| *t = 0.0);
            if sums.iter().any(|s| s[c] > limit) {
                return None;
            }
        }
        total.iter_mut().zip(sums).for_each(|(t, s)| *t += s[c]);
    }
    chunks.push((start, channels));
    Some(chunks)
}

fn conv_integer(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    one(integer_conv(ctx, n, [0, 2, 1, 3])?)
}

/// Inputs x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point, then
/// an int32 bias (scale x_scale·w_scale, zero point 0) when present.
fn qlinear_conv(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = ctx.input(n, 0)?;
    let x_type = ctx.b.dtype(x);
    let mut acc = integer_conv(ctx, n, [0, 2, 3, 5])?;
    // Per-channel parameters broadcast against [N, O, *spatial] from O on.
    let dims = ctx.b.rank(acc) - 1;
    let outs = ctx.b.shape(acc)[1].clone();
    if let Some(bias) = ctx.opt_input(n, 8)? {
        if ctx.b.dtype(bias) != DType::I32 {
            return Err(n.err(format!("bias must be int32, got {}", ctx.b.dtype(bias))));
        }
        let bias = per_output_channel(ctx, n, bias, &outs, dims, "bias")?;
        acc = bin(ctx, BinaryOp::Add, acc, bias)?;
    }
    let x_scale = ctx.input(n, 1)?;
    let x_scale = per_tensor(ctx, n, x_scale, "x_scale")?;
    let w_scale = ctx.input(n, 4)?;
    let w_scale = per_output_channel(ctx, n, w_scale, &outs, dims, "w_scale")?;
    let y_scale = ctx.input(n, 6)?;
    let y_scale = per_tensor(ctx, n, y_scale, "y_scale")?;
    let product = bin(ctx, BinaryOp::Mul, x_scale, w_scale)?;
    let multiplier = bin(ctx, BinaryOp::Div, product, y_scale)?;
    let to = match ctx.opt_input(n, 7)? {
        Some(z) => ctx.b.dtype(z),
        None => x_type,
    };
    let y_zero = zero_point(ctx, n, 7, to)?;
    one(requantize(ctx, n, acc, multiplier, y_zero, to)?)
}

/// A scale or zero point of `QLinearMatMul`'s a (per tensor, or per row: `[M]` or
/// `[.., M, 1]`) or b (per tensor, or per column: `[N]` or `[.., 1, N]`), shaped to
/// broadcast against the product.
fn matmul_param(ctx: &mut Ctx, v: ValueId, of_a: bool) -> Result<ValueId> {
    let s = ctx.b.shape(v);
    match s.as_slice() {
        [] => Ok(v),
        [d] if *d == Dim::Const(1) => ctx.b.reshape(v, vec![]),
        [d] if of_a => ctx.b.reshape(v, vec![d.clone(), Dim::Const(1)]),
        _ => Ok(v),
    }
}

/// Inputs a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point.
fn qlinear_matmul(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let (a, a_type) = quantized_input(ctx, n, 0)?;
    let (b, b_type) = quantized_input(ctx, n, 3)?;
    let mut params = Vec::new();
    for (k, of_a, dtype) in [(1, true, None), (2, true, Some(a_type))]
        .into_iter()
        .chain([(4, false, None), (5, false, Some(b_type))])
    {
        let v = ctx.input(n, k)?;
        if dtype.is_some_and(|t| ctx.b.dtype(v) != t) {
            return Err(n.err(format!(
                "zero point (input {k}) must have its tensor's type"
            )));
        }
        params.push(matmul_param(ctx, v, of_a)?);
    }
    let [a_scale, a_zero, b_scale, b_zero] = params[..] else {
        unreachable!("four parameters")
    };
    let acc = integer_product(ctx, a, b, Some(a_zero), Some(b_zero))?;
    let product = bin(ctx, BinaryOp::Mul, a_scale, b_scale)?;
    let y_scale = ctx.input(n, 6)?;
    let y_scale = per_tensor(ctx, n, y_scale, "y_scale")?;
    let multiplier = bin(ctx, BinaryOp::Div, product, y_scale)?;
    let y_zero = ctx.input(n, 7)?;
    let to = ctx.b.dtype(y_zero);
    let y_zero = zero_point(ctx, n, 7, to)?;
    one(requantize(ctx, n, acc, multiplier, y_zero, to)?)
}

/// `com.microsoft.QGemm`: inputs A, a_scale, a_zero_point, B, b_scale, b_zero_point (per
/// tensor or per column), then optional C (int32, scale a_scale·b_scale), y_scale and
/// y_zero_point. With y_zero_point the output is requantized by `alpha·a_scale·b_scale /
/// y_scale`; without it, it is float: the accumulator times that factor (y_scale, when
/// given, still divides).
fn qgemm(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let (mut a, a_type) = quantized_input(ctx, n, 0)?;
    let (mut b, b_type) = quantized_input(ctx, n, 3)?;
    if ctx.b.rank(a) != 2 || ctx.b.rank(b) != 2 {
        return Err(n.err(format!(
            "A {} and B {} must be matrices",
            format_shape(&ctx.b.shape(a)),
            format_shape(&ctx.b.shape(b))
        )));
    }
    if n.int("transA", 0)? != 0 {
        a = ctx.b.permute(a, vec![1, 0])?;
    }
    if n.int("transB", 0)? != 0 {
        b = ctx.b.permute(b, vec![1, 0])?;
    }
    let a_scale = ctx.input(n, 1)?;
    let a_scale = per_tensor(ctx, n, a_scale, "a_scale")?;
    let a_zero = zero_point(ctx, n, 2, a_type)?;
    let b_scale = ctx.input(n, 4)?;
    let b_scale = matmul_param(ctx, b_scale, false)?;
    let b_zero = match ctx.opt_input(n, 5)? {
        Some(z) if ctx.b.dtype(z) != b_type => {
            return Err(n.err("b_zero_point must have B's type"));
        }
        Some(z) => Some(matmul_param(ctx, z, false)?),
        None => None,
    };
    let mut acc = integer_product(ctx, a, b, a_zero, b_zero)?;
    if let Some(c) = ctx.opt_input(n, 6)? {
        if ctx.b.dtype(c) != DType::I32 {
            return Err(n.err(format!("C must be int32, got {}", ctx.b.dtype(c))));
        }
        acc = bin(ctx, BinaryOp::Add, acc, c)?;
    }
    let alpha = n.float("alpha", 1.0)?;
    let mut scale = ctx.b.binary_in(
        BinaryOp::Mul,
        Operand::Scalar(Scalar::Float(f64::from(alpha))),
        Operand::Tensor(a_scale),
        DType::F32,
    )?;
    scale = bin(ctx, BinaryOp::Mul, scale, b_scale)?;
    if let Some(y_scale) = ctx.opt_input(n, 7)? {
        let y_scale = per_tensor(ctx, n, y_scale, "y_scale")?;
        scale = bin(ctx, BinaryOp::Div, scale, y_scale)?;
    }
    match ctx.opt_input(n, 8)? {
        Some(z) => {
            let to = ctx.b.dtype(z);
            let y_zero = zero_point(ctx, n, 8, to)?;
            one(requantize(ctx, n, acc, scale, y_zero, to)?)
        }
        None => {
            let acc = ctx.b.cast(acc, DType::F32)?;
            one(bin(ctx, BinaryOp::Mul, acc, scale)?)
        }
    }
}

/// `QLinearAdd` / `QLinearMul`: inputs A, A_scale, A_zero_point, B, B_scale,
/// B_zero_point, C_scale, C_zero_point (broadcasting as Add and Mul do).
fn qlinear_binary(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let (a, a_type) = dequantized_input(ctx, n, 0)?;
    let (b, _) = dequantized_input(ctx, n, 3)?;
    let op = match n.op {
        "QLinearAdd" => BinaryOp::Add,
        _ => BinaryOp::Mul,
    };
    let y = bin(ctx, op, a, b)?;
    one(quantized_output(ctx, n, y, 6, a_type)?)
}

/// `QLinearSigmoid` / `QLinearLeakyRelu` (attribute `alpha`): inputs X, X_scale,
/// X_zero_point, Y_scale, Y_zero_point.
fn qlinear_activation(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let (x, x_type) = dequantized_input(ctx, n, 0)?;
    let op = match n.op {
        "QLinearSigmoid" => "Sigmoid",
        _ => "LeakyRelu",
    };
    let y = float_op(ctx, n, op, &[Some(x)])?;
    one(quantized_output(ctx, n, y, 3, x_type)?)
}

/// Inputs X, x_scale, x_zero_point, y_scale, y_zero_point; `channels_last` puts the
/// channels last (`[N, *spatial, C]`).
fn qlinear_global_average_pool(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let (x, x_type) = dequantized_input(ctx, n, 0)?;
    let rank = ctx.b.rank(x);
    if rank < 3 {
        return Err(n.err(format!(
            "X {} must have batch, channel and spatial dims",
            format_shape(&ctx.b.shape(x))
        )));
    }
    let spatial: Vec<usize> = match n.int("channels_last", 0)? {
        0 => (2..rank).collect(),
        _ => (1..rank - 1).collect(),
    };
    let y = ctx.b.mean(x, spatial, true)?;
    one(quantized_output(ctx, n, y, 3, x_type)?)
}

/// Inputs X, x_scale, x_zero_point, y_scale, y_zero_point, and AveragePool's attributes
/// (`channels_last` as in `QLinearGlobalAveragePool`).
fn qlinear_average_pool(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let (mut x, x_type) = dequantized_input(ctx, n, 0)?;
    let rank = ctx.b.rank(x);
    let channels_last = n.int("channels_last", 0)? != 0 && rank >= 3;
    if channels_last {
        let mut perm = vec![0, rank - 1];
        perm.extend(1..rank - 1);
        x = ctx.b.permute(x, perm)?;
    }
    let mut y = float_op(ctx, n, "AveragePool", &[Some(x)])?;
    if channels_last {
        let mut perm = vec![0];
        perm.extend(2..rank);
        perm.push(1);
        y = ctx.b.permute(y, perm)?;
    }
    one(quantized_output(ctx, n, y, 3, x_type)?)
}

/// Inputs Y_scale, Y_zero_point, then (X, X_scale, X_zero_point) for each input;
/// attribute `axis`.
fn qlinear_concat(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let count = n.num_inputs().saturating_sub(2);
    if count == 0 || !count.is_multiple_of(3) {
        return Err(n.err(format!(
            "{} inputs: expected Y_scale, Y_zero_point, then (X, X_scale, X_zero_point) \
             triples",
            n.num_inputs()
        )));
    }
    let mut parts = Vec::with_capacity(count / 3);
    let mut x_type = DType::U8;
    for k in (2..2 + count).step_by(3) {
        let (x, t) = dequantized_input(ctx, n, k)?;
        parts.push(Some(x));
        x_type = t;
    }
    let y = float_op(ctx, n, "Concat", &parts)?;
    one(quantized_output(ctx, n, y, 0, x_type)?)
}

#[cfg(test)]
mod tests {
    use super::{channel_chunks, reach};

    #[test]
    fn reach_of_a_zero_point_is_the_farther_end_of_the_range() {
        assert_eq!(reach((0.0, 255.0), Some(&[128.0])), 128.0);
        assert_eq!(reach((0.0, 255.0), Some(&[0.0])), 255.0);
        assert_eq!(reach((-128.0, 127.0), Some(&[0.0, -100.0])), 227.0);
        assert_eq!(reach((-128.0, 127.0), None), 255.0);
    }

    #[test]
    fn channels_split_where_a_sum_would_pass_the_limit() {
        // Two outputs, four channels: the second output's sums decide the split.
        let sums = vec![vec![1.0, 1.0, 1.0, 1.0], vec![4.0, 5.0, 2.0, 9.0]];
        assert_eq!(
            channel_chunks(&sums, 10.0),
            Some(vec![(0, 2), (2, 3), (3, 4)])
        );
        assert_eq!(channel_chunks(&sums, 100.0), Some(vec![(0, 4)]));
        assert_eq!(channel_chunks(&sums, 8.0), None);
    }
}
