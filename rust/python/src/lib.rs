//! `ember._core`: the PyO3 glue between the Python package and the Rust crates.
//! Conversions and exception mapping live here; logic lives in the core and backends.
//! Every entry point runs under `guard`, so no Rust panic ever reaches Python.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[cfg(feature = "cuda")]
mod cuda;
mod onnx;

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use ember_core::backend::{Backend, Executable as CoreExecutable, Weights};
use ember_core::dtype::DType;
use ember_core::frontend::pt2::{self, Pt2Program};
use ember_core::ir::Graph;
use ember_core::search::{SearchOptions, SearchReport};
use ember_core::tensor::{HostTensor, TensorOut, TensorView};
use ember_core::Error;

create_exception!(
    _core,
    EmberError,
    PyException,
    "Root of every error Ember raises."
);
create_exception!(
    _core,
    UnsupportedOpError,
    EmberError,
    "An op Ember does not support."
);
create_exception!(
    _core,
    CompileError,
    EmberError,
    "A model Ember could not compile."
);
create_exception!(
    _core,
    ShapeError,
    CompileError,
    "Shapes that do not fit together."
);
create_exception!(
    _core,
    InputError,
    EmberError,
    "Call-time inputs that do not fit the program."
);
create_exception!(
    _core,
    EmberRuntimeError,
    EmberError,
    "A failure while running a program."
);

fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::UnsupportedOp { .. } => UnsupportedOpError::new_err(msg),
        Error::Compile(_) | Error::Io(_) => CompileError::new_err(msg),
        Error::Shape(_) => ShapeError::new_err(msg),
        Error::Input(_) => InputError::new_err(msg),
        Error::Runtime(_) => EmberRuntimeError::new_err(msg),
    }
}

/// Runs `f`, turning an error into its Python exception and a panic into `EmberError`.
pub(crate) fn guard<T>(f: impl FnOnce() -> Result<T, Error>) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r.map_err(to_py),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(EmberError::new_err(format!(
                "internal error in Ember (please report it): {what}"
            )))
        }
    }
}

fn dtype(name: &str) -> PyResult<DType> {
    DType::from_name(name).ok_or_else(|| InputError::new_err(format!("unsupported dtype '{name}'")))
}

/// A caller's buffer: `(address, dtype name, shape)`.
type RawBuffer = (usize, String, Vec<usize>);

/// A translated program, before it is compiled for a backend.
#[pyclass(frozen, module = "ember._core")]
struct Program {
    pub(crate) inner: Arc<Pt2Program>,
}

#[pymethods]
impl Program {
    #[getter]
    fn input_names(&self) -> Vec<String> {
        self.inner.input_names.clone()
    }

    #[getter]
    fn output_names(&self) -> Vec<String> {
        self.inner.output_names.clone()
    }

    /// Positions of the user inputs that are complex tensors (passed as their
    /// `torch.view_as_real` pairs).
    #[getter]
    fn complex_inputs(&self) -> Vec<usize> {
        let flags = &self.inner.complex_inputs;
        (0..flags.len()).filter(|&i| flags[i]).collect()
    }

    /// Dtypes of the user inputs, in call order.
    #[getter]
    fn input_dtypes(&self) -> Vec<String> {
        let g = &self.inner.graph;
        g.inputs
            .iter()
            .map(|&i| g.ty(i).dtype.name().to_owned())
            .collect()
    }

    #[getter]
    fn output_dtypes(&self) -> Vec<String> {
        let g = &self.inner.graph;
        g.outputs
            .iter()
            .map(|&i| g.ty(i).dtype.name().to_owned())
            .collect()
    }

    /// `(name, dtype, shape)` of every weight the program reads.
    #[getter]
    fn weight_specs(&self) -> Vec<(String, String, Vec<usize>)> {
        self.inner
            .weight_specs
            .iter()
            .map(|(n, d, s)| (n.clone(), d.name().to_owned(), s.clone()))
            .collect()
    }

    /// Names of weights that were loaded from the archive itself.
    #[getter]
    fn loaded_weights(&self) -> Vec<String> {
        self.inner.weights.keys().cloned().collect()
    }

    #[getter]
    fn num_nodes(&self) -> usize {
        self.inner.graph.nodes.len()
    }

    /// The IR in its readable text form.
    fn ir(&self) -> String {
        self.inner.graph.to_string()
    }
}

