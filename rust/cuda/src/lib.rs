//! Ember's CUDA backend.
//!
//! * `codegen`: IR graph → kernels (CUDA C) and launch steps; no GPU needed.
//! * `nvrtc`: compiles a program's kernels to CUBIN for one `sm_XX` (cached by source hash).
//! * `emulate`: runs the generated kernels on the host (a C++ compiler and threads stand in
//!   for the GPU), so CI checks what the kernels compute on machines without a GPU.
//! * `exec`: the executor shared by the GPU and the emulator: per-shape plans, liveness-
//!   planned arena, steps.
//! * `device`: the GPU through cudarc (libcuda, libnvrtc, libcublasLt loaded at run time).

pub mod codegen;
pub mod emulate;
pub mod exec;

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
pub mod nvrtc;

/// The CUDA backend (`"cuda"`): kernels compiled by NVRTC for GPU 0, cuBLASLt products.
pub struct CudaBackend {
    gpu: std::sync::Arc<device::Gpu>,
}

impl CudaBackend {
    /// Opens GPU 0; fails clearly where there is no usable GPU, driver or library.
    pub fn new() -> Result<CudaBackend> {
        Ok(CudaBackend {
            gpu: device::Gpu::get()?,
        })
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn device_name(&self) -> String {
        format!("cuda {} {}", self.gpu.name, self.gpu.arch)
    }

    fn compile(&self, graph: &Graph, weights: &Weights) -> Result<Box<dyn Executable>> {
        let kp = codegen::generate(graph)?;
        let device = device::CudaDevice::new(self.gpu.clone(), &kp)?;
        Ok(Box::new(exec::Program::new(kp, device, weights)?))
    }
}
