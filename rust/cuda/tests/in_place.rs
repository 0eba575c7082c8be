//! A cache updated in place on the emulator: a scatter into an input nothing else reads,
//! given that input's own memory as its output, writes only the updates (its copy step is
//! skipped), reads back right, and — because every index of the run is checked before the
//! first update — a run that fails on an index, before or after the scatter, leaves the
//! caller's tensor exactly as it was.

mod common;

use common::input;
use ember_core::backend::{Executable, Weights};
use ember_core::dim::Dim;
use ember_core::dtype::DType;
use ember_core::interp::{self, Value};
use ember_core::ir::{BinaryOp, Graph, Op, ReduceOp, ScatterReduce};
use ember_core::tensor::HostTensor;
use ember_cuda::codegen::{generate, InPlace, StepKind};
use ember_cuda::emulate::EmulatedDevice;
use ember_cuda::exec::Program;

const B: usize = 2;
const S: usize = 6;
const E: usize = 3;
const ROWS: usize = 4;

/// `cache[:, at] = keys` for a `[B, S, E]` cache, `[B, 1, E]` keys and a one-element `at`
/// (`index_copy_` as the frontends translate it: a scatter at the position, expanded).
fn cache_update(g: &mut Graph, cache: usize, at: usize, keys: usize, name: &str) -> usize {
    let shape = |s: &[usize]| s.iter().map(|&d| Dim::from(d)).collect::<Vec<_>>();
    let at3 = g
        .add(
            Op::Reshape {
                shape: shape(&[1, 1, 1]),
            },
            &[at],
            "at3",
        )
        .unwrap();
    let index = g
        .add(
            Op::Expand {
                shape: shape(&[B, 1, E]),
            },
            &[at3],
            "index",
        )
        .unwrap();
    let op = Op::Scatter {
        axis: 1,
        reduce: ScatterReduce::None,
    };
    g.add(op, &[cache, index, keys], name).unwrap()
}

/// `cache[:, pos] = keys` (output 0, into input 0), then
/// `sum(cache, 1) + table[ids]` (output 1): the table lookup's indices are checked after
/// the cache was written.
fn step_graph() -> (Graph, Weights) {
    let mut g = Graph::new();
    let cache = input(&mut g, 0, DType::F32, &[B, S, E], "cache");
    let keys = input(&mut g, 1, DType::F32, &[B, 1, E], "keys");
    let pos = input(&mut g, 2, DType::I64, &[1], "pos");
    let ids = input(&mut g, 3, DType::I64, &[B], "ids");
    let shape = |s: &[usize]| s.iter().map(|&d| Dim::from(d)).collect::<Vec<_>>();
    let updated = cache_update(&mut g, cache, pos, keys, "index_copy");
    let total = g
        .add(
            Op::Reduce {
                op: ReduceOp::Sum,
                axes: vec![1],
                keepdim: false,
            },
            &[updated],
            "sum",
        )
        .unwrap();
    let table = g
        .add_source(
            Op::Weight {
                name: "table".into(),
            },
            ember_core::ir::TensorType::new(DType::F32, shape(&[ROWS, E])),
            "table",
        )
        .unwrap();
    let rows = g
        .add(Op::IndexSelect { axis: 0 }, &[table, ids], "lookup")
        .unwrap();
    let out = g
        .add(Op::Binary(BinaryOp::Add), &[total, rows], "add")
        .unwrap();
    g.outputs = vec![updated, out];
    let values: Vec<u8> = (0..ROWS * E)
        .flat_map(|i| (i as f32 / 4.0 - 1.0).to_le_bytes())
        .collect();
    let mut w = Weights::new();
    w.insert(
        "table".into(),
        HostTensor::owned(DType::F32, vec![ROWS, E], values).unwrap(),
    );
    (g, w)
}

