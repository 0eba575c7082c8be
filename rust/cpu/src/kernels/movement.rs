//! Data movement and sources: views (reshape, permute, expand, slice, flip) as layout changes,
//! pad, concat, full (a broadcast scalar) and iota.

use std::sync::Arc;

use ember_core::dtype::{DType, Scalar};
use ember_core::tensor::contiguous_strides;

use crate::arena::Dest;
use crate::buffer::{is_aligned, Layout, Storage, Val};
use crate::elem::Elem;
use crate::error::{CpuError, KResult};
use crate::strided::copy_into;

/// A one-element value holding `s` converted to `dtype`.
pub fn scalar(dtype: DType, s: Scalar) -> KResult<Val> {
    crate::with_dtype!(dtype, T => Val::build::<T>(dtype, &[], |o| {
        o[0] = match s {
            Scalar::Float(f) => T::from_f64(f),
            Scalar::Int(i) => T::from_i64(i),
            Scalar::Bool(b) => T::from_i64(b as i64),
        };
        Ok(())
    }))
}

/// `s` broadcast to `shape` (zero strides, one element of storage).
pub fn full(one: &Val, shape: &[usize]) -> KResult<Val> {
    one.with_layout(Layout {
        shape: shape.to_vec(),
        strides: vec![0; shape.len()],
        offset: one.layout.offset,
    })
}

pub fn iota(dtype: DType, start: Scalar, step: Scalar, n: usize) -> KResult<Val> {
    crate::with_dtype!(dtype, T => Val::build::<T>(dtype, &[n], |o| {
        if T::IS_FLOAT {
            let (a, b) = (start.as_f64(), step.as_f64());
            for (i, d) in o.iter_mut().enumerate() {
                *d = T::from_f64(a + b * i as f64);
            }
        } else {
            let (a, b) = (start.as_i64(), step.as_i64());
            for (i, d) in o.iter_mut().enumerate() {
                *d = T::from_i64(a.wrapping_add(b.wrapping_mul(i as i64)));
            }
        }
        Ok(())
    }))
}

/// Bytes of a constant or weight as a value (copied once if they are not aligned).
pub fn bind_bytes(dtype: DType, shape: &[usize], bytes: &[u8], copy: bool) -> KResult<Val> {
    let n: usize = shape.iter().product();
    if bytes.len() != n * dtype.size() {
        return Err(CpuError::Input(format!(
            "{dtype}{shape:?} needs {} bytes, got {}",
            n * dtype.size(),
            bytes.len()
        )));
    }
    let storage = if copy || !is_aligned(bytes.as_ptr(), dtype.size()) {
        Storage::copy_of(bytes)
    } else {
        Storage::External {
            ptr: bytes.as_ptr(),
            bytes: bytes.len(),
        }
    };
    Val::new(dtype, Arc::new(storage), Layout::contiguous(shape))
}

pub fn permute(x: &Val, perm: &[usize]) -> KResult<Val> {
    let l = &x.layout;
    if perm.len() != l.shape.len() || perm.iter().any(|&p| p >= l.shape.len()) {
        return Err(CpuError::Shape(format!(
            "permute {perm:?} of {:?}",
            l.shape
        )));
    }
    x.with_layout(Layout {
        shape: perm.iter().map(|&p| l.shape[p]).collect(),
        strides: perm.iter().map(|&p| l.strides[p]).collect(),
        offset: l.offset,
    })
}

pub fn expand(x: &Val, shape: &[usize]) -> KResult<Val> {
    let l = &x.layout;
    let bad = || CpuError::Shape(format!("expand {:?} to {shape:?}", l.shape));
    if shape.len() != l.shape.len() {
        return Err(bad());
    }
    let mut strides = Vec::with_capacity(shape.len());
    for ((&from, &to), &s) in l.shape.iter().zip(shape).zip(&l.strides) {
        strides.push(match (from, to) {
            _ if from == to => s,
            (1, _) => 0,
            _ => return Err(bad()),
        });
    }
    x.with_layout(Layout {
        shape: shape.to_vec(),
        strides,
        offset: l.offset,
    })
}

pub fn slice(x: &Val, axis: usize, start: i64, end: i64, step: i64) -> KResult<Val> {
    let l = &x.layout;
    let size = *l
        .shape
        .get(axis)
        .ok_or_else(|| CpuError::Shape(format!("slice axis {axis}")))?;
    if !(0 <= start && start <= end && end <= size as i64 && step >= 1) {
        return Err(CpuError::Shape(format!(
            "slice [{start}:{end}:{step}] of a dim of size {size}"
        )));
    }
    let mut out = l.clone();
    out.shape[axis] = ((end - start + step - 1) / step) as usize;
    if out.shape[axis] > 0 {
        out.offset += start as isize * l.strides[axis];
    }
    out.strides[axis] *= step as isize;
    x.with_layout(out)
}

