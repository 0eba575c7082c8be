//! Composite ops recovered from the decompositions exporters write: attention, layer norm,
//! RMS norm and GELU.
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
//! torch's exporter (opsets 14–22) also guards the weights of a row that sees no key:
//! `where(isnan(softmax), 0, softmax)`; `Op::Attention` gives such a row zeros itself, so the
//! guard is part of the chain.
//!
//! A chain is recovered only when each intermediate (the scaled operands, the scores, the
//! masked scores, the weights) has no other use, the scales are scalar constants, and the
//! shapes are those of attention (equal batch dims, matching head and key dims). A mask
//! that is a constant causal pattern (0 on and below the diagonal, -inf or the dtype's
//! lowest above: what exporters capture for `is_causal=True`) becomes `causal`, which lets
//! the kernels skip the masked half instead of adding -inf to it.
//!
//! RMS norm (no ONNX op before opset 23; Llama-style models write it out) arrives as
//! `x · rsqrt(mean(x²) + eps) · w` in some spelling (`Pow` or `Mul` for the square,
//! `ReduceMean` or a sum over a count, `1/Sqrt`, a `Div` by the root); f32/f64 chains become
//! one `Op::RmsNorm`, a row-wise kernel instead of six passes over the activations.
//!
//! Layer norm before opset 17 (torch's exporter at opset 14, as many BERT-style files on
//! model hubs were written) is `ReduceMean → Sub → Pow → ReduceMean → Add eps → Sqrt →
//! Div → Mul weight → Add bias`: an RMS norm of the centered input, recovered as one
//! `Op::LayerNorm` the same way. GELU before opset 20 arrives as `Div √2 → Erf → Add 1 →
//! Mul x → Mul 0.5` (in some order): one `gelu`, which the CPU backend runs as a vector
//! kernel instead of a scalar erf per element; the tanh approximation written out (GPT-2's
//! `gelu_new`: `Pow 3 → Mul 0.044715 → Add x → Mul √(2/π) → Tanh → Add 1 → Mul x → Mul
//! 0.5`) becomes one `gelu_tanh` the same way.

use std::collections::BTreeMap;

use crate::backend::Weights;
use crate::dim::Dim;
use crate::dtype::{DType, Scalar};
use crate::error::Result;
use crate::interp::Value;
use crate::ir::{BinaryOp, Graph, Op, ReduceOp, UnaryOp, ValueId};