fn program() -> (Graph, Weights, Program<EmulatedDevice>) {
    let (g, w) = step_graph();
    let kp = generate(&g).unwrap();
    let device = EmulatedDevice::new(&kp).unwrap();
    let p = Program::new(kp, device, &w).unwrap();
    (g, w, p)
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

struct Call {
    cache: Vec<f32>,
    keys: Vec<f32>,
    pos: [i64; 1],
    ids: [i64; B],
}

impl Call {
    fn new(pos: i64, ids: [i64; B]) -> Call {
        Call {
            cache: (0..B * S * E).map(|i| (i % 7) as f32 - 3.0).collect(),
            keys: (0..B * E).map(|i| 10.0 + i as f32).collect(),
            pos: [pos],
            ids,
        }
    }

    /// What the interpreter computes, from the call's values before the run.
    fn expected(&self, g: &Graph, w: &Weights) -> Vec<Vec<f64>> {
        let ins = [
            Value::from_bytes(DType::F32, vec![B, S, E], &f32_bytes(&self.cache)).unwrap(),
            Value::from_bytes(DType::F32, vec![B, 1, E], &f32_bytes(&self.keys)).unwrap(),
            Value::from_i64(DType::I64, vec![1], self.pos.to_vec()),
            Value::from_i64(DType::I64, vec![B], self.ids.to_vec()),
        ];
        let outs = interp::run(g, w, &ins).unwrap();
        outs.iter().map(|v| v.to_f64_vec()).collect()
    }

    /// Runs with output 0 in the cache's own memory (as `in_place_outputs` allows).
    fn run_in_place(&mut self, p: &Program<EmulatedDevice>) -> ember_core::Result<Vec<f32>> {
        let mut out1 = vec![0f32; B * E];
        let cache = self.cache.as_mut_ptr() as u64;
        let ins = [
            cache,
            self.keys.as_ptr() as u64,
            self.pos.as_ptr() as u64,
            self.ids.as_ptr() as u64,
        ];
        let shapes = [vec![B, S, E], vec![B, 1, E], vec![1], vec![B]];
        // On the emulator, device addresses are host addresses.
        p.run_on_device(&shapes, &ins, &[cache, out1.as_mut_ptr() as u64], 0)?;
        Ok(out1)
    }
}

fn assert_close(got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len());
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        assert!((a as f64 - b).abs() <= 1e-5, "element {i}: {a} vs {b}");
    }
}

#[test]
fn the_scatter_is_planned_in_place_with_an_index_check_before_it() {
    let (g, _) = step_graph();
    let kp = generate(&g).unwrap();
    let check = kp.precheck_step.expect("an index check step");
    assert_eq!(kp.in_place.len(), 1);
    let InPlace {
        output,
        input,
        copy_step,
    } = kp.in_place[0];
    assert_eq!((output, input), (0, 0));
    assert!(check < copy_step, "{check} {copy_step}");
    // The check covers the scatter's indices and the later lookup's.
    let checks = kp.source.matches("ember_index(meta").count();
    assert!(checks >= 4, "{}", kp.source);
    let (_, _, p) = program();
    assert_eq!(Executable::in_place_outputs(&p), vec![(0, 0)]);
}

/// The kernel a step launches.
fn kernel_of(p: &Program<EmulatedDevice>, step: usize) -> usize {
    match p.kp.steps[step].kind {
        StepKind::Kernel { kernel, .. } => kernel,
        StepKind::Gemm(_) => panic!("step {step} is a library product"),
    }
}

#[test]
fn an_update_in_place_reads_back_right_and_repeats() {
    let (g, w, p) = program();
    let copy = kernel_of(&p, p.kp.in_place[0].copy_step);
    let check = kernel_of(&p, p.kp.precheck_step.unwrap());
    for (round, pos) in [0i64, 3, 5, -1].into_iter().enumerate() {
        let mut call = Call::new(pos, [round as i64 % ROWS as i64, 3]);
        let want = call.expected(&g, &w);
        let out1 = call.run_in_place(&p).unwrap();
        assert_close(&call.cache, &want[0]);
        assert_close(&out1, &want[1]);
    }
    // Only the updates were written: the cache was never copied onto itself.
    let counts = p.device.launch_counts();
    assert_eq!((counts[copy], counts[check]), (0, 4), "{counts:?}");
}

