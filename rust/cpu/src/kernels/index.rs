//! Indexing: gather (torch.gather) and index_select (embedding). Indices are read and checked
//! first (negative ones count from the end); an index out of range is an error, never a read.

use ember_core::tensor::contiguous_strides;

use crate::buffer::Val;
use crate::elem::Elem;
use crate::error::{CpuError, KResult};
use crate::strided::{batch_offsets, coalesce, copy_into, for_runs};

/// The index tensor's values in row-major order, wrapped into `0..size` and checked.
fn indices(idx: &Val, size: usize) -> KResult<Vec<isize>> {
    if idx.dtype.is_float() || idx.dtype == ember_core::dtype::DType::Bool {
        return Err(CpuError::Shape(format!(
            "index tensor of dtype {}",
            idx.dtype
        )));
    }
    let raw: Vec<i64> = crate::with_dtype!(idx.dtype, T => {
        idx.to_vec::<T>()?.into_iter().map(T::to_i64).collect()
    });
    raw.into_iter()
        .map(|i| {
            let j = if i < 0 {
                i.wrapping_add(size as i64)
            } else {
                i
            };
            if j < 0 || j >= size as i64 {
                Err(CpuError::IndexOutOfRange { index: i, size })
            } else {
                Ok(j as isize)
            }
        })
        .collect()
}

pub fn gather(x: &Val, idx: &Val, axis: usize) -> KResult<Val> {
    let (xs, is) = (x.shape(), idx.shape());
    if xs.len() != is.len() || axis >= xs.len() {
        return Err(CpuError::Shape(format!(
            "gather of {xs:?} with index {is:?}"
        )));
    }
    if (0..xs.len()).any(|d| d != axis && is[d] > xs[d]) {
        return Err(CpuError::Shape(format!(
            "gather index {is:?} is larger than the input {xs:?} outside axis {axis}"
        )));
    }
    let ids = indices(idx, xs[axis])?;
    crate::with_size!(x.dtype, U => {
        let v = x.view::<U>()?;
        let sa = v.strides[axis];
        let mut base = v.strides.clone();
        base[axis] = 0;
        let (shape, st) = coalesce(is, [&base]);
        Val::build::<U>(x.dtype, is, |out| {
            let n = out.len();
            for_runs(&shape, &st, 0, n, |lin, [off], len| {
                let s = st[0].last().copied().unwrap_or(0);
                for i in 0..len {
                    let at = off + i as isize * s + ids[lin + i] * sa;
                    out[lin + i] = v.at(at);
                }
            });
            Ok(())
        })
    })
}

pub fn index_select(x: &Val, idx: &Val, axis: usize, out_shape: &[usize]) -> KResult<Val> {
    let xs = x.shape();
    if axis >= xs.len() {
        return Err(CpuError::Shape(format!(
            "index_select axis {axis} of {xs:?}"
        )));
    }
    let ids = indices(idx, xs[axis])?;
    let post_shape = &xs[axis + 1..];
    let post_n: usize = post_shape.iter().product();
    let post_strides: Vec<isize> = contiguous_strides(post_shape)
        .into_iter()
        .map(|s| s as isize)
        .collect();
    let mut want = xs[..axis].to_vec();
    want.extend_from_slice(idx.shape());
    want.extend_from_slice(post_shape);
    if want != out_shape {
        return Err(CpuError::Shape(format!(
            "index_select output {out_shape:?}, expected {want:?}"
        )));
    }
    crate::with_size!(x.dtype, U => {
        let v = x.view::<U>()?;
        let sa = v.strides[axis];
        let pre = batch_offsets(&xs[..axis], [&v.strides]);
        Val::build::<U>(x.dtype, out_shape, |out| {
            if post_n == 0 {
                return Ok(());
            }
            let mut at = 0;
            // Rows stored contiguously (a KV cache's heads, embedding rows) are block
            // copies; a view per row costs more than copying a short row.
            let rows_contiguous = v.strides[axis + 1..] == post_strides[..];
            for &[p] in &pre {
                for &j in &ids {
                    if rows_contiguous {
                        out[at..at + post_n].copy_from_slice(v.run(p + j * sa, post_n));
                    } else {
                        let sub = v.inner(axis + 1, p + j * sa);
                        copy_into(&sub, out, at, &post_strides);
                    }
                    at += post_n;
                }
            }
            Ok(())
        })
    })
}

/// `Scatter`: a copy of `x` with `updates` written (or combined) where `idx` points on
/// `axis`, in row-major order of the index (so without a reduction the last update wins).
pub fn scatter(
    x: &Val,
    idx: &Val,
    upd: &Val,
    axis: usize,
    reduce: ember_core::ir::ScatterReduce,
) -> KResult<Val> {
    use ember_core::ir::ScatterReduce as R;
    let (xs, is) = (x.shape().to_vec(), idx.shape().to_vec());
    if xs.len() != is.len() || axis >= xs.len() || upd.shape() != is.as_slice() {
        return Err(CpuError::Shape(format!(
            "scatter into {xs:?} with index {is:?} and updates {:?}",
            upd.shape()
        )));
    }
    if (0..xs.len()).any(|d| d != axis && is[d] > xs[d]) {
        return Err(CpuError::Shape(format!(
            "scatter index {is:?} is larger than the input {xs:?} outside axis {axis}"
        )));
    }
    let ids = indices(idx, xs[axis])?;
    let st = contiguous_strides(&xs);
    let n: usize = is.iter().product();
    crate::with_dtype!(x.dtype, T => {
        // `x` is copied once, straight into the result (a static KV cache is the whole
        // cache per step; an intermediate copy doubled that traffic).
        let base = x.view::<T>()?;
        let updates: Vec<T> = upd.to_vec::<T>()?;
        Val::build::<T>(x.dtype, &xs, |out| {
            crate::strided::map1(&base, out, |v| v);
            let mut at = vec![0usize; is.len()];
            for k in 0..n {
                let off: usize = (0..is.len())
                    .map(|d| if d == axis { ids[k] as usize } else { at[d] } * st[d])
                    .sum();
                let (cur, u) = (out[off], updates[k]);
                out[off] = match reduce {
                    R::None => u,
                    R::Max if u > cur => u,
                    R::Min if u < cur => u,
                    R::Max | R::Min => cur,
                    R::Add | R::Mul if T::IS_FLOAT => {
                        let (a, b) = (cur.to_f64(), u.to_f64());
                        T::from_f64(if reduce == R::Add { a + b } else { a * b })
                    }
                    R::Add => T::from_i64(cur.to_i64().wrapping_add(u.to_i64())),
                    R::Mul => T::from_i64(cur.to_i64().wrapping_mul(u.to_i64())),
                };
                for d in (0..is.len()).rev() {
                    at[d] += 1;
                    if at[d] < is[d] {
                        break;
                    }
                    at[d] = 0;
                }
            }
            Ok(())
        })
    })
}
