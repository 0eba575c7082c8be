//! ONNX Runtime's fused attention ops in the `com.microsoft` domain, as its transformer
//! optimizer (BERT-style `Attention`), its model builders (`GroupQueryAttention`,
//! `MultiHeadAttention`) and Optimum's exports write them: `Attention` (and `QAttention`, its
//! 8-bit form from `quantize_dynamic`), `MultiHeadAttention`, `GroupQueryAttention` and
//! `RotaryEmbedding`. Each becomes the IR's
//! `attention` with a mask that reproduces ONNX Runtime's CPU kernels exactly: padding is
//! *added* as `mask_filter_value` (-10000 by default, so a row of padding only still
//! averages its keys), the causal frontier hides keys outright, and
//! `GroupQueryAttention` reads per-sequence lengths (`seqlens_k`) at run time.

use super::attention::{
    const_dim, float_input, merge_heads, positions, rotate, scaled_dot_product, split_heads,
};
use super::{bin, Handler};
use crate::dim::{Dim, DimOp};
use crate::dtype::{DType, Scalar};
use crate::error::Result;
use crate::frontend::onnx::node::Node;
use crate::frontend::onnx::translate::{Ctx, Val};
use crate::ir::{BinaryOp, Op, ValueId};

/// The fused attention ops, by name.
pub const OPS: &[(&str, Handler)] = &[
    ("Attention", attention),
    ("GroupQueryAttention", group_query_attention),
    ("MultiHeadAttention", multi_head_attention),
    ("QAttention", q_attention),
    ("RotaryEmbedding", rotary_embedding),
];

pub fn handler(op: &str) -> Option<Handler> {
    OPS.iter().find(|(name, _)| *name == op).map(|&(_, h)| h)
}

/// The `scale` attribute, 0 (the default) meaning `1/√head`.
fn scale_of(n: &Node, head: usize) -> Result<f64> {
    Ok(match n.float("scale", 0.0)? {
        s if s != 0.0 => s as f64,
        _ => 1.0 / (head as f64).sqrt(),
    })
}

/// A required positive integer attribute.
fn heads_attr(n: &Node, name: &str) -> Result<i64> {
    match n.int(name, 0)? {
        h if h > 0 => Ok(h),
        _ => Err(n.err(format!("the {name} attribute must be given and positive"))),
    }
}

/// `v` sliced to `[start, end)` of its last axis.
fn columns(ctx: &mut Ctx, v: ValueId, start: i64, end: i64) -> Result<ValueId> {
    let last = ctx.b.rank(v) - 1;
    ctx.b.slice(v, last, Dim::Const(start), Dim::Const(end), 1)
}

/// `v + bias[start..end]` (a slice of a packed Q/K/V bias).
fn add_bias_part(
    ctx: &mut Ctx,
    v: ValueId,
    bias: Option<ValueId>,
    start: i64,
    end: i64,
) -> Result<ValueId> {
    match bias {
        Some(b) => {
            let part = columns(ctx, b, start, end)?;
            bin(ctx, BinaryOp::Add, v, part)
        }
        None => Ok(v),
    }
}

/// A `[rows]`-long int64 column `[rows, 1]` and a `[cols]`-long row `[1, cols]` of positions.
fn grid(ctx: &mut Ctx, rows: &Dim, cols: &Dim) -> Result<(ValueId, ValueId)> {
    let r = positions(ctx, rows.clone())?;
    let r = ctx.b.reshape(r, vec![rows.clone(), Dim::Const(1)])?;
    let c = positions(ctx, cols.clone())?;
    let c = ctx.b.reshape(c, vec![Dim::Const(1), cols.clone()])?;
    Ok((r, c))
}

/// `a op b` with broadcasting, in `a`'s dtype for arithmetic, bool for comparisons.
fn cmp(ctx: &mut Ctx, op: BinaryOp, a: ValueId, b: ValueId) -> Result<ValueId> {
    let v = ctx.b.broadcast_all(&[a, b])?;
    ctx.b.op(Op::Binary(op), &v)
}

/// ONNX Runtime's padding masks (`mask_index` of `Attention`, `key_padding_mask` of
/// `MultiHeadAttention`) as "keep" booleans `[B, 1, S or 1, T]`: `[B]` end positions,
/// `[2B]` ends then starts, `[3B+2]` (only its ends are read), `[B, T]` or `[B, S, T]` with
/// keys kept where the value is positive. `[B, 1]` and `[1, 1]` masks mask nothing.
fn padding_keep(
    ctx: &mut Ctx,
    n: &Node,
    mask: ValueId,
    batch: &Dim,
    queries: &Dim,
    keys: &Dim,
) -> Result<Option<ValueId>> {
    if !ctx.b.dtype(mask).is_int() {
        return Err(n.err(format!(
            "the mask must be an integer tensor, got {}",
            ctx.b.dtype(mask)
        )));
    }
    let mask = ctx.b.cast(mask, DType::I64)?;
    let ms = ctx.b.shape(mask);
    let c = Dim::Const;
    let keep = match ms.len() {
        1 => {
            let len = &ms[0];
            let times = |k: i64, plus: i64| {
                let scaled = Dim::binary(DimOp::Mul, batch.clone(), c(k));
                Dim::binary(DimOp::Add, scaled, c(plus))
            };
            let (_, cols) = grid(ctx, &c(1), keys)?;
            // Element b (of ends) or B + b (of starts) as a [B, 1] column.
            let column = |ctx: &mut Ctx, from: Dim| -> Result<ValueId> {
                let to = Dim::binary(DimOp::Add, from.clone(), batch.clone());
                let part = ctx.b.slice(mask, 0, from, to, 1)?;
                ctx.b.reshape(part, vec![batch.clone(), c(1)])
            };
            let ends = column(ctx, c(0))?;
            let before_end = cmp(ctx, BinaryOp::Lt, cols, ends)?;
            let keep = if len == batch || *len == times(3, 2) {
                before_end
            } else if *len == times(2, 0) {
                let starts = column(ctx, batch.clone())?;
                let after_start = cmp(ctx, BinaryOp::Ge, cols, starts)?;
                cmp(ctx, BinaryOp::And, before_end, after_start)?
            } else {
                return Err(n.err(format!(
                    "a 1-d mask of {len} elements for batch {batch} (B, 2·B or 3·B+2 are read)"
                )));
            };
            ctx.b
                .reshape(keep, vec![batch.clone(), c(1), c(1), keys.clone()])?
        }
        2 if ms[1] == c(1) => return Ok(None),
        2 | 3 => {
            if &ms[ms.len() - 1] != keys || (ms.len() == 3 && &ms[1] != queries) {
                return Err(n.err(format!(
                    "a mask of shape {ms:?} for {queries} queries over {keys} keys \
                     ([B, keys] or [B, queries, keys])"
                )));
            }
            let zero = ctx.b.full(Scalar::Int(0), DType::I64, vec![])?;
            let keep = cmp(ctx, BinaryOp::Gt, mask, zero)?;
            let rows = if ms.len() == 3 { ms[1].clone() } else { c(1) };
            ctx.b
                .reshape(keep, vec![ms[0].clone(), c(1), rows, keys.clone()])?
        }
        r => {
            return Err(n.unsupported(format!(
                "a mask of rank {r} (ONNX Runtime's CPU kernels read ranks 1 to 3)"
            )))
        }
    };
    Ok(Some(keep))
}

