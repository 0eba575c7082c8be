//! The GPU as an executor `Device`: the driver API for memory, modules and launches (on
//! the primary context, which torch shares), and cuBLASLt for matrix products.
//!
//! Recordings of a program's work are CUDA graphs (`graph.rs`).
//!
//! Everything here needs a GPU; without one, `CudaBackend::compile` fails with a clear error
//! before any of it runs.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublaslt::{result as lt, sys as ltsys};
use cudarc::driver::{result as drv, sys};
use ember_core::dtype::DType;
use ember_core::{Error, Result};

use crate::codegen::{KernelProgram, StepKind};
use crate::exec::{Device, DeviceBuffer, GemmCall, Work};
use crate::graph::GpuGraph;

/// cuBLASLt's scratch space (its heuristics pick faster algorithms with some).
const WORKSPACE_BYTES: usize = 32 << 20;

/// Pointers to each kernel argument value, as `cuLaunchKernel` and kernel graph nodes want
/// them (the driver only reads through them, and copies the values).
pub(crate) fn param_pointers(args: &[u64]) -> Vec<*mut c_void> {
    args.iter()
        .map(|v| v as *const u64 as *mut c_void)
        .collect()
}

pub(crate) fn driver_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Runtime(format!("CUDA {what} failed: {e:?}"))
}

/// The primary context of GPU 0 and what lives as long as it: one cuBLASLt handle.
pub struct Gpu {
    ctx: sys::CUcontext,
    pub name: String,
    pub arch: String,
    blas: ltsys::cublasLtHandle_t,
    /// A stream of our own on which cuBLASLt calls are captured into graphs (capturing
    /// never touches the stream torch's work runs on).
    pub(crate) capture_stream: sys::CUstream,
    /// Held from the beginning of a capture on `capture_stream` to its end: two programs
    /// recording at once would otherwise begin a second capture on a capturing stream.
    pub(crate) capture_lock: Mutex<()>,
    /// cuBLASLt handles are not safe to use from two threads at once.
    blas_lock: Mutex<()>,
}

// SAFETY: the context and handle are process-wide driver objects; their use is serialized
// where the driver requires it (`blas_lock`), and contexts may be made current anywhere.
unsafe impl Send for Gpu {}
unsafe impl Sync for Gpu {}

impl Gpu {
    /// GPU 0, initialized once per process.
    pub fn get() -> Result<Arc<Gpu>> {
        static GPU: OnceLock<std::result::Result<Arc<Gpu>, String>> = OnceLock::new();
        GPU.get_or_init(|| {
            std::panic::catch_unwind(Gpu::open)
                .unwrap_or_else(|_| {
                    Err(Error::Runtime(
                        "the CUDA libraries could not be loaded".into(),
                    ))
                })
                .map(Arc::new)
                .map_err(|e| e.to_string())
        })
        .clone()
        .map_err(Error::Runtime)
    }

    fn open() -> Result<Gpu> {
        let info = crate::driver::gpus()
            .into_iter()
            .next()
            .ok_or_else(|| Error::Runtime("no usable NVIDIA GPU and driver were found".into()))?;
        drv::init().map_err(|e| driver_err("init", e))?;
        // The bindings are CUDA 13.0's: an older driver lacks symbols they call.
        let mut version: std::ffi::c_int = 0;
        // SAFETY: a plain out-parameter.
        unsafe { sys::cuDriverGetVersion(&mut version).result() }
            .map_err(|e| driver_err("driver version", e))?;
        if version < 13000 {
            return Err(Error::Runtime(format!(
                "the NVIDIA driver supports CUDA {}.{}; Ember needs a driver for CUDA 13.0 or newer",
                version / 1000,
                version % 1000 / 10
            )));
        }
        let dev = drv::device::get(0).map_err(|e| driver_err("device 0", e))?;
        // SAFETY: `dev` is a valid device; the primary context is what torch uses too.
        let ctx = unsafe { drv::primary_ctx::retain(dev) }.map_err(|e| driver_err("context", e))?;
        unsafe { drv::ctx::set_current(ctx) }.map_err(|e| driver_err("context", e))?;
        // SAFETY: `lt` loads libcublasLt; a missing library panics, caught by `get`.
        if !unsafe { ltsys::is_culib_present() } {
            return Err(Error::Runtime(
                "libcublasLt was not found (it comes with the CUDA build of torch)".into(),
            ));
        }
        let blas = lt::create_handle().map_err(|e| driver_err("cublasLtCreate", e))?;
        let capture_stream = drv::stream::create(drv::stream::StreamKind::NonBlocking)
            .map_err(|e| driver_err("stream creation", e))?;
        Ok(Gpu {
            ctx,
            name: info.name,
            arch: info.arch,
            blas,
            capture_stream,
            capture_lock: Mutex::new(()),
            blas_lock: Mutex::new(()),
        })
    }