/// Reads and translates a `.pt2` archive from a path or from bytes.
#[pyfunction]
#[pyo3(signature = (path=None, data=None, load_weights=true))]
fn load_pt2(
    py: Python<'_>,
    path: Option<String>,
    data: Option<Vec<u8>>,
    load_weights: bool,
) -> PyResult<Program> {
    let program = py.detach(|| {
        guard(|| match (&path, &data) {
            (Some(p), None) => pt2::load(pt2::Source::Path(std::path::Path::new(p)), load_weights),
            (None, Some(d)) => pt2::load(pt2::Source::Bytes(d), load_weights),
            _ => Err(Error::Compile("pass exactly one of path and data".into())),
        })
    })?;
    Ok(Program {
        inner: Arc::new(program),
    })
}

/// Whether the PT2 frontend translates the op `target` (serialized form, e.g.
/// `torch.ops.aten.add.Tensor`); the torch.compile backend partitions graphs with it.
#[pyfunction]
fn pt2_supports(target: &str) -> bool {
    pt2::supports(target)
}

/// Turns per-step timing of CPU programs on or off (see `ember.profile_cpu`).
#[pyfunction]
fn cpu_profile_enable(on: bool) {
    ember_cpu::profile::set_enabled(on);
}

/// The per-step timings gathered so far, slowest first: (label, output shape, seconds,
/// steps), and a fresh table started.
#[pyfunction]
fn cpu_profile_take() -> Vec<ember_cpu::profile::Row> {
    ember_cpu::profile::take()
}

/// Which backend a program is compiled for, and its settings (kept to compile again).
#[derive(Clone)]
struct BackendChoice {
    name: String,
    num_threads: usize,
    /// f32 products may use TF32 tensor cores (CUDA; ~10-bit mantissa inputs).
    allow_tf32: bool,
    /// Weights the CUDA backends read where they are in device memory (torch's CUDA
    /// parameters; for the emulator, host memory), by name.
    #[cfg(feature = "cuda")]
    device_weights: Arc<ember_cuda::exec::DeviceWeights>,
}

impl BackendChoice {
    /// This choice with `weights` (`(device address, dtype, shape)` by name) read where
    /// they are in device memory; `None` keeps the current ones.
    fn with_device_weights(
        &self,
        weights: Option<HashMap<String, RawBuffer>>,
    ) -> PyResult<BackendChoice> {
        let Some(weights) = weights else {
            return Ok(self.clone());
        };
        #[cfg(feature = "cuda")]
        {
            if !self.name.starts_with("cuda") {
                return Err(PyValueError::new_err(format!(
                    "device weights need a CUDA backend, not '{}'",
                    self.name
                )));
            }
            let mut on_device = ember_cuda::exec::DeviceWeights::new();
            for (name, (addr, dt, shape)) in weights {
                let dtype = dtype(&dt)?;
                let addr = addr as u64;
                on_device.insert(name, ember_cuda::exec::DeviceWeight { addr, dtype, shape });
            }
            Ok(BackendChoice {
                device_weights: Arc::new(on_device),
                ..self.clone()
            })
        }
        #[cfg(not(feature = "cuda"))]
        {
            if weights.is_empty() {
                return Ok(self.clone());
            }
            Err(PyValueError::new_err(
                "device weights need the CUDA backend, which this build does not have",
            ))
        }
    }

    fn has_device_weight(&self, name: &str) -> bool {
        #[cfg(feature = "cuda")]
        {
            self.device_weights.contains_key(name)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = name;
            false
        }
    }

    fn make(&self) -> PyResult<Box<dyn Backend>> {
        let num_threads = self.num_threads;
        match self.name.as_str() {
            // Starting a thread pool can fail (and panic) when the OS refuses threads.
            "cpu" => {
                guard(|| Ok(Box::new(ember_cpu::CpuBackend::new(num_threads)) as Box<dyn Backend>))
            }
            "reference" => Ok(Box::new(ember_core::interp::ReferenceBackend)),
            #[cfg(feature = "cuda")]
            "cuda-emu" => Ok(Box::new(ember_cuda::EmulatedCudaBackend {
                device_weights: self.device_weights.clone(),
            })),
            #[cfg(feature = "cuda")]
            "cuda" => guard(|| {
                let backend = ember_cuda::CudaBackend::new(self.allow_tf32)?;
                let backend = backend.with_device_weights(self.device_weights.clone());
                Ok(Box::new(backend) as Box<dyn Backend>)
            }),
            other => Err(CompileError::new_err(format!(
                "unknown backend '{other}'; available: cpu, reference{}",
                if cfg!(feature = "cuda") {
                    ", cuda-emu"
                } else {
                    ""
                }
            ))),
        }
    }
}

