//! Fused elementwise groups and GEMM epilogues: every graph runs fused and unfused; the two
//! must agree bit for bit, and both must match the interpreter.

mod common;

use common::*;
use ember_core::backend::{Backend, Weights};
use ember_core::dim::Dim;
use ember_core::dtype::{DType, Scalar};
use ember_core::interp::{self, Value};
use ember_core::ir::{BinaryOp, Graph, Op, ReduceOp, UnaryOp, ValueId};
use ember_core::tensor::{TensorOut, TensorView};
use ember_cpu::CpuBackend;

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

fn dims(shape: &[usize]) -> Vec<Dim> {
    shape.iter().map(|&d| Dim::from(d)).collect()
}

fn un(g: &mut Graph, op: UnaryOp, x: ValueId) -> ValueId {
    g.add(Op::Unary(op), &[x], "u").unwrap()
}

fn bin(g: &mut Graph, op: BinaryOp, a: ValueId, b: ValueId) -> ValueId {
    g.add(Op::Binary(op), &[a, b], "b").unwrap()
}

fn full(g: &mut Graph, dtype: DType, shape: &[usize], v: f64) -> ValueId {
    g.add_source(
        Op::Full {
            value: Scalar::Float(v),
        },
        ty(dtype, shape),
        "full",
    )
    .unwrap()
}

/// `v` of shape [n] seen as `shape` (reshape to [1, .., n], then expand).
fn broadcast_row(g: &mut Graph, v: ValueId, shape: &[usize]) -> ValueId {
    let mut ones = vec![1; shape.len()];
    *ones.last_mut().unwrap() = *shape.last().unwrap();
    let r = g
        .add(Op::Reshape { shape: dims(&ones) }, &[v], "reshape")
        .unwrap();
    g.add(Op::Expand { shape: dims(shape) }, &[r], "expand")
        .unwrap()
}

/// Runs fused and unfused (bit-identical) and against the interpreter (within `tol`).
fn check_fused(
    g: &Graph,
    w: &Weights,
    inputs: &[Value],
    strided: &[Strided],
    tol: f64,
    what: &str,
) {
    let want = interp::run(g, w, inputs).unwrap_or_else(|e| panic!("{what}: interpreter: {e}"));
    let fused = run_cpu_strided(&CpuBackend::new(2).with_fusion(true), g, w, strided)
        .unwrap_or_else(|e| panic!("{what}: fused: {e}"));
    let plain = run_cpu_strided(&CpuBackend::new(2).with_fusion(false), g, w, strided)
        .unwrap_or_else(|e| panic!("{what}: unfused: {e}"));
    for (k, ((f, p), w)) in fused.iter().zip(&plain).zip(&want).enumerate() {
        assert_eq!(f.shape, p.shape, "{what} output {k}: shape");
        assert_eq!(
            f.to_bytes(),
            p.to_bytes(),
            "{what} output {k}: fused differs from unfused"
        );
        assert_close(f, w, tol, &format!("{what} output {k}"));
    }
}

fn contiguous(vs: &[Value]) -> Vec<Strided> {
    vs.iter().map(Strided::contiguous).collect()
}

/// tanh(x·½ + b) squared, minus x, relu, + ½, sqrt — with b a broadcast row.
fn chain(dtype: DType, shape: &[usize]) -> Graph {
    let mut g = Graph::new();
    let x = input(&mut g, 0, dtype, shape);
    let b = input(&mut g, 1, dtype, &[*shape.last().unwrap()]);
    let be = broadcast_row(&mut g, b, shape);
    let half = full(&mut g, dtype, shape, 0.5);
    let mut y = bin(&mut g, BinaryOp::Mul, x, half);
    y = bin(&mut g, BinaryOp::Add, y, be);
    y = un(&mut g, UnaryOp::Tanh, y);
    y = bin(&mut g, BinaryOp::Mul, y, y);
    y = bin(&mut g, BinaryOp::Sub, y, x);
    y = un(&mut g, UnaryOp::Relu, y);
    y = bin(&mut g, BinaryOp::Add, y, half);
    y = un(&mut g, UnaryOp::Sqrt, y);
    g.outputs.push(y);
    g
}

