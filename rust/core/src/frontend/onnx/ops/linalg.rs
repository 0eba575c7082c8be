//! Matrix products: MatMul (numpy broadcasting), Gemm and Einsum, all lowered to the IR's
//! one batched contraction `Dot` plus permutes, reshapes and sums.

use std::collections::BTreeMap;

use super::{one, quant, Handler};
use crate::dim::{numel, Dim};
use crate::dtype::Scalar;
use crate::error::Result;
use crate::frontend::builder::{Builder, Operand};
use crate::frontend::onnx::node::Node;
use crate::frontend::onnx::translate::{Ctx, Val};
use crate::ir::{BinaryOp, Op, ReduceOp, ValueId};

pub fn handler(op: &str) -> Option<Handler> {
    Some(match op {
        "MatMul" => matmul_node,
        "Gemm" => gemm,
        "Einsum" => einsum,
        _ => return None,
    })
}

fn matmul_node(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let a = ctx.input(n, 0)?;
    let b = ctx.input(n, 1)?;
    super::elementwise::same_dtype(ctx, n, &[a, b])?;
    if let Some(y) = quant::dequantized_product(ctx, a, b)? {
        return one(y);
    }
    one(matmul(&mut ctx.b, n, a, b)?)
}

/// numpy `matmul` (`Builder::matmul`, shared with the PT2 frontend).
fn matmul(b: &mut Builder, _n: &Node, x: ValueId, y: ValueId) -> Result<ValueId> {
    b.matmul(x, y)
}

/// `alpha · A' · B' + beta · C` with optional transposes and a broadcast C.
fn gemm(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let mut a = ctx.input(n, 0)?;
    let mut b = ctx.input(n, 1)?;
    let dtype = super::elementwise::same_dtype(ctx, n, &[a, b])?;
    if ctx.b.rank(a) != 2 || ctx.b.rank(b) != 2 {
        return Err(n.err("A and B must be 2-D"));
    }
    if n.flag("transA", false)? {
        let t = ctx.b.permute(a, vec![1, 0])?;
        quant::note_transpose(ctx, a, t)?;
        a = t;
    }
    if n.flag("transB", false)? {
        let t = ctx.b.permute(b, vec![1, 0])?;
        quant::note_transpose(ctx, b, t)?;
        b = t;
    }
    let mut y = match quant::dequantized_product(ctx, a, b)? {
        Some(y) => y,
        None => matmul(&mut ctx.b, n, a, b)?,
    };
    let alpha = n.float("alpha", 1.0)?;
    if alpha != 1.0 {
        y = ctx.b.binary_in(
            BinaryOp::Mul,
            Operand::Scalar(Scalar::Float(alpha as f64)),
            Operand::Tensor(y),
            dtype,
        )?;
    }
    let Some(c) = ctx.opt_input(n, 2)? else {
        return one(y);
    };
    let beta = n.float("beta", 1.0)?;
    if beta == 0.0 {
        return one(y);
    }
    let c = if beta != 1.0 {
        ctx.b.binary_in(
            BinaryOp::Mul,
            Operand::Scalar(Scalar::Float(beta as f64)),
            Operand::Tensor(c),
            dtype,
        )?
    } else {
        c
    };
    one(ctx
        .b
        .binary_in(BinaryOp::Add, Operand::Tensor(y), Operand::Tensor(c), dtype)?)
}

/// One operand during an einsum: its value and the label of each axis.
struct Term {
    v: ValueId,
    labels: Vec<char>,
}

