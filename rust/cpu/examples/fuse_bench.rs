//! Times an 8-op elementwise chain over 1M f32, the requantizing pass of a quantized model
//! and a linear+bias+gelu (256×1024×1024).
//! `cargo run -p ember-cpu --release --example fuse_bench` (set `EMBER_CPU_FUSE=0` to compare,
//! `EMBER_BENCH_THREADS=1` for one thread).

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

/// The float pass between two quantized products (a `QuantizeLinear` after a dequantized
/// `MatMul` + bias): int32 sums less the zero-point term, scaled, biased, requantized to int8.
fn requantize() -> (Graph, Vec<Vec<usize>>) {
    let (m, n) = (32, 1024);
    let mut g = Graph::new();
    let sums = g
        .add_source(
            Op::Input { index: 0 },
            TensorType::new(DType::I32, vec![Dim::from(m), Dim::from(n)]),
            "sums",
        )
        .unwrap();
    let col = g
        .add_source(
            Op::Input { index: 1 },
            TensorType::new(DType::I32, vec![Dim::from(1usize), Dim::from(n)]),
            "col",
        )
        .unwrap();
    let bias = input(&mut g, 2, &[1, n]);
    let wide = |g: &mut Graph, v| {
        g.add(
            Op::Expand {
                shape: vec![Dim::from(m), Dim::from(n)],
            },
            &[v],
            "e",
        )
        .unwrap()
    };
    let scalar = |g: &mut Graph, v: f64| {
        g.add_source(
            Op::Full {
                value: Scalar::Float(v),
            },
            ty(&[m, n]),
            "s",
        )
        .unwrap()
    };
    let bin = |g: &mut Graph, op, a, b| g.add(Op::Binary(op), &[a, b], "b").unwrap();
    let col = wide(&mut g, col);
    let bias = wide(&mut g, bias);
    let y = bin(&mut g, BinaryOp::Sub, sums, col);
    let y = g.add(Op::Cast { to: DType::F32 }, &[y], "c").unwrap();
    let s = scalar(&mut g, 0.0123);
    let y = bin(&mut g, BinaryOp::Mul, y, s);
    let y = bin(&mut g, BinaryOp::Add, y, bias);
    let s = scalar(&mut g, 0.071);
    let y = bin(&mut g, BinaryOp::Div, y, s);
    let y = g.add(Op::Unary(UnaryOp::Round), &[y], "r").unwrap();
    let s = scalar(&mut g, -3.0);
    let y = bin(&mut g, BinaryOp::Add, y, s);
    let s = scalar(&mut g, -128.0);
    let y = bin(&mut g, BinaryOp::Max, y, s);
    let s = scalar(&mut g, 127.0);
    let y = bin(&mut g, BinaryOp::Min, y, s);
    let y = g.add(Op::Cast { to: DType::I8 }, &[y], "q").unwrap();
    g.outputs.push(y);
    (g, vec![vec![m, n], vec![1, n], vec![1, n]])
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

/// Median and best of `reps` runs of `exe` on inputs of `g`'s dtypes and `shapes`.
fn time(name: &str, g: &Graph, exe: &dyn Executable, shapes: &[Vec<usize>], reps: usize) {
    let dtype_of = |index: usize| {
        g.nodes
            .iter()
            .find(|n| n.op == Op::Input { index })
            .map(|n| n.ty.dtype)
            .unwrap()
    };
    // 4-byte elements: f32 values, or int32 ones for integer inputs.
    let bufs: Vec<Vec<u32>> = shapes
        .iter()
        .enumerate()
        .map(|(k, s)| {
            (0..s.iter().product::<usize>())
                .map(|i| match dtype_of(k) {
                    DType::F32 => (((i % 97) as f32) * 0.01 - 0.3).to_bits(),
                    _ => (i % 1931) as u32,
                })
                .collect()
        })
        .collect();
    let views: Vec<TensorView> = bufs
        .iter()
        .zip(shapes)
        .enumerate()
        .map(|(k, (b, s))| TensorView {
            ptr: b.as_ptr() as *const u8,
            dtype: dtype_of(k),
            shape: s.clone(),
            strides: contiguous_strides(s),
        })
        .collect();
    let out_shape = exe.output_shapes(shapes).unwrap().remove(0);
    let out_dtype = g.nodes[g.outputs[0]].ty.dtype;
    let mut out = vec![0u8; out_shape.iter().product::<usize>() * out_dtype.size()];
    let outs = [TensorOut {
        ptr: out.as_mut_ptr(),
        dtype: out_dtype,
        shape: out_shape,
    }];
    let mut times = Vec::new();
    for _ in 0..reps {
        let t = Instant::now();
        // SAFETY: the views and the output point at live buffers of the right sizes.
        unsafe { exe.run(&views, &outs).unwrap() };
        times.push(t.elapsed().as_secs_f64() * 1e6);
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!(
        "{name}: median {:.1} µs, min {:.1} µs (checksum {})",
        times[times.len() / 2],
        times[0],
        out.iter().map(|&v| v as u64).sum::<u64>()
    );
}

fn main() {
    let threads = std::env::var("EMBER_BENCH_THREADS").map_or(0, |v| v.parse().unwrap_or(0));
    let backend = CpuBackend::new(threads);
    for (name, (g, shapes), reps) in [
        ("chain8 1M f32", chain(), 30),
        ("requantize [32, 1024] int32 -> int8", requantize(), 2000),
        ("linear+gelu 256x1024x1024", linear_gelu(), 30),
    ] {
        let exe = backend.compile(&g, &Weights::new()).unwrap();
        time(name, &g, exe.as_ref(), &shapes, reps);
    }
}