#[test]
fn chain_with_broadcasting_every_float_and_size() {
    let mut rng = Rng::new(7);
    for dtype in FLOATS {
        for shape in [&[7, 13][..], &[1, 1], &[3, 1], &[300, 301], &[2, 3, 5]] {
            let g = chain(dtype, shape);
            let x = random(&mut rng, dtype, shape, -2.0, 2.0);
            let b = random(&mut rng, dtype, &[*shape.last().unwrap()], -1.0, 1.0);
            let what = format!("chain {dtype}{shape:?}");
            let ins = [x.clone(), b.clone()];
            check_fused(
                &g,
                &Weights::new(),
                &ins,
                &contiguous(&ins),
                tol(dtype),
                &what,
            );
            // x stored transposed: a non-contiguous leaf.
            let strided = [Strided::transposed(&x), Strided::contiguous(&b)];
            check_fused(&g, &Weights::new(), &ins, &strided, tol(dtype), &what);
        }
    }
}

#[test]
fn zero_sized_and_zero_dim_chains() {
    let mut rng = Rng::new(8);
    for shape in [&[0][..], &[3, 0, 5], &[]] {
        let mut g = Graph::new();
        let x = input(&mut g, 0, DType::F32, shape);
        let y = input(&mut g, 1, DType::F32, shape);
        let mut z = bin(&mut g, BinaryOp::Mul, x, y);
        z = un(&mut g, UnaryOp::Exp, z);
        z = bin(&mut g, BinaryOp::Sub, z, x);
        g.outputs.push(z);
        let ins = [
            random(&mut rng, DType::F32, shape, -1.0, 1.0),
            random(&mut rng, DType::F32, shape, -1.0, 1.0),
        ];
        check_fused(
            &g,
            &Weights::new(),
            &ins,
            &contiguous(&ins),
            2e-6,
            &format!("{shape:?}"),
        );
    }
}

#[test]
fn casts_between_floats_ints_and_bool() {
    let mut rng = Rng::new(9);
    let shape = [7, 13];
    let mut g = Graph::new();
    let x = input(&mut g, 0, DType::F16, &shape);
    let y = input(&mut g, 1, DType::BF16, &shape);
    let xf = g.add(Op::Cast { to: DType::F32 }, &[x], "c").unwrap();
    let yf = g.add(Op::Cast { to: DType::F32 }, &[y], "c").unwrap();
    let p = bin(&mut g, BinaryOp::Mul, xf, yf);
    let pb = g.add(Op::Cast { to: DType::BF16 }, &[p], "c").unwrap();
    let q = bin(&mut g, BinaryOp::Add, pb, y);
    let qh = g.add(Op::Cast { to: DType::F16 }, &[q], "c").unwrap();
    let r = un(&mut g, UnaryOp::Silu, qh);
    // float → int → bool and back, and a same-dtype cast.
    let ri = g.add(Op::Cast { to: DType::I32 }, &[r], "c").unwrap();
    let two = g
        .add_source(
            Op::Full {
                value: Scalar::Int(2),
            },
            ty(DType::I32, &shape),
            "two",
        )
        .unwrap();
    let rm = bin(&mut g, BinaryOp::Mul, ri, two);
    let rb = g.add(Op::Cast { to: DType::Bool }, &[rm], "c").unwrap();
    let back = g.add(Op::Cast { to: DType::F16 }, &[rb], "c").unwrap();
    let same = g.add(Op::Cast { to: DType::F16 }, &[back], "c").unwrap();
    let out = bin(&mut g, BinaryOp::Add, same, r);
    g.outputs.push(out);
    let ins = [
        random(&mut rng, DType::F16, &shape, -4.0, 4.0),
        random(&mut rng, DType::BF16, &shape, -4.0, 4.0),
    ];
    let strided = [Strided::transposed(&ins[0]), Strided::transposed(&ins[1])];
    check_fused(&g, &Weights::new(), &ins, &contiguous(&ins), 2e-2, "casts");
    check_fused(&g, &Weights::new(), &ins, &strided, 2e-2, "casts, strided");
}

