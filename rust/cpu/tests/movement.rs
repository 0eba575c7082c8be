//! Indexing, views, data movement, sources, concurrency and input errors against the
//! interpreter.

mod common;

use std::sync::Arc;

use common::*;
use ember_core::backend::{Backend, Weights};
use ember_core::dim::Dim;
use ember_core::dtype::{DType, Scalar};
use ember_core::interp::{self, Value};
use ember_core::ir::{ConstData, Graph, Op, ScanOp};
use ember_core::tensor::HostTensor;
use ember_cpu::CpuBackend;

fn dims(v: &[usize]) -> Vec<Dim> {
    v.iter().map(|&d| Dim::from(d)).collect()
}

#[test]
fn gather_and_index_select_with_negative_indices() {
    let mut rng = Rng::new(27);
    for idt in [DType::I64, DType::I32] {
        let g = op_graph(
            Op::Gather { axis: 1 },
            &[(DType::F32, &[3, 5]), (idt, &[3, 4])],
        );
        let x = random(&mut rng, DType::F32, &[3, 5], -1.0, 1.0);
        let i = random(&mut rng, idt, &[3, 4], -5.0, 4.0);
        check(&g, &[x, i], "gather");
        let g = op_graph(
            Op::Gather { axis: 0 },
            &[(DType::I16, &[3, 5]), (idt, &[2, 5])],
        );
        let x = random(&mut rng, DType::I16, &[3, 5], -100.0, 100.0);
        let i = random(&mut rng, idt, &[2, 5], -3.0, 2.0);
        check(&g, &[x, i], "gather axis 0");
        let g = op_graph(
            Op::IndexSelect { axis: 1 },
            &[(DType::BF16, &[2, 6, 3]), (idt, &[2, 2])],
        );
        let x = random(&mut rng, DType::BF16, &[2, 6, 3], -1.0, 1.0);
        let i = random(&mut rng, idt, &[2, 2], -6.0, 5.0);
        check(&g, &[x, i], "index_select");
        let g = op_graph(
            Op::IndexSelect { axis: 0 },
            &[(DType::F32, &[10, 4]), (idt, &[7])],
        );
        let x = random(&mut rng, DType::F32, &[10, 4], -1.0, 1.0);
        let i = random(&mut rng, idt, &[7], -10.0, 9.0);
        check(&g, &[x, i], "embedding");
    }
}

#[test]
fn out_of_range_indices_are_errors() {
    let g = op_graph(
        Op::Gather { axis: 1 },
        &[(DType::F32, &[2, 3]), (DType::I64, &[2, 2])],
    );
    let x = Value::from_f64(DType::F32, vec![2, 3], vec![0.0; 6]);
    for bad in [3, -4, i64::MIN, i64::MAX] {
        let i = Value::from_i64(DType::I64, vec![2, 2], vec![0, 1, bad, 2]);
        let err = run_cpu(&g, &Weights::new(), &[x.clone(), i])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("gather") && err.contains("out of range"),
            "{err}"
        );
    }
    let g = op_graph(
        Op::IndexSelect { axis: 0 },
        &[(DType::F32, &[2, 3]), (DType::I32, &[1])],
    );
    let i = Value::from_i64(DType::I32, vec![1], vec![2]);
    let err = run_cpu(&g, &Weights::new(), &[x.clone(), i])
        .unwrap_err()
        .to_string();
    assert!(err.contains("index_select"), "{err}");
    // A gather index larger than the input outside the axis is a shape error, not a read.
    let g = op_graph(
        Op::Gather { axis: 1 },
        &[(DType::F32, &[2, 3]), (DType::I64, &[3, 1])],
    );
    let i = Value::from_i64(DType::I64, vec![3, 1], vec![0, 0, 0]);
    assert!(run_cpu(&g, &Weights::new(), &[x, i]).is_err());
}

