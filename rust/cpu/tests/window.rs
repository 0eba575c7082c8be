//! Convolution and pooling against the interpreter: odd sizes, strides, asymmetric padding,
//! dilation, groups (dense, grouped, depthwise), 1-, 2- and 3-d, ceil mode and divisors.

mod common;

use common::*;
use ember_core::backend::Weights;
use ember_core::dtype::DType;
use ember_core::ir::{Op, PoolKind};

struct ConvCase {
    x: Vec<usize>,
    w: Vec<usize>,
    stride: Vec<i64>,
    padding: Vec<(i64, i64)>,
    dilation: Vec<i64>,
    groups: i64,
    bias: bool,
}

fn conv_case(c: &ConvCase, dtype: DType, seed: u64) {
    let op = Op::Conv {
        stride: c.stride.clone(),
        padding: c.padding.clone(),
        dilation: c.dilation.clone(),
        groups: c.groups,
        has_bias: c.bias,
    };
    let o = c.w[0];
    let mut ins: Vec<(DType, &[usize])> = vec![(dtype, &c.x), (dtype, &c.w)];
    let bshape = [o];
    if c.bias {
        ins.push((dtype, &bshape));
    }
    let g = op_graph(op, &ins);
    let mut rng = Rng::new(seed);
    let mut vals = vec![
        random(&mut rng, dtype, &c.x, -1.0, 1.0),
        random(&mut rng, dtype, &c.w, -1.0, 1.0),
    ];
    if c.bias {
        vals.push(random(&mut rng, dtype, &bshape, -1.0, 1.0));
    }
    // Sums of up to a few hundred products: f32 rounding, not the op, sets the tolerance.
    let t = match dtype {
        DType::F32 => 1e-4,
        d => tol(d).max(1e-4) * 8.0,
    };
    check_with(
        &g,
        &Weights::new(),
        &vals,
        t,
        &format!("conv {dtype} {:?} {:?}", c.x, c.w),
    );
}

#[test]
fn conv_variants_match_the_interpreter() {
    let cases = [
        // 2-d dense, odd sizes, stride 2, asymmetric padding.
        ConvCase {
            x: vec![2, 3, 9, 7],
            w: vec![5, 3, 3, 3],
            stride: vec![2, 1],
            padding: vec![(1, 2), (0, 1)],
            dilation: vec![1, 1],
            groups: 1,
            bias: true,
        },
        // Dilation and groups.
        ConvCase {
            x: vec![1, 4, 11, 10],
            w: vec![6, 2, 3, 2],
            stride: vec![1, 2],
            padding: vec![(2, 2), (1, 1)],
            dilation: vec![2, 3],
            groups: 2,
            bias: false,
        },
        // Depthwise (one input channel per group), multiplier 2, stride 2.
        ConvCase {
            x: vec![2, 3, 8, 9],
            w: vec![6, 1, 3, 3],
            stride: vec![2, 2],
            padding: vec![(1, 1), (1, 1)],
            dilation: vec![1, 1],
            groups: 3,
            bias: true,
        },
        // Pointwise 1×1 (no im2col).
        ConvCase {
            x: vec![3, 5, 4, 6],
            w: vec![7, 5, 1, 1],
            stride: vec![1, 1],
            padding: vec![(0, 0), (0, 0)],
            dilation: vec![1, 1],
            groups: 1,
            bias: true,
        },
        // 1-d and 3-d.
        ConvCase {
            x: vec![2, 3, 13],
            w: vec![4, 3, 4],
            stride: vec![3],
            padding: vec![(2, 1)],
            dilation: vec![2],
            groups: 1,
            bias: true,
        },
        ConvCase {
            x: vec![1, 2, 5, 6, 4],
            w: vec![3, 2, 2, 3, 2],
            stride: vec![1, 2, 1],
            padding: vec![(1, 0), (1, 1), (0, 1)],
            dilation: vec![1, 1, 2],
            groups: 1,
            bias: false,
        },
        // Kernel larger than the unpadded input.
        ConvCase {
            x: vec![1, 1, 2, 2],
            w: vec![2, 1, 3, 3],
            stride: vec![1, 1],
            padding: vec![(1, 1), (1, 1)],
            dilation: vec![1, 1],
            groups: 1,
            bias: true,
        },
    ];
    for (i, c) in cases.iter().enumerate() {
        conv_case(c, DType::F32, 10 + i as u64);
    }
    conv_case(&cases[0], DType::F64, 1);
    conv_case(&cases[2], DType::BF16, 2);
}

