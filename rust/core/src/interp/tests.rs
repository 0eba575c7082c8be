//! Tests of values, rounding, elementwise ops, the executor and the backend wrapper.
//! (Reductions, movement and linear algebra are in `tests_ops.rs`.)

use std::collections::BTreeMap;

use super::*;
use crate::dim::Dim;
use crate::dtype::DType::{self, *};
use crate::ir::{BinaryOp, ConstData, TensorType, UnaryOp};
use crate::tensor::{HostTensor, TensorOut, TensorView};

pub(super) fn dims(s: &[usize]) -> Vec<Dim> {
    s.iter().map(|&d| Dim::from(d)).collect()
}

pub(super) fn fv(dtype: DType, shape: &[usize], v: &[f64]) -> Value {
    Value::from_f64(dtype, shape.to_vec(), v.to_vec())
}

pub(super) fn iv(dtype: DType, shape: &[usize], v: &[i64]) -> Value {
    Value::from_i64(dtype, shape.to_vec(), v.to_vec())
}

/// Runs `op` on graph inputs holding `args`.
pub(super) fn apply(op: Op, args: &[Value]) -> Result<Value> {
    let mut g = Graph::new();
    let mut ids = Vec::new();
    for (index, a) in args.iter().enumerate() {
        let ty = TensorType::new(a.dtype, dims(&a.shape));
        ids.push(g.add_source(Op::Input { index }, ty, "in").unwrap());
    }
    let out = g.add(op, &ids, "node")?;
    g.outputs.push(out);
    Ok(run(&g, &Weights::new(), args)?.remove(0))
}

pub(super) fn apply_ok(op: Op, args: &[Value]) -> Value {
    apply(op.clone(), args).unwrap_or_else(|e| panic!("{op:?}: {e}"))
}

/// Runs a source op of the given type.
fn source(op: Op, dtype: DType, shape: &[usize]) -> Result<Value> {
    let mut g = Graph::new();
    let id = g.add_source(op, TensorType::new(dtype, dims(shape)), "src")?;
    g.outputs.push(id);
    Ok(run(&g, &Weights::new(), &[])?.remove(0))
}

/// Exact equality of f64s where NaN equals NaN (and -0 equals 0).
#[track_caller]
pub(super) fn assert_f(v: &Value, want: &[f64]) {
    let got = v.to_f64_vec();
    let same = got.len() == want.len()
        && got
            .iter()
            .zip(want)
            .all(|(a, b)| a == b || (a.is_nan() && b.is_nan()));
    assert!(same, "got {got:?}, want {want:?}");
}

#[track_caller]
pub(super) fn assert_close(v: &Value, want: &[f64], tol: f64) {
    let got = v.to_f64_vec();
    let close = got.len() == want.len()
        && got.iter().zip(want).all(|(a, b)| {
            (a - b).abs() <= tol * b.abs().max(1.0) || (a.is_nan() && b.is_nan()) || a == b
        });
    assert!(close, "got {got:?}, want {want:?}");
}

fn un(op: UnaryOp, x: &Value) -> Value {
    apply_ok(Op::Unary(op), std::slice::from_ref(x))
}

fn bin(op: BinaryOp, a: &Value, b: &Value) -> Value {
    apply_ok(Op::Binary(op), &[a.clone(), b.clone()])
}

#[test]
fn bytes_round_trip_every_dtype() {
    for dtype in DType::ALL {
        let v = Value::from_f64(dtype, vec![2, 2], vec![0.0, 1.0, 3.0, 1.5]);
        let back = Value::from_bytes(dtype, vec![2, 2], &v.to_bytes()).unwrap();
        assert_eq!(back, v, "{dtype}");
        assert_eq!(v.to_bytes().len(), 4 * dtype.size());
    }
    assert!(Value::from_bytes(F32, vec![3], &[0; 8]).is_err());
    let v = Value::from_bytes(I16, vec![2], &[0xff, 0xff, 0x00, 0x80]).unwrap();
    assert_eq!(v.to_i64_vec(), [-1, -32768]);
    let s = Value::from_bytes(F64, vec![], &2.5f64.to_le_bytes()).unwrap();
    assert_eq!((s.numel(), s.to_f64_vec()), (1, vec![2.5]));
}

