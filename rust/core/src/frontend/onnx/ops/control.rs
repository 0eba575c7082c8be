//! Control flow: If, Loop and Scan. The IR has no control flow, so these are unrolled while
//! translating. An If whose condition is known takes one branch; one decided at run time
//! computes both and selects. Loop and Scan translate their body once per iteration, which
//! needs the iteration count at compile time (a known trip count or sequence length; a loop
//! condition that stays known). Known values flow through the iterations, so a body's shape
//! arithmetic on the iteration number folds.

use super::Handler;
use crate::dim::{format_shape, Dim};
use crate::dtype::DType;
use crate::error::Result;
use crate::frontend::builder::{norm_axis, Operand};
use crate::frontend::onnx::known::Known;
use crate::frontend::onnx::node::Node;
use crate::frontend::onnx::proto::GraphProto;
use crate::frontend::onnx::translate::{Ctx, Val};
use crate::ir::{BinaryOp, Op, ValueId};

/// Iterations Ember unrolls at most.
const MAX_ITERATIONS: i64 = 4096;
/// IR nodes one unrolled Loop or Scan may add at most: beyond this, compiling the unrolled
/// graph would take longer than a user would wait.
const MAX_UNROLLED_NODES: usize = 100_000;

pub fn handler(op: &str) -> Option<Handler> {
    Some(match op {
        "If" => if_,
        "Loop" => loop_,
        "Scan" => scan,
        _ => return None,
    })
}

/// The ops whose subgraphs Ember translates.
pub fn reads_subgraphs(op: &str) -> bool {
    matches!(op, "If" | "Loop" | "Scan")
}

/// A single bool known at compile time (a condition), if `v` is one.
fn known_flag(ctx: &Ctx, v: &Val) -> Option<bool> {
    let k = ctx.known_of(v)?;
    match k.consts()?.as_slice() {
        [c] => Some(*c != 0),
        _ => None,
    }
}

/// A one-element bool tensor decided at run time, as a 0-d IR value.
fn runtime_flag(ctx: &mut Ctx, n: &Node, v: &Val, what: &str) -> Result<ValueId> {
    let id = ctx.id_of(v)?;
    let ty = ctx.b.ty(id).clone();
    let one_element = ty.shape.iter().all(|d| d.as_const() == Some(1));
    if ty.dtype != DType::Bool || !one_element {
        return Err(n.err(format!(
            "its {what} must be a bool tensor of one element, got {}{}",
            ty.dtype,
            format_shape(&ty.shape)
        )));
    }
    ctx.b.reshape(id, vec![])
}

fn if_(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let then_branch = n.graph("then_branch")?;
    let else_branch = n.graph("else_branch")?;
    let cond = ctx.val(n.input(0).ok_or_else(|| n.err("input 0 is missing"))?)?;
    if let Some(c) = known_flag(ctx, &cond) {
        let (g, label) = if c {
            (then_branch, "then_branch")
        } else {
            (else_branch, "else_branch")
        };
        return ctx.subgraph(g, vec![], n, label);
    }
    // Both branches run and the condition selects: ONNX branches have no side effects, so
    // this gives the taken branch's values, as long as both give the same shapes.
    let cond = runtime_flag(ctx, n, &cond, "condition")?;
    let a = ctx.subgraph(then_branch, vec![], n, "then_branch")?;
    let b = ctx.subgraph(else_branch, vec![], n, "else_branch")?;
    if a.len() != b.len() {
        return Err(n.err(format!(
            "its branches give {} and {} outputs",
            a.len(),
            b.len()
        )));
    }
    let mut out = Vec::with_capacity(a.len());
    for (k, (a, b)) in a.iter().zip(&b).enumerate() {
        let (a, b) = (ctx.id_of(a)?, ctx.id_of(b)?);
        same_type(ctx, n, a, b, &format!("output {k} of its branches"))?;
        out.push(Val::of(ctx.b.where_(
            cond,
            Operand::Tensor(a),
            Operand::Tensor(b),
        )?));
    }
    Ok(out)
}