/// How `Attention` and `MultiHeadAttention` mask their scores (ONNX Runtime's
/// `PrepareMask`): padding adds `filter`, `bias` (`attention_bias`, `[B|1, N|1, S, T]`) is
/// added, and with `causal` each query row `s` but the last is kept from the keys past
/// `past + s`.
struct Masking {
    pad: Option<ValueId>,
    bias: Option<ValueId>,
    causal: bool,
    past: Dim,
    filter: f64,
}

/// `q4` (`[B, N, S, H]`) attending over `k4`, `v4` (`[B, N, T, H]`) masked as `m` says.
fn masked_attention(
    ctx: &mut Ctx,
    n: &Node,
    [q4, k4, v4]: [ValueId; 3],
    m: Masking,
    scale: f64,
) -> Result<ValueId> {
    let dtype = ctx.b.dtype(q4);
    let (qs, ks) = (ctx.b.shape(q4), ctx.b.shape(k4));
    let (s, t) = (qs[2].clone(), ks[2].clone());
    let full = vec![qs[0].clone(), qs[1].clone(), s.clone(), t.clone()];
    let mut added = None;
    if let Some(keep) = m.pad {
        let zero = ctx.b.full(Scalar::Float(0.0), dtype, vec![])?;
        let filter = ctx.b.full(Scalar::Float(m.filter), dtype, vec![])?;
        let v = ctx.b.broadcast_all(&[keep, zero, filter])?;
        added = Some(ctx.b.op(Op::Where, &v)?);
    }
    if let Some(bias) = m.bias {
        if ctx.b.dtype(bias) != dtype || ctx.b.rank(bias) != 4 {
            return Err(n.err(format!(
                "attention_bias must be a 4-D {dtype} tensor [B or 1, N or 1, S, T]"
            )));
        }
        added = Some(match added {
            Some(a) => cmp(ctx, BinaryOp::Add, a, bias)?,
            None => bias,
        });
    }
    let mut mask = match added {
        Some(a) => Some(ctx.b.broadcast_to(a, &full)?),
        None => None,
    };
    let no_past = m.past == Dim::Const(0);
    let ir_causal = m.causal && no_past && t == s && mask.is_none();
    if m.causal && !ir_causal {
        let (rows, cols) = grid(ctx, &s, &t)?;
        let past = ctx.b.dim_value(&m.past, DType::I64)?;
        let last_seen = bin(ctx, BinaryOp::Add, rows, past)?;
        let mut keep = cmp(ctx, BinaryOp::Le, cols, last_seen)?;
        // ONNX Runtime never masks the last query row: it matters only where the keys
        // are not the past plus one per query (cross attention).
        if t != Dim::binary(DimOp::Add, m.past.clone(), s.clone()) {
            let last = Dim::binary(DimOp::Sub, s.clone(), Dim::Const(1));
            let last = ctx.b.dim_value(&last, DType::I64)?;
            let is_last = cmp(ctx, BinaryOp::Eq, rows, last)?;
            keep = cmp(ctx, BinaryOp::Or, keep, is_last)?;
        }
        let keep = ctx.b.broadcast_to(keep, &full)?;
        mask = Some(match mask {
            None => keep,
            Some(a) => {
                let hidden = ctx
                    .b
                    .full(Scalar::Float(f64::NEG_INFINITY), dtype, full.clone())?;
                ctx.b.op(Op::Where, &[keep, a, hidden])?
            }
        });
    }
    scaled_dot_product(ctx, [q4, k4, v4], mask, ir_causal, scale, 0.0)
}

/// Input positions of what `Attention` and `QAttention` share after their projections.
struct AttentionInputs {
    mask: usize,
    past: usize,
    bias: Option<usize>,
}

/// `com.microsoft.Attention` (BERT and GPT-2 as ONNX Runtime's optimizer fuses them): the
/// Q/K/V projection `input · weights + bias`, a `past` of `[2, B, N, P, H]` concatenated
/// before the new keys (`present` is the concatenation), padding (`mask_index`), an
/// `attention_bias`, and `unidirectional` (causal) attention.
fn attention(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    refuse_attention_extras(n, 6)?;
    let x = float_input(ctx, n, 0, None)?;
    let dtype = ctx.b.dtype(x);
    let w = float_input(ctx, n, 1, Some(dtype))?;
    if ctx.b.rank(x) != 3 || ctx.b.rank(w) != 2 {
        return Err(n.err("input must be [B, S, hidden] and weights [hidden, Q+K+V widths]"));
    }
    let qkv = ctx.b.matmul(x, w)?;
    let inputs = AttentionInputs {
        mask: 3,
        past: 4,
        bias: Some(5),
    };
    projected_attention(ctx, n, qkv, inputs)
}

