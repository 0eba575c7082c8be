//! Matrix products with one warp per output element (the optimizer's `cuda.warp_dot`
//! choice beside cuBLASLt): a decode step multiplies one row by each `[N, K]` weight, and
//! a warp's lanes taking every 32nd term of a sum read the weight's rows in whole cache
//! lines, with as many warps in flight as outputs.
//!
//! When both operands lie in memory with the sum's axis contiguous (a row times a
//! transposed weight) and are 16-byte aligned, each lane loads 16 bytes a time (8 bf16):
//! a warp then has 512 bytes of a weight row in flight per step instead of 64, which is
//! what reading weights near the memory's bandwidth takes.
//!
//! Where the rows are an RMS norm no other op reads (`folded_norm.rs`), each warp first
//! sums the squares of its row of the norm's input, then normalizes each value as it
//! multiplies it: the norm takes no launch of its own.

use ember_core::dim::{numel, Dim};
use ember_core::dtype::DType;
use ember_core::ir::Graph;

use super::super::emit::Emitter;
use super::super::folded_norm::{folded_norm, FoldedNorm};
use super::super::types::{accumulate_type, load, store};
use super::product::product_term;
use super::{sum_name, write_product, Body, CodegenError, Generator, StepKind};
use crate::codegen::{stored_in_order, Launch};

/// The memory a product's operands are read from in packed steps: `a`'s rows and `b`'s
/// columns are contiguous rows of `K` elements of these nodes. Where `a` is a norm the
/// product computes (`norm`), `a` here is the norm's input.
struct PackedRows {
    a: usize,
    b: usize,
    /// Elements per 16-byte pack, and the prelude's suffix of its pack functions for the
    /// dtype (`ember_pack_dot_bf16`, …).
    per_pack: usize,
    suffix: &'static str,
    norm: Option<FoldedNorm>,
}

impl PackedRows {
    /// The 16-byte-aligned addresses its packed loads need.
    fn addresses(&self, e: &mut Emitter<'_>) -> Vec<String> {
        let mut nodes = vec![self.a, self.b];
        nodes.extend(self.norm.and_then(|f| f.w));
        nodes
            .into_iter()
            .map(|n| format!("(unsigned long long){}", e.param(n)))
            .collect()
    }

    /// `sum += ` the packed terms of rows `ra`, `rb` at pack `k` (`rstd`: its norm's).
    fn term(&self, e: &mut Emitter<'_>, sum: &str, ra: &str, rb: &str, rstd: &str) -> String {
        let suffix = self.suffix;
        match self.norm {
            None => format!("{sum} += ember_pack_dot_{suffix}({ra}[k], {rb}[k]);"),
            Some(f) => {
                let w = match f.w {
                    Some(w) => format!("((const ember_pack*){})[k], ", e.param(w)),
                    None => format!("{ra}[k], "),
                };
                format!(
                    "{sum} += ember_pack_norm_dot_{suffix}({ra}[k], {w}{rb}[k], {rstd}, {}, {});",
                    f.w.is_some(),
                    f.rounds_before_weight
                )
            }
        }
    }
}

/// The norms (`FoldedNorm`) a kernel's products compute, each once: its scale is
/// `rstd{j}` for the `j`-th.
struct Norms(Vec<FoldedNorm>);

impl Norms {
    fn of(g: &Graph, in_memory: &[bool], products: &[usize]) -> Norms {
        let mut found: Vec<FoldedNorm> = Vec::new();
        for &p in products {
            if let Some(f) = folded_norm(g, in_memory, g.nodes[p].inputs[0]) {
                if found.iter().all(|h| h.norm != f.norm) {
                    found.push(f);
                }
            }
        }
        Norms(found)
    }

    /// Product `p`'s norm and its scale variable, if its rows are one.
    fn scale_of(&self, g: &Graph, in_memory: &[bool], p: usize) -> Option<(FoldedNorm, String)> {
        let f = folded_norm(g, in_memory, g.nodes[p].inputs[0])?;
        let j = self.0.iter().position(|h| h.norm == f.norm)?;
        Some((f, format!("rstd{j}")))
    }

