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

use cudarc::driver::{result as drv, sys};
use ember_core::{Error, Result};

use crate::codegen::{KernelProgram, StepKind};
use crate::exec::{Device, DeviceBuffer, GemmCall, Work};
use crate::graph::GpuGraph;
use crate::products::{Products, WORKSPACE_BYTES};

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

/// The primary context of GPU 0 and what lives as long as it: the product libraries.
pub struct Gpu {
    ctx: sys::CUcontext,
    pub name: String,
    pub arch: String,
    /// cuBLASLt and cuBLAS, and the kernel measured fastest for each product shape.
    pub(crate) products: Products,
    /// A stream of our own on which cuBLASLt calls are captured into graphs (capturing
    /// never touches the stream torch's work runs on).
    pub(crate) capture_stream: sys::CUstream,
    /// Held from the beginning of a capture on `capture_stream` to its end, and while
    /// products are measured on it (`products.rs`): two programs recording at once would
    /// otherwise begin a second capture on a capturing stream.
    pub(crate) capture_lock: Mutex<()>,
}

// SAFETY: the context is a process-wide driver object, made current wherever it is used;
// `Products` serializes the libraries' handles itself.
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
        // SAFETY: `dev` is a valid device.
        let l2_bytes = unsafe {
            drv::device::get_attribute(
                dev,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE,
            )
        }
        .map_err(|e| driver_err("device attribute", e))?;
        let products = Products::open(l2_bytes.max(0) as usize)?;
        let capture_stream = drv::stream::create(drv::stream::StreamKind::NonBlocking)
            .map_err(|e| driver_err("stream creation", e))?;
        Ok(Gpu {
            ctx,
            name: info.name,
            arch: info.arch,
            products,
            capture_stream,
            capture_lock: Mutex::new(()),
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
    pub(crate) allow_tf32: bool,
    /// cuBLASLt's scratch for this program's products (none without products). A program
    /// of its own: runs of one program never overlap, while two programs may run at once
    /// on two streams.
    workspace: Option<GpuBuffer>,
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
        })
    }

    /// The stream this program's runs launch on (torch's current one).
    pub(crate) fn stream(&self) -> sys::CUstream {
        self.stream.load(Ordering::Relaxed) as sys::CUstream
    }

    /// This program's scratch for the product libraries.
    pub(crate) fn workspace_addr(&self) -> Result<u64> {
        self.workspace.as_ref().map(|w| w.ptr).ok_or_else(|| {
            Error::Runtime("a matrix product in a program planned without one".into())
        })
    }

    /// Whether products may be measured now: not while torch's stream is being captured
    /// (a user's own CUDA graph), where the waits measuring needs are not allowed.
    pub(crate) fn may_measure(&self) -> bool {
        // SAFETY: a live stream handle (torch's, or the legacy default).
        let status = unsafe { drv::stream::is_capturing(self.stream()) };
        matches!(
            status,
            Ok(sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
        )
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
        if self.may_measure() {
            self.tune(c)?;
        }
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
