//! Scaled dot-product attention per batch: scores = q·kᵀ·scale (gemm, k read transposed
//! through its strides), causal / bool / additive mask, max-subtracted softmax, then ·v.
//! f16/bf16 run in f32; where few query rows read each key (decode) the f32 loops read
//! half-precision keys and values as stored, widened in registers.

use ember_core::dtype::DType;
use half::{bf16, f16};

use super::dot::{gemm_into, GemmElem, Mat};
use super::elementwise::cast;
use super::norm::softmax_numerators_in_place;
use super::rowdot::RowWeight;
use super::sgemm::{self, Operand};
use crate::buffer::{Val, View};
use crate::elem::{FloatElem, Real, B8};
use crate::error::{CpuError, KResult};
use crate::par;
use crate::scratch::with_scratch;
use crate::simd;
use crate::strided::batch_offsets;

pub struct Params {
    pub scale: f64,
    pub causal: bool,
}

pub fn attention(
    q: &Val,
    k: &Val,
    v: &Val,
    mask: Option<&Val>,
    p: &Params,
    threads: usize,
) -> KResult<Val> {
    match q.dtype {
        DType::F32 => attention_t::<f32, f32>(q, k, v, mask, p, threads),
        DType::F64 => attention_t::<f64, f64>(q, k, v, mask, p, threads),
        DType::F16 | DType::BF16 => {
            let up = widen_keeping_broadcasts;
            let mask = match mask {
                Some(m) if m.dtype != DType::Bool => Some(up(m)?),
                Some(m) => Some(m.clone()),
                None => None,
            };
            let (dtype, q, mask) = (q.dtype, up(q)?, mask.as_ref());
            // Decode reads the keys and values as stored; widening them whole first cost
            // more than the attention over them.
            let out = match (k.dtype, v.dtype, direct_rows(&q, k, v)) {
                (DType::BF16, DType::BF16, true) if fast_loops() => {
                    attention_t::<f32, bf16>(&q, k, v, mask, p, threads)?
                }
                (DType::F16, DType::F16, true) if fast_loops() => {
                    attention_t::<f32, f16>(&q, k, v, mask, p, threads)?
                }
                _ => attention_t::<f32, f32>(&q, &up(k)?, &up(v)?, mask, p, threads)?,
            };
            cast(&out, dtype)
        }
        other => Err(CpuError::Unsupported(format!("attention on {other}"))),
    }
}

/// `x` in f32, its broadcast dims (stride 0: grouped-query heads shared by several query
/// heads) still broadcast: only the distinct elements are converted, and the f32 kernel
/// still sees which heads are shared (a plain cast made a decode step's keys and values
/// 4× larger, and the attention over them 4× slower).
fn widen_keeping_broadcasts(x: &Val) -> KResult<Val> {
    let strides = &x.layout.strides;
    let mut distinct = x.layout.clone();
    for (d, &s) in distinct.shape.iter_mut().zip(strides) {
        if s == 0 {
            *d = 1;
        }
    }
    let wide = cast(&x.with_layout(distinct)?, DType::F32)?;
    let mut layout = wide.layout.clone();
    for (i, &s) in strides.iter().enumerate() {
        if s == 0 {
            layout.shape[i] = x.layout.shape[i];
            layout.strides[i] = 0;
        }
    }
    wide.with_layout(layout)
}

/// How the f32 direct loops (`fast`) read key and value rows.
#[derive(Clone, Copy)]
enum RowKind {
    F32,
    Bf16,
    F16,
}

/// Whether the f32 direct loops (`fast`) run here: AVX2, FMA and the F16C they are
/// compiled with (for every kind of row they read).
fn fast_loops() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        sgemm::available() && f16::loads_available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// An element of the keys and values: the computation's own type `T`, or (for `T` = f32)
/// a half type that the direct loops widen as they load it.
trait KvElem<T>: Copy + Send + Sync + 'static {
    /// How the f32 direct loops read it (`None`: they do not).
    const KIND: Option<RowKind>;
    fn widen(self) -> T;
}

