//! The rulesets, generated from Rust tables (DESIGN §4) so that every guard (rank, dtype,
//! shape) comes from one template instead of being copied by hand.
//!
//! * `analysis`: facts the other rules read (the dtype of every class; which classes are
//!   all-ones or all-zeros constants).
//! * `algebra`: identities that hold exactly in floating point.
//! * `layout`: view algebra (permute∘permute, reshape∘reshape, identity views) and
//!   broadcasts pushed through elementwise ops.
//! * `fuse`: composite ops ⇄ their decompositions (softmax, layer/rms norm, silu), and
//!   products sharing an operand ⇄ one merged product ([`super::merge`]).
//! * `lower`: the backend's implementation choices ([`LoweringRule`]).
//!
//! Every union is unconditionally equivalent: each rule pins the rank and dtype of what it
//! matches (pattern variables shared between both sides), and rules that depend on a shape
//! are generated for, and guarded by, that exact shape.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;

use super::encode::{dtype_lit, lit, term, Vocabulary};
use crate::backend::LoweringRule;
use crate::dim::{format_shape, Dim};
use crate::dtype::{DType, Scalar};
use crate::ir::{BinaryOp, Graph, Op, ReduceOp, TensorType, UnaryOp};

/// The rulesets in the order the schedule runs them.
pub const RULESETS: [&str; 5] = ["analysis", "algebra", "layout", "fuse", "lower"];

/// Permutations composed per rank at most (the closure of a graph's permutes can be large
/// for high ranks; beyond this the rules simply do not cover every pair).
const MAX_PERMS_PER_RANK: usize = 48;

/// The rule program for `graph`: ruleset declarations, rules, and the key facts they read.
pub fn generate(graph: &Graph, vocab: &mut Vocabulary, lowering: &[LoweringRule]) -> String {
    let mut w = RuleWriter::default();
    for rs in RULESETS {
        let _ = writeln!(w.text, "(ruleset {rs})");
    }
    analysis(&mut w);
    algebra(graph, vocab, &mut w);
    layout(graph, vocab, &mut w);
    fuse(graph, vocab, &mut w);
    lower(graph, vocab, lowering, &mut w);
    key_facts(vocab, &mut w);
    w.text
}

#[derive(Default)]
pub(super) struct RuleWriter {
    text: String,
    names: BTreeSet<String>,
}

impl RuleWriter {
    /// Adds `(rule (query) (actions))` to `ruleset` under a unique name `ruleset/name`.
    pub(super) fn rule(&mut self, ruleset: &str, name: &str, query: &str, actions: &str) {
        let mut full = format!("{ruleset}/{name}");
        let mut k = 2;
        while self.names.contains(&full) {
            full = format!("{ruleset}/{name}#{k}");
            k += 1;
        }
        self.names.insert(full.clone());
        let _ = writeln!(
            self.text,
            "(rule ({query}) ({actions}) :ruleset {ruleset} :name {})",
            lit(&full)
        );
    }
}

fn vars(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("a{i}")).collect()
}

fn analysis(w: &mut RuleWriter) {
    w.rule(
        "analysis",
        "dtype-src",
        "(= e (Src k d r))",
        "(DTypeOf e d)",
    );
    for n in 1..=4 {
        let args = vars(n);
        w.rule(
            "analysis",
            &format!("dtype-op{n}"),
            &format!("(= e {})", term("k", &args, "d", "r")),
            "(DTypeOf e d)",
        );
    }
    w.rule(
        "analysis",
        "dtype-opn",
        "(= e (OpN k l d r))",
        "(DTypeOf e d)",
    );
    // A broadcast or reshape of an all-ones (all-zeros) tensor is all ones (zeros).
    for fact in ["OneLike", "ZeroLike"] {
        for view in ["IsExpand", "IsReshape"] {
            w.rule(
                "analysis",
                &format!("{fact}-{view}"),
                &format!("(= e (Op1 k c d r)) ({view} k) ({fact} c)"),
                &format!("({fact} e)"),
            );
        }
    }
}

/// An op present in the graph, with every (dtype, rank, arity) it appears at.
type Uses = (Op, BTreeSet<(DType, usize, usize)>);

fn instances(graph: &Graph) -> BTreeMap<String, Uses> {
    let mut out: BTreeMap<String, Uses> = BTreeMap::new();
    for n in &graph.nodes {
        if n.inputs.is_empty() {
            continue;
        }
        let key = super::encode::op_key(&n.op);
        out.entry(key)
            .or_insert_with(|| (n.op.clone(), BTreeSet::new()))
            .1
            .insert((n.ty.dtype, n.ty.rank(), n.inputs.len()));
    }
    out
}

