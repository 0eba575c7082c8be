//! Times an 8-op elementwise chain over 1M f32 and a linear+bias+gelu (256×1024×1024).
//! `cargo run -p ember-cpu --release --example fuse_bench` (set `EMBER_CPU_FUSE=0` to compare).

use std::time::Instant;

use ember_core::backend::{Backend, Executable, Weights};
use ember_core::dim::Dim;
use ember_core::dtype::{DType, Scalar};
use ember_core::ir::{BinaryOp, Graph, Op, TensorType, UnaryOp, ValueId};
use ember_core::tensor::{contiguous_strides, TensorOut, TensorView};
use ember_cpu::CpuBackend;

fn ty(shape: &[usize]) -> TensorType {
    TensorType::new(DType::F32, shape.iter().map(|&d| Dim::from(d)).collect())
}

fn input(g: &mut Graph, index: usize, shape: &[usize]) -> ValueId {
    g.add_source(Op::Input { index }, ty(shape), "in").unwrap()
}

fn chain() -> (Graph, Vec<Vec<usize>>) {
    let s = [1024, 1024];
    let mut g = Graph::new();
    let x = input(&mut g, 0, &s);
    let b = input(&mut g, 1, &s);
    let half = g
        .add_source(
            Op::Full {
                value: Scalar::Float(0.5),
            },
            ty(&s),
            "half",
        )
        .unwrap();
    let bin = |g: &mut Graph, op, a, b| g.add(Op::Binary(op), &[a, b], "b").unwrap();
    let un = |g: &mut Graph, op, a| g.add(Op::Unary(op), &[a], "u").unwrap();
    let mut y = bin(&mut g, BinaryOp::Mul, x, half);
    y = bin(&mut g, BinaryOp::Add, y, b);
    y = un(&mut g, UnaryOp::Tanh, y);
    y = bin(&mut g, BinaryOp::Mul, y, y);
    y = bin(&mut g, BinaryOp::Sub, y, x);
    y = un(&mut g, UnaryOp::Relu, y);
    y = bin(&mut g, BinaryOp::Add, y, half);
    y = un(&mut g, UnaryOp::Sqrt, y);
    g.outputs.push(y);
    (g, vec![s.to_vec(), s.to_vec()])
}

fn linear_gelu() -> (Graph, Vec<Vec<usize>>) {
    let (m, k, n) = (256, 1024, 1024);
    let mut g = Graph::new();
    let x = input(&mut g, 0, &[m, k]);
    let w = input(&mut g, 1, &[n, k]);
    let bias = input(&mut g, 2, &[n]);
    let wt = g.add(Op::Permute { perm: vec![1, 0] }, &[w], "wt").unwrap();
    let d = g.add(Op::Dot, &[x, wt], "dot").unwrap();
    let br = g
        .add(
            Op::Reshape {
                shape: vec![Dim::from(1usize), Dim::from(n)],
            },
            &[bias],
            "r",
        )
        .unwrap();
    let be = g
        .add(
            Op::Expand {
                shape: vec![Dim::from(m), Dim::from(n)],
            },
            &[br],
            "e",
        )
        .unwrap();
    let a = g.add(Op::Binary(BinaryOp::Add), &[d, be], "add").unwrap();
    let y = g.add(Op::Unary(UnaryOp::Gelu), &[a], "gelu").unwrap();
    g.outputs.push(y);
    (g, vec![vec![m, k], vec![n, k], vec![n]])
}

fn time(name: &str, exe: &dyn Executable, shapes: &[Vec<usize>], out_shape: &[usize]) {
    let bufs: Vec<Vec<f32>> = shapes
        .iter()
        .map(|s| {
            (0..s.iter().product::<usize>())
                .map(|i| ((i % 97) as f32) * 0.01 - 0.3)
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
    for _ in 0..30 {
        let t = Instant::now();
        // SAFETY: the views and the output point at live buffers of the right sizes.
        unsafe { exe.run(&views, &outs).unwrap() };
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!(
        "{name}: median {:.3} ms, min {:.3} ms (checksum {:.4})",
        times[times.len() / 2],
        times[0],
        out.iter().map(|&v| v as f64).sum::<f64>()
    );
}

fn main() {
    let backend = CpuBackend::default();
    for (name, (g, shapes)) in [
        ("chain8 1M f32", chain()),
        ("linear+gelu 256x1024x1024", linear_gelu()),
    ] {
        let exe = backend.compile(&g, &Weights::new()).unwrap();
        let out_shape = exe.output_shapes(&shapes).unwrap().remove(0);
        time(name, exe.as_ref(), &shapes, &out_shape);
    }
}