#[test]
fn where_and_comparisons_in_a_chain() {
    let mut rng = Rng::new(10);
    for dtype in [DType::F32, DType::BF16, DType::I32] {
        let shape = [13, 7];
        let mut g = Graph::new();
        let x = input(&mut g, 0, dtype, &shape);
        let y = input(&mut g, 1, dtype, &shape);
        let c = bin(&mut g, BinaryOp::Gt, x, y);
        let nc = un(&mut g, UnaryOp::Not, c);
        let a = bin(&mut g, BinaryOp::Mul, x, x);
        let b = un(&mut g, UnaryOp::Neg, y);
        let w = g.add(Op::Where, &[nc, a, b], "where").unwrap();
        let out = bin(&mut g, BinaryOp::Sub, w, x);
        g.outputs.push(out);
        let ins = [
            random(&mut rng, dtype, &shape, -50.0, 50.0),
            random(&mut rng, dtype, &shape, -50.0, 50.0),
        ];
        let strided = [Strided::transposed(&ins[0]), Strided::contiguous(&ins[1])];
        check_fused(
            &g,
            &Weights::new(),
            &ins,
            &strided,
            tol(dtype),
            &format!("where {dtype}"),
        );
    }
}

#[test]
fn integer_chain_wraps() {
    let mut rng = Rng::new(11);
    let shape = [300, 200];
    let mut g = Graph::new();
    let x = input(&mut g, 0, DType::I8, &shape);
    let y = input(&mut g, 1, DType::I8, &shape);
    let mut z = bin(&mut g, BinaryOp::Mul, x, y);
    z = bin(&mut g, BinaryOp::Add, z, x);
    z = bin(&mut g, BinaryOp::FloorDiv, z, y);
    z = un(&mut g, UnaryOp::Abs, z);
    g.outputs.push(z);
    let ins = [
        random(&mut rng, DType::I8, &shape, -128.0, 127.0),
        random(&mut rng, DType::I8, &shape, -128.0, 127.0),
    ];
    check_fused(
        &g,
        &Weights::new(),
        &ins,
        &contiguous(&ins),
        0.0,
        "i8 chain",
    );
}

#[test]
fn intermediates_with_consumers_outside_the_group() {
    let mut rng = Rng::new(12);
    let shape = [7, 13];
    let mut g = Graph::new();
    let x = input(&mut g, 0, DType::F32, &shape);
    let e = un(&mut g, UnaryOp::Exp, x);
    // e feeds an elementwise chain (fusible), a reduction and a softmax (not fusible).
    let one = full(&mut g, DType::F32, &shape, 1.0);
    let a = bin(&mut g, BinaryOp::Add, e, one);
    let a2 = un(&mut g, UnaryOp::Log, a);
    let s = g
        .add(
            Op::Reduce {
                op: ReduceOp::Sum,
                axes: vec![1],
                keepdim: true,
            },
            &[e],
            "sum",
        )
        .unwrap();
    let sm = g
        .add(
            Op::Softmax {
                axis: 1,
                log: false,
            },
            &[e],
            "softmax",
        )
        .unwrap();
    // A value read twice inside one group (silu by hand) is still fused.
    let sg = un(&mut g, UnaryOp::Sigmoid, a2);
    let silu = bin(&mut g, BinaryOp::Mul, a2, sg);
    let t = bin(&mut g, BinaryOp::Mul, silu, sm);
    g.outputs.extend([t, s]);
    let ins = [random(&mut rng, DType::F32, &shape, -3.0, 3.0)];
    check_fused(
        &g,
        &Weights::new(),
        &ins,
        &contiguous(&ins),
        1e-5,
        "shared intermediate",
    );
}

#[test]
fn outputs_read_by_other_nodes_and_repeated_outputs() {
    let mut rng = Rng::new(13);
    let shape = [300, 130];
    let mut g = Graph::new();
    let x = input(&mut g, 0, DType::F32, &shape);
    let two = full(&mut g, DType::F32, &shape, 2.0);
    let y = bin(&mut g, BinaryOp::Mul, x, two);
    let y2 = un(&mut g, UnaryOp::Tanh, y);
    let z = bin(&mut g, BinaryOp::Add, y2, x);
    let zz = bin(&mut g, BinaryOp::Mul, z, y2);
    let p = g.add(Op::Permute { perm: vec![1, 0] }, &[y2], "t").unwrap();
    // y2 is an output and is read by z, zz and a view that is an output too; x is an output.
    g.outputs.extend([y2, zz, y2, p, x, z]);
    let ins = [random(&mut rng, DType::F32, &shape, -3.0, 3.0)];
    check_fused(
        &g,
        &Weights::new(),
        &ins,
        &contiguous(&ins),
        2e-6,
        "outputs as inputs",
    );
    check_fused(
        &g,
        &Weights::new(),
        &ins,
        &[Strided::transposed(&ins[0])],
        2e-6,
        "strided",
    );
}