pub fn flip(x: &Val, axes: &[usize]) -> KResult<Val> {
    let mut out = x.layout.clone();
    for &a in axes {
        let (&size, s) = match (out.shape.get(a), out.strides.get_mut(a)) {
            (Some(size), Some(s)) => (size, s),
            _ => return Err(CpuError::Shape(format!("flip axis {a}"))),
        };
        if size > 0 {
            out.offset += (size as isize - 1) * *s;
            *s = -*s;
        }
    }
    x.with_layout(out)
}

/// Reshape as a view when the strides allow it (torch's rule), else through a copy.
pub fn reshape(x: &Val, shape: &[usize]) -> KResult<Val> {
    if x.numel() != shape.iter().product::<usize>() {
        return Err(CpuError::Shape(format!(
            "reshape {:?} to {shape:?}",
            x.shape()
        )));
    }
    if let Some(strides) = view_strides(&x.layout, shape) {
        return x.with_layout(Layout {
            shape: shape.to_vec(),
            strides,
            offset: x.layout.offset,
        });
    }
    let c = x.contiguous()?;
    let offset = c.layout.offset;
    c.with_layout(Layout {
        offset,
        ..Layout::contiguous(shape)
    })
}

fn view_strides(l: &Layout, shape: &[usize]) -> Option<Vec<isize>> {
    let contiguous = || {
        contiguous_strides(shape)
            .into_iter()
            .map(|s| s as isize)
            .collect()
    };
    if l.numel() <= 1 || l.shape.is_empty() {
        return Some(contiguous());
    }
    let mut strides = vec![0isize; shape.len()];
    let mut view_d = shape.len() as isize - 1;
    let mut base = *l.strides.last()?;
    let (mut tensor_numel, mut view_numel) = (1usize, 1usize);
    for d in (0..l.shape.len()).rev() {
        tensor_numel *= l.shape[d];
        if d == 0 || (l.shape[d - 1] != 1 && l.strides[d - 1] != tensor_numel as isize * base) {
            while view_d >= 0 && (view_numel < tensor_numel || shape[view_d as usize] == 1) {
                strides[view_d as usize] = view_numel as isize * base;
                view_numel *= shape[view_d as usize];
                view_d -= 1;
            }
            if view_numel != tensor_numel {
                return None;
            }
            if d > 0 {
                base = l.strides[d - 1];
                tensor_numel = 1;
                view_numel = 1;
            }
        }
    }
    (view_d == -1).then_some(strides)
}

pub fn pad(x: &Val, pads: &[(i64, i64)], value: Scalar, out_shape: &[usize]) -> KResult<Val> {
    let xs = x.shape();
    let ok = pads.len() == xs.len()
        && out_shape.len() == xs.len()
        && pads
            .iter()
            .zip(xs)
            .zip(out_shape)
            .all(|((&(a, b), &i), &o)| a >= 0 && b >= 0 && i as i64 + a + b == o as i64);
    if !ok {
        return Err(CpuError::Shape(format!(
            "pad {xs:?} by {pads:?} to {out_shape:?}"
        )));
    }
    let fill = scalar(x.dtype, value)?;
    let strides: Vec<isize> = contiguous_strides(out_shape)
        .into_iter()
        .map(|s| s as isize)
        .collect();
    let offset: isize = pads
        .iter()
        .zip(&strides)
        .map(|(p, s)| p.0 as isize * s)
        .sum();
    crate::with_size!(x.dtype, U => {
        let (v, f) = (x.view::<U>()?, fill.view::<U>()?.at(0));
        Val::build::<U>(x.dtype, out_shape, |out| {
            out.iter_mut().for_each(|d| *d = f);
            copy_into(&v, out, offset as usize, &strides);
            Ok(())
        })
    })
}

pub fn concat(xs: &[&Val], axis: usize, out_shape: &[usize]) -> KResult<Val> {
    let dtype = concat_check(xs, axis, out_shape)?;
    crate::with_size!(dtype, U => Val::build::<U>(dtype, out_shape, |out| {
        concat_fill(xs, axis, out_shape, out)
    }))
}

/// `concat` written into `dest` (the arena's buffer or the caller's output): every element
/// is overwritten, so the buffer needs no zeroing and a graph output needs no extra copy.
pub fn concat_into(xs: &[&Val], axis: usize, dest: &mut Dest) -> KResult<()> {
    let shape = dest.shape.clone();
    let dtype = concat_check(xs, axis, &shape)?;
    if dtype != dest.dtype {
        return Err(CpuError::Internal(format!(
            "concat of {dtype} into {}",
            dest.dtype
        )));
    }
    crate::with_size!(dtype, U => concat_fill(xs, axis, &shape, dest.slice::<U>()?))
}