/// `a` and `b` must have one dtype and provably equal shapes for a select between them.
fn same_type(ctx: &Ctx, n: &Node, a: ValueId, b: ValueId, what: &str) -> Result<()> {
    let (ta, tb) = (ctx.b.ty(a), ctx.b.ty(b));
    let same_shape = ta.shape.len() == tb.shape.len()
        && ta
            .shape
            .iter()
            .zip(&tb.shape)
            .all(|(x, y)| x.provably_equal(y) == Some(true));
    if ta.dtype != tb.dtype || !same_shape {
        return Err(n.unsupported(format!(
            "its condition is computed at run time and {what} differ ({}{} and {}{}); \
             Ember computes both and selects, which needs one type",
            ta.dtype,
            format_shape(&ta.shape),
            tb.dtype,
            format_shape(&tb.shape)
        )));
    }
    Ok(())
}

/// The known constant of input `k`, or an error saying why the count must be known.
fn known_count(ctx: &Ctx, n: &Node, k: usize, what: &str) -> Result<i64> {
    let v = ctx.known_required(n, k, what)?;
    match v.consts().as_deref() {
        Some([c]) => Ok(*c),
        Some(_) => Err(n.err(format!("its {what} must have one element"))),
        None => Err(n.unsupported(format!(
            "its {what} depends on a symbolic size; Ember unrolls loops and needs it constant"
        ))),
    }
}

/// Refuses a loop that would unroll into more iterations or IR nodes than Ember compiles.
fn check_unroll(ctx: &Ctx, n: &Node, iteration: i64, nodes_before: usize) -> Result<()> {
    if iteration >= MAX_ITERATIONS {
        return Err(n.unsupported(format!(
            "it runs more than {MAX_ITERATIONS} iterations; Ember unrolls loops"
        )));
    }
    if ctx.b.g.nodes.len() - nodes_before > MAX_UNROLLED_NODES {
        return Err(n.unsupported(format!(
            "unrolled, it has more than {MAX_UNROLLED_NODES} IR nodes after {iteration} iterations"
        )));
    }
    Ok(())
}

/// `slices` (each of one shape) stacked along a new `axis`.
fn stack(ctx: &mut Ctx, n: &Node, slices: &[ValueId], axis: i64) -> Result<ValueId> {
    let shape = ctx.b.shape(slices[0]);
    let axis = norm_axis(axis, shape.len() + 1, &n.name)?;
    let mut wider = shape.clone();
    wider.insert(axis, Dim::Const(1));
    let parts = slices
        .iter()
        .map(|&s| ctx.b.reshape(s, wider.clone()))
        .collect::<Result<Vec<_>>>()?;
    if parts.len() == 1 {
        return Ok(parts[0]);
    }
    ctx.b.op(Op::Concat { axis }, &parts)
}

