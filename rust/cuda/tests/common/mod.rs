//! What the emulator tests share: test values, graph inputs, and a program run on the
//! emulator (host tensors in and out) compared with the reference interpreter.

#![allow(dead_code)] // each test file uses its own part

use ember_core::backend::{Executable, Weights};
use ember_core::dim::Dim;
use ember_core::dtype::DType;
use ember_core::interp::{self, Value};
use ember_core::ir::{Graph, Op, TensorType};
use ember_core::tensor::{contiguous_strides, TensorOut, TensorView};
use ember_core::Result;
use ember_cuda::codegen::KernelProgram;
use ember_cuda::emulate::EmulatedDevice;
use ember_cuda::exec::Program;

pub fn dims(shape: &[usize]) -> Vec<Dim> {
    shape.iter().map(|&d| Dim::from(d)).collect()
}

/// Deterministic test values in [-0.875, 0.875], none zero for most seeds' first few.
pub fn values(n: usize, seed: usize) -> Vec<f64> {
    (0..n)
        .map(|i| (((i * 31 + seed * 17) % 29) as f64 - 14.0) / 16.0)
        .collect()
}

/// Input `index` of `shape`.
pub fn input(g: &mut Graph, index: usize, dtype: DType, shape: &[usize], name: &str) -> usize {
    let ty = TensorType::new(dtype, dims(shape));
    g.add_source(Op::Input { index }, ty, name).unwrap()
}

/// Runs `kp` on the emulator (launching as the GPU does when `gpu_launches`); every output.
pub fn run_program(
    kp: KernelProgram,
    weights: &Weights,
    inputs: &[Value],
    gpu_launches: bool,
) -> Result<Vec<Vec<f64>>> {
    let dtypes: Vec<DType> = kp
        .graph
        .outputs
        .iter()
        .map(|&o| kp.graph.ty(o).dtype)
        .collect();
    let mut device = EmulatedDevice::new(&kp)?;
    if gpu_launches {
        device = device.launching_as_the_gpu();
    }
    let program = Program::new(kp, device, weights)?;
    let bytes: Vec<Vec<u8>> = inputs.iter().map(|v| v.to_bytes()).collect();
    let views: Vec<TensorView> = inputs
        .iter()
        .zip(&bytes)
        .map(|(v, b)| TensorView {
            ptr: b.as_ptr(),
            dtype: v.dtype,
            shape: v.shape.clone(),
            strides: contiguous_strides(&v.shape),
        })
        .collect();
    let shapes: Vec<Vec<usize>> = inputs.iter().map(|v| v.shape.clone()).collect();
    let out_shapes = Executable::output_shapes(&program, &shapes)?;
    let mut outs: Vec<Vec<u8>> = out_shapes
        .iter()
        .zip(&dtypes)
        .map(|(s, d)| vec![0u8; s.iter().product::<usize>() * d.size()])
        .collect();
    let targets: Vec<TensorOut> = outs
        .iter_mut()
        .zip(out_shapes.iter().zip(&dtypes))
        .map(|(o, (s, &d))| TensorOut {
            ptr: o.as_mut_ptr(),
            dtype: d,
            shape: s.clone(),
        })
        .collect();
    // SAFETY: the views and the outputs point at live buffers of their shapes.
    unsafe { Executable::run(&program, &views, &targets) }?;
    outs.iter()
        .zip(out_shapes.into_iter().zip(dtypes))
        .map(|(o, (s, d))| Ok(Value::from_bytes(d, s, o)?.to_f64_vec()))
        .collect()
}

/// Runs `graph` on the emulator and checks every output against the interpreter, each
/// element within `rtol · (1 + |expected|)` (NaN only where NaN is expected).
pub fn check_against_reference(
    what: &str,
    graph: &Graph,
    weights: &Weights,
    inputs: &[Value],
    gpu_launches: bool,
    rtol: f64,
) {
    let kp = ember_cuda::codegen::generate(graph).unwrap();
    let got = run_program(kp, weights, inputs, gpu_launches).unwrap();
    let want = interp::run(graph, weights, inputs).unwrap();
    for (k, (got, want)) in got.iter().zip(&want).enumerate() {
        check(
            &format!("{what}, output {k}"),
            got,
            &want.to_f64_vec(),
            rtol,
        );
    }
}

pub fn check(what: &str, got: &[f64], want: &[f64], rtol: f64) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        let close = (a - b).abs() <= rtol * (1.0 + b.abs()) || (a.is_nan() && b.is_nan());
        assert!(close, "{what}: element {i} is {a}, expected {b}");
    }
}