    /// Whether the GPU's tensor cores take f16/bf16 `mma.m16n8k16` (sm_80 and newer).
    pub fn tensor_cores(&self) -> bool {
        self.arch
            .strip_prefix("sm_")
            .and_then(|n| {
                n.trim_end_matches(|c: char| c.is_ascii_alphabetic())
                    .parse::<u32>()
                    .ok()
            })
            .is_some_and(|n| n >= 80)
    }

    pub(crate) fn make_current(&self) -> Result<()> {
        // SAFETY: the context was retained in `open` and is never released.
        unsafe { drv::ctx::set_current(self.ctx) }.map_err(|e| driver_err("context", e))
    }
}

struct GpuBuffer {
    ptr: sys::CUdeviceptr,
    gpu: Arc<Gpu>,
}

impl DeviceBuffer for GpuBuffer {
    fn addr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for GpuBuffer {
    fn drop(&mut self) {
        if self.gpu.make_current().is_ok() {
            // SAFETY: allocated by `malloc_sync`, freed once; the stream work using it was
            // synchronized by the run that owned it.
            let _ = unsafe { drv::free_sync(self.ptr) };
        }
    }
}

/// A loaded program module on the GPU.
pub struct CudaDevice {
    pub(crate) gpu: Arc<Gpu>,
    module: sys::CUmodule,
    pub(crate) functions: Vec<sys::CUfunction>,
    /// The stream this run launches on (torch's current stream; 0 is the legacy default).
    stream: AtomicU64,
    /// f32 products may use TF32 tensor cores.
    allow_tf32: bool,
    /// cuBLASLt's scratch for this program's products (none without products). A program
    /// of its own: runs of one program never overlap, while two programs may run at once
    /// on two streams.
    workspace: Option<GpuBuffer>,
    /// cuBLASLt's algorithm for each product shape it was asked about: its heuristic query
    /// costs more than the product's other host work, and a product is enqueued again on
    /// every patch of a recording and every run step by step.
    algos: Mutex<std::collections::HashMap<AlgoKey, ltsys::cublasLtMatmulAlgo_t>>,
}

/// Product shapes whose cuBLASLt algorithm a program remembers.
const MAX_ALGOS: usize = 4096;

/// What cuBLASLt's algorithm choice depends on: the descriptors and the preferences (the
/// operands' alignments), not the addresses themselves.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct AlgoKey {
    dtype: DType,
    mnk: (usize, usize, usize),
    batch: usize,
    trans: (bool, bool),
    bias: bool,
    gelu_tanh: bool,
    add: bool,
    alignments: [u32; 4],
}

// SAFETY: module and function handles are immutable driver objects usable from any thread
// once the context is current.
unsafe impl Send for CudaDevice {}
unsafe impl Sync for CudaDevice {}