#[test]
fn rounding_to_narrow_floats_is_to_nearest_even() {
    let e10 = 2f64.powi(-10);
    // f16 has 10 fraction bits: 1 + 2^-11 is a tie (→ 1), 1 + 3·2^-11 a tie (→ 1 + 2^-9).
    let h = fv(
        F16,
        &[4],
        &[1.0 + e10 / 2.0, 1.0 + 3.0 * e10 / 2.0, 70000.0, 0.1],
    );
    assert_f(&h, &[1.0, 1.0 + 2.0 * e10, f64::INFINITY, 0.0999755859375]);
    // bf16 has 7 fraction bits.
    let e7 = 2f64.powi(-7);
    let b = fv(BF16, &[3], &[1.0 + e7 / 2.0, 1.0 + 3.0 * e7 / 2.0, 0.1]);
    assert_f(&b, &[1.0, 1.0 + 2.0 * e7, 0.10009765625]);
    assert_f(&fv(F32, &[1], &[0.1]), &[0.1f32 as f64]);
    // f16 math rounds at the op's output.
    let one = fv(F16, &[1], &[1.0]);
    let tiny = fv(F16, &[1], &[e10 / 2.0]);
    assert_f(&bin(BinaryOp::Add, &one, &tiny), &[1.0]);
}

#[test]
fn integers_wrap_and_bools_are_zero_one() {
    assert_eq!(iv(I8, &[2], &[200, -129]).to_i64_vec(), [-56, 127]);
    assert_eq!(iv(U8, &[2], &[-1, 256]).to_i64_vec(), [255, 0]);
    assert_eq!(iv(I16, &[1], &[40000]).to_i64_vec(), [-25536]);
    assert_eq!(iv(I32, &[1], &[1 << 31]).to_i64_vec(), [i32::MIN as i64]);
    assert_eq!(iv(Bool, &[3], &[2, 0, -1]).to_i64_vec(), [1, 0, 1]);
    assert_eq!(fv(I32, &[2], &[-2.7, 2.7]).to_i64_vec(), [-2, 2]);
    let a = iv(I8, &[1], &[100]);
    assert_eq!(bin(BinaryOp::Add, &a, &a).to_i64_vec(), [-56]);
    assert_eq!(
        un(UnaryOp::Abs, &iv(I8, &[1], &[-128])).to_i64_vec(),
        [-128]
    );
    assert_eq!(un(UnaryOp::Neg, &iv(U8, &[1], &[1])).to_i64_vec(), [255]);
}

