//! Every kernel template whose threads cooperate (reductions, softmax, norms, prefill and
//! decode attention, cumsum, argsort), launched as the GPU launches it — 256 threads a
//! block, eight warps — on the emulator, against the reference interpreter. The emulator
//! meets a warp's threads at the warp's own barrier, so a kernel that forgets a
//! `__syncthreads` between warps races here as on the GPU; `scripts/emu_sanitize.sh`
//! runs these tests under the thread sanitizer to catch exactly that.

mod common;

use common::{check_against_reference, input, values};
use ember_core::backend::Weights;
use ember_core::dtype::DType;
use ember_core::interp::Value;
use ember_core::ir::{Graph, Op, ReduceOp, ScanOp};
use ember_cuda::codegen::StepKind;

/// Rows several blocks apart, longer than a block (300 > 256 threads).
const ROWS: usize = 3;
const WIDTH: usize = 300;

fn rtol(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-12,
        DType::F32 => 1e-5,
        _ => 1e-2,
    }
}

/// `op(x)` for one input `x` of `shape`.
fn unary_graph(dtype: DType, shape: &[usize], op: Op) -> (Graph, Vec<Value>) {
    let mut g = Graph::new();
    let x = input(&mut g, 0, dtype, shape, "x");
    let y = g.add(op, &[x], "y").unwrap();
    g.outputs = vec![y];
    let n = shape.iter().product();
    (
        g,
        vec![Value::from_f64(dtype, shape.to_vec(), values(n, 1))],
    )
}

fn check_unary(what: &str, dtype: DType, shape: &[usize], op: Op) {
    let (g, x) = unary_graph(dtype, shape, op);
    let what = format!("{what} {dtype} {shape:?}");
    check_against_reference(&what, &g, &Weights::new(), &x, true, rtol(dtype));
}

#[test]
fn reductions_over_the_last_and_a_middle_axis() {
    for dtype in [DType::F32, DType::BF16] {
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::ArgMax] {
            for (shape, axis) in [(vec![ROWS, WIDTH], 1), (vec![4, 70, 5], 1)] {
                let reduce = Op::Reduce {
                    op,
                    axes: vec![axis],
                    keepdim: false,
                };
                check_unary(&format!("{op:?}"), dtype, &shape, reduce);
            }
        }
    }
}

#[test]
fn softmax_and_norms_over_long_rows() {
    for dtype in [DType::F32, DType::BF16] {
        for log in [false, true] {
            let op = Op::Softmax { axis: 1, log };
            check_unary("softmax", dtype, &[ROWS, WIDTH], op);
        }
        let layer_norm = Op::LayerNorm {
            axis: 1,
            eps: 1e-5,
            has_weight: false,
            has_bias: false,
        };
        check_unary("layer norm", dtype, &[ROWS, WIDTH], layer_norm);
        let rms_norm = Op::RmsNorm {
            axis: 1,
            eps: 1e-6,
            has_weight: false,
        };
        check_unary("rms norm", dtype, &[ROWS, WIDTH], rms_norm);
    }
}

#[test]
fn cumsum_and_argsort_of_long_lines() {
    check_unary(
        "cumsum",
        DType::F32,
        &[ROWS, WIDTH],
        Op::Scan {
            axis: 1,
            op: ScanOp::Sum,
        },
    );
    for descending in [false, true] {
        let op = Op::Argsort {
            axis: 1,
            descending,
        };
        check_unary("argsort", DType::F32, &[2, 50], op);
    }
}

/// Attention of `l` query rows over `s` keys, 2 heads of `e` dims.
fn attention(dtype: DType, l: usize, s: usize, e: usize, causal: bool) -> (Graph, Vec<Value>) {
    let heads = 2;
    let mut g = Graph::new();
    let q = input(&mut g, 0, dtype, &[1, heads, l, e], "q");
    let k = input(&mut g, 1, dtype, &[1, heads, s, e], "k");
    let v = input(&mut g, 2, dtype, &[1, heads, s, e], "v");
    let op = Op::Attention {
        scale: 0.25,
        causal,
        has_mask: false,
    };
    let y = g.add(op, &[q, k, v], "attention").unwrap();
    g.outputs = vec![y];
    let value = |rows: usize, seed: usize| {
        let shape = vec![1, heads, rows, e];
        Value::from_f64(dtype, shape, values(heads * rows * e, seed))
    };
    (g, vec![value(l, 2), value(s, 3), value(s, 4)])
}

#[test]
fn prefill_attention_over_several_key_tiles() {
    // 40 query rows (five warps' worth of rows a block) over 40 keys: two 32-key tiles.
    for dtype in [DType::F32, DType::BF16] {
        for causal in [false, true] {
            let (g, x) = attention(dtype, 40, 40, 16, causal);
            let kp = ember_cuda::codegen::generate(&g).unwrap();
            assert!(
                kp.source.contains("ks["),
                "not the tiled kernel:\n{}",
                kp.source
            );
            let what = format!("prefill attention {dtype} causal={causal}");
            check_against_reference(&what, &g, &Weights::new(), &x, true, rtol(dtype));
        }
    }
}

#[test]
fn decode_attention_split_over_a_long_cache() {
    // One query row over 300 keys: three 128-key chunks, the last of each row's blocks to
    // finish combining them.
    for dtype in [DType::F32, DType::BF16] {
        let (g, x) = attention(dtype, 1, 300, 16, false);
        let kp = ember_cuda::codegen::generate(&g).unwrap();
        let split = matches!(
            kp.steps.as_slice(),
            [st] if matches!(st.kind, StepKind::Kernel { partials: Some(_), .. })
        );
        assert!(split, "not split over the keys: {:?}", kp.steps);
        let what = format!("decode attention {dtype}");
        check_against_reference(&what, &g, &Weights::new(), &x, true, rtol(dtype));
    }
}

#[test]
fn attention_a_block_per_row_when_the_tiled_kernel_does_not_apply() {
    // f64 (the tiled kernel accumulates in f32) and heads wider than 128 take the generic
    // kernel: a block per query row, values summed by groups of threads.
    for (dtype, e) in [(DType::F64, 16), (DType::F32, 160)] {
        for causal in [false, true] {
            let (g, x) = attention(dtype, 9, 40, e, causal);
            let kp = ember_cuda::codegen::generate(&g).unwrap();
            assert!(
                !kp.source.contains("ks["),
                "the tiled kernel:\n{}",
                kp.source
            );
            let what = format!("generic attention {dtype} e={e} causal={causal}");
            check_against_reference(&what, &g, &Weights::new(), &x, true, rtol(dtype));
        }
    }
}
