//! Unary, binary, where and cast against the interpreter, on every dtype, with strided and
//! broadcast operands, scalars and empty tensors.

mod common;

use common::*;
use ember_core::backend::Weights;
use ember_core::dim::Dim;
use ember_core::dtype::DType;
use ember_core::interp::{self, Value};
use ember_core::ir::{BinaryOp, Graph, Op, UnaryOp};
use ember_cpu::CpuBackend;

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];
const INTS: [DType; 5] = [DType::U8, DType::I8, DType::I16, DType::I32, DType::I64];

#[test]
fn hand_computed_add_and_relu() {
    let mut g = Graph::new();
    let a = input(&mut g, 0, DType::F32, &[2, 2]);
    let b = input(&mut g, 1, DType::F32, &[2, 2]);
    let s = g.add(Op::Binary(BinaryOp::Add), &[a, b], "add").unwrap();
    let r = g.add(Op::Unary(UnaryOp::Relu), &[s], "relu").unwrap();
    g.outputs.push(r);
    let x = Value::from_f64(DType::F32, vec![2, 2], vec![1.0, -2.0, 3.0, -4.0]);
    let y = Value::from_f64(DType::F32, vec![2, 2], vec![0.5, 1.0, -5.0, 10.0]);
    let out = run_cpu(&g, &Weights::new(), &[x, y]).unwrap();
    assert_eq!(out[0].to_f64_vec(), vec![1.5, 0.0, 0.0, 6.0]);
}

#[test]
fn hand_computed_integer_division_rules() {
    let g = op_graph(
        Op::Binary(BinaryOp::FloorDiv),
        &[(DType::I32, &[4]), (DType::I32, &[4])],
    );
    let a = Value::from_i64(DType::I32, vec![4], vec![7, -7, 7, -7]);
    let b = Value::from_i64(DType::I32, vec![4], vec![2, 2, -2, -2]);
    let out = run_cpu(&g, &Weights::new(), &[a.clone(), b.clone()]).unwrap();
    assert_eq!(out[0].to_i64_vec(), vec![3, -4, -4, 3]);
    let g = op_graph(
        Op::Binary(BinaryOp::Rem),
        &[(DType::I32, &[4]), (DType::I32, &[4])],
    );
    let out = run_cpu(&g, &Weights::new(), &[a.clone(), b.clone()]).unwrap();
    assert_eq!(out[0].to_i64_vec(), vec![1, 1, -1, -1]);
    let g = op_graph(
        Op::Binary(BinaryOp::Fmod),
        &[(DType::I32, &[4]), (DType::I32, &[4])],
    );
    let out = run_cpu(&g, &Weights::new(), &[a, b]).unwrap();
    assert_eq!(out[0].to_i64_vec(), vec![1, -1, 1, -1]);
}

#[test]
fn hand_computed_round_half_even_and_erf() {
    let g = op_graph(Op::Unary(UnaryOp::Round), &[(DType::F32, &[5])]);
    let x = Value::from_f64(DType::F32, vec![5], vec![0.5, 1.5, 2.5, -0.5, -1.5]);
    let out = run_cpu(&g, &Weights::new(), &[x]).unwrap();
    assert_eq!(out[0].to_f64_vec(), vec![0.0, 2.0, 2.0, -0.0, -2.0]);
    let g = op_graph(Op::Unary(UnaryOp::Erf), &[(DType::F64, &[3])]);
    let x = Value::from_f64(DType::F64, vec![3], vec![0.5, -1.0, 3.0]);
    let out = run_cpu(&g, &Weights::new(), &[x]).unwrap();
    let want = [
        0.520_499_877_813_046_5,
        -0.842_700_792_949_714_9,
        0.999_977_909_503_001_4,
    ];
    for (a, b) in out[0].to_f64_vec().iter().zip(want) {
        assert!((a - b).abs() < 1e-15, "{a} vs {b}");
    }
}

#[test]
fn every_unary_op_on_floats() {
    let mut rng = Rng::new(1);
    for dtype in FLOATS {
        for op in UnaryOp::ALL {
            if op == UnaryOp::BitNot {
                continue;
            }
            let g = op_graph(Op::Unary(op), &[(dtype, &[7, 13])]);
            let mut x = random(&mut rng, dtype, &[7, 13], -3.0, 3.0);
            if let ember_core::interp::Data::F(v) = &mut x.data {
                v[0] = 0.0;
                v[1] = f64::NAN;
                v[2] = f64::INFINITY;
                v[3] = f64::NEG_INFINITY;
                v[4] = 2.5;
            }
            check(&g, &[x], &format!("{} {dtype}", op.name()));
        }
    }
}