fn algebra(graph: &Graph, vocab: &mut Vocabulary, w: &mut RuleWriter) {
    let neg = lit(&vocab.op(&Op::Unary(UnaryOp::Neg)));
    w.rule(
        "algebra",
        "neg-neg",
        &format!("(= e (Op1 {neg} (Op1 {neg} x d r) d r))"),
        "(union e x)",
    );
    let mul = lit(&vocab.op(&Op::Binary(BinaryOp::Mul)));
    let div = lit(&vocab.op(&Op::Binary(BinaryOp::Div)));
    let sub = lit(&vocab.op(&Op::Binary(BinaryOp::Sub)));
    // Binary operands share the output's dtype and shape, so `x` can replace the product.
    w.rule(
        "algebra",
        "mul-one",
        &format!("(= e (Op2 {mul} x c d r)) (OneLike c)"),
        "(union e x)",
    );
    w.rule(
        "algebra",
        "one-mul",
        &format!("(= e (Op2 {mul} c x d r)) (OneLike c)"),
        "(union e x)",
    );
    w.rule(
        "algebra",
        "div-one",
        &format!("(= e (Op2 {div} x c d r)) (OneLike c)"),
        "(union e x)",
    );
    // `x - (+0) == x` for every x including -0 and NaN (`x + 0` is not: -0 + 0 = +0).
    w.rule(
        "algebra",
        "sub-zero",
        &format!("(= e (Op2 {sub} x c d r)) (ZeroLike c)"),
        "(union e x)",
    );
    // Casts: to the value's own dtype, and round trips through a wider dtype.
    let casts: BTreeSet<DType> = graph
        .nodes
        .iter()
        .filter_map(|n| match n.op {
            Op::Cast { to } => Some(to),
            _ => None,
        })
        .collect();
    for &to in &casts {
        let k = lit(&vocab.op(&Op::Cast { to }));
        let d = dtype_lit(to);
        w.rule(
            "algebra",
            &format!("cast-same-{to}"),
            &format!("(= e (Op1 {k} x {d} r)) (DTypeOf x {d})"),
            "(union e x)",
        );
        for &mid in &casts {
            if lossless(to, mid) {
                let km = lit(&vocab.op(&Op::Cast { to: mid }));
                let dm = dtype_lit(mid);
                w.rule(
                    "algebra",
                    &format!("cast-roundtrip-{to}-{mid}"),
                    &format!("(= e (Op1 {k} (Op1 {km} x {dm} r) {d} r)) (DTypeOf x {d})"),
                    "(union e x)",
                );
            }
        }
    }
}

/// Whether every value of `from` survives a cast to `to` and back.
fn lossless(from: DType, to: DType) -> bool {
    use DType::*;
    matches!(
        (from, to),
        (F16 | BF16, F32 | F64)
            | (F32, F64)
            | (Bool, U8 | I8 | I16 | I32 | I64 | F16 | BF16 | F32 | F64)
            | (U8, I16 | I32 | I64 | F16 | F32 | F64)
            | (I8, I16 | I32 | I64 | F16 | F32 | F64)
            | (I16, I32 | I64 | F32 | F64)
            | (I32, I64 | F64)
    )
}

