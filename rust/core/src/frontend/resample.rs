//! Resampling along one axis as gathers with constant indices blended by constant weights:
//! nearest is one `index_select`, linear two, cubic four. Shared by the PT2 upsample ops and
//! ONNX `Resize`; the frontends compute where each output samples the input (each by its
//! own source's rules and in f32, as their reference kernels do).

use std::sync::Arc;

use crate::dim::Dim;
use crate::dtype::DType;
use crate::error::Result;
use crate::frontend::builder::{Builder, Operand};
use crate::ir::{BinaryOp, ConstData, Op, TensorType, ValueId};

/// A 1-D int64 constant.
pub fn index_const(b: &mut Builder, idx: &[i64]) -> Result<ValueId> {
    let bytes: Vec<u8> = idx.iter().flat_map(|i| i.to_le_bytes()).collect();
    b.source(
        Op::Constant(ConstData {
            shape: vec![idx.len()],
            bytes: Arc::new(bytes),
        }),
        TensorType::new(DType::I64, vec![Dim::Const(idx.len() as i64)]),
    )
}

/// Blend weights in `dtype`, shaped to broadcast along `axis` of a rank-`rank` value.
pub fn weight_const(
    b: &mut Builder,
    w: &[f32],
    dtype: DType,
    axis: usize,
    rank: usize,
) -> Result<ValueId> {
    let (cdt, bytes): (DType, Vec<u8>) = match dtype {
        DType::F64 => (
            DType::F64,
            w.iter().flat_map(|&v| (v as f64).to_le_bytes()).collect(),
        ),
        _ => (DType::F32, w.iter().flat_map(|v| v.to_le_bytes()).collect()),
    };
    let mut shape = vec![1usize; rank];
    shape[axis] = w.len();
    let c = b.source(
        Op::Constant(ConstData {
            shape: shape.clone(),
            bytes: Arc::new(bytes),
        }),
        TensorType::new(cdt, shape.iter().map(|&d| Dim::Const(d as i64)).collect()),
    )?;
    b.cast(c, dtype)
}

/// Keys's cubic convolution weights for the four taps around a fraction `t` ∈ [0, 1) (the
/// taps at -1, 0, 1 and 2 from the sample's floor), with coefficient `a` (-0.75 in torch,
/// ONNX's default). The same expressions as torch's `cubic_convolution1/2`, in f32.
pub fn cubic_weights(t: f32, a: f32) -> [f32; 4] {
    let far = |x: f32| ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a;
    let near = |x: f32| ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0;
    [far(t + 1.0), near(t), near(1.0 - t), far(2.0 - t)]
}

/// One tap of a resampling filter: for every output position, the input index it reads and
/// the weight it gets.
pub struct Tap {
    pub index: Vec<i64>,
    pub weight: Vec<f32>,
}

/// `Σ weightₜ · v[indexₜ]` along `axis`, summed left to right (the order reference kernels
/// use, so results match them to the last bit where they can).
pub fn blend(b: &mut Builder, v: ValueId, axis: usize, taps: &[Tap]) -> Result<ValueId> {
    let dtype = b.dtype(v);
    let rank = b.rank(v);
    let t = Operand::Tensor;
    let mut acc: Option<ValueId> = None;
    for tap in taps {
        let c = index_const(b, &tap.index)?;
        let picked = b.op(Op::IndexSelect { axis }, &[v, c])?;
        let w = weight_const(b, &tap.weight, dtype, axis, rank)?;
        let term = b.binary_in(BinaryOp::Mul, t(w), t(picked), dtype)?;
        acc = Some(match acc {
            None => term,
            Some(a) => b.binary_in(BinaryOp::Add, t(a), t(term), dtype)?,
        });
    }
    Ok(acc.unwrap_or(v))
}