/// A program compiled for one backend; callable from several threads at once.
#[pyclass(frozen, module = "ember._core")]
struct Executable {
    inner: Box<dyn CoreExecutable>,
    graph: Arc<Pt2Program>,
    backend: BackendChoice,
    /// The program the optimizer adopted (the input program when it adopted none).
    optimized: Graph,
    report: SearchReport,
}

#[pymethods]
impl Executable {
    #[getter]
    fn backend(&self) -> String {
        self.backend.name.clone()
    }

    /// The program that runs (after optimization), as text.
    fn ir(&self) -> String {
        self.optimized.to_string()
    }

    /// How runs went, by counter name (CUDA: `replayed`, `recorded`, `patched`, `direct`);
    /// empty for backends that keep no counters.
    fn run_stats(&self) -> HashMap<String, u64> {
        self.inner
            .run_stats()
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect()
    }

    /// What the optimizer did, as plain Python data (see `ember.SearchReport`).
    fn report<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        report_dict(py, &self.report)
    }

    /// The same optimized program compiled again with new weight buffers (no new search):
    /// for weights changed in place after compiling.
    #[pyo3(signature = (weights=None, device_weights=None))]
    fn rebind(
        &self,
        py: Python<'_>,
        weights: Option<HashMap<String, RawBuffer>>,
        device_weights: Option<HashMap<String, RawBuffer>>,
    ) -> PyResult<Executable> {
        let backend = self.backend.with_device_weights(device_weights)?;
        let bound = bind_weights(&self.graph, weights, &backend)?;
        let backend_impl = backend.make()?;
        let exe = py.detach(|| guard(|| backend_impl.compile(&self.optimized, &bound)))?;
        Ok(Executable {
            inner: exe,
            graph: self.graph.clone(),
            backend,
            optimized: self.optimized.clone(),
            report: self.report.clone(),
        })
    }

    /// `(output, input)` index pairs whose output may be written into the input's own
    /// memory (a cache updated in place; see `Executable::in_place_outputs`).
    fn in_place_outputs(&self) -> Vec<(usize, usize)> {
        self.inner.in_place_outputs()
    }

    /// Output shapes for the given input shapes (raises `InputError` when they do not fit).
    fn output_shapes(&self, py: Python<'_>, shapes: Vec<Vec<usize>>) -> PyResult<Vec<Vec<usize>>> {
        py.detach(|| guard(|| self.inner.output_shapes(&shapes)))
    }

    /// Runs on raw buffers: inputs `(ptr, dtype, shape, strides)`, outputs `(ptr, dtype,
    /// shape)`, both in elements. The caller keeps every buffer alive for the call.
    fn run(
        &self,
        py: Python<'_>,
        inputs: Vec<(usize, String, Vec<usize>, Vec<usize>)>,
        outputs: Vec<(usize, String, Vec<usize>)>,
    ) -> PyResult<()> {
        let g: &Graph = &self.graph.graph;
        if inputs.len() != g.inputs.len() || outputs.len() != g.outputs.len() {
            return Err(InputError::new_err(format!(
                "expected {} inputs and {} outputs, got {} and {}",
                g.inputs.len(),
                g.outputs.len(),
                inputs.len(),
                outputs.len()
            )));
        }
        let mut views = Vec::with_capacity(inputs.len());
        for (k, (ptr, dt, shape, strides)) in inputs.into_iter().enumerate() {
            let dt = dtype(&dt)?;
            let want = g.ty(g.inputs[k]).dtype;
            if dt != want {
                return Err(InputError::new_err(format!(
                    "input {k} ('{}') should be {want}, got {dt}",
                    self.graph.input_names.get(k).cloned().unwrap_or_default()
                )));
            }
            if strides.len() != shape.len() {
                return Err(InputError::new_err(format!(
                    "input {k}: strides do not match shape"
                )));
            }
            views.push(TensorView {
                ptr: ptr as *const u8,
                dtype: dt,
                shape,
                strides,
            });
        }
        let mut outs = Vec::with_capacity(outputs.len());
        for (k, (ptr, dt, shape)) in outputs.into_iter().enumerate() {
            let dt = dtype(&dt)?;
            if dt != g.ty(g.outputs[k]).dtype {
                return Err(InputError::new_err(format!(
                    "output {k} has the wrong dtype {dt}"
                )));
            }
            outs.push(TensorOut {
                ptr: ptr as *mut u8,
                dtype: dt,
                shape,
            });
        }
        let views = SendPtrs(views, outs);
        py.detach(move || {
            let SendPtrs(views, outs) = views;
            // SAFETY: the Python caller passes live buffers of the stated sizes (CompiledModel
            // allocates the outputs itself from `output_shapes`).
            guard(|| unsafe { self.inner.run(&views, &outs) })
        })
    }

    /// Runs on device memory (torch CUDA tensors): inputs `(ptr, dtype, shape)` contiguous,
    /// outputs `(ptr, dtype, shape)` of the shapes `output_shapes` gives, work queued on
    /// `stream` (torch's current stream). The caller keeps every buffer alive for the call.
    fn run_device(
        &self,
        py: Python<'_>,
        inputs: Vec<(usize, String, Vec<usize>)>,
        outputs: Vec<(usize, String, Vec<usize>)>,
        stream: usize,
    ) -> PyResult<()> {
        let g: &Graph = &self.graph.graph;
        for (k, (_, dt, _)) in inputs.iter().enumerate() {
            let dt = dtype(dt)?;
            let want = g.inputs.get(k).map(|&i| g.ty(i).dtype);
            if want.is_some_and(|w| w != dt) {
                return Err(InputError::new_err(format!(
                    "input {k} should be {}, got {dt}",
                    want.map(|w| w.to_string()).unwrap_or_default()
                )));
            }
        }
        let shapes: Vec<Vec<usize>> = inputs.iter().map(|i| i.2.clone()).collect();
        let ins: Vec<u64> = inputs.iter().map(|i| i.0 as u64).collect();
        let outs: Vec<u64> = outputs.iter().map(|o| o.0 as u64).collect();
        py.detach(|| {
            // SAFETY: the Python caller passes live device tensors of the stated shapes.
            guard(|| unsafe { self.inner.run_device(&shapes, &ins, &outs, stream as u64) })
        })
    }
}

