//! What the CUDA code generator decides, checked without a GPU: which nodes get memory,
//! which steps run, what the kernels read. (What the kernels compute is checked by the
//! Python op tests on the emulator, and their CUDA dialect by the `nvrtc` tests.)

use ember_core::dim::Dim;
use ember_core::dtype::DType;
use ember_core::ir::{BinaryOp, Graph, Op, TensorType, UnaryOp, ValueId};
use ember_cuda::codegen::{generate, Mem, StepKind};

fn input(g: &mut Graph, index: usize, dtype: DType, shape: Vec<Dim>) -> ValueId {
    g.add_source(
        Op::Input { index },
        TensorType::new(dtype, shape),
        &format!("in{index}"),
    )
    .unwrap()
}

fn dims(shape: &[usize]) -> Vec<Dim> {
    shape.iter().map(|&d| Dim::from(d)).collect()
}

fn weight(g: &mut Graph, name: &str, shape: &[usize]) -> ValueId {
    g.add_source(
        Op::Weight { name: name.into() },
        TensorType::new(DType::F32, dims(shape)),
        name,
    )
    .unwrap()
}

/// `h · wᵀ + b` for `h: [rows, k]`, `w: [n, k]`, as frontends translate `linear`: the
/// nodes the tests look at.
struct Linear {
    w: ValueId,
    b: ValueId,
    wt: ValueId,
    product: ValueId,
    broadcast_bias: ValueId,
    out: ValueId,
}

fn linear_with_bias(g: &mut Graph, h: ValueId, rows: usize, (n, k): (usize, usize)) -> Linear {
    let w = weight(g, "w", &[n, k]);
    let b = weight(g, "b", &[n]);
    let wt = g.add(Op::Permute { perm: vec![1, 0] }, &[w], "t").unwrap();
    let product = g.add(Op::Dot, &[h, wt], "mm").unwrap();
    let shape = dims(&[1, n]);
    let b1 = g.add(Op::Reshape { shape }, &[b], "b1").unwrap();
    let shape = dims(&[rows, n]);
    let broadcast_bias = g.add(Op::Expand { shape }, &[b1], "bb").unwrap();
    let add = Op::Binary(BinaryOp::Add);
    let out = g.add(add, &[product, broadcast_bias], "add").unwrap();
    Linear {
        w,
        b,
        wt,
        product,
        broadcast_bias,
        out,
    }
}

#[test]
fn linear_layer_is_one_gemm_reading_the_weight_transposed_with_the_bias_in_its_epilogue() {
    let mut g = Graph::new();
    let x = input(&mut g, 0, DType::F32, dims(&[4, 8]));
    let Linear {
        w,
        b,
        wt,
        product: y,
        broadcast_bias: bb,
        out,
    } = linear_with_bias(&mut g, x, 4, (16, 8));
    g.outputs = vec![out];
    let kp = generate(&g).unwrap();
    assert_eq!(kp.steps.len(), 1, "{:?}", kp.steps);
    let StepKind::Gemm(gm) = &kp.steps[0].kind else {
        panic!("first step is not a gemm: {:?}", kp.steps[0]);
    };
    assert_eq!((gm.a, gm.b, gm.trans_a, gm.trans_b), (x, w, false, true));
    assert_eq!(
        gm.bias,
        Some(b),
        "the bias is added as the product is written"
    );
    assert_eq!(kp.steps[0].node, out);
    assert_eq!(kp.mem[y], Mem::Inline, "the bare product needs no memory");
    assert_eq!(
        kp.mem[wt],
        Mem::Inline,
        "the transpose is never materialized"
    );
    assert_eq!(
        kp.mem[bb],
        Mem::Inline,
        "the broadcast bias is read in place"
    );
    assert!(kp.kernels.is_empty());
}