#[test]
fn views_and_movement() {
    let mut rng = Rng::new(28);
    let mut g = Graph::new();
    let x = input(&mut g, 0, DType::F32, &[4, 6, 5]);
    let p = g
        .add(
            Op::Permute {
                perm: vec![2, 0, 1],
            },
            &[x],
            "p",
        )
        .unwrap();
    let s = g
        .add(
            Op::Slice {
                axis: 2,
                start: Dim::from(1usize),
                end: Dim::from(6usize),
                step: 2,
            },
            &[p],
            "s",
        )
        .unwrap();
    let f = g.add(Op::Flip { axes: vec![0, 2] }, &[s], "f").unwrap();
    let r = g
        .add(
            Op::Reshape {
                shape: dims(&[5, 12]),
            },
            &[f],
            "r",
        )
        .unwrap();
    let pad = g
        .add(
            Op::Pad {
                pads: vec![(1, 2), (0, 3)],
                value: Scalar::Float(-7.5),
            },
            &[r],
            "pad",
        )
        .unwrap();
    let c = g
        .add(
            Op::Scan {
                axis: 0,
                op: ScanOp::Sum,
            },
            &[pad],
            "cs",
        )
        .unwrap();
    let cat = g
        .add(Op::Concat { axis: 1 }, &[pad, c, pad], "cat")
        .unwrap();
    g.outputs.extend([f, r, pad, c, cat]);
    let v = random(&mut rng, DType::F32, &[4, 6, 5], -1.0, 1.0);
    check_with(&g, &Weights::new(), &[v], 1e-5, "view chain");
    for dtype in [DType::I64, DType::F16, DType::Bool, DType::U8] {
        let mut g = Graph::new();
        let x = input(&mut g, 0, dtype, &[3, 4]);
        let t = g.add(Op::Permute { perm: vec![1, 0] }, &[x], "t").unwrap();
        let r = g
            .add(
                Op::Reshape {
                    shape: dims(&[2, 6]),
                },
                &[t],
                "r",
            )
            .unwrap();
        let pad = g
            .add(
                Op::Pad {
                    pads: vec![(0, 1), (2, 0)],
                    value: Scalar::Int(1),
                },
                &[r],
                "pad",
            )
            .unwrap();
        let cat = g.add(Op::Concat { axis: 0 }, &[pad, pad], "cat").unwrap();
        g.outputs.extend([r, cat]);
        if dtype != DType::Bool {
            let c = g
                .add(
                    Op::Scan {
                        axis: 1,
                        op: ScanOp::Sum,
                    },
                    &[t],
                    "cs",
                )
                .unwrap();
            g.outputs.push(c);
        }
        let v = random(&mut rng, dtype, &[3, 4], -9.0, 9.0);
        check(&g, &[v], &format!("movement {dtype}"));
    }
}

#[test]
fn sources_full_iota_constant_weight() {
    let mut g = Graph::new();
    let f = g
        .add_source(
            Op::Full {
                value: Scalar::Float(2.5),
            },
            ty(DType::BF16, &[2, 3]),
            "full",
        )
        .unwrap();
    let i = g
        .add_source(
            Op::Iota {
                start: Scalar::Int(-3),
                step: Scalar::Int(2),
            },
            ty(DType::I32, &[5]),
            "iota",
        )
        .unwrap();
    let fi = g
        .add_source(
            Op::Iota {
                start: Scalar::Float(0.5),
                step: Scalar::Float(0.25),
            },
            ty(DType::F32, &[4]),
            "iota_f",
        )
        .unwrap();
    let bytes: Vec<u8> = [1.0f32, -2.0, 3.5]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let c = g
        .add_source(
            Op::Constant(ConstData {
                shape: vec![3],
                bytes: Arc::new(bytes),
            }),
            ty(DType::F32, &[3]),
            "const",
        )
        .unwrap();
    let w = g
        .add_source(Op::Weight { name: "w".into() }, ty(DType::F32, &[3]), "w")
        .unwrap();
    let s = g
        .add(Op::Binary(ember_core::ir::BinaryOp::Add), &[c, w], "add")
        .unwrap();
    g.outputs.extend([f, i, fi, s, w]);
    let wb: Vec<u8> = [10.0f32, 20.0, 30.0]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let mut weights = Weights::new();
    weights.insert(
        "w".into(),
        HostTensor::owned(DType::F32, vec![3], wb).unwrap(),
    );
    check_with(&g, &weights, &[], 0.0, "sources");
    let out = run_cpu(&g, &weights, &[]).unwrap();
    assert_eq!(out[1].to_i64_vec(), vec![-3, -1, 1, 3, 5]);
    assert_eq!(out[3].to_f64_vec(), vec![11.0, 18.0, 33.5]);
    // A missing weight is a compile error.
    assert!(CpuBackend::new(1).compile(&g, &Weights::new()).is_err());
}

