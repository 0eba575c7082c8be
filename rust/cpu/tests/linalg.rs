//! Reductions, dot, softmax, norms and attention against the interpreter.

mod common;

use common::*;
use ember_core::backend::Weights;
use ember_core::dtype::DType;
use ember_core::interp::{self, Data, Value};
use ember_core::ir::{Graph, Op, ReduceOp};
use ember_cpu::CpuBackend;

#[test]
fn reductions_over_several_axes() {
    let mut rng = Rng::new(20);
    use ReduceOp::*;
    for dtype in [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I8,
        DType::U8,
        DType::Bool,
    ] {
        for op in [Sum, Prod, Max, Min] {
            for (axes, keepdim) in [
                (vec![0, 2], false),
                (vec![1], true),
                (vec![0, 1, 2], false),
                (vec![], false),
            ] {
                let g = op_graph(
                    Op::Reduce {
                        op,
                        axes: axes.clone(),
                        keepdim,
                    },
                    &[(dtype, &[3, 4, 5])],
                );
                let (lo, hi) = if op == Prod {
                    (-2.0, 2.0)
                } else {
                    (-50.0, 50.0)
                };
                let x = random(&mut rng, dtype, &[3, 4, 5], lo, hi);
                check_with(
                    &g,
                    &Weights::new(),
                    &[x],
                    tol(dtype).max(1e-5),
                    &format!("{} {dtype} {axes:?}", op.name()),
                );
            }
        }
    }
}

#[test]
fn arg_reductions_take_first_extreme_and_nan() {
    let g = op_graph(
        Op::Reduce {
            op: ReduceOp::ArgMax,
            axes: vec![1],
            keepdim: false,
        },
        &[(DType::F32, &[3, 4])],
    );
    let x = Value::from_f64(
        DType::F32,
        vec![3, 4],
        vec![
            1.0,
            3.0,
            3.0,
            2.0,
            f64::NAN,
            1.0,
            f64::NAN,
            9.0,
            -1.0,
            -1.0,
            -1.0,
            -1.0,
        ],
    );
    let out = run_cpu(&g, &Weights::new(), std::slice::from_ref(&x)).unwrap();
    assert_eq!(out[0].to_i64_vec(), vec![1, 0, 0]);
    check(&g, &[x], "argmax");
    let mut rng = Rng::new(21);
    for dtype in [DType::F32, DType::I64, DType::BF16, DType::U8] {
        for op in [ReduceOp::ArgMax, ReduceOp::ArgMin] {
            for axis in 0..3 {
                for keepdim in [false, true] {
                    let g = op_graph(
                        Op::Reduce {
                            op,
                            axes: vec![axis],
                            keepdim,
                        },
                        &[(dtype, &[4, 3, 5])],
                    );
                    let x = random(&mut rng, dtype, &[4, 3, 5], -3.0, 3.0);
                    check(&g, &[x], &format!("{} {dtype} axis {axis}", op.name()));
                }
            }
        }
    }
}

#[test]
fn reductions_of_empty_dims() {
    let g = op_graph(
        Op::Reduce {
            op: ReduceOp::Sum,
            axes: vec![1],
            keepdim: false,
        },
        &[(DType::F32, &[3, 0])],
    );
    let x = Value::from_f64(DType::F32, vec![3, 0], vec![]);
    check(&g, std::slice::from_ref(&x), "sum over empty");
    let g = op_graph(
        Op::Reduce {
            op: ReduceOp::Max,
            axes: vec![1],
            keepdim: false,
        },
        &[(DType::F32, &[3, 0])],
    );
    let err = run_cpu(&g, &Weights::new(), &[x]).unwrap_err().to_string();
    assert!(err.contains("reduce_max"), "{err}");
}