impl KvElem<f32> for f32 {
    const KIND: Option<RowKind> = Some(RowKind::F32);
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl KvElem<f64> for f64 {
    const KIND: Option<RowKind> = None;
    #[inline(always)]
    fn widen(self) -> f64 {
        self
    }
}

impl KvElem<f32> for bf16 {
    const KIND: Option<RowKind> = Some(RowKind::Bf16);
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

impl KvElem<f32> for f16 {
    const KIND: Option<RowKind> = Some(RowKind::F16);
    #[inline(always)]
    fn widen(self) -> f32 {
        RowWeight::to_f32(self)
    }
}

/// Whether attention of these operands takes the direct loops (few query rows per batch,
/// rows contiguous along the head dim) rather than GEMMs.
fn direct_rows(q: &Val, k: &Val, v: &Val) -> bool {
    let (sq, sk, sv) = (q.shape(), k.shape(), v.shape());
    let r = sq.len();
    if r < 2 || sk.len() != r || sv.len() != r {
        return false;
    }
    let unit = |x: &Val, n: usize| n <= 1 || x.layout.strides[r - 1] == 1;
    sq[r - 2] <= DIRECT_MAX_ROWS && unit(q, sq[r - 1]) && unit(k, sk[r - 1]) && unit(v, sv[r - 1])
}

/// Attention computed in `T`, keys and values read as `W` (`T` itself, or a half type when
/// the direct loops take them: `direct_rows` and `fast_loops`).
fn attention_t<T: GemmElem + FloatElem<C = T> + Real, W: KvElem<T>>(
    q: &Val,
    k: &Val,
    v: &Val,
    mask: Option<&Val>,
    p: &Params,
    threads: usize,
) -> KResult<Val> {
    let (sq, sk, sv) = (q.shape(), k.shape(), v.shape());
    let r = sq.len();
    let bad = || CpuError::Shape(format!("attention of q {sq:?}, k {sk:?}, v {sv:?}"));
    if r < 2 || sk.len() != r || sv.len() != r {
        return Err(bad());
    }
    let nb = r - 2;
    let (l, e, s, ev) = (sq[r - 2], sq[r - 1], sk[r - 2], sv[r - 1]);
    if sq[..nb] != sk[..nb] || sk[..r - 1] != sv[..r - 1] || sk[r - 1] != e {
        return Err(bad());
    }
    let mut want_mask = sq[..r - 1].to_vec();
    want_mask.push(s);
    if let Some(m) = mask {
        if m.shape() != want_mask {
            return Err(CpuError::Shape(format!(
                "attention mask {:?}, expected {want_mask:?}",
                m.shape()
            )));
        }
        if m.dtype != DType::Bool && m.dtype != T::DTYPE {
            return Err(CpuError::Shape(format!(
                "attention mask of dtype {}",
                m.dtype
            )));
        }
    }
    let (vq, vk, vv) = (q.view::<T>()?, k.view::<W>()?, v.view::<W>()?);
    // The GEMM path reads keys and values as `T`; the caller widens them for it.
    let same = std::any::TypeId::of::<W>() == std::any::TypeId::of::<T>();
    let gemm_kv = match same {
        true => Some((k.view::<T>()?, v.view::<T>()?)),
        false => None,
    };
    // The f32 loops of `fast` read the rows (AVX2 + FMA; F16C for f16 rows).
    let fast_kind = W::KIND.filter(|_| T::DTYPE == DType::F32 && fast_loops());
    let direct_ok = direct_rows(q, k, v);
    if !(same || direct_ok && fast_kind.is_some()) {
        return Err(CpuError::Internal(format!(
            "attention reading {} keys as stored outside the direct loops",
            k.dtype
        )));
    }
    let bool_mask = match mask {
        Some(m) if m.dtype == DType::Bool => Some(m.view::<B8>()?),
        _ => None,
    };
    let add_mask = match mask {
        Some(m) if m.dtype != DType::Bool => Some(m.view::<T>()?),
        _ => None,
    };
    let zero_strides = vec![0isize; r];
    let mstrides = match (&bool_mask, &add_mask) {
        (Some(m), _) => m.strides.clone(),
        (_, Some(m)) => m.strides.clone(),
        _ => zero_strides,
    };
    let offs = batch_offsets(
        &sq[..nb],
        [&vq.strides, &vk.strides, &vv.strides, &mstrides],
    );
    let (mrs, mcs) = (mstrides[r - 2], mstrides[r - 1]);
    let scale = T::of(p.scale);
    let mut shape = sq[..r - 1].to_vec();
    shape.push(ev);
    Val::build::<T>(T::DTYPE, &shape, |out| {
        if l * ev == 0 {
            return Ok(());
        }
        // Few query rows (decode: one token, or the query heads sharing a key/value head):
        // each key and value row is read once, contiguously, for all of them; two GEMMs
        // would cost more in packing and set-up than this does in arithmetic.
        let (qs, ks, vs) = (vq.strides[r - 2], vk.strides[r - 2], vv.strides[r - 2]);
        // Scale, mask and softmax numerators of score row `i` of the batch whose mask
        // starts at `om`; returns the factor (1 / their sum) that makes them the weights.
        // Causal masking hides keys past `i`: only the first `i + 1` scores are live (the
        // rest become zero weights without being scaled, masked or exponentiated).
        let finish_row = |row: &mut [T], i: usize, om: isize| {
            let live = if p.causal {
                row.len().min(i + 1)
            } else {
                row.len()
            };
            let (row, dead) = row.split_at_mut(live);
            dead.fill(<T as Real>::ZERO);
            let mbase = om + i as isize * mrs;
            let unit = mcs == 1 || live <= 1;
            match (&add_mask, &bool_mask) {
                (Some(m), _) if unit => simd::wide(
                    #[inline(always)]
                    || scale_add_row(row, scale, m.run(mbase, live)),
                ),
                (Some(m), _) => {
                    for (j, x) in row.iter_mut().enumerate() {
                        *x = *x * scale + m.at(mbase + j as isize * mcs);
                    }
                }
                _ => simd::wide(
                    #[inline(always)]
                    || scale_row(row, scale),
                ),
            }
            if let Some(m) = &bool_mask {
                if unit {
                    hide_row(row, m.run(mbase, live));
                } else {
                    for (j, x) in row.iter_mut().enumerate() {
                        if !m.at(mbase + j as isize * mcs).get() {
                            *x = -T::INF;
                        }
                    }
                }
            }
            let masked = add_mask.is_some() || bool_mask.is_some();
            if row.is_empty() || masked && row.iter().all(|x| *x == -T::INF) {
                // Every score masked (left padding): zeros, as torch's SDPA, not NaN.
                row.fill(<T as Real>::ZERO);
                return <T as Real>::ZERO;
            }
            T::of(1.0 / softmax_numerators_in_place(row))
        };
        // f32 with sgemm: every distinct key matrix (query heads sharing a key/value head
        // share one) packed once, transposed, into sgemm's panel layout; each block of
        // queries then reads the prefix of keys it sees without packing them again.
        let packed_keys = match &gemm_kv {
            Some((vk, _)) if T::DTYPE == DType::F32 && sgemm::available() && !direct_ok => {
                Some(pack_keys(vk, &offs, (s, e), threads))
            }
            _ => None,
        };
        // Rows `i0..` of batch `b` (`o` holds them): scores against the keys those rows can
        // see (causal: the first `i0 + rows`), their softmax, then the weighted values.
        let by_gemm = |o: &mut [T], b: usize, i0: usize, t: usize| {
            // Present: keys and values of another type than `T` take the direct loops only
            // (checked above).
            let Some((vk, vv)) = &gemm_kv else { return };
            let [oq, ok, ov, om] = offs[b];
            let rows = o.len() / ev;
            let keys = if p.causal { s.min(i0 + rows) } else { s };
            with_scores(rows * keys, |scores: &mut [T]| {
                let mq = Mat::of(&vq, oq + i0 as isize * vq.strides[r - 2], nb);
                match &packed_keys {
                    Some(packed) => {
                        let q = sgemm::Strided {
                            ptr: mq.ptr.cast(),
                            rs: mq.rs,
                            cs: mq.cs,
                        };
                        let panels = Operand::PanelsB(packed.of(b));
                        // SAFETY: T is f32 (`packed_keys` exists); q's rows i0.. lie in a checked
                        // view; the panels hold all s keys (so the first `keys`); scores holds
                        // rows·keys elements.
                        unsafe {
                            let out = scores.as_mut_ptr().cast();
                            sgemm::sgemm((rows, keys, e), Operand::Strided(q), panels, out, keys, t)
                        }
                    }
                    None => {
                        let mk = Mat::of(vk, ok, nb).transposed();
                        // SAFETY: q's rows i0.. and k's first `keys` rows lie in checked views;
                        // scores holds rows·keys elements.
                        unsafe { gemm_into(scores, keys, (rows, keys, e), mq, mk, t) };
                    }
                }
                let factors: Vec<T> = (scores.chunks_mut(keys.max(1)).enumerate().take(rows))
                    .map(|(ii, row)| finish_row(row, i0 + ii, om))
                    .collect();
                let mp = Mat {
                    ptr: scores.as_ptr(),
                    rs: keys as isize,
                    cs: 1,
                };
                // SAFETY: scores is rows×keys and alive; v's first `keys` rows lie in a checked
                // view; o holds rows·ev elements.
                unsafe { gemm_into(o, ev, (rows, ev, keys), mp, Mat::of(vv, ov, nb), t) };
                simd::wide(
                    #[inline(always)]
                    || scale_rows(o, ev, &factors),
                );
            })
        };
        // f32 on AVX2 + FMA: the products in registers (the generic loops below keep an
        // output row in memory and did not vectorize the dot products well).
        let avx2_f32 = fast_kind;
        // Batches `b0..b0 + batches` (several only when each has one query row and all
        // read the same keys and values, with queries `dq` apart: see `shared_kv_runs`)
        // into `o`, as one batch of `rows` query rows.
        let direct = |o: &mut [T], b0: usize, batches: usize, dq: isize| {
            let [oq, ok, ov, om] = offs[b0];
            let (rows, q_stride) = if batches == 1 { (l, qs) } else { (batches, dq) };
            // Query row r's row within its batch and where its batch's mask starts.
            let row_of = |r: usize| match batches {
                1 => (r, om),
                _ => (0, offs[b0 + r][3]),
            };
            with_scores(rows * s, |scores: &mut [T]| {
                let (q, k, v) = ((&vq, oq, q_stride), (&vk, ok, ks), (&vv, ov, vs));
                if let Some(kind) = avx2_f32 {
                    // SAFETY: T is f32 and W is read as `kind` (`fast_kind`); the rows lie in
                    // checked views with unit stride along e/ev (`direct_ok`); scores holds
                    // rows·s and o rows·ev elements.
                    unsafe {
                        fast::scores(
                            scores.as_mut_ptr().cast(),
                            rows_f32(q),
                            (row_bytes(k), kind),
                            (rows, s, e),
                        )
                    };
                } else {
                    simd::wide(
                        #[inline(always)]
                        || scores_direct(scores, q, k, (rows, s, e)),
                    );
                }
                let factors: Vec<T> = (scores.chunks_mut(s.max(1)).enumerate().take(rows))
                    .map(|(r, row)| {
                        let (i, om) = row_of(r);
                        finish_row(row, i, om)
                    })
                    .collect();
                if let Some(kind) = avx2_f32 {
                    // SAFETY: as above.
                    unsafe {
                        fast::weighted(
                            o.as_mut_ptr().cast(),
                            scores.as_ptr().cast(),
                            (row_bytes(v), kind),
                            (rows, s, ev),
                        )
                    };
                } else {
                    simd::wide(
                        #[inline(always)]
                        || weighted_rows(o, scores, v, (s, ev)),
                    );
                }
                simd::wide(
                    #[inline(always)]
                    || scale_rows(o, ev, &factors),
                );
            })
        };
        let parallel = threads > 1 && offs.len() * l * s * (e + ev) >= PAR_MIN_WORK;
        if direct_ok {
            let runs = match l {
                1 => shared_kv_runs(&offs),
                _ => (0..offs.len()).map(|b| (b, 1, 0)).collect(),
            };
            let span =
                |&(b0, batches, _): &(usize, usize, isize)| b0 * l * ev..(b0 + batches) * l * ev;
            // Runs of batches (heads) in parallel when there are several.
            if parallel && runs.len() > 1 {
                let parts: Vec<_> = runs.iter().map(span).collect();
                par::for_parts_mut(out, &parts, |t, o| {
                    let (b0, batches, dq) = runs[t];
                    direct(o, b0, batches, dq)
                });
            } else {
                for run in &runs {
                    let (b0, batches, dq) = *run;
                    direct(&mut out[span(run)], b0, batches, dq);
                }
            }
            return Ok(());
        }
        // Blocks of query rows: causal blocks skip the keys none of their rows sees, and
        // every (batch, block) is a task, so one long sequence spreads over the threads too.
        let blocks = l.div_ceil(QUERY_BLOCK);
        let part = |t: usize| {
            let (b, i0) = (t / blocks, (t % blocks) * QUERY_BLOCK);
            (b * l + i0) * ev..(b * l + (i0 + QUERY_BLOCK).min(l)) * ev
        };
        let parts: Vec<_> = (0..offs.len() * blocks).map(part).collect();
        let run = |t: usize, o: &mut [T], threads: usize| {
            by_gemm(o, t / blocks, (t % blocks) * QUERY_BLOCK, threads)
        };
        if parallel && parts.len() > 1 {
            par::for_parts_mut(out, &parts, |t, o| run(t, o, 1));
        } else {
            for (t, range) in parts.iter().enumerate() {
                run(t, &mut out[range.clone()], threads);
            }
        }
        Ok(())
    })
}

/// Multiply-adds below which the heads of one call run on one thread.
const PAR_MIN_WORK: usize = 1 << 17;

/// Query rows per GEMM task: a causal block skips the keys none of its rows sees (about
/// half the work of a long sequence), and a single long sequence splits into tasks for the
/// threads. Smaller blocks (36) measured no faster at 64–512 tokens: each task's two
/// products have a fixed cost.
const QUERY_BLOCK: usize = 64;

/// Query rows per batch up to which attention skips the GEMMs (see `direct` above).
const DIRECT_MAX_ROWS: usize = 8;

/// Runs `(first batch, batches, query stride)` of consecutive one-row batches that read the
/// same keys and values with their queries evenly spaced — the query heads sharing one
/// key/value head in grouped-query decode — so that the direct kernel reads each key and
/// value row once for the whole group (at most `DIRECT_MAX_ROWS` batches a run).
fn shared_kv_runs(offs: &[[isize; 4]]) -> Vec<(usize, usize, isize)> {
    let mut runs = Vec::new();
    let mut b = 0;
    while b < offs.len() {
        let [oq, ok, ov, _] = offs[b];
        let dq = offs.get(b + 1).map_or(0, |next| next[0] - oq);
        let mut batches = 1;
        while batches < DIRECT_MAX_ROWS
            && offs
                .get(b + batches)
                .is_some_and(|&[q, k, v, _]| k == ok && v == ov && q == oq + batches as isize * dq)
        {
            batches += 1;
        }
        runs.push((b, batches, dq));
        b += batches;
    }
    runs
}

/// The key matrices of an attention call in sgemm's panel layout (as right operands
/// `e`×`s`, i.e. transposed), one per distinct key matrix.
struct PackedKeys {
    panels: Vec<f32>,
    /// Floats per key matrix.
    len: usize,
    /// Per batch, which key matrix it reads.
    slot: Vec<usize>,
}

impl PackedKeys {
    fn of(&self, batch: usize) -> &[f32] {
        let at = self.slot[batch] * self.len;
        &self.panels[at..at + self.len]
    }
}

/// Packs the key matrix of every batch (once per distinct one) for `sgemm`; `k` is f32.
fn pack_keys<T>(
    k: &View<T>,
    offs: &[[isize; 4]],
    (s, e): (usize, usize),
    threads: usize,
) -> PackedKeys {
    let r = k.strides.len();
    let mut distinct: Vec<isize> = Vec::new();
    let slot = offs
        .iter()
        .map(
            |&[_, ok, _, _]| match distinct.iter().position(|&d| d == ok) {
                Some(i) => i,
                None => {
                    distinct.push(ok);
                    distinct.len() - 1
                }
            },
        )
        .collect();
    let len = sgemm::panels_len(e, s);
    let mut panels = vec![0.0f32; len * distinct.len()];
    let pack = |i: usize, dst: &mut [f32]| {
        // kᵀ: element (d, j) is key j's element d.
        let src = sgemm::Strided {
            ptr: k.ptr.wrapping_offset(distinct[i]).cast(),
            rs: k.strides[r - 1],
            cs: k.strides[r - 2],
        };
        // SAFETY: the batch's s×e keys lie in the checked view `k` (f32 by the caller); dst
        // holds panels_len(e, s) floats.
        unsafe { sgemm::pack_right(dst, e, s, src) };
    };
    if threads > 1 && distinct.len() > 1 {
        par::for_chunks_mut(&mut panels, len.max(1), |start, dst| {
            pack(start / len.max(1), dst)
        });
    } else {
        for (i, dst) in panels.chunks_mut(len.max(1)).enumerate() {
            pack(i, dst);
        }
    }
    PackedKeys { panels, len, slot }
}

/// Each `n`-long row of `o` times its factor: the softmax's division, done on the weighted
/// values (`n` per row) rather than on the weights (one per key).
#[inline(always)]
fn scale_rows<T: Real>(o: &mut [T], n: usize, factors: &[T]) {
    for (row, &f) in o.chunks_mut(n.max(1)).zip(factors) {
        for x in row {
            *x = *x * f;
        }
    }
}

/// `x · scale` over a row of scores.
#[inline(always)]
fn scale_row<T: Real>(row: &mut [T], scale: T) {
    for x in row {
        *x = *x * scale;
    }
}

/// `x · scale + bias` over a row of scores (the bias row contiguous).
#[inline(always)]
fn scale_add_row<T: Real>(row: &mut [T], scale: T, bias: &[T]) {
    for (x, &b) in row.iter_mut().zip(bias) {
        *x = *x * scale + b;
    }
}

/// `-inf` wherever the (contiguous) boolean mask row hides a key.
#[inline(always)]
fn hide_row<T: Real>(row: &mut [T], keep: &[B8]) {
    for (x, k) in row.iter_mut().zip(keep) {
        if !k.get() {
            *x = -T::INF;
        }
    }
}

/// `f` on `n` elements of this thread's scratch viewed as `T` (f32 or f64), for score rows:
/// every user writes all of them before reading any, and a fresh allocation per task was
/// mapped and page-faulted in once the rows of a long sequence grew large.
fn with_scores<T: Real, R>(n: usize, f: impl FnOnce(&mut [T]) -> R) -> R {
    let words = (n * std::mem::size_of::<T>()).div_ceil(8);
    with_scratch(words, |p| {
        // SAFETY: the scratch holds at least n·size_of::<T>() bytes, 8-byte aligned (T is f32
        // or f64, for which any bits are a value), and nothing else uses it meanwhile.
        f(unsafe { std::slice::from_raw_parts_mut(p.cast::<T>(), n) })
    })
}

/// A batch's rows: the view, the offset of row 0, the row stride (elements contiguous).
type Rows<'a, T> = (&'a View<T>, isize, isize);

/// `scores[i·s + j] = q_i · k_j` for `l` query rows and `s` key rows of `e` elements: each
/// key row is read once for all query rows. A named, always-inlined function so that all of
/// it lands in `simd::wide`'s AVX2 copy (a closure body there stayed an SSE call).
#[inline(always)]
fn scores_direct<T: Real, W: KvElem<T>>(
    scores: &mut [T],
    (q, oq, qs): Rows<T>,
    (k, ok, ks): Rows<W>,
    (l, s, e): (usize, usize, usize),
) {
    for j in 0..s {
        let krow = k.run(ok + j as isize * ks, e);
        for i in 0..l {
            scores[i * s + j] = dot(q.run(oq + i as isize * qs, e), krow);
        }
    }
}

/// `o_i = Σ_j p[i·s + j] · v_j` for the rows of `o` (each `ev` long): each value row is read
/// once for all of them.
#[inline(always)]
fn weighted_rows<T: Real, W: KvElem<T>>(
    o: &mut [T],
    p: &[T],
    (v, ov, vs): Rows<W>,
    (s, ev): (usize, usize),
) {
    o.fill(<T as Real>::ZERO);
    for j in 0..s {
        let vrow = v.run(ov + j as isize * vs, ev);
        for (i, orow) in o.chunks_exact_mut(ev).enumerate() {
            let w = p[i * s + j];
            for (d, &x) in orow.iter_mut().zip(vrow) {
                *d = *d + w * x.widen();
            }
        }
    }
}

/// Row 0's address and the row stride, for the f32 kernels (`T` must be f32).
fn rows_f32<T>((v, off, stride): Rows<T>) -> (*const f32, isize) {
    (v.ptr.wrapping_offset(off).cast(), stride)
}

/// Row 0's address and the row stride (in elements), for the f32 kernels reading rows of
/// the kind they are told.
fn row_bytes<W>((v, off, stride): Rows<W>) -> (*const u8, isize) {
    (v.ptr.wrapping_offset(off).cast(), stride)
}

/// The direct kernel's two loops for f32 with AVX2 and FMA; key and value rows are f32,
/// or bf16/f16 widened as they are loaded (`RowWeight`).
mod fast {
    use super::RowKind;
    #[cfg(target_arch = "x86_64")]
    use half::{bf16, f16};

