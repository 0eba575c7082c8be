//! Horizontal merging: products that share their left operand (attention's q/k/v
//! projections, a gated MLP's gate and up) ⇄ one product with the weights concatenated,
//! sliced back apart. One wider GEMM instead of several narrow ones means fewer thread
//! hand-offs and fuller register tiles; the concatenated weight is computed once at compile
//! time (backends fold weight-only subgraphs). The merge pays only when every member
//! switches to it together: `search::candidates` offers such coordinated changes.

use std::collections::BTreeMap;

use super::encode::{dtype_lit, lit, node_source_key, op_key, term, Vocabulary};
use super::rules::RuleWriter;
use crate::backend::MAX_FOLDED_ELEMS;
use crate::dim::{format_shape, Dim};
use crate::ir::{Graph, Op};

/// Most products merged into one (a larger group is merged in chunks of this size).
const MAX_MEMBERS: usize = 8;

/// How a product's right operand holds its weight.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Form {
    /// `x · wᵀ` with `w: [N, K]` (a `linear`): weights concatenate along axis 0.
    Transposed,
    /// `x · w` with `w: [K, N]`: weights concatenate along axis 1.
    Plain,
}

/// One product of a group: its weight's node id, output width N and element count.
struct Member {
    weight: usize,
    width: i64,
    elems: i64,
}

/// One rule per group of rank-2 products of weights whose left operands are the same
/// expression (structurally: the frontends repeat `reshape(x)` for each projection).
pub(super) fn dot_merge_rules(graph: &Graph, vocab: &mut Vocabulary, w: &mut RuleWriter) {
    for ((_, form), members) in groups(graph) {
        for chunk in chunks(&members) {
            if chunk.len() >= 2 {
                rule(graph, vocab, w, form, chunk);
            }
        }
    }
}

/// Consecutive runs of at most `MAX_MEMBERS` products whose concatenated weight backends
/// still compute at compile time: a larger one would be concatenated on every call.
fn chunks(members: &[Member]) -> Vec<&[Member]> {
    let mut out = Vec::new();
    let (mut start, mut elems) = (0, 0);
    for (i, m) in members.iter().enumerate() {
        if i > start && (i - start == MAX_MEMBERS || elems + m.elems > MAX_FOLDED_ELEMS) {
            out.push(&members[start..i]);
            (start, elems) = (i, 0);
        }
        elems += m.elems;
    }
    if start < members.len() {
        out.push(&members[start..]);
    }
    out
}

/// Products grouped by (canonical left operand, form), in graph order, each weight once.
fn groups(graph: &Graph) -> BTreeMap<(usize, Form), Vec<Member>> {
    // Hash-consing: equal ops of equal inputs get one canonical id, as in the e-graph.
    let mut canon = vec![0usize; graph.nodes.len()];
    let mut seen: BTreeMap<(String, Vec<usize>), usize> = BTreeMap::new();
    for (id, node) in graph.nodes.iter().enumerate() {
        canon[id] = if node.inputs.is_empty() {
            id
        } else {
            let key = (
                op_key(&node.op),
                node.inputs.iter().map(|&i| canon[i]).collect(),
            );
            *seen.entry(key).or_insert(id)
        };
    }
    let is_weight =
        |id: usize| matches!(graph.nodes[id].op, Op::Weight { .. }) && graph.ty(id).rank() == 2;
    let mut out: BTreeMap<(usize, Form), Vec<Member>> = BTreeMap::new();
    for node in &graph.nodes {
        let (Op::Dot, [x, r]) = (&node.op, node.inputs.as_slice()) else {
            continue;
        };
        if graph.ty(*x).rank() != 2 {
            continue;
        }
        let rhs = &graph.nodes[*r];
        let (form, weight) = match (&rhs.op, rhs.inputs.as_slice()) {
            (Op::Permute { perm }, [s]) if perm == &[1, 0] && is_weight(*s) => {
                (Form::Transposed, *s)
            }
            _ if is_weight(*r) => (Form::Plain, *r),
            _ => continue,
        };
        let Some(width) = node.ty.shape[1].as_const() else {
            continue;
        };
        let Some(elems) = graph.ty(weight).shape.iter().map(Dim::as_const).product() else {
            continue;
        };
        let group = out.entry((canon[*x], form)).or_default();
        if !group.iter().any(|m| m.weight == weight) {
            group.push(Member {
                weight,
                width,
                elems,
            });
        }
    }
    out
}

/// `dot(x, w_j)` for every member j ⇒ each is `slice_j(dot(x, concat(w…)))`.
fn rule(graph: &Graph, vocab: &mut Vocabulary, w: &mut RuleWriter, form: Form, members: &[Member]) {
    let dtype = graph.ty(members[0].weight).dtype;
    let d = dtype_lit(dtype);
    let dot = lit(&vocab.op(&Op::Dot));
    let perm = lit(&vocab.op(&Op::Permute { perm: vec![1, 0] }));
    let src = |m: &Member| format!("(Src {} {d} 2)", lit(&node_source_key(m.weight)));
    let rhs_of = |weight: String| match form {
        Form::Transposed => format!("(Op1 {perm} {weight} {d} 2)"),
        Form::Plain => weight,
    };
    let mut query = String::new();
    for (j, m) in members.iter().enumerate() {
        query += &format!("(= e{j} (Op2 {dot} x {} {d} 2)) ", rhs_of(src(m)));
    }
    let axis = match form {
        Form::Transposed => 0,
        Form::Plain => 1,
    };
    let concat = lit(&vocab.op(&Op::Concat { axis }));
    let weights: Vec<String> = members.iter().map(src).collect();
    let merged_rhs = rhs_of(term(&concat, &weights, &d, "2"));
    let mut actions = format!("(let m (Op2 {dot} x {merged_rhs} {d} 2))");
    let mut start = 0i64;
    for (j, m) in members.iter().enumerate() {
        let slice = lit(&vocab.op(&Op::Slice {
            axis: 1,
            start: Dim::from(start),
            end: Dim::from(start + m.width),
            step: 1,
        }));
        actions += &format!(" (union e{j} (Op1 {slice} m {d} 2))");
        start += m.width;
    }
    let widths: Vec<Dim> = members.iter().map(|m| Dim::from(m.width)).collect();
    w.rule(
        "fuse",
        &format!("dot-merge-{dtype}-{}", format_shape(&widths)),
        query.trim_end(),
        &actions,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(elems: i64) -> Member {
        Member {
            weight: 0,
            width: 1,
            elems,
        }
    }

    fn sizes(members: &[Member]) -> Vec<usize> {
        chunks(members).iter().map(|c| c.len()).collect()
    }

    #[test]
    fn groups_split_at_the_member_and_fold_limits() {
        assert_eq!(sizes(&(0..3).map(|_| member(10)).collect::<Vec<_>>()), [3]);
        assert_eq!(
            sizes(&(0..10).map(|_| member(10)).collect::<Vec<_>>()),
            [8, 2]
        );
        // q/k/v of a 2048-wide model: 3 × 4 M elements, each alone (not merged).
        let wide: Vec<_> = (0..3).map(|_| member(2048 * 2048)).collect();
        assert_eq!(sizes(&wide), [1, 1, 1]);
        let half = MAX_FOLDED_ELEMS / 2;
        assert_eq!(sizes(&[member(half), member(half), member(1)]), [2, 1]);
    }
}
