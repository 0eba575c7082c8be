//! ONNX element types and `TensorProto` payloads → Ember dtypes and little-endian bytes.

use super::external::ExternalData;
use super::proto::TensorProto;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// Tensors larger than this are refused: a corrupt or hostile file must not make Ember try
/// to allocate terabytes.
pub const MAX_TENSOR_BYTES: usize = 1 << 34;

/// An ONNX `TensorProto.DataType` code → Ember dtype.
pub fn dtype_from_onnx(code: i32, what: &str) -> Result<DType> {
    Ok(match code {
        1 => DType::F32,
        2 => DType::U8,
        3 => DType::I8,
        5 => DType::I16,
        6 => DType::I32,
        7 => DType::I64,
        9 => DType::Bool,
        10 => DType::F16,
        11 => DType::F64,
        16 => DType::BF16,
        _ => {
            return Err(Error::unsupported_because(
                format!("element type {}", onnx_type_name(code)),
                what,
                "Ember supports float32/64, float16, bfloat16, int8/16/32/64, uint8 and bool",
            ))
        }
    })
}

fn onnx_type_name(code: i32) -> String {
    let name = match code {
        0 => "UNDEFINED",
        4 => "UINT16",
        8 => "STRING",
        12 => "UINT32",
        13 => "UINT64",
        14 => "COMPLEX64",
        15 => "COMPLEX128",
        17..=20 => "FLOAT8",
        21 => "UINT4",
        22 => "INT4",
        23 => "FLOAT4E2M1",
        _ => return format!("code {code}"),
    };
    name.to_owned()
}

/// Element count of `dims`, refusing negative dims and sizes past `MAX_TENSOR_BYTES`.
pub fn checked_numel(dims: &[i64], dtype: DType, what: &str) -> Result<usize> {
    let mut n: usize = 1;
    for &d in dims {
        let d = usize::try_from(d)
            .map_err(|_| Error::Compile(format!("tensor '{what}' has a negative dim {d}")))?;
        n = n
            .checked_mul(d)
            .filter(|n| n.saturating_mul(dtype.size()) <= MAX_TENSOR_BYTES)
            .ok_or_else(|| Error::Compile(format!("tensor '{what}' {dims:?} is too large")))?;
    }
    Ok(n)
}

/// A decoded tensor: dtype, shape and contiguous little-endian bytes.
#[derive(Clone, Debug)]
pub struct Decoded {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

/// Decodes a `TensorProto` (raw bytes, typed fields or external data).
pub fn decode(t: &TensorProto, ext: &ExternalData, what: &str) -> Result<Decoded> {
    let name = t.name.as_deref().filter(|n| !n.is_empty()).unwrap_or(what);
    let dtype = dtype_from_onnx(t.data_type.unwrap_or(0), name)?;
    let n = checked_numel(&t.dims, dtype, name)?;
    let shape: Vec<usize> = t.dims.iter().map(|&d| d as usize).collect();
    let want = n * dtype.size();
    let bytes = if t.data_location == Some(1) {
        ext.read(&t.external_data, want, name)?
    } else if let Some(raw) = &t.raw_data {
        raw.clone()
    } else {
        typed_bytes(t, dtype, n, name)?
    };
    if bytes.len() != want {
        return Err(Error::Compile(format!(
            "tensor '{name}' of type {dtype}{shape:?} needs {want} bytes of data, has {}",
            bytes.len()
        )));
    }
    Ok(Decoded {
        dtype,
        shape,
        bytes,
    })
}

/// The typed repeated fields ONNX uses when `raw_data` is absent. Narrow integer types and
/// the 16-bit floats are stored one per `int32_data` entry.
fn typed_bytes(t: &TensorProto, dtype: DType, n: usize, name: &str) -> Result<Vec<u8>> {
    let count = match dtype {
        DType::F32 => t.float_data.len(),
        DType::F64 => t.double_data.len(),
        DType::I64 => t.int64_data.len(),
        _ => t.int32_data.len(),
    };
    if count != n {
        return Err(Error::Compile(format!(
            "tensor '{name}' should hold {n} values, has {count}"
        )));
    }
    let mut out = Vec::with_capacity(n * dtype.size());
    match dtype {
        DType::F32 => t
            .float_data
            .iter()
            .for_each(|v| out.extend(v.to_le_bytes())),
        DType::F64 => t
            .double_data
            .iter()
            .for_each(|v| out.extend(v.to_le_bytes())),
        DType::I64 => t
            .int64_data
            .iter()
            .for_each(|v| out.extend(v.to_le_bytes())),
        DType::I32 => t
            .int32_data
            .iter()
            .for_each(|v| out.extend(v.to_le_bytes())),
        DType::I16 | DType::F16 | DType::BF16 => t
            .int32_data
            .iter()
            .for_each(|&v| out.extend((v as u16).to_le_bytes())),
        DType::I8 | DType::U8 => t.int32_data.iter().for_each(|&v| out.push(v as u8)),
        DType::Bool => t.int32_data.iter().for_each(|&v| out.push((v != 0) as u8)),
    }
    Ok(out)
}

/// Reads a decoded integer tensor's elements as i64 (bool and integer dtypes only).
pub fn ints(d: &Decoded) -> Option<Vec<i64>> {
    let b = &d.bytes;
    Some(match d.dtype {
        DType::I64 => b
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        DType::I32 => b
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as i64)
            .collect(),
        DType::I16 => b
            .chunks_exact(2)
            .map(|c| i16::from_le_bytes(c.try_into().unwrap()) as i64)
            .collect(),
        DType::I8 => b.iter().map(|&v| v as i8 as i64).collect(),
        DType::U8 | DType::Bool => b.iter().map(|&v| v as i64).collect(),
        _ => return None,
    })
}

/// Reads a decoded tensor's elements as f64 (any dtype).
pub fn floats(d: &Decoded) -> Vec<f64> {
    let b = &d.bytes;
    match d.dtype {
        DType::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect(),
        DType::F64 => b
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        DType::F16 => b
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
        DType::BF16 => b
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
        _ => ints(d)
            .unwrap_or_default()
            .into_iter()
            .map(|v| v as f64)
            .collect(),
    }
}
