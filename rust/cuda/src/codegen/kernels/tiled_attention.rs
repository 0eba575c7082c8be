//! Attention over many query rows per head (prefill), tiled as flash attention is: a block
//! takes up to `ROWS_PER_BLOCK` query rows of one (batch, head), a warp per row, and walks
//! the keys in tiles of 32 staged in shared memory, so each key and value row is read from
//! memory once per block instead of once per query row. Within a tile, lane `j` scores key
//! `j` against its warp's query row and the lanes then sum value columns; the softmax runs
//! online (a running maximum rescales the running sums), so no row of scores is stored.
//!
//! Taken for f16/bf16/f32 with head dims known at compile time (at most 128, the shared
//! tiles' size); other attention runs one block per query row (`Generator::attention`).

use ember_core::dim::{numel, Dim};

use super::super::types::store;
use super::{inf, AttentionParts, Body, CodegenError, Generator, RowIndex, StepKind};
use crate::codegen::Launch;

/// Keys per shared tile (a warp's lanes score one each).
const TILE: i64 = 32;
/// Warps (query rows) of a block that take a row: the GPU's launches are 256 threads
/// (`launch_limits`), the emulator's 32 or 256; warps beyond these (a larger block) idle.
const ROWS_PER_BLOCK: i64 = 8;
/// Threads a block may have at most (CUDA's limit): the per-thread shared slots.
const MAX_THREADS: i64 = 1024;
/// Largest head dim the shared tiles hold (two 32 × 128 f32 tiles: 32 KiB).
const MAX_HEAD_DIM: i64 = 128;

