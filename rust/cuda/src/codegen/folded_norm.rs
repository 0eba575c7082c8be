//! RMS norms computed inside the products that read them. A decode layer normalizes one
//! row before its q, k and v products and again before its gate and up products; as a
//! step of its own each norm is a launch of a single block whose whole work is a few
//! microseconds of latency. Where every reader of a norm is a `cuda.warp_dot` product
//! taking it as its rows (`a`), each warp sums the squares of its row itself (the row is
//! a few KB, read from cache by every warp of an SM) and normalizes the values as it
//! multiplies them: the norm needs no launch and no memory, and a decode layer takes two
//! launches fewer (four for transformers' 16-bit norms, which are two kernels otherwise).
//!
//! Two forms are folded, each computed as its kernels would round it:
//! * `rms_norm(x, w)` (`F.rms_norm`, ONNX): `round((x · rstd) · w)`;
//! * transformers' `w * rms_norm(x.to(f32)).to(dtype)` in f16/bf16:
//!   `round(round(x · rstd) · w)`.

use std::collections::BTreeSet;

use ember_core::dim::Dim;
use ember_core::dtype::DType;
use ember_core::ir::{BinaryOp, Graph, Op};

use super::{in_memory_through_reshape, keeps_order, swaps_last_two, Mem, KERNEL_WARP_DOT};

/// A norm a product computes in place of reading it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FoldedNorm {
    /// The node the products read as their rows (kept out of memory).
    pub rows: usize,
    /// The RMS norm node: `rows` itself, or the norm inside it (kept out of memory too).
    pub norm: usize,
    /// The node in memory holding the norm's input as contiguous rows of the norm's width.
    pub x: usize,
    /// The node in memory holding the weight (one value per column), if there is one.
    pub w: Option<usize>,
    pub eps: f64,
    /// The rows' dtype, which `x` and `w` have too.
    pub dtype: DType,
    /// The normalized values are rounded to `dtype` before the weight multiplies them.
    pub rounds_before_weight: bool,
}

/// The RMS norm over the last axis that `a` is (either form), directly or through views
/// keeping both the elements' order and the last dim (so a row of `a` is a row of the
/// norm), with its input and weight where `is_stored` says they are in memory.
fn norm_of(g: &Graph, mut a: usize, is_stored: &impl Fn(usize) -> bool) -> Option<FoldedNorm> {
    let width = g.ty(a).shape.last()?.clone();
    let dtype = g.ty(a).dtype;
    if !matches!(dtype, DType::F16 | DType::BF16 | DType::F32) {
        return None;
    }
    while !is_norm(&g.nodes[a].op) && g.nodes[a].op != Op::Binary(BinaryOp::Mul) {
        if !keeps_order(g, a) {
            return None;
        }
        a = g.nodes[a].inputs[0];
        if g.ty(a).shape.last() != Some(&width) {
            return None;
        }
    }
    let stored = |x: usize, dtype: DType| {
        let m = super::stored_in_order(g, x, is_stored)?;
        (g.ty(x).dtype == dtype).then_some(m)
    };
    let n = &g.nodes[a];
    if let Op::RmsNorm {
        axis,
        eps,
        has_weight,
    } = n.op
    {
        if n.ty.dtype != dtype || axis + 1 != n.ty.shape.len() {
            return None;
        }
        return Some(FoldedNorm {
            rows: a,
            norm: a,
            x: stored(n.inputs[0], dtype)?,
            w: match has_weight {
                true => Some(stored(n.inputs[1], dtype)?),
                false => None,
            },
            eps,
            dtype,
            rounds_before_weight: false,
        });
    }
    // `w * cast(rms_norm(cast(x, f32)), dtype)`, the weight on either side.
    if dtype == DType::F32 || n.ty.dtype != dtype {
        return None;
    }
    let (p, q) = (n.inputs[0], n.inputs[1]);
    let (w, rounded) = match row_vector(g, p, is_stored, &width) {
        Some(w) => (w, q),
        None => (row_vector(g, q, is_stored, &width)?, p),
    };
    let norm = cast_of(g, rounded, dtype)?;
    let Op::RmsNorm {
        axis,
        eps,
        has_weight: false,
    } = g.nodes[norm].op
    else {
        return None;
    };
    let widened = g.nodes[norm].inputs[0];
    if g.ty(norm).dtype != DType::F32 || axis + 1 != g.ty(norm).shape.len() {
        return None;
    }
    let x = cast_of(g, widened, DType::F32)?;
    if g.ty(w).dtype != dtype {
        return None;
    }
    Some(FoldedNorm {
        rows: a,
        norm,
        x: stored(x, dtype)?,
        w: Some(w),
        eps,
        dtype,
        rounds_before_weight: true,
    })
}

fn is_norm(op: &Op) -> bool {
    matches!(op, Op::RmsNorm { .. })
}

/// The input of `x` where `x` casts it to `to` (of the same shape).
fn cast_of(g: &Graph, x: usize, to: DType) -> Option<usize> {
    match g.nodes[x].op {
        Op::Cast { to: t } if t == to => Some(g.nodes[x].inputs[0]),
        _ => None,
    }
}