fn concat_fill<U: Copy>(
    xs: &[&Val],
    axis: usize,
    out_shape: &[usize],
    out: &mut [U],
) -> KResult<()> {
    let strides: Vec<isize> = contiguous_strides(out_shape)
        .into_iter()
        .map(|s| s as isize)
        .collect();
    let mut at = 0usize;
    for x in xs {
        copy_into(&x.view::<U>()?, out, at * strides[axis] as usize, &strides);
        at += x.shape()[axis];
    }
    Ok(())
}

/// `CacheAppend` written into `dest`: per sequence b, along `axis`, past's entries before
/// `lengths[b]` (zeros past P), new's S entries from there, zeros after. Whole row blocks
/// are copied; only rows no input covers are zeroed (none, for a cache that grows by S).
pub fn cache_append_into(
    past: &Val,
    new: &Val,
    lengths: &Val,
    axis: usize,
    dest: &mut Dest,
) -> KResult<()> {
    let shape = dest.shape.clone();
    let r = shape.len();
    let fits = |x: &Val| {
        x.dtype == dest.dtype
            && x.shape().len() == r
            && (0..r).all(|d| d == axis || x.shape()[d] == shape[d])
    };
    if axis == 0 || axis >= r || !fits(past) || !fits(new) || lengths.shape() != [shape[0]] {
        return Err(CpuError::Shape(format!(
            "cache_append of {:?} and {:?} with lengths {:?} into {:?} on axis {axis}",
            past.shape(),
            new.shape(),
            lengths.shape(),
            shape
        )));
    }
    if lengths.dtype.is_float() || lengths.dtype == DType::Bool {
        return Err(CpuError::Shape(format!(
            "cache_append lengths of dtype {}",
            lengths.dtype
        )));
    }
    let at: Vec<i64> = crate::with_dtype!(lengths.dtype, T => {
        lengths.to_vec::<T>()?.into_iter().map(T::to_i64).collect()
    });
    let (p, s, len) = (past.shape()[axis], new.shape()[axis], shape[axis]);
    let strides: Vec<isize> = contiguous_strides(&shape)
        .into_iter()
        .map(|s| s as isize)
        .collect();
    let (row, outer) = (
        strides[axis] as usize,
        shape[1..axis].iter().product::<usize>(),
    );
    crate::with_size!(dest.dtype, U => {
        let out = dest.slice::<U>()?;
        for (b, &first) in at.iter().enumerate() {
            let base = b * strides[0] as usize;
            // Rows [0, kept) from past, [lo, hi) from new, zeros elsewhere.
            let kept = first.clamp(0, p.min(len) as i64) as usize;
            let lo = first.clamp(0, len as i64) as usize;
            let hi = first.saturating_add(s as i64).clamp(lo as i64, len as i64) as usize;
            let one = |x: &Val, from: usize, to: usize| -> KResult<Val> {
                let x = slice(x, 0, b as i64, b as i64 + 1, 1)?;
                slice(&x, axis, from as i64, to as i64, 1)
            };
            if kept > 0 {
                copy_into(&one(past, 0, kept)?.view::<U>()?, out, base, &strides);
            }
            if hi > lo {
                let skip = (lo as i64 - first) as usize;
                let rows = one(new, skip, skip + hi - lo)?;
                copy_into(&rows.view::<U>()?, out, base + lo * row, &strides);
            }
            for (from, to) in [(kept, lo), (hi, len)] {
                for o in 0..outer * (to > from) as usize {
                    let at = base + o * len * row;
                    out[at + from * row..at + to * row].fill(U::default());
                }
            }
        }
    });
    Ok(())
}

/// The common dtype of a concat's inputs, after checking they fit `out_shape`.
fn concat_check(xs: &[&Val], axis: usize, out_shape: &[usize]) -> KResult<DType> {
    let dtype = xs
        .first()
        .map(|x| x.dtype)
        .ok_or_else(|| CpuError::Shape("concat of nothing".into()))?;
    let mut total = 0;
    for x in xs {
        let s = x.shape();
        let fits = x.dtype == dtype
            && s.len() == out_shape.len()
            && axis < s.len()
            && s.iter()
                .zip(out_shape)
                .enumerate()
                .all(|(d, (a, b))| d == axis || a == b);
        if !fits {
            return Err(CpuError::Shape(format!(
                "concat of {s:?} into {out_shape:?}"
            )));
        }
        total += s[axis];
    }
    if total != out_shape[axis] {
        return Err(CpuError::Shape(format!(
            "concat sizes add to {total}, not {}",
            out_shape[axis]
        )));
    }
    Ok(dtype)
}
