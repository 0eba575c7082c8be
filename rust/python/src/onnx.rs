//! `load_onnx`: reads and translates an ONNX model into the same `Program` the PT2 path
//! returns. Initializers are loaded into Rust-owned weights.

use std::sync::Arc;

use pyo3::prelude::*;

use ember_core::frontend::onnx;
use ember_core::Error;

use crate::{guard, Program};

/// Reads and translates an ONNX model from a path or from serialized bytes.
#[pyfunction]
#[pyo3(signature = (path=None, data=None))]
pub fn load_onnx(py: Python<'_>, path: Option<String>, data: Option<Vec<u8>>) -> PyResult<Program> {
    let program = py.detach(|| {
        guard(|| match (&path, &data) {
            (Some(p), None) => onnx::load(onnx::Source::Path(std::path::Path::new(p))),
            (None, Some(d)) => onnx::load(onnx::Source::Bytes(d)),
            _ => Err(Error::Compile("pass exactly one of path and data".into())),
        })
    })?;
    Ok(Program {
        inner: Arc::new(program),
    })
}
