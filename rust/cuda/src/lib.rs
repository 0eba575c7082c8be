//! Ember's CUDA backend.
//!
//! * `codegen`: IR graph → kernels (CUDA C) and launch steps; no GPU needed.
//! * `nvrtc`: compiles a program's kernels to CUBIN for one `sm_XX` (cached by source hash).
//! * `emulate`: runs the generated kernels on the host (a C++ compiler and threads stand in
//!   for the GPU), so CI checks what the kernels compute on machines without a GPU.
//! * `layout`: arena offsets from liveness, scratch and launch sizes, for one or more dim
//!   bindings (a dim bucket).
//! * `memcheck`: the emulator's memory checker (out-of-bounds writes, reads of unwritten
//!   memory, writes into a neighbour's value).
//! * `exec`: the executor shared by the GPU and the emulator: weights, `meta`, the steps
//!   launched one by one or replayed from a recording (a CUDA graph) per dim bucket.
//! * `device`: the GPU through cudarc (libcuda, libnvrtc, libcublasLt loaded at run time);
//!   `graph`: recordings there (CUDA graphs).

pub mod codegen;
pub mod emulate;
pub mod exec;
pub mod layout;
pub mod memcheck;

use ember_core::backend::{Backend, Executable, LoweringRule, Weights};
use ember_core::dtype::DType;
use ember_core::ir::{Graph, Op};
use ember_core::Result;

/// The CUDA backend's code run on the host by the emulator (`"cuda-emu"`): a test backend.
/// Its "device" memory is host memory, so `device_weights` are host addresses read in
/// place, as the GPU reads torch's CUDA parameters.
#[derive(Default)]
pub struct EmulatedCudaBackend {
    pub device_weights: std::sync::Arc<exec::DeviceWeights>,
}

/// Which nodes a kernel choice applies to: (op, dtype, rank).
type Applies = fn(&Op, DType, usize) -> bool;

/// The implementation choices both CUDA backends offer the optimizer (`lower_cuda`): the
/// generated product kernels beside cuBLASLt, for the dtypes cuBLASLt takes.
fn cuda_lowering_rules() -> Vec<LoweringRule> {
    [codegen::KERNEL_WARP_DOT, codegen::KERNEL_THREAD_DOT]
        .into_iter()
        .map(|kernel| LoweringRule::Kernel {
            kernel,
            applies: |op, dtype, _rank| matches!(op, Op::Dot) && codegen::gemm_dtype(dtype),
        })
        .collect()
}

/// Every kernel choice `with_choice` can take: the optimizer's, and the tensor-core
/// attention the backends take by default (`with_default_kernels`).
fn choices() -> Vec<(&'static str, Applies)> {
    let mut all: Vec<(&'static str, Applies)> = cuda_lowering_rules()
        .into_iter()
        .filter_map(|r| match r {
            LoweringRule::Kernel { kernel, applies } => Some((kernel, applies)),
            _ => None,
        })
        .collect();
    all.push((codegen::KERNEL_MMA_ATTENTION, half_attention));
    all
}

/// Attention in f16/bf16: what the tensor-core kernel may compute.
fn half_attention(op: &Op, dtype: DType, _rank: usize) -> bool {
    matches!(op, Op::Attention { .. }) && matches!(dtype, DType::F16 | DType::BF16)
}

/// `graph` with the CUDA kernel choice `kernel` taken at every node it applies to: how
/// tests run and compile a choice the optimizer would only take where it measures faster.
pub fn with_choice(graph: &Graph, kernel: &str) -> Result<Graph> {
    let all = choices();
    let Some(&(_, applies)) = all.iter().find(|(k, _)| *k == kernel) else {
        let names: Vec<&str> = all.iter().map(|(k, _)| *k).collect();
        return Err(ember_core::Error::Input(format!(
            "the CUDA backend has no kernel choice '{kernel}' (it has {})",
            names.join(", ")
        )));
    };
    let mut g = graph.clone();
    for n in &mut g.nodes {
        if applies(&n.op, n.ty.dtype, n.ty.rank()) {
            n.op = Op::Kernel {
                name: kernel.to_string(),
                base: Box::new(n.op.clone()),
            };
        }
    }
    Ok(g)
}

/// The graph a CUDA backend generates code for: `graph` with the kernels it takes by
/// default, then those the environment forces.
///
/// * Where the GPU has tensor cores for f16/bf16 (`tensor_cores`: sm_80 and newer; the
///   emulator's shim has them), prefill attention runs on them
///   (`cuda.mma_attention`) — as every fast attention does, so it is no search candidate;
///   `EMBER_CUDA_MMA_ATTENTION=0` keeps the other kernels, to compare them on a GPU.
/// * `EMBER_CUDA_PRODUCTS=cuda.warp_dot` (or `cuda.thread_dot`) takes that kernel for every
///   product the optimizer left to cuBLASLt: to compare a choice on a GPU without the
///   search, and to run it end to end on the emulator in tests.
fn with_default_kernels(graph: &Graph, tensor_cores: bool) -> Result<std::borrow::Cow<'_, Graph>> {
    let mut g = std::borrow::Cow::Borrowed(graph);
    let mma_off = std::env::var("EMBER_CUDA_MMA_ATTENTION").is_ok_and(|v| v == "0");
    let any = graph
        .nodes
        .iter()
        .any(|n| half_attention(&n.op, n.ty.dtype, n.ty.rank()));
    if tensor_cores && !mma_off && any {
        // Where its shapes do not fit (a decode step, odd head dims) the generator takes
        // the other attention kernels.
        g = std::borrow::Cow::Owned(with_choice(graph, codegen::KERNEL_MMA_ATTENTION)?);
    }
    match std::env::var("EMBER_CUDA_PRODUCTS") {
        Ok(kernel) if !kernel.is_empty() => Ok(std::borrow::Cow::Owned(with_choice(&g, &kernel)?)),
        _ => Ok(g),
    }
}

