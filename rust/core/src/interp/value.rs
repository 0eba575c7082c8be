//! The interpreter's tensor: contiguous row-major data, floats held as f64 and integers and
//! bools as i64, always already rounded (or wrapped) to the tensor's dtype.

use half::{bf16, f16};

use crate::dtype::{DType, Kind, Scalar};
use crate::error::{Error, Result};

/// Element storage. Float dtypes use `F`; integer dtypes and bool (0/1) use `I`.
#[derive(Clone, Debug, PartialEq)]
pub enum Data {
    F(Vec<f64>),
    I(Vec<i64>),
}

impl Data {
    pub fn len(&self) -> usize {
        match self {
            Data::F(v) => v.len(),
            Data::I(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements at the given flat positions, in order. Positions must be in range.
    pub(crate) fn pick(&self, idx: &[usize]) -> Data {
        match self {
            Data::F(v) => Data::F(idx.iter().map(|&i| v[i]).collect()),
            Data::I(v) => Data::I(idx.iter().map(|&i| v[i]).collect()),
        }
    }

    /// Like `pick`, with `None` positions taking the single element of `fill`.
    pub(crate) fn pick_or(&self, idx: &[Option<usize>], fill: &Data) -> Option<Data> {
        Some(match (self, fill) {
            (Data::F(v), Data::F(f)) => {
                let f = *f.first()?;
                Data::F(idx.iter().map(|i| i.map_or(f, |i| v[i])).collect())
            }
            (Data::I(v), Data::I(f)) => {
                let f = *f.first()?;
                Data::I(idx.iter().map(|i| i.map_or(f, |i| v[i])).collect())
            }
            _ => return None,
        })
    }

    /// An empty buffer of the same kind.
    pub(crate) fn empty_like(&self, capacity: usize) -> Data {
        match self {
            Data::F(_) => Data::F(Vec::with_capacity(capacity)),
            Data::I(_) => Data::I(Vec::with_capacity(capacity)),
        }
    }

    /// Appends `src[range]`; false when the kinds differ.
    pub(crate) fn extend_from(&mut self, src: &Data, range: std::ops::Range<usize>) -> bool {
        match (self, src) {
            (Data::F(d), Data::F(s)) => d.extend_from_slice(&s[range]),
            (Data::I(d), Data::I(s)) => d.extend_from_slice(&s[range]),
            _ => return false,
        }
        true
    }
}

/// A tensor value: dtype, concrete shape and contiguous row-major data.
#[derive(Clone, Debug, PartialEq)]
pub struct Value {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Data,
}

/// Rounds an f64 to the nearest value of a float dtype (ties to even). f16 and bf16 go
/// through f32, as torch's CPU kernels do (they compute in f32 and convert the result).
pub fn round_float(dtype: DType, x: f64) -> f64 {
    match dtype {
        DType::F32 => x as f32 as f64,
        DType::F16 => f16::from_f32(x as f32).to_f64(),
        DType::BF16 => bf16::from_f32(x as f32).to_f64(),
        _ => x,
    }
}

/// Wraps an i64 to an integer dtype's width (two's complement); bool becomes 0/1.
pub fn wrap_int(dtype: DType, x: i64) -> i64 {
    match dtype {
        DType::Bool => (x != 0) as i64,
        DType::U8 => x as u8 as i64,
        DType::I8 => x as i8 as i64,
        DType::I16 => x as i16 as i64,
        DType::I32 => x as i32 as i64,
        _ => x,
    }
}

/// A float converted to an integer dtype (the IR's `Cast`): truncated toward zero,
/// saturated to int64's range for int64 and to int32's for the narrower types (NaN → 0),
/// then wrapped to the type. Within int32's range that is C's conversion; beyond it C's is
/// undefined, and int32 saturation is what vector conversions do cheaply.
pub fn float_to_int(dtype: DType, x: f64) -> i64 {
    match dtype {
        DType::I64 => x as i64,
        _ => wrap_int(dtype, i64::from(x as i32)),
    }
}

/// An integer converted to a float dtype (through f32 for the narrow types, as torch does).
fn int_to_float(dtype: DType, x: i64) -> f64 {
    match dtype {
        DType::F64 => x as f64,
        _ => round_float(dtype, x as f32 as f64),
    }
}

/// Product of a shape's dims, or `None` on overflow.
pub(crate) fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// Row-major strides (in elements).
pub(crate) fn strides(shape: &[usize]) -> Vec<usize> {
    crate::tensor::contiguous_strides(shape)
}

/// Calls `f` with every multi-index of `shape`, in row-major order (once for rank 0, never
/// when an extent is 0), stopping at the first error.
pub(crate) fn try_for_each_index<E>(
    shape: &[usize],
    mut f: impl FnMut(&[usize]) -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    if shape.contains(&0) {
        return Ok(());
    }
    let mut idx = vec![0usize; shape.len()];
    loop {
        f(&idx)?;
        // Advance the odometer; done when every digit wrapped.
        let mut d = shape.len();
        loop {
            if d == 0 {
                return Ok(());
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// Flat positions of `shape`'s elements mapped through `f` (row-major order of `shape`).
pub(crate) fn map_indices<T, E>(
    shape: &[usize],
    mut f: impl FnMut(&[usize]) -> std::result::Result<T, E>,
) -> std::result::Result<Vec<T>, E> {
    let mut out = Vec::with_capacity(checked_numel(shape).unwrap_or(0));
    try_for_each_index(shape, |idx| {
        out.push(f(idx)?);
        Ok(())
    })?;
    Ok(out)
}

/// Dot product of an index with strides.
pub(crate) fn offset(idx: &[usize], strides: &[usize]) -> usize {
    idx.iter().zip(strides).map(|(i, s)| i * s).sum()
}

impl Value {
    /// Builds a value from data of any kind, converting and rounding it to `dtype`:
    /// float→float rounds to nearest even, float→int truncates toward zero then wraps,
    /// int→int wraps, anything→bool is `x != 0` (NaN → true).
    pub(crate) fn from_data(dtype: DType, shape: Vec<usize>, data: Data) -> Value {
        let data = match (dtype.kind(), data) {
            (Kind::Float, Data::F(v)) => {
                if dtype == DType::F64 {
                    Data::F(v)
                } else {
                    Data::F(v.into_iter().map(|x| round_float(dtype, x)).collect())
                }
            }
            (Kind::Float, Data::I(v)) => {
                Data::F(v.into_iter().map(|x| int_to_float(dtype, x)).collect())
            }
            (Kind::Bool, Data::F(v)) => Data::I(v.into_iter().map(|x| (x != 0.0) as i64).collect()),
            (Kind::Bool, Data::I(v)) => Data::I(v.into_iter().map(|x| (x != 0) as i64).collect()),
            (Kind::Int, Data::F(v)) => {
                Data::I(v.into_iter().map(|x| float_to_int(dtype, x)).collect())
            }
            (Kind::Int, Data::I(v)) => {
                if dtype == DType::I64 {
                    Data::I(v)
                } else {
                    Data::I(v.into_iter().map(|x| wrap_int(dtype, x)).collect())
                }
            }
        };
        Value { dtype, shape, data }
    }

    /// `n` copies of a scalar converted to `dtype` (as `Full` and `Pad` do).
    pub(crate) fn splat(dtype: DType, shape: Vec<usize>, n: usize, s: Scalar) -> Value {
        let data = match s {
            Scalar::Float(f) => Data::F(vec![f; n]),
            Scalar::Int(i) => Data::I(vec![i; n]),
            Scalar::Bool(b) => Data::I(vec![b as i64; n]),
        };
        Value::from_data(dtype, shape, data)
    }

    /// Reads little-endian, contiguous bytes.
    pub fn from_bytes(dtype: DType, shape: Vec<usize>, bytes: &[u8]) -> Result<Value> {
        let size = dtype.size();
        let want = checked_numel(&shape).and_then(|n| n.checked_mul(size));
        if want != Some(bytes.len()) {
            return Err(Error::Input(format!(
                "a {dtype} tensor of shape {shape:?} needs {} bytes, got {}",
                want.map_or("too many".to_string(), |w| w.to_string()),
                bytes.len()
            )));
        }
        let chunks = bytes.chunks_exact(size);
        fn arr<const N: usize>(c: &[u8]) -> [u8; N] {
            let mut a = [0u8; N];
            a.copy_from_slice(c);
            a
        }
        let data = match dtype {
            DType::Bool => Data::I(chunks.map(|c| (c[0] != 0) as i64).collect()),
            DType::U8 => Data::I(chunks.map(|c| c[0] as i64).collect()),
            DType::I8 => Data::I(chunks.map(|c| c[0] as i8 as i64).collect()),
            DType::I16 => Data::I(chunks.map(|c| i16::from_le_bytes(arr(c)) as i64).collect()),
            DType::I32 => Data::I(chunks.map(|c| i32::from_le_bytes(arr(c)) as i64).collect()),
            DType::I64 => Data::I(chunks.map(|c| i64::from_le_bytes(arr(c))).collect()),
            DType::F16 => Data::F(
                chunks
                    .map(|c| f16::from_le_bytes(arr(c)).to_f64())
                    .collect(),
            ),
            DType::BF16 => Data::F(
                chunks
                    .map(|c| bf16::from_le_bytes(arr(c)).to_f64())
                    .collect(),
            ),
            DType::F32 => Data::F(chunks.map(|c| f32::from_le_bytes(arr(c)) as f64).collect()),
            DType::F64 => Data::F(chunks.map(|c| f64::from_le_bytes(arr(c))).collect()),
        };
        Ok(Value { dtype, shape, data })
    }

    /// Little-endian, contiguous bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.numel() * self.dtype.size());
        if self.dtype.is_float() {
            for x in self.to_f64_vec() {
                match self.dtype {
                    DType::F16 => out.extend_from_slice(&f16::from_f32(x as f32).to_le_bytes()),
                    DType::BF16 => out.extend_from_slice(&bf16::from_f32(x as f32).to_le_bytes()),
                    DType::F32 => out.extend_from_slice(&(x as f32).to_le_bytes()),
                    _ => out.extend_from_slice(&x.to_le_bytes()),
                }
            }
        } else {
            for x in self.to_i64_vec() {
                match self.dtype {
                    DType::Bool => out.push((x != 0) as u8),
                    DType::U8 | DType::I8 => out.push(x as u8),
                    DType::I16 => out.extend_from_slice(&(x as i16).to_le_bytes()),
                    DType::I32 => out.extend_from_slice(&(x as i32).to_le_bytes()),
                    _ => out.extend_from_slice(&x.to_le_bytes()),
                }
            }
        }
        out
    }

    /// A value from f64s, rounded (floats) or truncated and wrapped (integers) to `dtype`.
    ///
    /// # Panics
    /// If `values.len()` is not the shape's element count (a caller bug, not a data error).
    pub fn from_f64(dtype: DType, shape: Vec<usize>, values: Vec<f64>) -> Value {
        assert_eq!(
            checked_numel(&shape),
            Some(values.len()),
            "Value::from_f64: {shape:?}"
        );
        Value::from_data(dtype, shape, Data::F(values))
    }

    /// A value from i64s, wrapped (integers) or converted (floats) to `dtype`.
    ///
    /// # Panics
    /// If `values.len()` is not the shape's element count (a caller bug, not a data error).
    pub fn from_i64(dtype: DType, shape: Vec<usize>, values: Vec<i64>) -> Value {
        assert_eq!(
            checked_numel(&shape),
            Some(values.len()),
            "Value::from_i64: {shape:?}"
        );
        Value::from_data(dtype, shape, Data::I(values))
    }

    pub fn to_f64_vec(&self) -> Vec<f64> {
        match &self.data {
            Data::F(v) => v.clone(),
            Data::I(v) => v.iter().map(|&x| x as f64).collect(),
        }
    }

    /// Elements as i64 (floats truncated toward zero).
    pub fn to_i64_vec(&self) -> Vec<i64> {
        match &self.data {
            Data::F(v) => v.iter().map(|&x| x as i64).collect(),
            Data::I(v) => v.clone(),
        }
    }

    pub fn numel(&self) -> usize {
        self.data.len()
    }

    /// Checks that the data agrees with the dtype and shape and that every element is a value
    /// of the dtype (the fields are public, so a caller can build anything).
    pub(crate) fn check(&self) -> std::result::Result<(), String> {
        self.check_layout()?;
        let canonical = match &self.data {
            Data::F(v) => {
                self.dtype == DType::F64
                    || v.iter()
                        .all(|&x| x.is_nan() || round_float(self.dtype, x) == x)
            }
            Data::I(v) => v.iter().all(|&x| wrap_int(self.dtype, x) == x),
        };
        if !canonical {
            return Err(format!(
                "{} value holds elements that are not {} values",
                self.dtype, self.dtype
            ));
        }
        Ok(())
    }

    /// `check` without the look at every element: the data's kind and length only.
    pub(crate) fn check_layout(&self) -> std::result::Result<(), String> {
        let kind_ok = matches!(
            (&self.data, self.dtype.is_float()),
            (Data::F(_), true) | (Data::I(_), false)
        );
        if !kind_ok {
            return Err(format!("{} value holds data of the wrong kind", self.dtype));
        }
        if checked_numel(&self.shape) != Some(self.data.len()) {
            return Err(format!(
                "value of shape {:?} holds {} elements",
                self.shape,
                self.data.len()
            ));
        }
        Ok(())
    }
}
