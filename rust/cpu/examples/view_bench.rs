//! scratch: cost of a view step
use ember_core::backend::{Backend, Weights};
use ember_core::dim::Dim;
use ember_core::dtype::DType;
use ember_core::ir::{Graph, Op, TensorType};
use ember_core::tensor::{contiguous_strides, TensorOut, TensorView};
use ember_cpu::CpuBackend;
use std::time::Instant;
fn dims(v: &[usize]) -> Vec<Dim> {
    v.iter().map(|&d| Dim::from(d)).collect()
}
fn main() {
    let mut g = Graph::new();
    let mut x = g
        .add_source(
            Op::Input { index: 0 },
            TensorType::new(DType::F32, dims(&[1, 8, 32])),
            "x",
        )
        .unwrap();
    for i in 0..100 {
        let shape = if i % 2 == 0 {
            dims(&[1, 1, 8, 32])
        } else {
            dims(&[1, 8, 32])
        };
        x = g.add(Op::Reshape { shape }, &[x], "r").unwrap();
    }
    let y = g
        .add(Op::Unary(ember_core::ir::UnaryOp::Neg), &[x], "n")
        .unwrap();
    g.outputs.push(y);
    let exe = CpuBackend::new(1).compile(&g, &Weights::new()).unwrap();
    let buf = vec![0.5f32; 256];
    let views = [TensorView {
        ptr: buf.as_ptr() as *const u8,
        dtype: DType::F32,
        shape: vec![1, 8, 32],
        strides: contiguous_strides(&[1, 8, 32]),
    }];
    let mut out = vec![0f32; 256];
    let outs = [TensorOut {
        ptr: out.as_mut_ptr() as *mut u8,
        dtype: DType::F32,
        shape: vec![1, 8, 32],
    }];
    let mut times = Vec::new();
    for i in 0..20000 {
        let t = Instant::now();
        unsafe { exe.run(&views, &outs).unwrap() };
        if i >= 2000 {
            times.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    times.sort_by(f64::total_cmp);
    println!(
        "{:.2} us per call (100 reshapes + neg)",
        times[times.len() / 2]
    );
}
