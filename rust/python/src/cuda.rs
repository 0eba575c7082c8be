//! Python entry points of the CUDA backend that work without a GPU: generated source and
//! NVRTC compilation (what the `nvrtc` tests check in CI).

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::{guard, Program};

/// The CUDA source generated for a program: `{"source", "kernels", "steps"}`.
#[pyfunction]
pub fn cuda_codegen<'py>(py: Python<'py>, program: &Program) -> PyResult<Bound<'py, PyDict>> {
    let kp = guard(|| Ok(ember_cuda::codegen::generate(&program.inner.graph)?))?;
    let d = PyDict::new(py);
    d.set_item("source", kp.cuda_source())?;
    let names: Vec<String> = kp.kernels.iter().map(|k| k.name.clone()).collect();
    d.set_item("kernels", names)?;
    d.set_item("steps", kp.steps.len())?;
    Ok(d)
}

/// Compiles CUDA source with NVRTC for `arch` ("sm_90"); returns the CUBIN's size in bytes.
#[pyfunction]
pub fn nvrtc_compile(py: Python<'_>, source: &str, arch: &str) -> PyResult<usize> {
    py.detach(|| guard(|| Ok(ember_cuda::nvrtc::compile(source, arch)?.len())))
}

/// NVRTC's (major, minor) version, or None when libnvrtc cannot be loaded.
#[pyfunction]
pub fn nvrtc_version() -> Option<(i32, i32)> {
    guard(ember_cuda::nvrtc::version).ok()
}

/// The GPUs a working CUDA driver reports: `[(name, "sm_XX")]` (empty without one).
#[pyfunction]
pub fn cuda_devices(py: Python<'_>) -> Vec<(String, String)> {
    py.detach(|| {
        ember_cuda::driver::gpus()
            .into_iter()
            .map(|g| (g.name, g.arch))
            .collect()
    })
}