#[test]
fn dot_batched_transposed_and_every_dtype() {
    let mut rng = Rng::new(22);
    for dtype in [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::I8,
    ] {
        let g = op_graph(Op::Dot, &[(dtype, &[2, 3, 7, 5]), (dtype, &[2, 3, 5, 4])]);
        let a = random(&mut rng, dtype, &[2, 3, 7, 5], -3.0, 3.0);
        let b = random(&mut rng, dtype, &[2, 3, 5, 4], -3.0, 3.0);
        let t = match dtype {
            DType::F16 => 5e-3,
            DType::BF16 => 3e-2,
            DType::F32 => 1e-5,
            _ => tol(dtype),
        };
        check_with(&g, &Weights::new(), &[a, b], t, &format!("dot {dtype}"));
    }
    // b given transposed in memory: gemm reads it through its strides.
    let g = op_graph(Op::Dot, &[(DType::F32, &[33, 17]), (DType::F32, &[17, 29])]);
    let a = random(&mut rng, DType::F32, &[33, 17], -1.0, 1.0);
    let b = random(&mut rng, DType::F32, &[17, 29], -1.0, 1.0);
    let want = interp::run(&g, &Weights::new(), &[a.clone(), b.clone()]).unwrap();
    let got = run_cpu_strided(
        &CpuBackend::new(2),
        &g,
        &Weights::new(),
        &[Strided::transposed(&a), Strided::transposed(&b)],
    )
    .unwrap();
    assert_close(&got[0], &want[0], 1e-5, "dot of transposed operands");
    // Transposed through a Permute node, and an empty contraction.
    let mut g = Graph::new();
    let x = input(&mut g, 0, DType::F32, &[5, 6]);
    let y = input(&mut g, 1, DType::F32, &[4, 6]);
    let yt = g.add(Op::Permute { perm: vec![1, 0] }, &[y], "t").unwrap();
    let d = g.add(Op::Dot, &[x, yt], "dot").unwrap();
    g.outputs.push(d);
    let a = random(&mut rng, DType::F32, &[5, 6], -1.0, 1.0);
    let b = random(&mut rng, DType::F32, &[4, 6], -1.0, 1.0);
    check_with(&g, &Weights::new(), &[a, b], 1e-5, "x @ y.T");
    let g = op_graph(Op::Dot, &[(DType::F32, &[3, 0]), (DType::F32, &[0, 2])]);
    let a = Value::from_f64(DType::F32, vec![3, 0], vec![]);
    let b = Value::from_f64(DType::F32, vec![0, 2], vec![]);
    check(&g, &[a, b], "dot with K = 0");
}

#[test]
fn large_dot_uses_threads() {
    let mut rng = Rng::new(23);
    let g = op_graph(
        Op::Dot,
        &[(DType::F32, &[96, 80]), (DType::F32, &[80, 112])],
    );
    let a = random(&mut rng, DType::F32, &[96, 80], -1.0, 1.0);
    let b = random(&mut rng, DType::F32, &[80, 112], -1.0, 1.0);
    check_with(&g, &Weights::new(), &[a, b], 1e-5, "large dot");
}

#[test]
fn softmax_with_large_magnitudes() {
    let mut rng = Rng::new(24);
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for log in [false, true] {
            for axis in 0..2 {
                let g = op_graph(Op::Softmax { axis, log }, &[(dtype, &[6, 9])]);
                let (lo, hi) = if dtype == DType::F16 {
                    (-60.0, 60.0)
                } else {
                    (-1000.0, 1000.0)
                };
                let x = random(&mut rng, dtype, &[6, 9], lo, hi);
                check_with(
                    &g,
                    &Weights::new(),
                    &[x],
                    tol(dtype).max(1e-5),
                    &format!("softmax {dtype} log={log} axis={axis}"),
                );
                let x = random(&mut rng, dtype, &[6, 9], -3.0, 3.0);
                check(&g, &[x], &format!("softmax {dtype} log={log} axis={axis}"));
            }
        }
    }
}