fn layout(graph: &Graph, vocab: &mut Vocabulary, w: &mut RuleWriter) {
    // permute ∘ permute, over the closure of the graph's permutations (per rank, bounded).
    let mut by_rank: BTreeMap<usize, BTreeSet<Vec<usize>>> = BTreeMap::new();
    for n in &graph.nodes {
        if let Op::Permute { perm } = &n.op {
            by_rank.entry(perm.len()).or_default().insert(perm.clone());
        }
    }
    for perms in by_rank.values_mut() {
        loop {
            let mut new = Vec::new();
            for p in perms.iter() {
                for q in perms.iter() {
                    let c = compose(p, q);
                    if !perms.contains(&c) && !new.contains(&c) {
                        new.push(c);
                    }
                }
            }
            if new.is_empty() || perms.len() + new.len() > MAX_PERMS_PER_RANK {
                break;
            }
            perms.extend(new);
        }
    }
    for perms in by_rank.values() {
        for p in perms {
            let kp = lit(&vocab.op(&Op::Permute { perm: p.clone() }));
            if is_identity(p) {
                w.rule(
                    "layout",
                    &format!("permute-identity-{p:?}"),
                    &format!("(= e (Op1 {kp} x d r))"),
                    "(union e x)",
                );
                continue;
            }
            for q in perms {
                if is_identity(q) {
                    continue;
                }
                let kq = lit(&vocab.op(&Op::Permute { perm: q.clone() }));
                let c = compose(p, q);
                let action = if is_identity(&c) {
                    "(union e x)".to_string()
                } else {
                    let kc = lit(&vocab.op(&Op::Permute { perm: c }));
                    format!("(union e (Op1 {kc} x d r))")
                };
                w.rule(
                    "layout",
                    &format!("permute-permute-{p:?}-{q:?}"),
                    &format!("(= e (Op1 {kq} (Op1 {kp} x d r) d r))"),
                    &action,
                );
            }
        }
    }
    // A reshape of a reshape is one reshape; views to the shape they already have vanish.
    w.rule(
        "layout",
        "reshape-reshape",
        "(= e (Op1 k2 (Op1 k1 x d r1) d r2)) (IsReshape k1) (IsReshape k2)",
        "(union e (Op1 k2 x d r2))",
    );
    w.rule(
        "layout",
        "reshape-identity",
        "(= e (Op1 k x d r)) (ReshapeTo k s) (HasShape x s)",
        "(union e x)",
    );
    w.rule(
        "layout",
        "expand-identity",
        "(= e (Op1 k x d r)) (ExpandTo k s) (HasShape x s)",
        "(union e x)",
    );
    // Elementwise ops on broadcast operands compute on the small tensor, then broadcast.
    w.rule(
        "layout",
        "unary-of-expand",
        "(= e (Op1 u (Op1 k x d0 r) d r)) (IsExpand k) (ElementwiseUnary u)",
        "(union e (Op1 k (Op1 u x d r) d r))",
    );
    w.rule(
        "layout",
        "binary-of-expands",
        "(= e (Op2 b (Op1 k x d0 r) (Op1 k y d0 r) d r)) (IsExpand k) (ElementwiseBinary b) \
         (HasShape x s) (HasShape y s)",
        "(union e (Op1 k (Op2 b x y d r) d r))",
    );
    let mut done = BTreeSet::new();
    for n in &graph.nodes {
        if let Op::Attention {
            causal, has_mask, ..
        } = n.op
        {
            let key = format!("{:?}", (&n.op, &n.inputs));
            if done.insert(key) {
                attention_batch_rules(graph, vocab, w, n, causal, has_mask);
            }
        }
    }
}

/// Batch dims of `reshaped` that a reshape regroups from `source`, when the reshape keeps the
/// trailing two (matrix) dims and the batch dims of both sides are constants with the same
/// product.
fn batch_regrouping(source: &TensorType, reshaped: &TensorType) -> Option<Vec<Dim>> {
    let (rs, rr) = (source.rank(), reshaped.rank());
    if rs < 2 || rr < 2 || source.shape[rs - 2..] != reshaped.shape[rr - 2..] {
        return None;
    }
    let product =
        |dims: &[Dim]| -> Option<i64> { dims.iter().map(Dim::as_const).product::<Option<i64>>() };
    let (bs, br) = (&source.shape[..rs - 2], &reshaped.shape[..rr - 2]);
    (product(bs)? == product(br)?).then(|| bs.to_vec())
}