#[test]
fn conv_rejects_mismatched_channels() {
    let op = Op::Conv {
        stride: vec![1, 1],
        padding: vec![(0, 0), (0, 0)],
        dilation: vec![1, 1],
        groups: 2,
        has_bias: false,
    };
    let mut g = ember_core::ir::Graph::new();
    let x = input(&mut g, 0, DType::F32, &[1, 3, 4, 4]);
    let w = input(&mut g, 1, DType::F32, &[4, 2, 3, 3]);
    let err = g.add(op, &[x, w], "conv1").unwrap_err().to_string();
    assert!(err.contains("groups=2") && err.contains("conv1"), "{err}");
}

#[test]
fn pooling_variants_match_the_interpreter() {
    let max = PoolKind::Max;
    let avg = |count_include_pad, divisor| PoolKind::Avg {
        count_include_pad,
        divisor,
    };
    #[allow(clippy::type_complexity)]
    let cases: Vec<(
        PoolKind,
        Vec<usize>,
        Vec<i64>,
        Vec<i64>,
        Vec<i64>,
        Vec<i64>,
        bool,
    )> = vec![
        (
            max,
            vec![2, 3, 9, 7],
            vec![3, 3],
            vec![2, 2],
            vec![1, 1],
            vec![1, 1],
            false,
        ),
        (
            max,
            vec![2, 3, 9, 7],
            vec![3, 2],
            vec![2, 2],
            vec![1, 1],
            vec![1, 1],
            true,
        ),
        (
            max,
            vec![1, 2, 10, 11],
            vec![3, 3],
            vec![2, 1],
            vec![2, 1],
            vec![2, 1],
            false,
        ),
        (max, vec![3, 13], vec![4], vec![3], vec![2], vec![1], true),
        (
            max,
            vec![1, 2, 5, 6, 7],
            vec![2, 2, 3],
            vec![2, 2, 2],
            vec![0, 1, 1],
            vec![1, 1, 1],
            false,
        ),
        (
            avg(true, None),
            vec![2, 3, 9, 7],
            vec![3, 3],
            vec![2, 2],
            vec![1, 1],
            vec![1, 1],
            true,
        ),
        (
            avg(false, None),
            vec![2, 3, 9, 7],
            vec![3, 3],
            vec![2, 2],
            vec![1, 1],
            vec![1, 1],
            true,
        ),
        (
            avg(true, Some(5)),
            vec![2, 3, 8, 8],
            vec![2, 3],
            vec![2, 2],
            vec![1, 0],
            vec![1, 1],
            false,
        ),
        (
            avg(false, None),
            vec![2, 4, 11],
            vec![3],
            vec![2],
            vec![1],
            vec![1],
            false,
        ),
    ];
    let mut rng = Rng::new(7);
    for (kind, shape, kernel, stride, padding, dilation, ceil_mode) in cases {
        let op = Op::Pool {
            kind,
            kernel,
            stride,
            padding,
            dilation,
            ceil_mode,
        };
        let what = format!("{op:?} on {shape:?}");
        let g = op_graph(op, &[(DType::F32, &shape)]);
        let x = random(&mut rng, DType::F32, &shape, -5.0, 5.0);
        check_with(&g, &Weights::new(), &[x], 1e-5, &what);
    }
}

