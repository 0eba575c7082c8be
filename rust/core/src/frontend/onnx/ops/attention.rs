//! The transformer ops of opsets 23–24: `Attention` (self and cross attention, grouped or
//! multi-query heads, 3-D or 4-D operands, a KV cache concatenated inside or kept outside with
//! per-sequence lengths, bottom-right causal masks, soft-capped scores), `RotaryEmbedding` and
//! `TensorScatter` (writing new keys into a fixed-size cache). They become IR ops the backends
//! already fuse: the IR's `attention` (or, with a soft cap, its decomposition), elementwise
//! rotations of sliced halves, and a scatter.

use super::{bin, one, scalar, Handler};
use crate::dim::Dim;
use crate::dtype::{DType, Scalar};
use crate::error::Result;
use crate::frontend::onnx::node::Node;
use crate::frontend::onnx::translate::{Ctx, Val};
use crate::ir::{BinaryOp, Op, ReduceOp, UnaryOp, ValueId};

pub fn handler(op: &str) -> Option<Handler> {
    Some(match op {
        "Attention" => attention,
        "RotaryEmbedding" => rotary_embedding,
        "TensorScatter" => tensor_scatter,
        _ => return None,
    })
}

pub(super) fn float_input(
    ctx: &mut Ctx,
    n: &Node,
    k: usize,
    dtype: Option<DType>,
) -> Result<ValueId> {
    let x = ctx.input(n, k)?;
    let got = ctx.b.dtype(x);
    match dtype {
        Some(want) if got != want => Err(n.err(format!("input {k} is {got} but Q is {want}"))),
        _ if !got.is_float() => Err(n.err(format!("input {k} must be float, got {got}"))),
        _ => Ok(x),
    }
}

/// A constant dim of `v`, or an error naming what needs it.
pub(super) fn const_dim(ctx: &Ctx, n: &Node, v: ValueId, axis: usize, what: &str) -> Result<usize> {
    let d = ctx.b.shape(v)[axis].clone();
    d.as_const()
        .and_then(|c| usize::try_from(c).ok())
        .ok_or_else(|| n.unsupported(format!("a symbolic {what} ({d})")))
}

/// `[B, S, heads·D]` → `[B, heads, S, D]`.
pub(super) fn split_heads(
    ctx: &mut Ctx,
    n: &Node,
    x: ValueId,
    heads: i64,
    what: &str,
) -> Result<ValueId> {
    let s = ctx.b.shape(x);
    let hidden = const_dim(ctx, n, x, 2, &format!("{what} hidden size"))? as i64;
    if heads <= 0 || hidden % heads != 0 {
        return Err(n.err(format!(
            "{what} hidden size {hidden} does not split into {heads} heads"
        )));
    }
    let split = vec![
        s[0].clone(),
        s[1].clone(),
        Dim::Const(heads),
        Dim::Const(hidden / heads),
    ];
    let x = ctx.b.reshape(x, split)?;
    ctx.b.permute(x, vec![0, 2, 1, 3])
}

/// `[0, len)` as int64.
pub(super) fn positions(ctx: &mut Ctx, len: Dim) -> Result<ValueId> {
    super::creation::iota(ctx, Scalar::Int(0), Scalar::Int(1), DType::I64, len)
}

/// The bottom-right causal frontier `[L, T]`: query `i` sees key `j` iff `j ≤ i + offset`.
fn causal_keep(ctx: &mut Ctx, l: &Dim, t: &Dim, offset: &Dim) -> Result<ValueId> {
    let rows = positions(ctx, l.clone())?;
    let rows = ctx.b.reshape(rows, vec![l.clone(), Dim::Const(1)])?;
    let off = ctx.b.dim_value(offset, DType::I64)?;
    let last = bin(ctx, BinaryOp::Add, rows, off)?;
    let cols = positions(ctx, t.clone())?;
    let cols = ctx.b.reshape(cols, vec![Dim::Const(1), t.clone()])?;
    let v = ctx.b.broadcast_all(&[cols, last])?;
    ctx.b.op(Op::Binary(BinaryOp::Le), &v)
}

