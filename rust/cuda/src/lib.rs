//! Ember's CUDA backend.
//!
//! * `codegen`: IR graph → kernels (CUDA C) and launch steps; no GPU needed.
//! * `nvrtc`: compiles a program's kernels to CUBIN for one `sm_XX` (cached by source hash).
//! * `emulate`: runs the generated kernels on the host (a C++ compiler and threads stand in
//!   for the GPU), so CI checks what the kernels compute on machines without a GPU.
//! * `layout`: arena offsets from liveness, scratch and launch sizes, for one or more dim
//!   bindings (a dim bucket).
//! * `exec`: the executor shared by the GPU and the emulator: weights, `meta`, the steps
//!   launched one by one or replayed from a recording (a CUDA graph) per dim bucket.
//! * `device`: the GPU through cudarc (libcuda, libnvrtc, libcublasLt loaded at run time);
//!   `graph`: recordings there (CUDA graphs).

pub mod codegen;
pub mod emulate;
pub mod exec;
pub mod layout;

use ember_core::backend::{Backend, Executable, Weights};
use ember_core::ir::Graph;
use ember_core::Result;

/// The CUDA backend's code run on the host by the emulator (`"cuda-emu"`): a test backend.
pub struct EmulatedCudaBackend;

impl Backend for EmulatedCudaBackend {
    fn name(&self) -> &'static str {
        "cuda-emu"
    }

    fn compile(&self, graph: &Graph, weights: &Weights) -> Result<Box<dyn Executable>> {
        let kp = codegen::generate(graph)?;
        let device = emulate::EmulatedDevice::new(&kp)?;
        Ok(Box::new(exec::Program::new(kp, device, weights)?))
    }
}
pub mod device;
pub mod driver;
pub mod graph;
pub mod nvrtc;

/// The CUDA backend (`"cuda"`): kernels compiled by NVRTC for GPU 0, cuBLASLt products.
pub struct CudaBackend {
    gpu: std::sync::Arc<device::Gpu>,
    /// f32 products may run on TF32 tensor cores (only when the user allows it).
    allow_tf32: bool,
}

impl CudaBackend {
    /// Opens GPU 0; fails clearly where there is no usable GPU, driver or library.
    pub fn new(allow_tf32: bool) -> Result<CudaBackend> {
        Ok(CudaBackend {
            gpu: device::Gpu::get()?,
            allow_tf32,
        })
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn device_name(&self) -> String {
        // TF32 changes results, so programs searched with it are cached apart.
        let tf32 = if self.allow_tf32 { " tf32" } else { "" };
        format!("cuda {} {}{tf32}", self.gpu.name, self.gpu.arch)
    }

    fn compile(&self, graph: &Graph, weights: &Weights) -> Result<Box<dyn Executable>> {
        let kp = codegen::generate(graph)?;
        let device = device::CudaDevice::new(self.gpu.clone(), &kp, self.allow_tf32)?;
        Ok(Box::new(exec::Program::new(kp, device, weights)?))
    }
}
