//! External tensor data: files next to the model, named by `location` relative to its folder.
//! A location that leaves the folder (`..`, an absolute path, a symlink pointing out) is
//! refused: a model file must not make Ember read arbitrary files.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Component, Path, PathBuf};

use super::proto::StringStringEntryProto;
use crate::error::{Error, Result};

/// Where external data may be read from: the model's folder, or nowhere for in-memory models.
#[derive(Clone)]
pub struct ExternalData {
    base: Option<PathBuf>,
}

impl ExternalData {
    pub fn new(model_path: Option<&Path>) -> ExternalData {
        let base = model_path.map(|p| match p.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        });
        ExternalData { base }
    }

    /// Reads `want` bytes as described by a tensor's `external_data` entries.
    pub fn read(
        &self,
        entries: &[StringStringEntryProto],
        want: usize,
        tensor: &str,
    ) -> Result<Vec<u8>> {
        let get = |k: &str| {
            entries
                .iter()
                .find(|e| e.key.as_deref() == Some(k))
                .and_then(|e| e.value.clone())
        };
        let location = get("location").ok_or_else(|| {
            Error::Compile(format!(
                "tensor '{tensor}' has external data without a location"
            ))
        })?;
        let parse = |k: &str| -> Result<Option<u64>> {
            get(k)
                .map(|v| {
                    v.parse::<u64>().map_err(|_| {
                        Error::Compile(format!("tensor '{tensor}': external data {k} '{v}'"))
                    })
                })
                .transpose()
        };
        let offset = parse("offset")?.unwrap_or(0);
        let length = parse("length")?;
        if let Some(len) = length {
            if len != want as u64 {
                return Err(Error::Compile(format!(
                    "tensor '{tensor}': external data length {len} but the tensor needs {want} bytes"
                )));
            }
        }
        let Some(base) = &self.base else {
            return Err(Error::Compile(format!(
                "tensor '{tensor}' keeps its data in the external file '{location}'; load the \
                 model from its path (not from bytes) so that Ember can find it"
            )));
        };
        let path = resolve_inside(base, &location, tensor)?;
        let mut file = std::fs::File::open(&path).map_err(|e| {
            Error::Compile(format!(
                "tensor '{tensor}': cannot open external data file '{location}': {e}"
            ))
        })?;
        let size = file.metadata()?.len();
        let fits = matches!(offset.checked_add(want as u64), Some(end) if end <= size);
        if !fits {
            return Err(Error::Compile(format!(
                "tensor '{tensor}': external data file '{location}' has {size} bytes, too few \
                 for {want} bytes at offset {offset}"
            )));
        }
        file.seek(SeekFrom::Start(offset))?;
        let mut bytes = vec![0u8; want];
        file.read_exact(&mut bytes)?;
        Ok(bytes)
    }
}

/// `base/location`, refusing anything that resolves outside `base`.
fn resolve_inside(base: &Path, location: &str, tensor: &str) -> Result<PathBuf> {
    let refuse = |why: &str| {
        Error::Compile(format!(
            "tensor '{tensor}': external data location '{location}' {why}; it must name a \
             file inside the model's folder"
        ))
    };
    let rel = Path::new(location);
    if location.is_empty() || location.contains('\0') {
        return Err(refuse("is not a file name"));
    }
    for c in rel.components() {
        match c {
            Component::Normal(_) | Component::CurDir => {}
            Component::ParentDir => return Err(refuse("contains '..'")),
            Component::RootDir | Component::Prefix(_) => return Err(refuse("is absolute")),
        }
    }
    let joined = base.join(rel);
    // Symlinks (of the file or of a folder on the way) may still lead out of the folder.
    let real_base = base
        .canonicalize()
        .map_err(|e| Error::Compile(format!("cannot resolve the model's folder: {e}")))?;
    let real = joined.canonicalize().map_err(|e| {
        Error::Compile(format!(
            "tensor '{tensor}': cannot open external data file '{location}': {e}"
        ))
    })?;
    if !real.starts_with(&real_base) {
        return Err(refuse(
            "points outside the model's folder (through a symlink)",
        ));
    }
    Ok(real)
}
