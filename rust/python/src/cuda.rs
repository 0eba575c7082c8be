//! Python entry points of the CUDA backend that work without a GPU: generated source and
//! NVRTC compilation (what the `nvrtc` tests check in CI).

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::{guard, Program};

/// The CUDA source generated for a program: `{"source", "kernels", "steps"}`; with
/// `choice` (a CUDA lowering choice such as "cuda.warp_dot"), as if the optimizer had taken
/// it wherever it applies.
#[pyfunction]
#[pyo3(signature = (program, choice=None))]
pub fn cuda_codegen<'py>(
    py: Python<'py>,
    program: &Program,
    choice: Option<&str>,
) -> PyResult<Bound<'py, PyDict>> {
    let kp = guard(|| {
        let graph = match choice {
            Some(kernel) => ember_cuda::with_choice(&program.inner.graph, kernel)?,
            None => program.inner.graph.clone(),
        };
        Ok(ember_cuda::codegen::generate(&graph)?)
    })?;
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

/// The matrix-product shapes the CUDA backend measured (`products.rs`): a list of
/// `{"product", "candidates": [(name, median µs or None)], "chosen"}`, oldest first.
#[pyfunction]
pub fn cuda_product_tuning<'py>(py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
    let tunings = py.detach(|| guard(|| Ok(ember_cuda::product_tuning())))?;
    tunings
        .into_iter()
        .map(|t| {
            let d = PyDict::new(py);
            d.set_item("product", t.product)?;
            d.set_item("candidates", t.candidates)?;
            d.set_item("chosen", t.chosen)?;
            Ok(d)
        })
        .collect()
}