    /// Declares each norm's `rstd{j}` for the row `row` (meaningful where `active`): the
    /// warp's lanes sum the squares of the row's values, packed where the input's address
    /// allows, and every thread of the block meets the reduction (outside any branch).
    fn emit_scales(
        &self,
        e: &mut Emitter<'_>,
        active: &str,
        row: &str,
    ) -> Result<(), CodegenError> {
        for (j, f) in self.0.iter().enumerate() {
            let x = e.param(f.x);
            let (per_pack, suffix) = pack_of(f.dtype).ok_or_else(|| {
                CodegenError::new(e.g, f.norm, "internal: a folded norm of a non-float dtype")
            })?;
            e.line(format!("float q{j} = 0;"));
            e.open(format!("if ({active})"));
            e.line(format!("const auto* xr = {x} + ({row}) * K;"));
            e.open(format!(
                "if (K % {per_pack} == 0 && ((unsigned long long){x} & 15) == 0)"
            ));
            e.line(format!(
                "for (i64 k = lane; k < K / {per_pack}; k += 32) q{j} += ember_pack_sumsq_{suffix}(((const ember_pack*)xr)[k]);"
            ));
            e.close();
            e.open("else");
            let v = load(f.dtype, "xr[k]");
            e.line(format!(
                "for (i64 k = lane; k < K; k += 32) {{ const float v = {v}; q{j} += v * v; }}"
            ));
            e.close();
            e.close();
            e.line(format!("q{j} = ember_warp_reduce(q{j}, smem, EmberSum());"));
            e.line(format!(
                "const float rstd{j} = ember_rsqrt(q{j} / (float)K + (float){:e});",
                f.eps
            ));
        }
        Ok(())
    }
}

/// Elements per 16-byte pack and the prelude's suffix of the pack functions for `dtype`.
fn pack_of(dtype: DType) -> Option<(usize, &'static str)> {
    match dtype {
        DType::BF16 => Some((8, "bf16")),
        DType::F16 => Some((8, "f16")),
        DType::F32 => Some((4, "f32")),
        _ => None,
    }
}