/// Splits `"ij,jk->ik"` into per-operand labels and the output labels; `...` becomes
/// digit labels aligned from the right (digits are not valid einsum letters).
fn parse_equation(n: &Node, eq: &str, ranks: &[usize]) -> Result<(Vec<Vec<char>>, Vec<char>)> {
    let eq: String = eq.chars().filter(|c| !c.is_whitespace()).collect();
    let (lhs, rhs) = match eq.split_once("->") {
        Some((l, r)) => (l.to_owned(), Some(r.to_owned())),
        None => (eq.clone(), None),
    };
    let terms: Vec<&str> = lhs.split(',').collect();
    if terms.len() != ranks.len() {
        return Err(n.err(format!(
            "equation '{eq}' has {} operands but the node has {}",
            terms.len(),
            ranks.len()
        )));
    }
    let bad = |t: &str| t.chars().any(|c| !(c.is_ascii_alphabetic() || c == '.'));
    let mut ell_rank = 0;
    for (t, &r) in terms.iter().zip(ranks) {
        if bad(t) {
            return Err(n.err(format!("invalid einsum term '{t}'")));
        }
        if t.contains("...") {
            let letters = t.replace("...", "").len();
            if letters > r {
                return Err(n.err(format!("term '{t}' has more labels than rank {r}")));
            }
            ell_rank = ell_rank.max(r - letters);
        }
    }
    let expand = |t: &str, r: usize| -> Result<Vec<char>> {
        let letters = t.replace("...", "");
        let mut out = Vec::new();
        match t.split_once("...") {
            Some((before, after)) => {
                let e = r.saturating_sub(letters.len());
                out.extend(before.chars());
                out.extend((ell_rank - e..ell_rank).map(|i| (b'0' + i as u8) as char));
                out.extend(after.chars());
            }
            None => out.extend(t.chars()),
        }
        if out.contains(&'.') || out.len() != r {
            return Err(n.err(format!(
                "einsum term '{t}' does not match an operand of rank {r}"
            )));
        }
        Ok(out)
    };
    let inputs = terms
        .iter()
        .zip(ranks)
        .map(|(t, &r)| expand(t, r))
        .collect::<Result<Vec<_>>>()?;
    let output = match rhs {
        Some(r) => {
            if bad(&r) {
                return Err(n.err(format!("invalid einsum output '{r}'")));
            }
            expand(
                &r,
                r.replace("...", "").len() + if r.contains("...") { ell_rank } else { 0 },
            )?
        }
        None => {
            // Implicit output: the ellipsis dims, then labels seen once, alphabetically.
            let mut counts: BTreeMap<char, usize> = BTreeMap::new();
            inputs
                .iter()
                .flatten()
                .for_each(|&c| *counts.entry(c).or_default() += 1);
            let mut out: Vec<char> = (0..ell_rank).map(|i| (b'0' + i as u8) as char).collect();
            out.extend(
                counts
                    .iter()
                    .filter(|(c, &k)| k == 1 && c.is_ascii_alphabetic())
                    .map(|(&c, _)| c),
            );
            out
        }
    };
    Ok((inputs, output))
}

fn einsum(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let eq = n.string("equation", "")?;
    let ids = n
        .inputs()
        .iter()
        .map(|name| ctx.value(name))
        .collect::<Result<Vec<_>>>()?;
    if ids.is_empty() {
        return Err(n.err("needs at least one input"));
    }
    super::elementwise::same_dtype(ctx, n, &ids)?;
    let ranks: Vec<usize> = ids.iter().map(|&v| ctx.b.rank(v)).collect();
    let (labels, output) = parse_equation(n, &eq, &ranks)?;
    // An operand that repeats a label contributes its diagonal over those axes.
    let mut ids = ids;
    let mut labels = labels;
    for (v, l) in ids.iter_mut().zip(labels.iter_mut()) {
        (*v, *l) = diagonal(ctx, n, *v, l)?;
    }
    // The size of each label: a 1 broadcasts against a larger size.
    let mut sizes: BTreeMap<char, Dim> = BTreeMap::new();
    for (&v, l) in ids.iter().zip(&labels) {
        for (c, d) in l.iter().zip(ctx.b.shape(v)) {
            let e = sizes.entry(*c).or_insert(d.clone());
            if e.as_const() == Some(1) {
                *e = d;
            }
        }
    }
    if let Some(c) = output.iter().find(|c| !sizes.contains_key(c)) {
        return Err(n.err(format!("output label '{c}' appears in no operand")));
    }
    let mut terms: Vec<Term> = ids
        .iter()
        .zip(labels)
        .map(|(&v, labels)| Term { v, labels })
        .collect();
    while terms.len() > 1 {
        let b = terms.remove(1);
        let a = terms.remove(0);
        let mut needed: Vec<char> = output.clone();
        terms.iter().for_each(|t| needed.extend(&t.labels));
        let t = contract(ctx, a, b, &needed, &sizes)?;
        terms.insert(0, t);
    }
    let t = terms.pop().expect("one term left");
    let t = sum_out(ctx, t, &output)?;
    let perm = output
        .iter()
        .map(|c| t.labels.iter().position(|x| x == c).expect("kept"))
        .collect();
    one(ctx.b.permute(t.v, perm)?)
}

