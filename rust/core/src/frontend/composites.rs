//! Composite ops recovered from the decompositions exporters write.
//!
//! ONNX exports before opset 23 spell scaled dot-product attention as
//! `MatMul → Mul/Div by a scalar → Add mask → Softmax → MatMul` (torch's exporter scales q
//! and kᵀ by √scale each), and models with "eager" attention traced by `torch.export` do
//! the same in aten ops. The backends' attention kernels (the CPU's blocked attention, the
//! CUDA backend's tiled and split kernels) run only on `Op::Attention`, so such graphs ran
//! as two products, a softmax and a materialized score tensor. [`recover`] rewrites every
//! such chain into one `Attention` node, the way ONNX Runtime's graph optimizers fuse
//! attention. The result differs only by rounding: the scale multiplies the scores once
//! instead of q and k separately.
//!
//! A chain is recovered only when each intermediate (the scaled operands, the scores, the
//! masked scores, the weights) has no other use, the scales are scalar constants, and the
//! shapes are those of attention (equal batch dims, matching head and key dims). A mask
//! that is a constant causal pattern (0 on and below the diagonal, -inf or the dtype's
//! lowest above: what exporters capture for `is_causal=True`) becomes `causal`, which lets
//! the kernels skip the masked half instead of adding -inf to it.

use std::collections::BTreeMap;

use crate::backend::Weights;
use crate::dtype::Scalar;
use crate::error::Result;
use crate::interp::Value;
use crate::ir::{BinaryOp, Graph, Op, ValueId};

/// `graph` with every decomposed attention chain replaced by `Op::Attention`, and the
/// nodes no output needs any more removed (inputs are kept). Unchanged when there is none.
/// `weights` (the values known at load time) let a constant causal mask be recognized.
pub fn recover(graph: &Graph, weights: &Weights) -> Result<Graph> {
    let uses = graph.use_counts();
    let found: Vec<(ValueId, Chain)> = (0..graph.nodes.len())
        .filter_map(|id| attention_chain(graph, &uses, id).map(|c| (id, c)))
        .map(|(id, mut c)| {
            if c.mask.is_some_and(|m| is_causal_mask(graph, weights, m)) {
                (c.mask, c.causal) = (None, true);
            }
            (id, c)
        })
        .collect();
    if found.is_empty() {
        return Ok(graph.clone());
    }
    let mut out = Graph {
        symbols: graph.symbols.clone(),
        ..Graph::default()
    };
    let chains: BTreeMap<ValueId, Chain> = found.into_iter().collect();
    let live = needed(graph, &chains);
    let mut map: Vec<Option<ValueId>> = vec![None; graph.nodes.len()];
    for (id, node) in graph.nodes.iter().enumerate() {
        if !live[id] {
            continue;
        }
        let new = |v: ValueId| map[v].expect("inputs come first and are live");
        let at = &*node.origin;
        map[id] = Some(match chains.get(&id) {
            Some(c) => {
                let r = graph.ty(c.kt).rank();
                let mut perm: Vec<usize> = (0..r).collect();
                perm.swap(r - 2, r - 1);
                let k = out.add(Op::Permute { perm }, &[new(c.kt)], at)?;
                let mut inputs = vec![new(c.q), k, new(c.v)];
                inputs.extend(c.mask.map(new));
                let op = Op::Attention {
                    scale: c.scale,
                    causal: c.causal,
                    has_mask: c.mask.is_some(),
                };
                out.add(op, &inputs, at)?
            }
            None if node.inputs.is_empty() => {
                out.add_source(node.op.clone(), node.ty.clone(), at)?
            }
            None => {
                let inputs: Vec<ValueId> = node.inputs.iter().map(|&i| new(i)).collect();
                out.add(node.op.clone(), &inputs, at)?
            }
        });
    }
    out.outputs = graph
        .outputs
        .iter()
        .map(|&o| map[o].expect("outputs are live"))
        .collect();
    Ok(out)
}

