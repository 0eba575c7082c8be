//! The emulator's memory check (`memcheck`): kernels with planted bugs of the kinds a GPU
//! punishes (a write past a value's end, into a neighbour, into an input or past an
//! output; a read of memory nothing wrote) fail their run naming the kernel, and the
//! unplanted program runs clean and right. Indices into an empty axis are refused before
//! any kernel runs.

mod common;

use common::run_program;
use ember_core::backend::Weights;
use ember_core::dim::Dim;
use ember_core::dtype::DType;
use ember_core::interp::Value;
use ember_core::ir::{Graph, Op, TensorType, UnaryOp};
use ember_core::Result;
use ember_cuda::codegen::{generate, KernelProgram};

const N: usize = 8;

/// `e = exp(x)` in the arena (two consumers), then `sin(e)` and `cos(e)` into the two
/// outputs in one launch: kernel `ember_k0` writes `e`, `ember_k1` the outputs.
fn program_source() -> KernelProgram {
    let mut g = Graph::new();
    let ty = TensorType::new(DType::F32, vec![Dim::from(N)]);
    let x = g.add_source(Op::Input { index: 0 }, ty, "x").unwrap();
    let e = g.add(Op::Unary(UnaryOp::Exp), &[x], "e").unwrap();
    let a = g.add(Op::Unary(UnaryOp::Sin), &[e], "a").unwrap();
    let b = g.add(Op::Unary(UnaryOp::Cos), &[e], "b").unwrap();
    g.outputs = vec![a, b];
    generate(&g).unwrap()
}

/// Runs the program with the replacement `from` → `to` (which must apply) made in its
/// source, on `x = [0, 0.1, …]`; returns the two outputs.
fn run_edited(from: &str, to: &str) -> Result<(Vec<f64>, Vec<f64>)> {
    let mut kp = program_source();
    assert!(kp.source.contains(from), "{from:?} not in\n{}", kp.source);
    kp.source = kp.source.replacen(from, to, 1);
    let x: Vec<f64> = (0..N).map(|i| i as f64 / 10.0).collect();
    let x = Value::from_f64(DType::F32, vec![N], x);
    let mut outs = run_program(kp, &Weights::new(), &[x], false)?;
    let b = outs.remove(1);
    Ok((outs.remove(0), b))
}

fn error_of(from: &str, to: &str) -> String {
    match run_edited(from, to) {
        Ok(_) => panic!("the planted bug {to:?} ran without complaint"),
        Err(e) => e.to_string(),
    }
}

const K0_WRITE: &str = "out[i] = (float)(v_4);";

#[test]
fn the_unplanted_program_runs_clean_and_right() {
    let (a, b) = run_edited(K0_WRITE, K0_WRITE).unwrap();
    for i in 0..N {
        let e = (i as f32 / 10.0).exp();
        let (sin, cos) = (e.sin() as f64, e.cos() as f64);
        assert!((a[i] - sin).abs() < 1e-6 && (b[i] - cos).abs() < 1e-6);
    }
}

#[test]
fn a_write_past_a_values_end_names_the_kernel_and_the_neighbour() {
    let msg = error_of(K0_WRITE, "out[i + 1] = (float)(v_4);");
    assert!(msg.contains("kernel ember_k0"), "{msg}");
    assert!(msg.contains("outside every live value"), "{msg}");
    assert!(msg.contains("node 'e' (exp)"), "{msg}");
}

#[test]
fn a_value_read_before_it_is_written_reads_nan_not_zero() {
    // `e`'s last element is never written: its consumers read poison (NaN), as a GPU
    // would read garbage, instead of the zeros of a fresh host buffer.
    let (a, b) = run_edited(K0_WRITE, "if (i + 1 < n) out[i] = (float)(v_4);").unwrap();
    assert!(a[..N - 1].iter().all(|v| v.is_finite()));
    assert!(a[N - 1].is_nan() && b[N - 1].is_nan(), "{a:?} {b:?}");
}

#[test]
fn a_write_into_a_live_value_it_only_reads_is_caught() {
    let msg = error_of(
        "out1[i] = (float)(v_5);",
        "out1[i] = (float)(v_5); ((float*)b0)[i] = 0.0f;",
    );
    assert!(msg.contains("kernel ember_k1"), "{msg}");
    assert!(
        msg.contains("changed node 'e' (exp), which it does not write"),
        "{msg}"
    );
}

#[test]
fn a_write_into_an_input_is_caught() {
    let msg = error_of(K0_WRITE, "out[i] = (float)(v_4); ((float*)b0)[i] = 1.0f;");
    assert!(msg.contains("changed input 0"), "{msg}");
}

#[test]
fn a_write_past_an_outputs_end_is_caught() {
    let msg = error_of("out1[i] = (float)(v_5);", "out1[i + 2] = (float)(v_5);");
    assert!(msg.contains("kernel ember_k1"), "{msg}");
    assert!(
        msg.contains("past the end of a buffer of 32 bytes"),
        "{msg}"
    );
}

#[test]
fn indices_into_an_empty_axis_are_refused_before_any_kernel_runs() {
    // A kernel would read element 0 of nothing: on a GPU, an illegal address that breaks
    // the CUDA context. The executor refuses the call instead, naming the node.
    let mut g = Graph::new();
    let x = common::input(&mut g, 0, DType::F32, &[0, 4], "x");
    let idx = common::input(&mut g, 1, DType::I64, &[3], "idx");
    let y = g
        .add(Op::IndexSelect { axis: 0 }, &[x, idx], "pick")
        .unwrap();
    g.outputs = vec![y];
    let kp = generate(&g).unwrap();
    let inputs = [
        Value::from_f64(DType::F32, vec![0, 4], vec![]),
        Value::from_f64(DType::I64, vec![3], vec![0.0, 1.0, 2.0]),
    ];
    let err = run_program(kp, &Weights::new(), &inputs, false).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("index out of range in index_select (node 'pick')"),
        "{msg}"
    );
    assert!(msg.contains("into an empty axis"), "{msg}");
}
