//! Matrix products with one warp per output element (the optimizer's `cuda.warp_dot`
//! choice beside cuBLASLt): a decode step multiplies one row by each `[N, K]` weight, and
//! a warp's lanes taking every 32nd term of a sum read the weight's rows in whole cache
//! lines, with as many warps in flight as outputs.
//!
//! When both operands lie in memory with the sum's axis contiguous (a row times a
//! transposed weight) and are 16-byte aligned, each lane loads 16 bytes a time (8 bf16):
//! a warp then has 512 bytes of a weight row in flight per step instead of 64, which is
//! what reading weights near the memory's bandwidth takes.

use ember_core::dim::{numel, Dim};
use ember_core::dtype::DType;
use ember_core::ir::Graph;

use super::super::types::accumulate_type;
use super::{product_term, sum_name, write_product, Body, CodegenError, Generator, StepKind};
use crate::codegen::{stored_in_order, Launch};

/// The memory a product's operands are read from in packed steps: `a`'s rows and `b`'s
/// columns are contiguous rows of `K` elements of these nodes.
struct PackedRows {
    a: usize,
    b: usize,
    /// Elements per 16-byte pack, and the prelude's function summing a pack pair.
    per_pack: usize,
    pack_dot: &'static str,
}

impl Generator<'_> {
    /// The loop over outputs steps a block at a time, so every thread of a block meets
    /// every `ember_warp_reduce` (the emulator's stands in for shuffles with a barrier).
    /// `products[1..]` (same shapes as `products[0]`) are summed by the same warps, each
    /// lane's terms of all of them in one loop.
    pub(super) fn warp_dot(
        &mut self,
        products: &[usize],
        epilogue: Option<usize>,
    ) -> Result<StepKind, CodegenError> {
        let g = self.g;
        let id = products[0];
        let n = &g.nodes[id];
        let acc = accumulate_type(n.ty.dtype);
        let ash = g.nodes[n.inputs[0]].ty.shape.clone();
        let out = n.ty.shape.clone();
        let r = out.len();
        // Packed only when every product can be (they share the loop).
        let packed: Option<Vec<PackedRows>> = products
            .iter()
            .map(|&p| packed_rows(g, self.in_memory, p))
            .collect();
        let mut e = self.emitter(epilogue);
        e.line(format!("__shared__ {acc} smem[1024];"));
        e.line(format!("const i64 n = {};", e.dims.product(&out)));
        e.line(format!("const i64 K = {};", e.dim(&ash[r - 1])));
        e.line("const i64 lane = threadIdx.x & 31;");
        if let Some(ps) = &packed {
            let mut addresses = Vec::new();
            for p in ps {
                for node in [p.a, p.b] {
                    addresses.push(format!("(unsigned long long){}", e.param(node)));
                }
            }
            e.line(format!("const i64 N = {};", e.dim(&out[r - 1])));
            e.line(format!("const i64 MN = {};", e.dims.product(&out[r - 2..])));
            // Caller's tensors may start anywhere; the arena and weights are aligned.
            e.line(format!(
                "const bool packed = K % {} == 0 && (({}) & 15) == 0;",
                ps[0].per_pack,
                addresses.join(" | ")
            ));
        }
        e.open("for (i64 base = (i64)blockIdx.x * blockDim.x; base < n * 32; base += (i64)gridDim.x * blockDim.x)");
        e.line("const i64 i = (base + threadIdx.x) >> 5;");
        for k in 0..products.len() {
            e.line(format!("{acc} {} = 0;", sum_name(k)));
        }
        e.open("if (i < n)");
        if let Some(ps) = &packed {
            e.open("if (packed)");
            // Output `i` is row `i / N` of `a` (batch and row) times row `(batch, i % N)`
            // of `b`'s memory.
            let mut terms = Vec::new();
            for (k, p) in ps.iter().enumerate() {
                let (pa, pb) = (e.param(p.a), e.param(p.b));
                e.line(format!(
                    "const ember_pack* ra{k} = (const ember_pack*)({pa} + (i / N) * K);"
                ));
                e.line(format!(
                    "const ember_pack* rb{k} = (const ember_pack*)({pb} + ((i / MN) * N + i % N) * K);"
                ));
                terms.push(format!(
                    "{} += {}(ra{k}[k], rb{k}[k]);",
                    sum_name(k),
                    p.pack_dot
                ));
            }
            e.line("#pragma unroll 4");
            e.line(format!(
                "for (i64 k = lane; k < K / {}; k += 32) {{ {} }}",
                ps[0].per_pack,
                terms.join(" ")
            ));
            e.close();
            e.open("else");
        }
        let oidx = e.unravel("i", &out);
        e.line("#pragma unroll 4");
        e.open("for (i64 k = lane; k < K; k += 32)");
        for (k, &p) in products.iter().enumerate() {
            let pn = &g.nodes[p];
            product_term(
                &mut e,
                (pn.inputs[0], pn.inputs[1]),
                &oidx,
                acc,
                &sum_name(k),
            )?;
        }
        e.close();
        if packed.is_some() {
            e.close();
        }
        e.close();
        for k in 0..products.len() {
            let s = sum_name(k);
            e.line(format!("{s} = ember_warp_reduce({s}, smem, EmberSum());"));
        }
        e.open("if (i < n && lane == 0)");
        write_product(&mut e, products, epilogue)?;
        e.close();
        e.close();
        let body = Body::of(e, true);
        let threads = numel(&out) * Dim::from(32usize);
        Ok(self.add(epilogue.unwrap_or(id), body, Launch::Elements(threads)))
    }
}

/// Whether product `id` can sum packed rows: `a` is (through order-keeping views) a node
/// in memory, `b` the transpose of one (a `[.., N, K]` weight), batch dims equal, and the
/// dtype has a pack sum.
fn packed_rows(g: &Graph, in_memory: &[bool], id: usize) -> Option<PackedRows> {
    let n = &g.nodes[id];
    let (per_pack, pack_dot) = match n.ty.dtype {
        DType::BF16 => (8, "ember_pack_dot_bf16"),
        DType::F16 => (8, "ember_pack_dot_f16"),
        DType::F32 => (4, "ember_pack_dot_f32"),
        _ => return None,
    };
    let (a, b) = (n.inputs[0], n.inputs[1]);
    let (ash, bsh) = (&g.nodes[a].ty.shape, &g.nodes[b].ty.shape);
    let r = ash.len();
    if bsh[..r - 2] != ash[..r - 2] || !super::super::swaps_last_two(&g.nodes[b].op) {
        return None;
    }
    Some(PackedRows {
        a: stored_in_order(g, a, |x| in_memory[x])?,
        b: stored_in_order(g, g.nodes[b].inputs[0], |x| in_memory[x])?,
        per_pack,
        pack_dot,
    })
}