/// Attention whose k and v are reshapes that regroup batch dims (grouped-query attention
/// repeats each KV head as `reshape(expand(reshape(k)))`, and the last reshape copies the
/// broadcast) reads k and v before the reshape instead: q and the mask are regrouped to
/// their batch dims and the output regrouped back, so the broadcast stays a view. When the
/// repeat is a broadcast of the last batch dim, with no mask and no causal mask (each query
/// row independent), the repeated heads' queries are stacked as rows of one attention over
/// the un-repeated k and v: each KV head is read once for all its query heads.
fn attention_batch_rules(
    graph: &Graph,
    vocab: &mut Vocabulary,
    w: &mut RuleWriter,
    n: &crate::ir::Node,
    causal: bool,
    has_mask: bool,
) {
    let (q, k, v) = (n.inputs[0], n.inputs[1], n.inputs[2]);
    let (Op::Reshape { .. }, Op::Reshape { .. }) = (&graph.nodes[k].op, &graph.nodes[v].op) else {
        return;
    };
    let (xk, xv) = (graph.nodes[k].inputs[0], graph.nodes[v].inputs[0]);
    let (qt, xkt, xvt) = (graph.ty(q), graph.ty(xk), graph.ty(xv));
    let (Some(batch), Some(batch_v)) = (
        batch_regrouping(xkt, graph.ty(k)),
        batch_regrouping(xvt, graph.ty(v)),
    ) else {
        return;
    };
    let rq = qt.rank();
    let product = |dims: &[Dim]| dims.iter().map(Dim::as_const).product::<Option<i64>>();
    let (Some(qb), Some(kb)) = (product(&qt.shape[..rq - 2]), product(&batch)) else {
        return;
    };
    if batch != batch_v || qb != kb || batch.len() + 2 == rq {
        return;
    }
    let rx = batch.len() + 2;
    let (d, r, rxl) = (dtype_lit(qt.dtype), rq.to_string(), rx.to_string());
    let att = lit(&vocab.op(&n.op));
    let (rsk, rsv) = (
        lit(&vocab.op(&graph.nodes[k].op)),
        lit(&vocab.op(&graph.nodes[v].op)),
    );
    let regroup = |vocab: &mut Vocabulary, t: &TensorType, batch: &[Dim], x: &str| {
        let mut shape = batch.to_vec();
        shape.extend(t.shape[t.rank() - 2..].iter().cloned());
        let key = lit(&vocab.op(&Op::Reshape { shape }));
        format!("(Op1 {key} {x} {} {rx})", dtype_lit(t.dtype))
    };
    let out_ty = &n.ty;
    let back = lit(&vocab.op(&Op::Reshape {
        shape: out_ty.shape.clone(),
    }));
    let shape_of = |t: &TensorType| lit(&format_shape(&t.shape));
    let mut guard = format!(
        "(HasShape q {}) (HasShape xk {}) (HasShape xv {})",
        shape_of(qt),
        shape_of(xkt),
        shape_of(xvt)
    );
    let mut pattern_args = vec![
        "q".to_string(),
        format!("(Op1 {rsk} xk {d} {r})"),
        format!("(Op1 {rsv} xv {d} {r})"),
    ];
    let mut args = vec![
        regroup(vocab, qt, &batch, "q"),
        "xk".to_string(),
        "xv".to_string(),
    ];
    if has_mask {
        let mt = graph.ty(n.inputs[3]);
        pattern_args.push("m".into());
        let _ = write!(guard, " (HasShape m {})", shape_of(mt));
        args.push(regroup(vocab, mt, &batch, "m"));
    }
    let name = format_shape(&qt.shape);
    w.rule(
        "layout",
        &format!("attention-of-regrouped-kv-{name}"),
        &format!("(= e {}) {guard}", term(&att, &pattern_args, &d, &r)),
        &format!(
            "(union e (Op1 {back} {} {d} {r}))",
            term(&att, &args, &d, &rxl)
        ),
    );

    // Stacked query rows: k and v broadcast from size 1 on their last batch dim.
    let (Op::Expand { .. }, Op::Expand { .. }) = (&graph.nodes[xk].op, &graph.nodes[xv].op) else {
        return;
    };
    let (k1, v1) = (graph.nodes[xk].inputs[0], graph.nodes[xv].inputs[0]);
    let (k1t, v1t) = (graph.ty(k1), graph.ty(v1));
    let Some(last) = batch.len().checked_sub(1) else {
        return; // no batch dim that could have been repeated
    };
    let repeats_last_batch_dim = |t: &TensorType, x: &TensorType| {
        t.shape[last].as_const() == Some(1)
            && (0..rx).all(|i| i == last || t.shape[i] == x.shape[i])
    };
    let l = &qt.shape[rq - 2];
    let (Some(reps), Some(l)) = (batch[last].as_const(), l.as_const()) else {
        return;
    };
    if causal || has_mask || !repeats_last_batch_dim(k1t, xkt) || !repeats_last_batch_dim(v1t, xvt)
    {
        return;
    }
    let (exk, exv) = (
        lit(&vocab.op(&graph.nodes[xk].op)),
        lit(&vocab.op(&graph.nodes[xv].op)),
    );
    let mut stacked = k1t.shape[..rx - 2].to_vec();
    stacked.push(Dim::from(reps * l));
    stacked.push(qt.shape[rq - 1].clone());
    let stack_q = lit(&vocab.op(&Op::Reshape { shape: stacked }));
    w.rule(
        "layout",
        &format!("attention-stacked-query-rows-{name}"),
        &format!(
            "(= e {}) (= xk (Op1 {exk} k1 {d} {rxl})) (= xv (Op1 {exv} v1 {d} {rxl})) {guard} \
             (HasShape k1 {}) (HasShape v1 {})",
            term(&att, &pattern_args, &d, &r),
            shape_of(k1t),
            shape_of(v1t)
        ),
        &format!(
            "(union e (Op1 {back} {} {d} {r}))",
            term(
                &att,
                &[
                    format!("(Op1 {stack_q} q {d} {rxl})"),
                    "k1".into(),
                    "v1".into()
                ],
                &d,
                &rxl
            )
        ),
    );
}