#[test]
fn a_run_into_a_separate_output_copies_and_skips_the_check() {
    let (g, w, p) = program();
    let copy = kernel_of(&p, p.kp.in_place[0].copy_step);
    let check = kernel_of(&p, p.kp.precheck_step.unwrap());
    let call = Call::new(4, [1, 2]);
    let ins: Vec<Value> = vec![
        Value::from_bytes(DType::F32, vec![B, S, E], &f32_bytes(&call.cache)).unwrap(),
        Value::from_bytes(DType::F32, vec![B, 1, E], &f32_bytes(&call.keys)).unwrap(),
        Value::from_i64(DType::I64, vec![1], call.pos.to_vec()),
        Value::from_i64(DType::I64, vec![B], call.ids.to_vec()),
    ];
    let kp = generate(&g).unwrap();
    let got = common::run_program(kp, &w, &ins, false).unwrap();
    let want = call.expected(&g, &w);
    for (got, want) in got.iter().zip(&want) {
        let got: Vec<f32> = got.iter().map(|&v| v as f32).collect();
        assert_close(&got, want);
    }
    // The same through this program's device: the copy runs, the check does not.
    let mut cache_out = vec![0f32; B * S * E];
    let mut out1 = vec![0f32; B * E];
    let ins = [
        call.cache.as_ptr() as u64,
        call.keys.as_ptr() as u64,
        call.pos.as_ptr() as u64,
        call.ids.as_ptr() as u64,
    ];
    let shapes = [vec![B, S, E], vec![B, 1, E], vec![1], vec![B]];
    let outs = [cache_out.as_mut_ptr() as u64, out1.as_mut_ptr() as u64];
    p.run_on_device(&shapes, &ins, &outs, 0).unwrap();
    assert_close(&cache_out, &want[0]);
    let counts = p.device.launch_counts();
    assert_eq!((counts[copy], counts[check]), (1, 0), "{counts:?}");
}

#[test]
fn a_run_failing_on_the_scatters_index_leaves_the_cache_unchanged() {
    let (_, _, p) = program();
    let mut call = Call::new(S as i64, [0, 1]);
    let before = call.cache.clone();
    let err = call.run_in_place(&p).unwrap_err().to_string();
    assert!(
        err.contains("index out of range") && err.contains("index_copy"),
        "{err}"
    );
    assert_eq!(call.cache, before);
}

#[test]
fn a_run_failing_on_a_later_lookup_leaves_the_cache_unchanged() {
    // The lookup runs after the scatter: without the check before the first update, the
    // cache would hold the new keys although the run failed.
    let (_, _, p) = program();
    let mut call = Call::new(2, [0, ROWS as i64]);
    let before = call.cache.clone();
    let err = call.run_in_place(&p).unwrap_err().to_string();
    assert!(
        err.contains("index out of range") && err.contains("lookup"),
        "{err}"
    );
    assert_eq!(call.cache, before);
    // And the next good call updates it.
    let (g, w, _) = program();
    let mut call = Call::new(2, [0, 1]);
    let want = call.expected(&g, &w);
    call.run_in_place(&p).unwrap();
    assert_close(&call.cache, &want[0]);
}

#[test]
fn a_lookup_of_computed_indices_after_the_scatter_keeps_the_copy() {
    // Indices computed from the updated cache cannot be checked before it is written: the
    // program then updates no input in place.
    let (mut g, _) = step_graph();
    let updated = g.outputs[0];
    let arg = g
        .add(
            Op::Reduce {
                op: ReduceOp::ArgMax,
                axes: vec![1],
                keepdim: true,
            },
            &[updated],
            "argmax",
        )
        .unwrap();
    let picked = g
        .add(Op::Gather { axis: 1 }, &[updated, arg], "pick")
        .unwrap();
    g.outputs.push(picked);
    let kp = generate(&g).unwrap();
    assert!(kp.in_place.is_empty());
    assert!(kp.precheck_step.is_none());
}

