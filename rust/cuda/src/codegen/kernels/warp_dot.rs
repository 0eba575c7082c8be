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

use super::super::types::{accumulate_type, store};
use super::{product_terms, sum_name, write_product, Body, CodegenError, Generator, StepKind};
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
        product_terms(&mut e, products, &oidx, acc)?;
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

impl Generator<'_> {
    /// Products of one input (same rows and sum length, different widths: a decode step's
    /// q, k and v) in one launch: output `i` of the step is the first member's while
    /// `i < n0`, the second's while `i < n0 + n1`, and so on; each member is written as it
    /// would be alone (`out`, `out1`, …). A warp's outputs all belong to one member, so the
    /// member branch is uniform across the warp; the reduction sits outside the branches so
    /// every thread of a block meets it (the emulator's is a block barrier).
    pub fn grouped_warp_dot(&mut self, members: &[usize]) -> Result<StepKind, CodegenError> {
        let g = self.g;
        let first = &g.nodes[members[0]];
        let acc = accumulate_type(first.ty.dtype);
        let ash = g.nodes[first.inputs[0]].ty.shape.clone();
        let mut e = self.emitter(None);
        e.line(format!("__shared__ {acc} smem[1024];"));
        e.line(format!("const i64 K = {};", e.dim(&ash[ash.len() - 1])));
        e.line("const i64 lane = threadIdx.x & 31;");
        let mut start = "0LL".to_string();
        let mut packed = Vec::new();
        for (j, &m) in members.iter().enumerate() {
            let out = g.nodes[m].ty.shape.clone();
            e.line(format!("const i64 start{j} = {start};"));
            e.line(format!(
                "const i64 end{j} = start{j} + {};",
                e.dims.product(&out)
            ));
            start = format!("end{j}");
            let p = packed_rows(g, self.in_memory, m);
            let cond = match &p {
                Some(p) => format!(
                    "K % {} == 0 && (((unsigned long long){} | (unsigned long long){}) & 15) == 0",
                    p.per_pack,
                    e.param(p.a),
                    e.param(p.b)
                ),
                None => "false".into(),
            };
            e.line(format!("const bool packed{j} = {cond};"));
            packed.push(p);
        }
        e.line(format!("const i64 n = {start};"));
        e.open("for (i64 base = (i64)blockIdx.x * blockDim.x; base < n * 32; base += (i64)gridDim.x * blockDim.x)");
        e.line("const i64 i = (base + threadIdx.x) >> 5;");
        e.line(format!("{acc} s = 0;"));
        for (j, &m) in members.iter().enumerate() {
            e.open(member_branch(j));
            e.line(format!("const i64 li = i - start{j};"));
            let out = g.nodes[m].ty.shape.clone();
            let r = out.len();
            if let Some(p) = &packed[j] {
                let (pa, pb) = (e.param(p.a), e.param(p.b));
                e.open(format!("if (packed{j})"));
                e.line(format!("const i64 N = {};", e.dim(&out[r - 1])));
                e.line(format!("const i64 MN = {};", e.dims.product(&out[r - 2..])));
                e.line(format!(
                    "const ember_pack* ra = (const ember_pack*)({pa} + (li / N) * K);"
                ));
                e.line(format!(
                    "const ember_pack* rb = (const ember_pack*)({pb} + ((li / MN) * N + li % N) * K);"
                ));
                e.line("#pragma unroll 4");
                e.line(format!(
                    "for (i64 k = lane; k < K / {}; k += 32) s += {}(ra[k], rb[k]);",
                    p.per_pack, p.pack_dot
                ));
                e.close();
                e.open("else");
            }
            let oidx = e.unravel("li", &out);
            e.line("#pragma unroll 4");
            e.open("for (i64 k = lane; k < K; k += 32)");
            product_terms(&mut e, &[m], &oidx, acc)?;
            e.close();
            if packed[j].is_some() {
                e.close();
            }
            e.close();
        }
        e.line("s = ember_warp_reduce(s, smem, EmberSum());");
        e.open("if (lane == 0)");
        for (j, &m) in members.iter().enumerate() {
            let out = if j == 0 {
                "out".into()
            } else {
                format!("out{j}")
            };
            let dtype = g.nodes[m].ty.dtype;
            e.line(format!(
                "{} {out}[i - start{j}] = {};",
                member_branch(j),
                store(dtype, "s")
            ));
        }
        e.close();
        e.close();
        let body = Body {
            also_writes: members[1..].to_vec(),
            ..Body::of(e, true)
        };
        let outputs = members[1..].iter().fold(numel(&first.ty.shape), |n, &m| {
            n + numel(&g.nodes[m].ty.shape)
        });
        let threads = outputs * Dim::from(32usize);
        Ok(self.add(members[0], body, Launch::Elements(threads)))
    }
}

/// The test selecting member `j` of a group by the output index `i`.
fn member_branch(j: usize) -> String {
    match j {
        0 => "if (i < end0)".into(),
        j => format!("else if (i < end{j})"),
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