/// `permute(permute(x, p), q) == permute(x, compose(p, q))`.
fn compose(p: &[usize], q: &[usize]) -> Vec<usize> {
    q.iter().map(|&i| p[i]).collect()
}

fn is_identity(p: &[usize]) -> bool {
    p.iter().enumerate().all(|(i, &v)| i == v)
}

fn fuse(graph: &Graph, vocab: &mut Vocabulary, w: &mut RuleWriter) {
    let mul = lit(&vocab.op(&Op::Binary(BinaryOp::Mul)));
    let sig = lit(&vocab.op(&Op::Unary(UnaryOp::Sigmoid)));
    let silu = lit(&vocab.op(&Op::Unary(UnaryOp::Silu)));
    for dt in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let d = dtype_lit(dt);
        w.rule(
            "fuse",
            &format!("silu-fuse-{dt}"),
            &format!("(= e (Op2 {mul} x (Op1 {sig} x {d} r) {d} r))"),
            &format!("(union e (Op1 {silu} x {d} r))"),
        );
        w.rule(
            "fuse",
            &format!("silu-fuse-swapped-{dt}"),
            &format!("(= e (Op2 {mul} (Op1 {sig} x {d} r) x {d} r))"),
            &format!("(union e (Op1 {silu} x {d} r))"),
        );
        w.rule(
            "fuse",
            &format!("silu-decompose-{dt}"),
            &format!("(= e (Op1 {silu} x {d} r))"),
            &format!("(union e (Op2 {mul} x (Op1 {sig} x {d} r) {d} r))"),
        );
    }
    // Composite ops: a decomposition rule per (op, input shape, dtype) the graph holds,
    // because the decomposition's broadcasts name the shape.
    let mut done = BTreeSet::new();
    for n in &graph.nodes {
        let Some(&x) = n.inputs.first() else { continue };
        let xt = graph.ty(x).clone();
        if !matches!(xt.dtype, DType::F32 | DType::F64) {
            // Decomposed low-precision norms would round every intermediate: less accurate
            // than the fused kernels (and eager), so they are not offered.
            continue;
        }
        let key = (super::encode::op_key(&n.op), format_shape(&xt.shape));
        if !done.insert(key) {
            continue;
        }
        match &n.op {
            Op::Softmax { axis, log } => softmax_rule(vocab, w, &n.op, &xt, *axis, *log),
            Op::RmsNorm { axis, eps, .. } | Op::LayerNorm { axis, eps, .. } => {
                let arity = n.inputs.len();
                norm_rule(vocab, w, &n.op, &xt, *axis, *eps, arity)
            }
            Op::Attention {
                scale,
                causal,
                has_mask,
            } => {
                let types: Vec<TensorType> =
                    n.inputs.iter().map(|&i| graph.ty(i).clone()).collect();
                attention_rule(vocab, w, &n.op, &types, *scale, *causal, *has_mask)
            }
            _ => {}
        }
    }
    super::merge::dot_merge_rules(graph, vocab, w);
}

/// Term-building shorthands for one decomposition over inputs of type `xt`.
struct Decomp<'a> {
    vocab: &'a mut Vocabulary,
    d: String,
    r: String,
    xt: TensorType,
}

