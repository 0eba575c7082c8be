//! The optimizer on the CPU backend: every rule family fires on a graph built for it, and
//! **every** extracted candidate (not only the chosen one) matches the reference
//! interpreter running the input program (candidate fuzzing, DESIGN §8). Also: search
//! determinism, budgets and the compile cache.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::*;
use ember_core::backend::{Backend, Weights};
use ember_core::dim::Dim;
use ember_core::dtype::{DType, Scalar};
use ember_core::egraph::{saturate, Budget};
use ember_core::extract::{Candidate, DefaultCost, Extractor};
use ember_core::interp::{self, Value};
use ember_core::ir::{BinaryOp, Graph, Op, ReduceOp, UnaryOp, ValueId};
use ember_core::search::{candidates, optimize, SearchOptions, REFERENCE_TERMS};
use ember_core::tensor::HostTensor;
use ember_cpu::CpuBackend;

fn weight(g: &mut Graph, w: &mut Weights, rng: &mut Rng, name: &str, shape: &[usize]) -> ValueId {
    let v = random(rng, DType::F32, shape, -1.0, 1.0);
    w.insert(
        name.to_string(),
        HostTensor::owned(DType::F32, shape.to_vec(), v.to_bytes()).unwrap(),
    );
    g.add_source(
        Op::Weight {
            name: name.to_string(),
        },
        ty(DType::F32, shape),
        name,
    )
    .unwrap()
}

fn full(g: &mut Graph, value: f64, shape: &[usize]) -> ValueId {
    g.add_source(
        Op::Full {
            value: Scalar::Float(value),
        },
        ty(DType::F32, shape),
        "full",
    )
    .unwrap()
}

fn expand(g: &mut Graph, x: ValueId, shape: &[usize]) -> ValueId {
    let shape = shape.iter().map(|&d| Dim::from(d)).collect();
    g.add(Op::Expand { shape }, &[x], "expand").unwrap()
}

fn bin(g: &mut Graph, b: BinaryOp, x: ValueId, y: ValueId) -> ValueId {
    g.add(Op::Binary(b), &[x, y], "bin").unwrap()
}

fn un(g: &mut Graph, u: UnaryOp, x: ValueId) -> ValueId {
    g.add(Op::Unary(u), &[x], "un").unwrap()
}

/// linear → x·sigmoid(x) → linear → softmax, and x·x2ᵀ: dot kernels, packed operands, silu
/// fusion, softmax decomposition.
fn mlp(rng: &mut Rng) -> (Graph, Weights, Vec<Value>) {
    let (mut g, mut w) = (Graph::new(), Weights::new());
    let x = input(&mut g, 0, DType::F32, &[3, 37]);
    let w1 = weight(&mut g, &mut w, rng, "w1", &[29, 37]);
    let b1 = weight(&mut g, &mut w, rng, "b1", &[1, 29]);
    let w2 = weight(&mut g, &mut w, rng, "w2", &[11, 29]);
    let w1t = g
        .add(Op::Permute { perm: vec![1, 0] }, &[w1], "t1")
        .unwrap();
    let h = g.add(Op::Dot, &[x, w1t], "fc1").unwrap();
    let be = expand(&mut g, b1, &[3, 29]);
    let h = bin(&mut g, BinaryOp::Add, h, be);
    let s = un(&mut g, UnaryOp::Sigmoid, h);
    let h = bin(&mut g, BinaryOp::Mul, h, s);
    let w2t = g
        .add(Op::Permute { perm: vec![1, 0] }, &[w2], "t2")
        .unwrap();
    let y = g.add(Op::Dot, &[h, w2t], "fc2").unwrap();
    let y = g
        .add(
            Op::Softmax {
                axis: 1,
                log: false,
            },
            &[y],
            "softmax",
        )
        .unwrap();
    // A product with a transposed activation (not a weight): packing it is a choice.
    let x2 = input(&mut g, 1, DType::F32, &[5, 37]);
    let x2t = g
        .add(Op::Permute { perm: vec![1, 0] }, &[x2], "t3")
        .unwrap();
    let z = g.add(Op::Dot, &[x, x2t], "scores").unwrap();
    g.outputs.extend([y, z]);
    let inputs = vec![
        random(rng, DType::F32, &[3, 37], -2.0, 2.0),
        random(rng, DType::F32, &[5, 37], -2.0, 2.0),
    ];
    (g, w, inputs)
}

