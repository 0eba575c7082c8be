//! Reading a `.pt2` archive (the zip file `torch.export.save` writes) without executing
//! anything from it: only JSON and raw weight bytes are read; pickled entries are ignored.
//! An archive may come from a stranger, so every path it names is checked to stay inside it.

use std::collections::BTreeMap;
use std::io::{Cursor, Read, Seek};
use std::path::Path;

use serde_json::Value as Json;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::HostTensor;

/// The parts of an archive that Ember uses.
pub struct Archive {
    /// `models/model.json`: the serialized ExportedProgram.
    pub program: Json,
    /// Weights and constants by their fully qualified name (`layer.weight`), when loaded.
    pub tensors: BTreeMap<String, HostTensor>,
}

/// Where to read an archive from.
pub enum Source<'a> {
    Path(&'a Path),
    Bytes(&'a [u8]),
}

/// Opens an archive; `load_tensors = false` skips the weights (a caller that binds live
/// tensors by pointer does not need them).
pub fn read(source: Source<'_>, load_tensors: bool) -> Result<Archive> {
    match source {
        Source::Path(p) => {
            let file = std::fs::File::open(p).map_err(|e| {
                Error::Compile(format!("cannot open archive '{}': {e}", p.display()))
            })?;
            read_zip(std::io::BufReader::new(file), load_tensors)
        }
        Source::Bytes(b) => read_zip(Cursor::new(b), load_tensors),
    }
}

fn bad(msg: impl AsRef<str>) -> Error {
    Error::Compile(format!("invalid .pt2 archive: {}", msg.as_ref()))
}

fn read_zip<R: Read + Seek>(reader: R, load_tensors: bool) -> Result<Archive> {
    let mut zip = zip::ZipArchive::new(reader).map_err(|e| bad(format!("not a zip file ({e})")))?;
    let names: Vec<String> = zip
        .file_names()
        .map(|n| n.map(|n| n.into_owned()))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| bad(format!("unreadable entry name ({e})")))?;
    for n in &names {
        check_entry_name(n)?;
    }
    // Every entry sits under one top-level folder whose name the saver chose.
    let model = names
        .iter()
        .find(|n| n.ends_with("/models/model.json") && n.matches('/').count() == 2)
        .ok_or_else(|| bad("no <name>/models/model.json entry"))?;
    let prefix = model.trim_end_matches("models/model.json").to_owned();
    let program = read_json(&mut zip, model)?;
    let mut tensors = BTreeMap::new();
    if load_tensors {
        for (config, folder) in [
            ("data/weights/model_weights_config.json", "data/weights/"),
            (
                "data/constants/model_constants_config.json",
                "data/constants/",
            ),
        ] {
            let config_name = format!("{prefix}{config}");
            if !names.contains(&config_name) {
                continue;
            }
            let config = read_json(&mut zip, &config_name)?;
            let Some(entries) = config.get("config").and_then(Json::as_object) else {
                return Err(bad(format!("{config_name} has no 'config' object")));
            };
            for (name, entry) in entries {
                let t = read_tensor(&mut zip, &prefix, folder, name, entry)?;
                tensors.insert(name.clone(), t);
            }
        }
    }
    Ok(Archive { program, tensors })
}

/// Entry names must be relative paths without `..` components (zip-slip).
fn check_entry_name(name: &str) -> Result<()> {
    let escapes = name.starts_with('/')
        || name.starts_with('\\')
        || name.contains(':')
        || name.split(['/', '\\']).any(|part| part == "..");
    if escapes {
        return Err(bad(format!("entry '{name}' leaves the archive's folder")));
    }
    Ok(())
}

fn read_entry<R: Read + Seek>(zip: &mut zip::ZipArchive<R>, name: &str) -> Result<Vec<u8>> {
    let mut f = zip
        .by_name(name)
        .map_err(|e| bad(format!("cannot read '{name}': {e}")))?;
    let mut buf = Vec::with_capacity(f.size() as usize);
    f.read_to_end(&mut buf)
        .map_err(|e| bad(format!("cannot read '{name}': {e}")))?;
    Ok(buf)
}

fn read_json<R: Read + Seek>(zip: &mut zip::ZipArchive<R>, name: &str) -> Result<Json> {
    let bytes = read_entry(zip, name)?;
    serde_json::from_slice(&bytes).map_err(|e| bad(format!("'{name}' is not valid JSON: {e}")))
}