/// The user's `attn_mask` as `[B, Hq, L, T]`: bool (keep where true) or float in Q's type
/// (added to the scores); a last dim shorter than T is padded with "masked".
fn user_mask(ctx: &mut Ctx, n: &Node, shape: &[Dim], dtype: DType) -> Result<Option<ValueId>> {
    let Some(mut m) = ctx.opt_input(n, 3)? else {
        return Ok(None);
    };
    let mdt = ctx.b.dtype(m);
    if mdt != DType::Bool && !mdt.is_float() {
        return Err(n.unsupported(format!("an attn_mask of {mdt} (bool or float masks are)")));
    }
    if mdt.is_float() && mdt != dtype {
        m = ctx.b.cast(m, dtype)?;
    }
    let ms = ctx.b.shape(m);
    if ms.is_empty() || ms.len() > 4 {
        return Err(n.err(format!("attn_mask of rank {} (1 to 4)", ms.len())));
    }
    let total = &shape[3];
    let last = ms[ms.len() - 1].clone();
    if &last != total && last != Dim::Const(1) {
        let short = match (last.as_const(), total.as_const()) {
            (Some(a), Some(b)) if a < b => b - a,
            _ => {
                return Err(n.err(format!(
                    "attn_mask's last dim {last} does not cover the {total} keys"
                )))
            }
        };
        let mut pads = vec![(0, 0); ms.len()];
        pads[ms.len() - 1] = (0, short);
        let value = match ctx.b.dtype(m) {
            DType::Bool => Scalar::Bool(false),
            _ => Scalar::Float(f64::NEG_INFINITY),
        };
        m = ctx.b.op(Op::Pad { pads, value }, &[m])?;
    }
    Ok(Some(ctx.b.broadcast_to(m, shape)?))
}

/// ONNX `Attention` (opsets 23–24).
fn attention(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    if n.wants_output(3) {
        return Err(n.unsupported("the qk_matmul_output debugging output"));
    }
    let q = float_input(ctx, n, 0, None)?;
    let dtype = ctx.b.dtype(q);
    let k = float_input(ctx, n, 1, Some(dtype))?;
    let v = float_input(ctx, n, 2, Some(dtype))?;
    let rank = ctx.b.rank(q);
    if !matches!(rank, 3 | 4) || ctx.b.rank(k) != rank || ctx.b.rank(v) != rank {
        return Err(n.err(format!(
            "Q, K and V must all be 3-D or all 4-D, got ranks {rank}, {}, {}",
            ctx.b.rank(k),
            ctx.b.rank(v)
        )));
    }
    // Everything below works on [B, heads, S, D].
    let (mut q4, mut k4, mut v4) = (q, k, v);
    if rank == 3 {
        let (qh, kvh) = (n.int("q_num_heads", 0)?, n.int("kv_num_heads", 0)?);
        if qh <= 0 || kvh <= 0 {
            return Err(n.err("3-D Q, K, V need the q_num_heads and kv_num_heads attributes"));
        }
        q4 = split_heads(ctx, n, q, qh, "Q")?;
        k4 = split_heads(ctx, n, k, kvh, "K")?;
        v4 = split_heads(ctx, n, v, kvh, "V")?;
    }
    // A KV cache updated inside: present = concat(past, new) along the sequence.
    let past = match (ctx.opt_input(n, 4)?, ctx.opt_input(n, 5)?) {
        (Some(pk), Some(pv)) => Some((pk, pv)),
        (None, None) => None,
        _ => return Err(n.err("past_key and past_value must be given together")),
    };
    let mut offset = Dim::Const(0);
    let new_keys = ctx.b.shape(k4)[2].clone();
    if let Some((pk, pv)) = past {
        for (p, what) in [(pk, "past_key"), (pv, "past_value")] {
            if ctx.b.rank(p) != 4 || ctx.b.dtype(p) != dtype {
                return Err(n.err(format!("{what} must be a 4-D {dtype} tensor")));
            }
        }
        offset = ctx.b.shape(pk)[2].clone();
        k4 = ctx.b.op(Op::Concat { axis: 2 }, &[pk, k4])?;
        v4 = ctx.b.op(Op::Concat { axis: 2 }, &[pv, v4])?;
    }
    let (present_k, present_v) = (k4, v4);

    let qs = ctx.b.shape(q4);
    let head = const_dim(ctx, n, q4, 3, "head size")?;
    let q_heads = const_dim(ctx, n, q4, 1, "number of query heads")?;
    let scale = match n.has_attr("scale") {
        true => n.float("scale", 1.0)? as f64,
        false => 1.0 / (head as f64).sqrt(),
    };
    let q_heads = Dim::Const(q_heads as i64);
    let kr = ctx.b.repeat_heads(k4, &q_heads)?;
    let vr = ctx.b.repeat_heads(v4, &q_heads)?;
    let total = ctx.b.shape(kr)[2].clone();
    let scores_shape = vec![qs[0].clone(), qs[1].clone(), qs[2].clone(), total.clone()];

    let mut mask = user_mask(ctx, n, &scores_shape, dtype)?;
    let causal = n.flag("is_causal", false)?;
    // An external cache (opset 24): keys past each sequence's length are padding, and the
    // causal frontier sits that length minus the queries from the top.
    if let Some(lens) = ctx.opt_input(n, 6)? {
        if past.is_some() {
            return Err(n.err("nonpad_kv_seqlen cannot be used with past_key/past_value"));
        }
        let keep = nonpad_keep(ctx, n, lens, &scores_shape, causal)?;
        mask = Some(combine(ctx, mask, keep, &scores_shape, dtype)?);
        return finish(
            ctx, n, rank, q4, kr, vr, mask, false, scale, present_k, present_v,
        );
    }
    // With no cache the frontier is the IR's top-left `causal`; behind a cache it shifts right
    // by the cache's length and becomes part of the mask (it hides nothing when one key is
    // new: every query sees the whole cache and that key).
    let ir_causal = causal && offset == Dim::Const(0);
    if causal && !ir_causal && new_keys != Dim::Const(1) {
        let keep = causal_keep(ctx, &qs[2], &total, &offset)?;
        mask = Some(combine(ctx, mask, keep, &scores_shape, dtype)?);
    }
    finish(
        ctx, n, rank, q4, kr, vr, mask, ir_causal, scale, present_k, present_v,
    )
}