/// rms norm, layer norm and log-softmax on a rank-3 tensor with large magnitudes.
fn norms(rng: &mut Rng) -> (Graph, Weights, Vec<Value>) {
    let (mut g, mut w) = (Graph::new(), Weights::new());
    let x = input(&mut g, 0, DType::F32, &[2, 5, 24]);
    let gw = weight(&mut g, &mut w, rng, "g", &[24]);
    let lw = weight(&mut g, &mut w, rng, "lw", &[24]);
    let lb = weight(&mut g, &mut w, rng, "lb", &[24]);
    let r = g
        .add(
            Op::RmsNorm {
                axis: 2,
                eps: 1e-6,
                has_weight: true,
            },
            &[x, gw],
            "rms",
        )
        .unwrap();
    let l = g
        .add(
            Op::LayerNorm {
                axis: 2,
                eps: 1e-5,
                has_weight: true,
                has_bias: true,
            },
            &[r, lw, lb],
            "ln",
        )
        .unwrap();
    let s = g
        .add(Op::Softmax { axis: 1, log: true }, &[l], "lsm")
        .unwrap();
    g.outputs.extend([s, r]);
    let inputs = vec![random(rng, DType::F32, &[2, 5, 24], -300.0, 300.0)];
    (g, w, inputs)
}

/// Algebra and view identities: neg∘neg, ·1, −0, lossless cast round trips,
/// permute∘permute, reshape∘reshape, unary of a broadcast.
fn identities(rng: &mut Rng) -> (Graph, Weights, Vec<Value>) {
    let mut g = Graph::new();
    let x = input(&mut g, 0, DType::F32, &[4, 3, 5]);
    let b = input(&mut g, 1, DType::F32, &[1, 3, 1]);
    let n = un(&mut g, UnaryOp::Neg, x);
    let n = un(&mut g, UnaryOp::Neg, n);
    let one = full(&mut g, 1.0, &[4, 3, 5]);
    let y = bin(&mut g, BinaryOp::Mul, n, one);
    let zero = full(&mut g, 0.0, &[1, 1, 1]);
    let zero = expand(&mut g, zero, &[4, 3, 5]);
    let y = bin(&mut g, BinaryOp::Sub, y, zero);
    let c = g.add(Op::Cast { to: DType::F64 }, &[y], "up").unwrap();
    let y = g.add(Op::Cast { to: DType::F32 }, &[c], "down").unwrap();
    let p = g
        .add(
            Op::Permute {
                perm: vec![1, 2, 0],
            },
            &[y],
            "p1",
        )
        .unwrap();
    let p = g
        .add(
            Op::Permute {
                perm: vec![2, 0, 1],
            },
            &[p],
            "p2",
        )
        .unwrap();
    let r = g
        .add(
            Op::Reshape {
                shape: vec![Dim::from(12usize), Dim::from(5usize)],
            },
            &[p],
            "r1",
        )
        .unwrap();
    let r = g
        .add(
            Op::Reshape {
                shape: vec![Dim::from(4usize), Dim::from(3usize), Dim::from(5usize)],
            },
            &[r],
            "r2",
        )
        .unwrap();
    let be = expand(&mut g, b, &[4, 3, 5]);
    let e = un(&mut g, UnaryOp::Exp, be);
    let out = bin(&mut g, BinaryOp::Add, r, e);
    let red = g
        .add(
            Op::Reduce {
                op: ReduceOp::Sum,
                axes: vec![2],
                keepdim: false,
            },
            &[out],
            "sum",
        )
        .unwrap();
    g.outputs.extend([out, red]);
    let inputs = vec![
        random(rng, DType::F32, &[4, 3, 5], -3.0, 3.0),
        random(rng, DType::F32, &[1, 3, 1], -1.0, 1.0),
    ];
    (g, Weights::new(), inputs)
}