/// `com.microsoft.QAttention` (an optimized BERT quantized by `quantize_dynamic`):
/// `Attention` whose projection is the 8-bit product `(input − zi)·(weight − zw)`, exact in
/// int32, scaled by `input_scale · weight_scale` (per tensor, or per column for the weight).
fn q_attention(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    refuse_attention_extras(n, usize::MAX)?;
    let x = ctx.input(n, 0)?;
    let w = ctx.input(n, 1)?;
    for (v, what) in [(x, "input"), (w, "weight")] {
        if !matches!(ctx.b.dtype(v), DType::U8 | DType::I8) {
            return Err(n.err(format!(
                "{what} must be uint8 or int8, got {}",
                ctx.b.dtype(v)
            )));
        }
    }
    if ctx.b.rank(x) != 3 || ctx.b.rank(w) != 2 {
        return Err(n.err("input must be [B, S, hidden] and weights [hidden, Q+K+V widths]"));
    }
    let x_scale = float_input(ctx, n, 3, None)?;
    let dtype = ctx.b.dtype(x_scale);
    let w_scale = float_input(ctx, n, 4, Some(dtype))?;
    let scalar_or_row = |ctx: &mut Ctx, v: ValueId| -> Result<ValueId> {
        match ctx.b.shape(v).as_slice() {
            [Dim::Const(1)] => ctx.b.reshape(v, vec![]),
            _ => Ok(v),
        }
    };
    let (x_scale, w_scale) = (scalar_or_row(ctx, x_scale)?, scalar_or_row(ctx, w_scale)?);
    let zero = |ctx: &mut Ctx, k: usize| -> Result<Option<ValueId>> {
        match ctx.opt_input(n, k)? {
            Some(z) => Ok(Some(scalar_or_row(ctx, z)?)),
            None => Ok(None),
        }
    };
    let (x_zero, w_zero) = (zero(ctx, 6)?, zero(ctx, 7)?);
    if ctx.b.rank(x_scale) != 0 || x_zero.is_some_and(|z| ctx.b.rank(z) != 0) {
        return Err(n.err("input_scale and input_zero_point must be scalars"));
    }
    let product = super::quant::integer_product(ctx, x, w, x_zero, w_zero)?;
    let product = ctx.b.cast(product, dtype)?;
    let scale = cmp(ctx, BinaryOp::Mul, x_scale, w_scale)?;
    let qkv = cmp(ctx, BinaryOp::Mul, product, scale)?;
    let inputs = AttentionInputs {
        mask: 5,
        past: 8,
        bias: None,
    };
    projected_attention(ctx, n, qkv, inputs)
}

/// What both refuse: rotary inside the op, a past and present sharing one buffer (and its
/// `past_sequence_length`, input `length_input`).
fn refuse_attention_extras(n: &Node, length_input: usize) -> Result<()> {
    if n.flag("do_rotary", false)? {
        return Err(n.unsupported("do_rotary (ONNX Runtime's CPU kernel refuses it too)"));
    }
    if n.flag("past_present_share_buffer", false)? || n.input(length_input).is_some() {
        return Err(n.unsupported("a past and present sharing one buffer"));
    }
    Ok(())
}

/// `Attention` after its projection `qkv` (`[B, S, Q+K+V widths]`, before the bias).
fn projected_attention(
    ctx: &mut Ctx,
    n: &Node,
    mut qkv: ValueId,
    at: AttentionInputs,
) -> Result<Vec<Val>> {
    let dtype = ctx.b.dtype(qkv);
    let heads = heads_attr(n, "num_heads")?;
    let width = const_dim(ctx, n, qkv, 2, "projection width")? as i64;
    let sizes = match n.ints("qkv_hidden_sizes")? {
        Some(v) if v.len() == 3 => [v[0], v[1], v[2]],
        Some(v) => return Err(n.err(format!("qkv_hidden_sizes {v:?} needs 3 sizes"))),
        None if width % 3 == 0 => [width / 3; 3],
        None => return Err(n.err(format!("weights of width {width} split into 3 equal parts"))),
    };
    let [dq, dk, dv] = sizes;
    if dq != dk || dq + dk + dv != width || sizes.iter().any(|&d| d <= 0 || d % heads != 0) {
        return Err(n.err(format!(
            "qkv_hidden_sizes {sizes:?}: Q and K as wide, all splitting into {heads} heads, \
             summing to the weights' width {width}"
        )));
    }
    if let Some(bias) = ctx.opt_input(n, 2)? {
        if ctx.b.shape(bias) != [Dim::Const(width)] || ctx.b.dtype(bias) != dtype {
            return Err(n.err(format!("bias must be a [{width}] {dtype} vector")));
        }
        qkv = bin(ctx, BinaryOp::Add, qkv, bias)?;
    }
    let q = columns(ctx, qkv, 0, dq)?;
    let k = columns(ctx, qkv, dq, dq + dk)?;
    let v = columns(ctx, qkv, dq + dk, width)?;
    let q4 = split_heads(ctx, n, q, heads, "Q")?;
    let mut k4 = split_heads(ctx, n, k, heads, "K")?;
    let mut v4 = split_heads(ctx, n, v, heads, "V")?;
    let mut past_len = Dim::Const(0);
    if let Some(past) = ctx.opt_input(n, at.past)? {
        let ps = ctx.b.shape(past);
        if ps.len() != 5 || ps[0] != Dim::Const(2) || ctx.b.dtype(past) != dtype {
            return Err(n.err(format!("past must be a [2, B, N, P, H] {dtype} tensor")));
        }
        let half = |ctx: &mut Ctx, k: i64| -> Result<ValueId> {
            let part = ctx.b.slice(past, 0, Dim::Const(k), Dim::Const(k + 1), 1)?;
            ctx.b.reshape(part, ps[1..].to_vec())
        };
        let (pk, pv) = (half(ctx, 0)?, half(ctx, 1)?);
        past_len = ps[3].clone();
        k4 = ctx.b.op(Op::Concat { axis: 2 }, &[pk, k4])?;
        v4 = ctx.b.op(Op::Concat { axis: 2 }, &[pv, v4])?;
    }
    let qs = ctx.b.shape(q4);
    let keys = ctx.b.shape(k4)[2].clone();
    let pad = match ctx.opt_input(n, at.mask)? {
        Some(m) => padding_keep(ctx, n, m, &qs[0], &qs[2], &keys)?,
        None => None,
    };
    let bias = match at.bias {
        Some(k) => ctx.opt_input(n, k)?,
        None => None,
    };
    let masking = Masking {
        pad,
        bias,
        causal: n.flag("unidirectional", false)?,
        past: past_len,
        filter: n.float("mask_filter_value", -10000.0)? as f64,
    };
    let head = (dq / heads) as usize;
    let y = masked_attention(ctx, n, [q4, k4, v4], masking, scale_of(n, head)?)?;
    let y = merge_heads(ctx, y)?;
    let mut outs = vec![Val::of(y)];
    if n.wants_output(1) {
        let stack = |ctx: &mut Ctx, v: ValueId| -> Result<ValueId> {
            let mut s = ctx.b.shape(v);
            s.insert(0, Dim::Const(1));
            ctx.b.reshape(v, s)
        };
        let (pk, pv) = (stack(ctx, k4)?, stack(ctx, v4)?);
        outs.push(Val::of(ctx.b.op(Op::Concat { axis: 0 }, &[pk, pv])?));
    }
    Ok(outs)
}