#[test]
fn a_bias_the_caller_passes_is_added_by_a_kernel_not_the_epilogue() {
    // cuBLASLt's bias epilogue needs a 16-byte aligned vector; a caller's tensor may start
    // anywhere (`b[1:]`), so only weights and arena values are folded.
    let mut g = Graph::new();
    let x = input(&mut g, 0, DType::F32, dims(&[4, 8]));
    let b = input(&mut g, 1, DType::F32, dims(&[16]));
    let w = weight(&mut g, "w", &[8, 16]);
    let product = g.add(Op::Dot, &[x, w], "mm").unwrap();
    let b1 = g
        .add(
            Op::Reshape {
                shape: dims(&[1, 16]),
            },
            &[b],
            "b1",
        )
        .unwrap();
    let bb = g
        .add(
            Op::Expand {
                shape: dims(&[4, 16]),
            },
            &[b1],
            "bb",
        )
        .unwrap();
    let out = g
        .add(Op::Binary(BinaryOp::Add), &[product, bb], "add")
        .unwrap();
    g.outputs = vec![out];
    let kp = generate(&g).unwrap();
    let StepKind::Gemm(gm) = &kp.steps[0].kind else {
        panic!("first step is not a gemm: {:?}", kp.steps[0]);
    };
    assert_eq!(gm.bias, None);
    assert_eq!(
        kp.steps.len(),
        2,
        "the add is a kernel of its own: {:?}",
        kp.steps
    );
}

#[test]
fn views_and_elementwise_chains_fuse_into_one_kernel_without_copies() {
    let mut g = Graph::new();
    let x = input(&mut g, 0, DType::F32, dims(&[2, 3, 4]));
    let p = g
        .add(
            Op::Permute {
                perm: vec![2, 0, 1],
            },
            &[x],
            "p",
        )
        .unwrap();
    let r = g
        .add(
            Op::Reshape {
                shape: dims(&[4, 6]),
            },
            &[p],
            "r",
        )
        .unwrap();
    let e = g.add(Op::Unary(UnaryOp::Exp), &[r], "e").unwrap();
    let t = g.add(Op::Unary(UnaryOp::Tanh), &[e], "t").unwrap();
    g.outputs = vec![t];
    let kp = generate(&g).unwrap();
    assert_eq!(kp.steps.len(), 1);
    assert_eq!(kp.kernels.len(), 1);
    for n in [p, r, e] {
        assert_eq!(kp.mem[n], Mem::Inline);
    }
    assert!(kp.source.contains("ember_exp(") && kp.source.contains("ember_tanh("));
}

#[test]
fn shared_intermediates_are_materialized_once() {
    let mut g = Graph::new();
    let x = input(&mut g, 0, DType::F32, dims(&[8]));
    let e = g.add(Op::Unary(UnaryOp::Exp), &[x], "e").unwrap();
    let a = g.add(Op::Unary(UnaryOp::Sin), &[e], "a").unwrap();
    let b = g.add(Op::Unary(UnaryOp::Cos), &[e], "b").unwrap();
    g.outputs = vec![a, b];
    let kp = generate(&g).unwrap();
    assert_eq!(kp.mem[e], Mem::Buffer);
    // `e`, then `a` and `b` from it in one launch.
    assert_eq!(kp.steps.len(), 2, "{:?}", kp.steps);
    assert_eq!(kp.steps[1].also.len(), 1, "{:?}", kp.steps);
}

#[test]
fn independent_elementwise_kernels_of_one_shape_share_a_launch() {
    // k and v cache updates: concat(cache, new) twice, from values computed before both.
    let mut g = Graph::new();
    let kc = input(&mut g, 0, DType::F32, dims(&[2, 5, 4]));
    let vc = input(&mut g, 1, DType::F32, dims(&[2, 5, 4]));
    let kn = input(&mut g, 2, DType::F32, dims(&[2, 1, 4]));
    let vn = input(&mut g, 3, DType::BF16, dims(&[2, 1, 4]));
    let kr = g.add(Op::Unary(UnaryOp::Neg), &[kn], "rotate").unwrap();
    let vf = g.add(Op::Cast { to: DType::F32 }, &[vn], "widen").unwrap();
    let k = g.add(Op::Concat { axis: 1 }, &[kc, kr], "k").unwrap();
    let v = g.add(Op::Concat { axis: 1 }, &[vc, vf], "v").unwrap();
    // And one that reads the first: it must come after it, in a launch of its own.
    let kk = g.add(Op::Binary(BinaryOp::Mul), &[k, k], "kk").unwrap();
    g.outputs = vec![k, v, kk];
    let kp = generate(&g).unwrap();
    assert_eq!(kp.steps.len(), 2, "{:?}", kp.steps);
    assert_eq!(kp.steps[0].node, k);
    assert_eq!(kp.steps[0].also.len(), 1, "{:?}", kp.steps);
    assert_eq!(kp.steps[0].also[0].0, v);
    assert_eq!(kp.steps[1].node, kk);
}