#[test]
fn unary_float_ops() {
    let nan = f64::NAN;
    let x = fv(F64, &[5], &[-2.0, -0.0, 0.0, 3.0, nan]);
    assert_f(&un(UnaryOp::Sign, &x), &[-1.0, 0.0, 0.0, 1.0, nan]);
    assert_f(&un(UnaryOp::Relu, &x), &[0.0, 0.0, 0.0, 3.0, nan]);
    assert_f(&un(UnaryOp::Abs, &x), &[2.0, 0.0, 0.0, 3.0, nan]);
    assert_f(&un(UnaryOp::Not, &x).clone(), &[0.0, 1.0, 1.0, 0.0, 0.0]);
    assert_eq!(un(UnaryOp::IsNan, &x).to_i64_vec(), [0, 0, 0, 0, 1]);
    let inf = fv(F32, &[3], &[f64::INFINITY, -f64::INFINITY, 1.0]);
    assert_eq!(un(UnaryOp::IsInf, &inf).to_i64_vec(), [1, 1, 0]);

    let r = fv(
        F32,
        &[8],
        &[-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 0.49999997, -3.7],
    );
    assert_f(
        &un(UnaryOp::Round, &r),
        &[-2.0, -2.0, -0.0, 0.0, 2.0, 2.0, 0.0, -4.0],
    );
    let y = fv(F64, &[2], &[-1.5, 1.5]);
    assert_f(&un(UnaryOp::Floor, &y), &[-2.0, 1.0]);
    assert_f(&un(UnaryOp::Ceil, &y), &[-1.0, 2.0]);
    assert_f(&un(UnaryOp::Trunc, &y), &[-1.0, 1.0]);

    let g = fv(F64, &[2], &[1.0, -0.5]);
    assert_close(
        &un(UnaryOp::Gelu, &g),
        &[0.8413447460685429, -0.15426876936299344],
        1e-15,
    );
    assert_close(
        &un(UnaryOp::GeluTanh, &g),
        &[0.8411919906082768, -0.15428599017485609],
        1e-15,
    );
    assert_close(
        &un(UnaryOp::Sigmoid, &g),
        &[0.7310585786300049, 0.3775406687981454],
        1e-15,
    );
    assert_close(
        &un(UnaryOp::Silu, &g),
        &[0.7310585786300049, -0.1887703343990727],
        1e-15,
    );
    assert_close(
        &un(UnaryOp::Erf, &g),
        &[0.8427007929497149, -0.5204998778130465],
        1e-16,
    );
    let p = fv(F64, &[2], &[4.0, 0.25]);
    assert_f(&un(UnaryOp::Rsqrt, &p), &[0.5, 2.0]);
    assert_f(&un(UnaryOp::Recip, &p), &[0.25, 4.0]);
    assert_f(&un(UnaryOp::Sqrt, &p), &[2.0, 0.5]);
    let z = fv(F64, &[1], &[0.0]);
    assert_f(&un(UnaryOp::Exp, &z), &[1.0]);
    assert_f(&un(UnaryOp::Log, &z), &[f64::NEG_INFINITY]);
    assert_f(&un(UnaryOp::Expm1, &z), &[0.0]);
    assert_f(&un(UnaryOp::Log1p, &z), &[0.0]);
    assert_f(&un(UnaryOp::Cos, &z), &[1.0]);
    assert_f(&un(UnaryOp::Tanh, &z), &[0.0]);
}

#[test]
fn unary_integer_ops() {
    let x = iv(I32, &[3], &[-5, 0, 7]);
    assert_eq!(un(UnaryOp::Sign, &x).to_i64_vec(), [-1, 0, 1]);
    assert_eq!(un(UnaryOp::Relu, &x).to_i64_vec(), [0, 0, 7]);
    assert_eq!(un(UnaryOp::Round, &x).to_i64_vec(), [-5, 0, 7]);
    assert_eq!(un(UnaryOp::BitNot, &x).to_i64_vec(), [4, -1, -8]);
    assert_eq!(un(UnaryOp::Not, &x).to_i64_vec(), [0, 1, 0]);
    assert_eq!(un(UnaryOp::IsNan, &x).to_i64_vec(), [0, 0, 0]);
    let b = iv(Bool, &[2], &[0, 1]);
    assert_eq!(un(UnaryOp::BitNot, &b).to_i64_vec(), [1, 0]);
    assert_eq!(un(UnaryOp::Sign, &b).to_i64_vec(), [0, 1]);
    assert_eq!(un(UnaryOp::BitNot, &iv(U8, &[1], &[5])).to_i64_vec(), [250]);
    // Float-only ops on integers are rejected (by the type rule, or at run time).
    assert!(apply(Op::Unary(UnaryOp::Exp), std::slice::from_ref(&x)).is_err());
    assert!(elementwise::unary(UnaryOp::Exp, &x).is_err());
    assert!(elementwise::unary(UnaryOp::BitNot, &fv(F32, &[1], &[1.0])).is_err());
}