/// `graph` with every decomposed attention chain replaced by `Op::Attention` and every RMS
/// norm by `Op::RmsNorm`, and the nodes no output needs removed (inputs are kept).
/// Unchanged when there is nothing to replace or remove. `fixed` holds the weights whose
/// values can never change after loading (an ONNX file's initializers), which lets a causal
/// mask stored as a weight be recognized; weights a caller can rebind later (PT2 parameters
/// and buffers, updated in place) must not be passed, or a changed mask would be ignored.
pub fn recover(graph: &Graph, fixed: &Weights) -> Result<Graph> {
    let uses = graph.use_counts();
    let found: BTreeMap<ValueId, Composite> = (0..graph.nodes.len())
        .filter_map(|id| {
            // A layer norm holds an RMS norm (of the centered x): it is tried first.
            let found = match attention_chain(graph, &uses, id) {
                Some(mut c) => {
                    if c.mask.is_some_and(|m| is_causal_mask(graph, fixed, m)) {
                        (c.mask, c.causal) = (None, true);
                    }
                    Composite::Attention(c)
                }
                None => match (
                    layer_norm_chain(graph, &uses, id),
                    gelu_chain(graph, &uses, id),
                ) {
                    (Some(n), _) => Composite::LayerNorm(n),
                    (None, Some((x, op))) => Composite::Gelu(x, op),
                    (None, None) => Composite::RmsNorm(rms_norm_chain(graph, &uses, id)?),
                },
            };
            Some((id, found))
        })
        .collect();
    // Frontends also leave nodes no output reads where a pattern replaced what they had
    // built (`Builder::concat`); a backend would still run them.
    let live = needed(graph, &found);
    if found.is_empty() && live.iter().all(|&l| l) {
        return Ok(graph.clone());
    }
    let mut out = Graph {
        symbols: graph.symbols.clone(),
        ..Graph::default()
    };
    let mut map: Vec<Option<ValueId>> = vec![None; graph.nodes.len()];
    for (id, node) in graph.nodes.iter().enumerate() {
        if !live[id] {
            continue;
        }
        let new = |v: ValueId| map[v].expect("inputs come first and are live");
        let at = &*node.origin;
        map[id] = Some(match found.get(&id) {
            Some(Composite::Attention(c)) => {
                let kt = graph.ty(c.kt);
                let r = kt.rank();
                let mut k_shape = kt.shape.clone();
                k_shape.swap(r - 2, r - 1);
                let k = match c.keys {
                    Some(keys) if graph.ty(keys).shape == k_shape => new(keys),
                    Some(keys) => out.add(Op::Reshape { shape: k_shape }, &[new(keys)], at)?,
                    None => {
                        let mut perm: Vec<usize> = (0..r).collect();
                        perm.swap(r - 2, r - 1);
                        out.add(Op::Permute { perm }, &[new(c.kt)], at)?
                    }
                };
                let mut inputs = vec![new(c.q), k, new(c.v)];
                inputs.extend(c.mask.map(new));
                let op = Op::Attention {
                    scale: c.scale,
                    causal: c.causal,
                    has_mask: c.mask.is_some(),
                };
                out.add(op, &inputs, at)?
            }
            Some(Composite::LayerNorm(n)) => {
                let op = Op::LayerNorm {
                    axis: n.axis,
                    eps: n.eps,
                    has_weight: n.weight.is_some(),
                    has_bias: n.bias.is_some(),
                };
                let inputs: Vec<ValueId> = [n.x]
                    .into_iter()
                    .chain(n.weight)
                    .chain(n.bias)
                    .map(new)
                    .collect();
                out.add(op, &inputs, at)?
            }
            Some(Composite::Gelu(x, op)) => out.add(Op::Unary(*op), &[new(*x)], at)?,
            Some(Composite::RmsNorm(n)) => {
                let op = Op::RmsNorm {
                    axis: n.axis,
                    eps: n.eps,
                    has_weight: n.weight.is_some(),
                };
                let inputs: Vec<ValueId> = [n.x].into_iter().chain(n.weight).map(new).collect();
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

/// A composite op found in place of the node that ends its decomposition.
enum Composite {
    Attention(Chain),
    LayerNorm(LayerNorm),
    /// The GELU of this value: `UnaryOp::Gelu` (erf) or `GeluTanh`.
    Gelu(ValueId, UnaryOp),
    RmsNorm(Norm),
}

impl Composite {
    /// The values the composite op reads.
    fn reads(&self) -> Vec<ValueId> {
        match self {
            Composite::Attention(c) => {
                let k = c.keys.unwrap_or(c.kt);
                [c.q, k, c.v].into_iter().chain(c.mask).collect()
            }
            Composite::LayerNorm(n) => [n.x].into_iter().chain(n.weight).chain(n.bias).collect(),
            Composite::Gelu(x, _) => vec![*x],
            Composite::RmsNorm(n) => [n.x].into_iter().chain(n.weight).collect(),
        }
    }
}

/// One attention chain: `softmax(q·kt·scale (+ mask)) · v`.
#[derive(Clone, Copy, Debug)]
struct Chain {
    q: ValueId,
    /// The keys transposed (`[B.., E, S]`), as the first product reads them.
    kt: ValueId,
    /// What `kt` transposes, when it is a transpose ([`untransposed`]): the attention reads
    /// it (regrouped to `kt`'s batch dims) instead of transposing `kt` back.
    keys: Option<ValueId>,
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
    // torch's exporter guards the softmax of a fully masked row (NaN) with
    // `where(isnan(w), 0, w)`; `Op::Attention` gives such a row zeros itself.
    let (weights, readers) = match nan_guarded(g, uses, weights) {
        Some(w) => (w, 2),
        None => (weights, 1),
    };
    let Op::Softmax { axis, log: false } = g.nodes[weights].op else {
        return None;
    };
    if axis + 1 != r || uses[weights] != readers {
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
            if scaled_product(g, uses, key_expand_peeled(g, uses, a)).is_some() {
                (a, Some(b))
            } else {
                (b, Some(a))
            }
        }
        _ => (masked, None),
    };
    let scores = key_expand_peeled(g, uses, scores);
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
        keys: untransposed(g, kt),
        v,
        mask,
        causal: false,
        scale,
    })
}

/// `x`'s input when `x` is an `expand` of the scores' key axis alone from one symbolic size
/// to another (BERT exports meet `min(s, 512)` positions with an `s`-wide mask): the
/// product after the softmax reads the keys at the unexpanded size, so wherever the original
/// graph runs the two sizes are equal and the expand copies nothing; where they differ
/// the recovered attention's shape check refuses the call, as the original's product does.
fn key_expand_peeled(g: &Graph, uses: &[usize], x: ValueId) -> ValueId {
    let node = &g.nodes[x];
    let Op::Expand { shape } = &node.op else {
        return x;
    };
    let inner = node.inputs[0];
    let from = &g.ty(inner).shape;
    let r = from.len();
    let only_keys = r >= 2
        && shape.len() == r
        && from[..r - 1] == shape[..r - 1]
        && from[r - 1] != Dim::Const(1);
    match only_keys && uses[x] == 1 {
        true => inner,
        false => x,
    }
}

/// The softmax `w` that `x = where(isnan(w), 0, w)` guards (each guard node used only
/// there).
fn nan_guarded(g: &Graph, uses: &[usize], x: ValueId) -> Option<ValueId> {
    let node = &g.nodes[x];
    let (Op::Where, &[test, zero, w]) = (&node.op, &node.inputs[..]) else {
        return None;
    };
    let guard = &g.nodes[test];
    let is_nan_of_w = guard.op == Op::Unary(UnaryOp::IsNan) && guard.inputs[0] == w;
    (is_nan_of_w && uses[x] == 1 && uses[test] == 1 && scalar(g, zero) == Some(0.0)).then_some(w)
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
/// composite reads its operands directly.
fn needed(g: &Graph, found: &BTreeMap<ValueId, Composite>) -> Vec<bool> {
    let mut live = vec![false; g.nodes.len()];
    let mut stack: Vec<ValueId> = g.outputs.clone();
    stack.extend(g.inputs.iter().copied());
    while let Some(v) = stack.pop() {
        if std::mem::replace(&mut live[v], true) {
            continue;
        }
        match found.get(&v) {
            Some(c) => stack.extend(c.reads()),
            None => stack.extend(g.nodes[v].inputs.iter().copied()),
        }
    }
    live
}

/// Whether the additive mask `m` (`[B.., L, S]`) is the same causal pattern for every batch:
/// broadcasts (expands keeping the last two dims) of reshapes of a constant or a fixed
/// weight of L·S values, 0 where key j ≤ query i and -inf (or below -1e30, the dtype's lowest as
/// some exporters write it) where j > i.
fn is_causal_mask(g: &Graph, fixed: &Weights, m: ValueId) -> bool {
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
        Op::Weight { name } => match fixed.get(name) {
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

/// An RMS norm: `x / sqrt(mean(x²) + eps) (· weight)` over dims `axis..`.
#[derive(Clone, Copy, Debug)]
struct Norm {
    x: ValueId,
    weight: Option<ValueId>,
    axis: usize,
    eps: f64,
}

/// The RMS norm ending at node `id`: the normalized `x` times a weight over the normalized
/// dims (either operand), or the normalization itself. f32/f64 only: decomposed f16/bf16
/// norms round every intermediate, which the fused op does not.
fn rms_norm_chain(g: &Graph, uses: &[usize], id: ValueId) -> Option<Norm> {
    let node = &g.nodes[id];
    if !matches!(node.ty.dtype, DType::F32 | DType::F64) {
        return None;
    }
    let inner = |n| normalized(g, uses, n);
    match with_param(g, uses, id, BinaryOp::Mul, inner, |n: &Norm| (n.x, n.axis)) {
        Some((norm, w)) => Some(Norm {
            weight: Some(w),
            ..norm
        }),
        None => normalized(g, uses, id),
    }
}

/// `v` as `n op c` (either operand) where `n`, used only here, is a norm `inner` finds and
/// `c` is a parameter of its normalized dims (`normalized_over`: the norm's input and first
/// normalized axis), broadcast: `(the norm, c)`.
fn with_param<N>(
    g: &Graph,
    uses: &[usize],
    v: ValueId,
    op: BinaryOp,
    inner: impl Fn(ValueId) -> Option<N>,
    normalized_over: impl Fn(&N) -> (ValueId, usize),
) -> Option<(N, ValueId)> {
    let node = &g.nodes[v];
    let [a, b] = node.inputs[..] else {
        return None;
    };
    if node.op != Op::Binary(op) {
        return None;
    }
    [(a, b), (b, a)].into_iter().find_map(|(n, c)| {
        let norm = (uses[n] == 1).then(|| inner(n)).flatten()?;
        let (x, axis) = normalized_over(&norm);
        let c = broadcast_weight(g, c, &g.ty(x).shape[axis..], node.ty.dtype)?;
        Some((norm, c))
    })
}

/// `v` as `x · rsqrt(mean(x²) + eps)` (either operand; rsqrt also as 1/sqrt) or
/// `x / sqrt(mean(x²) + eps)`, every intermediate used once.
fn normalized(g: &Graph, uses: &[usize], v: ValueId) -> Option<Norm> {
    let node = &g.nodes[v];
    let [a, b] = node.inputs[..] else {
        return None;
    };
    let norm = |x: ValueId, (axis, eps)| Norm {
        x,
        weight: None,
        axis,
        eps,
    };
    match node.op {
        Op::Binary(BinaryOp::Mul) => [(a, b), (b, a)]
            .into_iter()
            .find_map(|(x, s)| inverse_rms(g, uses, s, x, false).map(|p| norm(x, p))),
        Op::Binary(BinaryOp::Div) => inverse_rms(g, uses, b, a, true).map(|p| norm(a, p)),
        _ => None,
    }
}

/// `s` (possibly broadcast) as `1 / sqrt(mean(x²) + eps)`, or as `sqrt(mean(x²) + eps)`
/// when `root` (a divisor): `(axis, eps)` with the mean over `axis..` of `x`.
fn inverse_rms(
    g: &Graph,
    uses: &[usize],
    s: ValueId,
    x: ValueId,
    root: bool,
) -> Option<(usize, f64)> {
    let once = |v: ValueId| (uses[v] == 1).then_some(v);
    let input = |v: ValueId| g.nodes[v].inputs.first().copied();
    let mut s = once(s)?;
    if let Op::Expand { .. } = g.nodes[s].op {
        s = once(input(s)?)?;
    }
    let sum_eps = match (&g.nodes[s].op, root) {
        (Op::Unary(UnaryOp::Rsqrt), false) => input(s)?,
        (Op::Unary(UnaryOp::Recip), false) => {
            let r = once(input(s)?)?;
            (g.nodes[r].op == Op::Unary(UnaryOp::Sqrt)).then_some(())?;
            input(r)?
        }
        (Op::Unary(UnaryOp::Sqrt), true) => input(s)?,
        _ => return None,
    };
    let sum_eps = once(sum_eps)?;
    let Op::Binary(BinaryOp::Add) = g.nodes[sum_eps].op else {
        return None;
    };
    let [p, q] = g.nodes[sum_eps].inputs[..] else {
        return None;
    };
    let (mean, eps) = match (scalar(g, p), scalar(g, q)) {
        (_, Some(e)) => (p, e),
        (Some(e), None) => (q, e),
        _ => return None,
    };
    let (square, axis) = mean_over(g, uses, once(mean)?)?;
    let square = once(square)?;
    let squares_x = match (&g.nodes[square].op, &g.nodes[square].inputs[..]) {
        (Op::Binary(BinaryOp::Mul), &[a, b]) => a == x && b == x,
        (Op::Binary(BinaryOp::Pow), &[a, b]) => a == x && scalar(g, b) == Some(2.0),
        _ => false,
    };
    (squares_x && eps >= 0.0).then_some((axis, eps))
}

/// The value whose GELU node `id` computes, and which GELU: written out as the product of
/// `x`, 0.5 and `1 + erf(x / √2)` (erf GELU; `/ √2` also as `· 1/√2`) or `1 + tanh(√(2/π) ·
/// (x + 0.044715 · x³))` (the tanh approximation, GPT-2's `gelu_new`; the cube as `Pow 3`
/// or `x · x · x`), in any grouping and order, every intermediate used once. f32/f64 only:
/// a half-precision chain rounds each step.
fn gelu_chain(g: &Graph, uses: &[usize], id: ValueId) -> Option<(ValueId, UnaryOp)> {
    let node = &g.nodes[id];
    if node.op != Op::Binary(BinaryOp::Mul) || !matches!(node.ty.dtype, DType::F32 | DType::F64) {
        return None;
    }
    // The leaves of the product tree under `id`: its inner products are used only here.
    let mut factors = Vec::new();
    let mut stack = vec![id];
    while let Some(v) = stack.pop() {
        let n = &g.nodes[v];
        if n.op == Op::Binary(BinaryOp::Mul) && (v == id || uses[v] == 1) && factors.len() < 8 {
            stack.extend(n.inputs.iter().copied());
        } else {
            factors.push(v);
        }
    }
    let mut half = 1.0;
    let mut values = Vec::new();
    for f in factors {
        match scalar(g, f) {
            Some(c) => half *= c,
            None => values.push(f),
        }
    }
    let [a, b] = values[..] else {
        return None;
    };
    let close = |v: f64, want: f64| (v - want).abs() <= 1e-6 * want;
    // `1 + f(t)` for f erf or tanh: (f, t), every step used once.
    let one_plus = |s: ValueId| -> Option<(UnaryOp, ValueId)> {
        let node = &g.nodes[s];
        let (Op::Binary(BinaryOp::Add), [p, q]) = (&node.op, &node.inputs[..]) else {
            return None;
        };
        let f = match (scalar(g, *p), scalar(g, *q)) {
            (Some(1.0), None) => *q,
            (None, Some(1.0)) => *p,
            _ => return None,
        };
        let (Op::Unary(op), [t]) = (&g.nodes[f].op, &g.nodes[f].inputs[..]) else {
            return None;
        };
        (uses[s] == 1 && uses[f] == 1 && uses[*t] == 1).then_some((*op, *t))
    };
    // The x of `1 + erf(x / √2)` or `1 + tanh(√(2/π) · (x + 0.044715 · x³))`.
    let gelu_of = |s: ValueId| -> Option<(ValueId, UnaryOp)> {
        let (f, t) = one_plus(s)?;
        let (inner, k) = scaled(g, t)?;
        match f {
            UnaryOp::Erf => {
                close(k, std::f64::consts::FRAC_1_SQRT_2).then_some((inner, UnaryOp::Gelu))
            }
            UnaryOp::Tanh if close(k, (2.0 / std::f64::consts::PI).sqrt()) => {
                Some((tanh_gelu_inner(g, uses, inner)?, UnaryOp::GeluTanh))
            }
            _ => None,
        }
    };
    let (x, op) = [(a, b), (b, a)].into_iter().find_map(|(x, s)| {
        let (y, op) = gelu_of(s)?;
        (y == x).then_some((x, op))
    })?;
    (close(half, 0.5) && g.ty(x).shape == node.ty.shape && g.ty(x).dtype == node.ty.dtype)
        .then_some((x, op))
}

/// The `x` of `x + 0.044715 · x³` (the cube as `Pow(x, 3)` or `x · x · x` in either
/// grouping), every intermediate used only here.
fn tanh_gelu_inner(g: &Graph, uses: &[usize], inner: ValueId) -> Option<ValueId> {
    let node = &g.nodes[inner];
    let (Op::Binary(BinaryOp::Add), &[p, q]) = (&node.op, &node.inputs[..]) else {
        return None;
    };
    let is_cube_of = |c: ValueId, x: ValueId| match (&g.nodes[c].op, &g.nodes[c].inputs[..]) {
        (Op::Binary(BinaryOp::Pow), &[a, e]) => a == x && scalar(g, e) == Some(3.0),
        (Op::Binary(BinaryOp::Mul), &[a, b]) => {
            let square = |v: ValueId| {
                uses[v] == 1
                    && g.nodes[v].op == Op::Binary(BinaryOp::Mul)
                    && g.nodes[v].inputs[..] == [x, x]
            };
            (a == x && square(b)) || (b == x && square(a))
        }
        _ => false,
    };
    [(p, q), (q, p)].into_iter().find_map(|(x, cubic)| {
        let (cube, a) = scaled(g, cubic)?;
        let once = uses[inner] == 1 && uses[cubic] == 1 && uses[cube] == 1;
        (once && (a - 0.044715).abs() <= 1e-6 && is_cube_of(cube, x)).then_some(x)
    })
}

/// `m` as the mean of a value over its trailing dims from some axis (a kept-dim sum times
/// or divided by their count, the sum used only here): `(value, axis)`.
fn mean_over(g: &Graph, uses: &[usize], m: ValueId) -> Option<(ValueId, usize)> {
    let (sum, per) = scaled(g, m)?;
    if uses[sum] != 1 {
        return None;
    }
    let Op::Reduce {
        op: ReduceOp::Sum,
        ref axes,
        keepdim: true,
    } = g.nodes[sum].op
    else {
        return None;
    };
    let v = *g.nodes[sum].inputs.first()?;
    let shape = &g.ty(v).shape;
    let axis = *axes.first()?;
    let trailing = axes.iter().copied().eq(axis..shape.len());
    let count: Option<i64> = shape[axis..].iter().map(|d| d.as_const()).product();
    let mean = count.is_some_and(|n| n > 0 && (per * n as f64 - 1.0).abs() < 1e-6);
    (trailing && mean).then_some((v, axis))
}

/// A layer norm: `(x - mean(x)) / sqrt(mean((x - mean(x))²) + eps)`, times a weight and
/// plus a bias over the normalized dims when there are, over dims `axis..`.
#[derive(Clone, Copy, Debug)]
struct LayerNorm {
    x: ValueId,
    weight: Option<ValueId>,
    bias: Option<ValueId>,
    axis: usize,
    eps: f64,
}

/// The layer norm ending at node `id` (its bias add, weight product, or normalization).
/// f32/f64 only, as for RMS norm.
fn layer_norm_chain(g: &Graph, uses: &[usize], id: ValueId) -> Option<LayerNorm> {
    let node = &g.nodes[id];
    if !matches!(node.ty.dtype, DType::F32 | DType::F64) {
        return None;
    }
    let over = |n: &LayerNorm| (n.x, n.axis);
    // The normalization, times a weight when there is one.
    let weighted = |v: ValueId| {
        let inner = |n| centered(g, uses, n);
        match with_param(g, uses, v, BinaryOp::Mul, inner, over) {
            Some((norm, w)) => Some(LayerNorm {
                weight: Some(w),
                ..norm
            }),
            None => centered(g, uses, v),
        }
    };
    match with_param(g, uses, id, BinaryOp::Add, weighted, over) {
        Some((norm, bias)) => Some(LayerNorm {
            bias: Some(bias),
            ..norm
        }),
        None => weighted(id),
    }
}

/// `v` as the RMS norm of `x - mean(x)` over the same dims, the centered value used only
/// by the norm (its square and the normalization).
fn centered(g: &Graph, uses: &[usize], v: ValueId) -> Option<LayerNorm> {
    let norm = normalized(g, uses, v)?;
    let d = norm.x;
    let Op::Binary(BinaryOp::Sub) = g.nodes[d].op else {
        return None;
    };
    let [x, mut m] = g.nodes[d].inputs[..] else {
        return None;
    };
    // The square reads d once (Pow) or twice (Mul), the normalization once.
    if !(2..=3).contains(&uses[d]) || uses[m] != 1 {
        return None;
    }
    if let Op::Expand { .. } = g.nodes[m].op {
        m = g.nodes[m].inputs[0];
        if uses[m] != 1 {
            return None;
        }
    }
    let (of, axis) = mean_over(g, uses, m)?;
    (of == x && axis == norm.axis).then_some(LayerNorm {
        x,
        weight: None,
        bias: None,
        axis,
        eps: norm.eps,
    })
}

/// The value `w` broadcasts: one of exactly the normalized `dims` (and `dtype`), given
/// leading 1s by reshapes, then broadcast over the leading dims by expands.
fn broadcast_weight(g: &Graph, w: ValueId, dims: &[Dim], dtype: DType) -> Option<ValueId> {
    let trailing = |v: ValueId| {
        let s = &g.ty(v).shape;
        s.len() >= dims.len() && s[s.len() - dims.len()..] == *dims
    };
    let mut v = w;
    loop {
        let t = g.ty(v);
        if t.shape == dims {
            return (t.dtype == dtype).then_some(v);
        }
        let from = *g.nodes[v].inputs.first()?;
        let leading_ones = t.shape[..t.rank().saturating_sub(dims.len())]
            .iter()
            .all(|d| *d == Dim::Const(1));
        match g.nodes[v].op {
            Op::Expand { .. } if trailing(v) && trailing(from) => {}
            Op::Reshape { .. } if trailing(v) && leading_ones => {}
            _ => return None,
        }
        v = from;
    }
}

/// The keys `kt` (`[B.., E, S]`) transposes, when it is a swap of the last two dims with
/// batch-regrouping reshapes around it: a value whose elements, regrouped to `kt`'s batch
/// dims, are the keys `[B.., S, E]`. Exporters transpose grouped-query keys after repeating
/// them (`Reshape(Transpose(Reshape(Expand(k))))`); reading the repeat itself lets the
/// optimizer keep the broadcast a view, as it does for attention traced by torch.
fn untransposed(g: &Graph, kt: ValueId) -> Option<ValueId> {
    let regroups = |v: ValueId| {
        let (Op::Reshape { .. }, Some(&from)) = (&g.nodes[v].op, g.nodes[v].inputs.first()) else {
            return None;
        };
        let (a, b) = (&g.ty(from).shape, &g.ty(v).shape);
        let batch = |s: &[Dim]| {
            s[..s.len() - 2]
                .iter()
                .map(Dim::as_const)
                .product::<Option<i64>>()
        };
        let keeps = a.len() >= 2 && b.len() >= 2 && a[a.len() - 2..] == b[b.len() - 2..];
        (keeps && batch(a).is_some() && batch(a) == batch(b)).then_some(from)
    };
    let mut v = kt;
    while let Some(from) = regroups(v) {
        v = from;
    }
    let Op::Permute { perm } = &g.nodes[v].op else {
        return None;
    };
    let r = perm.len();
    let swap = r >= 2
        && perm[..r - 2].iter().enumerate().all(|(i, &p)| i == p)
        && perm[r - 2..] == [r - 1, r - 2];
    if !swap {
        return None;
    }
    let mut keys = g.nodes[v].inputs[0];
    while let Some(from) = regroups(keys) {
        keys = from;
    }
    Some(keys)
}