impl CudaDevice {
    pub fn new(gpu: Arc<Gpu>, kp: &KernelProgram, allow_tf32: bool) -> Result<CudaDevice> {
        let cubin = crate::nvrtc::compile(&kp.cuda_source(), &gpu.arch)?;
        gpu.make_current()?;
        // SAFETY: a CUBIN NVRTC produced for this device's architecture.
        let module = unsafe { drv::module::load_data(cubin.as_ptr() as *const c_void) }
            .map_err(|e| driver_err("module load", e))?;
        let mut functions = Vec::new();
        for k in &kp.kernels {
            let name = std::ffi::CString::new(k.name.as_str())
                .map_err(|_| Error::Compile("kernel name holds a NUL byte".into()))?;
            // SAFETY: `module` is loaded; the name is a kernel it defines.
            let f = unsafe { drv::module::get_function(module, name) }
                .map_err(|e| driver_err(&format!("kernel {}", k.name), e))?;
            functions.push(f);
        }
        let has_products = kp.steps.iter().any(|s| matches!(s.kind, StepKind::Gemm(_)));
        let workspace = if has_products {
            // SAFETY: a plain allocation, freed by `GpuBuffer::drop`.
            let ptr = unsafe { drv::malloc_sync(WORKSPACE_BYTES) }
                .map_err(|e| driver_err("cuBLASLt workspace allocation", e))?;
            Some(GpuBuffer {
                ptr,
                gpu: gpu.clone(),
            })
        } else {
            None
        };
        Ok(CudaDevice {
            gpu,
            module,
            functions,
            stream: AtomicU64::new(0),
            allow_tf32,
            workspace,
            algos: Mutex::default(),
        })
    }

    fn stream(&self) -> sys::CUstream {
        self.stream.load(Ordering::Relaxed) as sys::CUstream
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        if self.gpu.make_current().is_ok() {
            // SAFETY: loaded in `new`, unloaded once; no launch is in flight after a run.
            let _ = unsafe { drv::module::unload(self.module) };
        }
    }
}

fn data_type(d: DType) -> Result<ltsys::cudaDataType> {
    Ok(match d {
        DType::F32 => ltsys::cudaDataType::CUDA_R_32F,
        DType::F64 => ltsys::cudaDataType::CUDA_R_64F,
        DType::F16 => ltsys::cudaDataType::CUDA_R_16F,
        DType::BF16 => ltsys::cudaDataType::CUDA_R_16BF,
        other => return Err(Error::Runtime(format!("cuBLASLt has no {other} matmul"))),
    })
}

/// A cuBLASLt descriptor, destroyed on drop (on every path, errors included).
struct Lt<T: Copy> {
    raw: T,
    destroy: unsafe fn(T) -> std::result::Result<(), lt::CublasError>,
}

impl<T: Copy> Drop for Lt<T> {
    fn drop(&mut self) {
        // SAFETY: created by the matching cuBLASLt call and destroyed once, here.
        let _ = unsafe { (self.destroy)(self.raw) };
    }
}

fn lt_err(what: &str) -> impl FnOnce(lt::CublasError) -> Error + '_ {
    move |e| driver_err(what, e)
}

/// A column-major layout `rows × cols` (leading dimension `ld`), `batch` of them `stride`
/// elements apart.
fn layout(
    t: ltsys::cudaDataType,
    rows: usize,
    cols: usize,
    ld: usize,
    batch: usize,
    stride: usize,
) -> Result<Lt<ltsys::cublasLtMatrixLayout_t>> {
    let l = Lt {
        raw: lt::create_matrix_layout(t, rows as u64, cols as u64, ld as i64)
            .map_err(lt_err("matrix layout"))?,
        destroy: lt::destroy_matrix_layout,
    };
    let count = batch as i32;
    let offset = stride as i64;
    // SAFETY: attribute buffers of the documented types and sizes.
    unsafe {
        lt::set_matrix_layout_attribute(
            l.raw,
            ltsys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
            &count as *const i32 as *const c_void,
            4,
        )
        .map_err(lt_err("matrix layout"))?;
        lt::set_matrix_layout_attribute(
            l.raw,
            ltsys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
            &offset as *const i64 as *const c_void,
            8,
        )
        .map_err(lt_err("matrix layout"))?;
    }
    Ok(l)
}

/// The alignment cuBLASLt may assume of `addr`: the largest power of two dividing it, at
/// most 256 (cuBLASLt assumes 256 unless told, and a torch tensor with a storage offset,
/// `x[1:]`, is aligned only to its element size).
fn alignment(addr: u64) -> u32 {
    if addr == 0 {
        return 256;
    }
    1u32 << addr.trailing_zeros().min(8)
}

