//! Grouped-query attention without repeating the shared heads.
//!
//! A model with fewer key/value heads than query heads repeats each shared head for its
//! group of queries before attention (transformers' `repeat_kv`, or SDPA's `enable_gqa`
//! as the frontend expands it): `reshape(expand(reshape(k)))` from `[B, Hkv, S, E]` to
//! `[B, Hkv·G, S, E]`. The last reshape merges a broadcast axis, which no strided view can
//! express, so it was copied in full for every layer on every call — with a static KV
//! cache, the whole cache (42 % of a decode step at 1024 positions).
//!
//! Here the attention runs one axis wider instead: queries `[B, Hkv, G, L, E]` against the
//! expanded keys `[B, Hkv, G, S, E]` (a stride-0 view of the shared heads, which the
//! attention kernel reads once per group), and its result is reshaped back to
//! `[B, H, L, Ev]`. Same values, no copy.

use ember_core::dim::{numel, Dim};
use ember_core::ir::{infer_type, Graph, Node, Op, ValueId};
use ember_core::Result;

/// The shared heads behind an attention operand `reshape(expand(x))`: the expand node
/// (`[B.., Hkv, G, S, E]`) when the reshape only merges its `Hkv` and `G` axes.
fn repeated_heads(g: &Graph, operand: ValueId) -> Option<ValueId> {
    let merged = &g.nodes[operand];
    if !matches!(merged.op, Op::Reshape { .. }) {
        return None;
    }
    let expanded = merged.inputs[0];
    let e = &g.nodes[expanded];
    if !matches!(e.op, Op::Expand { .. }) {
        return None;
    }
    let (out, wide) = (&merged.ty.shape, &e.ty.shape);
    let r = out.len();
    if r < 3 || wide.len() != r + 1 {
        return None;
    }
    // [B.., Hkv, G, S, E] → [B.., Hkv·G, S, E]: everything else unchanged.
    let heads = numel(&wide[r - 3..r - 1]);
    let same = out[..r - 3] == wide[..r - 3] && out[r - 2..] == wide[r - 1..];
    let merged_heads = out[r - 3] == heads || out[r - 3].provably_equal(&heads) == Some(true);
    (same && merged_heads).then_some(expanded)
}

/// The graph with every grouped-query attention reading its shared heads in place (see
/// the module docs); other nodes unchanged. Repeats nothing else reads are dropped. None
/// when the graph has no such attention (it serves as it is).
pub fn read_shared_heads(g: &Graph) -> Result<Option<Graph>> {
    let uses = g.use_counts();
    // Per attention node: the expanded k and v (same heads and groups).
    let mut grouped: Vec<Option<(ValueId, ValueId)>> = vec![None; g.nodes.len()];
    let mut dropped = vec![false; g.nodes.len()];
    for (id, node) in g.nodes.iter().enumerate() {
        if !matches!(node.op, Op::Attention { .. }) || node.ty.shape.len() < 3 {
            continue;
        }
        let (k, v) = (node.inputs[1], node.inputs[2]);
        let (Some(ek), Some(ev)) = (repeated_heads(g, k), repeated_heads(g, v)) else {
            continue;
        };
        let (wk, wv) = (&g.nodes[ek].ty.shape, &g.nodes[ev].ty.shape);
        let r = wk.len();
        if wk[..r - 2] != wv[..r - 2] {
            continue;
        }
        grouped[id] = Some((ek, ev));
        for operand in [k, v] {
            dropped[operand] |= uses[operand] == 1 && !g.outputs.contains(&operand);
        }
    }
    if grouped.iter().all(Option::is_none) {
        return Ok(None);
    }

    let mut out = Graph {
        nodes: Vec::with_capacity(g.nodes.len() + 8),
        inputs: Vec::new(),
        outputs: Vec::new(),
        symbols: g.symbols.clone(),
    };
    // Old id → new id (dropped nodes map nowhere: nothing left reads them).
    let mut new_id = vec![usize::MAX; g.nodes.len()];
    for (id, node) in g.nodes.iter().enumerate() {
        if dropped[id] {
            continue;
        }
        let inputs: Vec<ValueId> = node.inputs.iter().map(|&i| new_id[i]).collect();
        new_id[id] = match grouped[id] {
            Some((ek, ev)) => widened(&mut out, node, &inputs, new_id[ek], new_id[ev])?,
            None => {
                out.nodes.push(Node {
                    inputs,
                    ..node.clone()
                });
                out.nodes.len() - 1
            }
        };
    }
    out.inputs = g.inputs.iter().map(|&i| new_id[i]).collect();
    out.outputs = g.outputs.iter().map(|&o| new_id[o]).collect();
    Ok(Some(out))
}

