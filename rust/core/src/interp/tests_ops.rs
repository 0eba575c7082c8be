//! Tests of reductions, axis ops, linear algebra and data movement.

use super::tests::{apply, apply_ok, assert_close, assert_f, dims, fv, iv};
use super::*;
use crate::dim::Dim;
use crate::dtype::DType::*;
use crate::ir::{ReduceOp, ScanOp};

fn reduce(op: ReduceOp, axes: &[usize], keepdim: bool, x: &Value) -> Result<Value> {
    let op = Op::Reduce {
        op,
        axes: axes.to_vec(),
        keepdim,
    };
    apply(op, std::slice::from_ref(x))
}

fn range(shape: &[usize]) -> Value {
    let n: usize = shape.iter().product();
    fv(F32, shape, &(0..n).map(|i| i as f64).collect::<Vec<_>>())
}

#[test]
fn sum_and_prod_over_several_axes() {
    let x = range(&[2, 3, 2]);
    let s = reduce(ReduceOp::Sum, &[0, 2], true, &x).unwrap();
    assert_eq!(s.shape, [1, 3, 1]);
    assert_f(&s, &[14.0, 22.0, 30.0]);
    let s = reduce(ReduceOp::Sum, &[0, 2], false, &x).unwrap();
    assert_eq!(s.shape, [3]);
    let s = reduce(ReduceOp::Sum, &[0, 1, 2], false, &x).unwrap();
    assert_eq!(s.shape, Vec::<usize>::new());
    assert_f(&s, &[66.0]);
    let p = fv(F64, &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    assert_f(
        &reduce(ReduceOp::Prod, &[1], false, &p).unwrap(),
        &[6.0, 120.0],
    );
    let w = iv(I8, &[2], &[100, 100]);
    assert_eq!(
        reduce(ReduceOp::Sum, &[0], false, &w).unwrap().to_i64_vec(),
        [-56]
    );
    // Empty reductions: sum 0, prod 1.
    let e = fv(F32, &[0, 3], &[]);
    assert_f(&reduce(ReduceOp::Sum, &[0], false, &e).unwrap(), &[0.0; 3]);
    assert_f(&reduce(ReduceOp::Prod, &[0], false, &e).unwrap(), &[1.0; 3]);
}

#[test]
fn max_min_and_arg_reductions() {
    let nan = f64::NAN;
    let x = fv(F32, &[2, 3], &[1.0, nan, 3.0, 4.0, 5.0, 6.0]);
    assert_f(
        &reduce(ReduceOp::Max, &[1], false, &x).unwrap(),
        &[nan, 6.0],
    );
    assert_f(
        &reduce(ReduceOp::Min, &[1], false, &x).unwrap(),
        &[nan, 4.0],
    );
    assert_f(
        &reduce(ReduceOp::Max, &[0], false, &x).unwrap(),
        &[4.0, nan, 6.0],
    );
    let a = fv(F32, &[2, 3], &[1.0, 3.0, 3.0, nan, 5.0, nan]);
    let am = reduce(ReduceOp::ArgMax, &[1], false, &a).unwrap();
    assert_eq!((am.dtype, am.to_i64_vec()), (I64, vec![1, 0]));
    let b = fv(F32, &[2, 3], &[2.0, 1.0, 1.0, 4.0, nan, 0.0]);
    let am = reduce(ReduceOp::ArgMin, &[1], true, &b).unwrap();
    assert_eq!(
        (am.shape.clone(), am.to_i64_vec()),
        (vec![2, 1], vec![1, 1])
    );
    let am = reduce(ReduceOp::ArgMax, &[0], false, &b).unwrap();
    assert_eq!(am.to_i64_vec(), [1, 1, 0]);
    let i = iv(I32, &[3], &[3, 7, 7]);
    assert_eq!(
        reduce(ReduceOp::ArgMax, &[0], false, &i)
            .unwrap()
            .to_i64_vec(),
        [1]
    );
    assert_eq!(
        reduce(ReduceOp::Max, &[0], false, &i).unwrap().to_i64_vec(),
        [7]
    );
    assert_eq!(
        reduce(ReduceOp::ArgMin, &[0], false, &i)
            .unwrap()
            .to_i64_vec(),
        [0]
    );
    // Max of nothing is an error, unless there is no output element either.
    let e = fv(F32, &[0, 3], &[]);
    let err = reduce(ReduceOp::Max, &[0], false, &e).unwrap_err();
    assert!(matches!(err, Error::Runtime(_)), "{err}");
    assert!(
        err.to_string().contains("reduce_max at node 'node'"),
        "{err}"
    );
    assert!(reduce(ReduceOp::ArgMin, &[0], false, &e).is_err());
    let e = fv(F32, &[3, 0], &[]);
    assert_eq!(reduce(ReduceOp::Max, &[0], false, &e).unwrap().shape, [0]);
}

#[test]
fn cumsum_along_each_axis() {
    let x = iv(I64, &[2, 3], &[1, 2, 3, 4, 5, 6]);
    let c = apply_ok(
        Op::Scan {
            axis: 1,
            op: ScanOp::Sum,
        },
        std::slice::from_ref(&x),
    );
    assert_eq!(c.to_i64_vec(), [1, 3, 6, 4, 9, 15]);
    let c = apply_ok(
        Op::Scan {
            axis: 0,
            op: ScanOp::Sum,
        },
        &[x],
    );
    assert_eq!(c.to_i64_vec(), [1, 2, 3, 5, 7, 9]);
    let f = fv(F32, &[3], &[0.5, 0.25, -1.0]);
    assert_f(
        &apply_ok(
            Op::Scan {
                axis: 0,
                op: ScanOp::Sum,
            },
            &[f],
        ),
        &[0.5, 0.75, -0.25],
    );
}

#[test]
fn cumprod_cummax_cummin_and_nan() {
    let x = iv(I64, &[2, 3], &[2, -1, 3, 4, 5, 1]);
    let scan = |op, v: &Value| apply_ok(Op::Scan { axis: 1, op }, std::slice::from_ref(v));
    assert_eq!(scan(ScanOp::Prod, &x).to_i64_vec(), [2, -2, -6, 4, 20, 20]);
    assert_eq!(scan(ScanOp::Max, &x).to_i64_vec(), [2, 2, 3, 4, 5, 5]);
    assert_eq!(scan(ScanOp::Min, &x).to_i64_vec(), [2, -1, -1, 4, 4, 1]);
    // A NaN stays the running max/min once seen.
    let f = fv(F32, &[1, 4], &[1.0, f64::NAN, 3.0, -2.0]);
    let m = scan(ScanOp::Max, &f).to_f64_vec();
    assert_eq!(m[0], 1.0);
    assert!(m[1..].iter().all(|v| v.is_nan()), "{m:?}");
    let m = scan(ScanOp::Min, &f).to_f64_vec();
    assert!(m[1..].iter().all(|v| v.is_nan()), "{m:?}");
}

#[test]
fn softmax_is_stable_for_large_values() {
    let x = fv(F64, &[1, 2], &[1000.0, 1001.0]);
    let s = apply_ok(
        Op::Softmax {
            axis: 1,
            log: false,
        },
        std::slice::from_ref(&x),
    );
    assert_close(&s, &[0.2689414213699951, 0.7310585786300049], 1e-15);
    let l = apply_ok(Op::Softmax { axis: 1, log: true }, &[x]);
    assert_close(&l, &[-1.3132616875182228, -0.3132616875182228], 1e-15);
    let x = fv(F32, &[2], &[-1001.0, -1000.0]);
    let s = apply_ok(
        Op::Softmax {
            axis: 0,
            log: false,
        },
        &[x],
    );
    assert_f(
        &s,
        &[
            0.2689414213699951_f64 as f32 as f64,
            0.7310585786300049_f64 as f32 as f64,
        ],
    );
    // Along axis 0 of a 2-D tensor.
    let x = fv(F64, &[2, 2], &[0.0, 0.0, 3f64.ln(), 0.0]);
    let s = apply_ok(
        Op::Softmax {
            axis: 0,
            log: false,
        },
        &[x],
    );
    assert_close(&s, &[0.25, 0.5, 0.75, 0.5], 1e-15);
    // A row of -inf gives NaN.
    let x = fv(F32, &[2], &[f64::NEG_INFINITY; 2]);
    let s = apply_ok(
        Op::Softmax {
            axis: 0,
            log: false,
        },
        &[x],
    );
    assert_f(&s, &[f64::NAN; 2]);
}

fn layer_norm(axis: usize, eps: f64, args: &[Value]) -> Value {
    let op = Op::LayerNorm {
        axis,
        eps,
        has_weight: args.len() > 1,
        has_bias: args.len() > 2,
    };
    apply_ok(op, args)
}

#[test]
fn layer_norm_and_rms_norm() {
    let (a, b) = (1.3416407864998738, 0.4472135954999579);
    let x = fv(F64, &[1, 4], &[1.0, 2.0, 3.0, 4.0]);
    assert_close(&layer_norm(1, 0.0, &[x]), &[-a, -b, b, a], 1e-15);
    // Over the trailing two dims, with weight and bias of that shape.
    let x = fv(F64, &[2, 2], &[1.0, 2.0, 3.0, 4.0]);
    let w = fv(F64, &[2, 2], &[1.0, 2.0, 3.0, 4.0]);
    let bias = fv(F64, &[2, 2], &[0.5; 4]);
    let y = layer_norm(0, 0.0, &[x, w, bias.clone()]);
    assert_close(
        &y,
        &[0.5 - a, 0.5 - 2.0 * b, 0.5 + 3.0 * b, 0.5 + 4.0 * a],
        1e-15,
    );
    // A constant row normalizes to 0 (eps keeps it finite), then takes the bias.
    let x = fv(F64, &[2, 2], &[7.0; 4]);
    let w = fv(F64, &[2], &[3.0, 3.0]);
    let bias = fv(F64, &[2], &[0.5, -0.5]);
    assert_f(&layer_norm(1, 1e-5, &[x, w, bias]), &[0.5, -0.5, 0.5, -0.5]);

    let x = fv(F64, &[1, 2], &[3.0, 4.0]);
    let rms = |args: &[Value]| {
        let op = Op::RmsNorm {
            axis: 1,
            eps: 0.0,
            has_weight: args.len() > 1,
        };
        apply_ok(op, args)
    };
    let (c, d) = (0.848528137423857, 1.131370849898476);
    assert_close(&rms(std::slice::from_ref(&x)), &[c, d], 1e-15);
    let w = fv(F64, &[2], &[2.0, 0.5]);
    assert_close(&rms(&[x, w]), &[2.0 * c, 0.5 * d], 1e-15);
}

#[test]
fn dot_with_batch_dims() {
    let a = fv(F32, &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let b = fv(F32, &[3, 2], &[7.0, 8.0, 9.0, 10.0, 11.0, 12.0]);
    assert_f(&apply_ok(Op::Dot, &[a, b]), &[58.0, 64.0, 139.0, 154.0]);
    let a = range(&[2, 2, 3]);
    let b = fv(F32, &[2, 3, 1], &[1.0; 6]);
    let c = apply_ok(Op::Dot, &[a, b]);
    assert_eq!(c.shape, [2, 2, 1]);
    assert_f(&c, &[3.0, 12.0, 21.0, 30.0]);
    let a = iv(I8, &[1, 2], &[100, 100]);
    let b = iv(I8, &[2, 1], &[1, 1]);
    assert_eq!(apply_ok(Op::Dot, &[a, b]).to_i64_vec(), [-56]);
    let a = fv(F32, &[2, 0], &[]);
    let b = fv(F32, &[0, 3], &[]);
    assert_f(&apply_ok(Op::Dot, &[a, b]), &[0.0; 6]);
}

/// `x · wᵀ` as a linear layer spells it, run with the transpose read in place (it feeds
/// only the product) and made (it is also an output): the same bits, at sizes that take
/// the one-thread, row-parallel and column-parallel paths with lane tails.
#[test]
fn products_of_transposes_read_in_place_match_the_made_transpose() {
    let mut seed = 7u64;
    let mut next = move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 33) as f64 / (1u64 << 31) as f64) * 2.0 - 1.0
    };
    for (batch, m, k, n, dtype) in [
        (1, 3, 5, 7, F32),
        (2, 9, 33, 70, BF16),
        (1, 1, 300, 203, F32),
        (1, 37, 64, 515, F64),
    ] {
        let (xs, ws) = (vec![batch, m, k], vec![batch, n, k]);
        let x: Vec<f64> = (0..batch * m * k).map(|_| next()).collect();
        let w: Vec<f64> = (0..batch * n * k).map(|_| next()).collect();
        let args = [fv(dtype, &xs, &x), fv(dtype, &ws, &w)];
        let run_with = |transpose_is_output: bool| {
            let mut g = Graph::new();
            let ids: Vec<usize> = args
                .iter()
                .enumerate()
                .map(|(index, a)| {
                    let ty = crate::ir::TensorType::new(a.dtype, dims(&a.shape));
                    g.add_source(Op::Input { index }, ty, "in").unwrap()
                })
                .collect();
            let wt = g
                .add(
                    Op::Permute {
                        perm: vec![0, 2, 1],
                    },
                    &[ids[1]],
                    "t",
                )
                .unwrap();
            let y = g.add(Op::Dot, &[ids[0], wt], "dot").unwrap();
            g.outputs.push(y);
            if transpose_is_output {
                g.outputs.push(wt);
            }
            run(&g, &Weights::new(), &args).unwrap().remove(0)
        };
        let (in_place, made) = (run_with(false), run_with(true));
        assert_eq!(in_place.shape, [batch, m, n]);
        let bits = |v: &Value| {
            v.to_f64_vec()
                .iter()
                .map(|f| f.to_bits())
                .collect::<Vec<_>>()
        };
        assert_eq!(bits(&in_place), bits(&made), "{batch}×{m}×{k}×{n} {dtype}");
    }
}

