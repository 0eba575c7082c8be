//! The generated matrix-product kernels the optimizer may choose instead of cuBLASLt
//! (`cuda.warp_dot`, `cuda.thread_dot`), run on the host emulator against the reference
//! interpreter: a decode step's row times a transposed weight, several rows times a plain
//! operand, batched products; every dtype cuBLASLt takes; sums whose length is no multiple
//! of a warp, and output counts that leave warps of a block idle.

mod common;

use common::{dims, input, run_program, values};
use ember_core::backend::Weights;
use ember_core::dtype::DType;
use ember_core::interp::{self, Value};
use ember_core::ir::{BinaryOp, Graph, Op, TensorType, UnaryOp};
use ember_core::tensor::HostTensor;
use ember_cuda::codegen::{generate, Dest, KERNEL_THREAD_DOT, KERNEL_WARP_DOT};

const DTYPES: [DType; 4] = [DType::F32, DType::BF16, DType::F16, DType::F64];

/// A `[n, k]` weight `name` (test values from `seed`, registered in `weights`), as the
/// `[k, n]` transpose a linear layer multiplies by.
fn weight_t(
    g: &mut Graph,
    weights: &mut Weights,
    name: &str,
    dtype: DType,
    (n, k): (usize, usize),
    seed: usize,
) -> usize {
    let ty = TensorType::new(dtype, dims(&[n, k]));
    let w = g
        .add_source(Op::Weight { name: name.into() }, ty, name)
        .unwrap();
    let wv = Value::from_f64(dtype, vec![n, k], values(n * k, seed));
    let bytes = HostTensor::owned(dtype, vec![n, k], wv.to_bytes()).unwrap();
    weights.insert(name.into(), bytes);
    g.add(Op::Permute { perm: vec![1, 0] }, &[w], name).unwrap()
}

/// `x @ wᵀ` with `w` a `[n, k]` weight (a linear layer; a decode step when `m` is 1).
fn linear(dtype: DType, m: usize, k: usize, n: usize) -> (Graph, Weights, Vec<Value>) {
    let mut g = Graph::new();
    let mut weights = Weights::new();
    let x = input(&mut g, 0, dtype, &[m, k], "x");
    let wt = weight_t(&mut g, &mut weights, "w", dtype, (n, k), 1);
    let y = g.add(Op::Dot, &[x, wt], "proj").unwrap();
    g.outputs = vec![y];
    let xv = Value::from_f64(dtype, vec![m, k], values(m * k, 2));
    (g, weights, vec![xv])
}

/// `a @ b` of two inputs `[.., m, k]` and `[.., k, n]`.
fn product(dtype: DType, batch: &[usize], m: usize, k: usize, n: usize) -> (Graph, Vec<Value>) {
    let mut g = Graph::new();
    let shape = |rows, cols| [batch, &[rows, cols]].concat();
    let (sa, sb) = (shape(m, k), shape(k, n));
    let a = input(&mut g, 0, dtype, &sa, "a");
    let b = input(&mut g, 1, dtype, &sb, "b");
    let y = g.add(Op::Dot, &[a, b], "mm").unwrap();
    g.outputs = vec![y];
    let av = Value::from_f64(dtype, sa.clone(), values(sa.iter().product(), 3));
    let bv = Value::from_f64(dtype, sb.clone(), values(sb.iter().product(), 4));
    (g, vec![av, bv])
}

/// Runs `graph` with `kernel` chosen for its products on the emulator; its first output.
fn run_choice(
    graph: &Graph,
    weights: &Weights,
    inputs: &[Value],
    kernel: &str,
    gpu_launches: bool,
) -> Vec<f64> {
    run_choice_all(graph, weights, inputs, kernel, gpu_launches).remove(0)
}

