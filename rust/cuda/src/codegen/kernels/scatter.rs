//! Scatter: a copy of the destination, then a thread per update (reductions by atomics);
//! and the check of every index a program reads before it updates a caller's tensor in
//! place (`index_precheck`).

use std::collections::BTreeSet;

use ember_core::dim::{numel, Dim, DimOp};
use ember_core::dtype::Kind;
use ember_core::ir::{Op, ScatterReduce};

use super::super::emit::Emitter;
use super::super::types::{storage_type, store};
use super::super::{CodegenError, Launch, StepKind};
use super::{err, Body, Generator, GRID_STRIDE};

impl Generator<'_> {
    /// `Scatter` in two launches on the same output: a copy of the input, then one thread
    /// per update (atomic when updates combine). With `gated`, the updates are written only
    /// while no index check has failed (`meta[0] == 0`): a scatter that may write straight
    /// into its input (`KernelProgram::in_place`) leaves the caller's tensor as it was when
    /// the run fails.
    pub fn scatter_steps(&mut self, id: usize, gated: bool) -> Result<Vec<StepKind>, CodegenError> {
        let copy = self.scatter_copy(id)?;
        let write = self.scatter_writes(&[id], gated)?;
        Ok(vec![copy, write])
    }

    /// A scatter's first launch: its output = its input.
    pub fn scatter_copy(&mut self, id: usize) -> Result<StepKind, CodegenError> {
        let g = self.g;
        let n = &g.nodes[id];
        let Op::Scatter { axis: _, reduce } = n.op else {
            return Err(err(g, id, "internal: not a scatter"));
        };
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
        let mut e = self.emitter(None);
        e.line(format!("const i64 n = {};", e.dims.product(&shape)));
        e.open(GRID_STRIDE);
        let idx = e.unravel("i", &shape);
        let v = e.value(n.inputs[0], &idx)?;
        e.line(format!("out[i] = {};", store(dtype, &v)));
        e.close();
        let copy = Body::of(e, false);
        Ok(self.add(id, copy, Launch::Elements(numel(&shape))))
    }

    /// The updates of scatters `members` (each copied into its output before), one thread
    /// per update, in one launch: member `j` writes `out` (`j = 0`) or `out{j}`, its
    /// updates in a grid-stride loop of their own (a static cache's key and value updates
    /// of one layer: one launch, not two). Gated as in [`Self::scatter_steps`].
    pub fn scatter_writes(
        &mut self,
        members: &[usize],
        gated: bool,
    ) -> Result<StepKind, CodegenError> {
        let g = self.g;
        let mut e = self.emitter(None);
        if gated {
            // The check of every index (`index_precheck`) ran before this launch.
            e.line("if (meta[0] != 0) return;");
        }
        let mut most = Dim::from(0usize);
        for (k, &id) in members.iter().enumerate() {
            let n = &g.nodes[id];
            let Op::Scatter { axis, reduce } = n.op else {
                return Err(err(g, id, "internal: not a scatter"));
            };
            let (index, updates) = (n.inputs[1], n.inputs[2]);
            let dtype = n.ty.dtype;
            let shape = n.ty.shape.clone();
            let out = match k {
                0 => "out".to_string(),
                k => format!("out{k}"),
            };
            let ishape = g.nodes[index].ty.shape.clone();
            let (idx, j) = open_index_loop(&mut e, index, &ishape)?;
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
                ScatterReduce::None => e.line(format!("{out}[{off}] = {stored};")),
                r => {
                    let f = match (r, dtype.kind() == Kind::Float) {
                        (ScatterReduce::Add, _) => "EmberSum()",
                        (ScatterReduce::Mul, _) => "EmberProd()",
                        (ScatterReduce::Max, _) => "EmberIMax()",
                        _ => "EmberIMin()",
                    };
                    e.line(format!(
                        "ember_atomic_update<{st}>(&{out}[{off}], {stored}, {f});"
                    ));
                }
            }
            e.close();
            e.close();
            most = Dim::binary(DimOp::Max, most, numel(&ishape));
        }
        let body = Body {
            also_writes: members[1..].to_vec(),
            ..Body::of(e, false)
        };
        Ok(self.add(members[0], body, Launch::Elements(most)))
    }

    /// One launch that checks every index the program reads from tensors (`checked`:
    /// gathers, index selects and scatters), flagging the first out of range in `meta[0]`
    /// as their own kernels would. It runs before a program's first in-place update, so the
    /// updates (gated on the flag) are written all or not at all. The index expressions
    /// read memory written before it, and compute the values in `recompute` (kept in
    /// memory, but written later) from theirs (`generate` checks).
    pub fn index_precheck(
        &mut self,
        checked: &[usize],
        recompute: &BTreeSet<usize>,
        dest: usize,
    ) -> Result<StepKind, CodegenError> {
        let g = self.g;
        let in_memory: Vec<bool> = (self.in_memory.iter().enumerate())
            .map(|(n, &m)| m && !recompute.contains(&n))
            .collect();
        let mut e = Emitter::new(g, &in_memory, None, self.symbols);
        e.indent = 1;
        let mut most = Dim::from(0usize);
        for &id in checked {
            let n = &g.nodes[id];
            let axis = match n.op {
                Op::Gather { axis } | Op::IndexSelect { axis } | Op::Scatter { axis, .. } => axis,
                _ => return Err(err(g, id, "internal: not an indexing op")),
            };
            let (x, index) = (n.inputs[0], n.inputs[1]);
            let ishape = g.nodes[index].ty.shape.clone();
            let (_, j) = open_index_loop(&mut e, index, &ishape)?;
            let len = e.dim(&g.nodes[x].ty.shape[axis]);
            e.line(format!("ember_index(meta, (i64){j}, {len}, {id}LL);"));
            e.close();
            e.close();
            most = Dim::binary(DimOp::Max, most, numel(&ishape));
        }
        let body = Body::of(e, false);
        Ok(self.add(dest, body, Launch::Elements(most)))
    }
}

/// Opens a block and, in it, a grid-stride loop over the elements of `index` (of shape
/// `ishape`): the loop's multi-index and the index value there. What a scatter's updates
/// and the index check both loop over; the caller closes both.
fn open_index_loop(
    e: &mut Emitter<'_>,
    index: usize,
    ishape: &[Dim],
) -> Result<(Vec<String>, String), CodegenError> {
    e.open("");
    e.line(format!("const i64 n = {};", e.dims.product(ishape)));
    e.open(GRID_STRIDE);
    let idx = e.unravel("i", ishape);
    let j = e.value(index, &idx)?;
    Ok((idx, j))
}
