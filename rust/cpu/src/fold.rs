//! Compile-time evaluation of the parts of a graph that read only weights and constants
//! (a batch norm folded into a conv's weight and bias, a transposed conv's rearranged
//! weight): each such result a run-time node reads becomes a `Constant`, computed once by
//! the reference interpreter (f64, rounded once to the node's dtype), and nodes no output
//! needs any more are dropped.

use std::sync::Arc;

use ember_core::backend::{Weights, MAX_FOLDED_ELEMS};
use ember_core::dim::Dim;
use ember_core::interp;
use ember_core::ir::{ConstData, Graph, Node, Op, ValueId};

/// A backend kernel's base op (what it computes), any other op itself.
fn base(op: &Op) -> &Op {
    match op {
        Op::Kernel { base, .. } => base,
        other => other,
    }
}

fn is_source(op: &Op) -> bool {
    matches!(
        op,
        Op::Weight { .. } | Op::Constant(_) | Op::Full { .. } | Op::Iota { .. }
    )
}

/// The graph with weight-only results folded into constants and dead nodes removed; the
/// graph unchanged when there is nothing to fold or the folding fails (the same error then
/// surfaces, with its node, when the program runs).
pub fn fold_weights(graph: &Graph, weights: &Weights) -> Graph {
    let n = graph.nodes.len();
    let static_shape = |node: &Node| node.ty.shape.iter().all(|d| d.as_const().is_some());
    // Known at compile time, and (`computed`) worth folding: some arithmetic, not only a
    // view of a weight (views are free, and `permute` of a weight is pre-packed anyway).
    let mut known = vec![false; n];
    let mut computed = vec![false; n];
    for (id, node) in graph.nodes.iter().enumerate() {
        let inputs_known = node.inputs.iter().all(|&i| known[i]);
        known[id] = static_shape(node)
            && !matches!(node.op, Op::Input { .. })
            && (is_source(&node.op) || (!node.inputs.is_empty() && inputs_known));
        computed[id] = known[id]
            && !is_source(&node.op)
            && (!node.op.is_view() || node.inputs.iter().any(|&i| computed[i]));
    }
    let small = |id: ValueId| {
        graph.nodes[id]
            .ty
            .shape
            .iter()
            .filter_map(Dim::as_const)
            .product::<i64>()
            <= MAX_FOLDED_ELEMS
    };
    // A product's weight operand reached through views other than one transpose (a
    // direction of a recurrent layer's stacked weights: slice, reshape, transpose) is folded
    // too: the packing of weight operands sees only weights, constants and their transposes,
    // and an unpacked operand made each step of an LSTM ~8× slower.
    let plain_operand = |i: ValueId| {
        let node = &graph.nodes[i];
        is_source(&node.op)
            || matches!(base(&node.op), Op::Permute { .. })
                && node.inputs.iter().all(|&s| is_source(&graph.nodes[s].op))
    };
    let product = |op: &Op| matches!(base(op), Op::Dot | Op::IntegerDot | Op::Conv { .. });
    // Fold the computed values that a run-time node or an output reads.
    let mut fold = vec![false; n];
    for (id, node) in graph.nodes.iter().enumerate() {
        if known[id] {
            continue;
        }
        for &i in &node.inputs {
            let view_operand = product(&node.op) && known[i] && !plain_operand(i);
            if (computed[i] || view_operand) && small(i) {
                fold[i] = true;
            }
        }
    }
    for &o in &graph.outputs {
        if computed[o] && small(o) {
            fold[o] = true;
        }
    }
    let targets: Vec<ValueId> = (0..n).filter(|&i| fold[i]).collect();
    if targets.is_empty() {
        return prune(graph);
    }
    let Ok(values) = evaluate(graph, &known, &targets, weights) else {
        return prune(graph);
    };
    let mut g = graph.clone();
    for (&id, v) in targets.iter().zip(values) {
        let node = &mut g.nodes[id];
        node.op = Op::Constant(ConstData {
            shape: v.shape.clone(),
            bytes: Arc::new(v.to_bytes()),
        });
        node.inputs.clear();
    }
    prune(&g)
}

/// Runs the compile-time part of the graph with `targets` as its outputs.
fn evaluate(
    graph: &Graph,
    known: &[bool],
    targets: &[ValueId],
    weights: &Weights,
) -> ember_core::Result<Vec<interp::Value>> {
    let mut sub = Graph::new();
    sub.symbols = graph.symbols.clone();
    let mut map = vec![usize::MAX; graph.nodes.len()];
    for (id, node) in graph.nodes.iter().enumerate() {
        if known[id] {
            let mut copy = node.clone();
            copy.inputs = node.inputs.iter().map(|&i| map[i]).collect();
            sub.nodes.push(copy);
            map[id] = sub.nodes.len() - 1;
        }
    }
    sub.outputs = targets.iter().map(|&t| map[t]).collect();
    interp::run(&prune(&sub), weights, &[])
}

/// The graph without the nodes no output needs (input nodes always stay: they number the
/// caller's arguments).
pub fn prune(graph: &Graph) -> Graph {
    let n = graph.nodes.len();
    let mut live = vec![false; n];
    for &o in &graph.outputs {
        live[o] = true;
    }
    for id in (0..n).rev() {
        if live[id] || matches!(graph.nodes[id].op, Op::Input { .. }) {
            live[id] = true;
            for &i in &graph.nodes[id].inputs {
                live[i] = true;
            }
        }
    }
    if live.iter().all(|&l| l) {
        return graph.clone();
    }
    let mut g = Graph::new();
    g.symbols = graph.symbols.clone();
    let mut map = vec![usize::MAX; n];
    for (id, node) in graph.nodes.iter().enumerate() {
        if live[id] {
            let mut copy = node.clone();
            copy.inputs = node.inputs.iter().map(|&i| map[i]).collect();
            g.nodes.push(copy);
            map[id] = g.nodes.len() - 1;
        }
    }
    g.inputs = graph.inputs.iter().map(|&i| map[i]).collect();
    g.outputs = graph.outputs.iter().map(|&o| map[o]).collect();
    g
}