/// `mask` (the user's, bool or float, or none) restricted to the keys `keep` allows.
fn combine(
    ctx: &mut Ctx,
    mask: Option<ValueId>,
    keep: ValueId,
    shape: &[Dim],
    dtype: DType,
) -> Result<ValueId> {
    let keep = ctx.b.broadcast_to(keep, shape)?;
    Ok(match mask {
        None => keep,
        Some(m) if ctx.b.dtype(m) == DType::Bool => bin(ctx, BinaryOp::And, m, keep)?,
        Some(m) => {
            let hidden = ctx
                .b
                .full(Scalar::Float(f64::NEG_INFINITY), dtype, shape.to_vec())?;
            ctx.b.op(Op::Where, &[keep, m, hidden])?
        }
    })
}

/// The keys each query may see behind an external cache of `lens[b]` valid keys:
/// `j < lens[b]`, and with `causal` also `j ≤ i + lens[b] - L`, as `[B, 1, L or 1, T]`.
fn nonpad_keep(
    ctx: &mut Ctx,
    n: &Node,
    lens: ValueId,
    shape: &[Dim],
    causal: bool,
) -> Result<ValueId> {
    if ctx.b.rank(lens) != 1 || !ctx.b.dtype(lens).is_int() {
        return Err(n.err("nonpad_kv_seqlen must be a 1-d integer tensor"));
    }
    let (b, l, t) = (shape[0].clone(), shape[2].clone(), shape[3].clone());
    let lens = ctx.b.cast(lens, DType::I64)?;
    let cols = positions(ctx, t.clone())?;
    let cols = ctx
        .b
        .reshape(cols, vec![Dim::Const(1), Dim::Const(1), t.clone()])?;
    let per_seq = ctx
        .b
        .reshape(lens, vec![b.clone(), Dim::Const(1), Dim::Const(1)])?;
    let v = ctx.b.broadcast_all(&[cols, per_seq])?;
    let mut keep = ctx.b.op(Op::Binary(BinaryOp::Lt), &v)?;
    if causal {
        let rows = positions(ctx, l.clone())?;
        let rows = ctx
            .b
            .reshape(rows, vec![Dim::Const(1), l.clone(), Dim::Const(1)])?;
        let queries = ctx.b.dim_value(&l, DType::I64)?;
        let offset = bin(ctx, BinaryOp::Sub, per_seq, queries)?;
        let last = bin(ctx, BinaryOp::Add, rows, offset)?;
        let v = ctx.b.broadcast_all(&[cols, last])?;
        let frontier = ctx.b.op(Op::Binary(BinaryOp::Le), &v)?;
        let v = ctx.b.broadcast_all(&[keep, frontier])?;
        keep = ctx.b.op(Op::Binary(BinaryOp::And), &v)?;
    }
    let ks = ctx.b.shape(keep);
    ctx.b.reshape(
        keep,
        vec![ks[0].clone(), Dim::Const(1), ks[1].clone(), ks[2].clone()],
    )
}

