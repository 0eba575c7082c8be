//! Recorded runs (CUDA graphs) on the host emulator: a program is recorded once per dim
//! bucket, later calls patch only what changed (the caller's addresses, product sizes), and
//! every call matches the reference interpreter — across sizes inside a bucket, across
//! buckets, and with new input and output buffers each call.

use ember_core::backend::{Executable, Weights};
use ember_core::dim::Dim;
use ember_core::dtype::DType;
use ember_core::interp::{self, Value};
use ember_core::ir::{BinaryOp, Graph, Op, ReduceOp, TensorType};
use ember_core::tensor::{contiguous_strides, HostTensor, TensorOut, TensorView};
use ember_cuda::emulate::EmulatedDevice;
use ember_cuda::exec::{Program, RunStats};

/// A graph with a dynamic row count `s0`: a product (cuBLASLt on the GPU, whose sizes a
/// recording fixes), a softmax over the rows' features, and a reduction over the rows (a
/// kernel whose work grows with `s0`).
fn dynamic_graph() -> (Graph, Weights) {
    let mut g = Graph::new();
    let s0 = Dim::sym("s0");
    let x = g
        .add_source(
            Op::Input { index: 0 },
            TensorType::new(DType::F32, vec![s0.clone(), Dim::from(8usize)]),
            "x",
        )
        .unwrap();
    let w = g
        .add_source(
            Op::Weight { name: "w".into() },
            TensorType::new(DType::F32, vec![Dim::from(8usize), Dim::from(6usize)]),
            "w",
        )
        .unwrap();
    let y = g.add(Op::Dot, &[x, w], "mm").unwrap();
    let p = g
        .add(
            Op::Softmax {
                axis: 1,
                log: false,
            },
            &[y],
            "softmax",
        )
        .unwrap();
    let total = g
        .add(
            Op::Reduce {
                op: ReduceOp::Sum,
                axes: vec![0],
                keepdim: true,
            },
            &[y],
            "sum",
        )
        .unwrap();
    let rows = g
        .add(
            Op::Expand {
                shape: vec![s0, Dim::from(6usize)],
            },
            &[total],
            "bcast",
        )
        .unwrap();
    let out = g.add(Op::Binary(BinaryOp::Mul), &[p, rows], "mul").unwrap();
    g.outputs = vec![out, total];
    let wv: Vec<f32> = (0..48).map(|i| ((i * 7 % 11) as f32 - 5.0) / 8.0).collect();
    let bytes: Vec<u8> = wv.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut weights = Weights::new();
    weights.insert(
        "w".into(),
        HostTensor::owned(DType::F32, vec![8, 6], bytes).unwrap(),
    );
    (g, weights)
}

fn input_for(rows: usize, seed: usize) -> Vec<f32> {
    (0..rows * 8)
        .map(|i| (((i + seed) * 37 % 23) as f32 - 11.0) / 10.0)
        .collect()
}

fn expected(g: &Graph, w: &Weights, rows: usize, x: &[f32]) -> Vec<Vec<f64>> {
    let x_bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    let xv = Value::from_bytes(DType::F32, vec![rows, 8], &x_bytes).unwrap();
    let want = interp::run(g, w, &[xv]).unwrap();
    want.iter().map(|v| v.to_f64_vec()).collect()
}

fn assert_close(got: &[Vec<f32>], want: &[Vec<f64>], rows: usize) {
    for (got, want) in got.iter().zip(want) {
        assert_eq!(got.len(), want.len());
        for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
            assert!(
                (a as f64 - b).abs() <= 1e-4 * (1.0 + b.abs()),
                "rows {rows}, element {i}: {a} vs {b}"
            );
        }
    }
}

/// Runs `program` on fresh host buffers (so the emulated device addresses change too) and
/// checks both outputs against the interpreter.
fn run_and_check(
    program: &Program<EmulatedDevice>,
    g: &Graph,
    w: &Weights,
    rows: usize,
    seed: usize,
) {
    let x = input_for(rows, seed);
    let view = TensorView {
        ptr: x.as_ptr() as *const u8,
        dtype: DType::F32,
        shape: vec![rows, 8],
        strides: contiguous_strides(&[rows, 8]),
    };
    let shapes = Executable::output_shapes(program, &[vec![rows, 8]]).unwrap();
    assert_eq!(shapes, vec![vec![rows, 6], vec![1, 6]]);
    let mut out0 = vec![0f32; rows * 6];
    let mut out1 = vec![0f32; 6];
    let outs = [
        TensorOut {
            ptr: out0.as_mut_ptr() as *mut u8,
            dtype: DType::F32,
            shape: vec![rows, 6],
        },
        TensorOut {
            ptr: out1.as_mut_ptr() as *mut u8,
            dtype: DType::F32,
            shape: vec![1, 6],
        },
    ];
    // SAFETY: the views and outputs point at live buffers of the stated shapes.
    unsafe { Executable::run(program, &[view], &outs) }.unwrap();
    assert_close(&[out0, out1], &expected(g, w, rows, &x), rows);
}

fn program(g: &Graph, w: &Weights) -> Program<EmulatedDevice> {
    let kp = ember_cuda::codegen::generate(g).unwrap();
    let device = EmulatedDevice::new(&kp).unwrap();
    Program::new(kp, device, w).unwrap()
}