/// x·wᵀ + bias, then an optional activation (the graph `linear` builds), with x of rank 3
/// folded to 2-D around the dot as the frontend does.
fn linear(dtype: DType, batch: &[usize], k: usize, n: usize, act: Option<UnaryOp>) -> Graph {
    let mut g = Graph::new();
    let mut xs = batch.to_vec();
    xs.push(k);
    let x = input(&mut g, 0, dtype, &xs);
    let w = input(&mut g, 1, dtype, &[n, k]);
    let bias = input(&mut g, 2, dtype, &[n]);
    let m: usize = batch.iter().product();
    let x2 = if batch.len() == 1 {
        x
    } else {
        g.add(
            Op::Reshape {
                shape: dims(&[m, k]),
            },
            &[x],
            "fold",
        )
        .unwrap()
    };
    let wt = g.add(Op::Permute { perm: vec![1, 0] }, &[w], "wt").unwrap();
    let mut y = g.add(Op::Dot, &[x2, wt], "dot").unwrap();
    let mut ys = batch.to_vec();
    ys.push(n);
    if batch.len() != 1 {
        y = g
            .add(Op::Reshape { shape: dims(&ys) }, &[y], "unfold")
            .unwrap();
    }
    let be = broadcast_row(&mut g, bias, &ys);
    y = bin(&mut g, BinaryOp::Add, y, be);
    if let Some(a) = act {
        y = un(&mut g, a, y);
    }
    g.outputs.push(y);
    g
}

#[test]
fn linear_bias_activation_epilogue() {
    let mut rng = Rng::new(14);
    let acts = [
        None,
        Some(UnaryOp::Relu),
        Some(UnaryOp::Gelu),
        Some(UnaryOp::GeluTanh),
        Some(UnaryOp::Silu),
    ];
    for dtype in FLOATS {
        for act in acts {
            for (batch, k, n) in [
                (&[7][..], 13, 5),
                (&[2, 3][..], 16, 9),
                (&[65][..], 64, 130),
                (&[1][..], 1, 1),
            ] {
                let g = linear(dtype, batch, k, n, act);
                let mut xs = batch.to_vec();
                xs.push(k);
                let ins = [
                    random(&mut rng, dtype, &xs, -1.0, 1.0),
                    random(&mut rng, dtype, &[n, k], -1.0, 1.0),
                    random(&mut rng, dtype, &[n], -1.0, 1.0),
                ];
                let what = format!("linear {dtype} {batch:?}x{k}x{n} {act:?}");
                let t = match dtype {
                    DType::F32 => 1e-5,
                    DType::F16 => 4e-3,
                    d => tol(d),
                };
                check_fused(&g, &Weights::new(), &ins, &contiguous(&ins), t, &what);
            }
        }
    }
}

#[test]
fn linear_with_zero_sized_dims_and_dot_as_output() {
    let mut rng = Rng::new(15);
    for (m, k, n) in [(0, 4, 3), (3, 0, 4), (3, 4, 0)] {
        let g = linear(DType::F32, &[m], k, n, Some(UnaryOp::Relu));
        let ins = [
            random(&mut rng, DType::F32, &[m, k], -1.0, 1.0),
            random(&mut rng, DType::F32, &[n, k], -1.0, 1.0),
            random(&mut rng, DType::F32, &[n], -1.0, 1.0),
        ];
        check_fused(
            &g,
            &Weights::new(),
            &ins,
            &contiguous(&ins),
            1e-5,
            &format!("{m}x{k}x{n}"),
        );
    }
    // The product is also an output: no epilogue, but both results must be right.
    let mut g = Graph::new();
    let x = input(&mut g, 0, DType::F32, &[5, 6]);
    let w = input(&mut g, 1, DType::F32, &[6, 4]);
    let d = g.add(Op::Dot, &[x, w], "dot").unwrap();
    let r = un(&mut g, UnaryOp::Relu, d);
    g.outputs.extend([r, d]);
    let ins = [
        random(&mut rng, DType::F32, &[5, 6], -1.0, 1.0),
        random(&mut rng, DType::F32, &[6, 4], -1.0, 1.0),
    ];
    check_fused(
        &g,
        &Weights::new(),
        &ins,
        &contiguous(&ins),
        1e-5,
        "dot as output",
    );
}