/// Runs `graph` with `kernel` chosen for its products on the emulator; every output.
fn run_choice_all(
    graph: &Graph,
    weights: &Weights,
    inputs: &[Value],
    kernel: &str,
    gpu_launches: bool,
) -> Vec<Vec<f64>> {
    let chosen = ember_cuda::with_choice(graph, kernel).unwrap();
    let kp = generate(&chosen).unwrap();
    assert!(
        kp.steps
            .iter()
            .all(|s| !matches!(s.kind, ember_cuda::codegen::StepKind::Gemm(_))),
        "{kernel}: no product is left to cuBLASLt"
    );
    run_program(kp, weights, inputs, gpu_launches).unwrap()
}

fn check(what: &str, got: &[f64], want: &Value) {
    let rtol = match want.dtype {
        DType::F64 => 1e-12,
        DType::F32 => 1e-5,
        // The kernel rounds once from an f32 sum; the interpreter's sum is exact.
        _ => 1e-2,
    };
    common::check(what, got, &want.to_f64_vec(), rtol);
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

/// `silu(x @ wgᵀ) * (x @ wuᵀ) + r`: a gated MLP's products and the residual add after
/// its down projection, in one pointwise chain; with `rows`, the products are reshaped to
/// `[1, m, n]` before it (as a decode step's `[1, 1, d]` activations are).
fn gated(dtype: DType, m: usize, k: usize, n: usize, rows: bool) -> (Graph, Weights, Vec<Value>) {
    let out_shape = if rows { vec![1, m, n] } else { vec![m, n] };
    let mut g = Graph::new();
    let mut weights = Weights::new();
    let x = input(&mut g, 0, dtype, &[m, k], "x");
    let r = input(&mut g, 1, dtype, &out_shape, "r");
    let mut proj = |g: &mut Graph, name: &str, seed: usize| {
        let wt = weight_t(g, &mut weights, name, dtype, (n, k), seed);
        let p = g.add(Op::Dot, &[x, wt], name).unwrap();
        let shape = dims(&out_shape);
        match rows {
            true => g.add(Op::Reshape { shape }, &[p], name).unwrap(),
            false => p,
        }
    };
    let gate = proj(&mut g, "gate", 5);
    let up = proj(&mut g, "up", 6);
    let act = g.add(Op::Unary(UnaryOp::Silu), &[gate], "silu").unwrap();
    let h = g.add(Op::Binary(BinaryOp::Mul), &[act, up], "mul").unwrap();
    let y = g
        .add(Op::Binary(BinaryOp::Add), &[h, r], "residual")
        .unwrap();
    g.outputs = vec![y];
    let xv = Value::from_f64(dtype, vec![m, k], values(m * k, 2));
    let rv = Value::from_f64(dtype, out_shape.clone(), values(m * n, 7));
    (g, weights, vec![xv, rv])
}

#[test]
fn products_apply_the_pointwise_chain_that_consumes_them() {
    for kernel in [KERNEL_WARP_DOT, KERNEL_THREAD_DOT] {
        for dtype in DTYPES {
            for (m, rows) in [(1, true), (3, false), (3, true)] {
                let (g, w, x) = gated(dtype, m, 70, 45, rows);
                // One kernel sums `gate` and `up` and writes `silu(gate) * up + r`.
                let kp = generate(&ember_cuda::with_choice(&g, kernel).unwrap()).unwrap();
                assert_eq!(kp.steps.len(), 1, "{kernel} {dtype}: {:?}", kp.steps);
                assert!(
                    matches!(kp.steps[0].dest, Dest::Output(0)),
                    "{kernel} {dtype}: the fused products write the output"
                );
                let want = interp::run(&g, &w, &x).unwrap().remove(0);
                let got = run_choice(&g, &w, &x, kernel, kernel == KERNEL_WARP_DOT);
                check(&format!("{kernel} {dtype} gated m={m} {rows}"), &got, &want);
            }
        }
    }
}

#[test]
fn a_product_that_is_itself_an_output_keeps_its_value() {
    // `y = x @ wᵀ` is returned and also feeds `relu(y)`: no fusion may drop `y`.
    let (mut g, w, x) = linear(DType::F32, 2, 40, 9);
    let y = g.outputs[0];
    let z = g.add(Op::Unary(UnaryOp::Relu), &[y], "relu").unwrap();
    g.outputs = vec![y, z];
    let want = interp::run(&g, &w, &x).unwrap();
    let kp = generate(&ember_cuda::with_choice(&g, KERNEL_WARP_DOT).unwrap()).unwrap();
    assert_eq!(kp.steps.len(), 2, "{:?}", kp.steps);
    let got = run_choice_all(&g, &w, &x, KERNEL_WARP_DOT, false);
    check("the product output", &got[0], &want[0]);
    check("its relu", &got[1], &want[1]);
}

#[test]
fn the_warp_kernel_sums_packed_rows_when_they_are_aligned() {
    // 264 terms: 33 packs of 8 bf16 (66 of 4 f32) — a full warp's stride and one more.
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for m in [1, 2] {
            let (g, w, x) = linear(dtype, m, 264, 37);
            let kp = generate(&ember_cuda::with_choice(&g, KERNEL_WARP_DOT).unwrap()).unwrap();
            assert!(
                kp.source.contains("ember_pack_dot_"),
                "{dtype}: no packed path"
            );
            let want = interp::run(&g, &w, &x).unwrap().remove(0);
            let got = run_choice(&g, &w, &x, KERNEL_WARP_DOT, true);
            check(&format!("{dtype} packed m={m}"), &got, &want);
        }
        // A gated chain on packed rows: the epilogue reads the same element either way.
        let (g, w, x) = gated(dtype, 1, 128, 19, true);
        let want = interp::run(&g, &w, &x).unwrap().remove(0);
        let got = run_choice(&g, &w, &x, KERNEL_WARP_DOT, true);
        check(&format!("{dtype} packed gated"), &got, &want);
    }
}