/// The identities `identities` leaves out: 1·x, x/1, a cast to the own dtype, an identity
/// permute and expand, a binary op of two equal broadcasts, silu written σ(x)·x, a silu op
/// (decomposed), ones and zeros seen through reshapes and broadcasts, and a five-input
/// concat (the n-ary term).
fn more_identities(rng: &mut Rng) -> (Graph, Weights, Vec<Value>) {
    let mut g = Graph::new();
    let x = input(&mut g, 0, DType::F32, &[3, 4]);
    let a = input(&mut g, 1, DType::F32, &[1, 4]);
    let b = input(&mut g, 2, DType::F32, &[1, 4]);
    let one = full(&mut g, 1.0, &[12]);
    let one = g
        .add(
            Op::Reshape {
                shape: vec![Dim::from(3usize), Dim::from(4usize)],
            },
            &[one],
            "ones",
        )
        .unwrap();
    let y = bin(&mut g, BinaryOp::Mul, one, x);
    let y = bin(&mut g, BinaryOp::Div, y, one);
    let y = g.add(Op::Cast { to: DType::F32 }, &[y], "same").unwrap();
    let y = g
        .add(Op::Permute { perm: vec![0, 1] }, &[y], "noop-permute")
        .unwrap();
    let y = expand(&mut g, y, &[3, 4]);
    let (ea, eb) = (expand(&mut g, a, &[3, 4]), expand(&mut g, b, &[3, 4]));
    let ab = bin(&mut g, BinaryOp::Add, ea, eb);
    let s = un(&mut g, UnaryOp::Sigmoid, y);
    let swapped = bin(&mut g, BinaryOp::Mul, s, y);
    let silu = un(&mut g, UnaryOp::Silu, ab);
    let out = bin(&mut g, BinaryOp::Add, swapped, silu);
    let ones = full(&mut g, 1.0, &[1, 4]);
    let ones = expand(&mut g, ones, &[3, 4]);
    let out = bin(&mut g, BinaryOp::Mul, out, ones);
    let zeros = full(&mut g, 0.0, &[12]);
    let zeros = g
        .add(
            Op::Reshape {
                shape: vec![Dim::from(3usize), Dim::from(4usize)],
            },
            &[zeros],
            "zeros",
        )
        .unwrap();
    let out = bin(&mut g, BinaryOp::Sub, out, zeros);
    let cat = g
        .add(Op::Concat { axis: 0 }, &[out, x, y, ab, out], "cat5")
        .unwrap();
    g.outputs.push(cat);
    let inputs = vec![
        random(rng, DType::F32, &[3, 4], -3.0, 3.0),
        random(rng, DType::F32, &[1, 4], -1.0, 1.0),
        random(rng, DType::F32, &[1, 4], -1.0, 1.0),
    ];
    (g, Weights::new(), inputs)
}

/// Causal attention, and attention with a bool mask (rows keep at least one key).
fn attention(rng: &mut Rng) -> (Graph, Weights, Vec<Value>) {
    let mut g = Graph::new();
    let q = input(&mut g, 0, DType::F32, &[2, 5, 8]);
    let k = input(&mut g, 1, DType::F32, &[2, 7, 8]);
    let v = input(&mut g, 2, DType::F32, &[2, 7, 3]);
    let m = input(&mut g, 3, DType::Bool, &[2, 5, 7]);
    let causal = g
        .add(
            Op::Attention {
                scale: 0.35,
                causal: true,
                has_mask: false,
            },
            &[q, k, v],
            "causal",
        )
        .unwrap();
    let masked = g
        .add(
            Op::Attention {
                scale: 0.5,
                causal: false,
                has_mask: true,
            },
            &[q, k, v, m],
            "masked",
        )
        .unwrap();
    g.outputs.extend([causal, masked]);
    let mut mask = random(rng, DType::Bool, &[2, 5, 7], 0.0, 1.0).to_i64_vec();
    for row in mask.chunks_mut(7) {
        row[0] = 1;
    }
    let inputs = vec![
        random(rng, DType::F32, &[2, 5, 8], -2.0, 2.0),
        random(rng, DType::F32, &[2, 7, 8], -2.0, 2.0),
        random(rng, DType::F32, &[2, 7, 3], -2.0, 2.0),
        Value::from_i64(DType::Bool, vec![2, 5, 7], mask),
    ];
    (g, Weights::new(), inputs)
}

