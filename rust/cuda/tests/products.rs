//! The generated matrix-product kernels the optimizer may choose instead of cuBLASLt
//! (`cuda.warp_dot`, `cuda.thread_dot`), run on the host emulator against the reference
//! interpreter: a decode step's row times a transposed weight, several rows times a plain
//! operand, batched products; every dtype cuBLASLt takes; sums whose length is no multiple
//! of a warp, and output counts that leave warps of a block idle.

use ember_core::backend::{Executable, Weights};
use ember_core::dim::Dim;
use ember_core::dtype::DType;
use ember_core::interp::{self, Value};
use ember_core::ir::{Graph, Op, TensorType};
use ember_core::tensor::{contiguous_strides, HostTensor, TensorOut, TensorView};
use ember_cuda::codegen::{generate, KERNEL_THREAD_DOT, KERNEL_WARP_DOT};
use ember_cuda::emulate::EmulatedDevice;
use ember_cuda::exec::Program;

const DTYPES: [DType; 4] = [DType::F32, DType::BF16, DType::F16, DType::F64];

fn dims(shape: &[usize]) -> Vec<Dim> {
    shape.iter().map(|&d| Dim::from(d)).collect()
}

fn values(n: usize, seed: usize) -> Vec<f64> {
    (0..n)
        .map(|i| (((i * 31 + seed * 17) % 29) as f64 - 14.0) / 16.0)
        .collect()
}

/// `x @ wᵀ` with `w` a `[n, k]` weight (a linear layer; a decode step when `m` is 1).
fn linear(dtype: DType, m: usize, k: usize, n: usize) -> (Graph, Weights, Vec<Value>) {
    let mut g = Graph::new();
    let x = g
        .add_source(
            Op::Input { index: 0 },
            TensorType::new(dtype, dims(&[m, k])),
            "x",
        )
        .unwrap();
    let w = g
        .add_source(
            Op::Weight { name: "w".into() },
            TensorType::new(dtype, dims(&[n, k])),
            "w",
        )
        .unwrap();
    let wt = g
        .add(Op::Permute { perm: vec![1, 0] }, &[w], "w_t")
        .unwrap();
    let y = g.add(Op::Dot, &[x, wt], "proj").unwrap();
    g.outputs = vec![y];
    let wv = Value::from_f64(dtype, vec![n, k], values(n * k, 1));
    let mut weights = Weights::new();
    weights.insert(
        "w".into(),
        HostTensor::owned(dtype, vec![n, k], wv.to_bytes()).unwrap(),
    );
    let xv = Value::from_f64(dtype, vec![m, k], values(m * k, 2));
    (g, weights, vec![xv])
}

/// `a @ b` of two inputs `[.., m, k]` and `[.., k, n]`.
fn product(dtype: DType, batch: &[usize], m: usize, k: usize, n: usize) -> (Graph, Vec<Value>) {
    let mut g = Graph::new();
    let shape = |rows, cols| [batch, &[rows, cols]].concat();
    let (sa, sb) = (shape(m, k), shape(k, n));
    let a = g
        .add_source(
            Op::Input { index: 0 },
            TensorType::new(dtype, dims(&sa)),
            "a",
        )
        .unwrap();
    let b = g
        .add_source(
            Op::Input { index: 1 },
            TensorType::new(dtype, dims(&sb)),
            "b",
        )
        .unwrap();
    let y = g.add(Op::Dot, &[a, b], "mm").unwrap();
    g.outputs = vec![y];
    let av = Value::from_f64(dtype, sa.clone(), values(sa.iter().product(), 3));
    let bv = Value::from_f64(dtype, sb.clone(), values(sb.iter().product(), 4));
    (g, vec![av, bv])
}

/// Runs `graph` with `kernel` chosen for its products on the emulator; the outputs.
fn run_choice(
    graph: &Graph,
    weights: &Weights,
    inputs: &[Value],
    kernel: &str,
    gpu_launches: bool,
) -> Vec<f64> {
    let chosen = ember_cuda::with_choice(graph, kernel).unwrap();
    let kp = generate(&chosen).unwrap();
    assert!(
        kp.steps
            .iter()
            .all(|s| !matches!(s.kind, ember_cuda::codegen::StepKind::Gemm(_))),
        "{kernel}: no product is left to cuBLASLt"
    );
    let mut device = EmulatedDevice::new(&kp).unwrap();
    if gpu_launches {
        device = device.launching_as_the_gpu();
    }
    let program = Program::new(kp, device, weights).unwrap();
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
    let out_shape = Executable::output_shapes(&program, &shapes)
        .unwrap()
        .remove(0);
    let dtype = graph.ty(graph.outputs[0]).dtype;
    let mut out = vec![0u8; out_shape.iter().product::<usize>() * dtype.size()];
    let target = TensorOut {
        ptr: out.as_mut_ptr(),
        dtype,
        shape: out_shape.clone(),
    };
    // SAFETY: the views and the output point at live buffers of their shapes.
    unsafe { Executable::run(&program, &views, &[target]) }.unwrap();
    Value::from_bytes(dtype, out_shape, &out)
        .unwrap()
        .to_f64_vec()
}

fn check(what: &str, got: &[f64], want: &Value) {
    let rtol = match want.dtype {
        DType::F64 => 1e-12,
        DType::F32 => 1e-5,
        // The kernel rounds once from an f32 sum; the interpreter's sum is exact.
        _ => 1e-2,
    };
    let want = want.to_f64_vec();
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (&a, &b)) in got.iter().zip(&want).enumerate() {
        assert!(
            (a - b).abs() <= rtol * (1.0 + b.abs()),
            "{what}: element {i} is {a}, expected {b}"
        );
    }
}

#[test]
fn both_product_kernels_match_the_reference_on_every_layout_and_dtype() {
    for kernel in [KERNEL_WARP_DOT, KERNEL_THREAD_DOT] {
        for dtype in DTYPES {
            // A decode step (one row, 70 terms: two full warps' strides and a partial one),
            // and a few rows.
            for m in [1, 3] {
                let (g, w, x) = linear(dtype, m, 70, 45);
                let want = interp::run(&g, &w, &x).unwrap().remove(0);
                let got = run_choice(&g, &w, &x, kernel, false);
                check(&format!("{kernel} {dtype} linear m={m}"), &got, &want);
            }
            let (g, x) = product(dtype, &[2], 3, 40, 33);
            let want = interp::run(&g, &Weights::new(), &x).unwrap().remove(0);
            let got = run_choice(&g, &Weights::new(), &x, kernel, false);
            check(&format!("{kernel} {dtype} batched"), &got, &want);
        }
    }
}

#[test]
fn the_warp_kernel_at_the_gpus_launch_sizes() {
    // 256 threads a block: 8 warps, of which the last block's are partly idle (45 outputs).
    for dtype in [DType::F32, DType::BF16] {
        let (g, w, x) = linear(dtype, 1, 300, 45);
        let want = interp::run(&g, &w, &x).unwrap().remove(0);
        let got = run_choice(&g, &w, &x, KERNEL_WARP_DOT, true);
        check(&format!("{dtype} at GPU launch sizes"), &got, &want);
    }
}

#[test]
fn choosing_an_unknown_kernel_is_refused() {
    let (g, _, _) = linear(DType::F32, 1, 8, 4);
    let err = ember_cuda::with_choice(&g, "cuda.nope").unwrap_err();
    assert!(err.to_string().contains("cuda.nope"), "{err}");
}