/// A decode step's gated MLP with its residual: `r + down(silu(gate(x)) * up(x))`, each
/// product on `[1, d]` rows reshaped to `[1, 1, d]` (as exported llama blocks are).
fn mlp_block(dtype: DType, d: usize, hidden: usize) -> (Graph, Weights, Vec<Value>) {
    let mut g = Graph::new();
    let mut weights = Weights::new();
    let x = input(&mut g, 0, dtype, &[1, 1, d], "x");
    let mut linear = |g: &mut Graph, name: &str, v: usize, (n, k): (usize, usize), seed| {
        let wt = weight_t(g, &mut weights, name, dtype, (n, k), seed);
        let shape = dims(&[1, k]);
        let rows = g.add(Op::Reshape { shape }, &[v], name).unwrap();
        let p = g.add(Op::Dot, &[rows, wt], name).unwrap();
        let shape = dims(&[1, 1, n]);
        g.add(Op::Reshape { shape }, &[p], name).unwrap()
    };
    let gate = linear(&mut g, "gate", x, (hidden, d), 5);
    let up = linear(&mut g, "up", x, (hidden, d), 6);
    let act = g.add(Op::Unary(UnaryOp::Silu), &[gate], "silu").unwrap();
    let h = g.add(Op::Binary(BinaryOp::Mul), &[act, up], "mul").unwrap();
    let down = linear(&mut g, "down", h, (d, hidden), 8);
    let y = g
        .add(Op::Binary(BinaryOp::Add), &[x, down], "residual")
        .unwrap();
    g.outputs = vec![y];
    let xv = Value::from_f64(dtype, vec![1, 1, d], values(d, 2));
    (g, weights, vec![xv])
}

#[test]
fn a_gated_mlp_takes_two_product_kernels_and_no_other() {
    for kernel in [KERNEL_WARP_DOT, KERNEL_THREAD_DOT] {
        for dtype in [DType::BF16, DType::F32] {
            let (g, w, x) = mlp_block(dtype, 64, 96);
            // `gate` and `up` summed together, writing `silu(gate) * up` (the activation
            // the down product reads from memory, not recomputed per term); `down` writing
            // the residual sum.
            let kp = generate(&ember_cuda::with_choice(&g, kernel).unwrap()).unwrap();
            assert_eq!(kp.steps.len(), 2, "{kernel} {dtype}: {:?}", kp.steps);
            if kernel == KERNEL_WARP_DOT {
                assert_eq!(kp.source.matches("ember_pack_dot_").count(), 3, "{dtype}");
            }
            let want = interp::run(&g, &w, &x).unwrap().remove(0);
            let got = run_choice(&g, &w, &x, kernel, true);
            check(&format!("{kernel} {dtype} mlp block"), &got, &want);
        }
    }
}