#[test]
fn every_unary_op_on_integers_and_bool() {
    let mut rng = Rng::new(2);
    for dtype in INTS.into_iter().chain([DType::Bool]) {
        for op in UnaryOp::ALL {
            if op.needs_float() {
                continue;
            }
            let g = op_graph(Op::Unary(op), &[(dtype, &[5, 9])]);
            let x = random(&mut rng, dtype, &[5, 9], -200.0, 200.0);
            check(&g, &[x], &format!("{} {dtype}", op.name()));
        }
    }
}

#[test]
fn every_binary_op_on_floats() {
    let mut rng = Rng::new(3);
    for dtype in FLOATS {
        for op in BinaryOp::ALL {
            if op.is_logical() {
                continue;
            }
            let g = op_graph(Op::Binary(op), &[(dtype, &[7, 13]), (dtype, &[7, 13])]);
            let a = random(&mut rng, dtype, &[7, 13], -4.0, 4.0);
            let mut b = random(&mut rng, dtype, &[7, 13], -4.0, 4.0);
            if let ember_core::interp::Data::F(v) = &mut b.data {
                v[0] = f64::NAN;
                v[1] = 0.0;
                v[2] = 2.0;
            }
            check(&g, &[a, b], &format!("{} {dtype}", op.name()));
        }
    }
}

#[test]
fn every_binary_op_on_integers_with_negatives() {
    let mut rng = Rng::new(4);
    for dtype in INTS {
        for op in BinaryOp::ALL {
            if op == BinaryOp::Atan2 {
                continue;
            }
            let g = op_graph(Op::Binary(op), &[(dtype, &[6, 11]), (dtype, &[6, 11])]);
            let a = random(&mut rng, dtype, &[6, 11], -100.0, 100.0);
            let b = if op == BinaryOp::Pow {
                random(&mut rng, dtype, &[6, 11], -3.0, 6.0)
            } else {
                random(&mut rng, dtype, &[6, 11], -9.0, 9.0)
            };
            check(&g, &[a, b], &format!("{} {dtype}", op.name()));
        }
    }
}

#[test]
fn integer_arithmetic_wraps() {
    let g = op_graph(
        Op::Binary(BinaryOp::Mul),
        &[(DType::I8, &[3]), (DType::I8, &[3])],
    );
    let a = Value::from_i64(DType::I8, vec![3], vec![100, -128, 127]);
    let b = Value::from_i64(DType::I8, vec![3], vec![3, -1, 2]);
    check(&g, &[a.clone(), b.clone()], "i8 mul wraps");
    let out = run_cpu(&g, &Weights::new(), &[a, b]).unwrap();
    assert_eq!(out[0].to_i64_vec(), vec![44, -128, -2]);
}

#[test]
fn bool_logic() {
    let mut rng = Rng::new(5);
    use BinaryOp::*;
    for op in [Add, Mul, And, Or, Xor, Eq, Ne, Lt, Le, Gt, Ge, Max, Min] {
        let g = op_graph(
            Op::Binary(op),
            &[(DType::Bool, &[17]), (DType::Bool, &[17])],
        );
        let a = random(&mut rng, DType::Bool, &[17], 0.0, 1.0);
        let b = random(&mut rng, DType::Bool, &[17], 0.0, 1.0);
        check(&g, &[a, b], &format!("bool {}", op.name()));
    }
}

#[test]
fn where_and_cast_on_every_dtype() {
    let mut rng = Rng::new(6);
    for dtype in ember_core::dtype::DType::ALL {
        let g = op_graph(
            Op::Where,
            &[(DType::Bool, &[4, 5]), (dtype, &[4, 5]), (dtype, &[4, 5])],
        );
        let c = random(&mut rng, DType::Bool, &[4, 5], 0.0, 1.0);
        let a = random(&mut rng, dtype, &[4, 5], -50.0, 50.0);
        let b = random(&mut rng, dtype, &[4, 5], -50.0, 50.0);
        check(&g, &[c, a, b], &format!("where {dtype}"));
    }
    for from in DType::ALL {
        for to in DType::ALL {
            let g = op_graph(Op::Cast { to }, &[(from, &[3, 7])]);
            // Negative floats into uint8 are unspecified; keep them in range there.
            let lo = if to == DType::U8 { 0.0 } else { -100.0 };
            let x = random(&mut rng, from, &[3, 7], lo, 100.0);
            check(&g, &[x], &format!("cast {from} -> {to}"));
        }
    }
}