#[test]
fn layer_and_rms_norm() {
    let mut rng = Rng::new(25);
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for (hw, hb) in [(false, false), (true, false), (true, true)] {
            let mut ins: Vec<(DType, &[usize])> = vec![(dtype, &[4, 3, 8])];
            if hw {
                ins.push((dtype, &[3, 8]));
            }
            if hb {
                ins.push((dtype, &[3, 8]));
            }
            let g = op_graph(
                Op::LayerNorm {
                    axis: 1,
                    eps: 1e-5,
                    has_weight: hw,
                    has_bias: hb,
                },
                &ins,
            );
            let vals: Vec<Value> = ins
                .iter()
                .map(|(d, s)| random(&mut rng, *d, s, -3.0, 5.0))
                .collect();
            check(&g, &vals, &format!("layer_norm {dtype} {hw} {hb}"));
            let ins = &ins[..1 + hw as usize];
            let g = op_graph(
                Op::RmsNorm {
                    axis: 2,
                    eps: 1e-6,
                    has_weight: hw,
                },
                &[ins[0], (dtype, &[8])][..ins.len()],
            );
            let mut vals = vec![random(&mut rng, dtype, &[4, 3, 8], -3.0, 5.0)];
            if hw {
                vals.push(random(&mut rng, dtype, &[8], -2.0, 2.0));
            }
            check(&g, &vals, &format!("rms_norm {dtype} {hw}"));
        }
    }
}

#[test]
fn attention_causal_and_masked() {
    let mut rng = Rng::new(26);
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let (q, k, v) = ([2, 3, 5, 8], [2, 3, 7, 8], [2, 3, 7, 6]);
        let t = match dtype {
            DType::F16 => 4e-3,
            DType::BF16 => 3e-2,
            DType::F32 => 1e-5,
            _ => 1e-12,
        };
        for causal in [false, true] {
            let g = op_graph(
                Op::Attention {
                    scale: 0.35,
                    causal,
                    has_mask: false,
                },
                &[(dtype, &q), (dtype, &k), (dtype, &v)],
            );
            let vals = [&q[..], &k, &v].map(|s| random(&mut rng, dtype, s, -2.0, 2.0));
            check_with(
                &g,
                &Weights::new(),
                &vals,
                t,
                &format!("attention {dtype} causal={causal}"),
            );
        }
        // Bool mask (keep where true; column 0 always kept so no row is fully masked).
        let g = op_graph(
            Op::Attention {
                scale: 0.35,
                causal: false,
                has_mask: true,
            },
            &[
                (dtype, &q),
                (dtype, &k),
                (dtype, &v),
                (DType::Bool, &[2, 3, 5, 7]),
            ],
        );
        let mut vals: Vec<Value> = [&q[..], &k, &v]
            .iter()
            .map(|s| random(&mut rng, dtype, s, -2.0, 2.0))
            .collect();
        let mut m = random(&mut rng, DType::Bool, &[2, 3, 5, 7], 0.0, 1.0);
        if let Data::I(d) = &mut m.data {
            for row in d.chunks_mut(7) {
                row[0] = 1;
            }
        }
        vals.push(m);
        check_with(
            &g,
            &Weights::new(),
            &vals,
            t,
            &format!("attention {dtype} bool mask"),
        );
        // Float (additive) mask.
        let g = op_graph(
            Op::Attention {
                scale: 0.35,
                causal: true,
                has_mask: true,
            },
            &[
                (dtype, &q),
                (dtype, &k),
                (dtype, &v),
                (dtype, &[2, 3, 5, 7]),
            ],
        );
        let mut vals: Vec<Value> = [&q[..], &k, &v]
            .iter()
            .map(|s| random(&mut rng, dtype, s, -2.0, 2.0))
            .collect();
        vals.push(random(&mut rng, dtype, &[2, 3, 5, 7], -3.0, 0.0));
        check_with(
            &g,
            &Weights::new(),
            &vals,
            t,
            &format!("attention {dtype} float mask"),
        );
    }
}

/// Grouped-query attention as models write it: each of 2 key/value heads repeated for 3
/// query heads (`reshape(expand(reshape(k)))`), which the backend attends in place
/// (`grouped_attention.rs`) — decode and prefill rows, causal, masked, and a repeat that
/// is also an output (so it must still be computed). Half-precision decode rows read the
/// keys and values as stored, widened in the kernel's registers.
#[test]
fn grouped_query_attention_reads_shared_heads_in_place() {
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        grouped_query_attention(dtype);
    }
}