fn attention(scale: f64, causal: bool, args: &[Value]) -> Value {
    let op = Op::Attention {
        scale,
        causal,
        has_mask: args.len() > 3,
    };
    apply_ok(op, args)
}

#[test]
fn attention_causal_masks_and_scale() {
    let ln3 = 3f64.ln();
    let q = fv(F64, &[1, 2, 1], &[1.0, 1.0]);
    let k = fv(F64, &[1, 2, 1], &[0.0, ln3]);
    let v = fv(F64, &[1, 2, 2], &[1.0, 0.0, 0.0, 1.0]);
    let qkv = [q.clone(), k.clone(), v.clone()];
    assert_close(
        &attention(1.0, false, &qkv),
        &[0.25, 0.75, 0.25, 0.75],
        1e-15,
    );
    let causal = attention(1.0, true, &qkv);
    assert_close(&causal, &[1.0, 0.0, 0.25, 0.75], 1e-15);
    // An explicit lower-triangular mask, as bool and as an additive float mask.
    let keep = iv(Bool, &[1, 2, 2], &[1, 0, 1, 1]);
    let masked = attention(1.0, false, &[q.clone(), k.clone(), v.clone(), keep]);
    assert_f(&masked, &causal.to_f64_vec());
    let add = fv(F64, &[1, 2, 2], &[0.0, f64::NEG_INFINITY, 0.0, 0.0]);
    let masked = attention(1.0, false, &[q.clone(), k.clone(), v.clone(), add]);
    assert_f(&masked, &causal.to_f64_vec());
    let add = fv(F64, &[1, 2, 2], &[0.0, -ln3, 0.0, 0.0]);
    let masked = attention(1.0, false, &[q.clone(), k.clone(), v.clone(), add]);
    assert_close(&masked, &[0.5, 0.5, 0.25, 0.75], 1e-15);
    // Scale multiplies the scores: softmax([0, 2 ln 3]) = [0.1, 0.9].
    assert_close(&attention(2.0, false, &qkv), &[0.1, 0.9, 0.1, 0.9], 1e-15);
    // Causal is top-left aligned when L < S.
    let q1 = fv(F64, &[1, 1, 1], &[1.0]);
    let one = attention(1.0, true, &[q1, k.clone(), v.clone()]);
    assert_f(&one, &[1.0, 0.0]);
    // A fully masked row gives zeros (torch's scaled_dot_product_attention), not NaN.
    let none = iv(Bool, &[1, 2, 2], &[0, 0, 1, 1]);
    let out = attention(1.0, false, &[q, k, v, none]);
    assert_close(&out, &[0.0, 0.0, 0.25, 0.75], 1e-15);
}