/// `sum += a · b` for product `p` at output `out_idx` and the emitted `k`, one element at
/// a time; where `a` is a norm the product computes (scale `rstd`), its value is the
/// input's element of row `row` normalized as the norm's kernel stores it.
fn scalar_term(
    e: &mut Emitter<'_>,
    p: usize,
    out_idx: &[String],
    acc: &str,
    sum: &str,
    norm: Option<(FoldedNorm, &str, &str)>,
) -> Result<(), CodegenError> {
    let n = &e.g.nodes[p];
    let (a, b) = (n.inputs[0], n.inputs[1]);
    let Some((f, rstd, row)) = norm else {
        return product_term(e, (a, b), out_idx, acc, sum);
    };
    let r = out_idx.len();
    let mut bi = out_idx[..r - 2].to_vec();
    bi.push("k".into());
    bi.push(out_idx[r - 1].clone());
    let bv = e.value(b, &bi)?;
    let x = e.param(f.x);
    let round = |v: &str| load(f.dtype, &store(f.dtype, v));
    let mut v = format!(
        "{} * {rstd}",
        load(f.dtype, &format!("{x}[({row}) * K + k]"))
    );
    if f.rounds_before_weight {
        v = round(&v);
    }
    if let Some(w) = f.w {
        let w = e.param(w);
        v = format!("({v}) * {}", load(f.dtype, &format!("{w}[k]")));
    }
    e.line(format!("{sum} += ({acc}){} * ({acc}){bv};", round(&v)));
    Ok(())
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
        let norms = Norms::of(g, self.in_memory, products);
        let mut e = self.emitter(epilogue);
        e.line(format!("__shared__ {acc} smem[1024];"));
        e.line(format!("const i64 n = {};", e.dims.product(&out)));
        e.line(format!("const i64 K = {};", e.dim(&ash[r - 1])));
        e.line("const i64 lane = threadIdx.x & 31;");
        if packed.is_some() || !norms.0.is_empty() {
            e.line(format!("const i64 N = {};", e.dim(&out[r - 1])));
        }
        if let Some(ps) = &packed {
            let addresses: Vec<String> = ps.iter().flat_map(|p| p.addresses(&mut e)).collect();
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
        // Output `i` is row `i / N` of `a` (batch and row) times row `(batch, i % N)` of
        // `b`'s memory.
        norms.emit_scales(&mut e, "i < n", "i / N")?;
        let scales: Vec<Option<(FoldedNorm, String)>> = products
            .iter()
            .map(|&p| norms.scale_of(g, self.in_memory, p))
            .collect();
        for k in 0..products.len() {
            e.line(format!("{acc} {} = 0;", sum_name(k)));
        }
        e.open("if (i < n)");
        if let Some(ps) = &packed {
            e.open("if (packed)");
            let mut terms = Vec::new();
            for (k, p) in ps.iter().enumerate() {
                let (pa, pb) = (e.param(p.a), e.param(p.b));
                e.line(format!(
                    "const ember_pack* ra{k} = (const ember_pack*)({pa} + (i / N) * K);"
                ));
                e.line(format!(
                    "const ember_pack* rb{k} = (const ember_pack*)({pb} + ((i / MN) * N + i % N) * K);"
                ));
                let rstd = scales[k].as_ref().map_or("", |(_, s)| s.as_str());
                terms.push(p.term(
                    &mut e,
                    &sum_name(k),
                    &format!("ra{k}"),
                    &format!("rb{k}"),
                    rstd,
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
            let with = scales[k].as_ref().map(|(f, s)| (*f, s.as_str(), "i / N"));
            scalar_term(&mut e, p, &oidx, acc, &sum_name(k), with)?;
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
        // Members read the same rows: a norm they compute is the same one for all.
        let norms = Norms::of(g, self.in_memory, members);
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
            e.line(format!("const i64 N{j} = {};", e.dim(&out[out.len() - 1])));
            start = format!("end{j}");
            let p = packed_rows(g, self.in_memory, m);
            let cond = match &p {
                Some(p) => format!(
                    "K % {} == 0 && (({}) & 15) == 0",
                    p.per_pack,
                    p.addresses(&mut e).join(" | ")
                ),
                None => "false".into(),
            };
            e.line(format!("const bool packed{j} = {cond};"));
            packed.push(p);
        }
        e.line(format!("const i64 n = {start};"));
        e.open("for (i64 base = (i64)blockIdx.x * blockDim.x; base < n * 32; base += (i64)gridDim.x * blockDim.x)");
        e.line("const i64 i = (base + threadIdx.x) >> 5;");
        if !norms.0.is_empty() {
            // The row of `a` output `i` reads (-1 past the last member).
            e.line("i64 row = -1;");
            for j in 0..members.len() {
                e.line(format!("{} row = (i - start{j}) / N{j};", member_branch(j)));
            }
            norms.emit_scales(&mut e, "row >= 0", "row")?;
        }
        e.line(format!("{acc} s = 0;"));
        for (j, &m) in members.iter().enumerate() {
            e.open(member_branch(j));
            e.line(format!("const i64 li = i - start{j};"));
            let out = g.nodes[m].ty.shape.clone();
            let r = out.len();
            let rstd = norms.scale_of(g, self.in_memory, m);
            if let Some(p) = &packed[j] {
                let (pa, pb) = (e.param(p.a), e.param(p.b));
                e.open(format!("if (packed{j})"));
                e.line(format!("const i64 N = N{j};"));
                e.line(format!("const i64 MN = {};", e.dims.product(&out[r - 2..])));
                e.line(format!(
                    "const ember_pack* ra = (const ember_pack*)({pa} + (li / N) * K);"
                ));
                e.line(format!(
                    "const ember_pack* rb = (const ember_pack*)({pb} + ((li / MN) * N + li % N) * K);"
                ));
                let scale = rstd.as_ref().map_or("", |(_, s)| s.as_str());
                let term = p.term(&mut e, "s", "ra", "rb", scale);
                e.line("#pragma unroll 4");
                e.line(format!(
                    "for (i64 k = lane; k < K / {}; k += 32) {{ {term} }}",
                    p.per_pack
                ));
                e.close();
                e.open("else");
            }
            let oidx = e.unravel("li", &out);
            e.line("#pragma unroll 4");
            e.open("for (i64 k = lane; k < K; k += 32)");
            let with = rstd.as_ref().map(|(f, s)| (*f, s.as_str(), "row"));
            scalar_term(&mut e, m, &oidx, acc, "s", with)?;
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
/// in memory or a norm of one computed in place, `b` the transpose of one (a `[.., N, K]` weight), batch dims equal, and the
/// dtype has a pack sum.
fn packed_rows(g: &Graph, in_memory: &[bool], id: usize) -> Option<PackedRows> {
    let n = &g.nodes[id];
    let (per_pack, suffix) = pack_of(n.ty.dtype)?;
    let (a, b) = (n.inputs[0], n.inputs[1]);
    let (ash, bsh) = (&g.nodes[a].ty.shape, &g.nodes[b].ty.shape);
    let r = ash.len();
    if bsh[..r - 2] != ash[..r - 2] || !super::super::swaps_last_two(&g.nodes[b].op) {
        return None;
    }
    let norm = folded_norm(g, in_memory, a);
    let a = match norm {
        Some(f) => f.x,
        None => stored_in_order(g, a, |x| in_memory[x])?,
    };
    Some(PackedRows {
        a,
        b: stored_in_order(g, g.nodes[b].inputs[0], |x| in_memory[x])?,
        per_pack,
        suffix,
        norm,
    })
}