/// Grouped-query attention as the frontends translate it: each of 2 KV heads repeated for 3
/// query heads by `reshape(expand(reshape(kv)))`. A decode-like step (one query row, no mask:
/// the stacked-rows rewrite), a causal prefill-like one and a masked one (batch regrouping).
fn grouped_query_attention(rng: &mut Rng) -> (Graph, Weights, Vec<Value>) {
    let mut g = Graph::new();
    let repeat = |g: &mut Graph, x: ValueId, s: usize| -> ValueId {
        let dims = |d: &[usize]| d.iter().map(|&d| Dim::from(d)).collect::<Vec<_>>();
        let shape = dims(&[1, 2, 1, s, 8]);
        let x5 = g.add(Op::Reshape { shape }, &[x], "unsqueeze").unwrap();
        let wide = expand(g, x5, &[1, 2, 3, s, 8]);
        let shape = dims(&[1, 6, s, 8]);
        g.add(Op::Reshape { shape }, &[wide], "repeat_kv").unwrap()
    };
    let q1 = input(&mut g, 0, DType::F32, &[1, 6, 1, 8]);
    let k = input(&mut g, 1, DType::F32, &[1, 2, 9, 8]);
    let v = input(&mut g, 2, DType::F32, &[1, 2, 9, 8]);
    let q = input(&mut g, 3, DType::F32, &[1, 6, 9, 8]);
    let m = input(&mut g, 4, DType::Bool, &[1, 6, 9, 9]);
    let (kr, vr) = (repeat(&mut g, k, 9), repeat(&mut g, v, 9));
    let attention = |g: &mut Graph, causal: bool, ins: &[ValueId]| {
        let op = Op::Attention {
            scale: 0.4,
            causal,
            has_mask: ins.len() == 4,
        };
        g.add(op, ins, "attention").unwrap()
    };
    let decode = attention(&mut g, false, &[q1, kr, vr]);
    let prefill = attention(&mut g, true, &[q, kr, vr]);
    let masked = attention(&mut g, false, &[q, kr, vr, m]);
    // k and v broadcast from one row, then given a batch dim: regrouped into no batch dims
    // at all (rank-2 attention), with nothing that could be stacked.
    let q0 = input(&mut g, 5, DType::F32, &[1, 2, 8]);
    let row = input(&mut g, 6, DType::F32, &[1, 8]);
    let rows = expand(&mut g, row, &[9, 8]);
    let shape = [1usize, 9, 8].iter().map(|&d| Dim::from(d)).collect();
    let kv0 = g.add(Op::Reshape { shape }, &[rows], "batch").unwrap();
    let flat = attention(&mut g, false, &[q0, kv0, kv0]);
    g.outputs.extend([decode, prefill, masked, flat]);
    let mut mask = random(rng, DType::Bool, &[1, 6, 9, 9], 0.0, 1.0).to_i64_vec();
    for row in mask.chunks_mut(9) {
        row[3] = 1;
    }
    let inputs = vec![
        random(rng, DType::F32, &[1, 6, 1, 8], -2.0, 2.0),
        random(rng, DType::F32, &[1, 2, 9, 8], -2.0, 2.0),
        random(rng, DType::F32, &[1, 2, 9, 8], -2.0, 2.0),
        random(rng, DType::F32, &[1, 6, 9, 8], -2.0, 2.0),
        Value::from_i64(DType::Bool, vec![1, 6, 9, 9], mask),
        random(rng, DType::F32, &[1, 2, 8], -2.0, 2.0),
        random(rng, DType::F32, &[1, 8], -2.0, 2.0),
    ];
    (g, Weights::new(), inputs)
}

/// Projections that share their input, as the frontends translate a llama block: q/k/v of
/// `linear` weights (each reading its own `reshape(x)`, equal only structurally) and a
/// gated MLP's gate and up as plain `x · w` products.
fn merged_projections(rng: &mut Rng) -> (Graph, Weights, Vec<Value>) {
    let (mut g, mut w) = (Graph::new(), Weights::new());
    let x = input(&mut g, 0, DType::F32, &[1, 3, 24]);
    let mut outs = Vec::new();
    for (name, n) in [("wq", 16), ("wk", 8), ("wv", 8)] {
        let rows = g
            .add(
                Op::Reshape {
                    shape: vec![Dim::from(3i64), Dim::from(24i64)],
                },
                &[x],
                "rows",
            )
            .unwrap();
        let wt = weight(&mut g, &mut w, rng, name, &[n, 24]);
        let wt = g.add(Op::Permute { perm: vec![1, 0] }, &[wt], "t").unwrap();
        outs.push(g.add(Op::Dot, &[rows, wt], name).unwrap());
    }
    let h = outs[0];
    let gate = weight(&mut g, &mut w, rng, "gate", &[16, 10]);
    let up = weight(&mut g, &mut w, rng, "up", &[16, 10]);
    let gate = g.add(Op::Dot, &[h, gate], "gate").unwrap();
    let up = g.add(Op::Dot, &[h, up], "up").unwrap();
    let gate = un(&mut g, UnaryOp::Silu, gate);
    let y = bin(&mut g, BinaryOp::Mul, gate, up);
    g.outputs.extend([y, outs[1], outs[2]]);
    let inputs = vec![random(rng, DType::F32, &[1, 3, 24], -2.0, 2.0)];
    (g, w, inputs)
}