/// Raw views crossing into the GIL-free section.
struct SendPtrs(Vec<TensorView>, Vec<TensorOut>);

/// The weights a program reads: `weights` maps names to live buffers `(ptr, dtype, shape)`
/// the caller keeps alive as long as the executable; the rest come from the archive.
fn bind_weights(
    prog: &Pt2Program,
    weights: Option<HashMap<String, RawBuffer>>,
    backend: &BackendChoice,
) -> PyResult<Weights> {
    let mut bound: Weights = prog.weights.clone();
    for (name, (ptr, dt, shape)) in weights.unwrap_or_default() {
        let dt = dtype(&dt)?;
        // SAFETY: the caller (CompiledModel) holds the tensor for the executable's lifetime.
        bound.insert(name, unsafe { HostTensor::external(dt, shape, ptr) });
    }
    for (name, dt, shape) in &prog.weight_specs {
        match bound.get(name) {
            // Read where it is on the device (checked against the graph when compiled).
            None if backend.has_device_weight(name) => {}
            None => {
                return Err(CompileError::new_err(format!(
                    "weight '{name}' was not provided"
                )))
            }
            Some(t) if t.dtype != *dt || &t.shape != shape => {
                return Err(CompileError::new_err(format!(
                    "weight '{name}' should be {dt}{shape:?}, got {}{:?}",
                    t.dtype, t.shape
                )))
            }
            _ => {}
        }
    }
    Ok(bound)
}

/// Compiles a program for a backend, binding weights once (see `bind_weights`). The
/// optimizer searches up to `search_iterations` candidate programs (0: none) within
/// `time_budget_s`, measuring them on inputs shaped like `input_shapes` (needed when the
/// program has symbolic dims), and caches its choice under `cache_dir` when given.
/// `allow_tf32` lets the CUDA backend multiply f32 on TF32 tensor cores.
#[pyfunction]
#[pyo3(signature = (program, backend="cpu", weights=None, num_threads=1, search_iterations=8,
    time_budget_s=3.0, seed=0, input_shapes=None, cache_dir=None, allow_tf32=false,
    device_weights=None))]