impl Generator<'_> {
    /// The tiled kernel for `id`, or `None` where it does not apply.
    pub(super) fn tiled_attention(
        &mut self,
        id: usize,
        p: &AttentionParts,
    ) -> Result<Option<StepKind>, CodegenError> {
        let r = p.qs.len();
        let (Some(e_len), Some(ev_len)) = (p.qs[r - 1].as_const(), p.ev_dim.as_const()) else {
            return Ok(None);
        };
        let fits = |d: i64| (1..=MAX_HEAD_DIM).contains(&d);
        if r < 2 || p.score.acc != "float" || !fits(e_len) || !fits(ev_len) {
            return Ok(None);
        }
        let g = self.g;
        let acc = p.score.acc;
        let neg_inf = format!("-{}", inf(acc));
        let outs_per_lane = (ev_len + 31) / 32;
        let mut e = self.emitter(None);
        // `red` serves the emulator's warp reductions (the GPU's use shuffles).
        e.line(format!("__shared__ {acc} red[{MAX_THREADS}];"));
        e.line(format!("__shared__ {acc} qsh[{}];", ROWS_PER_BLOCK * e_len));
        e.line(format!("__shared__ {acc} ks[{}];", TILE * (e_len + 1)));
        e.line(format!("__shared__ {acc} vs[{}];", TILE * ev_len));
        e.line(format!("__shared__ {acc} psh[{MAX_THREADS}];"));
        let batch = &p.qs[..r - 2];
        e.line(format!("const i64 BH = {};", e.dims.product(batch)));
        e.line(format!("const i64 L = {};", e.dim(&p.qs[r - 2])));
        e.line(format!("const i64 S = {};", e.dim(&p.s_dim)));
        e.line(format!("const i64 E = {e_len}, EV = {ev_len};"));
        e.line(format!(
            "const i64 W = ember_imin((i64)blockDim.x >> 5, (i64){ROWS_PER_BLOCK});"
        ));
        e.line("const i64 w = (i64)threadIdx.x >> 5;");
        e.line("const i64 lane = (i64)threadIdx.x & 31;");
        e.line("const i64 tiles = (L + W - 1) / W;");
        // Every loop bound below is the same for the whole block: its barriers (and the
        // emulator's warp reductions) are met by every thread.
        e.open("for (i64 blk = blockIdx.x; blk < BH * tiles; blk += gridDim.x)");
        e.line("const i64 bh = blk / tiles, l0 = (blk % tiles) * W, l = l0 + w;");
        e.line("const bool active = w < W && l < L;");
        let ri = RowIndex {
            batch: e.unravel("bh", batch),
            query: "l".into(),
        };
        let at = |last2: [&str; 2]| ri.at(last2);
        e.open("for (i64 c = lane; c < E; c += 32)");
        e.line(format!("{acc} qv = 0;"));
        e.open("if (active)");
        let qv = e.value(p.score.q, &at(["l", "c"]))?;
        e.line(format!("qv = ({acc}){qv};"));
        e.close();
        e.line("if (w < W) qsh[w * E + c] = qv;");
        e.close();
        e.line(format!("{acc} m = {neg_inf}, lsum = 0;"));
        e.line(format!("{acc} o[{outs_per_lane}];"));
        e.line(format!(
            "for (int i = 0; i < {outs_per_lane}; ++i) o[i] = 0;"
        ));
        let kend = if p.score.causal {
            "l0 + W < S ? l0 + W : S"
        } else {
            "S"
        };
        e.line(format!("const i64 kend = {kend};"));
        e.open(format!("for (i64 j0 = 0; j0 < kend; j0 += {TILE})"));
        e.line("__syncthreads();");
        for (tile, v, width, stride) in [("ks", p.score.k, "E", "E + 1"), ("vs", p.v, "EV", "EV")] {
            e.open(format!(
                "for (i64 t = threadIdx.x; t < {TILE} * {width}; t += blockDim.x)"
            ));
            e.line(format!(
                "const i64 jj = t / {width}, c = t % {width}, j = j0 + jj;"
            ));
            e.line(format!("{acc} x = 0;"));
            e.open("if (j < S)");
            let xv = e.value(v, &at(["j", "c"]))?;
            e.line(format!("x = ({acc}){xv};"));
            e.close();
            e.line(format!("{tile}[jj * ({stride}) + c] = x;"));
            e.close();
        }
        e.line("__syncthreads();");
        e.line("const i64 j = j0 + lane;");
        e.line(format!("{acc} s = {neg_inf};"));
        e.open("if (active && j < S)");
        e.line(format!("{acc} d = 0;"));
        e.line("for (i64 c = 0; c < E; ++c) d += qsh[w * E + c] * ks[lane * (E + 1) + c];");
        e.line(format!("s = d * ({acc}){:e};", p.score.scale));
        p.score.limit(g, &mut e, &at, "l")?;
        e.close();
        e.line(format!(
            "const {acc} mt = ember_warp_reduce(s, red, EmberIMax());"
        ));
        e.line(format!("const {acc} mn = mt > m ? mt : m;"));
        // Nothing unmasked yet (m = -inf): the running sums are zero, scale them by 0.
        e.line(format!(
            "const {acc} alpha = m == {neg_inf} ? ({acc})0 : ember_exp(m - mn);"
        ));
        e.line(format!(
            "const {acc} pj = s == {neg_inf} ? ({acc})0 : ember_exp(s - mn);"
        ));
        e.line("lsum = lsum * alpha + ember_warp_reduce(pj, red, EmberSum());");
        e.line("m = mn;");
        e.line("psh[threadIdx.x] = pj;");
        e.line("__syncwarp();");
        e.open(format!("for (int i = 0; i < {outs_per_lane}; ++i)"));
        e.line("const i64 c = lane + 32 * i;");
        e.line(format!("{acc} a = o[i] * alpha;"));
        e.line(format!(
            "if (c < EV) for (int jj = 0; jj < {TILE}; ++jj) a += psh[w * 32 + jj] * vs[jj * EV + c];"
        ));
        e.line("o[i] = a;");
        e.close();
        e.close();
        // Every score masked: zeros, as torch's SDPA.
        e.open("if (active)");
        e.open(format!("for (int i = 0; i < {outs_per_lane}; ++i)"));
        e.line("const i64 c = lane + 32 * i;");
        e.line(format!(
            "const {acc} y = m == {neg_inf} ? ({acc})0 : o[i] / lsum;"
        ));
        e.line(format!(
            "if (c < EV) out[(bh * L + l) * EV + c] = {};",
            store(p.dtype, "y")
        ));
        e.close();
        e.close();
        e.close();
        let body = Body::of(e, true);
        let threads = numel(p.row_dims()) * Dim::from(32usize);
        Ok(Some(self.add(id, body, Launch::Elements(threads))))
    }
}