type Case = fn(&mut Rng) -> (Graph, Weights, Vec<Value>);
const CASES: [(&str, Case); 7] = [
    ("mlp", mlp),
    ("norms", norms),
    ("identities", identities),
    ("more_identities", more_identities),
    ("attention", attention),
    ("grouped_query_attention", grouped_query_attention),
    ("merged_projections", merged_projections),
];

/// Every candidate of every case matches the interpreter on the input program.
#[test]
fn every_candidate_matches_the_reference() {
    let backend = CpuBackend::new(2);
    for (name, case) in CASES {
        let mut rng = Rng::new(7);
        let (g, w, inputs) = case(&mut rng);
        let (data, report) = saturate(&g, &backend.lowering_rules(), &Budget::default())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(report.fixed_point, "{name}: {report:?}");
        let ex = Extractor::new(
            &data,
            &g,
            &DefaultCost {
                sizes: Default::default(),
            },
        );
        let cands = candidates(&ex, &g, 1000);
        // A class merged by an identity offers alternatives that mostly read the class itself
        // (cyclic, so rejected); the default and one other program remain at least.
        assert!(cands.len() >= 2, "{name}: only {} candidates", cands.len());
        let want = interp::run(&g, &w, &inputs).unwrap();
        let tol = 1e-5;
        for c in &cands {
            ember_core::ir::verify(&c.graph).unwrap();
            let got = run_cpu_strided(
                &backend,
                &c.graph,
                &w,
                &inputs.iter().map(Strided::contiguous).collect::<Vec<_>>(),
            )
            .unwrap_or_else(|e| panic!("{name} [{}]: {e}\n{}", c.description, c.graph));
            for (k, (a, b)) in got.iter().zip(&want).enumerate() {
                assert_close(a, b, tol, &format!("{name} [{}] output {k}", c.description));
            }
        }
    }
}

/// The rules each case exists for actually fire.
#[test]
fn rule_families_fire() {
    let backend = CpuBackend::new(1);
    let expect: [(&str, &[&str]); 6] = [
        (
            "mlp",
            &[
                "fuse/silu-fuse",
                "fuse/softmax-decompose",
                "lower/cpu.rowwise",
                "lower/cpu.packed",
            ],
        ),
        (
            "norms",
            &[
                "fuse/rms-norm-decompose",
                "fuse/layer-norm-decompose",
                "fuse/log-softmax-decompose",
            ],
        ),
        (
            "identities",
            &[
                "algebra/neg-neg",
                "algebra/mul-one",
                "algebra/sub-zero",
                "algebra/cast-roundtrip",
                "layout/permute-permute",
                "layout/reshape-reshape",
                "layout/reshape-identity",
                "layout/unary-of-expand",
            ],
        ),
        ("attention", &["fuse/attention-decompose"]),
        (
            "grouped_query_attention",
            &[
                "layout/attention-of-regrouped-kv",
                "layout/attention-stacked-query-rows",
            ],
        ),
        ("merged_projections", &["fuse/dot-merge"]),
    ];
    let listed = CASES.iter().filter(|(name, _)| *name != "more_identities");
    for ((name, case), (ename, rules)) in listed.zip(expect) {
        assert_eq!(*name, ename);
        let (g, _, _) = case(&mut Rng::new(1));
        let (_, report) = saturate(&g, &backend.lowering_rules(), &Budget::default()).unwrap();
        for r in rules {
            assert!(
                report.rules_fired.keys().any(|k| k.starts_with(r)),
                "{name}: rule {r} did not fire; fired: {:?}",
                report.rules_fired
            );
        }
    }
}