/// The attention itself (fused, or decomposed for a soft cap) and the outputs in the
/// operands' layout.
#[allow(clippy::too_many_arguments)]
fn finish(
    ctx: &mut Ctx,
    n: &Node,
    rank: usize,
    q4: ValueId,
    kr: ValueId,
    vr: ValueId,
    mask: Option<ValueId>,
    ir_causal: bool,
    scale: f64,
    present_k: ValueId,
    present_v: ValueId,
) -> Result<Vec<Val>> {
    let softcap = n.float("softcap", 0.0)? as f64;
    let y = scaled_dot_product(ctx, [q4, kr, vr], mask, ir_causal, scale, softcap)?;
    let y = match rank {
        4 => y,
        _ => merge_heads(ctx, y)?,
    };
    Ok(vec![Val::of(y), Val::of(present_k), Val::of(present_v)])
}

/// The IR's fused attention over `[B, heads, S, D]` operands, or its decomposition when
/// the scores are soft-capped (`softcap > 0`), which the fused op does not have.
pub(super) fn scaled_dot_product(
    ctx: &mut Ctx,
    [q, k, v]: [ValueId; 3],
    mask: Option<ValueId>,
    causal: bool,
    scale: f64,
    softcap: f64,
) -> Result<ValueId> {
    if softcap > 0.0 {
        return soft_capped(ctx, q, k, v, mask, causal, scale, softcap);
    }
    let mut inputs = vec![q, k, v];
    inputs.extend(mask);
    ctx.b.op(
        Op::Attention {
            scale,
            causal,
            has_mask: mask.is_some(),
        },
        &inputs,
    )
}

/// `[B, heads, S, D]` → `[B, S, heads·D]`.
pub(super) fn merge_heads(ctx: &mut Ctx, y: ValueId) -> Result<ValueId> {
    let ys = ctx.b.shape(y);
    let t = ctx.b.permute(y, vec![0, 2, 1, 3])?;
    let width = Dim::binary(crate::dim::DimOp::Mul, ys[1].clone(), ys[3].clone());
    ctx.b.reshape(t, vec![ys[0].clone(), ys[2].clone(), width])
}

/// Attention with `softcap · tanh(scores / softcap)` before the mask, which the IR's fused
/// op does not have: the products, the cap, the mask, a softmax and zeros for rows whose
/// every key is masked (as the fused op gives them).
#[allow(clippy::too_many_arguments)]
fn soft_capped(
    ctx: &mut Ctx,
    q: ValueId,
    k: ValueId,
    v: ValueId,
    mask: Option<ValueId>,
    causal: bool,
    scale: f64,
    softcap: f64,
) -> Result<ValueId> {
    let dtype = ctx.b.dtype(q);
    let kt = ctx.b.permute(k, vec![0, 1, 3, 2])?;
    let s = ctx.b.matmul(q, kt)?;
    let shape = ctx.b.shape(s);
    let c = scalar(ctx, scale / softcap, dtype)?;
    let s = bin(ctx, BinaryOp::Mul, s, c)?;
    let s = ctx.b.unary(UnaryOp::Tanh, s)?;
    let c = scalar(ctx, softcap, dtype)?;
    let mut s = bin(ctx, BinaryOp::Mul, s, c)?;
    let mut keep = None;
    if causal {
        let k = causal_keep(ctx, &shape[2], &shape[3], &Dim::Const(0))?;
        keep = Some(ctx.b.broadcast_to(k, &shape)?);
    }
    match mask {
        Some(m) if ctx.b.dtype(m) == DType::Bool => {
            keep = Some(match keep {
                Some(k) => bin(ctx, BinaryOp::And, k, m)?,
                None => m,
            });
        }
        Some(m) => s = bin(ctx, BinaryOp::Add, s, m)?,
        None => {}
    }
    if let Some(keep) = keep {
        let hidden = ctx
            .b
            .full(Scalar::Float(f64::NEG_INFINITY), dtype, shape.clone())?;
        s = ctx.b.op(Op::Where, &[keep, s, hidden])?;
    }
    let p = ctx.b.op(
        Op::Softmax {
            axis: 3,
            log: false,
        },
        &[s],
    )?;
    // A row of -inf scores gives NaN probabilities; the fused op gives zeros there.
    let top = ctx.b.op(
        Op::Reduce {
            op: ReduceOp::Max,
            axes: vec![3],
            keepdim: true,
        },
        &[s],
    )?;
    let lowest = scalar(ctx, f64::NEG_INFINITY, dtype)?;
    let seen = ctx.b.broadcast_all(&[top, lowest])?;
    let seen = ctx.b.op(Op::Binary(BinaryOp::Gt), &seen)?;
    let y = ctx.b.matmul(p, v)?;
    let zero = scalar(ctx, 0.0, dtype)?;
    let parts = ctx.b.broadcast_all(&[seen, y, zero])?;
    ctx.b.op(Op::Where, &parts)
}