/// `com.microsoft.MultiHeadAttention`: separate Q, K, V (`[B, S, D]`; keys and values may
/// come already split into heads, `[B, N, L, H]`, for cross attention), a packed bias added
/// to Q and to 3-D K and V, padding, `attention_bias`, a past concatenated before the new
/// keys, and `unidirectional`. Outputs the attention and the present keys and values.
fn multi_head_attention(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    if n.wants_output(3) {
        return Err(n.unsupported("the qk debugging output"));
    }
    if n.input(8).is_some() || n.input(9).is_some() {
        return Err(n.unsupported(
            "past_sequence_length / cache_indirection (a shared buffer for beam search)",
        ));
    }
    let heads = heads_attr(n, "num_heads")?;
    let q = float_input(ctx, n, 0, None)?;
    let dtype = ctx.b.dtype(q);
    if ctx.b.rank(q) != 3 {
        return Err(n.unsupported(format!(
            "a query of rank {} (packed Q/K/V; [B, S, D] queries are read)",
            ctx.b.rank(q)
        )));
    }
    if n.input(1).is_none() || n.input(2).is_none() {
        return Err(n.unsupported("keys and values packed with the query"));
    }
    let k = float_input(ctx, n, 1, Some(dtype))?;
    let v = float_input(ctx, n, 2, Some(dtype))?;
    let d = const_dim(ctx, n, q, 2, "query width")? as i64;
    let bias = ctx.opt_input(n, 3)?;
    let bias_len = match bias {
        Some(b) if ctx.b.rank(b) == 1 && ctx.b.dtype(b) == dtype => {
            const_dim(ctx, n, b, 0, "bias length")? as i64
        }
        Some(_) => return Err(n.err(format!("bias must be a 1-d {dtype} vector"))),
        None => 0,
    };
    let q = add_bias_part(ctx, q, bias, 0, d)?;
    let q4 = split_heads(ctx, n, q, heads, "query")?;
    let (mut k4, mut v4) = match (ctx.b.rank(k), ctx.b.rank(v)) {
        (3, 3) => {
            let k = add_bias_part(ctx, k, bias, d, 2 * d)?;
            let v = add_bias_part(ctx, v, bias, 2 * d, bias_len)?;
            (
                split_heads(ctx, n, k, heads, "key")?,
                split_heads(ctx, n, v, heads, "value")?,
            )
        }
        (4, 4) => (k, v),
        (kr, vr) => {
            return Err(n.unsupported(format!(
                "keys of rank {kr} and values of rank {vr} ([B, L, D] or [B, N, L, H] each; \
                 packed keys and values are not read)"
            )))
        }
    };
    let mut past_len = Dim::Const(0);
    match (ctx.opt_input(n, 6)?, ctx.opt_input(n, 7)?) {
        (Some(pk), Some(pv)) => {
            for (p, what) in [(pk, "past_key"), (pv, "past_value")] {
                if ctx.b.rank(p) != 4 || ctx.b.dtype(p) != dtype {
                    return Err(n.err(format!("{what} must be a 4-D {dtype} tensor")));
                }
            }
            past_len = ctx.b.shape(pk)[2].clone();
            k4 = ctx.b.op(Op::Concat { axis: 2 }, &[pk, k4])?;
            v4 = ctx.b.op(Op::Concat { axis: 2 }, &[pv, v4])?;
        }
        (None, None) => {}
        _ => return Err(n.err("past_key and past_value must be given together")),
    }
    let qs = ctx.b.shape(q4);
    let keys = ctx.b.shape(k4)[2].clone();
    let pad = match ctx.opt_input(n, 4)? {
        Some(m) => padding_keep(ctx, n, m, &qs[0], &qs[2], &keys)?,
        None => None,
    };
    let masking = Masking {
        pad,
        bias: ctx.opt_input(n, 5)?,
        causal: n.flag("unidirectional", false)?,
        past: past_len,
        filter: n.float("mask_filter_value", -10000.0)? as f64,
    };
    let head = const_dim(ctx, n, q4, 3, "head size")?;
    let y = masked_attention(ctx, n, [q4, k4, v4], masking, scale_of(n, head)?)?;
    Ok(vec![
        Val::of(merge_heads(ctx, y)?),
        Val::of(k4),
        Val::of(v4),
    ])
}