#[test]
fn integer_division_rounding_modes() {
    let a = iv(I64, &[6], &[-7, 7, -7, 7, 5, i64::MIN]);
    let b = iv(I64, &[6], &[2, -2, -2, 2, 0, -1]);
    assert_eq!(
        bin(BinaryOp::Div, &a, &b).to_i64_vec(),
        [-3, -3, 3, 3, 0, i64::MIN]
    );
    assert_eq!(
        bin(BinaryOp::FloorDiv, &a, &b).to_i64_vec(),
        [-4, -4, 3, 3, 0, i64::MIN]
    );
    assert_eq!(
        bin(BinaryOp::Rem, &a, &b).to_i64_vec(),
        [1, -1, -1, 1, 0, 0]
    );
    assert_eq!(
        bin(BinaryOp::Fmod, &a, &b).to_i64_vec(),
        [-1, 1, -1, 1, 0, 0]
    );
    let a8 = iv(I8, &[1], &[-128]);
    let m1 = iv(I8, &[1], &[-1]);
    assert_eq!(bin(BinaryOp::Div, &a8, &m1).to_i64_vec(), [-128]);
}

#[test]
fn float_division_rounding_modes() {
    let a = fv(F64, &[5], &[-7.0, 7.0, -7.0, 5.5, 1.0]);
    let b = fv(F64, &[5], &[2.0, -2.0, -2.0, -2.0, 0.0]);
    assert_f(
        &bin(BinaryOp::Div, &a, &b),
        &[-3.5, -3.5, 3.5, -2.75, f64::INFINITY],
    );
    assert_f(
        &bin(BinaryOp::FloorDiv, &a, &b),
        &[-4.0, -4.0, 3.0, -3.0, f64::INFINITY],
    );
    assert_f(
        &bin(BinaryOp::Rem, &a, &b),
        &[1.0, -1.0, -1.0, -0.5, f64::NAN],
    );
    assert_f(
        &bin(BinaryOp::Fmod, &a, &b),
        &[-1.0, 1.0, -1.0, 1.5, f64::NAN],
    );
}

#[test]
fn integer_and_float_pow() {
    let a = iv(I64, &[6], &[2, -3, 2, -1, 1, 0]);
    let b = iv(I64, &[6], &[10, 3, -1, -3, -5, 0]);
    assert_eq!(
        bin(BinaryOp::Pow, &a, &b).to_i64_vec(),
        [1024, -27, 0, -1, 1, 1]
    );
    let w = iv(I8, &[1], &[2]);
    assert_eq!(
        bin(BinaryOp::Pow, &w, &iv(I8, &[1], &[7])).to_i64_vec(),
        [-128]
    );
    let f = fv(F32, &[2], &[2.0, 9.0]);
    assert_f(
        &bin(BinaryOp::Pow, &f, &fv(F32, &[2], &[-1.0, 0.5])),
        &[0.5, 3.0],
    );
}

#[test]
fn max_min_propagate_nan_and_comparisons_follow_ieee() {
    let nan = f64::NAN;
    let a = fv(F32, &[3], &[nan, 1.0, 2.0]);
    let b = fv(F32, &[3], &[1.0, nan, 3.0]);
    assert_f(&bin(BinaryOp::Max, &a, &b), &[nan, nan, 3.0]);
    assert_f(&bin(BinaryOp::Min, &a, &b), &[nan, nan, 2.0]);
    assert_eq!(bin(BinaryOp::Eq, &a, &a).to_i64_vec(), [0, 1, 1]);
    assert_eq!(bin(BinaryOp::Ne, &a, &a).to_i64_vec(), [1, 0, 0]);
    assert_eq!(bin(BinaryOp::Lt, &a, &b).to_i64_vec(), [0, 0, 1]);
    assert_eq!(bin(BinaryOp::Ge, &a, &b).to_i64_vec(), [0, 0, 0]);
    let y = fv(F64, &[2], &[1.0, -1.0]);
    let x = fv(F64, &[2], &[0.0, 0.0]);
    let half_pi = std::f64::consts::FRAC_PI_2;
    assert_f(&bin(BinaryOp::Atan2, &y, &x), &[half_pi, -half_pi]);
}