impl Decomp<'_> {
    fn op1(&mut self, op: Op, x: &str) -> String {
        let k = lit(&self.vocab.op(&op));
        format!("(Op1 {k} {x} {} {})", self.d, self.r)
    }
    fn op2(&mut self, op: Op, x: &str, y: &str) -> String {
        let k = lit(&self.vocab.op(&op));
        format!("(Op2 {k} {x} {y} {} {})", self.d, self.r)
    }
    fn bin(&mut self, b: BinaryOp, x: &str, y: &str) -> String {
        self.op2(Op::Binary(b), x, y)
    }
    fn reduce(&mut self, op: ReduceOp, axes: Vec<usize>, x: &str) -> String {
        self.op1(
            Op::Reduce {
                op,
                axes,
                keepdim: true,
            },
            x,
        )
    }
    /// Broadcasts a keepdim-reduced term back to the input's shape.
    fn expand(&mut self, x: &str) -> String {
        let shape = self.xt.shape.clone();
        self.op1(Op::Expand { shape }, x)
    }
    /// A constant of the reduced (keepdim) shape over `axes`.
    fn full(&mut self, value: f64, axes: &[usize]) -> String {
        let mut shape = self.xt.shape.clone();
        for &a in axes {
            shape[a] = Dim::from(1i64);
        }
        let ty = TensorType::new(self.xt.dtype, shape);
        let k = self.vocab.full(Scalar::Float(value), &ty);
        format!("(Src {} {} {})", lit(&k), self.d, self.r)
    }
    /// A trailing-dims parameter (norm weight/bias) reshaped to rank r and broadcast.
    fn param(&mut self, p: &str, axis: usize) -> String {
        let mut shape: Vec<Dim> = vec![Dim::from(1i64); axis];
        shape.extend(self.xt.shape[axis..].iter().cloned());
        let reshaped = self.op1(Op::Reshape { shape }, p);
        self.expand(&reshaped)
    }
}

fn softmax_rule(
    vocab: &mut Vocabulary,
    w: &mut RuleWriter,
    op: &Op,
    xt: &TensorType,
    axis: usize,
    log: bool,
) {
    let (d, r) = (dtype_lit(xt.dtype), xt.rank().to_string());
    let k = lit(&vocab.op(op));
    let shape = lit(&format_shape(&xt.shape));
    let mut t = Decomp {
        vocab,
        d: d.clone(),
        r: r.clone(),
        xt: xt.clone(),
    };
    let m = t.reduce(ReduceOp::Max, vec![axis], "x");
    let me = t.expand(&m);
    let xm = t.bin(BinaryOp::Sub, "x", &me);
    let ex = t.op1(Op::Unary(UnaryOp::Exp), "xm");
    let s = t.reduce(ReduceOp::Sum, vec![axis], "ex");
    let result = if log {
        let ls = t.op1(Op::Unary(UnaryOp::Log), &s);
        let lse = t.expand(&ls);
        t.bin(BinaryOp::Sub, "xm", &lse)
    } else {
        let se = t.expand(&s);
        t.bin(BinaryOp::Div, "ex", &se)
    };
    let name = if log { "log-softmax" } else { "softmax" };
    w.rule(
        "fuse",
        &format!("{name}-decompose-{}", format_shape(&xt.shape)),
        &format!("(= e (Op1 {k} x {d} {r})) (HasShape x {shape})"),
        &format!("(let xm {xm}) (let ex {ex}) (union e {result})"),
    );
}

fn norm_rule(
    vocab: &mut Vocabulary,
    w: &mut RuleWriter,
    op: &Op,
    xt: &TensorType,
    axis: usize,
    eps: f64,
    arity: usize,
) {
    // The element count of the normalized dims must be a known constant.
    let Some(count) = xt.shape[axis..]
        .iter()
        .map(|d| d.as_const())
        .try_fold(1i64, |acc, d| d.map(|v| acc * v))
    else {
        return;
    };
    if count == 0 {
        return;
    }
    let (d, r) = (dtype_lit(xt.dtype), xt.rank().to_string());
    let k = lit(&vocab.op(op));
    let shape = lit(&format_shape(&xt.shape));
    let axes: Vec<usize> = (axis..xt.rank()).collect();
    let mut t = Decomp {
        vocab,
        d: d.clone(),
        r: r.clone(),
        xt: xt.clone(),
    };
    let n = t.full(count as f64, &axes);
    let eps_c = t.full(eps, &axes);
    let (centered, has_weight, has_bias) = match op {
        Op::RmsNorm { has_weight, .. } => ("x".to_string(), *has_weight, false),
        Op::LayerNorm {
            has_weight,
            has_bias,
            ..
        } => {
            let s = t.reduce(ReduceOp::Sum, axes.clone(), "x");
            let mean = t.bin(BinaryOp::Div, &s, &n);
            let me = t.expand(&mean);
            (t.bin(BinaryOp::Sub, "x", &me), *has_weight, *has_bias)
        }
        _ => return,
    };
    let sq = t.bin(BinaryOp::Mul, "c", "c");
    let ss = t.reduce(ReduceOp::Sum, axes.clone(), &sq);
    let ms = t.bin(BinaryOp::Div, &ss, &n);
    let plus = t.bin(BinaryOp::Add, &ms, &eps_c);
    let rs = t.op1(Op::Unary(UnaryOp::Rsqrt), &plus);
    let rse = t.expand(&rs);
    let mut y = t.bin(BinaryOp::Mul, "c", &rse);
    let args = vars(arity);
    let mut next = 1;
    if has_weight {
        let p = t.param(&args[next], axis);
        y = t.bin(BinaryOp::Mul, &y, &p);
        next += 1;
    }
    if has_bias {
        let p = t.param(&args[next], axis);
        y = t.bin(BinaryOp::Add, &y, &p);
    }
    let mut q_args = args.clone();
    q_args[0] = "x".into();
    w.rule(
        "fuse",
        &format!(
            "{}-decompose-{}",
            op.name().replace('_', "-"),
            format_shape(&xt.shape)
        ),
        &format!("(= e {}) (HasShape x {shape})", term(&k, &q_args, &d, &r)),
        &format!("(let c {centered}) (union e {y})"),
    );
}