#[test]
fn one_recording_serves_every_size_of_a_bucket_and_new_buckets_record_once() {
    let (g, w) = dynamic_graph();
    let p = program(&g, &w);
    // 17..=32 is one bucket; 3 and 16 share the smallest; 40 and 64 the next.
    for (call, rows) in [17usize, 20, 32, 3, 16, 40, 64, 18].into_iter().enumerate() {
        run_and_check(&p, &g, &w, rows, call);
    }
    let RunStats {
        direct,
        replayed,
        recorded,
        patched,
        record_failures,
        host_us,
        record_us,
        patch_us,
    } = p.stats();
    assert_eq!(record_failures, 0);
    // The host's time covers its parts.
    assert!(
        host_us >= record_us + patch_us,
        "{host_us} < {record_us} + {patch_us}"
    );
    if std::env::var("EMBER_CUDA_GRAPHS").is_ok_and(|v| v == "0") {
        assert_eq!((direct, replayed), (8, 0));
        return;
    }
    assert_eq!(direct, 0);
    assert_eq!(replayed, 8, "every call replays a recording");
    // One recording per bucket (32, 16, 64), and the 32 bucket's again at the last call:
    // the 64 bucket grew the arena, which drops the recordings made on the old one.
    assert_eq!(recorded, 4);
    // Every later call of a bucket changes the caller's buffers and the product's rows.
    assert!(patched >= 5, "patched {patched}");
}

#[test]
fn a_repeated_call_with_the_same_buffers_patches_nothing() {
    let (g, w) = dynamic_graph();
    let p = program(&g, &w);
    let x = input_for(5, 0);
    let mut out0 = vec![0f32; 30];
    let mut out1 = vec![0f32; 6];
    let outputs = [out0.as_mut_ptr() as u64, out1.as_mut_ptr() as u64];
    for _ in 0..3 {
        // On the emulator, device addresses are host addresses.
        p.run_on_device(&[vec![5, 8]], &[x.as_ptr() as u64], &outputs, 0)
            .unwrap();
    }
    assert_close(&[out0, out1], &expected(&g, &w, 5, &x), 5);
    let stats = p.stats();
    if stats.direct == 0 {
        assert_eq!((stats.recorded, stats.replayed, stats.patched), (1, 3, 0));
    }
}

/// The optimizer's timer runs the program as torch tensors do: device buffers, the recorded
/// path, patched once for its buffers and then replayed without changes.
#[test]
fn the_device_timer_replays_the_recording_and_patches_only_once() {
    let (g, w) = dynamic_graph();
    let p = program(&g, &w);
    run_and_check(&p, &g, &w, 20, 0);
    let x = input_for(20, 1);
    let before = p.stats();
    // SAFETY: the view points at a live buffer of its shape.
    let mut timer = unsafe { Executable::device_timer(&p, &[view_of(&x)]) }
        .unwrap()
        .expect("the CUDA executor times on its device");
    let warmed = p.stats();
    let times: Vec<f64> = (0..5).map(|_| timer.run().unwrap()).collect();
    drop(timer);
    assert!(times.iter().all(|t| t.is_finite() && *t > 0.0), "{times:?}");
    let after = p.stats();
    if after.direct > before.direct {
        assert_eq!(after.direct - before.direct, 6);
        return;
    }
    // One untimed run (new buffers: patched in, unless the allocator gave the timer the
    // addresses the last run's buffers had), then five timed replays of the same
    // recording with nothing to patch.
    assert_eq!(after.replayed - before.replayed, 6);
    assert_eq!(after.recorded, before.recorded);
    assert_eq!(after.patched, warmed.patched, "timed runs patch nothing");
}

fn view_of(x: &[f32]) -> TensorView {
    let rows = x.len() / 8;
    TensorView {
        ptr: x.as_ptr() as *const u8,
        dtype: DType::F32,
        shape: vec![rows, 8],
        strides: contiguous_strides(&[rows, 8]),
    }
}

/// On the CUDA backend the optimizer times candidates by the device's clock and adopts a
/// program that still matches the interpreter.
#[test]
fn the_search_times_cuda_candidates_on_the_device() {
    use ember_core::search::{optimize, SearchOptions};
    let (g, w) = dynamic_graph();
    let opts = SearchOptions {
        iterations: 3,
        repeats: 2,
        input_shapes: Some(vec![vec![12, 8]]),
        // Each candidate compiles its kernels with the host C++ compiler first: on a busy
        // machine the default 3 s can end the search after the default program alone.
        time_budget: std::time::Duration::from_secs(120),
        ..Default::default()
    };
    let done = optimize(&g, &ember_cuda::EmulatedCudaBackend::default(), &w, &opts).unwrap();
    assert_eq!(done.report.clock, "device", "{:?}", done.report);
    assert!(done.report.chosen.is_some(), "{:?}", done.report);
    // The generated product kernels are among the measured alternatives to cuBLASLt.
    let measured_choice = |name: &str| {
        done.report
            .candidates
            .iter()
            .any(|c| c.description.contains(name) && c.verified == Some(true) && c.time_s.is_some())
    };
    assert!(
        measured_choice(ember_cuda::codegen::KERNEL_WARP_DOT),
        "{:#?}",
        done.report.candidates
    );
    let x = input_for(12, 3);
    let shapes = done.executable.output_shapes(&[vec![12, 8]]).unwrap();
    let mut outs: Vec<Vec<f32>> = shapes
        .iter()
        .map(|s| vec![0f32; s.iter().product()])
        .collect();
    let targets: Vec<TensorOut> = outs
        .iter_mut()
        .zip(&shapes)
        .map(|(o, s)| TensorOut {
            ptr: o.as_mut_ptr() as *mut u8,
            dtype: DType::F32,
            shape: s.clone(),
        })
        .collect();
    // SAFETY: the view and outputs point at live buffers of their shapes.
    unsafe { done.executable.run(&[view_of(&x)], &targets) }.unwrap();
    assert_close(&outs, &expected(&g, &w, 12, &x), 12);
}
