//! The IR's invariants, checked on every graph a frontend builds and after every pass in tests.

use super::{infer_type, Graph, Op, TensorType};
use crate::error::{Error, Result};

/// Checks that the graph is well formed:
/// - every input of a node refers to an earlier node (topological order, no cycles);
/// - every node's recorded type is what its op's type rule computes;
/// - `inputs` lists exactly the `Op::Input` nodes, by index; outputs exist.
pub fn verify(g: &Graph) -> Result<()> {
    let mut input_nodes = Vec::new();
    for (id, node) in g.nodes.iter().enumerate() {
        for &i in &node.inputs {
            if i >= id {
                return Err(Error::Compile(format!(
                    "node {id} ({}) uses %{i}, which does not come before it",
                    node.op.name()
                )));
            }
        }
        let input_types: Vec<&TensorType> = node.inputs.iter().map(|&i| &g.nodes[i].ty).collect();
        let declared = if node.inputs.is_empty() {
            Some(&node.ty)
        } else {
            None
        };
        let ty = infer_type(&node.op, &input_types, declared).map_err(|e| {
            Error::Compile(format!(
                "node {id} ({}, '{}'): {e}",
                node.op.name(),
                node.origin
            ))
        })?;
        if ty.dtype != node.ty.dtype || ty.shape.len() != node.ty.shape.len() {
            return Err(Error::Compile(format!(
                "node {id} ({}) records type {:?} but its rule gives {:?}",
                node.op.name(),
                node.ty,
                ty
            )));
        }
        if let Op::Input { index } = node.op {
            input_nodes.push((index, id));
        }
    }
    input_nodes.sort();
    let ordered: Vec<usize> = input_nodes.iter().map(|&(_, id)| id).collect();
    if ordered != g.inputs
        || input_nodes
            .iter()
            .enumerate()
            .any(|(i, &(idx, _))| i != idx)
    {
        return Err(Error::Compile(format!(
            "graph inputs {:?} do not match its input nodes {:?}",
            g.inputs, input_nodes
        )));
    }
    if let Some(&bad) = g.outputs.iter().find(|&&o| o >= g.nodes.len()) {
        return Err(Error::Compile(format!("output %{bad} does not exist")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dim::Dim;
    use crate::dtype::DType;
    use crate::ir::{BinaryOp, Graph};

    fn input(g: &mut Graph, index: usize, shape: &[i64]) -> usize {
        let ty = TensorType::new(DType::F32, shape.iter().map(|&d| Dim::Const(d)).collect());
        g.add_source(Op::Input { index }, ty, "x").unwrap()
    }

    #[test]
    fn accepts_well_formed_graph() {
        let mut g = Graph::new();
        let a = input(&mut g, 0, &[2, 3]);
        let b = input(&mut g, 1, &[2, 3]);
        let c = g.add(Op::Binary(BinaryOp::Add), &[a, b], "add").unwrap();
        g.outputs.push(c);
        verify(&g).unwrap();
    }

    #[test]
    fn rejects_mismatched_shapes_and_bad_order() {
        let mut g = Graph::new();
        let a = input(&mut g, 0, &[2, 3]);
        let b = input(&mut g, 1, &[3, 2]);
        let err = g
            .add(Op::Binary(BinaryOp::Add), &[a, b], "add")
            .unwrap_err();
        assert!(err.to_string().contains("add"), "{err}");

        let mut g = Graph::new();
        let a = input(&mut g, 0, &[2]);
        let c = g.add(Op::Binary(BinaryOp::Mul), &[a, a], "mul").unwrap();
        g.nodes[c].inputs[1] = c; // a self-loop
        assert!(verify(&g).is_err());
    }

    #[test]
    fn rejects_wrong_recorded_dtype() {
        let mut g = Graph::new();
        let a = input(&mut g, 0, &[4]);
        let c = g.add(Op::Binary(BinaryOp::Lt), &[a, a], "lt").unwrap();
        assert_eq!(g.ty(c).dtype, DType::Bool);
        g.nodes[c].ty.dtype = DType::F32;
        assert!(verify(&g).is_err());
    }
}