/// `softmax(q·kᵀ·scale, causally masked) · v` from IR ops, for one (q, k, v) shape; not for
/// attention with a mask (see below).
fn attention_rule(
    vocab: &mut Vocabulary,
    w: &mut RuleWriter,
    op: &Op,
    types: &[TensorType],
    scale: f64,
    causal: bool,
    has_mask: bool,
) {
    let (q, k, v) = (&types[0], &types[1], &types[2]);
    let r = q.rank();
    if has_mask {
        // A mask can mask a whole row: attention gives zeros there, the decomposition NaN.
        return;
    }
    let (d, rl) = (dtype_lit(q.dtype), r.to_string());
    let key = lit(&vocab.op(op));
    // Scores: [B.., L, S].
    let mut scores_shape = q.shape[..r - 1].to_vec();
    scores_shape.push(k.shape[r - 2].clone());
    let sty = TensorType::new(q.dtype, scores_shape.clone());
    let mut swap: Vec<usize> = (0..r).collect();
    swap.swap(r - 2, r - 1);
    let perm = lit(&vocab.op(&Op::Permute { perm: swap }));
    let dot = lit(&vocab.op(&Op::Dot));
    let mul = lit(&vocab.op(&Op::Binary(BinaryOp::Mul)));
    let wh = lit(&vocab.op(&Op::Where));
    let scale_c = lit(&vocab.full(Scalar::Float(scale), &sty));
    let ninf = lit(&vocab.full(Scalar::Float(f64::NEG_INFINITY), &sty));
    let mut s = format!(
        "(Op2 {mul} (Op2 {dot} q (Op1 {perm} k {d} {rl}) {d} {rl}) (Src {scale_c} {d} {rl}) {d} {rl})"
    );
    let b = dtype_lit(DType::Bool);
    if causal {
        // keep[i, j] = j <= i: iotas over L and S broadcast against each other.
        let pos = |vocab: &mut Vocabulary, n: &Dim, axis: usize| -> String {
            let iota = vocab.source(
                Op::Iota {
                    start: Scalar::Int(0),
                    step: Scalar::Int(1),
                },
                &TensorType::new(DType::I64, vec![n.clone()]),
            );
            let mut shape = vec![Dim::from(1i64); r];
            shape[axis] = n.clone();
            let reshape = lit(&vocab.op(&Op::Reshape { shape }));
            let expand = lit(&vocab.op(&Op::Expand {
                shape: scores_shape.clone(),
            }));
            let i64_ = dtype_lit(DType::I64);
            format!(
                "(Op1 {expand} (Op1 {reshape} (Src {} {i64_} 1) {i64_} {rl}) {i64_} {rl})",
                lit(&iota)
            )
        };
        let row = pos(vocab, &q.shape[r - 2], r - 2);
        let col = pos(vocab, &k.shape[r - 2], r - 1);
        let le = lit(&vocab.op(&Op::Binary(BinaryOp::Le)));
        s = format!(
            "(Op3 {wh} (Op2 {le} {col} {row} {b} {rl}) {s} (Src {ninf} {d} {rl}) {d} {rl})"
        );
    }
    let softmax = lit(&vocab.op(&Op::Softmax {
        axis: r - 1,
        log: false,
    }));
    let out = format!("(Op2 {dot} (Op1 {softmax} {s} {d} {rl}) v {d} {rl})");
    let args: Vec<String> = ["q", "k", "v"].iter().map(|s| s.to_string()).collect();
    let guard = format!(
        "(HasShape q {}) (HasShape k {}) (HasShape v {})",
        lit(&format_shape(&q.shape)),
        lit(&format_shape(&k.shape)),
        lit(&format_shape(&v.shape))
    );
    w.rule(
        "fuse",
        &format!("attention-decompose-{}", format_shape(&q.shape)),
        &format!("(= e {}) {guard}", term(&key, &args, &d, &rl)),
        &format!("(union e {out})"),
    );
}

