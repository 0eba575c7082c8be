//! Scatter: a copy of the destination, then a thread per update (reductions by atomics).

use ember_core::dim::numel;
use ember_core::dtype::Kind;
use ember_core::ir::{Op, ScatterReduce};

use super::super::types::{storage_type, store};
use super::super::{CodegenError, Launch, StepKind};
use super::{err, Body, Generator, GRID_STRIDE};

impl Generator<'_> {
    /// `Scatter` in two launches on the same output: a copy of the input, then one thread
    /// per update (atomic when updates combine).
    pub fn scatter_steps(&mut self, id: usize) -> Result<Vec<StepKind>, CodegenError> {
        let g = self.g;
        let n = &g.nodes[id];
        let Op::Scatter { axis, reduce } = n.op else {
            return Err(err(g, id, "internal: not a scatter"));
        };
        let (x, index, updates) = (n.inputs[0], n.inputs[1], n.inputs[2]);
        let dtype = n.ty.dtype;
        let shape = n.ty.shape.clone();
        if reduce != ScatterReduce::None && !matches!(dtype.size(), 4 | 8) {
            return Err(err(
                g,
                id,
                format!(
                    "a {reduce:?} scatter of {dtype} (CUDA atomics take 32- and 64-bit values)"
                ),
            ));
        }
        // 1. out = x
        let mut e = self.emitter(None);
        e.line(format!("const i64 n = {};", e.dims.product(&shape)));
        e.open(GRID_STRIDE);
        let idx = e.unravel("i", &shape);
        let v = e.value(x, &idx)?;
        e.line(format!("out[i] = {};", store(dtype, &v)));
        e.close();
        let copy = Body::of(e, false);
        let copy = self.add(id, copy, Launch::Elements(numel(&shape)));
        // 2. one thread per update
        let ishape = g.nodes[index].ty.shape.clone();
        let mut e = self.emitter(None);
        e.line(format!("const i64 n = {};", e.dims.product(&ishape)));
        e.open(GRID_STRIDE);
        let idx = e.unravel("i", &ishape);
        let j = e.value(index, &idx)?;
        let len = e.dim(&shape[axis]);
        e.line(format!(
            "const i64 j = ember_index(meta, (i64){j}, {len}, {id}LL);"
        ));
        let mut at = idx.clone();
        at[axis] = "j".into();
        let off = e.offset(&at, &shape);
        let u = e.value(updates, &idx)?;
        let st = storage_type(dtype);
        let stored = store(dtype, &u);
        match reduce {
            ScatterReduce::None => e.line(format!("out[{off}] = {stored};")),
            r => {
                let f = match (r, dtype.kind() == Kind::Float) {
                    (ScatterReduce::Add, _) => "EmberSum()",
                    (ScatterReduce::Mul, _) => "EmberProd()",
                    (ScatterReduce::Max, _) => "EmberIMax()",
                    _ => "EmberIMin()",
                };
                e.line(format!(
                    "ember_atomic_update<{st}>(&out[{off}], {stored}, {f});"
                ));
            }
        }
        e.close();
        let body = Body::of(e, false);
        let write = self.add(id, body, Launch::Elements(numel(&ishape)));
        Ok(vec![copy, write])
    }
}