/// ONNX `RotaryEmbedding` (opset 23): rotates pairs of each head's first
/// `rotary_embedding_dim` features — its two halves, or even and odd features when
/// `interleaved` — by the angles whose cosines and sines the caches hold, looked up by
/// `position_ids` when given.
fn rotary_embedding(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let x = float_input(ctx, n, 0, None)?;
    let dtype = ctx.b.dtype(x);
    let cos = float_input(ctx, n, 1, Some(dtype))?;
    let sin = float_input(ctx, n, 2, Some(dtype))?;
    let xs = ctx.b.shape(x);
    // [B, S, H, D] from [B, H, S, D] or [B, S, H·D].
    let x4 = match xs.len() {
        4 => ctx.b.permute(x, vec![0, 2, 1, 3])?,
        3 => {
            let heads = n.int("num_heads", 0)?;
            if heads <= 0 {
                return Err(n.err("a 3-D input needs the num_heads attribute"));
            }
            let bhsd = split_heads(ctx, n, x, heads, "input")?;
            ctx.b.permute(bhsd, vec![0, 2, 1, 3])?
        }
        r => return Err(n.err(format!("input of rank {r} (3 or 4)"))),
    };
    let head = const_dim(ctx, n, x4, 3, "head size")? as i64;
    let rot = match n.int("rotary_embedding_dim", 0)? {
        0 => head,
        r => r,
    };
    if rot <= 0 || rot % 2 != 0 || rot > head {
        return Err(n.err(format!(
            "rotary_embedding_dim {rot} must be even and at most the head size {head}"
        )));
    }
    // Angle tables as [B or 1, S, rot/2].
    let table = |ctx: &mut Ctx, cache: ValueId, what: &str| -> Result<ValueId> {
        match ctx.opt_input(n, 3)? {
            Some(ids) => {
                if ctx.b.rank(cache) != 2 || !ctx.b.dtype(ids).is_int() {
                    return Err(n.err(format!(
                        "with position_ids, {what} must be 2-D and position_ids integer"
                    )));
                }
                ctx.b.op(Op::IndexSelect { axis: 0 }, &[cache, ids])
            }
            None if ctx.b.rank(cache) == 3 => Ok(cache),
            None => Err(n.err(format!("without position_ids, {what} must be 3-D"))),
        }
    };
    let cos = table(ctx, cos, "cos_cache")?;
    let sin = table(ctx, sin, "sin_cache")?;
    let interleaved = n.flag("interleaved", false)?;
    let y4 = rotate(ctx, n, x4, [cos, sin], rot, interleaved)?;
    let y = match xs.len() {
        4 => ctx.b.permute(y4, vec![0, 2, 1, 3])?,
        _ => ctx.b.reshape(y4, xs)?,
    };
    one(y)
}