#[test]
fn errors_inside_a_fused_group_are_reported() {
    let mut g = Graph::new();
    let x = input(&mut g, 0, DType::F32, &[4]);
    let e = un(&mut g, UnaryOp::Exp, x);
    let b = un(&mut g, UnaryOp::BitNot, e);
    g.outputs.push(b);
    let x = Value::from_f64(DType::F32, vec![4], vec![1.0; 4]);
    let err = run_cpu(&g, &Weights::new(), &[x]).unwrap_err();
    assert!(err.to_string().contains("bitnot"), "{err}");
}

#[test]
fn concurrent_calls_share_no_buffers() {
    let shape = [256, 300];
    let g = chain(DType::F32, &shape);
    let backend = CpuBackend::new(2);
    let exe = backend.compile(&g, &Weights::new()).unwrap();
    let mut rng = Rng::new(16);
    let cases: Vec<[Value; 2]> = (0..4)
        .map(|_| {
            [
                random(&mut rng, DType::F32, &shape, -2.0, 2.0),
                random(&mut rng, DType::F32, &[300], -1.0, 1.0),
            ]
        })
        .collect();
    std::thread::scope(|s| {
        for ins in &cases {
            let exe = &exe;
            let g = &g;
            s.spawn(move || {
                let want = interp::run(g, &Weights::new(), ins).unwrap();
                let strided = contiguous(ins);
                for _ in 0..5 {
                    let mut out = vec![0u64; 256 * 300 / 2];
                    let views: Vec<TensorView> = strided.iter().map(|s| s.view()).collect();
                    let outs = [TensorOut {
                        ptr: out.as_mut_ptr() as *mut u8,
                        dtype: DType::F32,
                        shape: shape.to_vec(),
                    }];
                    // SAFETY: live buffers of the right sizes.
                    unsafe { exe.run(&views, &outs).unwrap() };
                    // SAFETY: `out` holds 256·300 f32.
                    let bytes = unsafe {
                        std::slice::from_raw_parts(out.as_ptr() as *const u8, 256 * 300 * 4)
                    };
                    let got = Value::from_bytes(DType::F32, shape.to_vec(), bytes).unwrap();
                    assert_close(&got, &want[0], 2e-6, "concurrent");
                }
            });
        }
    });
}

/// Runs fused and unfused and demands the same bits (no interpreter: NaN and overflow are
/// the point of these inputs), NaNs aside: any NaN equals any other, since LLVM keeps
/// neither a NaN's payload nor its sign (it may commute `p + q` when both are NaN).
fn check_same_bits(g: &Graph, inputs: &[Value], what: &str) {
    let strided = contiguous(inputs);
    let w = Weights::new();
    let fused = run_cpu_strided(&CpuBackend::new(2).with_fusion(true), g, &w, &strided)
        .unwrap_or_else(|e| panic!("{what}: fused: {e}"));
    let plain = run_cpu_strided(&CpuBackend::new(2).with_fusion(false), g, &w, &strided)
        .unwrap_or_else(|e| panic!("{what}: unfused: {e}"));
    for (k, (f, p)) in fused.iter().zip(&plain).enumerate() {
        let (fb, pb) = (f.to_bytes(), p.to_bytes());
        let size = f.dtype.size();
        let nan =
            |b: &[u8]| f.dtype == DType::F32 && f32::from_le_bytes(b.try_into().unwrap()).is_nan();
        let differs = |i: usize| {
            let (a, b) = (&fb[i * size..][..size], &pb[i * size..][..size]);
            a != b && !(nan(a) && nan(b))
        };
        if let Some(i) = (0..fb.len() / size).find(|&i| differs(i)) {
            panic!(
                "{what} output {k}: element {i} fused {:?} unfused {:?}",
                &fb[i * size..][..size],
                &pb[i * size..][..size]
            );
        }
    }
}

/// f32 values where the vector chains (`kernels::chain`) could part from the step closures:
/// NaN, infinities, signed zeros, halfway cases, values past int32 and int8, subnormals.
fn awkward_floats(rng: &mut Rng, n: usize) -> Vec<f64> {
    let special = [
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        0.0,
        -0.0,
        0.5,
        -0.5,
        1.5,
        2.5,
        -2.5,
        127.5,
        -128.5,
        255.5,
        300.2,
        -129.7,
        3e9,
        -3e9,
        2147483520.0,
        2147483648.0,
        -2147483648.0,
        1e-40,
        -1e-40,
        1e30,
        -1e30,
    ];
    (0..n)
        .map(|i| match i % 3 {
            0 => special[(i / 3) % special.len()],
            _ => rng.range(-300.0, 300.0),
        })
        .collect()
}