impl Backend for EmulatedCudaBackend {
    fn name(&self) -> &'static str {
        "cuda-emu"
    }

    fn lowering_rules(&self) -> Vec<LoweringRule> {
        cuda_lowering_rules()
    }

    fn compile(&self, graph: &Graph, weights: &Weights) -> Result<Box<dyn Executable>> {
        let graph = with_default_kernels(graph, true)?;
        let kp = codegen::generate(&graph)?;
        let device = emulate::EmulatedDevice::new(&kp)?;
        let program = exec::Program::with_device_weights(kp, device, weights, &self.device_weights);
        Ok(Box::new(program?))
    }
}
pub mod device;
pub mod driver;
pub mod graph;
pub mod nvrtc;
pub mod products;

/// The CUDA backend (`"cuda"`): kernels compiled by NVRTC for GPU 0, cuBLASLt products.
pub struct CudaBackend {
    gpu: std::sync::Arc<device::Gpu>,
    /// f32 products may run on TF32 tensor cores (only when the user allows it).
    allow_tf32: bool,
    /// Weights read where they already are on GPU 0 (torch's CUDA parameters).
    device_weights: std::sync::Arc<exec::DeviceWeights>,
}

impl CudaBackend {
    /// Opens GPU 0; fails clearly where there is no usable GPU, driver or library.
    pub fn new(allow_tf32: bool) -> Result<CudaBackend> {
        Ok(CudaBackend {
            gpu: device::Gpu::get()?,
            allow_tf32,
            device_weights: Default::default(),
        })
    }

    /// Programs read these weights in GPU 0's memory where they are, instead of uploading
    /// host copies (see `exec::DeviceWeight`).
    pub fn with_device_weights(
        mut self,
        weights: std::sync::Arc<exec::DeviceWeights>,
    ) -> CudaBackend {
        self.device_weights = weights;
        self
    }
}

/// The product shapes measured on GPU 0 so far, oldest first (empty where no GPU was
/// opened).
pub fn product_tuning() -> Vec<products::Tuning> {
    if crate::driver::gpus().is_empty() {
        return Vec::new();
    }
    device::Gpu::get()
        .map(|g| g.products.tunings())
        .unwrap_or_default()
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn lowering_rules(&self) -> Vec<LoweringRule> {
        cuda_lowering_rules()
    }

    fn device_name(&self) -> String {
        // TF32 changes results, so programs searched with it are cached apart.
        let tf32 = if self.allow_tf32 { " tf32" } else { "" };
        format!("cuda {} {}{tf32}", self.gpu.name, self.gpu.arch)
    }

    fn compile(&self, graph: &Graph, weights: &Weights) -> Result<Box<dyn Executable>> {
        let graph = with_default_kernels(graph, self.gpu.tensor_cores())?;
        let kp = codegen::generate(&graph)?;
        let device = device::CudaDevice::new(self.gpu.clone(), &kp, self.allow_tf32)?;
        let program = exec::Program::with_device_weights(kp, device, weights, &self.device_weights);
        Ok(Box::new(program?))
    }
}