/// One attention chain: `softmax(q·kt·scale (+ mask)) · v`.
#[derive(Clone, Copy, Debug)]
struct Chain {
    q: ValueId,
    /// The keys transposed (`[B.., E, S]`), as the first product reads them.
    kt: ValueId,
    v: ValueId,
    mask: Option<ValueId>,
    causal: bool,
    scale: f64,
}

/// The chain whose last product is node `id`, if it is one.
fn attention_chain(g: &Graph, uses: &[usize], id: ValueId) -> Option<Chain> {
    let node = &g.nodes[id];
    if node.op != Op::Dot {
        return None;
    }
    let (weights, v) = (node.inputs[0], node.inputs[1]);
    let only = |x: ValueId| uses[x] == 1;
    let r = g.ty(weights).rank();
    let Op::Softmax { axis, log: false } = g.nodes[weights].op else {
        return None;
    };
    if axis + 1 != r || !only(weights) {
        return None;
    }
    let masked = g.nodes[weights].inputs[0];
    if !only(masked) {
        return None;
    }
    // Scores plus a mask (either side), or the scores alone.
    let (scores, mask) = match &g.nodes[masked].op {
        Op::Binary(BinaryOp::Add) => {
            let [a, b] = g.nodes[masked].inputs[..] else {
                return None;
            };
            if scaled_product(g, uses, a).is_some() {
                (a, Some(b))
            } else {
                (b, Some(a))
            }
        }
        _ => (masked, None),
    };
    let (q, kt, scale) = scaled_product(g, uses, scores)?;
    let (tq, tk, tv) = (g.ty(q), g.ty(kt), g.ty(v));
    let float = tq.dtype.is_float() && tk.dtype == tq.dtype && tv.dtype == tq.dtype;
    let ranks = tk.rank() == r && tv.rank() == r && tq.rank() == r && r >= 2;
    if !float || !ranks {
        return None;
    }
    let b = r - 2;
    let shapes = tq.shape[..b] == tk.shape[..b]
        && tk.shape[..b] == tv.shape[..b]
        && tq.shape[b + 1] == tk.shape[b]
        && tk.shape[b + 1] == tv.shape[b];
    let mask_ok = mask.is_none_or(|m| g.ty(m).dtype == tq.dtype);
    (shapes && mask_ok).then_some(Chain {
        q,
        kt,
        v,
        mask,
        causal: false,
        scale,
    })
}

/// `x` as `(q·c₁)(kt·c₂)`, optionally times or divided by `c₃` after the product (each
/// `cᵢ` a scalar constant, each scaled value used only here): `(q, kt, c₁·c₂·c₃)`.
fn scaled_product(g: &Graph, uses: &[usize], x: ValueId) -> Option<(ValueId, ValueId, f64)> {
    let (product, after) = match scaled(g, x) {
        Some((y, c)) if uses[y] == 1 => (y, c),
        _ => (x, 1.0),
    };
    let node = &g.nodes[product];
    if node.op != Op::Dot || uses[product] != 1 {
        return None;
    }
    let operand = |v: ValueId| match scaled(g, v) {
        Some((y, c)) if uses[v] == 1 => (y, c),
        _ => (v, 1.0),
    };
    let (q, cq) = operand(node.inputs[0]);
    let (kt, ck) = operand(node.inputs[1]);
    let scale = cq * ck * after;
    (scale.is_finite() && scale != 0.0).then_some((q, kt, scale))
}

/// `x` as `y · c` or `y / c` for a scalar constant `c` (either operand of a product):
/// `(y, c)` or `(y, 1 / c)`.
fn scaled(g: &Graph, x: ValueId) -> Option<(ValueId, f64)> {
    let node = &g.nodes[x];
    let [a, b] = node.inputs[..] else {
        return None;
    };
    match node.op {
        Op::Binary(BinaryOp::Mul) => match (scalar(g, a), scalar(g, b)) {
            (_, Some(c)) => Some((a, c)),
            (Some(c), None) => Some((b, c)),
            _ => None,
        },
        Op::Binary(BinaryOp::Div) => scalar(g, b).map(|c| (a, 1.0 / c)),
        _ => None,
    }
}