/// Every op the register chains have, in chains of each kind: f32 arithmetic with the
/// chain's value as either operand (row, scalar and full operands), the unary ops, int32
/// arithmetic, and casts between f32, int32, int8 and uint8 in every direction; lengths
/// that leave partial vectors. Fused (chains where the CPU has AVX-512) and unfused must
/// agree bit for bit.
#[test]
fn register_chains_match_their_steps_bit_for_bit() {
    let mut rng = Rng::new(31);
    for shape in [[3usize, 7], [33, 67], [8, 512]] {
        let mut g = Graph::new();
        let x = input(&mut g, 0, DType::F32, &shape);
        let y = input(&mut g, 1, DType::F32, &shape);
        let row = input(&mut g, 2, DType::F32, &[shape[1]]);
        let xi = input(&mut g, 3, DType::I32, &shape);
        let xb = input(&mut g, 4, DType::I8, &shape);
        let r = broadcast_row(&mut g, row, &shape);
        let s = full(&mut g, DType::F32, &shape, 1.37);
        // f32 binary ops, the value first and second.
        let mut v = bin(&mut g, BinaryOp::Add, x, y);
        for (op, value_first, other) in [
            (BinaryOp::Sub, false, y),
            (BinaryOp::Mul, true, s),
            (BinaryOp::Div, false, y),
            (BinaryOp::Div, true, r),
            (BinaryOp::Max, true, y),
            (BinaryOp::Max, false, r),
            (BinaryOp::Min, true, r),
            (BinaryOp::Min, false, y),
            (BinaryOp::Sub, true, s),
        ] {
            v = match value_first {
                true => bin(&mut g, op, v, other),
                false => bin(&mut g, op, other, v),
            };
        }
        g.outputs.push(v);
        // Unary ops, scaled between the roundings so that each one matters.
        let mut u = x;
        for op in [
            UnaryOp::Round,
            UnaryOp::Floor,
            UnaryOp::Ceil,
            UnaryOp::Trunc,
            UnaryOp::Neg,
            UnaryOp::Relu,
            UnaryOp::Abs,
            UnaryOp::Sqrt,
            UnaryOp::Recip,
            UnaryOp::Rsqrt,
            UnaryOp::Gelu,
            UnaryOp::Tanh,
            UnaryOp::Silu,
            UnaryOp::GeluTanh,
            UnaryOp::Sigmoid,
            UnaryOp::Exp,
        ] {
            u = bin(&mut g, BinaryOp::Mul, u, s);
            u = un(&mut g, op, u);
        }
        // The transcendentals on the awkward values themselves.
        for op in [UnaryOp::Exp, UnaryOp::Gelu, UnaryOp::Silu, UnaryOp::Tanh] {
            let t = un(&mut g, op, y);
            let sum = bin(&mut g, BinaryOp::Add, t, x);
            g.outputs.push(sum);
        }
        g.outputs.push(u);
        // Casts and int32 arithmetic: quantize-like chains through every integer lane kind.
        let cast =
            |g: &mut Graph, v: ValueId, to: DType| g.add(Op::Cast { to }, &[v], "c").unwrap();
        let mut c = cast(&mut g, x, DType::I32);
        c = bin(&mut g, BinaryOp::Add, c, xi);
        c = bin(&mut g, BinaryOp::Sub, xi, c);
        c = bin(&mut g, BinaryOp::Mul, c, xi);
        c = bin(&mut g, BinaryOp::Max, c, xi);
        c = bin(&mut g, BinaryOp::Min, xi, c);
        c = bin(&mut g, BinaryOp::Sub, c, xi);
        for to in [
            DType::I8,
            DType::F32,
            DType::U8,
            DType::I32,
            DType::U8,
            DType::I8,
            DType::I32,
            DType::F32,
            DType::I8,
            DType::U8,
            DType::F32,
        ] {
            c = cast(&mut g, c, to);
        }
        g.outputs.push(c);
        let q = cast(&mut g, y, DType::U8);
        let q = cast(&mut g, q, DType::F32);
        let q = bin(&mut g, BinaryOp::Add, q, x);
        let q = cast(&mut g, q, DType::I8);
        g.outputs.push(q);
        let b = cast(&mut g, xb, DType::F32);
        let b = bin(&mut g, BinaryOp::Mul, b, s);
        let b = cast(&mut g, b, DType::U8);
        g.outputs.push(b);
        let n: usize = shape.iter().product();
        let ints: Vec<i64> = (0..n)
            .map(|i| match i % 5 {
                0 => i64::from(i32::MAX),
                1 => i64::from(i32::MIN),
                _ => rng.int(-100_000, 100_000),
            })
            .collect();
        let ins = [
            Value::from_f64(DType::F32, shape.to_vec(), awkward_floats(&mut rng, n)),
            Value::from_f64(DType::F32, shape.to_vec(), awkward_floats(&mut rng, n)),
            Value::from_f64(
                DType::F32,
                vec![shape[1]],
                awkward_floats(&mut rng, shape[1]),
            ),
            Value::from_i64(DType::I32, shape.to_vec(), ints),
            random(&mut rng, DType::I8, &shape, -128.0, 127.0),
        ];
        check_same_bits(&g, &ins, &format!("chains {shape:?}"));
    }
}