fn grouped_query_attention(dtype: DType) {
    use ember_core::dim::Dim;
    let mut rng = Rng::new(27);
    let dims = |v: &[usize]| v.iter().map(|&d| Dim::Const(d as i64)).collect::<Vec<_>>();
    let tol = match dtype {
        DType::F16 => 4e-3,
        DType::BF16 => 3e-2,
        _ => 1e-5,
    };
    // Decode rows run each group's query heads as one batch (`shared_kv_runs`): a mask
    // per head must still reach its own row, and widths of 32 + 8 (+ 3) take the AVX2
    // blocks and the scalar tail.
    for (rows, causal, masked, repeat_out, mask_per_head, (e, ev)) in [
        (1, false, false, false, false, (8, 6)),
        (1, false, true, false, false, (8, 6)),
        (1, false, true, false, true, (32, 40)),
        (1, true, false, false, false, (32, 40)),
        (1, false, true, false, true, (12, 8)),
        (1, false, false, false, false, (43, 43)),
        (4, true, false, false, false, (8, 6)),
        (4, false, true, true, false, (8, 6)),
    ] {
        let (b, hkv, group, s) = (2, 2, 3, 9);
        let mut g = Graph::new();
        let q = input(&mut g, 0, dtype, &[b, hkv * group, rows, e]);
        let k = input(&mut g, 1, dtype, &[b, hkv, s, e]);
        let v = input(&mut g, 2, dtype, &[b, hkv, s, ev]);
        let repeat = |g: &mut Graph, x: usize, width: usize| {
            let one = g
                .add(
                    Op::Reshape {
                        shape: dims(&[b, hkv, 1, s, width]),
                    },
                    &[x],
                    "r",
                )
                .unwrap();
            let wide = g
                .add(
                    Op::Expand {
                        shape: dims(&[b, hkv, group, s, width]),
                    },
                    &[one],
                    "e",
                )
                .unwrap();
            g.add(
                Op::Reshape {
                    shape: dims(&[b, hkv * group, s, width]),
                },
                &[wide],
                "m",
            )
            .unwrap()
        };
        let (rk, rv) = (repeat(&mut g, k, e), repeat(&mut g, v, ev));
        let mut ins = vec![q, rk, rv];
        let mut vals = vec![
            random(&mut rng, dtype, &[b, hkv * group, rows, e], -2.0, 2.0),
            random(&mut rng, dtype, &[b, hkv, s, e], -2.0, 2.0),
            random(&mut rng, dtype, &[b, hkv, s, ev], -2.0, 2.0),
        ];
        if masked && mask_per_head {
            // An additive mask of its own for every query head.
            let m = input(&mut g, 3, dtype, &[b, hkv * group, rows, s]);
            ins.push(m);
            vals.push(random(
                &mut rng,
                dtype,
                &[b, hkv * group, rows, s],
                -3.0,
                0.0,
            ));
        } else if masked {
            // One mask row per batch, broadcast over heads (as a padding mask is).
            let m = input(&mut g, 3, DType::Bool, &[b, 1, rows, s]);
            let wide = g
                .add(
                    Op::Expand {
                        shape: dims(&[b, hkv * group, rows, s]),
                    },
                    &[m],
                    "mask",
                )
                .unwrap();
            ins.push(wide);
            let mut mv = random(&mut rng, DType::Bool, &[b, 1, rows, s], 0.0, 1.0);
            if let Data::I(d) = &mut mv.data {
                for row in d.chunks_mut(s) {
                    row[0] = 1;
                }
            }
            vals.push(mv);
        }
        let op = Op::Attention {
            scale: 0.3,
            causal,
            has_mask: masked,
        };
        let out = g.add(op, &ins, "attention").unwrap();
        g.outputs.push(out);
        if repeat_out {
            g.outputs.push(rk);
        }
        let what = format!(
            "grouped attention {dtype} rows={rows} causal={causal} masked={masked} per head={mask_per_head} e={e} ev={ev}"
        );
        check_with(&g, &Weights::new(), &vals, tol, &what);
    }
}