#[test]
fn a_permute_that_keeps_the_order_is_read_in_place() {
    // Decode attention's output `[1, H, 1, E]` → `[1, 1, H, E]` → `[1, H·E]` rows: the
    // same bytes, so the product reads the input itself (no copy step, packed loads).
    let dtype = DType::BF16;
    let mut g = Graph::new();
    let mut weights = Weights::new();
    let heads = input(&mut g, 0, dtype, &[1, 4, 1, 8], "attn");
    let wt = weight_t(&mut g, &mut weights, "w", dtype, (24, 32), 1);
    let perm = vec![0, 2, 1, 3];
    let p = g.add(Op::Permute { perm }, &[heads], "perm").unwrap();
    let shape = dims(&[1, 32]);
    let rows = g.add(Op::Reshape { shape }, &[p], "rows").unwrap();
    let y = g.add(Op::Dot, &[rows, wt], "o_proj").unwrap();
    g.outputs = vec![y];
    let xv = Value::from_f64(dtype, vec![1, 4, 1, 8], values(32, 9));
    let want = interp::run(&g, &weights, std::slice::from_ref(&xv))
        .unwrap()
        .remove(0);
    for kernel in [KERNEL_WARP_DOT, KERNEL_THREAD_DOT] {
        let kp = generate(&ember_cuda::with_choice(&g, kernel).unwrap()).unwrap();
        assert_eq!(kp.steps.len(), 1, "{kernel}: {:?}", kp.steps);
        if kernel == KERNEL_WARP_DOT {
            assert!(kp.source.contains("ember_pack_dot_bf16"), "{kernel}");
        }
        let got = run_choice(&g, &weights, std::slice::from_ref(&xv), kernel, true);
        check(&format!("{kernel} permuted rows"), &got, &want);
    }
    // cuBLASLt reads the input in place too.
    let kp = generate(&g).unwrap();
    assert_eq!(kp.steps.len(), 1, "gemm: {:?}", kp.steps);
}

/// `x·wqᵀ`, `x·wkᵀ`, `x·wvᵀ` of one `[m, k]` input, each returned: a decode step's
/// attention projections (widths `n`, `n/2`, `n/2 + 3`).
fn projections(dtype: DType, m: usize, k: usize, n: usize) -> (Graph, Weights, Vec<Value>) {
    let mut g = Graph::new();
    let mut weights = Weights::new();
    let x = input(&mut g, 0, dtype, &[m, k], "x");
    let mut outs = Vec::new();
    for (j, width) in [n, n / 2, n / 2 + 3].into_iter().enumerate() {
        let name = format!("w{j}");
        let wt = weight_t(&mut g, &mut weights, &name, dtype, (width, k), 10 + j);
        // Each projection reads its own reshape of x, as exported programs do.
        let shape = dims(&[m, k]);
        let xr = g.add(Op::Reshape { shape }, &[x], &name).unwrap();
        outs.push(g.add(Op::Dot, &[xr, wt], &name).unwrap());
    }
    g.outputs = outs;
    let xv = Value::from_f64(dtype, vec![m, k], values(m * k, 2));
    (g, weights, vec![xv])
}