/// `com.microsoft.GroupQueryAttention` (ONNX Runtime's LLM builders): grouped K/V heads, a
/// KV cache whose valid length per sequence is read at run time (`seqlens_k[b] + 1`
/// keys in all, the new ones written after the `tot_b − S` cached), rotary embeddings of
/// the new queries and keys at their positions, a causal frontier, a local window, a
/// soft cap, an attention bias, attention sinks (`head_sink`, `smooth_softmax`) and
/// per-head RMS norms of the queries and keys (`q_norm_weight`, `k_norm_weight`).
///
/// `present` holds `max(total_sequence_length, past buffer)` positions: the cached keys, the
/// new ones, zeros after them (as ONNX Runtime writes it). The first prompt (`S` equal to
/// the total) is the case `tot_b − S ≤ 0`: nothing cached, new keys from position 0.
fn group_query_attention(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    if n.wants_output(3) {
        return Err(n.unsupported("the output_qk debugging output"));
    }
    let refused = [
        (12, "k_scale (a quantized cache)"),
        (13, "v_scale (a quantized cache)"),
        (16, "query_seqlens"),
    ];
    for (k, what) in refused {
        if n.input(k).is_some() {
            return Err(n.unsupported(format!("the {what} input")));
        }
    }
    if n.int("sliding_window_cache", 0)? != 0 || n.int("kv_cache_bit_width", 0)? != 0 {
        return Err(n.unsupported("a sliding-window or quantized KV cache"));
    }
    let heads = heads_attr(n, "num_heads")?;
    let kv_heads = heads_attr(n, "kv_num_heads")?;
    if heads % kv_heads != 0 {
        return Err(n.err(format!(
            "{heads} query heads do not group into {kv_heads} key/value heads"
        )));
    }
    let query = float_input(ctx, n, 0, None)?;
    let dtype = ctx.b.dtype(query);
    if ctx.b.rank(query) != 3 {
        return Err(n.err("query must be [B, S, width]"));
    }
    let width = const_dim(ctx, n, query, 2, "query width")? as i64;
    let (q, k, v, head) = match n.input(1) {
        Some(_) => {
            let k = float_input(ctx, n, 1, Some(dtype))?;
            let v = float_input(ctx, n, 2, Some(dtype))?;
            (query, k, v, width / heads)
        }
        None => {
            let head = width / (heads + 2 * kv_heads);
            if head * (heads + 2 * kv_heads) != width {
                return Err(n.err(format!(
                    "a packed query of width {width} does not split into {heads} + 2·{kv_heads} heads"
                )));
            }
            let (qw, kw) = (heads * head, kv_heads * head);
            (
                columns(ctx, query, 0, qw)?,
                columns(ctx, query, qw, qw + kw)?,
                columns(ctx, query, qw + kw, width)?,
                head,
            )
        }
    };
    // [B, S, heads, H], the layout `rotate` takes.
    let per_head = |ctx: &mut Ctx, x: ValueId, h: i64, what: &str| -> Result<ValueId> {
        let s = ctx.b.shape(x);
        if s.len() != 3 || s[2] != Dim::Const(h * head) {
            return Err(n.err(format!("{what} must be [B, S, {}]", h * head)));
        }
        ctx.b.reshape(
            x,
            vec![s[0].clone(), s[1].clone(), Dim::Const(h), Dim::Const(head)],
        )
    };
    let mut q = per_head(ctx, q, heads, "query")?;
    let mut k = per_head(ctx, k, kv_heads, "key")?;
    // Qwen3's per-head RMS norms of queries and keys, before any rotation.
    match (ctx.opt_input(n, 14)?, ctx.opt_input(n, 15)?) {
        (Some(qw), Some(kw)) => {
            let both = n.float("qk_norm_epsilon", 1e-6)?;
            let q_eps = n.float("q_norm_epsilon", both)? as f64;
            let k_eps = n.float("k_norm_epsilon", both)? as f64;
            for (x, w, eps, what) in [
                (&mut q, qw, q_eps, "q_norm_weight"),
                (&mut k, kw, k_eps, "k_norm_weight"),
            ] {
                if ctx.b.dtype(w) != dtype || ctx.b.shape(w) != [Dim::Const(head)] {
                    return Err(n.err(format!("{what} must be a [{head}] {dtype} tensor")));
                }
                let norm = Op::RmsNorm {
                    axis: 3,
                    eps,
                    has_weight: true,
                };
                *x = ctx.b.op(norm, &[*x, w])?;
            }
        }
        (None, None) => {}
        _ => return Err(n.err("q_norm_weight and k_norm_weight must be given together")),
    }
    let v = per_head(ctx, v, kv_heads, "value")?;
    let qs = ctx.b.shape(q);
    let (batch, s) = (qs[0].clone(), qs[1].clone());

    // Per sequence: tot_b keys in all, past_b = max(tot_b − S, 0) of them cached.
    let lens = ctx.input(n, 5)?;
    if ctx.b.rank(lens) != 1 || !ctx.b.dtype(lens).is_int() {
        return Err(n.err("seqlens_k must be a 1-d integer tensor"));
    }
    // Shared by every layer reading the same lengths.
    let tot = ctx.shared(format!("gqa total {lens:?} {batch}"), |ctx| {
        let lens = ctx.b.cast(lens, DType::I64)?;
        let one = ctx.b.full(Scalar::Int(1), DType::I64, vec![])?;
        let tot = bin(ctx, BinaryOp::Add, lens, one)?;
        ctx.b.reshape(tot, vec![batch.clone(), Dim::Const(1)])
    })?;
    let past_b = ctx.shared(format!("gqa past {tot:?} {s}"), |ctx| {
        let s_val = ctx.b.dim_value(&s, DType::I64)?;
        let past_b = bin(ctx, BinaryOp::Sub, tot, s_val)?;
        let zero = ctx.b.full(Scalar::Int(0), DType::I64, vec![])?;
        bin(ctx, BinaryOp::Max, past_b, zero)
    })?;
    let total = match ctx.known(n, 6) {
        Some(k) if k.dims.len() == 1 => k.dims[0].clone(),
        _ => {
            return Err(n.unsupported(
                "a total_sequence_length computed from tensor values (Ember needs it from \
                 shapes or constants: it sizes the present key/value outputs)",
            ))
        }
    };

    if n.flag("do_rotary", false)? {
        let cos = float_input(ctx, n, 7, Some(dtype))?;
        let sin = float_input(ctx, n, 8, Some(dtype))?;
        if ctx.b.rank(cos) != 2 || ctx.b.shape(sin) != ctx.b.shape(cos) {
            return Err(n.err("cos_cache and sin_cache must both be [positions, rotary_dim/2]"));
        }
        let rot = 2 * const_dim(ctx, n, cos, 1, "rotary width")? as i64;
        if rot > head {
            return Err(n.err(format!("rotating {rot} features of heads of {head}")));
        }
        // Query s of sequence b sits at position past_b + s, or where position_ids say.
        let pos = match ctx.opt_input(n, 9)? {
            None => ctx.shared(format!("gqa positions {past_b:?} {s}"), |ctx| {
                let (_, steps) = grid(ctx, &Dim::Const(1), &s)?;
                cmp(ctx, BinaryOp::Add, steps, past_b)
            })?,
            Some(ids) => given_positions(ctx, n, ids, [&batch, &s, &total])?,
        };
        let [cos, sin] = [cos, sin].map(|table| {
            ctx.shared(format!("gqa angles {table:?} {pos:?}"), |ctx| {
                ctx.b.op(Op::IndexSelect { axis: 0 }, &[table, pos])
            })
        });
        let (cos, sin) = (cos?, sin?);
        let interleaved = n.flag("rotary_interleaved", false)?;
        q = rotate(ctx, n, q, [cos, sin], rot, interleaved)?;
        k = rotate(ctx, n, k, [cos, sin], rot, interleaved)?;
    }
    let to_bnsh = |ctx: &mut Ctx, x: ValueId| ctx.b.permute(x, vec![0, 2, 1, 3]);
    let q4 = to_bnsh(ctx, q)?;
    let (k_new, v_new) = (to_bnsh(ctx, k)?, to_bnsh(ctx, v)?);

    let (past_k, past_v) = match (ctx.opt_input(n, 3)?, ctx.opt_input(n, 4)?) {
        (Some(pk), Some(pv)) => {
            let mut cache = [pk, pv];
            for (p, what) in cache.iter_mut().zip(["past_key", "past_value"]) {
                let mut ps = ctx.b.shape(*p);
                if ps.len() != 4
                    || ctx.b.dtype(*p) != dtype
                    || ps[3].as_const().is_some_and(|d| d != head)
                {
                    return Err(n.err(format!(
                        "{what} must be a [B, {kv_heads}, positions, {head}] {dtype} tensor"
                    )));
                }
                // ONNX Runtime's builders name the head size (`kv_cache_dim`): a reshape
                // makes it the head size, checked at run time.
                ps[3] = Dim::Const(head);
                *p = ctx.b.reshape(*p, ps)?;
            }
            (Some(cache[0]), Some(cache[1]))
        }
        (None, None) => (None, None),
        _ => return Err(n.err("past_key and past_value must be given together")),
    };
    let buffer = match past_k {
        Some(pk) => ctx.b.shape(pk)[2].clone(),
        None => Dim::Const(0),
    };
    // ONNX Runtime accepts a total of the past buffer plus the new keys (a growing cache)
    // or at most the buffer (a static one); other constant lengths are refused here. (With
    // symbolic lengths the cache rows read are clamped into range either way.)
    if let (Some(t), Some(sv), Some(p)) = (total.as_const(), s.as_const(), buffer.as_const()) {
        if t != p + sv && !(p > 0 && t <= p) {
            return Err(n.err(format!(
                "total_sequence_length {t} for {sv} new keys after a past buffer of {p} \
                 (it must be {} or at most the buffer)",
                p + sv
            )));
        }
    }
    let present_len = match past_k {
        Some(_) => Dim::binary(DimOp::Max, total.clone(), buffer.clone()),
        None => total.clone(),
    };
    let present = |ctx: &mut Ctx, past: Option<ValueId>, new: ValueId| -> Result<ValueId> {
        present_cache(ctx, past, new, past_b, [&s, &present_len])
    };
    let present_k = present(ctx, past_k, k_new)?;
    let present_v = present(ctx, past_v, v_new)?;

    let causal = n.int("causal", 1)? != 0;
    let window = n.int("local_window_size", -1)?;
    let full = vec![
        batch.clone(),
        Dim::Const(heads),
        s.clone(),
        present_len.clone(),
    ];
    let key = format!("gqa keep {past_b:?} {tot:?} {s} {present_len} {causal} {window} {heads}");
    let keep = ctx.shared(key, |ctx| {
        visible_keys(ctx, [past_b, tot], &s, &present_len, causal, window, &full)
    })?;
    let mask = match ctx.opt_input(n, 10)? {
        Some(bias) => {
            if ctx.b.dtype(bias) != dtype || ctx.b.rank(bias) != 4 {
                return Err(n.err(format!(
                    "attention_bias must be a 4-D {dtype} tensor [B or 1, N or 1, S, total]"
                )));
            }
            let bias = ctx.b.broadcast_to(bias, &full)?;
            let hidden = ctx
                .b
                .full(Scalar::Float(f64::NEG_INFINITY), dtype, full.clone())?;
            ctx.b.op(Op::Where, &[keep, bias, hidden])?
        }
        None => keep,
    };
    // A sink logit per head (`head_sink`, or 0 for `smooth_softmax`) joins each softmax's
    // denominator: one more key, of zeros, scored by the mask.
    let sink = match ctx.opt_input(n, 11)? {
        Some(sink) => Some(sink),
        None if n.int("smooth_softmax", 0)? == 1 => Some(ctx.b.full(
            Scalar::Float(0.0),
            dtype,
            vec![Dim::Const(heads)],
        )?),
        None => None,
    };
    let (mask, [present_k_seen, present_v_seen]) = match sink {
        None => (mask, [present_k, present_v]),
        Some(sink) => {
            if ctx.b.dtype(sink) != dtype || ctx.b.shape(sink) != [Dim::Const(heads)] {
                return Err(n.err(format!("head_sink must be a [{heads}] {dtype} tensor")));
            }
            with_sink_key(ctx, [present_k, present_v], mask, sink, &full)?
        }
    };
    let q_heads = Dim::Const(heads);
    let kr = ctx.b.repeat_heads(present_k_seen, &q_heads)?;
    let vr = ctx.b.repeat_heads(present_v_seen, &q_heads)?;
    let scale = scale_of(n, head as usize)?;
    let softcap = n.float("softcap", 0.0)? as f64;
    let y = scaled_dot_product(ctx, [q4, kr, vr], Some(mask), false, scale, softcap)?;
    Ok(vec![
        Val::of(merge_heads(ctx, y)?),
        Val::of(present_k),
        Val::of(present_v),
    ])
}

