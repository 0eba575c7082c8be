//! Attention's shared parts (the score of a query row and key, an attention node's operands
//! and shapes) and the kernel of one block per query row, which every attention falls back
//! to; the prefill and decode kernels are `tiled_attention`, `mma_attention` and
//! `split_attention`.

use ember_core::dim::{numel, Dim};
use ember_core::dtype::{DType, Kind};
use ember_core::ir::{Graph, Op};

use super::super::emit::Emitter;
use super::super::types::{accumulate_type, store};
use super::super::{CodegenError, Launch, StepKind};
use super::{err, inf, Body, Generator};

/// The attention score of query row `l` and key `j` (variables of the emitted code): the
/// scaled dot product, then the causal limit and the mask; emitted as `acc s`.
pub(super) struct Score {
    pub(super) q: usize,
    pub(super) k: usize,
    pub(super) mask: Option<usize>,
    pub(super) scale: f64,
    pub(super) causal: bool,
    pub(super) acc: &'static str,
}

impl Score {
    pub(super) fn emit(
        &self,
        g: &Graph,
        e: &mut Emitter<'_>,
        at: &dyn Fn([&str; 2]) -> Vec<String>,
        l: &str,
    ) -> Result<(), CodegenError> {
        let acc = self.acc;
        e.line(format!("{acc} d = 0;"));
        e.open("for (i64 c = 0; c < E; ++c)");
        let qv = e.value(self.q, &at([l, "c"]))?;
        let kv = e.value(self.k, &at(["j", "c"]))?;
        e.line(format!("d += ({acc}){qv} * ({acc}){kv};"));
        e.close();
        e.line(format!("{acc} s = d * ({acc}){:e};", self.scale));
        self.limit(g, e, at, l)
    }

    /// Applies the causal limit and the mask to the score `s` of query row `l` and key `j`.
    pub(super) fn limit(
        &self,
        g: &Graph,
        e: &mut Emitter<'_>,
        at: &dyn Fn([&str; 2]) -> Vec<String>,
        l: &str,
    ) -> Result<(), CodegenError> {
        let acc = self.acc;
        if self.causal {
            e.line(format!("if (j > {l}) s = -{};", inf(acc)));
        }
        if let Some(m) = self.mask {
            let mv = e.value(m, &at([l, "j"]))?;
            if g.nodes[m].ty.dtype == DType::Bool {
                e.line(format!("if (!{mv}) s = -{};", inf(acc)));
            } else {
                e.line(format!("s += ({acc}){mv};"));
            }
        }
        Ok(())
    }
}

/// An attention node's operands and shapes, shared by its kernels.
pub(super) struct AttentionParts {
    pub(super) score: Score,
    pub(super) v: usize,
    pub(super) qs: Vec<Dim>,
    pub(super) s_dim: Dim,
    pub(super) ev_dim: Dim,
    pub(super) dtype: DType,
}

impl AttentionParts {
    pub(super) fn of(g: &Graph, id: usize) -> Result<AttentionParts, CodegenError> {
        let n = &g.nodes[id];
        let Op::Attention {
            scale,
            causal,
            has_mask,
        } = *super::super::base_op(&n.op)
        else {
            return Err(err(g, id, "not an attention node"));
        };
        let dtype = n.ty.dtype;
        if dtype.kind() != Kind::Float {
            return Err(err(g, id, format!("attention of {dtype}")));
        }
        let (q, k, v) = (n.inputs[0], n.inputs[1], n.inputs[2]);
        let qs = g.nodes[q].ty.shape.clone();
        let (ks, vs) = (&g.nodes[k].ty.shape, &g.nodes[v].ty.shape);
        let r = qs.len();
        Ok(AttentionParts {
            score: Score {
                q,
                k,
                mask: has_mask.then(|| n.inputs[3]),
                scale,
                causal,
                acc: accumulate_type(dtype),
            },
            v,
            s_dim: ks[r - 2].clone(),
            ev_dim: vs[r - 1].clone(),
            qs,
            dtype,
        })
    }

    /// The query rows (all dims but the head dim).
    pub(super) fn row_dims(&self) -> &[Dim] {
        &self.qs[..self.qs.len() - 1]
    }

    /// Declares `rows`, `S` (keys), `E` (head dim) and `EV` (value columns).
    pub(super) fn declare_dims(&self, e: &mut Emitter<'_>) {
        e.line(format!(
            "const i64 rows = {};",
            e.dims.product(self.row_dims())
        ));
        e.line(format!("const i64 S = {};", e.dim(&self.s_dim)));
        e.line(format!(
            "const i64 E = {};",
            e.dim(&self.qs[self.qs.len() - 1])
        ));
        e.line(format!("const i64 EV = {};", e.dim(&self.ev_dim)));
    }

    /// The batch indices of query row `row` (a variable of the emitted code) and its
    /// position among the queries.
    pub(super) fn row_index(&self, e: &mut Emitter<'_>) -> RowIndex {
        let ridx = e.unravel("row", self.row_dims());
        let r = ridx.len();
        RowIndex {
            batch: ridx[..r - 1].to_vec(),
            query: ridx[r - 1].clone(),
        }
    }
}

/// Where one query row of attention is: its batch indices and its query position.
pub(super) struct RowIndex {
    pub(super) batch: Vec<String>,
    pub(super) query: String,
}

