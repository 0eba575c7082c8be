//! Per-op cost of the CPU runtime on a [64, 512] f32 input (the norm chain's shape), without
//! Python: `x * 2`, GELU, softmax, layer norm (with weight and bias), RMS norm, a sum and a max
//! over each row, each on 1 and 2
//! threads, medians of many calls in µs.
//! `cargo run -p ember-cpu --release --example op_bench [ROWS COLS]`

use std::time::Instant;

use ember_core::backend::{Backend, Executable, Weights};
use ember_core::dim::Dim;
use ember_core::dtype::{DType, Scalar};
use ember_core::ir::{BinaryOp, Graph, Op, ReduceOp, TensorType, UnaryOp};
use ember_core::tensor::{contiguous_strides, TensorOut, TensorView};
use ember_cpu::CpuBackend;

fn ty(shape: &[usize]) -> TensorType {
    TensorType::new(DType::F32, shape.iter().map(|&d| Dim::from(d)).collect())
}

/// `op` applied to input 0 (shape `s`); weight-like inputs 1.. of shape [cols].
fn graph(s: &[usize], op: &str) -> (Graph, Vec<Vec<usize>>) {
    let mut g = Graph::new();
    let x = g.add_source(Op::Input { index: 0 }, ty(s), "x").unwrap();
    let cols = *s.last().unwrap();
    let mut shapes = vec![s.to_vec()];
    let axis = s.len() - 1;
    let y = match op {
        "mul2" => {
            let two = g
                .add_source(
                    Op::Full {
                        value: Scalar::Float(2.0),
                    },
                    ty(s),
                    "two",
                )
                .unwrap();
            g.add(Op::Binary(BinaryOp::Mul), &[x, two], "mul").unwrap()
        }
        "gelu" => g.add(Op::Unary(UnaryOp::Gelu), &[x], "gelu").unwrap(),
        "softmax" => g.add(Op::Softmax { axis, log: false }, &[x], "sm").unwrap(),
        // A sum or max over each row (`512 64`: a global average pool's sum over the 8×8
        // planes of [4, 128, 8, 8]).
        "rowsum" | "rowmax" => {
            let reduce = Op::Reduce {
                op: if op == "rowsum" {
                    ReduceOp::Sum
                } else {
                    ReduceOp::Max
                },
                axes: vec![axis],
                keepdim: true,
            };
            g.add(reduce, &[x], op).unwrap()
        }
        "layernorm" => {
            let w = g
                .add_source(Op::Input { index: 1 }, ty(&[cols]), "w")
                .unwrap();
            let b = g
                .add_source(Op::Input { index: 2 }, ty(&[cols]), "b")
                .unwrap();
            shapes.push(vec![cols]);
            shapes.push(vec![cols]);
            let op = Op::LayerNorm {
                axis,
                eps: 1e-5,
                has_weight: true,
                has_bias: true,
            };
            g.add(op, &[x, w, b], "ln").unwrap()
        }
        "rmsnorm" => {
            let op = Op::RmsNorm {
                axis,
                eps: 1e-6,
                has_weight: false,
            };
            g.add(op, &[x], "rms").unwrap()
        }
        _ => panic!("unknown op {op}"),
    };
    g.outputs.push(y);
    (g, shapes)
}

fn time(exe: &dyn Executable, shapes: &[Vec<usize>], out_shape: &[usize]) -> f64 {
    let bufs: Vec<Vec<f32>> = shapes
        .iter()
        .map(|s| {
            (0..s.iter().product::<usize>())
                .map(|i| ((i % 97) as f32) * 0.05 - 2.3)
                .collect()
        })
        .collect();
    let views: Vec<TensorView> = bufs
        .iter()
        .zip(shapes)
        .map(|(b, s)| TensorView {
            ptr: b.as_ptr() as *const u8,
            dtype: DType::F32,
            shape: s.clone(),
            strides: contiguous_strides(s),
        })
        .collect();
    let mut out = vec![0f32; out_shape.iter().product()];
    let outs = [TensorOut {
        ptr: out.as_mut_ptr() as *mut u8,
        dtype: DType::F32,
        shape: out_shape.to_vec(),
    }];
    let mut times = Vec::new();
    for i in 0..3000 {
        let t = Instant::now();
        // SAFETY: the views and the output point at live buffers of the right sizes.
        unsafe { exe.run(&views, &outs).unwrap() };
        if i >= 500 {
            times.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    times[times.len() / 2]
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().unwrap())
        .collect();
    let s = match args.as_slice() {
        [r, c] => vec![*r, *c],
        _ => vec![64, 512],
    };
    let backends = [CpuBackend::new(1), CpuBackend::new(2)];
    println!("{s:?} f32, median µs per call: 1 thread / 2 threads");
    for op in [
        "mul2",
        "gelu",
        "softmax",
        "layernorm",
        "rmsnorm",
        "rowsum",
        "rowmax",
    ] {
        let (g, shapes) = graph(&s, op);
        let t: Vec<f64> = backends
            .iter()
            .map(|b| {
                let exe = b.compile(&g, &Weights::new()).unwrap();
                let out_shape = exe.output_shapes(&shapes).unwrap().remove(0);
                time(exe.as_ref(), &shapes, &out_shape)
            })
            .collect();
        println!("{op:10} {:8.1} {:8.1}", t[0], t[1]);
    }
}