/// A conv whose weight and bias are computed from weights only (a folded batch norm): the
/// CPU backend evaluates them at compile time; the result must not change.
#[test]
fn conv_with_weight_only_arithmetic_is_folded_exactly() {
    use ember_core::ir::{BinaryOp, Graph, UnaryOp};
    use ember_core::tensor::HostTensor;
    let mut rng = Rng::new(3);
    let mut weights = Weights::new();
    let mut g = Graph::new();
    let x = input(&mut g, 0, DType::F32, &[2, 3, 6, 5]);
    let mut weight = |g: &mut Graph, name: &str, shape: &[usize], lo: f64| {
        let v = random(&mut rng, DType::F32, shape, lo, 2.0);
        let t = HostTensor::owned(DType::F32, shape.to_vec(), v.to_bytes()).unwrap();
        weights.insert(name.to_string(), t);
        g.add_source(
            Op::Weight { name: name.into() },
            ty(DType::F32, shape),
            name,
        )
        .unwrap()
    };
    let w = weight(&mut g, "w", &[4, 3, 3, 3], -2.0);
    let var = weight(&mut g, "var", &[4, 1, 1, 1], 0.5);
    let b = weight(&mut g, "b", &[4], -2.0);
    let s = g.add(Op::Unary(UnaryOp::Rsqrt), &[var], "s").unwrap();
    let s = g
        .add(
            Op::Expand {
                shape: [4, 3, 3, 3].iter().map(|&d| (d as i64).into()).collect(),
            },
            &[s],
            "s_wide",
        )
        .unwrap();
    let ws = g
        .add(Op::Binary(BinaryOp::Mul), &[w, s], "w_scaled")
        .unwrap();
    let conv = Op::Conv {
        stride: vec![1, 1],
        padding: vec![(1, 1), (1, 1)],
        dilation: vec![1, 1],
        groups: 1,
        has_bias: true,
    };
    let y = g.add(conv, &[x, ws, b], "conv").unwrap();
    g.outputs.push(y);
    let xv = random(&mut rng, DType::F32, &[2, 3, 6, 5], -1.0, 1.0);
    check_with(&g, &weights, &[xv], 1e-4, "folded conv");
}

/// conv → residual add → relu runs as one fused group with the conv as its head (computed
/// into the group's output); a conv that is also a graph output stays a value of its own.
#[test]
fn conv_heads_a_fused_epilogue() {
    use ember_core::ir::{BinaryOp, Graph, UnaryOp};
    let mut g = Graph::new();
    let x = input(&mut g, 0, DType::F32, &[2, 4, 7, 6]);
    let w = input(&mut g, 1, DType::F32, &[4, 4, 3, 3]);
    let b = input(&mut g, 2, DType::F32, &[4]);
    let conv = Op::Conv {
        stride: vec![1, 1],
        padding: vec![(1, 1), (1, 1)],
        dilation: vec![1, 1],
        groups: 1,
        has_bias: true,
    };
    let c = g.add(conv.clone(), &[x, w, b], "conv").unwrap();
    let s = g
        .add(Op::Binary(BinaryOp::Add), &[c, x], "residual")
        .unwrap();
    let y = g.add(Op::Unary(UnaryOp::Relu), &[s], "relu").unwrap();
    let c2 = g.add(conv, &[y, w, b], "conv2").unwrap();
    let y2 = g.add(Op::Unary(UnaryOp::Relu), &[c2], "relu2").unwrap();
    g.outputs.extend([y, y2, c2]);
    let mut rng = Rng::new(5);
    let vals = vec![
        random(&mut rng, DType::F32, &[2, 4, 7, 6], -1.0, 1.0),
        random(&mut rng, DType::F32, &[4, 4, 3, 3], -1.0, 1.0),
        random(&mut rng, DType::F32, &[4], -1.0, 1.0),
    ];
    check_with(&g, &Weights::new(), &vals, 1e-4, "conv epilogue");
}