#[test]
fn logical_and_bitwise_ops() {
    let p = iv(Bool, &[4], &[0, 0, 1, 1]);
    let q = iv(Bool, &[4], &[0, 1, 0, 1]);
    assert_eq!(bin(BinaryOp::And, &p, &q).to_i64_vec(), [0, 0, 0, 1]);
    assert_eq!(bin(BinaryOp::Or, &p, &q).to_i64_vec(), [0, 1, 1, 1]);
    assert_eq!(bin(BinaryOp::Xor, &p, &q).to_i64_vec(), [0, 1, 1, 0]);
    assert_eq!(bin(BinaryOp::Add, &p, &q).to_i64_vec(), [0, 1, 1, 1]);
    assert_eq!(bin(BinaryOp::Mul, &p, &q).to_i64_vec(), [0, 0, 0, 1]);
    let a = iv(I32, &[2], &[0b1100, -1]);
    let b = iv(I32, &[2], &[0b1010, 6]);
    assert_eq!(bin(BinaryOp::And, &a, &b).to_i64_vec(), [0b1000, 6]);
    assert_eq!(bin(BinaryOp::Xor, &a, &b).to_i64_vec(), [0b0110, -7]);
    let f = fv(F32, &[1], &[1.0]);
    assert!(elementwise::binary(BinaryOp::And, &f, &f).is_err());
    assert!(elementwise::binary(BinaryOp::Atan2, &a, &a).is_err());
}

#[test]
fn where_and_cast() {
    let c = iv(Bool, &[3], &[1, 0, 1]);
    let a = fv(F32, &[3], &[1.0, 2.0, 3.0]);
    let b = fv(F32, &[3], &[-1.0, -2.0, -3.0]);
    assert_f(&apply_ok(Op::Where, &[c, a, b]), &[1.0, -2.0, 3.0]);

    let x = fv(F32, &[5], &[-2.7, 2.7, 0.0, f64::NAN, -0.5]);
    assert_eq!(
        apply_ok(Op::Cast { to: I32 }, std::slice::from_ref(&x)).to_i64_vec(),
        [-2, 2, 0, 0, 0]
    );
    assert_eq!(
        apply_ok(Op::Cast { to: Bool }, &[x]).to_i64_vec(),
        [1, 1, 0, 1, 1]
    );
    let t = iv(Bool, &[2], &[1, 0]);
    assert_f(&apply_ok(Op::Cast { to: F16 }, &[t]), &[1.0, 0.0]);
    let d = fv(F64, &[1], &[1.0 + 2f64.powi(-12)]);
    assert_f(&apply_ok(Op::Cast { to: F16 }, &[d]), &[1.0]);
    let big = iv(I64, &[2], &[300, -129]);
    assert_eq!(
        apply_ok(Op::Cast { to: I8 }, &[big]).to_i64_vec(),
        [44, 127]
    );
    let i = iv(I64, &[1], &[(1 << 24) + 1]);
    assert_f(&apply_ok(Op::Cast { to: F32 }, &[i]), &[16777216.0]);
}

#[test]
fn sources_full_iota_constant() {
    let f = source(
        Op::Full {
            value: Scalar::Float(2.5),
        },
        I32,
        &[2, 2],
    )
    .unwrap();
    assert_eq!((f.shape.clone(), f.to_i64_vec()), (vec![2, 2], vec![2; 4]));
    let f = source(
        Op::Full {
            value: Scalar::Float(0.1),
        },
        F16,
        &[],
    )
    .unwrap();
    assert_f(&f, &[0.0999755859375]);
    let f = source(
        Op::Full {
            value: Scalar::Int(3),
        },
        Bool,
        &[1],
    )
    .unwrap();
    assert_eq!(f.to_i64_vec(), [1]);
    let iota = Op::Iota {
        start: Scalar::Float(0.5),
        step: Scalar::Float(0.25),
    };
    assert_f(&source(iota, F32, &[3]).unwrap(), &[0.5, 0.75, 1.0]);
    let iota = Op::Iota {
        start: Scalar::Int(3),
        step: Scalar::Int(-2),
    };
    assert_eq!(
        source(iota, I64, &[4]).unwrap().to_i64_vec(),
        [3, 1, -1, -3]
    );
    let bytes: Vec<u8> = [1i16, -2, 3].iter().flat_map(|x| x.to_le_bytes()).collect();
    let c = Op::Constant(ConstData {
        shape: vec![3],
        bytes: std::sync::Arc::new(bytes),
    });
    assert_eq!(source(c, I16, &[3]).unwrap().to_i64_vec(), [1, -2, 3]);
}