/// ns per element of fused groups on one thread ([64, 512] f32, best of 200 runs): four
/// cheap steps with a broadcast row, and the benchmark chain's GELU and sigmoid·tanh groups.
/// `cargo test --release -p ember-cpu --test fusion fused_group_speed -- --ignored --nocapture`.
#[test]
#[ignore]
fn fused_group_speed() {
    let shape = [64, 512];
    let n: usize = shape.iter().product();
    let build = |body: &dyn Fn(&mut Graph, ValueId, ValueId) -> ValueId| {
        let mut g = Graph::new();
        let x = input(&mut g, 0, DType::F32, &shape);
        let b = input(&mut g, 1, DType::F32, &[512]);
        let be = broadcast_row(&mut g, b, &shape);
        let y = body(&mut g, x, be);
        g.outputs.push(y);
        g
    };
    let graphs: [(&str, Graph); 3] = [
        (
            "cheap: (x·½ + b)·x - x",
            build(&|g, x, b| {
                let half = full(g, DType::F32, &shape, 0.5);
                let y = bin(g, BinaryOp::Mul, x, half);
                let y = bin(g, BinaryOp::Add, y, b);
                let y = bin(g, BinaryOp::Mul, y, x);
                bin(g, BinaryOp::Sub, y, x)
            }),
        ),
        (
            "gelu(x·b + b) + x",
            build(&|g, x, b| {
                let y = bin(g, BinaryOp::Mul, x, b);
                let y = bin(g, BinaryOp::Add, y, b);
                let y = un(g, UnaryOp::Gelu, y);
                bin(g, BinaryOp::Add, y, x)
            }),
        ),
        (
            "sigmoid(x)·tanh(b) + x",
            build(&|g, x, b| {
                let s = un(g, UnaryOp::Sigmoid, x);
                let t = un(g, UnaryOp::Tanh, b);
                let y = bin(g, BinaryOp::Mul, s, t);
                bin(g, BinaryOp::Add, y, x)
            }),
        ),
    ];
    let mut rng = Rng::new(7);
    let x = Strided::contiguous(&random(&mut rng, DType::F32, &shape, -3.0, 3.0));
    let b = Strided::contiguous(&random(&mut rng, DType::F32, &[512], -3.0, 3.0));
    let mut out = vec![0u64; n / 2];
    let only = std::env::var("FUSED_ONLY").unwrap_or_default();
    for (name, g) in graphs.iter().filter(|(name, _)| name.contains(&only)) {
        let exe = CpuBackend::new(1)
            .with_fusion(true)
            .compile(g, &Weights::new())
            .unwrap();
        let views = [x.view(), b.view()];
        let outs = [TensorOut {
            ptr: out.as_mut_ptr() as *mut u8,
            dtype: DType::F32,
            shape: shape.to_vec(),
        }];
        let best = (0..std::env::var("FUSED_RUNS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(200))
            .map(|_| {
                let t = std::time::Instant::now();
                // SAFETY: the views and the output address live buffers of their shapes.
                unsafe { exe.run(&views, &outs).unwrap() };
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min);
        eprintln!("{name}: {:.3} ns/element", best * 1e9 / n as f64);
    }
}