/// The search's candidates for `g` on the CPU backend, from the cost model's extraction.
fn cpu_candidates(g: &Graph, limit: usize) -> Vec<Candidate> {
    let backend = CpuBackend::new(1);
    let (data, _) = saturate(g, &backend.lowering_rules(), &Budget::default()).unwrap();
    let cost = DefaultCost {
        sizes: Default::default(),
    };
    candidates(&Extractor::new(&data, g, &cost), g, limit)
}

/// Merging pays only when every product of a group switches: the candidates include the
/// program with each group computed by one product (q/k/v and gate/up: 5 products → 2).
#[test]
fn merged_products_are_offered_together() {
    let (g, _, _) = merged_projections(&mut Rng::new(1));
    let cands = cpu_candidates(&g, 8);
    let products = |g: &Graph| g.nodes.iter().filter(|n| matches!(n.op, Op::Dot)).count();
    assert_eq!(products(&cands[0].graph), 5, "{}", cands[0].graph);
    assert_eq!(products(&cands[1].graph), 2, "{}", cands[1].graph);
    assert!(
        cands[1].description.contains("slice"),
        "{}",
        cands[1].description
    );
}

/// The cost model's default program for grouped-query attention never copies a repeated KV
/// head: the one-row attention reads the un-repeated k and v (query heads stacked as rows),
/// and the others read the broadcast itself (a view), not a reshape of it.
#[test]
fn grouped_query_attention_reads_kv_without_copies_by_default() {
    let (g, _, _) = grouped_query_attention(&mut Rng::new(1));
    let default = &cpu_candidates(&g, 1)[0].graph;
    let mut stacked = 0;
    for n in &default.nodes {
        if let Op::Attention { .. } = n.op {
            let k = &default.nodes[n.inputs[1]];
            let copies = matches!(k.op, Op::Reshape { .. })
                && matches!(default.nodes[k.inputs[0]].op, Op::Expand { .. });
            assert!(!copies, "attention reads a reshaped broadcast:\n{default}");
            let k_elems: usize =
                k.ty.shape
                    .iter()
                    .map(|d| d.as_const().unwrap() as usize)
                    .product();
            if k_elems == 2 * 9 * 8 {
                stacked += 1;
                assert_eq!(n.ty.shape[3], Dim::from(3usize), "{default}");
            }
        }
    }
    assert_eq!(
        stacked, 1,
        "the one-row attention stacks its query heads:\n{default}"
    );
}

/// A rule's family: its name without the instance it was generated for (`#k`, dtypes,
/// shapes, permutations, ranks), e.g. `layout/permute-permute-[1, 0]-[1, 0]` →
/// `layout/permute-permute`.
fn family(rule: &str) -> String {
    let rule = rule.split('#').next().unwrap_or(rule);
    let dtypes = [
        "float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8",
        "bool",
    ];
    rule.split('-')
        .filter(|t| !t.starts_with('[') && !t.ends_with(']') && !dtypes.contains(t))
        .filter(|t| !(t.starts_with('r') && t[1..].chars().all(|c| c.is_ascii_digit())))
        .filter(|t| !t.chars().next().is_some_and(|c| c.is_ascii_digit()))
        .collect::<Vec<_>>()
        .join("-")
}

/// Every rule family the generator writes for the case graphs fires on at least one of them,
/// so the candidate fuzzing above (every candidate of every case against the interpreter)
/// differential-tests every rule.
#[test]
fn every_rule_family_is_exercised() {
    let backend = CpuBackend::new(1);
    let (mut generated, mut fired) = (BTreeSet::new(), BTreeSet::new());
    for (_, case) in CASES {
        let (g, _, _) = case(&mut Rng::new(3));
        let (text, _) = ember_core::egraph::program(&g, &backend.lowering_rules());
        for part in text.split(":name \"").skip(1) {
            generated.insert(family(part.split('"').next().unwrap()));
        }
        let (_, report) = saturate(&g, &backend.lowering_rules(), &Budget::default()).unwrap();
        fired.extend(report.rules_fired.keys().map(|k| family(k)));
    }
    let missing: Vec<_> = generated.difference(&fired).collect();
    assert!(
        missing.is_empty(),
        "rule families no case graph exercises: {missing:?}\nfired: {fired:?}"
    );
}

fn opts() -> SearchOptions {
    SearchOptions {
        iterations: 6,
        time_budget: Duration::from_secs(20),
        repeats: 3,
        ..Default::default()
    }
}