#[test]
fn symbolic_dims_are_read_from_meta_so_kernels_do_not_depend_on_sizes() {
    let mut g = Graph::new();
    let s = Dim::sym("s0");
    let x = input(&mut g, 0, DType::F32, vec![s.clone(), Dim::from(32usize)]);
    let y = g
        .add(
            Op::Softmax {
                axis: 1,
                log: false,
            },
            &[x],
            "softmax",
        )
        .unwrap();
    g.outputs = vec![y];
    let kp = generate(&g).unwrap();
    assert_eq!(kp.symbols.len(), 1);
    assert!(kp.source.contains("meta[1]"), "{}", kp.source);
    assert!(kp.kernels[0].cooperative);
}

#[test]
fn identical_kernels_are_generated_once() {
    let mut g = Graph::new();
    let x = input(&mut g, 0, DType::F32, dims(&[16]));
    // b reads a, so the two are separate launches of one kernel text.
    let a = g.add(Op::Unary(UnaryOp::Relu), &[x], "a").unwrap();
    let b = g.add(Op::Unary(UnaryOp::Relu), &[a], "b").unwrap();
    g.outputs = vec![a, b];
    let kp = generate(&g).unwrap();
    assert_eq!(kp.steps.len(), 2);
    assert_eq!(kp.kernels.len(), 1);
}

#[test]
fn another_backends_kernel_choice_is_refused_naming_the_node() {
    let mut g = Graph::new();
    let x = input(&mut g, 0, DType::F32, dims(&[2, 3]));
    let y = input(&mut g, 1, DType::F32, dims(&[3, 2]));
    let d = g
        .add(
            Op::Kernel {
                name: "cpu.rowwise".into(),
                base: Box::new(Op::Dot),
            },
            &[x, y],
            "mm",
        )
        .unwrap();
    g.outputs = vec![d];
    let err = ember_core::Error::from(generate(&g).err().expect("refused"));
    let msg = err.to_string();
    assert!(msg.contains("cpu.rowwise") && msg.contains("'mm'"), "{msg}");
}

#[test]
fn one_query_row_per_head_splits_attention_over_the_keys_in_one_step() {
    let s = Dim::sym("s0");
    let mut g = Graph::new();
    let q = input(&mut g, 0, DType::F32, dims(&[1, 4, 1, 16]));
    let kv_shape = vec![
        Dim::from(1usize),
        Dim::from(4usize),
        s.clone(),
        Dim::from(16usize),
    ];
    let k = input(&mut g, 1, DType::F32, kv_shape.clone());
    let v = input(&mut g, 2, DType::F32, kv_shape);
    let attention = Op::Attention {
        scale: 0.25,
        causal: false,
        has_mask: false,
    };
    let out = g.add(attention.clone(), &[q, k, v], "attn").unwrap();
    g.outputs = vec![out];
    let kp = generate(&g).unwrap();
    let parts: Vec<_> = kp
        .steps
        .iter()
        .map(|st| match &st.kind {
            StepKind::Kernel { partials, .. } => partials.clone(),
            other => panic!("not a kernel: {other:?}"),
        })
        .collect();
    // Partial results per (row, 128-key chunk), combined by each row's last block: a
    // counter per query row (4 heads).
    assert!(
        matches!(parts.as_slice(), [Some((_, rows))] if rows.as_const() == Some(4)),
        "{parts:?}"
    );
    assert!(kp.steps.iter().all(|st| st.node == out));
    assert!(kp.source.contains("ember_arrive(cnt + row) == NC - 1"));

    // Several query rows (prefill) keep one block per row, with no partial results.
    let mut g = Graph::new();
    let q = input(&mut g, 0, DType::F32, dims(&[1, 4, 5, 16]));
    let k = input(&mut g, 1, DType::F32, dims(&[1, 4, 5, 16]));
    let v = input(&mut g, 2, DType::F32, dims(&[1, 4, 5, 16]));
    let out = g.add(attention, &[q, k, v], "attn").unwrap();
    g.outputs = vec![out];
    let kp = generate(&g).unwrap();
    assert!(
        matches!(kp.steps.as_slice(), [st] if matches!(st.kind, StepKind::Kernel { partials: None, .. }))
    );
}