fn set_desc<V>(
    desc: ltsys::cublasLtMatmulDesc_t,
    attr: ltsys::cublasLtMatmulDescAttributes_t,
    value: &V,
) -> Result<()> {
    // SAFETY: `value` is the attribute's documented type, read during the call.
    unsafe {
        lt::set_matmul_desc_attribute(
            desc,
            attr,
            value as *const V as *const c_void,
            std::mem::size_of::<V>(),
        )
    }
    .map_err(lt_err("matmul"))
}

fn set_pref<V>(
    pref: ltsys::cublasLtMatmulPreference_t,
    attr: ltsys::cublasLtMatmulPreferenceAttributes_t,
    value: &V,
) -> Result<()> {
    // SAFETY: `value` is the attribute's documented type, read during the call.
    unsafe {
        lt::set_matmul_pref_attribute(
            pref,
            attr,
            value as *const V as *const c_void,
            std::mem::size_of::<V>(),
        )
    }
    .map_err(lt_err("matmul"))
}

impl CudaDevice {
    /// cuBLASLt's `c.c = c.a · c.b` enqueued on `stream`.
    pub(crate) fn gemm_on(&self, c: &GemmCall, stream: sys::CUstream) -> Result<()> {
        use ltsys::cublasLtMatmulDescAttributes_t as Desc;
        use ltsys::cublasLtMatmulPreferenceAttributes_t as Pref;
        self.gpu.make_current()?;
        let workspace = self.workspace.as_ref().ok_or_else(|| {
            Error::Runtime("a matrix product in a program planned without one".into())
        })?;
        let _one_at_a_time = self.gpu.blas_lock.lock().unwrap_or_else(|e| e.into_inner());
        let t = data_type(c.dtype)?;
        let (compute, scale) = if c.dtype == DType::F64 {
            (
                ltsys::cublasComputeType_t::CUBLAS_COMPUTE_64F,
                ltsys::cudaDataType::CUDA_R_64F,
            )
        } else if c.dtype == DType::F32 && self.allow_tf32 {
            (
                ltsys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
                ltsys::cudaDataType::CUDA_R_32F,
            )
        } else {
            // f32 accumulation; TF32 is never used without the user's consent.
            (
                ltsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                ltsys::cudaDataType::CUDA_R_32F,
            )
        };
        // Row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ: cuBLASLt's "A" is our B.
        let (m, n, k) = (c.m, c.n, c.k);
        let desc = Lt {
            raw: lt::create_matmul_desc(compute, scale).map_err(lt_err("matmul"))?,
            destroy: lt::destroy_matmul_desc,
        };
        let la = if c.trans_b {
            layout(t, k, n, k, c.batch, n * k)?
        } else {
            layout(t, n, k, n, c.batch, n * k)?
        };
        let lb = if c.trans_a {
            layout(t, m, k, m, c.batch, m * k)?
        } else {
            layout(t, k, m, k, c.batch, m * k)?
        };
        let lc = layout(t, n, m, n, c.batch, m * n)?;
        set_desc(
            desc.raw,
            Desc::CUBLASLT_MATMUL_DESC_TRANSA,
            &(c.trans_b as i32),
        )?;
        set_desc(
            desc.raw,
            Desc::CUBLASLT_MATMUL_DESC_TRANSB,
            &(c.trans_a as i32),
        )?;
        let epilogue = match (c.bias != 0, c.gelu_tanh) {
            (false, false) => None,
            (true, false) => Some(ltsys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS),
            (false, true) => Some(ltsys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU),
            (true, true) => Some(ltsys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_BIAS),
        };
        if let Some(epilogue) = epilogue {
            set_desc(desc.raw, Desc::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?;
        }
        if c.bias != 0 {
            // The bias is a vector along our rows' length `n`: cuBLASLt's rows (we multiply
            // transposed, column-major), broadcast over its columns and batches (batch
            // stride 0, the default). Its epilogue reads it in 16-byte loads: the code
            // generator folds only biases in our own (256-byte aligned) memory.
            if !c.bias.is_multiple_of(16) {
                return Err(Error::Runtime(format!(
                    "the bias of a matrix product is not 16-byte aligned (address {:#x})",
                    c.bias
                )));
            }
            let bias = c.bias as *const c_void;
            set_desc(desc.raw, Desc::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias)?;
        }
        // β = 1 adds the addend (cuBLASLt's C, laid out as the result D), else 0.
        let add = c.addend != 0;
        let c_matrix = if add { c.addend } else { c.c };
        let alignments = [c.b, c.a, c_matrix, c.c].map(alignment);
        let key = AlgoKey {
            dtype: c.dtype,
            mnk: (m, n, k),
            batch: c.batch,
            trans: (c.trans_a, c.trans_b),
            bias: c.bias != 0,
            gelu_tanh: c.gelu_tanh,
            add,
            alignments,
        };
        let known = self
            .algos
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
            .copied();
        let algo = match known {
            Some(algo) => algo,
            None => {
                let pref = Lt {
                    raw: lt::create_matmul_pref().map_err(lt_err("matmul"))?,
                    destroy: lt::destroy_matmul_pref,
                };
                set_pref(
                    pref.raw,
                    Pref::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    &WORKSPACE_BYTES,
                )?;
                for (attr, align) in [
                    Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                    Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                    Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                ]
                .into_iter()
                .zip(alignments)
                {
                    set_pref(pref.raw, attr, &align)?;
                }
                // SAFETY: the handle and descriptors are live (created above).
                let heuristic = unsafe {
                    lt::get_matmul_algo_heuristic(
                        self.gpu.blas,
                        desc.raw,
                        la.raw,
                        lb.raw,
                        lc.raw,
                        lc.raw,
                        pref.raw,
                    )
                }
                .map_err(|e| driver_err(&format!("matmul ({m}×{k} · {k}×{n}, {})", c.dtype), e))?;
                let mut algos = self.algos.lock().unwrap_or_else(|e| e.into_inner());
                if algos.len() >= MAX_ALGOS {
                    // Many sizes (a server's prompt lengths): start over rather than grow.
                    algos.clear();
                }
                algos.insert(key, heuristic.algo);
                heuristic.algo
            }
        };
        let (one32, zero32, one64, zero64) = (1.0f32, 0.0f32, 1.0f64, 0.0f64);
        let (alpha, beta): (*const c_void, *const c_void) = match (c.dtype, add) {
            (DType::F64, false) => (&one64 as *const f64 as _, &zero64 as *const f64 as _),
            (DType::F64, true) => (&one64 as *const f64 as _, &one64 as *const f64 as _),
            (_, false) => (&one32 as *const f32 as _, &zero32 as *const f32 as _),
            (_, true) => (&one32 as *const f32 as _, &one32 as *const f32 as _),
        };
        // SAFETY: descriptors created above; α and β of the scale type, alive through the
        // call; device pointers from the executor, sized by the plan; the workspace is this
        // program's own (runs of one program never overlap).
        unsafe {
            lt::matmul(
                self.gpu.blas,
                desc.raw,
                alpha,
                beta,
                c.b as *const c_void,
                la.raw,
                c.a as *const c_void,
                lb.raw,
                c_matrix as *const c_void,
                lc.raw,
                c.c as *mut c_void,
                lc.raw,
                &algo,
                workspace.addr() as *mut c_void,
                WORKSPACE_BYTES,
                stream as ltsys::cudaStream_t,
            )
        }
        .map_err(lt_err("matmul"))
    }
}

impl Device for CudaDevice {
    type Recording = GpuGraph;