#[test]
fn search_is_verified_and_deterministic() {
    let backend = CpuBackend::new(1);
    for (name, case) in CASES {
        let (g, w, _) = case(&mut Rng::new(3));
        let a = optimize(&g, &backend, &w, &opts()).unwrap();
        let chosen = a
            .report
            .chosen
            .unwrap_or_else(|| panic!("{name}: {:?}", a.report));
        assert_eq!(a.report.candidates[chosen].verified, Some(true));
        assert!(a.report.candidates.len() >= 2, "{name}: {:?}", a.report);
        // Same seed, same e-graph, same proposed candidates in the same order (the combined
        // candidate depends on which single changes won, i.e. on timings).
        let b = optimize(&g, &backend, &w, &opts()).unwrap();
        let proposed = |r: &ember_core::search::SearchReport| -> Vec<String> {
            r.candidates
                .iter()
                .map(|c| c.description.clone())
                .filter(|d| !d.starts_with("combined"))
                .collect()
        };
        let (da, db) = (proposed(&a.report), proposed(&b.report));
        assert_eq!(da, db, "{name}");
    }
}

#[test]
fn budgets_are_respected() {
    let backend = CpuBackend::new(1);
    let (g, _, _) = norms(&mut Rng::new(1));
    let one_round = Budget {
        iterations: 1,
        ..Default::default()
    };
    let (_, r) = saturate(&g, &backend.lowering_rules(), &one_round).unwrap();
    assert_eq!(r.iterations, 1);
    assert!(!r.fixed_point);
    let tiny = Budget {
        max_nodes: 10,
        ..Default::default()
    };
    let (_, r) = saturate(&g, &backend.lowering_rules(), &tiny).unwrap();
    assert_eq!(r.stop_reason, "node budget");
    assert_eq!(r.iterations, 1);
    // Search stops measuring at the candidate limit.
    let (g, w, _) = mlp(&mut Rng::new(1));
    let o = optimize(
        &g,
        &backend,
        &w,
        &SearchOptions {
            iterations: 2,
            ..opts()
        },
    )
    .unwrap();
    assert!(o.report.candidates.len() <= 2, "{:?}", o.report);
}