#[test]
fn batched_transposes_across_tile_edges() {
    // Past the 32-wide tiles of the last-two-axes fast path, in both value kinds.
    let (b, r, c) = (2, 33, 70);
    let y = range(&[b, r, c]);
    let t = apply_ok(
        Op::Permute {
            perm: vec![0, 2, 1],
        },
        std::slice::from_ref(&y),
    );
    assert_eq!(t.shape, [b, c, r]);
    let mut want = Vec::new();
    for bi in 0..b {
        for ci in 0..c {
            for ri in 0..r {
                want.push(((bi * r + ri) * c + ci) as f64);
            }
        }
    }
    assert_f(&t, &want);
    let ints = iv(I64, &[r, c], &(0..(r * c) as i64).collect::<Vec<_>>());
    let ti = apply_ok(Op::Permute { perm: vec![1, 0] }, &[ints]);
    let want: Vec<i64> = (0..c)
        .flat_map(|ci| (0..r).map(move |ri| (ri * c + ci) as i64))
        .collect();
    assert_eq!(ti.to_i64_vec(), want);
}

#[test]
fn reshape_permute_expand() {
    let x = range(&[2, 3]);
    let r = apply_ok(
        Op::Reshape {
            shape: dims(&[3, 2]),
        },
        std::slice::from_ref(&x),
    );
    assert_eq!(
        (r.shape.clone(), r.to_f64_vec()),
        (vec![3, 2], x.to_f64_vec())
    );
    let t = apply_ok(Op::Permute { perm: vec![1, 0] }, std::slice::from_ref(&x));
    assert_eq!(t.shape, [3, 2]);
    assert_f(&t, &[0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
    let y = range(&[2, 3, 4]);
    let p = apply_ok(
        Op::Permute {
            perm: vec![2, 0, 1],
        },
        &[y],
    );
    assert_eq!(p.shape, [4, 2, 3]);
    let mut want = Vec::new();
    for a in 0..4 {
        for b in 0..2 {
            for c in 0..3 {
                want.push((b * 12 + c * 4 + a) as f64);
            }
        }
    }
    assert_f(&p, &want);
    let col = fv(F32, &[2, 1], &[1.0, 2.0]);
    let e = apply_ok(
        Op::Expand {
            shape: dims(&[2, 3]),
        },
        &[col],
    );
    assert_f(&e, &[1.0, 1.0, 1.0, 2.0, 2.0, 2.0]);
}

fn slice(x: &Value, axis: usize, start: i64, end: i64, step: i64) -> Value {
    let op = Op::Slice {
        axis,
        start: start.into(),
        end: end.into(),
        step,
    };
    apply_ok(op, std::slice::from_ref(x))
}

#[test]
fn slice_with_step_and_flip() {
    let x = range(&[10]);
    assert_f(&slice(&x, 0, 1, 8, 3), &[1.0, 4.0, 7.0]);
    assert_f(&slice(&x, 0, 1, 7, 3), &[1.0, 4.0]);
    assert_eq!(slice(&x, 0, 4, 4, 1).shape, [0]);
    let m = range(&[2, 5]);
    let s = slice(&m, 1, 0, 5, 2);
    assert_eq!(s.shape, [2, 3]);
    assert_f(&s, &[0.0, 2.0, 4.0, 5.0, 7.0, 9.0]);
    let s = slice(&m, 0, 1, 2, 1);
    assert_f(&s, &[5.0, 6.0, 7.0, 8.0, 9.0]);
    let x = range(&[2, 3]);
    let f = apply_ok(Op::Flip { axes: vec![0, 1] }, std::slice::from_ref(&x));
    assert_f(&f, &[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]);
    let f = apply_ok(Op::Flip { axes: vec![1] }, &[x]);
    assert_f(&f, &[2.0, 1.0, 0.0, 5.0, 4.0, 3.0]);
}

#[test]
fn pad_and_concat() {
    let x = fv(F32, &[2, 2], &[1.0, 2.0, 3.0, 4.0]);
    let op = Op::Pad {
        pads: vec![(1, 0), (0, 1)],
        value: Scalar::Float(9.0),
    };
    let p = apply_ok(op, std::slice::from_ref(&x));
    assert_eq!(p.shape, [3, 3]);
    assert_f(&p, &[9.0, 9.0, 9.0, 1.0, 2.0, 9.0, 3.0, 4.0, 9.0]);
    let i = iv(I32, &[1], &[5]);
    let op = Op::Pad {
        pads: vec![(2, 1)],
        value: Scalar::Int(-1),
    };
    assert_eq!(apply_ok(op, &[i]).to_i64_vec(), [-1, -1, 5, -1]);

    let a = fv(F32, &[2, 1], &[10.0, 20.0]);
    let c = apply_ok(Op::Concat { axis: 1 }, &[a.clone(), x.clone()]);
    assert_eq!(c.shape, [2, 3]);
    assert_f(&c, &[10.0, 1.0, 2.0, 20.0, 3.0, 4.0]);
    let row = fv(F32, &[1, 2], &[7.0, 8.0]);
    let e = fv(F32, &[0, 2], &[]);
    let c = apply_ok(Op::Concat { axis: 0 }, &[x, e, row]);
    assert_f(&c, &[1.0, 2.0, 3.0, 4.0, 7.0, 8.0]);
}

#[test]
fn gather_with_negative_and_out_of_range_indices() {
    let x = fv(F32, &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let idx = iv(I64, &[2, 2], &[0, -1, 2, 1]);
    let g = apply_ok(Op::Gather { axis: 1 }, &[x.clone(), idx]);
    assert_f(&g, &[1.0, 3.0, 6.0, 5.0]);
    let idx = iv(I32, &[1, 3], &[1, 0, -2]);
    let g = apply_ok(Op::Gather { axis: 0 }, &[x.clone(), idx]);
    assert_f(&g, &[4.0, 2.0, 3.0]);
    for bad in [3, -4] {
        let idx = iv(I64, &[1, 1], &[bad]);
        let err = apply(Op::Gather { axis: 1 }, &[x.clone(), idx]).unwrap_err();
        assert!(matches!(err, Error::Runtime(_)), "{err}");
        assert!(err.to_string().contains("gather at node 'node'"), "{err}");
    }
    // The index may not be larger than the input on the other dims.
    let idx = iv(I64, &[3, 1], &[0, 0, 0]);
    assert!(apply(Op::Gather { axis: 1 }, &[x, idx]).is_err());
}

#[test]
fn index_select_with_negative_and_out_of_range_indices() {
    let x = fv(F32, &[3, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let idx = iv(I64, &[2], &[-1, 0]);
    let s = apply_ok(Op::IndexSelect { axis: 0 }, &[x.clone(), idx]);
    assert_eq!(s.shape, [2, 2]);
    assert_f(&s, &[5.0, 6.0, 1.0, 2.0]);
    let idx = iv(I64, &[2, 2], &[0, 1, 2, -3]);
    let s = apply_ok(Op::IndexSelect { axis: 0 }, &[x.clone(), idx]);
    assert_eq!(s.shape, [2, 2, 2]);
    assert_f(&s, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 1.0, 2.0]);
    let idx = iv(I32, &[1], &[1]);
    let s = apply_ok(Op::IndexSelect { axis: 1 }, &[x.clone(), idx]);
    assert_eq!(s.shape, [3, 1]);
    assert_f(&s, &[2.0, 4.0, 6.0]);
    let idx = iv(I64, &[], &[-2]);
    let s = apply_ok(Op::IndexSelect { axis: 0 }, &[x.clone(), idx]);
    assert_eq!(s.shape, [2]);
    assert_f(&s, &[3.0, 4.0]);
    for bad in [3, -4, i64::MIN, i64::MAX] {
        let idx = iv(I64, &[1], &[bad]);
        let err = apply(Op::IndexSelect { axis: 0 }, &[x.clone(), idx]).unwrap_err();
        assert!(matches!(err, Error::Runtime(_)), "{err}");
        assert!(
            err.to_string().contains("index_select at node 'node'"),
            "{err}"
        );
    }
}

#[test]
fn cache_append_writes_new_entries_after_each_length() {
    // Sequence 0 has 3 cached entries, sequence 1 one; a length past the buffer reads
    // zeros there, a negative one writes the new entries from its (clipped) position.
    let past = fv(F32, &[2, 1, 3, 1], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let new = fv(F32, &[2, 1, 2, 1], &[10.0, 11.0, 20.0, 21.0]);
    let op = |len: usize| Op::CacheAppend {
        axis: 2,
        len: Dim::from(len),
    };
    let lengths = iv(I64, &[2], &[3, 1]);
    let c = apply_ok(op(5), &[past.clone(), new.clone(), lengths]);
    assert_eq!(c.shape, [2, 1, 5, 1]);
    assert_f(&c, &[1.0, 2.0, 3.0, 10.0, 11.0, 4.0, 20.0, 21.0, 0.0, 0.0]);
    let lengths = iv(I32, &[2], &[4, -1]);
    let c = apply_ok(op(4), &[past.clone(), new.clone(), lengths]);
    assert_f(&c, &[1.0, 2.0, 3.0, 0.0, 21.0, 0.0, 0.0, 0.0]);
    let err = apply(op(4), &[past, new, iv(I64, &[1], &[0])]).unwrap_err();
    assert!(err.to_string().contains("cache_append"), "{err}");
}
