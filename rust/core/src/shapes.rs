//! Concrete shapes for a call: binds the graph's symbols from the actual input shapes, then
//! evaluates every node's shape. Shared by the interpreter and every backend, so that all of
//! them accept and reject exactly the same inputs.

use crate::dim::{eval_shape, format_shape, Dim, SymbolBindings};
use crate::error::{Error, Result};
use crate::ir::{Graph, Op};

/// The symbol values and the concrete shape of every node for one call.
#[derive(Clone, Debug)]
pub struct Resolved {
    pub env: SymbolBindings,
    pub shapes: Vec<Vec<usize>>,
}

impl Resolved {
    /// Evaluates a dim attribute (slice bounds) of a node.
    pub fn dim(&self, d: &Dim) -> Result<i64> {
        d.eval(&self.env)
    }
}

/// Concrete shape of every node for one set of input shapes.
pub fn resolve(graph: &Graph, input_shapes: &[Vec<usize>]) -> Result<Resolved> {
    if input_shapes.len() != graph.inputs.len() {
        return Err(Error::Input(format!(
            "expected {} inputs, got {}",
            graph.inputs.len(),
            input_shapes.len()
        )));
    }
    let env = bind_symbols(graph, input_shapes)?;
    let mut shapes = Vec::with_capacity(graph.nodes.len());
    for node in &graph.nodes {
        let shape = eval_shape(&node.ty.shape, &env)
            .map_err(|e| Error::Shape(format!("{e} at node '{}'", node.origin)))?;
        shapes.push(shape);
    }
    check_consistency(graph, &shapes, &env)?;
    Ok(Resolved { env, shapes })
}

/// Symbols are bound from input dims that are a bare symbol; every input dim is then
/// checked against its (possibly composite) declared size.
fn bind_symbols(graph: &Graph, input_shapes: &[Vec<usize>]) -> Result<SymbolBindings> {
    let mut env = SymbolBindings::new();
    for (k, (&id, shape)) in graph.inputs.iter().zip(input_shapes).enumerate() {
        let declared = &graph.nodes[id].ty.shape;
        if declared.len() != shape.len() {
            return Err(Error::Input(format!(
                "input {k} ('{}') should have shape {}, got {shape:?}",
                graph.nodes[id].origin,
                format_shape(declared)
            )));
        }
        for (d, &actual) in declared.iter().zip(shape) {
            if let Dim::Sym(s) = d {
                match env.get(s) {
                    Some(&prev) if prev != actual as i64 => {
                        return Err(Error::Input(format!(
                            "input {k} ('{}'): dim '{s}' is {actual} here but {prev} elsewhere",
                            graph.nodes[id].origin
                        )))
                    }
                    _ => {
                        env.insert(s.clone(), actual as i64);
                    }
                }
            }
        }
    }
    for (name, range) in &graph.symbols {
        if let Some(&v) = env.get(name) {
            if v < range.min || range.max.is_some_and(|m| v > m) {
                return Err(Error::Input(format!(
                    "dim '{name}' = {v} is outside its allowed range [{}, {}]",
                    range.min,
                    range.max.map_or("inf".to_string(), |m| m.to_string())
                )));
            }
        }
    }
    for (k, (&id, shape)) in graph.inputs.iter().zip(input_shapes).enumerate() {
        let declared = &graph.nodes[id].ty.shape;
        let want = eval_shape(declared, &env)?;
        if &want != shape {
            return Err(Error::Input(format!(
                "input {k} ('{}') should have shape {want:?}, got {shape:?}",
                graph.nodes[id].origin
            )));
        }
    }
    Ok(env)
}

/// Run-time half of the type checker: constraints that were symbolic at compile time.
fn check_consistency(graph: &Graph, shapes: &[Vec<usize>], env: &SymbolBindings) -> Result<()> {
    for (id, node) in graph.nodes.iter().enumerate() {
        let ins: Vec<&Vec<usize>> = node.inputs.iter().map(|&i| &shapes[i]).collect();
        let out = &shapes[id];
        // A malformed (unverified) graph must give an error here, never an index panic.
        let op = node.op.semantics();
        let arity_ok = match op {
            Op::Binary(_) | Op::Dot | Op::IntegerDot => ins.len() == 2,
            Op::Where => ins.len() == 3,
            Op::Reshape { .. } | Op::Expand { .. } | Op::Slice { .. } => ins.len() == 1,
            _ => true,
        };
        let ok = arity_ok
            && match op {
                Op::Binary(_) => ins[0] == ins[1] && ins[0] == out,
                Op::Where => ins[0] == ins[1] && ins[1] == ins[2],
                Op::Reshape { .. } => {
                    ins[0].iter().product::<usize>() == out.iter().product::<usize>()
                }
                Op::Expand { .. } => ins[0].iter().zip(out).all(|(&a, &b)| a == b || a == 1),
                Op::Dot | Op::IntegerDot => {
                    let r = out.len();
                    r >= 2
                        && ins[0].len() == r
                        && ins[1].len() == r
                        && ins[0][..r - 2] == ins[1][..r - 2]
                        && ins[0][r - 1] == ins[1][r - 2]
                }
                Op::BlockQuantDot { .. } => {
                    ins.len() == 4
                        && ins[0].len() == 2
                        && ins[1].len() == 2
                        && out[..] == [ins[0][0], ins[1][0]]
                }
                Op::CacheAppend { axis, .. } => {
                    ins.len() == 3
                        && ins[0].len() == out.len()
                        && ins[1].len() == out.len()
                        && *axis < out.len()
                        && (0..out.len())
                            .all(|d| d == *axis || (ins[0][d] == out[d] && ins[1][d] == out[d]))
                        && ins[2][..] == [out[0]]
                }
                // Every shape attention reads, so that no kernel indexes past an operand
                // (symbolic dims the compiler assumed equal are checked here, per call).
                Op::Attention { has_mask, .. } => {
                    let r = ins.first().map_or(0, |q| q.len());
                    ins.len() == 3 + *has_mask as usize
                        && r >= 2
                        && ins.iter().all(|x| x.len() == r)
                        && ins[0][..r - 2] == ins[1][..r - 2]
                        && ins[1][..r - 1] == ins[2][..r - 1]
                        && ins[0][r - 1] == ins[1][r - 1]
                        && (!*has_mask
                            || (ins[3][..r - 1] == ins[0][..r - 1]
                                && ins[3][r - 1] == ins[1][r - 2]))
                }
                Op::Slice {
                    axis, start, end, ..
                } => {
                    let Some(&n) = ins[0].get(*axis) else {
                        return Err(Error::Shape(format!(
                            "slice axis {axis} at '{}'",
                            node.origin
                        )));
                    };
                    let n = n as i64;
                    let (s, e) = (start.eval(env)?, end.eval(env)?);
                    0 <= s && s <= e && e <= n
                }
                _ => true,
            };
        if !ok {
            let shown: Vec<String> = ins.iter().map(|s| format!("{s:?}")).collect();
            return Err(Error::Shape(format!(
                "{} at node '{}' got incompatible shapes {} (output {out:?})",
                node.op.name(),
                node.origin,
                shown.join(", ")
            )));
        }
    }
    Ok(())
}
