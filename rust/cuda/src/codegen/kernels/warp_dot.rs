//! Matrix products with one warp per output element (the optimizer's `cuda.warp_dot`
//! choice beside cuBLASLt): a decode step multiplies one row by each `[N, K]` weight, and
//! a warp's lanes taking every 32nd term of a sum read the weight's rows in whole cache
//! lines, with as many warps in flight as outputs.

use ember_core::dim::{numel, Dim};

use super::super::types::{accumulate_type, store};
use super::{product_term, Body, CodegenError, Generator, StepKind};
use crate::codegen::Launch;

impl Generator<'_> {
    /// The loop over outputs steps a block at a time, so every thread of a block meets
    /// every `ember_warp_reduce` (the emulator's stands in for shuffles with a barrier).
    pub(super) fn warp_dot(&mut self, id: usize) -> Result<StepKind, CodegenError> {
        let g = self.g;
        let n = &g.nodes[id];
        let dtype = n.ty.dtype;
        let acc = accumulate_type(dtype);
        let (a, b) = (n.inputs[0], n.inputs[1]);
        let ash = g.nodes[a].ty.shape.clone();
        let out = n.ty.shape.clone();
        let r = out.len();
        let mut e = self.emitter(None);
        e.line(format!("__shared__ {acc} smem[1024];"));
        e.line(format!("const i64 n = {};", e.dims.product(&out)));
        e.line(format!("const i64 K = {};", e.dim(&ash[r - 1])));
        e.line("const i64 lane = threadIdx.x & 31;");
        e.open("for (i64 base = (i64)blockIdx.x * blockDim.x; base < n * 32; base += (i64)gridDim.x * blockDim.x)");
        e.line("const i64 i = (base + threadIdx.x) >> 5;");
        e.line(format!("{acc} s = 0;"));
        e.open("if (i < n)");
        let oidx = e.unravel("i", &out);
        e.line("#pragma unroll 4");
        e.open("for (i64 k = lane; k < K; k += 32)");
        product_term(&mut e, (a, b), &oidx, acc)?;
        e.close();
        e.close();
        e.line("s = ember_warp_reduce(s, smem, EmberSum());");
        e.line(format!(
            "if (i < n && lane == 0) out[i] = {};",
            store(dtype, "s")
        ));
        e.close();
        let body = Body::of(e, true);
        let threads = numel(&out) * Dim::from(32usize);
        Ok(self.add(id, body, Launch::Elements(threads)))
    }
}