/// The value of `x` when it is one number broadcast: a one-element constant or a fill,
/// through reshapes and expands.
fn scalar(g: &Graph, x: ValueId) -> Option<f64> {
    let node = &g.nodes[x];
    match &node.op {
        Op::Reshape { .. } | Op::Expand { .. } => scalar(g, node.inputs[0]),
        Op::Full { value } => match value {
            Scalar::Float(f) => Some(*f),
            Scalar::Int(i) => Some(*i as f64),
            Scalar::Bool(_) => None,
        },
        Op::Constant(c) if c.shape.iter().product::<usize>() == 1 && node.ty.dtype.is_float() => {
            let v = Value::from_bytes(node.ty.dtype, c.shape.clone(), &c.bytes).ok()?;
            v.to_f64_vec().first().copied()
        }
        _ => None,
    }
}

/// Which nodes the rewritten graph keeps: inputs, and whatever an output needs once each
/// chain's last product reads its q, kt, v and mask directly.
fn needed(g: &Graph, chains: &BTreeMap<ValueId, Chain>) -> Vec<bool> {
    let mut live = vec![false; g.nodes.len()];
    let mut stack: Vec<ValueId> = g.outputs.clone();
    stack.extend(g.inputs.iter().copied());
    while let Some(v) = stack.pop() {
        if std::mem::replace(&mut live[v], true) {
            continue;
        }
        match chains.get(&v) {
            Some(c) => stack.extend([c.q, c.kt, c.v].into_iter().chain(c.mask)),
            None => stack.extend(g.nodes[v].inputs.iter().copied()),
        }
    }
    live
}

/// Whether the additive mask `m` (`[B.., L, S]`) is the same causal pattern for every batch:
/// broadcasts (expands keeping the last two dims) of reshapes of a constant or loaded weight
/// of L·S values, 0 where key j ≤ query i and -inf (or below -1e30, the dtype's lowest as
/// some exporters write it) where j > i.
fn is_causal_mask(g: &Graph, weights: &Weights, m: ValueId) -> bool {
    let shape = &g.ty(m).shape;
    let r = shape.len();
    let (Some(l), Some(s)) = (shape[r - 2].as_const(), shape[r - 1].as_const()) else {
        return false;
    };
    let (l, s) = (l as usize, s as usize);
    let mut x = m;
    while let Op::Expand { .. } = g.nodes[x].op {
        let from = g.nodes[x].inputs[0];
        let fs = &g.ty(from).shape;
        if fs.len() < 2 || fs[fs.len() - 2..] != shape[r - 2..] {
            return false;
        }
        x = from;
    }
    while let Op::Reshape { .. } = g.nodes[x].op {
        x = g.nodes[x].inputs[0];
    }
    let node = &g.nodes[x];
    let (dtype, bytes, numel): (_, &[u8], usize) = match &node.op {
        Op::Constant(c) => (node.ty.dtype, &c.bytes, c.shape.iter().product()),
        Op::Weight { name } => match weights.get(name) {
            Some(t) => (t.dtype, t.bytes(), t.numel()),
            None => return false,
        },
        _ => return false,
    };
    if !dtype.is_float() || numel != l * s {
        return false;
    }
    let Ok(values) = Value::from_bytes(dtype, vec![numel], bytes) else {
        return false;
    };
    let values = values.to_f64_vec();
    (0..l).all(|i| {
        (0..s).all(|j| {
            let v = values[i * s + j];
            if j <= i {
                v == 0.0
            } else {
                v <= -1e30
            }
        })
    })
}
