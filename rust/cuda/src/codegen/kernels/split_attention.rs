//! Attention for one query row per head (a decode step with a KV cache), split over the
//! keys ("flash decoding"): one block per query row gives a GPU only as many blocks as
//! heads, so the keys are cut into chunks of `CHUNK`, each chunk's block writes its partial
//! result (its score maximum, the sum of its exponentials and the unnormalized weighted
//! values), and the last block of a row to finish (counted in `cnt`, which each run's
//! `meta` upload zeroes) combines the row's chunks rescaled to the row's maximum — one
//! launch, where a second kernel for the combination was one more per layer. The chunk
//! count follows the keys' length at run time (`meta`), so one program serves a growing
//! cache.

use ember_core::dim::{numel, Dim, DimOp};
use ember_core::ir::Op;

use super::super::types::store;
use super::{inf, weighted_values, AttentionParts, Body, CodegenError, Generator, StepKind};
use crate::codegen::Launch;

/// Keys per block (and the shared score buffer's length).
const CHUNK: i64 = 128;

impl Generator<'_> {
    /// The step of split attention for `id`, or `None` where one block per query row is
    /// the better kernel (more than one query row per head: prefill).
    pub fn split_attention_steps(
        &mut self,
        id: usize,
    ) -> Result<Option<Vec<StepKind>>, CodegenError> {
        let g = self.g;
        let qs = &g.nodes[g.nodes[id].inputs[0]].ty.shape;
        if !matches!(super::super::base_op(&g.nodes[id].op), Op::Attention { .. })
            || !super::super::one_query_row(qs)
        {
            return Ok(None);
        }
        let p = AttentionParts::of(g, id)?;
        let acc = p.score.acc;
        let rows = numel(p.row_dims());
        let chunks = Dim::binary(
            DimOp::FloorDiv,
            Dim::binary(DimOp::Add, p.s_dim.clone(), Dim::Const(CHUNK - 1)),
            Dim::Const(CHUNK),
        );
        // Per (row, chunk): maximum, sum, then EV weighted values.
        let record = Dim::binary(DimOp::Add, p.ev_dim.clone(), Dim::Const(2));
        let part_elems = Dim::binary(
            DimOp::Mul,
            Dim::binary(DimOp::Mul, rows.clone(), chunks.clone()),
            record,
        );

        // Step 1: one block per (row, chunk).
        let mut e = self.emitter(None);
        e.line(format!("__shared__ {acc} smem[1024];"));
        e.line(format!("__shared__ {acc} ssc[{CHUNK}];"));
        e.line("__shared__ bool last;");
        p.declare_dims(&mut e);
        e.line(format!("const i64 NC = (S + {}) / {CHUNK};", CHUNK - 1));
        e.open("for (i64 b = blockIdx.x; b < rows * NC; b += gridDim.x)");
        e.line(format!(
            "const i64 row = b / NC, j0 = (b % NC) * {CHUNK}, nk = S - j0 < {CHUNK} ? S - j0 : {CHUNK};"
        ));
        let ri = p.row_index(&mut e);
        let at = |last2: [&str; 2]| ri.at(last2);
        e.line(format!("{acc} mx = -{};", inf(acc)));
        e.open("for (i64 jj = threadIdx.x; jj < nk; jj += blockDim.x)");
        e.line("const i64 j = j0 + jj;");
        p.score.emit(g, &mut e, &at, &ri.query)?;
        e.line("ssc[jj] = s;");
        e.line("mx = s > mx ? s : mx;");
        e.close();
        e.line("mx = ember_block_reduce(mx, smem, EmberIMax());");
        e.line(format!("{acc} sum = 0;"));
        e.open("for (i64 jj = threadIdx.x; jj < nk; jj += blockDim.x)");
        // A chunk whose every key is masked contributes nothing (its maximum stays -inf).
        e.line(format!(
            "const {acc} p = mx == -{} ? ({acc})0 : ember_exp(ssc[jj] - mx); ssc[jj] = p; sum += p;",
            inf(acc)
        ));
        e.close();
        e.line("sum = ember_block_reduce(sum, smem, EmberSum());");
        e.line(format!("{acc}* pr = part + b * (EV + 2);"));
        e.line("if (threadIdx.x == 0) { pr[0] = mx; pr[1] = sum; }");
        weighted_values(&mut e, p.v, &at, acc, ("ssc", "j0", "nk"), "o", &|o| {
            format!("pr[2 + c] = {o};")
        })?;
        // The row's last block to finish combines its chunks: every thread's partial
        // results are made visible to the device before the block counts itself done, and
        // the block seeing the count reach NC reads the others' (past any cache).
        e.line("__threadfence();");
        e.line("__syncthreads();");
        e.line("if (threadIdx.x == 0) last = ember_arrive(cnt + row) == NC - 1;");
        e.line("__syncthreads();");
        e.open("if (last)");
        e.line("__threadfence();");
        e.line(format!(
            "const volatile {acc}* rp = part + row * NC * (EV + 2);"
        ));
        e.line(format!("{acc} M = -{};", inf(acc)));
        e.line("for (i64 t = 0; t < NC; ++t) M = rp[t * (EV + 2)] > M ? rp[t * (EV + 2)] : M;");
        e.line(format!("{acc} L = 0;"));
        e.open("for (i64 t = 0; t < NC; ++t)");
        e.line(format!("const {acc} m = rp[t * (EV + 2)];"));
        e.line(format!(
            "if (m != -{}) L += rp[t * (EV + 2) + 1] * ember_exp(m - M);",
            inf(acc)
        ));
        e.close();
        e.open("for (i64 c = threadIdx.x; c < EV; c += blockDim.x)");
        e.line(format!("{acc} o = 0;"));
        e.open("for (i64 t = 0; t < NC; ++t)");
        e.line(format!("const {acc} m = rp[t * (EV + 2)];"));
        e.line(format!(
            "if (m != -{}) o += rp[t * (EV + 2) + 2 + c] * ember_exp(m - M);",
            inf(acc)
        ));
        e.close();
        // Every key masked (M = -inf): zeros, as torch's SDPA.
        e.line(format!("o = M == -{} ? ({acc})0 : o / L;", inf(acc)));
        e.line(format!("out[row * EV + c] = {};", store(p.dtype, "o")));
        e.close();
        e.close();
        // The next chunk's block reuses `last` and the score buffer.
        e.line("__syncthreads();");
        e.close();
        let body = Body {
            partials: Some((acc, (part_elems, rows.clone()))),
            ..Body::of(e, true)
        };
        let step = self.add(
            id,
            body,
            Launch::Rows {
                rows: Dim::binary(DimOp::Mul, rows, chunks),
                width: Dim::Const(CHUNK),
            },
        );
        Ok(Some(vec![step]))
    }
}