#[allow(clippy::too_many_arguments)]
fn compile(
    py: Python<'_>,
    program: &Program,
    backend: &str,
    weights: Option<HashMap<String, RawBuffer>>,
    num_threads: usize,
    search_iterations: usize,
    time_budget_s: f64,
    seed: u64,
    input_shapes: Option<Vec<Vec<usize>>>,
    cache_dir: Option<String>,
    allow_tf32: bool,
    device_weights: Option<HashMap<String, RawBuffer>>,
) -> PyResult<Executable> {
    let prog = program.inner.clone();
    let choice = BackendChoice {
        name: backend.to_owned(),
        num_threads: num_threads.max(1),
        allow_tf32,
        #[cfg(feature = "cuda")]
        device_weights: Arc::default(),
    }
    .with_device_weights(device_weights)?;
    let bound = bind_weights(&prog, weights, &choice)?;
    let backend_impl = choice.make()?;
    if !(time_budget_s.is_finite() && time_budget_s >= 0.0) {
        return Err(PyValueError::new_err(format!(
            "time_budget_s must be a non-negative number, got {time_budget_s}"
        )));
    }
    let opts = SearchOptions {
        // Searching the reference interpreter would only time the oracle against itself, and
        // the emulator's timings say nothing about a GPU.
        iterations: if backend == "reference" || backend == "cuda-emu" {
            0
        } else {
            search_iterations
        },
        time_budget: Duration::from_secs_f64(time_budget_s),
        seed,
        input_shapes,
        cache_dir: cache_dir.map(PathBuf::from),
        ..SearchOptions::default()
    };
    let done = py.detach(|| {
        guard(|| ember_core::search::optimize(&prog.graph, backend_impl.as_ref(), &bound, &opts))
    })?;
    Ok(Executable {
        inner: done.executable,
        graph: prog,
        backend: choice,
        optimized: done.graph,
        report: done.report,
    })
}

/// The report as a dict of plain Python values.
fn report_dict<'py>(py: Python<'py>, r: &SearchReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let s = &r.saturation;
    d.set_item("egraph_nodes", s.egraph_nodes)?;
    d.set_item("iterations", s.iterations)?;
    d.set_item("fixed_point", s.fixed_point)?;
    d.set_item("stop_reason", &s.stop_reason)?;
    d.set_item("saturation_time_s", s.time_s)?;
    let fired = PyDict::new(py);
    for (k, v) in &s.rules_fired {
        fired.set_item(k, v)?;
    }
    d.set_item("rules_fired", fired)?;
    let cands = PyList::empty(py);
    for c in &r.candidates {
        let cd = PyDict::new(py);
        cd.set_item("description", &c.description)?;
        cd.set_item("cost", c.cost)?;
        cd.set_item("time_s", c.time_s)?;
        cd.set_item("verified", c.verified)?;
        cd.set_item("error", &c.error)?;
        cands.append(cd)?;
    }
    d.set_item("candidates", cands)?;
    d.set_item("chosen", r.chosen)?;
    d.set_item("cache_hit", r.cache_hit)?;
    d.set_item("note", &r.note)?;
    d.set_item("clock", &r.clock)?;
    d.set_item("time_s", r.time_s)?;
    Ok(d)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("EmberError", py.get_type::<EmberError>())?;
    m.add("UnsupportedOpError", py.get_type::<UnsupportedOpError>())?;
    m.add("CompileError", py.get_type::<CompileError>())?;
    m.add("ShapeError", py.get_type::<ShapeError>())?;
    m.add("InputError", py.get_type::<InputError>())?;
    m.add("EmberRuntimeError", py.get_type::<EmberRuntimeError>())?;
    m.add_class::<Program>()?;
    m.add_class::<Executable>()?;
    m.add_function(wrap_pyfunction!(load_pt2, m)?)?;
    m.add_function(wrap_pyfunction!(pt2_supports, m)?)?;
    m.add_function(wrap_pyfunction!(onnx::load_onnx, m)?)?;
    m.add_function(wrap_pyfunction!(compile, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_profile_enable, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_profile_take, m)?)?;
    m.add("cuda_built", cfg!(feature = "cuda"))?;
    #[cfg(feature = "cuda")]
    {
        m.add_function(wrap_pyfunction!(cuda::cuda_codegen, m)?)?;
        m.add_function(wrap_pyfunction!(cuda::nvrtc_compile, m)?)?;
        m.add_function(wrap_pyfunction!(cuda::nvrtc_version, m)?)?;
        m.add_function(wrap_pyfunction!(cuda::cuda_devices, m)?)?;
        m.add_function(wrap_pyfunction!(cuda::cuda_product_tuning, m)?)?;
    }
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("BUILD_ID", ember_core::BUILD_ID)?;
    Ok(())
}