/// The keys and values `[B, kvN, len, H]` with a row of zeros after them, and the mask
/// `[B, N, S, len]` (bool or additive) as an additive one with the sink's column after it:
/// the extra key scores `sink[h]` for every query of head h and adds nothing to the output,
/// so each softmax's denominator gains `exp(sink[h])` (ONNX Runtime's `head_sink`).
fn with_sink_key(
    ctx: &mut Ctx,
    cache: [ValueId; 2],
    mask: ValueId,
    sink: ValueId,
    full: &[Dim],
) -> Result<(ValueId, [ValueId; 2])> {
    let dtype = ctx.b.dtype(sink);
    let with_zero_row = |ctx: &mut Ctx, x: ValueId| -> Result<ValueId> {
        let mut row = ctx.b.shape(x);
        row[2] = Dim::Const(1);
        let zeros = ctx.b.full(Scalar::Float(0.0), dtype, row)?;
        ctx.b.op(Op::Concat { axis: 2 }, &[x, zeros])
    };
    let k = with_zero_row(ctx, cache[0])?;
    let v = with_zero_row(ctx, cache[1])?;
    let additive = match ctx.b.dtype(mask) {
        DType::Bool => {
            let zero = ctx.b.full(Scalar::Float(0.0), dtype, full.to_vec())?;
            let hidden = ctx
                .b
                .full(Scalar::Float(f64::NEG_INFINITY), dtype, full.to_vec())?;
            ctx.b.op(Op::Where, &[mask, zero, hidden])?
        }
        _ => mask,
    };
    let heads = full[1].clone();
    let sink = ctx.b.reshape(
        sink,
        vec![Dim::Const(1), heads, Dim::Const(1), Dim::Const(1)],
    )?;
    let mut column = full.to_vec();
    column[3] = Dim::Const(1);
    let sink = ctx.b.broadcast_to(sink, &column)?;
    let mask = ctx.b.op(Op::Concat { axis: 3 }, &[additive, sink])?;
    Ok((mask, [k, v]))
}