#[test]
fn concurrent_calls_share_one_executable() {
    let mut rng = Rng::new(29);
    let g = op_graph(
        Op::Softmax {
            axis: 1,
            log: false,
        },
        &[(DType::F32, &[64, 300])],
    );
    let backend = CpuBackend::new(2);
    let exe = backend.compile(&g, &Weights::new()).unwrap();
    let inputs: Vec<Value> = (0..4)
        .map(|_| random(&mut rng, DType::F32, &[64, 300], -5.0, 5.0))
        .collect();
    let (exe, g) = (&exe, &g);
    std::thread::scope(|s| {
        for x in &inputs {
            s.spawn(move || {
                let want = interp::run(g, &Weights::new(), std::slice::from_ref(x)).unwrap();
                for _ in 0..3 {
                    let data = aligned(&x.to_bytes());
                    let mut out = vec![0u64; 64 * 300 / 2];
                    let view = ember_core::tensor::TensorView {
                        ptr: data.as_ptr() as *const u8,
                        dtype: DType::F32,
                        shape: vec![64, 300],
                        strides: vec![300, 1],
                    };
                    let o = ember_core::tensor::TensorOut {
                        ptr: out.as_mut_ptr() as *mut u8,
                        dtype: DType::F32,
                        shape: vec![64, 300],
                    };
                    // SAFETY: buffers are live and sized for the shapes.
                    unsafe { exe.run(&[view], &[o]).unwrap() };
                    // SAFETY: out holds 64·300 f32s.
                    let raw = unsafe {
                        std::slice::from_raw_parts(out.as_ptr() as *const u8, 64 * 300 * 4)
                    };
                    let got = Value::from_bytes(DType::F32, vec![64, 300], raw).unwrap();
                    assert_close(&got, &want[0], 1e-5, "concurrent softmax");
                }
            });
        }
    });
}

#[test]
fn wrong_inputs_are_errors_not_panics() {
    let g = op_graph(
        Op::Unary(ember_core::ir::UnaryOp::Neg),
        &[(DType::F32, &[2, 3])],
    );
    let x = Value::from_f64(DType::F32, vec![3, 2], vec![0.0; 6]);
    assert!(run_cpu(&g, &Weights::new(), &[x]).is_err());
    let x = Value::from_f64(DType::F64, vec![2, 3], vec![0.0; 6]);
    assert!(run_cpu(&g, &Weights::new(), &[x]).is_err());
    assert!(run_cpu(&g, &Weights::new(), &[]).is_err());
}

#[test]
fn cache_append_matches_the_interpreter() {
    let mut rng = Rng::new(41);
    let (b, n, p, s, h) = (3, 2, 5, 2, 4);
    for len in [p + s, p, p + s + 3] {
        for dtype in [DType::F32, DType::BF16, DType::I64] {
            let op = Op::CacheAppend {
                axis: 2,
                len: Dim::from(len),
            };
            let ins: [(DType, &[usize]); 3] = [
                (dtype, &[b, n, p, h]),
                (dtype, &[b, n, s, h]),
                (DType::I32, &[b]),
            ];
            let g = op_graph(op, &ins);
            let past = random(&mut rng, dtype, &[b, n, p, h], -9.0, 9.0);
            let new = random(&mut rng, dtype, &[b, n, s, h], -9.0, 9.0);
            // Cached lengths before, at and past the buffer, and negative.
            let lengths = Value::from_i64(DType::I32, vec![b], vec![p as i64, 1, -1]);
            check(&g, &[past.clone(), new.clone(), lengths], "cache_append");
            let lengths = Value::from_i64(DType::I32, vec![b], vec![p as i64 + 2, 0, 3]);
            check(&g, &[past, new, lengths], "cache_append past the buffer");
        }
    }
    // New entries as a permuted view ([B, S, N, H] → [B, N, S, H]), as attention makes them.
    let mut g = Graph::new();
    let past = input(&mut g, 0, DType::F32, &[b, n, p, h]);
    let new = input(&mut g, 1, DType::F32, &[b, s, n, h]);
    let lengths = input(&mut g, 2, DType::I64, &[b]);
    let new_t = g
        .add(
            Op::Permute {
                perm: vec![0, 2, 1, 3],
            },
            &[new],
            "t",
        )
        .unwrap();
    let op = Op::CacheAppend {
        axis: 2,
        len: Dim::from(p + s),
    };
    let out = g.add(op, &[past, new_t, lengths], "present").unwrap();
    g.outputs.push(out);
    let inputs = [
        random(&mut rng, DType::F32, &[b, n, p, h], -1.0, 1.0),
        random(&mut rng, DType::F32, &[b, s, n, h], -1.0, 1.0),
        Value::from_i64(DType::I64, vec![b], vec![5, 3, 4]),
    ];
    check(&g, &inputs, "cache_append of a permuted view");
}
