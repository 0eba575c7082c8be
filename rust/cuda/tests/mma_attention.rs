//! The tensor-core prefill attention kernel (`cuda.mma_attention`) on the emulator, whose
//! `mma` follows the PTX ISA's fragment layout, against the reference interpreter: query
//! counts that leave a warp's 16 rows part empty, key counts that leave a 32-key tile part
//! empty, every head dim the fragments allow, causal limits, boolean and additive masks,
//! rows with every key masked, and the GPU's launch sizes (eight warps a block).

mod common;

use common::{check, input, run_program, values};
use ember_core::backend::Weights;
use ember_core::dtype::DType;
use ember_core::interp::{self, Value};
use ember_core::ir::{Graph, Op};
use ember_cuda::codegen::{generate, KERNEL_MMA_ATTENTION};

const HEADS: usize = 2;

#[derive(Clone, Copy)]
enum Mask {
    None,
    /// Key `j` visible to row `i` unless `(i + 2j) % 5 == 0`; row 0 sees no key.
    Bool,
    /// An additive bias in [-0.875, 0.875].
    Float,
}

/// Attention of `l` query rows over `s` keys: heads of `e` dims, values of `ev`.
fn attention(
    dtype: DType,
    (l, s, e, ev): (usize, usize, usize, usize),
    causal: bool,
    mask: Mask,
) -> (Graph, Vec<Value>) {
    let mut g = Graph::new();
    let q = input(&mut g, 0, dtype, &[1, HEADS, l, e], "q");
    let k = input(&mut g, 1, dtype, &[1, HEADS, s, e], "k");
    let v = input(&mut g, 2, dtype, &[1, HEADS, s, ev], "v");
    let mut inputs = vec![q, k, v];
    let value = |dt: DType, shape: Vec<usize>, seed: usize| {
        let n = shape.iter().product();
        Value::from_f64(dt, shape, values(n, seed))
    };
    let mut xs = vec![
        value(dtype, vec![1, HEADS, l, e], 2),
        value(dtype, vec![1, HEADS, s, e], 3),
        value(dtype, vec![1, HEADS, s, ev], 4),
    ];
    let mask_shape = vec![1, HEADS, l, s];
    match mask {
        Mask::None => {}
        Mask::Bool => {
            inputs.push(input(&mut g, 3, DType::Bool, &mask_shape, "mask"));
            let visible = (0..HEADS * l * s)
                .map(|n| {
                    let (i, j) = (n / s % l, n % s);
                    if i != 0 && (i + 2 * j) % 5 != 0 {
                        1.0
                    } else {
                        0.0
                    }
                })
                .collect();
            xs.push(Value::from_f64(DType::Bool, mask_shape, visible));
        }
        Mask::Float => {
            inputs.push(input(&mut g, 3, dtype, &mask_shape, "bias"));
            xs.push(value(dtype, mask_shape, 5));
        }
    }
    let op = Op::Attention {
        scale: 1.0 / (e as f64).sqrt(),
        causal,
        has_mask: !matches!(mask, Mask::None),
    };
    let y = g.add(op, &inputs, "attention").unwrap();
    g.outputs = vec![y];
    (g, xs)
}

fn run(what: &str, g: &Graph, xs: &[Value], gpu_launches: bool) {
    let chosen = ember_cuda::with_choice(g, KERNEL_MMA_ATTENTION).unwrap();
    let kp = generate(&chosen).unwrap();
    assert!(
        kp.source.contains("ember_mma_"),
        "{what}: not the tensor-core kernel:\n{}",
        kp.source
    );
    let got = run_program(kp, &Weights::new(), xs, gpu_launches)
        .unwrap()
        .remove(0);
    let want = interp::run(g, &Weights::new(), xs).unwrap().remove(0);
    // Probabilities are rounded to the operands' type before the values' product.
    check(what, &got, &want.to_f64_vec(), 1e-2);
}

#[test]
fn every_head_dim_and_partial_tiles() {
    // (query rows, keys, head dim, value dim): 40 rows are two full warps' 16 and half a
    // third; 70 keys two full tiles and part of a third.
    for dims in [
        (40, 40, 16, 16),
        (21, 70, 32, 24),
        (17, 33, 64, 8),
        (5, 9, 128, 128),
    ] {
        for dtype in [DType::BF16, DType::F16] {
            let (g, xs) = attention(dtype, dims, false, Mask::None);
            run(&format!("{dtype} {dims:?}"), &g, &xs, false);
        }
    }
}

#[test]
fn causal_limits_and_masks() {
    for causal in [false, true] {
        for mask in [Mask::None, Mask::Bool, Mask::Float] {
            // More keys than rows: a causal row still sees only keys up to its own index.
            for dims in [(36, 36, 32, 32), (20, 45, 16, 16)] {
                let (g, xs) = attention(DType::BF16, dims, causal, mask);
                let what = format!("{dims:?} causal={causal} mask={}", mask as u8);
                run(&what, &g, &xs, false);
            }
        }
    }
}

#[test]
fn at_the_gpus_launch_sizes() {
    // Eight warps a block: 150 rows are one full block of 128 and part of a second; the
    // causal limit lets warps skip tiles after their last row.
    for causal in [false, true] {
        let (g, xs) = attention(DType::F16, (150, 150, 32, 32), causal, Mask::None);
        run(&format!("gpu launches causal={causal}"), &g, &xs, true);
    }
}

#[test]
fn a_decode_step_keeps_split_attention() {
    // One query row a head: the choice leaves it to the split kernel.
    let (g, _) = attention(DType::BF16, (1, 300, 64, 64), false, Mask::None);
    let chosen = ember_cuda::with_choice(&g, KERNEL_MMA_ATTENTION).unwrap();
    let kp = generate(&chosen).unwrap();
    assert!(!kp.source.contains("ember_mma_"), "{}", kp.source);
    assert_eq!(kp.kernels.len(), 1, "split attention's one kernel");
    assert!(kp.source.contains("ember_arrive("), "{}", kp.source);
}