#[test]
fn products_of_one_input_share_one_launch() {
    for dtype in [DType::BF16, DType::F32, DType::F64] {
        // 64 terms: packed for bf16/f32 (f64 has no pack); 70: the generic path.
        for k in [64, 70] {
            for m in [1, 2] {
                let (g, w, x) = projections(dtype, m, k, 20);
                let kp = generate(&ember_cuda::with_choice(&g, KERNEL_WARP_DOT).unwrap()).unwrap();
                assert_eq!(kp.steps.len(), 1, "{dtype} k={k}: {:?}", kp.steps);
                assert_eq!(kp.steps[0].also.len(), 2, "{:?}", kp.steps[0]);
                let want = interp::run(&g, &w, &x).unwrap();
                for gpu in [false, true] {
                    let got = run_choice_all(&g, &w, &x, KERNEL_WARP_DOT, gpu);
                    for (j, (got, want)) in got.iter().zip(&want).enumerate() {
                        check(&format!("{dtype} k={k} m={m} gpu={gpu} out {j}"), got, want);
                    }
                }
            }
        }
    }
}

/// Products on the warp kernel pay together (those of one row share a launch and compute
/// the norm before them), which no single change shows: the search offers each generated
/// kernel at every product at once, among its first candidates (with a hundred products,
/// each single change is within noise and combining the winners never gets there).
#[test]
fn the_search_offers_each_product_kernel_at_every_product_at_once() {
    use ember_core::backend::Backend;
    use ember_core::egraph::{saturate, Budget};
    use ember_core::extract::{DefaultCost, Extractor};
    use ember_core::search::candidates_preferring;

    let dtype = DType::F32;
    let mut g = Graph::new();
    let mut weights = Weights::new();
    let x = input(&mut g, 0, dtype, &[1, 64], "x");
    // A decode layer's q, k and v: one row times three weights.
    for (j, n) in [48, 16, 16].into_iter().enumerate() {
        let wt = weight_t(
            &mut g,
            &mut weights,
            &format!("w{j}"),
            dtype,
            (n, 64),
            j + 1,
        );
        let y = g.add(Op::Dot, &[x, wt], "proj").unwrap();
        g.outputs.push(y);
    }
    let xv = Value::from_f64(dtype, vec![1, 64], values(64, 9));
    let want = interp::run(&g, &weights, std::slice::from_ref(&xv)).unwrap();

    let backend = ember_cuda::EmulatedCudaBackend::default();
    let (data, _) = saturate(&g, &backend.lowering_rules(), &Budget::default()).unwrap();
    let sizes = DefaultCost {
        sizes: Default::default(),
    };
    let ex = Extractor::new(&data, &g, &sizes);
    // In the order of the backend's rules: the warp kernel (the likelier winner) first.
    let kernels: Vec<&str> = backend
        .lowering_rules()
        .iter()
        .map(|r| r.kernel())
        .collect();
    let cands = candidates_preferring(&ex, &g, 8, &kernels);
    let names: Vec<&str> = cands.iter().map(|c| c.description.as_str()).collect();
    let mut last = 0;
    for kernel in [KERNEL_WARP_DOT, KERNEL_THREAD_DOT] {
        let on_kernel = |c: &ember_core::extract::Candidate| {
            let nodes = &c.graph.nodes;
            let dots = nodes
                .iter()
                .filter(|n| matches!(n.op.base(), Op::Dot))
                .count();
            let taken = nodes
                .iter()
                .filter(|n| matches!(&n.op, Op::Kernel { name, .. } if name == kernel))
                .count();
            dots == 3 && taken == 3
        };
        let at = cands
            .iter()
            .position(on_kernel)
            .unwrap_or_else(|| panic!("no candidate with every product on {kernel}: {names:?}"));
        // The default, the merged products, then one candidate per kernel.
        assert!(at <= 3, "{kernel} everywhere is candidate {at}: {names:?}");
        assert!(
            at > last,
            "{kernel} everywhere is not in the rules' order: {names:?}"
        );
        last = at;
        let kp = generate(&cands[at].graph).unwrap();
        let got = run_program(kp, &weights, std::slice::from_ref(&xv), false).unwrap();
        for (k, (got, want)) in got.iter().zip(&want).enumerate() {
            check(&format!("{kernel} everywhere, output {k}"), got, want);
        }
    }
}