#[test]
fn transposed_inputs_read_in_place() {
    let mut rng = Rng::new(7);
    let g = op_graph(
        Op::Binary(BinaryOp::Sub),
        &[(DType::F32, &[7, 13]), (DType::F32, &[7, 13])],
    );
    let a = random(&mut rng, DType::F32, &[7, 13], -1.0, 1.0);
    let b = random(&mut rng, DType::F32, &[7, 13], -1.0, 1.0);
    let want = interp::run(&g, &Weights::new(), &[a.clone(), b.clone()]).unwrap();
    let got = run_cpu_strided(
        &CpuBackend::new(1),
        &g,
        &Weights::new(),
        &[Strided::transposed(&a), Strided::contiguous(&b)],
    )
    .unwrap();
    assert_close(&got[0], &want[0], 0.0, "transposed sub");
    // A misaligned input (one byte into its buffer) is copied, not misread.
    let mut s = Strided::contiguous(&a);
    let bytes = a.to_bytes();
    let mut shifted = vec![0u8; 1];
    shifted.extend_from_slice(&bytes);
    s.storage = aligned(&shifted);
    s.byte_offset = 1;
    let got = run_cpu_strided(
        &CpuBackend::new(1),
        &g,
        &Weights::new(),
        &[s, Strided::contiguous(&b)],
    )
    .unwrap();
    assert_close(&got[0], &want[0], 0.0, "misaligned sub");
}

#[test]
fn broadcasting_through_reshape_and_expand() {
    let mut rng = Rng::new(8);
    let mut g = Graph::new();
    let a = input(&mut g, 0, DType::F32, &[3]);
    let b = input(&mut g, 1, DType::F32, &[3, 5]);
    let r = g
        .add(
            Op::Reshape {
                shape: vec![Dim::from(3usize), Dim::from(1usize)],
            },
            &[a],
            "r",
        )
        .unwrap();
    let e = g
        .add(
            Op::Expand {
                shape: vec![Dim::from(3usize), Dim::from(5usize)],
            },
            &[r],
            "e",
        )
        .unwrap();
    let m = g.add(Op::Binary(BinaryOp::Mul), &[e, b], "mul").unwrap();
    g.outputs.push(m);
    g.outputs.push(e);
    let x = random(&mut rng, DType::F32, &[3], -2.0, 2.0);
    let y = random(&mut rng, DType::F32, &[3, 5], -2.0, 2.0);
    check(&g, &[x, y], "broadcast mul");
}

#[test]
fn scalars_and_empty_tensors() {
    let mut rng = Rng::new(9);
    let g = op_graph(
        Op::Binary(BinaryOp::Add),
        &[(DType::F32, &[]), (DType::F32, &[])],
    );
    let a = random(&mut rng, DType::F32, &[], -1.0, 1.0);
    let b = random(&mut rng, DType::F32, &[], -1.0, 1.0);
    check(&g, &[a, b], "0-d add");
    let g = op_graph(Op::Unary(UnaryOp::Exp), &[(DType::F32, &[0, 5])]);
    let x = random(&mut rng, DType::F32, &[0, 5], -1.0, 1.0);
    check(&g, &[x], "empty exp");
    let g = op_graph(Op::Cast { to: DType::I64 }, &[(DType::F16, &[3, 0])]);
    let x = random(&mut rng, DType::F16, &[3, 0], -1.0, 1.0);
    check(&g, &[x], "empty cast");
}

#[test]
fn large_elementwise_runs_in_parallel_chunks() {
    let mut rng = Rng::new(10);
    let shape = [3, 129, 257];
    let g = op_graph(
        Op::Binary(BinaryOp::Atan2),
        &[(DType::F32, &shape), (DType::F32, &shape)],
    );
    let a = random(&mut rng, DType::F32, &shape, -2.0, 2.0);
    let b = random(&mut rng, DType::F32, &shape, -2.0, 2.0);
    check(&g, &[a, b], "large atan2");
}