#[test]
fn a_decode_steps_query_is_computed_inside_its_attention() {
    // q = rotate(x) (pointwise here: x · 2 + x): one query row per head, read once per key
    // from cache, so no kernel of its own; with several rows it is materialized.
    let attention = Op::Attention {
        scale: 0.25,
        causal: false,
        has_mask: false,
    };
    // One row: the split kernel alone; five: q's kernel, then one block per row.
    for (rows, steps) in [(1, 1), (5, 2)] {
        let mut g = Graph::new();
        let x = input(&mut g, 0, DType::F32, dims(&[1, 4, rows, 16]));
        let k = input(&mut g, 1, DType::F32, dims(&[1, 4, 5, 16]));
        let v = input(&mut g, 2, DType::F32, dims(&[1, 4, 5, 16]));
        let twice = g.add(Op::Binary(BinaryOp::Add), &[x, x], "twice").unwrap();
        let q = g.add(Op::Binary(BinaryOp::Add), &[twice, x], "q").unwrap();
        let out = g.add(attention.clone(), &[q, k, v], "attn").unwrap();
        g.outputs = vec![out];
        let kp = generate(&g).unwrap();
        assert_eq!(kp.steps.len(), steps, "rows {rows}: {:?}", kp.steps);
        let q_has_a_step = kp.steps.iter().any(|st| st.node == q);
        assert_eq!(q_has_a_step, rows > 1, "rows {rows}");
    }
}

#[test]
fn a_residual_add_after_a_product_is_cublaslts_c_matrix() {
    // x + reshape(h · wᵀ + b): the exported shape of a transformer's residual connection.
    let mut g = Graph::new();
    let x = input(&mut g, 0, DType::F32, dims(&[1, 4, 16]));
    let h = input(&mut g, 1, DType::F32, dims(&[4, 8]));
    let Linear { w, b, out: yb, .. } = linear_with_bias(&mut g, h, 4, (16, 8));
    let y3 = g
        .add(
            Op::Reshape {
                shape: dims(&[1, 4, 16]),
            },
            &[yb],
            "rows",
        )
        .unwrap();
    let out = g
        .add(Op::Binary(BinaryOp::Add), &[x, y3], "residual")
        .unwrap();
    g.outputs = vec![out];
    let kp = generate(&g).unwrap();
    assert_eq!(kp.steps.len(), 1, "{:?}", kp.steps);
    let StepKind::Gemm(gm) = &kp.steps[0].kind else {
        panic!("not a gemm: {:?}", kp.steps[0]);
    };
    assert_eq!((gm.a, gm.b, gm.bias, gm.residual), (h, w, Some(b), Some(x)));
    assert_eq!(kp.steps[0].node, out);
    assert!(kp.kernels.is_empty());

    // A product read twice keeps its own step: the add is a kernel.
    let mut g = Graph::new();
    let x = input(&mut g, 0, DType::F32, dims(&[4, 16]));
    let h = input(&mut g, 1, DType::F32, dims(&[4, 8]));
    let w = weight(&mut g, "w", &[16, 8]);
    let wt = g.add(Op::Permute { perm: vec![1, 0] }, &[w], "t").unwrap();
    let y = g.add(Op::Dot, &[h, wt], "mm").unwrap();
    let sum = g
        .add(Op::Binary(BinaryOp::Add), &[x, y], "residual")
        .unwrap();
    g.outputs = vec![sum, y];
    let kp = generate(&g).unwrap();
    let residuals: Vec<_> = kp
        .steps
        .iter()
        .filter_map(|st| match &st.kind {
            StepKind::Gemm(gm) => Some(gm.residual),
            _ => None,
        })
        .collect();
    assert_eq!(residuals, vec![None], "{:?}", kp.steps);
}