/// The node in memory of `width` values that `x` repeats along every row (its element
/// `[.., k]` is element `k` of that node): reached through reshapes to and expands of
/// `[1, .., 1, width]`.
fn row_vector(
    g: &Graph,
    mut x: usize,
    is_stored: &impl Fn(usize) -> bool,
    width: &Dim,
) -> Option<usize> {
    let ones = |s: &[Dim]| {
        s[..s.len().saturating_sub(1)]
            .iter()
            .all(|d| d.as_const() == Some(1))
    };
    loop {
        let shape = &g.ty(x).shape;
        if shape.last() != Some(width) {
            return None;
        }
        if is_stored(x) {
            return ones(shape).then_some(x);
        }
        x = match &g.nodes[x].op {
            Op::Reshape { .. } if ones(shape) => g.nodes[x].inputs[0],
            Op::Expand { .. } if ones(&g.ty(g.nodes[x].inputs[0]).shape) => g.nodes[x].inputs[0],
            _ => return None,
        };
    }
}

/// The norm a generated product computes for its operand `a` (the planner left it out of
/// memory: see `fold_norms`).
pub(crate) fn folded_norm(g: &Graph, in_memory: &[bool], a: usize) -> Option<FoldedNorm> {
    let f = norm_of(g, a, &|n| in_memory[n])?;
    (!in_memory[f.rows] && !in_memory[f.norm]).then_some(f)
}

/// Keeps in memory the input of each norm that will be folded but whose input would be
/// recomputed inside the norm's own kernel (the last layer's residual add, read by the
/// final norm alone): the product writing it as its epilogue is then what computes it,
/// as in every other layer. Runs before the products' epilogues are planned.
pub(crate) fn keep_norm_inputs(
    g: &Graph,
    mem: &mut [Mem],
    consumers: &[BTreeSet<usize>],
    is_output: &[bool],
) {
    for rows in 0..g.nodes.len() {
        if is_output[rows] || !read_only_as_rows(g, mem, consumers, is_output, rows, rows) {
            continue;
        }
        // The norm's input as if everything were in memory: what must be.
        let Some(x) = norm_of(g, rows, &|_| true)
            .filter(|f| f.rows == rows)
            .map(|f| f.x)
        else {
            continue;
        };
        if mem[x] != Mem::Inline || super::is_view(&g.nodes[x].op) {
            continue;
        }
        mem[x] = Mem::Buffer;
        if norm_of(g, rows, &|n| mem[n] != Mem::Inline).is_none_or(|f| f.rows != rows) {
            mem[x] = Mem::Inline; // not foldable after all (dtype, axis, weight)
        }
    }
}

/// The norms to fold: in memory (so planned a step), not a program output, and read
/// only — directly or through such views — as the rows of `cuda.warp_dot` products whose
/// other operand is a transposed node in memory (what the products' packed loads read);
/// for the second form, the norm and its cast read by nothing else.
pub(crate) fn fold_norms(
    g: &Graph,
    mem: &mut [Mem],
    consumers: &[BTreeSet<usize>],
    is_output: &[bool],
) {
    for rows in 0..g.nodes.len() {
        let planned = mem[rows] == Mem::Buffer && !is_output[rows];
        if !planned || !read_only_as_rows(g, mem, consumers, is_output, rows, rows) {
            continue;
        }
        let Some(f) = norm_of(g, rows, &|n| mem[n] != Mem::Inline).filter(|f| f.rows == rows)
        else {
            continue;
        };
        if f.norm != rows {
            // norm → cast → rows, each read only by the next (the cast computed in place).
            let cast = consumers[f.norm].first().copied();
            let chain = consumers[f.norm].len() == 1
                && !is_output[f.norm]
                && cast.is_some_and(|c| {
                    consumers[c].len() == 1
                        && consumers[c].contains(&rows)
                        && !is_output[c]
                        && mem[c] == Mem::Inline
                });
            if !chain {
                continue;
            }
            mem[f.norm] = Mem::Inline;
        }
        mem[rows] = Mem::Inline;
    }
}

/// Whether `node` (a norm's rows, or a view of them) is read only — directly or through
/// views keeping the last dim — as the rows of `cuda.warp_dot` products of the rows'
/// dtype whose other operand is the transpose of a node in memory.
fn read_only_as_rows(
    g: &Graph,
    mem: &[Mem],
    consumers: &[BTreeSet<usize>],
    is_output: &[bool],
    rows: usize,
    node: usize,
) -> bool {
    let width = g.ty(rows).shape.last();
    !consumers[node].is_empty()
        && consumers[node].iter().all(|&c| {
            let n = &g.nodes[c];
            if is_output[c] {
                return false;
            }
            if keeps_order(g, c) {
                return g.ty(c).shape.last() == width
                    && read_only_as_rows(g, mem, consumers, is_output, rows, c);
            }
            let warp = matches!(&n.op, Op::Kernel { name, .. } if name == KERNEL_WARP_DOT);
            let b = n.inputs.get(1).copied();
            warp && n.inputs[0] == node
                && b != Some(node)
                && n.ty.dtype == g.ty(rows).dtype
                && b.is_some_and(|b| {
                    let (ash, bsh) = (&g.ty(node).shape, &g.ty(b).shape);
                    let r = ash.len();
                    swaps_last_two(&g.nodes[b].op)
                        && bsh.len() == r
                        && bsh[..r - 2] == ash[..r - 2]
                        && in_memory_through_reshape(g, mem, g.nodes[b].inputs[0]).is_some()
                })
        })
}