/// GroupQueryAttention's `position_ids` as ONNX Runtime reads them: `[B, S]` per query,
/// except on the first prompt (`S` equal to the total length), where every sequence counts
/// from the first element: `ids[0] + s`.
fn given_positions(
    ctx: &mut Ctx,
    n: &Node,
    ids: ValueId,
    [batch, s, total]: [&Dim; 3],
) -> Result<ValueId> {
    if !ctx.b.dtype(ids).is_int() || ctx.b.rank(ids) != 2 {
        return Err(n.err("position_ids must be a [B, S] integer tensor"));
    }
    let ids = ctx.b.cast(ids, DType::I64)?;
    let ids = ctx.b.broadcast_to(ids, &[batch.clone(), s.clone()])?;
    let first = ctx.b.slice(ids, 0, Dim::Const(0), Dim::Const(1), 1)?;
    let first = ctx.b.slice(first, 1, Dim::Const(0), Dim::Const(1), 1)?;
    let (_, steps) = grid(ctx, &Dim::Const(1), s)?;
    let counted = cmp(ctx, BinaryOp::Add, steps, first)?;
    let counted = ctx.b.broadcast_to(counted, &[batch.clone(), s.clone()])?;
    if s == total {
        return Ok(counted);
    }
    if let (Some(a), Some(b)) = (s.as_const(), total.as_const()) {
        if a != b {
            return Ok(ids);
        }
    }
    // Decided per call when the lengths are symbolic.
    let s_val = ctx.b.dim_value(s, DType::I64)?;
    let total_val = ctx.b.dim_value(total, DType::I64)?;
    let prompt = cmp(ctx, BinaryOp::Eq, s_val, total_val)?;
    let v = ctx.b.broadcast_all(&[prompt, counted, ids])?;
    ctx.b.op(Op::Where, &v)
}