/// Attention `node` (its new inputs `inputs`: q, k, v[, mask]) over the expanded heads
/// `k5`/`v5` `[B.., Hkv, G, S, E]`: q and the mask split their head axis in two, and the
/// result merges it back. Returns the id of the result.
fn widened(
    out: &mut Graph,
    node: &Node,
    inputs: &[ValueId],
    k5: ValueId,
    v5: ValueId,
) -> Result<ValueId> {
    let wide = out.nodes[k5].ty.shape.clone();
    let r = wide.len(); // one more than the attention's rank
    let (hkv, group) = (wide[r - 4].clone(), wide[r - 3].clone());
    let split = |shape: &[Dim]| -> Vec<Dim> {
        let q = shape.len();
        let mut s = shape[..q - 3].to_vec();
        s.extend([hkv.clone(), group.clone()]);
        s.extend_from_slice(&shape[q - 2..]);
        s
    };
    let shape = split(&out.nodes[inputs[0]].ty.shape);
    let q5 = push(out, node, Op::Reshape { shape }, &[inputs[0]])?;
    let mut ins = vec![q5, k5, v5];
    if let Some(&mask) = inputs.get(3) {
        let shape = split(&out.nodes[mask].ty.shape);
        ins.push(push(out, node, Op::Reshape { shape }, &[mask])?);
    }
    let a5 = push(out, node, node.op.clone(), &ins)?;
    let shape = node.ty.shape.clone();
    push(out, node, Op::Reshape { shape }, &[a5])
}

/// Appends `op` of `inputs` (its type inferred) with `like`'s origin.
fn push(out: &mut Graph, like: &Node, op: Op, inputs: &[ValueId]) -> Result<ValueId> {
    let types: Vec<_> = inputs.iter().map(|&i| &out.nodes[i].ty).collect();
    let ty = infer_type(&op, &types, None)?;
    out.nodes.push(Node {
        op,
        inputs: inputs.to_vec(),
        ty,
        origin: like.origin.clone(),
    });
    Ok(out.nodes.len() - 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ember_core::dtype::DType;
    use ember_core::ir::TensorType;

    fn c(v: &[i64]) -> Vec<Dim> {
        v.iter().map(|&d| Dim::Const(d)).collect()
    }

    fn input(g: &mut Graph, index: usize, dtype: DType, shape: &[i64]) -> ValueId {
        let ty = TensorType::new(dtype, c(shape));
        g.add_source(Op::Input { index }, ty, "in").unwrap()
    }

    fn attention(g: &mut Graph, inputs: &[ValueId]) -> ValueId {
        let op = Op::Attention {
            scale: 0.2,
            causal: false,
            has_mask: inputs.len() == 4,
        };
        let a = g.add(op, inputs, "a").unwrap();
        g.outputs.push(a);
        a
    }

    /// q `[1, 8, 1, 32]` against a 4-head cache `[1, 4, 64, 32]` repeated twice.
    fn decode_attention(masked: bool) -> Graph {
        let mut g = Graph::new();
        let q = input(&mut g, 0, DType::F32, &[1, 8, 1, 32]);
        let cache = input(&mut g, 1, DType::F32, &[1, 4, 64, 32]);
        let repeat = |g: &mut Graph| {
            let mut x = cache;
            for (op, shape) in [
                ("r", &[1, 4, 1, 64, 32][..]),
                ("e", &[1, 4, 2, 64, 32]),
                ("m", &[1, 8, 64, 32]),
            ] {
                let shape = c(shape);
                let op = if op == "e" {
                    Op::Expand { shape }
                } else {
                    Op::Reshape { shape }
                };
                x = g.add(op, &[x], "repeat").unwrap();
            }
            x
        };
        let k = repeat(&mut g);
        let v = repeat(&mut g);
        let mut ins = vec![q, k, v];
        if masked {
            ins.push(input(&mut g, 2, DType::Bool, &[1, 8, 1, 64]));
        }
        attention(&mut g, &ins);
        g
    }

    #[test]
    fn grouped_heads_are_attended_in_place_and_the_repeats_dropped() {
        for masked in [false, true] {
            let g = decode_attention(masked);
            let w = read_shared_heads(&g).unwrap().expect("rewritten");
            ember_core::ir::verify(&w).unwrap();
            let attention: Vec<&Node> = w
                .nodes
                .iter()
                .filter(|n| matches!(n.op, Op::Attention { .. }))
                .collect();
            assert_eq!(attention.len(), 1);
            assert_eq!(attention[0].ty.shape, c(&[1, 4, 2, 1, 32]));
            for &operand in &attention[0].inputs[1..3] {
                assert!(matches!(w.nodes[operand].op, Op::Expand { .. }));
            }
            // The merged repeats are gone; the result keeps the attention's type.
            let merged = w
                .nodes
                .iter()
                .filter(|n| n.ty.shape == c(&[1, 8, 64, 32]))
                .count();
            assert_eq!(merged, 0);
            let out = &w.nodes[w.outputs[0]];
            assert_eq!(out.ty, g.nodes[g.outputs[0]].ty);
            assert_eq!(w.inputs.len(), g.inputs.len());
        }
    }

    #[test]
    fn attention_without_repeated_heads_is_left_alone() {
        let mut plain = Graph::new();
        let q = input(&mut plain, 0, DType::F32, &[1, 4, 1, 32]);
        let kv = input(&mut plain, 1, DType::F32, &[1, 4, 64, 32]);
        attention(&mut plain, &[q, kv, kv]);
        assert_eq!(read_shared_heads(&plain).unwrap(), None);
    }
}