/// Loop: `M` (trip count), `cond`, then the loop-carried values. The body maps
/// `(iteration, cond, carried…)` to `(cond, carried…, scan outputs…)`; scan outputs are
/// stacked along a new first axis.
fn loop_(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let body = n.graph("body")?;
    let trip = match n.input(0) {
        Some(_) => Some(known_count(ctx, n, 0, "trip count M")?),
        None => None,
    };
    let carried_count = n.num_inputs().saturating_sub(2);
    let scan_count = body
        .output
        .len()
        .checked_sub(1 + carried_count)
        .ok_or_else(|| {
            n.err(format!(
                "its body gives {} outputs for {carried_count} loop-carried values",
                body.output.len()
            ))
        })?;
    let mut carried = (2..n.num_inputs())
        .map(|k| match n.input(k) {
            Some(name) => ctx.val(name),
            None => Err(n.err(format!("loop-carried input {k} is missing"))),
        })
        .collect::<Result<Vec<_>>>()?;
    let cond = match n.input(1) {
        Some(name) => ctx.val(name)?,
        None => Val::known(Known::scalar(DType::Bool, Dim::Const(1))),
    };
    // The condition stays a compile-time flag while it is known; once it is decided at
    // run time, later iterations run masked (they keep the values when it is false).
    let mut flag = Flag::of(ctx, n, &cond)?;
    let nodes_before = ctx.b.g.nodes.len();
    let mut scans: Vec<Vec<ValueId>> = vec![Vec::new(); scan_count];
    let mut i = 0;
    loop {
        if trip.is_some_and(|m| i >= m) || matches!(flag, Flag::Known(false)) {
            break;
        }
        if trip.is_none() && matches!(flag, Flag::Runtime(_)) {
            return Err(n.unsupported(
                "it has no trip count and its condition is computed at run time; Ember \
                 unrolls loops and needs to know when one ends",
            ));
        }
        check_unroll(ctx, n, i, nodes_before)?;
        let mut inputs = vec![
            Val::known(Known::scalar(DType::I64, Dim::Const(i))),
            flag.val(),
        ];
        inputs.extend(carried.iter().cloned());
        let outs = ctx.subgraph(body, inputs, n, &format!("body[{i}]"))?;
        let next = outs[1..1 + carried_count].to_vec();
        match flag {
            Flag::Known(_) => carried = next,
            Flag::Runtime(active) => {
                if scan_count > 0 {
                    return Err(n.unsupported(
                        "its condition is computed at run time and it has scan outputs, \
                         whose length then depends on values",
                    ));
                }
                for (k, (old, new)) in carried.iter_mut().zip(next).enumerate() {
                    let (o, v) = (ctx.id_of(old)?, ctx.id_of(&new)?);
                    same_type(
                        ctx,
                        n,
                        v,
                        o,
                        &format!("loop-carried value {k} and its update"),
                    )?;
                    *old = Val::of(
                        ctx.b
                            .where_(active, Operand::Tensor(v), Operand::Tensor(o))?,
                    );
                }
            }
        }
        for (k, s) in outs[1 + carried_count..].iter().enumerate() {
            let id = ctx.id_of(s)?;
            scans[k].push(id);
        }
        flag = flag.and(ctx, n, &outs[0])?;
        i += 1;
    }
    if scan_count > 0 && i == 0 {
        return Err(n.unsupported(
            "it runs no iteration and has scan outputs, whose shape Ember cannot tell",
        ));
    }
    let mut out = carried;
    for s in &scans {
        out.push(Val::of(stack(ctx, n, s, 0)?));
    }
    Ok(out)
}

/// A loop condition: known while translating, or decided at run time (a 0-d bool).
#[derive(Clone, Copy)]
enum Flag {
    Known(bool),
    Runtime(ValueId),
}

impl Flag {
    fn of(ctx: &mut Ctx, n: &Node, v: &Val) -> Result<Flag> {
        Ok(match known_flag(ctx, v) {
            Some(c) => Flag::Known(c),
            None => Flag::Runtime(runtime_flag(ctx, n, v, "condition")?),
        })
    }

    fn val(self) -> Val {
        match self {
            Flag::Known(c) => Val::known(Known::scalar(DType::Bool, Dim::Const(c as i64))),
            Flag::Runtime(id) => Val::of(id),
        }
    }

    /// The condition for the next iteration: this one's, and the body's.
    fn and(self, ctx: &mut Ctx, n: &Node, body_cond: &Val) -> Result<Flag> {
        if let Some(c) = known_flag(ctx, body_cond) {
            return Ok(match (self, c) {
                (_, false) => Flag::Known(false),
                (f, true) => f,
            });
        }
        let c = runtime_flag(ctx, n, body_cond, "body's condition output")?;
        Ok(match self {
            Flag::Known(_) => Flag::Runtime(c),
            Flag::Runtime(active) => Flag::Runtime(ctx.b.binary_in(
                BinaryOp::And,
                Operand::Tensor(active),
                Operand::Tensor(c),
                DType::Bool,
            )?),
        })
    }
}

/// The axes attribute `name` (one per tensor, default 0), each normalized for its rank.
fn scan_axes(n: &Node, name: &str, ranks: &[usize]) -> Result<Vec<usize>> {
    let given = n.ints(name)?.unwrap_or_else(|| vec![0; ranks.len()]);
    if given.len() != ranks.len() {
        return Err(n.err(format!(
            "attribute '{name}' has {} entries for {} tensors",
            given.len(),
            ranks.len()
        )));
    }
    given
        .iter()
        .zip(ranks)
        .map(|(&a, &r)| norm_axis(a, r, &n.name))
        .collect()
}