/// `x4` (`[B, S, heads, D]`) with each head's first `rot` features rotated — its two
/// halves, or even and odd features when `interleaved` — by the angles whose cosines and
/// sines `tables` hold as `[B or 1, S, rot/2]`; the features past `rot` pass through.
///
/// Written as one elementwise expression over the features viewed as pairs,
/// `x·cos + partner·(∓1)·sin`, where each feature's partner is read through a flip of the
/// pair axis: a backend fuses it into one pass, where halves rotated separately and
/// concatenated took five steps per tensor (and the same products and sums either way).
pub(super) fn rotate(
    ctx: &mut Ctx,
    n: &Node,
    x4: ValueId,
    tables: [ValueId; 2],
    rot: i64,
    interleaved: bool,
) -> Result<ValueId> {
    let s4 = ctx.b.shape(x4);
    let head = const_dim(ctx, n, x4, 3, "head size")? as i64;
    let half = rot / 2;
    let c = Dim::Const;
    // Features as [B, S, heads, 2, rot/2] (halves) or [B, S, heads, rot/2, 2] (pairs):
    // a feature's partner sits at the other end of the pair axis.
    let (pair_axis, pairs) = match interleaved {
        true => (4, [c(half), c(2)]),
        false => (3, [c(2), c(half)]),
    };
    let rotated_part = match rot < head {
        true => ctx.b.slice(x4, 3, c(0), c(rot), 1)?,
        false => x4,
    };
    let mut paired = s4[..3].to_vec();
    paired.extend(pairs.clone());
    let x5 = ctx.b.reshape(rotated_part, paired)?;
    // The first of a pair takes −partner·sin, the second +partner·sin.
    let signed = ctx.b.swap_pairs_negating_first(x5, pair_axis)?;
    // Angles as [B or 1, S, 1, ·, ·], one per pair, broadcast over the heads.
    let mut angles = [x4; 2];
    for (a, (table, what)) in angles
        .iter_mut()
        .zip(tables.into_iter().zip(["cos", "sin"]))
    {
        let ts = ctx.b.shape(table);
        if ts.len() != 3 || ts[2] != c(half) {
            return Err(n.err(format!(
                "the {what} cache gives {} angles per position; rotating {rot} features takes {half}",
                ts.last().cloned().unwrap_or(c(0))
            )));
        }
        let mut per_pair = vec![ts[0].clone(), ts[1].clone(), c(1)];
        per_pair.extend(match interleaved {
            true => [c(half), c(1)],
            false => [c(1), c(half)],
        });
        *a = ctx.b.reshape(table, per_pair)?;
    }
    let [cos, sin] = angles;
    let straight = bin(ctx, BinaryOp::Mul, x5, cos)?;
    let crossed = bin(ctx, BinaryOp::Mul, signed, sin)?;
    let y5 = bin(ctx, BinaryOp::Add, straight, crossed)?;
    let mut flat = s4.clone();
    flat[3] = c(rot);
    let rotated = ctx.b.reshape(y5, flat)?;
    match rot < head {
        true => {
            let rest = ctx.b.slice(x4, 3, c(rot), c(head), 1)?;
            ctx.b.op(Op::Concat { axis: 3 }, &[rotated, rest])
        }
        false => Ok(rotated),
    }
}

/// Opset 24's `TensorScatter`: `update` (`[B, …, S_new, …]`) written into `past_cache` along
/// `axis` from `write_indices[b]` on (0 when absent), wrapping around the cache in
/// `circular` mode. A scatter whose index is that position plus the update's own.
fn tensor_scatter(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let past = ctx.input(n, 0)?;
    let update = ctx.input(n, 1)?;
    let dtype = ctx.b.dtype(past);
    if ctx.b.dtype(update) != dtype {
        return Err(n.err(format!(
            "update is {} but past_cache is {dtype}",
            ctx.b.dtype(update)
        )));
    }
    let (ps, us) = (ctx.b.shape(past), ctx.b.shape(update));
    let r = ps.len();
    if r < 2 || us.len() != r {
        return Err(n.err("past_cache and update need one rank of at least 2"));
    }
    let a = super::axis(ctx, n.int("axis", -2)?, r)?;
    if a == 0 {
        return Err(n.err("axis 0 is the batch; the sequence axis must come after it"));
    }
    let circular = match n.string("mode", "linear")?.as_str() {
        "linear" => false,
        "circular" => true,
        other => return Err(n.err(format!("unknown mode '{other}'"))),
    };
    let mut along = vec![Dim::Const(1); r];
    along[a] = us[a].clone();
    let steps = positions(ctx, us[a].clone())?;
    let mut idx = ctx.b.reshape(steps, along)?;
    if let Some(starts) = ctx.opt_input(n, 2)? {
        if ctx.b.rank(starts) != 1 || !ctx.b.dtype(starts).is_int() {
            return Err(n.err("write_indices must be a 1-d integer tensor"));
        }
        let starts = ctx.b.cast(starts, DType::I64)?;
        let mut per_seq = vec![Dim::Const(1); r];
        per_seq[0] = ps[0].clone();
        let starts = ctx.b.reshape(starts, per_seq)?;
        let v = ctx.b.broadcast_all(&[idx, starts])?;
        idx = ctx.b.op(Op::Binary(BinaryOp::Add), &v)?;
    }
    if circular {
        let len = ctx.b.dim_value(&ps[a], DType::I64)?;
        idx = bin(ctx, BinaryOp::Rem, idx, len)?;
    }
    let idx = ctx.b.broadcast_to(idx, &us)?;
    one(ctx.b.op(
        Op::Scatter {
            axis: a,
            reduce: crate::ir::ScatterReduce::None,
        },
        &[past, idx, update],
    )?)
}