/// Two caches, as two layers update them: `a[:, pos] = keys` and `b[:, pos + 1] = keys`,
/// where `pos + 1` is also an output (so it lives in memory) and is written only after the
/// first update.
fn two_layer_graph() -> Graph {
    let mut g = Graph::new();
    let a = input(&mut g, 0, DType::F32, &[B, S, E], "cache_a");
    let keys = input(&mut g, 1, DType::F32, &[B, 1, E], "keys");
    let pos = input(&mut g, 2, DType::I64, &[1], "pos");
    let b = input(&mut g, 3, DType::F32, &[B, S, E], "cache_b");
    let shape = |s: &[usize]| s.iter().map(|&d| Dim::from(d)).collect::<Vec<_>>();
    let first = cache_update(&mut g, a, pos, keys, "update_a");
    let one = g
        .add_source(
            Op::Full {
                value: ember_core::dtype::Scalar::Int(1),
            },
            ember_core::ir::TensorType::new(DType::I64, shape(&[1])),
            "one",
        )
        .unwrap();
    let next = g
        .add(Op::Binary(BinaryOp::Add), &[pos, one], "next")
        .unwrap();
    let second = cache_update(&mut g, b, next, keys, "update_b");
    g.outputs = vec![first, second, next];
    g
}

#[test]
fn an_index_written_after_the_first_update_is_recomputed_by_the_check() {
    let g = two_layer_graph();
    let kp = generate(&g).unwrap();
    let pairs: Vec<(usize, usize)> = kp.in_place.iter().map(|p| (p.output, p.input)).collect();
    assert_eq!(pairs, vec![(0, 0), (1, 3)], "{}", kp.source);
    let device = EmulatedDevice::new(&kp).unwrap();
    let p = Program::new(kp, device, &Weights::new()).unwrap();
    let run = |pos: i64, a: &mut Vec<f32>, b: &mut Vec<f32>| -> ember_core::Result<i64> {
        let keys: Vec<f32> = (0..B * E).map(|i| 10.0 + i as f32).collect();
        let pos = [pos];
        let mut next = [0i64];
        let (pa, pb) = (a.as_mut_ptr() as u64, b.as_mut_ptr() as u64);
        let ins = [pa, keys.as_ptr() as u64, pos.as_ptr() as u64, pb];
        let shapes = [vec![B, S, E], vec![B, 1, E], vec![1], vec![B, S, E]];
        p.run_on_device(&shapes, &ins, &[pa, pb, next.as_mut_ptr() as u64], 0)?;
        Ok(next[0])
    };
    let fresh = || (0..B * S * E).map(|i| (i % 5) as f32).collect::<Vec<f32>>();
    let (mut a, mut b) = (fresh(), fresh());
    assert_eq!(run(2, &mut a, &mut b).unwrap(), 3);
    for bi in 0..B {
        for e in 0..E {
            let key = 10.0 + (bi * E + e) as f32;
            assert_eq!(a[(bi * S + 2) * E + e], key);
            assert_eq!(b[(bi * S + 3) * E + e], key);
            assert_eq!(a[(bi * S + 3) * E + e], fresh()[(bi * S + 3) * E + e]);
        }
    }
    // The second layer's position is out of range: neither cache is written.
    let (mut a, mut b) = (fresh(), fresh());
    let err = run(S as i64 - 1, &mut a, &mut b).unwrap_err().to_string();
    assert!(err.contains("update_b"), "{err}");
    assert_eq!((a, b), (fresh(), fresh()));
}
