//! Prefill attention on tensor cores (the `cuda.mma_attention` choice), as flash attention
//! 2 computes it: a block takes up to `WARPS × 16` query rows of one (batch, head), each
//! warp 16 rows whose query fragments it holds in registers; the keys go by in tiles of
//! `TILE` staged in shared memory as 16-bit pairs (values transposed, so each fragment
//! register is one 32-bit load). Per tile a warp computes its 16 × `TILE` scores with
//! `mma.m16n8k16` (f32 accumulators), masks and scales them, runs the softmax online (a
//! row's maximum and sum are kept by the four lanes that share it) and adds the tile's
//! probabilities, rounded to the operands' type as flash attention rounds them, times the
//! values with `mma` again — the score accumulators become the next product's operand
//! fragments without leaving registers.
//!
//! Taken for f16 and bf16 with head dims known at compile time, multiples of 16 (queries
//! and keys) and 8 (values), at most `MAX_HEAD_DIM`; the other attention kernels otherwise.

use ember_core::dim::{numel, Dim, DimOp};
use ember_core::dtype::DType;
use ember_core::ir::Graph;

use super::super::types::store;
use super::{inf, AttentionParts, Body, CodegenError, Generator, RowIndex, StepKind};
use crate::codegen::Launch;

/// Keys per shared tile: four 8-key score fragments, two 16-key value products.
const TILE: i64 = 32;
/// Warps of a block that take 16 query rows each; the GPU's launches are 256 threads
/// (`launch_limits`), eight warps; the emulator's may be one.
const WARPS: i64 = 8;
/// Largest head dim: the query fragments (`E / 4` registers a lane) and the value
/// accumulators (`EV / 2` a lane) stay in registers.
const MAX_HEAD_DIM: i64 = 128;
/// Padding (32-bit words) after each shared row, so the eight rows a fragment load reads
/// fall in distinct banks.
const PAD: i64 = 4;

/// Whether the tensor-core kernel computes attention node `id`: f16/bf16, head dims known,
/// multiples of the fragment sizes, and several query rows a head (a decode step's single
/// row takes split attention).
pub fn mma_attention_applies(g: &Graph, id: usize) -> bool {
    let n = &g.nodes[id];
    if !matches!(n.ty.dtype, DType::F16 | DType::BF16) || n.inputs.len() < 3 {
        return false;
    }
    let q = &g.nodes[n.inputs[0]].ty.shape;
    let v = &g.nodes[n.inputs[2]].ty.shape;
    let r = q.len();
    let fits = |d: &Dim, m: i64| {
        d.as_const()
            .is_some_and(|d| d > 0 && d % m == 0 && d <= MAX_HEAD_DIM)
    };
    r >= 2 && fits(&q[r - 1], 16) && fits(&v[r - 1], 8) && !super::super::one_query_row(q)
}