    /// `scores[i·s + j] = q_i · k_j` (rows of `e` contiguous elements; k's of `kind`).
    ///
    /// # Safety
    /// `fast_loops()`; `l` q rows and `s` k rows readable; `scores` holds l·s.
    pub unsafe fn scores(
        scores: *mut f32,
        (q, qs): (*const f32, isize),
        ((k, ks), kind): ((*const u8, isize), RowKind),
        (l, s, e): (usize, usize, usize),
    ) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract.
        unsafe {
            let dims = (l, s, e);
            match kind {
                RowKind::F32 => x86::scores::<f32>(scores, (q, qs), (k.cast(), ks), dims),
                RowKind::Bf16 => x86::scores::<bf16>(scores, (q, qs), (k.cast(), ks), dims),
                RowKind::F16 => x86::scores::<f16>(scores, (q, qs), (k.cast(), ks), dims),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (scores, q, qs, k, ks, kind, l, s, e);
            unreachable!("runs only where sgemm::available()");
        }
    }

    /// `o_i = Σ_j p[i·s + j] · v_j` for `l` rows of `ev` (contiguous value rows of `kind`).
    ///
    /// # Safety
    /// `fast_loops()`; `s` v rows readable; `p` holds l·s, `o` l·ev.
    pub unsafe fn weighted(
        o: *mut f32,
        p: *const f32,
        ((v, vs), kind): ((*const u8, isize), RowKind),
        (l, s, ev): (usize, usize, usize),
    ) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract.
        unsafe {
            let dims = (l, s, ev);
            match kind {
                RowKind::F32 => x86::weighted::<f32>(o, p, (v.cast(), vs), dims),
                RowKind::Bf16 => x86::weighted::<bf16>(o, p, (v.cast(), vs), dims),
                RowKind::F16 => x86::weighted::<f16>(o, p, (v.cast(), vs), dims),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (o, p, v, vs, kind, l, s, ev);
            unreachable!("runs only where sgemm::available()");
        }
    }