fn read_tensor<R: Read + Seek>(
    zip: &mut zip::ZipArchive<R>,
    prefix: &str,
    folder: &str,
    name: &str,
    entry: &Json,
) -> Result<HostTensor> {
    if entry.get("use_pickle").and_then(Json::as_bool) == Some(true) {
        return Err(Error::unsupported_because(
            "pickled tensor",
            name,
            "the archive stores this tensor pickled; Ember never unpickles archive data",
        ));
    }
    let path = entry
        .get("path_name")
        .and_then(Json::as_str)
        .ok_or_else(|| bad(format!("tensor '{name}' has no path_name")))?;
    if path.contains('/') || path.contains('\\') || path == ".." || path.is_empty() {
        return Err(bad(format!(
            "tensor '{name}' path '{path}' leaves its folder"
        )));
    }
    let meta = entry
        .get("tensor_meta")
        .ok_or_else(|| bad(format!("tensor '{name}' has no tensor_meta")))?;
    let element = meta
        .get("dtype")
        .and_then(Json::as_i64)
        .ok_or_else(|| bad(format!("tensor '{name}' has no dtype")))
        .and_then(|code| element_type(code, name))?;
    let (dtype, parts) = match element {
        ElementType::Real(d) => (d, 1),
        ElementType::Complex(d) => (d, 2),
    };
    let sizes = int_list(meta.get("sizes"), name, "sizes")?;
    let strides = int_list(meta.get("strides"), name, "strides")?;
    let offset = meta
        .get("storage_offset")
        .map(|o| int_value(o, name, "storage_offset"))
        .transpose()?
        .unwrap_or(0);
    let raw = read_entry(zip, &format!("{prefix}{folder}{path}"))?;
    let mut shape: Vec<usize> = sizes.iter().map(|&s| s as usize).collect();
    // A complex element is its (real, imaginary) pair, strides counting pairs.
    let bytes = gather_strided(
        &raw,
        dtype.size() * parts,
        &shape,
        &strides,
        offset as usize,
    )
    .ok_or_else(|| bad(format!("tensor '{name}' does not fit its storage")))?;
    if parts == 2 {
        shape.push(2);
    }
    HostTensor::owned(dtype, shape, bytes)
}

/// Copies a strided view of `raw` into contiguous bytes (weights are usually contiguous
/// already, but a saved view of a larger storage is not).
fn gather_strided(
    raw: &[u8],
    esize: usize,
    shape: &[usize],
    strides: &[i64],
    offset: usize,
) -> Option<Vec<u8>> {
    let n: usize = shape.iter().product();
    if strides.len() != shape.len() || strides.iter().any(|&s| s < 0) {
        return None;
    }
    let mut out = Vec::with_capacity(n * esize);
    let mut idx = vec![0usize; shape.len()];
    for _ in 0..n {
        let mut e = offset;
        for (i, &s) in idx.iter().zip(strides) {
            e = e.checked_add(i.checked_mul(s as usize)?)?;
        }
        let start = e.checked_mul(esize)?;
        out.extend_from_slice(raw.get(start..start.checked_add(esize)?)?);
        for d in (0..shape.len()).rev() {
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    Some(out)
}

fn int_value(v: &Json, name: &str, what: &str) -> Result<i64> {
    v.get("as_int")
        .and_then(Json::as_i64)
        .or_else(|| v.as_i64())
        .ok_or_else(|| bad(format!("tensor '{name}' has a non-integer {what}: {v}")))
}

fn int_list(v: Option<&Json>, name: &str, what: &str) -> Result<Vec<i64>> {
    let arr = v
        .and_then(Json::as_array)
        .ok_or_else(|| bad(format!("tensor '{name}' has no {what}")))?;
    arr.iter().map(|x| int_value(x, name, what)).collect()
}

/// A tensor's element type: real, or complex with parts of the given dtype (stored as torch's
/// `view_as_real` lays it out, a trailing dim of 2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElementType {
    Real(DType),
    Complex(DType),
}

/// torch.export's serialized ScalarType code, complex types included.
pub fn element_type(code: i64, what: &str) -> Result<ElementType> {
    Ok(match code {
        9 => ElementType::Complex(DType::F16),
        10 => ElementType::Complex(DType::F32),
        11 => ElementType::Complex(DType::F64),
        _ => ElementType::Real(dtype_from_code(code, what)?),
    })
}

/// torch.export's serialized ScalarType codes of the real types.
pub fn dtype_from_code(code: i64, what: &str) -> Result<DType> {
    Ok(match code {
        1 => DType::U8,
        2 => DType::I8,
        3 => DType::I16,
        4 => DType::I32,
        5 => DType::I64,
        6 => DType::F16,
        7 => DType::F32,
        8 => DType::F64,
        12 => DType::Bool,
        13 => DType::BF16,
        other => {
            return Err(Error::unsupported_because(
                format!("dtype code {other}"),
                what,
                "Ember supports bool, uint8, int8/16/32/64, float16, bfloat16, float32, float64",
            ))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_escaping_entry_names() {
        assert!(check_entry_name("m/models/model.json").is_ok());
        assert!(check_entry_name("m/../../etc/passwd").is_err());
        assert!(check_entry_name("/etc/passwd").is_err());
        assert!(check_entry_name("C:/x").is_err());
    }

    #[test]
    fn gathers_strided_views() {
        // A 2x2 transpose view of [0, 1, 2, 3] (one byte per element).
        let raw = [0u8, 1, 2, 3];
        let out = gather_strided(&raw, 1, &[2, 2], &[1, 2], 0).unwrap();
        assert_eq!(out, vec![0, 2, 1, 3]);
        assert!(gather_strided(&raw, 1, &[3], &[2], 0).is_none());
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(read(Source::Bytes(b"not a zip"), true).is_err());
    }
}