impl Generator<'_> {
    /// The tensor-core kernel for attention node `id`, or `None` where it does not apply.
    pub(super) fn mma_attention(
        &mut self,
        id: usize,
        p: &AttentionParts,
    ) -> Result<Option<StepKind>, CodegenError> {
        let g = self.g;
        if !mma_attention_applies(g, id) {
            return Ok(None);
        }
        let r = p.qs.len();
        let (Some(e_len), Some(ev_len)) = (p.qs[r - 1].as_const(), p.ev_dim.as_const()) else {
            return Ok(None);
        };
        let mma = match p.dtype {
            DType::BF16 => "ember_mma_bf16",
            _ => "ember_mma_f16",
        };
        let neg_inf = format!("-{}", inf("float"));
        let half = |v: &str| store(p.dtype, v);
        // Words a shared row holds: a key row's E values, a value column's TILE keys.
        let (kw, vw) = (e_len / 2 + PAD, TILE / 2 + PAD);
        let (ksteps, vtiles) = (e_len / 16, ev_len / 8);
        let mut e = self.emitter(None);
        e.line("EMBER_WARP_SLOTS(slots);");
        e.line(format!("__shared__ unsigned ksh[{}];", TILE * kw));
        e.line(format!("__shared__ unsigned vsh[{}];", ev_len * vw));
        let batch = &p.qs[..r - 2];
        e.line(format!("const i64 BH = {};", e.dims.product(batch)));
        e.line(format!("const i64 L = {};", e.dim(&p.qs[r - 2])));
        e.line(format!("const i64 S = {};", e.dim(&p.s_dim)));
        e.line(format!("const i64 E = {e_len}, EV = {ev_len};"));
        e.line(format!(
            "const i64 W = ember_imin((i64)blockDim.x >> 5, (i64){WARPS});"
        ));
        e.line("const i64 w = (i64)threadIdx.x >> 5;");
        e.line("const int lane = (int)(threadIdx.x & 31u), gq = lane >> 2, tq = lane & 3;");
        e.line("const i64 R = 16 * W, tiles = (L + R - 1) / R;");
        // Loop bounds are the block's own: every thread meets every barrier.
        e.open("for (i64 blk = blockIdx.x; blk < BH * tiles; blk += gridDim.x)");
        e.line("const i64 bh = blk / tiles, l0 = (blk % tiles) * R, lw = l0 + 16 * w;");
        e.line("const bool busy = w < W;");
        let ri = RowIndex {
            batch: e.unravel("bh", batch),
            query: "l".into(),
        };
        let at = |last2: [&str; 2]| ri.at(last2);

        // The warp's query fragments (zeros past the last row).
        e.line(format!("unsigned qf[{ksteps}][4];"));
        e.line("#pragma unroll");
        e.open(format!("for (int kk = 0; kk < {ksteps}; ++kk)"));
        e.line("#pragma unroll");
        e.open("for (int f = 0; f < 4; ++f)");
        e.line("const i64 l = lw + gq + 8 * (f & 1), c0 = 16 * kk + 2 * tq + 8 * (f >> 1);");
        e.line("unsigned short h[2] = {0, 0};");
        e.open("if (busy && l < L)");
        e.open("for (int u = 0; u < 2; ++u)");
        e.line("const i64 c = c0 + u;");
        let qv = e.value(p.score.q, &at(["l", "c"]))?;
        e.line(format!("h[u] = {};", half(&qv)));
        e.close();
        e.close();
        e.line("qf[kk][f] = ember_pack2(h[0], h[1]);");
        e.close();
        e.close();

        e.line(format!(
            "float m[2] = {{{neg_inf}, {neg_inf}}}, lsum[2] = {{0.0f, 0.0f}};"
        ));
        e.line(format!("float o[{vtiles}][4];"));
        e.line("#pragma unroll");
        e.line(format!(
            "for (int nv = 0; nv < {vtiles}; ++nv) for (int f = 0; f < 4; ++f) o[nv][f] = 0.0f;"
        ));
        let kend = if p.score.causal {
            "ember_imin(l0 + R, S)"
        } else {
            "S"
        };
        e.line(format!("const i64 kend = {kend};"));
        e.open(format!("for (i64 j0 = 0; j0 < kend; j0 += {TILE})"));
        // The previous tile's readers are done before it is overwritten.
        e.line("__syncthreads();");
        e.open(format!(
            "for (i64 t = threadIdx.x; t < {TILE} * (E / 2); t += blockDim.x)"
        ));
        e.line("const i64 jj = t / (E / 2), c0 = 2 * (t % (E / 2)), j = j0 + jj;");
        e.line("unsigned short h[2] = {0, 0};");
        e.open("if (j < S)");
        e.open("for (int u = 0; u < 2; ++u)");
        e.line("const i64 c = c0 + u;");
        let kv = e.value(p.score.k, &at(["j", "c"]))?;
        e.line(format!("h[u] = {};", half(&kv)));
        e.close();
        e.close();
        e.line(format!(
            "ksh[jj * {kw} + c0 / 2] = ember_pack2(h[0], h[1]);"
        ));
        e.close();
        // Values transposed: a column's consecutive keys pair up in one word.
        e.open(format!(
            "for (i64 t = threadIdx.x; t < ({TILE} / 2) * EV; t += blockDim.x)"
        ));
        e.line("const i64 jp = t / EV, c = t % EV;");
        e.line("unsigned short h[2] = {0, 0};");
        e.open("for (int u = 0; u < 2; ++u)");
        e.line("const i64 j = j0 + 2 * jp + u;");
        e.open("if (j < S)");
        let vv = e.value(p.v, &at(["j", "c"]))?;
        e.line(format!("h[u] = {};", half(&vv)));
        e.close();
        e.close();
        e.line(format!("vsh[c * {vw} + jp] = ember_pack2(h[0], h[1]);"));
        e.close();
        e.line("__syncthreads();");
        // A warp whose rows all come before the tile's first key skips it under a causal
        // limit: every score masked changes nothing.
        let skip = if p.score.causal {
            " && j0 <= lw + 15"
        } else {
            ""
        };
        e.open(format!("if (busy{skip})"));
        e.line("float acc[4][4];");
        e.line("#pragma unroll");
        e.line("for (int nt = 0; nt < 4; ++nt) for (int f = 0; f < 4; ++f) acc[nt][f] = 0.0f;");
        e.line("#pragma unroll");
        e.open(format!("for (int kk = 0; kk < {ksteps}; ++kk)"));
        e.line("#pragma unroll");
        e.open("for (int nt = 0; nt < 4; ++nt)");
        e.line(format!(
            "const unsigned* kr = ksh + (8 * nt + gq) * {kw} + 8 * kk + tq;"
        ));
        e.line("const unsigned b[2] = {kr[0], kr[4]};");
        e.line(format!("{mma}(acc[nt], qf[kk], b, slots);"));
        e.close();
        e.close();
        // Scale, limit and mask each score; a row's tile maximum over its quad.
        e.line(format!("float mt[2] = {{{neg_inf}, {neg_inf}}};"));
        e.line("#pragma unroll");
        e.open("for (int nt = 0; nt < 4; ++nt) for (int f = 0; f < 4; ++f)");
        e.line("const i64 l = lw + gq + 8 * (f >> 1), j = j0 + 8 * nt + 2 * tq + (f & 1);");
        e.line(format!("float sv = {neg_inf};"));
        e.open("if (l < L && j < S)");
        e.line(format!(
            "float s = acc[nt][f] * (float){:e};",
            p.score.scale
        ));
        p.score.limit(g, &mut e, &at, "l")?;
        e.line("sv = s;");
        e.close();
        e.line("acc[nt][f] = sv;");
        e.line("mt[f >> 1] = ember_imax(mt[f >> 1], sv);");
        e.close();
        e.line("#pragma unroll");
        e.open("for (int h = 0; h < 2; ++h)");
        e.line("const float mn = ember_imax(m[h], ember_quad_reduce(mt[h], slots, EmberIMax()));");
        // Nothing unmasked yet (m = -inf): the running sums are zero, scale them by 0.
        e.line(format!(
            "const float alpha = m[h] == {neg_inf} ? 0.0f : ember_exp(m[h] - mn);"
        ));
        e.line("m[h] = mn;");
        e.line("lsum[h] *= alpha;");
        e.line(format!(
            "for (int nv = 0; nv < {vtiles}; ++nv) {{ o[nv][2 * h] *= alpha; o[nv][2 * h + 1] *= alpha; }}"
        ));
        e.close();
        e.line("#pragma unroll");
        e.open("for (int nt = 0; nt < 4; ++nt) for (int f = 0; f < 4; ++f)");
        e.line("const float s = acc[nt][f], mh = m[f >> 1];");
        e.line(format!(
            "const float pj = s == {neg_inf} ? 0.0f : ember_exp(s - mh);"
        ));
        e.line("lsum[f >> 1] += pj;");
        e.line("acc[nt][f] = pj;");
        e.close();
        // The probabilities' D fragments of keys 16ks.. are the A fragment of the product
        // with those keys' values.
        e.line("#pragma unroll");
        e.open("for (int ks = 0; ks < 2; ++ks)");
        e.line("unsigned a[4];");
        e.line("#pragma unroll");
        e.open("for (int f = 0; f < 4; ++f)");
        e.line("const float* pf = acc[2 * ks + (f >> 1)] + 2 * (f & 1);");
        e.line(format!(
            "a[f] = ember_pack2({}, {});",
            half("pf[0]"),
            half("pf[1]")
        ));
        e.close();
        e.line("#pragma unroll");
        e.open(format!("for (int nv = 0; nv < {vtiles}; ++nv)"));
        e.line(format!(
            "const unsigned* vr = vsh + (8 * nv + gq) * {vw} + 8 * ks + tq;"
        ));
        e.line("const unsigned b[2] = {vr[0], vr[4]};");
        e.line(format!("{mma}(o[nv], a, b, slots);"));
        e.close();
        e.close();
        e.close();
        e.close();
        // Each lane summed its own columns' probabilities: the row's sum is the quad's.
        e.open("if (busy)");
        e.line(
            "for (int h = 0; h < 2; ++h) lsum[h] = ember_quad_reduce(lsum[h], slots, EmberSum());",
        );
        e.line("#pragma unroll");
        e.open(format!(
            "for (int nv = 0; nv < {vtiles}; ++nv) for (int f = 0; f < 4; ++f)"
        ));
        e.line("const int h = f >> 1;");
        e.line("const i64 l = lw + gq + 8 * h, c = 8 * nv + 2 * tq + (f & 1);");
        // Every score masked: zeros, as torch's SDPA.
        e.line(format!(
            "const float y = m[h] == {neg_inf} ? 0.0f : o[nv][f] / lsum[h];"
        ));
        e.line(format!(
            "if (l < L) out[(bh * L + l) * EV + c] = {};",
            store(p.dtype, "y")
        ));
        e.close();
        e.close();
        e.close();
        let body = Body::of(e, true);
        // A full block (WARPS warps) per tile of WARPS × 16 rows of each (batch, head): on
        // the GPU a block for every tile however few rows (9 rows of 32 heads: 32 blocks).
        let rows_per_block = WARPS * 16;
        let tiles = Dim::binary(
            DimOp::FloorDiv,
            Dim::binary(
                DimOp::Add,
                p.qs[r - 2].clone(),
                Dim::Const(rows_per_block - 1),
            ),
            Dim::Const(rows_per_block),
        );
        let blocks = Dim::binary(DimOp::Mul, numel(batch), tiles);
        let threads = Dim::binary(DimOp::Mul, blocks, Dim::Const(WARPS * 32));
        Ok(Some(self.add(id, body, Launch::Elements(threads))))
    }
}