#[test]
fn a_product_returned_through_a_reshape_is_written_in_place() {
    // logits = reshape(h · wᵀ): the step writes the caller's output, no copy after it.
    let mut g = Graph::new();
    let h = input(&mut g, 0, DType::F32, dims(&[1, 8]));
    let w = weight(&mut g, "w", &[16, 8]);
    let wt = g.add(Op::Permute { perm: vec![1, 0] }, &[w], "t").unwrap();
    let y = g.add(Op::Dot, &[h, wt], "mm").unwrap();
    let out = g
        .add(
            Op::Reshape {
                shape: dims(&[1, 1, 16]),
            },
            &[y],
            "logits",
        )
        .unwrap();
    g.outputs = vec![out];
    let kp = generate(&g).unwrap();
    assert_eq!(kp.steps.len(), 1, "{:?}", kp.steps);
    assert!(matches!(kp.steps[0].kind, StepKind::Gemm(_)));
    assert!(matches!(
        kp.steps[0].dest,
        ember_cuda::codegen::Dest::Output(0)
    ));
    assert_eq!(kp.mem[y], Mem::Inline);
}

#[test]
fn a_sum_of_two_products_keeps_one_of_them_in_memory() {
    // x·w1ᵀ + y·w2ᵀ: one product adds the other as its C, so the other is stored — also
    // when that other is a generated kernel (whose epilogue would end at the same add).
    for generated in [false, true] {
        let mut g = Graph::new();
        let x = input(&mut g, 0, DType::F32, dims(&[3, 8]));
        let y = input(&mut g, 1, DType::F32, dims(&[3, 8]));
        let w1 = weight(&mut g, "w1", &[16, 8]);
        let w2 = weight(&mut g, "w2", &[16, 8]);
        let t1 = g
            .add(Op::Permute { perm: vec![1, 0] }, &[w1], "t1")
            .unwrap();
        let t2 = g
            .add(Op::Permute { perm: vec![1, 0] }, &[w2], "t2")
            .unwrap();
        let p1 = g.add(Op::Dot, &[x, t1], "p1").unwrap();
        let p2 = g.add(Op::Dot, &[y, t2], "p2").unwrap();
        if generated {
            g.nodes[p2].op = Op::Kernel {
                name: ember_cuda::codegen::KERNEL_WARP_DOT.into(),
                base: Box::new(Op::Dot),
            };
        }
        let sum = g.add(Op::Binary(BinaryOp::Add), &[p1, p2], "sum").unwrap();
        g.outputs = vec![sum];
        let kp = generate(&g).unwrap();
        assert_eq!(kp.steps.len(), 2, "generated {generated}: {:?}", kp.steps);
        for st in &kp.steps {
            if let StepKind::Gemm(gm) = &st.kind {
                if let Some(r) = gm.residual {
                    assert_ne!(kp.mem[r], Mem::Inline, "C is in memory: {:?}", kp.steps);
                }
            }
        }
        assert_eq!(kp.steps[1].node, sum, "{:?}", kp.steps);
    }
}

#[test]
fn a_tanh_gelu_after_a_linear_layer_is_cublaslts_gelu_epilogue() {
    // gelu_tanh(h · wᵀ + b) (GPT-2's MLP): one cuBLASLt call; the exact GELU is a kernel.
    for (op, folded) in [(UnaryOp::GeluTanh, true), (UnaryOp::Gelu, false)] {
        let mut g = Graph::new();
        let h = input(&mut g, 0, DType::F32, dims(&[4, 8]));
        let Linear { b, out: yb, .. } = linear_with_bias(&mut g, h, 4, (16, 8));
        let act = g.add(Op::Unary(op), &[yb], "gelu").unwrap();
        g.outputs = vec![act];
        let kp = generate(&g).unwrap();
        let StepKind::Gemm(gm) = &kp.steps[0].kind else {
            panic!("not a gemm: {:?}", kp.steps[0]);
        };
        assert_eq!((gm.bias, gm.gelu_tanh), (Some(b), folded), "{op:?}");
        assert_eq!(kp.steps.len(), if folded { 1 } else { 2 }, "{:?}", kp.steps);
    }
}