fn lower(graph: &Graph, vocab: &mut Vocabulary, lowering: &[LoweringRule], w: &mut RuleWriter) {
    let present = instances(graph);
    for rule in lowering {
        match rule {
            LoweringRule::Kernel { kernel, applies } => {
                for (key, (op, uses)) in &present {
                    for &(dtype, rank, arity) in uses {
                        if !applies(op, dtype, rank) {
                            continue;
                        }
                        let kop = Op::Kernel {
                            name: kernel.to_string(),
                            base: Box::new(op.clone()),
                        };
                        let kk = lit(&vocab.op(&kop));
                        let (d, r) = (dtype_lit(dtype), rank.to_string());
                        let args = vars(arity);
                        w.rule(
                            "lower",
                            &format!("{kernel}-{}-{dtype}-r{rank}", op.name()),
                            &format!("(= e {})", term(&lit(key), &args, &d, &r)),
                            &format!("(union e {})", term(&kk, &args, &d, &r)),
                        );
                    }
                }
            }
            LoweringRule::PackOperand {
                kernel,
                consumer,
                operand,
                view,
            } => {
                // Views of weights and constants are packed once at compile time by every
                // backend that cares, so packing them again is no alternative.
                let mut views: Vec<Op> = Vec::new();
                for n in &graph.nodes {
                    let of_data = n.inputs.first().is_some_and(|&i| {
                        matches!(graph.nodes[i].op, Op::Weight { .. } | Op::Constant(_))
                    });
                    if view(&n.op) && !of_data && !views.contains(&n.op) {
                        views.push(n.op.clone());
                    }
                }
                for (key, (op, uses)) in &present {
                    if !consumer(op) {
                        continue;
                    }
                    for &(dtype, rank, arity) in uses {
                        if *operand >= arity {
                            continue;
                        }
                        for v in &views {
                            let vk = lit(&vocab.op(v));
                            let packed = Op::Kernel {
                                name: kernel.to_string(),
                                base: Box::new(v.clone()),
                            };
                            let pk = lit(&vocab.op(&packed));
                            let (d, r) = (dtype_lit(dtype), rank.to_string());
                            let mut q = vars(arity);
                            let mut a = q.clone();
                            q[*operand] = format!("(Op1 {vk} v dv rv)");
                            a[*operand] = format!("(Op1 {pk} v dv rv)");
                            w.rule(
                                "lower",
                                &format!("{kernel}-{}-{}-{dtype}-r{rank}", op.name(), v.name()),
                                &format!("(= e {})", term(&lit(key), &q, &d, &r)),
                                &format!("(union e {})", term(&lit(key), &a, &d, &r)),
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Facts about op keys that generic rules read.
fn key_facts(vocab: &Vocabulary, w: &mut RuleWriter) {
    for (key, op) in &vocab.ops {
        let k = lit(key);
        match op {
            Op::Reshape { shape } => {
                let _ = writeln!(w.text, "(IsReshape {k})");
                let _ = writeln!(w.text, "(ReshapeTo {k} {})", lit(&format_shape(shape)));
            }
            Op::Expand { shape } => {
                let _ = writeln!(w.text, "(IsExpand {k})");
                let _ = writeln!(w.text, "(ExpandTo {k} {})", lit(&format_shape(shape)));
            }
            Op::Unary(_) | Op::Cast { .. } => {
                let _ = writeln!(w.text, "(ElementwiseUnary {k})");
            }
            Op::Binary(_) => {
                let _ = writeln!(w.text, "(ElementwiseBinary {k})");
            }
            _ => {}
        }
    }
}