/// The diagonal of `v` over the axes that share a label (`ii -> i`), its labels then each
/// label once: those axes move last and merge, and a strided slice picks the elements whose
/// indices agree (for `m` axes of size `s`, every `1 + s + … + s^(m-1)`-th).
fn diagonal(ctx: &mut Ctx, n: &Node, v: ValueId, labels: &[char]) -> Result<(ValueId, Vec<char>)> {
    let (mut v, mut labels) = (v, labels.to_vec());
    while let Some(c) = labels
        .iter()
        .copied()
        .find(|c| labels.iter().filter(|x| *x == c).count() > 1)
    {
        let shape = ctx.b.shape(v);
        let (same, others): (Vec<usize>, Vec<usize>) =
            (0..labels.len()).partition(|&i| labels[i] == c);
        let size = shape[same[0]].as_const().ok_or_else(|| {
            n.unsupported(format!(
                "label '{c}' repeats over a symbolic size {}; a diagonal needs a constant one",
                shape[same[0]]
            ))
        })?;
        if same.iter().any(|&i| shape[i].as_const() != Some(size)) {
            return Err(n.err(format!("label '{c}' repeats over axes of different sizes")));
        }
        let perm: Vec<usize> = others.iter().chain(&same).copied().collect();
        let moved = ctx.b.permute(v, perm)?;
        let m = same.len() as u32;
        let total = size
            .checked_pow(m)
            .ok_or_else(|| n.err(format!("the diagonal over label '{c}' is too large")))?;
        let step = if size <= 1 {
            1
        } else {
            (total - 1) / (size - 1)
        };
        let mut merged: Vec<Dim> = others.iter().map(|&i| shape[i].clone()).collect();
        merged.push(Dim::Const(total));
        let flat = ctx.b.reshape(moved, merged)?;
        let axis = others.len();
        v = ctx
            .b
            .slice(flat, axis, Dim::Const(0), Dim::Const(total), step)?;
        labels = others.iter().map(|&i| labels[i]).collect();
        labels.push(c);
    }
    Ok((v, labels))
}

/// Sums over the labels of `t` that `keep` does not mention.
fn sum_out(ctx: &mut Ctx, t: Term, keep: &[char]) -> Result<Term> {
    let axes: Vec<usize> = (0..t.labels.len())
        .filter(|&i| !keep.contains(&t.labels[i]))
        .collect();
    if axes.is_empty() {
        return Ok(t);
    }
    let v = ctx.b.op(
        Op::Reduce {
            op: ReduceOp::Sum,
            axes: axes.clone(),
            keepdim: false,
        },
        &[t.v],
    )?;
    let labels = (0..t.labels.len())
        .filter(|i| !axes.contains(i))
        .map(|i| t.labels[i])
        .collect();
    Ok(Term { v, labels })
}

/// Contracts two operands with one `Dot`: `[batch, M, K] x [batch, K, N]`.
fn contract(
    ctx: &mut Ctx,
    a: Term,
    b: Term,
    needed: &[char],
    sizes: &BTreeMap<char, Dim>,
) -> Result<Term> {
    let mut keep_a: Vec<char> = needed.to_vec();
    keep_a.extend(&b.labels);
    let mut keep_b: Vec<char> = needed.to_vec();
    keep_b.extend(&a.labels);
    let a = sum_out(ctx, a, &keep_a)?;
    let b = sum_out(ctx, b, &keep_b)?;
    let in_b = |c: &char| b.labels.contains(c);
    let batch: Vec<char> = a
        .labels
        .iter()
        .filter(|c| in_b(c) && needed.contains(c))
        .copied()
        .collect();
    let inner: Vec<char> = a
        .labels
        .iter()
        .filter(|c| in_b(c) && !needed.contains(c))
        .copied()
        .collect();
    let m: Vec<char> = a.labels.iter().filter(|c| !in_b(c)).copied().collect();
    let nn: Vec<char> = b
        .labels
        .iter()
        .filter(|c| !a.labels.contains(c))
        .copied()
        .collect();
    let dims = |cs: &[char]| -> Vec<Dim> { cs.iter().map(|c| sizes[c].clone()).collect() };
    let arrange = |ctx: &mut Ctx, t: &Term, order: &[char], shape: Vec<Dim>| -> Result<ValueId> {
        let perm: Vec<usize> = order
            .iter()
            .map(|c| t.labels.iter().position(|x| x == c).expect("label present"))
            .collect();
        let v = ctx.b.permute(t.v, perm)?;
        // Broadcast size-1 dims (ellipsis broadcasting) before folding axes together.
        let v = ctx.b.broadcast_to(v, &dims(order))?;
        ctx.b.reshape(v, shape)
    };
    let mut a_order = batch.clone();
    a_order.extend(&m);
    a_order.extend(&inner);
    let mut a_shape = dims(&batch);
    a_shape.extend([numel(&dims(&m)), numel(&dims(&inner))]);
    let mut b_order = batch.clone();
    b_order.extend(&inner);
    b_order.extend(&nn);
    let mut b_shape = dims(&batch);
    b_shape.extend([numel(&dims(&inner)), numel(&dims(&nn))]);
    let av = arrange(ctx, &a, &a_order, a_shape)?;
    let bv = arrange(ctx, &b, &b_order, b_shape)?;
    let d = ctx.b.op(Op::Dot, &[av, bv])?;
    let mut labels = batch.clone();
    labels.extend(&m);
    labels.extend(&nn);
    let v = ctx.b.reshape(d, dims(&labels))?;
    Ok(Term { v, labels })
}