/// Which keys each query sees, `[B, N, S, len]`: query `s` of sequence `b` those in
/// `[max(eff − W, 0), eff)`, `eff = min(past_b + s + 1, tot_b)` (`tot_b` when not causal).
fn visible_keys(
    ctx: &mut Ctx,
    [past_b, tot]: [ValueId; 2],
    s: &Dim,
    len: &Dim,
    causal: bool,
    window: i64,
    full: &[Dim],
) -> Result<ValueId> {
    let batch = full[0].clone();
    let (rows, cols) = grid(ctx, s, len)?;
    let rows = ctx
        .b
        .reshape(rows, vec![Dim::Const(1), s.clone(), Dim::Const(1)])?;
    let cols = ctx
        .b
        .reshape(cols, vec![Dim::Const(1), Dim::Const(1), len.clone()])?;
    let tot3 = ctx
        .b
        .reshape(tot, vec![batch.clone(), Dim::Const(1), Dim::Const(1)])?;
    let eff = match causal {
        false => tot3,
        true => {
            let past3 = ctx
                .b
                .reshape(past_b, vec![batch.clone(), Dim::Const(1), Dim::Const(1)])?;
            let frontier = cmp(ctx, BinaryOp::Add, rows, past3)?;
            let one = ctx.b.full(Scalar::Int(1), DType::I64, vec![])?;
            let frontier = bin(ctx, BinaryOp::Add, frontier, one)?;
            cmp(ctx, BinaryOp::Min, frontier, tot3)?
        }
    };
    let mut keep = cmp(ctx, BinaryOp::Lt, cols, eff)?;
    if window >= 0 {
        let w = ctx.b.full(Scalar::Int(window), DType::I64, vec![])?;
        let first = bin(ctx, BinaryOp::Sub, eff, w)?;
        let inside = cmp(ctx, BinaryOp::Ge, cols, first)?;
        keep = cmp(ctx, BinaryOp::And, keep, inside)?;
    }
    let ks = ctx.b.shape(keep);
    let keep = ctx.b.reshape(
        keep,
        vec![ks[0].clone(), Dim::Const(1), ks[1].clone(), ks[2].clone()],
    )?;
    ctx.b.broadcast_to(keep, full)
}

/// A `GroupQueryAttention` present cache `[B, kvN, len, H]`: position `j` of sequence `b`
/// holds the cached `past[j]` for `j < past_b`, the new `new[j − past_b]` up to `past_b + S`,
/// zeros after. Without a past and with `len = S` that is `new` itself.
fn present_cache(
    ctx: &mut Ctx,
    past: Option<ValueId>,
    new: ValueId,
    past_b: ValueId,
    [s, len]: [&Dim; 2],
) -> Result<ValueId> {
    if past.is_none() && len == s {
        return Ok(new);
    }
    let ns = ctx.b.shape(new);
    let past = match past {
        Some(p) => p,
        None => {
            let mut empty = ns.clone();
            empty[2] = Dim::Const(0);
            ctx.b.full(Scalar::Float(0.0), ctx.b.dtype(new), empty)?
        }
    };
    let lengths = ctx.b.reshape(past_b, vec![ns[0].clone()])?;
    ctx.b.op(
        Op::CacheAppend {
            axis: 2,
            len: len.clone(),
        },
        &[past, new, lengths],
    )
}

/// `com.microsoft.RotaryEmbedding`: `input` `[B, S, hidden]` or `[B, N, S, H]` rotated by
/// `cos_cache`/`sin_cache` rows (`[positions, rot/2]`) at `position_ids` — `[B, S]`, or one
/// offset to which each step adds its index.
fn rotary_embedding(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = float_input(ctx, n, 0, None)?;
    let dtype = ctx.b.dtype(x);
    let ids = ctx.input(n, 1)?;
    let cos = float_input(ctx, n, 2, Some(dtype))?;
    let sin = float_input(ctx, n, 3, Some(dtype))?;
    if ctx.b.rank(cos) != 2 || ctx.b.shape(sin) != ctx.b.shape(cos) {
        return Err(n.err("cos_cache and sin_cache must both be [positions, rotary_dim/2]"));
    }
    if !ctx.b.dtype(ids).is_int() {
        return Err(n.err("position_ids must be an integer tensor"));
    }
    let half = const_dim(ctx, n, cos, 1, "rotary width")? as i64;
    let rot = match n.int("rotary_embedding_dim", 0)? {
        0 => 2 * half,
        r => r,
    };
    let xs = ctx.b.shape(x);
    let x4 = match xs.len() {
        4 => ctx.b.permute(x, vec![0, 2, 1, 3])?,
        3 => {
            let heads = match n.int("num_heads", 0)? {
                0 => {
                    let hidden = const_dim(ctx, n, x, 2, "hidden size")? as i64;
                    hidden / rot.max(1)
                }
                h => h,
            };
            let bhsd = split_heads(ctx, n, x, heads, "input")?;
            ctx.b.permute(bhsd, vec![0, 2, 1, 3])?
        }
        r => return Err(n.err(format!("input of rank {r} (3 or 4)"))),
    };
    let head = const_dim(ctx, n, x4, 3, "head size")? as i64;
    if rot <= 0 || rot % 2 != 0 || rot > head || rot != 2 * half {
        return Err(n.err(format!(
            "rotating {rot} features (caches of {half} angles) of heads of {head}"
        )));
    }
    let steps = ctx.b.shape(x4)[1].clone();
    let ids = ctx.b.cast(ids, DType::I64)?;
    let ids_shape = ctx.b.shape(ids);
    let pos = match ids_shape.len() {
        2 => ids,
        1 if ids_shape[0] == Dim::Const(1) => {
            let (_, s) = grid(ctx, &Dim::Const(1), &steps)?;
            cmp(ctx, BinaryOp::Add, s, ids)?
        }
        _ => return Err(n.err("position_ids must be [B, S] or a single offset")),
    };
    let cos = ctx.b.op(Op::IndexSelect { axis: 0 }, &[cos, pos])?;
    let sin = ctx.b.op(Op::IndexSelect { axis: 0 }, &[sin, pos])?;
    let y4 = rotate(ctx, n, x4, [cos, sin], rot, n.flag("interleaved", false)?)?;
    let y = match xs.len() {
        4 => ctx.b.permute(y4, vec![0, 2, 1, 3])?,
        _ => ctx.b.reshape(y4, xs)?,
    };
    Ok(vec![Val::of(y)])
}