impl RowIndex {
    /// The index of `[batch.., last2[0], last2[1]]` in a q/k/v/mask operand.
    pub(super) fn at(&self, last2: [&str; 2]) -> Vec<String> {
        let mut i = self.batch.clone();
        i.extend(last2.iter().map(|s| s.to_string()));
        i
    }
}

impl Generator<'_> {
    /// One block per query row: scores into scratch, softmax, then the weighted sum of values.
    pub(super) fn attention(&mut self, id: usize) -> Result<StepKind, CodegenError> {
        let g = self.g;
        let p = AttentionParts::of(g, id)?;
        let chosen = |k: &str| matches!(&g.nodes[id].op, Op::Kernel { name, .. } if name == k);
        if chosen(super::super::KERNEL_MMA_ATTENTION) {
            if let Some(step) = self.mma_attention(id, &p)? {
                return Ok(step);
            }
        }
        if let Some(step) = self.tiled_attention(id, &p)? {
            return Ok(step);
        }
        let acc = p.score.acc;
        let mut e = self.emitter(None);
        e.line(format!("__shared__ {acc} smem[1024];"));
        p.declare_dims(&mut e);
        e.line(format!("{acc}* sc = scratch + (i64)blockIdx.x * S;"));
        e.open("for (i64 row = blockIdx.x; row < rows; row += gridDim.x)");
        let ri = p.row_index(&mut e);
        let at = |last2: [&str; 2]| ri.at(last2);
        e.line(format!("{acc} mx = -{};", inf(acc)));
        e.open("for (i64 j = threadIdx.x; j < S; j += blockDim.x)");
        p.score.emit(g, &mut e, &at, &ri.query)?;
        e.line("sc[j] = s;");
        e.line("mx = s > mx ? s : mx;");
        e.close();
        e.line("mx = ember_block_reduce(mx, smem, EmberIMax());");
        e.line(format!("{acc} sum = 0;"));
        e.open("for (i64 j = threadIdx.x; j < S; j += blockDim.x)");
        e.line(format!(
            "const {acc} p = ember_exp(sc[j] - mx); sc[j] = p; sum += p;"
        ));
        e.close();
        // The reduction's barriers also publish every thread's `sc` writes to the block.
        e.line("sum = ember_block_reduce(sum, smem, EmberSum());");
        // Every score masked (mx = -inf, p = NaN): zeros, as torch's SDPA.
        let finish = format!("mx == -{} ? ({acc})0 : o / sum", inf(acc));
        let dtype = p.dtype;
        weighted_values(&mut e, p.v, &at, acc, ("sc", "0", "S"), &finish, &|o| {
            format!("out[row * EV + c] = {};", store(dtype, o))
        })?;
        e.line("__syncthreads();");
        e.close();
        let body = Body {
            scratch: Some(acc),
            ..Body::of(e, true)
        };
        Ok(self.add(
            id,
            body,
            Launch::Rows {
                rows: numel(p.row_dims()),
                width: p.s_dim.clone(),
            },
        ))
    }
}

/// `o[c] = Σ_j p[j] · v[j, c]` for the keys `j0 + jj`, `jj < n`, of one row, where `probs`
/// holds `p[j0 + jj]` at `jj`; then `o = finish` and `write(o)` for each column `c < EV`.
/// With fewer value columns than threads (a decode step: one query row, 64 columns, 256
/// threads) G groups of EV threads each take every G-th key and the groups' partial sums
/// meet in `smem`; otherwise each thread sums every key for its columns. Every thread of
/// the block must reach it (it synchronizes).
pub(super) fn weighted_values(
    e: &mut Emitter<'_>,
    v: usize,
    at: &dyn Fn([&str; 2]) -> Vec<String>,
    acc: &str,
    (probs, j0, n): (&str, &str, &str),
    finish: &str,
    write: &dyn Fn(&str) -> String,
) -> Result<(), CodegenError> {
    e.line("const i64 G = EV < (i64)blockDim.x ? (i64)blockDim.x / EV : 1;");
    e.open("if (G > 1)");
    e.line("const i64 grp = (i64)threadIdx.x / EV, c = (i64)threadIdx.x % EV;");
    e.line(format!("{acc} o = 0;"));
    e.open("if (grp < G)");
    e.open(format!("for (i64 jj = grp; jj < {n}; jj += G)"));
    e.line(format!("const i64 j = {j0} + jj;"));
    let vv = e.value(v, &at(["j", "c"]))?;
    e.line(format!("o += {probs}[jj] * ({acc}){vv};"));
    e.close();
    e.close();
    e.line("smem[threadIdx.x] = o;");
    e.line("__syncthreads();");
    e.open("if ((i64)threadIdx.x < EV)");
    e.line("o = 0;");
    e.line("for (i64 q = 0; q < G; ++q) o += smem[q * EV + c];");
    e.line(format!("o = {finish};"));
    e.line(write("o"));
    e.close();
    e.close();
    e.open("else");
    e.open("for (i64 c = threadIdx.x; c < EV; c += blockDim.x)");
    e.line(format!("{acc} o = 0;"));
    e.open(format!("for (i64 jj = 0; jj < {n}; ++jj)"));
    e.line(format!("const i64 j = {j0} + jj;"));
    let vv = e.value(v, &at(["j", "c"]))?;
    e.line(format!("o += {probs}[jj] * ({acc}){vv};"));
    e.close();
    e.line(format!("o = {finish};"));
    e.line(write("o"));
    e.close();
    e.close();
    Ok(())
}