/// x: input [s, 2] (symbolic), w: weight [1, 2]; out = x * expand(w).
fn weighted_graph() -> Graph {
    let mut g = Graph::new();
    let ty = TensorType::new(F32, vec![Dim::sym("s"), Dim::from(2usize)]);
    let x = g.add_source(Op::Input { index: 0 }, ty, "x").unwrap();
    let wty = TensorType::new(F32, dims(&[1, 2]));
    let w = g
        .add_source(Op::Weight { name: "w".into() }, wty, "w")
        .unwrap();
    let shape = vec![Dim::sym("s"), Dim::from(2usize)];
    let we = g.add(Op::Expand { shape }, &[w], "expand").unwrap();
    let y = g.add(Op::Binary(BinaryOp::Mul), &[x, we], "mul").unwrap();
    g.outputs.push(y);
    g
}

fn weights() -> Weights {
    let bytes: Vec<u8> = [2f32, 10.0].iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut w = Weights::new();
    w.insert(
        "w".into(),
        HostTensor::owned(F32, vec![1, 2], bytes).unwrap(),
    );
    w
}

#[test]
fn runs_graphs_with_weights_and_symbolic_shapes() {
    let g = weighted_graph();
    let w = weights();
    for s in [0, 1, 3] {
        let x = fv(F32, &[s, 2], &vec![1.5; 2 * s]);
        let out = run(&g, &w, &[x]).unwrap();
        assert_eq!(out[0].shape, [s, 2]);
        assert_f(&out[0], &[3.0, 15.0].repeat(s));
    }
    let bound: BTreeMap<String, Value> = [("w".to_string(), fv(F32, &[1, 2], &[1.0, 1.0]))].into();
    let out = run_bound(&g, &bound, &[fv(F32, &[1, 2], &[4.0, 5.0])]).unwrap();
    assert_f(&out[0], &[4.0, 5.0]);
}

#[test]
fn bad_inputs_and_weights_are_errors() {
    let g = weighted_graph();
    let w = weights();
    assert!(run(&g, &Weights::new(), &[fv(F32, &[1, 2], &[0.0; 2])]).is_err());
    assert!(run(&g, &w, &[]).is_err());
    assert!(run(&g, &w, &[fv(F64, &[1, 2], &[0.0; 2])]).is_err());
    assert!(run(&g, &w, &[fv(F32, &[2, 1], &[0.0; 2])]).is_err());
    let broken = Value {
        dtype: F32,
        shape: vec![1, 2],
        data: Data::I(vec![1, 2]),
    };
    assert!(run(&g, &w, &[broken]).is_err());
    let short = Value {
        dtype: F32,
        shape: vec![1, 2],
        data: Data::F(vec![1.0]),
    };
    assert!(run(&g, &w, &[short]).is_err());
    for data in [Data::I(vec![1, 2]), Data::F(vec![1.0, 0.1])] {
        let dtype = if matches!(data, Data::I(_)) {
            Bool
        } else {
            F32
        };
        let odd = Value {
            dtype,
            shape: vec![2],
            data,
        };
        assert!(odd.check().is_err());
    }
    let mut wrong = Weights::new();
    let bytes = vec![0u8; 12];
    wrong.insert(
        "w".into(),
        HostTensor::owned(F32, vec![1, 3], bytes).unwrap(),
    );
    let err = run(&g, &wrong, &[fv(F32, &[1, 2], &[0.0; 2])]).unwrap_err();
    assert!(err.to_string().contains("'w'"), "{err}");
}

