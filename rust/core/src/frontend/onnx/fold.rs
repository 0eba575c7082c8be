//! Values an op needs at compile time (a Reshape's shape, Pad's pads) that exporters compute
//! from constants by a route `known` does not follow: float arithmetic (`Ceil(Div(…))` cast
//! back to integers), or a detour through 2-d tensors (torch writes Pad's pads as
//! reshape → reverse slice → transpose). When every value behind such a tensor is a
//! constant, the reference interpreter evaluates that part of the graph while translating.

use crate::backend::Weights;
use crate::dim::Dim;
use crate::interp::{self, Data};
use crate::ir::{Graph, Op, ValueId};

use super::known::Known;

/// Nodes one evaluation may run at most (shape arithmetic is small).
const MAX_NODES: usize = 512;
/// Elements any value on the way may have at most.
const MAX_ELEMS: usize = 4096;

/// The values of integer (or bool) tensor `id` of at most one dim, when everything it is
/// computed from is a constant: no input, no weight, no symbolic size.
pub fn constant_value(g: &Graph, id: ValueId) -> Option<Known> {
    let out = &g.nodes[id].ty;
    if !(out.dtype.is_int() || out.dtype == crate::dtype::DType::Bool) || out.shape.len() > 1 {
        return None;
    }
    // The nodes `id` depends on, each once; ids ascend in topological order. Known values
    // are asked for on many nodes, so this gives up early: at the first input, weight or
    // large value, and past `MAX_NODES`.
    let mut seen = std::collections::HashSet::from([id]);
    let mut stack = vec![id];
    while let Some(v) = stack.pop() {
        let node = &g.nodes[v];
        let numel: Option<i64> = node.ty.shape.iter().map(Dim::as_const).product();
        if matches!(node.op, Op::Input { .. } | Op::Weight { .. })
            || numel.is_none_or(|n| n as usize > MAX_ELEMS)
        {
            return None;
        }
        for &i in &node.inputs {
            if seen.insert(i) {
                if seen.len() > MAX_NODES {
                    return None;
                }
                stack.push(i);
            }
        }
    }
    let mut needed: Vec<ValueId> = seen.into_iter().collect();
    needed.sort_unstable();
    let mut sub = Graph::new();
    let mut map = std::collections::HashMap::new();
    for &v in &needed {
        let node = &g.nodes[v];
        let inputs: Vec<ValueId> = node.inputs.iter().map(|i| map[i]).collect();
        let new = if inputs.is_empty() {
            sub.add_source(node.op.clone(), node.ty.clone(), &node.origin)
        } else {
            sub.add(node.op.clone(), &inputs, &node.origin)
        }
        .ok()?;
        map.insert(v, new);
    }
    sub.outputs.push(map[&id]);
    let value = interp::run(&sub, &Weights::new(), &[]).ok()?.pop()?;
    let Data::I(values) = value.data else {
        return None;
    };
    Some(Known {
        dtype: value.dtype,
        scalar: value.shape.is_empty(),
        dims: values.into_iter().map(Dim::Const).collect(),
    })
}