/// The directions attribute `name` (0 forward, 1 reverse; default forward).
fn scan_directions(n: &Node, name: &str, count: usize) -> Result<Vec<bool>> {
    let given = n.ints(name)?.unwrap_or_else(|| vec![0; count]);
    if given.len() != count {
        return Err(n.err(format!(
            "attribute '{name}' has {} entries for {count} tensors",
            given.len()
        )));
    }
    given
        .iter()
        .map(|&d| match d {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(n.err(format!("attribute '{name}' must hold 0 or 1, got {d}"))),
        })
        .collect()
}

/// Scan: state values, then `num_scan_inputs` tensors sliced along their scan axes. The
/// body maps `(state…, slices…)` to `(state…, output slices…)`; the output slices are
/// stacked along the scan output axes.
fn scan(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let body: &GraphProto = n.graph("body")?;
    if !n.has_attr("num_scan_inputs") {
        return Err(n.err("attribute 'num_scan_inputs' is missing"));
    }
    let scan_inputs = usize::try_from(n.int("num_scan_inputs", 0)?)
        .ok()
        .filter(|&m| (1..=n.num_inputs()).contains(&m))
        .ok_or_else(|| n.err("num_scan_inputs must be between 1 and the number of inputs"))?;
    let state_count = n.num_inputs() - scan_inputs;
    let outputs = body.output.len().checked_sub(state_count).ok_or_else(|| {
        n.err(format!(
            "its body gives {} outputs for {state_count} state values",
            body.output.len()
        ))
    })?;
    let mut state = (0..state_count)
        .map(|k| ctx.val(n.input(k).unwrap_or("")))
        .collect::<Result<Vec<_>>>()?;
    let xs = (state_count..n.num_inputs())
        .map(|k| ctx.input(n, k))
        .collect::<Result<Vec<_>>>()?;
    let ranks: Vec<usize> = xs.iter().map(|&x| ctx.b.rank(x)).collect();
    let in_axes = scan_axes(n, "scan_input_axes", &ranks)?;
    let in_reverse = scan_directions(n, "scan_input_directions", scan_inputs)?;
    let out_reverse = scan_directions(n, "scan_output_directions", outputs)?;

    let mut length = None;
    for (&x, &axis) in xs.iter().zip(&in_axes) {
        let d = ctx.b.shape(x)[axis].clone();
        let Some(l) = d.as_const() else {
            return Err(n.unsupported(format!(
                "its sequence length {d} is symbolic; Ember unrolls scans and needs it constant"
            )));
        };
        if length.is_some_and(|len| len != l) {
            return Err(n.err("its scan inputs have different sequence lengths"));
        }
        length = Some(l);
    }
    let length = length.expect("at least one scan input");
    if length == 0 && outputs > 0 {
        return Err(
            n.unsupported("its sequence is empty, so the shape of its scan outputs is unknown")
        );
    }

    let nodes_before = ctx.b.g.nodes.len();
    let mut slices: Vec<Vec<ValueId>> = vec![Vec::new(); outputs];
    for t in 0..length {
        check_unroll(ctx, n, t, nodes_before)?;
        let mut inputs = state.clone();
        for ((&x, &axis), &reverse) in xs.iter().zip(&in_axes).zip(&in_reverse) {
            let at = if reverse { length - 1 - t } else { t };
            let s = ctx
                .b
                .slice(x, axis, Dim::Const(at), Dim::Const(at + 1), 1)?;
            let mut shape = ctx.b.shape(s);
            shape.remove(axis);
            inputs.push(Val::of(ctx.b.reshape(s, shape)?));
        }
        let outs = ctx.subgraph(body, inputs, n, &format!("body[{t}]"))?;
        state = outs[..state_count].to_vec();
        for (k, s) in outs[state_count..].iter().enumerate() {
            let id = ctx.id_of(s)?;
            slices[k].push(id);
        }
    }
    let out_ranks: Vec<usize> = slices.iter().map(|s| ctx.b.rank(s[0]) + 1).collect();
    let out_axes = scan_axes(n, "scan_output_axes", &out_ranks)?;
    let mut out = state;
    for ((mut s, axis), reverse) in slices.into_iter().zip(out_axes).zip(out_reverse) {
        if reverse {
            s.reverse();
        }
        out.push(Val::of(stack(ctx, n, &s, axis as i64)?));
    }
    Ok(out)
}