    #[cfg(target_arch = "x86_64")]
    mod x86 {
        use std::arch::x86_64::*;

        use super::super::RowWeight;

        /// Σ a[i]·b[i] over `n` elements: two vector accumulators, then the tail.
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn dot<W: RowWeight>(a: *const f32, b: *const W, n: usize) -> f32 {
            // SAFETY (whole body): a and b address n elements (caller).
            unsafe {
                let (mut x, mut y) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                let mut i = 0;
                while i + 16 <= n {
                    x = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), W::load8(b.add(i)), x);
                    let (a8, b8) = (a.add(i + 8), b.add(i + 8));
                    y = _mm256_fmadd_ps(_mm256_loadu_ps(a8), W::load8(b8), y);
                    i += 16;
                }
                if i + 8 <= n {
                    x = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), W::load8(b.add(i)), x);
                    i += 8;
                }
                let v = _mm256_add_ps(x, y);
                let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
                let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
                let mut r = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
                while i < n {
                    r += *a.add(i) * (*b.add(i)).to_f32();
                    i += 1;
                }
                r
            }
        }

        #[target_feature(enable = "avx2,fma,f16c")]
        pub unsafe fn scores<W: RowWeight>(
            scores: *mut f32,
            (q, qs): (*const f32, isize),
            (k, ks): (*const W, isize),
            (l, s, e): (usize, usize, usize),
        ) {
            // Eight keys at a time: eight sums of lanes, reduced together into one vector
            // of eight scores (a horizontal sum per key cost more than its products).
            let whole = e - e % 8;
            let mut j = 0;
            while j + 8 <= s {
                for i in 0..l {
                    // SAFETY: rows inside the caller's ranges.
                    unsafe {
                        let qr = q.offset(i as isize * qs);
                        let mut acc = [_mm256_setzero_ps(); 8];
                        let mut d = 0;
                        while d < whole {
                            let qv = _mm256_loadu_ps(qr.add(d));
                            for (kk, a) in acc.iter_mut().enumerate() {
                                let kr = k.offset((j + kk) as isize * ks).add(d);
                                *a = _mm256_fmadd_ps(qv, W::load8(kr), *a);
                            }
                            d += 8;
                        }
                        let mut sums = [0.0f32; 8];
                        _mm256_storeu_ps(sums.as_mut_ptr(), sum8(acc));
                        for (kk, sum) in sums.iter_mut().enumerate() {
                            let kr = k.offset((j + kk) as isize * ks);
                            for d in whole..e {
                                *sum += *qr.add(d) * (*kr.add(d)).to_f32();
                            }
                            *scores.add(i * s + j + kk) = *sum;
                        }
                    }
                }
                j += 8;
            }
            for j in j..s {
                // SAFETY: rows inside the caller's ranges.
                unsafe {
                    let kr = k.offset(j as isize * ks);
                    for i in 0..l {
                        *scores.add(i * s + j) = dot(q.offset(i as isize * qs), kr, e);
                    }
                }
            }
        }

        /// Lane k of the result: the sum of the lanes of `v[k]`.
        #[target_feature(enable = "avx2,fma")]
        #[inline]
        unsafe fn sum8(v: [__m256; 8]) -> __m256 {
            // Pairs of rows added lane by lane, then 128-bit halves crossed: three rounds.
            let a = _mm256_hadd_ps(v[0], v[1]);
            let b = _mm256_hadd_ps(v[2], v[3]);
            let c = _mm256_hadd_ps(v[4], v[5]);
            let d = _mm256_hadd_ps(v[6], v[7]);
            let ab = _mm256_hadd_ps(a, b);
            let cd = _mm256_hadd_ps(c, d);
            // ab = [v0 v1 v2 v3 | v0 v1 v2 v3] partial sums of the low and high halves.
            let lo = _mm256_permute2f128_ps(ab, cd, 0x20);
            let hi = _mm256_permute2f128_ps(ab, cd, 0x31);
            _mm256_add_ps(lo, hi)
        }

        /// Per output row, blocks of 32 (then 8) columns accumulate over all `s` value rows
        /// in registers; the last columns one by one.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub unsafe fn weighted<W: RowWeight>(
            o: *mut f32,
            p: *const f32,
            (v, vs): (*const W, isize),
            (l, s, ev): (usize, usize, usize),
        ) {
            // SAFETY (whole body): every address is inside the caller's ranges.
            unsafe {
                for i in 0..l {
                    let (pi, out) = (p.add(i * s), o.add(i * ev));
                    let mut d = 0;
                    while d + 32 <= ev {
                        // Even and odd value rows into separate sums: eight independent
                        // chains of FMAs, enough to hide their latency (four were not).
                        let (mut even, mut odd) =
                            ([_mm256_setzero_ps(); 4], [_mm256_setzero_ps(); 4]);
                        // A macro, not a closure: a closure's body may not get AVX2.
                        macro_rules! step {
                            ($acc:ident, $j:expr) => {{
                                let w = _mm256_set1_ps(*pi.add($j));
                                let row = v.offset($j as isize * vs).add(d);
                                for (b, a) in $acc.iter_mut().enumerate() {
                                    *a = _mm256_fmadd_ps(w, W::load8(row.add(8 * b)), *a);
                                }
                            }};
                        }
                        let mut j = 0;
                        while j + 2 <= s {
                            step!(even, j);
                            step!(odd, j + 1);
                            j += 2;
                        }
                        if j < s {
                            step!(even, j);
                        }
                        for b in 0..4 {
                            let sum = _mm256_add_ps(even[b], odd[b]);
                            _mm256_storeu_ps(out.add(d + 8 * b), sum);
                        }
                        d += 32;
                    }
                    while d + 8 <= ev {
                        let mut acc = _mm256_setzero_ps();
                        for j in 0..s {
                            let row = v.offset(j as isize * vs).add(d);
                            acc = _mm256_fmadd_ps(_mm256_set1_ps(*pi.add(j)), W::load8(row), acc);
                        }
                        _mm256_storeu_ps(out.add(d), acc);
                        d += 8;
                    }
                    for c in d..ev {
                        let mut acc = 0.0f32;
                        for j in 0..s {
                            acc += *pi.add(j) * (*v.offset(j as isize * vs).add(c)).to_f32();
                        }
                        *out.add(c) = acc;
                    }
                }
            }
        }
    }
}

/// `a · b` with eight independent partial sums (vectorizable, and the same order on every
/// build), added pairwise at the end.
#[inline(always)]
fn dot<T: Real, W: KvElem<T>>(a: &[T], b: &[W]) -> T {
    let mut acc = [<T as Real>::ZERO; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let mut tail = <T as Real>::ZERO;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail = tail + *x * y.widen();
    }
    for (x, y) in ca.zip(cb) {
        for lane in 0..8 {
            acc[lane] = acc[lane] + x[lane] * y[lane].widen();
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}