#[test]
fn cache_hit_reuses_the_choice() {
    let dir = std::env::temp_dir().join(format!("ember-cache-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let backend = CpuBackend::new(1);
    let (g, w, inputs) = mlp(&mut Rng::new(5));
    let o = SearchOptions {
        cache_dir: Some(dir.clone()),
        ..opts()
    };
    let first = optimize(&g, &backend, &w, &o).unwrap();
    assert!(!first.report.cache_hit);
    let second = optimize(&g, &backend, &w, &o).unwrap();
    assert!(second.report.cache_hit, "{:?}", second.report);
    assert_eq!(second.report.candidates.len(), 1);
    assert_eq!(first.graph.to_string(), second.graph.to_string());
    // The cached program still computes the right thing.
    check_with(&second.graph, &w, &inputs, 1e-5, "cached program");
    // An entry that does not fit this e-graph (another Ember, other rules) is a miss.
    for f in std::fs::read_dir(&dir).unwrap() {
        let path = f.unwrap().path();
        let text = r#"{"genome":[[0,7],[99999,3]],"fingerprint":"0","description":"stale"}"#;
        std::fs::write(path, text).unwrap();
    }
    let third = optimize(&g, &backend, &w, &o).unwrap();
    assert!(!third.report.cache_hit);
    assert!(third.report.chosen.is_some());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_costly_reference_verifies_at_smaller_symbolic_sizes() {
    // rows × 37 → linear → silu → linear, with `rows` symbolic: the same program serves
    // every row count, so candidates are verified at fewer rows than they are timed at
    // when the reference run at the timed size would cost too much.
    let mut rng = Rng::new(9);
    let (mut g, mut w) = (Graph::new(), Weights::new());
    let rows = Dim::sym("rows");
    let x_ty = ember_core::ir::TensorType::new(DType::F32, vec![rows, Dim::Const(37)]);
    let x = g.add_source(Op::Input { index: 0 }, x_ty, "x").unwrap();
    let w1 = weight(&mut g, &mut w, &mut rng, "w1", &[29, 37]);
    let w2 = weight(&mut g, &mut w, &mut rng, "w2", &[11, 29]);
    let w1t = g
        .add(Op::Permute { perm: vec![1, 0] }, &[w1], "t1")
        .unwrap();
    let h = g.add(Op::Dot, &[x, w1t], "fc1").unwrap();
    let s = un(&mut g, UnaryOp::Sigmoid, h);
    let h = bin(&mut g, BinaryOp::Mul, h, s);
    let w2t = g
        .add(Op::Permute { perm: vec![1, 0] }, &[w2], "t2")
        .unwrap();
    let y = g.add(Op::Dot, &[h, w2t], "fc2").unwrap();
    g.outputs.push(y);
    let backend = CpuBackend::new(1);
    let searched = |reference_terms: f64| {
        let o = SearchOptions {
            input_shapes: Some(vec![vec![64, 37]]),
            reference_terms,
            ..opts()
        };
        optimize(&g, &backend, &w, &o).unwrap()
    };
    // A row costs 37·29 + 29·11 = 1392 terms: 64 rows 89 088, halved until ≤ 25 000: 16.
    let done = searched(25_000.0);
    assert!(
        done.report
            .note
            .contains("verified at input shapes [[16, 37]]")
            && done.report.note.contains("timed at [[64, 37]]"),
        "{:?}",
        done.report
    );
    let chosen = done.report.chosen.expect("a candidate is adopted");
    assert_eq!(done.report.candidates[chosen].verified, Some(true));
    // The adopted program is right at the timed size too.
    let x64 = random(&mut rng, DType::F32, &[64, 37], -2.0, 2.0);
    check_with(&done.graph, &w, &[x64], 1e-5, "program verified at 16 rows");
    // Affordable: verified where timed.
    let done = searched(REFERENCE_TERMS);
    assert!(
        !done.report.note.contains("verified at"),
        "{:?}",
        done.report
    );
}

/// The CPU backend, with every program that takes a backend kernel choice made slow:
/// `SLOW` more per run.
struct SlowKernels(CpuBackend);

const SLOW: Duration = Duration::from_millis(300);

struct Slowed(Box<dyn ember_core::backend::Executable>);

impl ember_core::backend::Executable for Slowed {
    fn output_shapes(&self, shapes: &[Vec<usize>]) -> ember_core::Result<Vec<Vec<usize>>> {
        self.0.output_shapes(shapes)
    }

    unsafe fn run(
        &self,
        inputs: &[ember_core::tensor::TensorView],
        outputs: &[ember_core::tensor::TensorOut],
    ) -> ember_core::Result<()> {
        std::thread::sleep(SLOW);
        // SAFETY: the caller's promise, passed on.
        unsafe { self.0.run(inputs, outputs) }
    }
}

impl Backend for SlowKernels {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn lowering_rules(&self) -> Vec<ember_core::backend::LoweringRule> {
        self.0.lowering_rules()
    }

    fn compile(
        &self,
        graph: &Graph,
        weights: &Weights,
    ) -> ember_core::Result<Box<dyn ember_core::backend::Executable>> {
        let exe = self.0.compile(graph, weights)?;
        let chosen = graph
            .nodes
            .iter()
            .any(|n| matches!(n.op, Op::Kernel { .. }));
        Ok(if chosen { Box::new(Slowed(exe)) } else { exe })
    }
}

/// A candidate far slower than the best so far is timed by one run, not by its repeats:
/// a search must not spend seconds timing what cannot win.
#[test]
fn a_hopeless_candidate_is_timed_once() {
    let backend = SlowKernels(CpuBackend::new(1));
    let (g, w, _) = mlp(&mut Rng::new(1));
    let o = optimize(
        &g,
        &backend,
        &w,
        &SearchOptions {
            iterations: 3,
            repeats: 10,
            ..opts()
        },
    )
    .unwrap();
    let slow: Vec<_> = o
        .report
        .candidates
        .iter()
        .filter(|c| c.time_s.is_some_and(|t| t >= SLOW.as_secs_f64()))
        .collect();
    assert!(!slow.is_empty(), "no slowed candidate: {:?}", o.report);
    assert_eq!(o.report.chosen, Some(0), "{:?}", o.report);
    // Each slowed candidate: its verification run and one timed run (eleven runs without
    // the bound); everything else takes milliseconds (a second of slack).
    let most = SLOW.as_secs_f64() * (2 * slow.len()) as f64 + 1.0;
    assert!(
        o.report.time_s < most,
        "{:.2} s: {:?}",
        o.report.time_s,
        o.report
    );
}