    fn alloc(&self, bytes: usize) -> Result<Box<dyn DeviceBuffer>> {
        self.gpu.make_current()?;
        // SAFETY: a plain allocation, freed by `GpuBuffer::drop`.
        let ptr = unsafe { drv::malloc_sync(bytes.max(1)) }
            .map_err(|e| driver_err(&format!("allocation of {bytes} bytes"), e))?;
        Ok(Box::new(GpuBuffer {
            ptr,
            gpu: self.gpu.clone(),
        }))
    }

    fn upload_async(&self, dst: u64, src: &[u8]) -> Result<()> {
        self.gpu.make_current()?;
        // SAFETY: `dst` is device memory of at least `src.len()` bytes. `src` is pageable
        // host memory, which the driver copies to a staging buffer before returning, so it
        // may be freed after; the device copy runs in stream order.
        unsafe { drv::memcpy_htod_async(dst, src, self.stream()) }
            .map_err(|e| driver_err("upload", e))
    }

    fn upload(&self, dst: u64, src: &[u8]) -> Result<()> {
        self.gpu.make_current()?;
        // SAFETY: `dst` is device memory of at least `src.len()` bytes; the copy completes
        // before we return (stream synchronized), so `src` may be freed after.
        unsafe {
            drv::memcpy_htod_async(dst, src, self.stream()).map_err(|e| driver_err("upload", e))?;
            drv::stream::synchronize(self.stream()).map_err(|e| driver_err("upload", e))
        }
    }

