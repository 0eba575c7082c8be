//! Ember's tensor IR: an SSA graph of typed nodes in topological order.

mod infer;
mod op;
mod print;
mod verify;
pub mod window;

use std::collections::BTreeMap;
use std::sync::Arc;

pub use infer::infer_type;
pub use op::{BinaryOp, ConstData, Op, PoolKind, ReduceOp, ScanOp, ScatterReduce, UnaryOp};
pub use verify::verify;

use crate::dim::{Dim, SymbolRange};
use crate::dtype::DType;
use crate::error::Result;

/// Index of a node (and of its single output value) in `Graph::nodes`.
pub type ValueId = usize;

#[derive(Clone, Debug, PartialEq)]
pub struct TensorType {
    pub dtype: DType,
    pub shape: Vec<Dim>,
}

impl TensorType {
    pub fn new(dtype: DType, shape: Vec<Dim>) -> TensorType {
        TensorType { dtype, shape }
    }

    pub fn rank(&self) -> usize {
        self.shape.len()
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub op: Op,
    pub inputs: Vec<ValueId>,
    pub ty: TensorType,
    /// Name of the source node this came from (for error messages and reports).
    pub origin: Arc<str>,
}

/// A whole program: nodes in topological order, the runtime inputs, and the outputs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Graph {
    pub nodes: Vec<Node>,
    /// `Op::Input` nodes, ordered by their `index`.
    pub inputs: Vec<ValueId>,
    pub outputs: Vec<ValueId>,
    pub symbols: BTreeMap<Arc<str>, SymbolRange>,
}

impl Graph {
    pub fn new() -> Graph {
        Graph::default()
    }

    /// Appends a node whose output type the op's type rule computes from its inputs.
    pub fn add(&mut self, op: Op, inputs: &[ValueId], origin: &str) -> Result<ValueId> {
        let input_types: Vec<&TensorType> = inputs.iter().map(|&i| &self.nodes[i].ty).collect();
        let ty = infer_type(&op, &input_types, None).map_err(|e| with_origin(e, &op, origin))?;
        Ok(self.push(op, inputs, ty, origin))
    }

    /// Appends a source node (input, weight, constant, full, iota) of a given type.
    pub fn add_source(&mut self, op: Op, ty: TensorType, origin: &str) -> Result<ValueId> {
        infer_type(&op, &[], Some(&ty)).map_err(|e| with_origin(e, &op, origin))?;
        let is_input = matches!(op, Op::Input { .. });
        let id = self.push(op, &[], ty, origin);
        if is_input {
            self.inputs.push(id);
        }
        Ok(id)
    }

    fn push(&mut self, op: Op, inputs: &[ValueId], ty: TensorType, origin: &str) -> ValueId {
        self.nodes.push(Node {
            op,
            inputs: inputs.to_vec(),
            ty,
            origin: Arc::from(origin),
        });
        self.nodes.len() - 1
    }

    /// Rewrites every dim (node shapes, reshape and expand targets, slice bounds) with
    /// the clamps the symbols' ranges make moot removed (`Dim::simplified`): a slice at a
    /// position below the table's end has its plain length (a decode step's one query
    /// row is 1, not `min(p + 1, n) - min(p, n)`), and dims that are equal look equal.
    pub fn simplify_dims(&mut self) {
        let Graph {
            nodes,
            symbols: ranges,
            ..
        } = self;
        if ranges.is_empty() {
            return;
        }
        let simplify = |shape: &mut Vec<Dim>| {
            for d in shape.iter_mut() {
                *d = d.simplified(ranges);
            }
        };
        for n in nodes.iter_mut() {
            simplify(&mut n.ty.shape);
            let mut op = &mut n.op;
            while let Op::Kernel { base, .. } = op {
                op = &mut **base;
            }
            match op {
                Op::Reshape { shape } | Op::Expand { shape } => simplify(shape),
                Op::Slice { start, end, .. } => {
                    *start = start.simplified(ranges);
                    *end = end.simplified(ranges);
                }
                Op::CacheAppend { len, .. } => *len = len.simplified(ranges),
                _ => {}
            }
        }
    }

    pub fn ty(&self, v: ValueId) -> &TensorType {
        &self.nodes[v].ty
    }

    /// How many nodes use each value (outputs count as uses).
    pub fn use_counts(&self) -> Vec<usize> {
        let mut uses = vec![0; self.nodes.len()];
        for n in &self.nodes {
            for &i in &n.inputs {
                uses[i] += 1;
            }
        }
        for &o in &self.outputs {
            uses[o] += 1;
        }
        uses
    }

    /// Names of the weights the graph reads, with their types.
    pub fn weights(&self) -> Vec<(&str, &TensorType)> {
        self.nodes
            .iter()
            .filter_map(|n| match &n.op {
                Op::Weight { name } => Some((name.as_str(), &n.ty)),
                _ => None,
            })
            .collect()
    }
}

fn with_origin(e: crate::error::Error, op: &Op, origin: &str) -> crate::error::Error {
    use crate::error::Error;
    match e {
        Error::Shape(m) => Error::Shape(format!("{} (op {}, node '{origin}')", m, op.name())),
        Error::Compile(m) => Error::Compile(format!("{} (op {}, node '{origin}')", m, op.name())),
        other => other,
    }
}