#[test]
fn reference_backend_reads_strided_views() {
    let g = weighted_graph();
    let exe = ReferenceBackend.compile(&g, &weights()).unwrap();
    assert_eq!(ReferenceBackend.name(), "reference");
    assert_eq!(exe.output_shapes(&[vec![3, 2]]).unwrap(), vec![vec![3, 2]]);
    // Memory holds a [2, 3] tensor; the input is its transpose, a [3, 2] view.
    let mem: Vec<f32> = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
    let view = TensorView {
        ptr: mem.as_ptr() as *const u8,
        dtype: F32,
        shape: vec![3, 2],
        strides: vec![1, 3],
    };
    let mut out = vec![0f32; 6];
    let buf = TensorOut {
        ptr: out.as_mut_ptr() as *mut u8,
        dtype: F32,
        shape: vec![3, 2],
    };
    // SAFETY: the view and the buffer cover live, disjoint vectors.
    unsafe {
        exe.run(std::slice::from_ref(&view), std::slice::from_ref(&buf))
            .unwrap()
    };
    assert_eq!(out, [2.0, 40.0, 4.0, 50.0, 6.0, 60.0]);
    // A broadcast view (stride 0).
    let row = TensorView {
        strides: vec![0, 1],
        ..view.clone()
    };
    // SAFETY: as above; stride 0 reads only the first two elements.
    unsafe { exe.run(&[row], std::slice::from_ref(&buf)).unwrap() };
    assert_eq!(out, [2.0, 20.0, 2.0, 20.0, 2.0, 20.0]);
    // Wrong dtype, wrong stride count, wrong output buffer.
    let bad = TensorView {
        dtype: F64,
        ..view.clone()
    };
    // SAFETY: rejected before any read.
    assert!(unsafe { exe.run(&[bad], std::slice::from_ref(&buf)) }.is_err());
    let bad = TensorView {
        strides: vec![1],
        ..view.clone()
    };
    // SAFETY: rejected before any read.
    assert!(unsafe { exe.run(&[bad], std::slice::from_ref(&buf)) }.is_err());
    let small = TensorOut {
        shape: vec![2, 2],
        ..buf
    };
    // SAFETY: rejected before any write.
    assert!(unsafe { exe.run(&[view], &[small]) }.is_err());
    assert!(ReferenceBackend.compile(&g, &Weights::new()).is_err());
}

/// Every unary and binary op on every dtype, on awkward values: an answer or an error,
/// never a panic.
#[test]
fn elementwise_ops_never_panic() {
    let floats = [
        0.0,
        -0.0,
        1.0,
        -1.0,
        0.5,
        -2.5,
        1e300,
        f64::NAN,
        f64::INFINITY,
        -f64::INFINITY,
    ];
    let ints = [0, 1, -1, 2, -7, 127, -128, 255, i64::MAX, i64::MIN];
    for dtype in DType::ALL {
        let x = if dtype.is_float() {
            fv(dtype, &[10], &floats)
        } else {
            iv(dtype, &[10], &ints)
        };
        // Every pair of elements.
        let n = x.numel();
        let pick = |f: &dyn Fn(usize) -> usize| Value {
            dtype,
            shape: vec![n * n],
            data: x.data.pick(&(0..n * n).map(f).collect::<Vec<_>>()),
        };
        let (a, b) = (pick(&|i| i / n), pick(&|i| i % n));
        for op in UnaryOp::ALL {
            if let Ok(v) = elementwise::unary(op, &a) {
                v.check().unwrap();
            }
        }
        for op in BinaryOp::ALL {
            if let Ok(v) = elementwise::binary(op, &a, &b) {
                v.check().unwrap();
            }
        }
        for to in DType::ALL {
            elementwise::cast(to, &a).check().unwrap();
        }
    }
}