    fn download(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        self.gpu.make_current()?;
        // SAFETY: `src` is device memory of at least `dst.len()` bytes.
        unsafe {
            drv::memcpy_dtoh_async(dst, src, self.stream())
                .map_err(|e| driver_err("download", e))?;
            drv::stream::synchronize(self.stream()).map_err(|e| driver_err("download", e))
        }
    }

    fn launch(&self, kernel: usize, grid: u32, block: u32, args: &[u64]) -> Result<()> {
        self.gpu.make_current()?;
        let mut params = param_pointers(args);
        // SAFETY: every kernel parameter is a 64-bit pointer, passed in signature order.
        unsafe {
            drv::launch_kernel(
                self.functions[kernel],
                (grid, 1, 1),
                (block, 1, 1),
                0,
                self.stream(),
                &mut params,
            )
        }
        .map_err(|e| driver_err("kernel launch", e))
    }

    fn gemm(&self, c: &GemmCall) -> Result<()> {
        self.gemm_on(c, self.stream())
    }

    fn record(&self, work: &[Work]) -> Result<Option<GpuGraph>> {
        GpuGraph::new(self, work).map(Some)
    }

    fn update(&self, graph: &mut GpuGraph, index: usize, work: &Work) -> Result<bool> {
        graph.update(self, index, work)
    }

    fn replay(&self, graph: &GpuGraph) -> Result<()> {
        graph.launch(self.stream())
    }

    fn launch_limits(&self, _cooperative: bool) -> (u32, u32) {
        (256, 65535)
    }

    fn set_stream(&self, stream: u64) {
        self.stream.store(stream, Ordering::Relaxed);
    }

    fn synchronize(&self) -> Result<()> {
        self.gpu.make_current()?;
        // SAFETY: a live stream handle (torch's, or the legacy default).
        unsafe { drv::stream::synchronize(self.stream()) }.map_err(|e| driver_err("synchronize", e))
    }

    type Mark = GpuEvent;

    fn mark(&self, stream: u64) -> Result<GpuEvent> {
        self.gpu.make_current()?;
        let event = drv::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map_err(|e| driver_err("event creation", e))?;
        let event = GpuEvent {
            event,
            gpu: self.gpu.clone(),
        };
        // SAFETY: a live event of this context, recorded on a live stream.
        unsafe { drv::event::record(event.event, stream as sys::CUstream) }
            .map_err(|e| driver_err("event record", e))?;
        Ok(event)
    }

    fn seconds_between(&self, start: &GpuEvent, end: &GpuEvent) -> Result<f64> {
        self.gpu.make_current()?;
        // SAFETY: both events were created and recorded by `mark`, and are still alive.
        let ms = unsafe {
            drv::event::synchronize(end.event).map_err(|e| driver_err("event wait", e))?;
            drv::event::elapsed(start.event, end.event)
        }
        .map_err(|e| driver_err("event timing", e))?;
        Ok(f64::from(ms) * 1e-3)
    }
}

/// A CUDA event (a point in a stream's work), destroyed on drop.
pub struct GpuEvent {
    event: sys::CUevent,
    gpu: Arc<Gpu>,
}

impl Drop for GpuEvent {
    fn drop(&mut self) {
        if self.gpu.make_current().is_ok() {
            // SAFETY: created by `mark`, destroyed once (the driver defers the release of
            // an event still pending).
            let _ = unsafe { drv::event::destroy(self.event) };
        }
    }
}
