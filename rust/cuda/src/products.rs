//! Matrix products on the GPU: cuBLASLt, and cuBLAS as eager PyTorch and Inductor call it.
//!
//! A row-major `C = A·B` is the column-major `Cᵀ = Bᵀ·Aᵀ`, so the libraries' "A" is our
//! `b`. Which kernel serves a shape is **measured**, once per shape and process: the first
//! time a product shape is about to be captured into a recording (or run step by step),
//! cuBLASLt's best few heuristic algorithms and cuBLAS's own dispatch (its matrix-vector
//! kernels serve a decode step's one-row products; a residual addend is copied into the
//! result and added in place) each run a few times on a private stream, with the L2 cache
//! flushed before each run (a model's weights come from memory, not L2), and the fastest
//! by median is kept. cuBLASLt's heuristic is a model, not a measurement, and never offers
//! cuBLAS's matrix-vector kernels; measuring costs a few milliseconds per new shape.
//! `EMBER_CUDA_TUNE_PRODUCTS=0` takes cuBLASLt's first heuristic instead;
//! `EMBER_CUDA_PRODUCT_LIBRARY=cublas|cublaslt` forces one library (tests, comparisons).
//! `ember.cuda.product_tuning()` lists what was measured.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::cublas::{result as blas, sys as blassys};
use cudarc::cublaslt::{result as lt, sys as ltsys};
use cudarc::driver::{result as drv, sys};
use ember_core::dtype::DType;
use ember_core::{Error, Result};

use crate::device::{driver_err, CudaDevice};
use crate::exec::GemmCall;

/// The libraries' scratch space per program (their faster algorithms want some).
pub(crate) const WORKSPACE_BYTES: usize = 32 << 20;

/// cuBLASLt heuristic algorithms measured per new shape.
const HEURISTICS: usize = 8;

/// Timed runs per candidate (after one untimed); the median counts.
const TIMED_RUNS: usize = 5;

/// Product shapes whose choice is remembered (a server's many prompt lengths: start over
/// rather than grow without bound).
const MAX_CHOICES: usize = 4096;

/// Tuning records kept for `product_tuning()`.
const MAX_RECORDS: usize = 1024;

/// How one product shape runs.
#[derive(Clone, Copy)]
pub(crate) enum Choice {
    /// cuBLASLt with this algorithm.
    Lt(ltsys::cublasLtMatmulAlgo_t),
    /// cuBLAS's `cublasGemmStridedBatchedEx` (its own dispatch; no epilogues).
    Blas,
}

/// What a product's kernel choice depends on: shape, types, epilogue and the operands'
/// alignments, not the addresses themselves.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(crate) struct ProductKey {
    dtype: DType,
    mnk: (usize, usize, usize),
    batch: usize,
    trans: (bool, bool),
    bias: bool,
    gelu_tanh: bool,
    add: bool,
    tf32: bool,
    alignments: [u32; 4],
}

impl ProductKey {
    fn of(c: &GemmCall, allow_tf32: bool) -> ProductKey {
        let add = c.addend != 0;
        let c_matrix = if add { c.addend } else { c.c };
        ProductKey {
            dtype: c.dtype,
            mnk: (c.m, c.n, c.k),
            batch: c.batch,
            trans: (c.trans_a, c.trans_b),
            bias: c.bias != 0,
            gelu_tanh: c.gelu_tanh,
            add,
            tf32: c.dtype == DType::F32 && allow_tf32,
            alignments: [c.b, c.a, c_matrix, c.c].map(alignment),
        }
    }

    fn describe(&self) -> String {
        let (m, n, k) = self.mnk;
        let mut s = format!("{} [{m}×{k}]·[{k}×{n}]", self.dtype);
        if self.batch > 1 {
            s += &format!(" ×{}", self.batch);
        }
        for (on, what) in [
            (self.trans.0, " a transposed"),
            (self.trans.1, " b transposed"),
            (self.bias, " +bias"),
            (self.add, " +addend"),
            (self.gelu_tanh, " gelu"),
            (self.tf32, " tf32"),
        ] {
            if on {
                s += what;
            }
        }
        s
    }
}

/// One measured shape: each candidate's median time (None: it failed to run) and the one
/// kept.
#[derive(Clone, Debug)]
pub struct Tuning {
    pub product: String,
    pub candidates: Vec<(String, Option<f64>)>,
    pub chosen: String,
}

/// The index of the fastest candidate by median time; the earliest among equals (cuBLASLt's
/// heuristic order breaks ties). None when none ran.
pub fn fastest(medians: &[Option<f64>]) -> Option<usize> {
    let mut best: Option<(usize, f64)> = None;
    for (i, t) in medians.iter().enumerate() {
        if let Some(t) = *t {
            if best.is_none_or(|(_, b)| t < b) {
                best = Some((i, t));
            }
        }
    }
    best.map(|(i, _)| i)
}

/// The median of `times` (not empty).
pub fn median(times: &mut [f64]) -> f64 {
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// The product libraries of one GPU: handles, the choice per shape, and what was measured.
pub(crate) struct Products {
    lt: ltsys::cublasLtHandle_t,
    /// None where libcublas is missing (cuBLASLt alone still serves every product).
    blas: Option<blassys::cublasHandle_t>,
    /// The handles are not safe to use from two threads at once.
    lock: Mutex<()>,
    choices: Mutex<HashMap<ProductKey, Choice>>,
    records: Mutex<Vec<Tuning>>,
    /// Bytes written before each timed run to evict the operands from L2.
    flush_bytes: usize,
}

// SAFETY: library handles are process-wide objects; their use is serialized by `lock`.
unsafe impl Send for Products {}
unsafe impl Sync for Products {}

impl Products {
    /// The handles for the current context; `l2_bytes` is the GPU's L2 cache size.
    pub(crate) fn open(l2_bytes: usize) -> Result<Products> {
        // SAFETY: loads libcublasLt; a missing library panics, caught by `Gpu::get`.
        if !unsafe { ltsys::is_culib_present() } {
            return Err(Error::Runtime(
                "libcublasLt was not found (it comes with the CUDA build of torch)".into(),
            ));
        }
        let lt = lt::create_handle().map_err(|e| driver_err("cublasLtCreate", e))?;
        Ok(Products {
            lt,
            blas: open_blas(),
            lock: Mutex::new(()),
            choices: Mutex::default(),
            records: Mutex::default(),
            flush_bytes: (2 * l2_bytes).max(8 << 20),
        })
    }

    /// What was measured so far, oldest first.
    pub(crate) fn tunings(&self) -> Vec<Tuning> {
        self.records
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn choice(&self, key: &ProductKey) -> Option<Choice> {
        self.choices
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
            .copied()
    }

    fn record(&self, tuning: Tuning) {
        let mut records = self.records.lock().unwrap_or_else(|e| e.into_inner());
        if records.len() >= MAX_RECORDS {
            records.remove(0);
        }
        records.push(tuning);
    }

    fn remember(&self, key: ProductKey, choice: Choice) {
        let mut choices = self.choices.lock().unwrap_or_else(|e| e.into_inner());
        if choices.len() >= MAX_CHOICES {
            choices.clear();
        }
        choices.insert(key, choice);
    }
}

/// A cuBLAS handle that never reduces 16-bit products in 16 bits, or None where libcublas
/// is missing or refuses (then cuBLASLt serves every product).
fn open_blas() -> Option<blassys::cublasHandle_t> {
    // SAFETY: only tries to open libcublas.
    if !unsafe { blassys::is_culib_present() } {
        return None;
    }
    let handle = blas::create_handle().ok()?;
    // SAFETY: a live handle; split sums of f16/bf16 products are added in f32, as cuBLASLt's
    // are (`REDUCTION_SCHEME_MASK` below).
    let math = unsafe {
        blassys::cublasSetMathMode(
            handle,
            blassys::cublasMath_t::CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION,
        )
    };
    if math.result().is_err() {
        // SAFETY: created above, destroyed once.
        let _ = unsafe { blas::destroy_handle(handle) };
        return None;
    }
    Some(handle)
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

fn blas_data_type(d: DType) -> Option<blassys::cudaDataType> {
    Some(match d {
        DType::F32 => blassys::cudaDataType::CUDA_R_32F,
        DType::F64 => blassys::cudaDataType::CUDA_R_64F,
        DType::F16 => blassys::cudaDataType::CUDA_R_16F,
        DType::BF16 => blassys::cudaDataType::CUDA_R_16BF,
        _ => return None,
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

/// A product's cuBLASLt descriptors and its key.
struct Setup {
    key: ProductKey,
    desc: Lt<ltsys::cublasLtMatmulDesc_t>,
    la: Lt<ltsys::cublasLtMatrixLayout_t>,
    lb: Lt<ltsys::cublasLtMatrixLayout_t>,
    lc: Lt<ltsys::cublasLtMatrixLayout_t>,
}

impl Setup {
    fn new(c: &GemmCall, allow_tf32: bool) -> Result<Setup> {
        use ltsys::cublasLtMatmulDescAttributes_t as Desc;
        let t = data_type(c.dtype)?;
        let tf32 = c.dtype == DType::F32 && allow_tf32;
        let (compute, scale) = if c.dtype == DType::F64 {
            (
                ltsys::cublasComputeType_t::CUBLAS_COMPUTE_64F,
                ltsys::cudaDataType::CUDA_R_64F,
            )
        } else if tf32 {
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
        Ok(Setup {
            key: ProductKey::of(c, allow_tf32),
            desc,
            la,
            lb,
            lc,
        })
    }

    /// cuBLASLt's first `count` heuristic algorithms (best first) for this product.
    fn heuristics(
        &self,
        handle: ltsys::cublasLtHandle_t,
        count: usize,
    ) -> Result<Vec<ltsys::cublasLtMatmulAlgo_t>> {
        use ltsys::cublasLtMatmulPreferenceAttributes_t as Pref;
        let pref = Lt {
            raw: lt::create_matmul_pref().map_err(lt_err("matmul"))?,
            destroy: lt::destroy_matmul_pref,
        };
        set_pref(
            pref.raw,
            Pref::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &WORKSPACE_BYTES,
        )?;
        if matches!(self.key.dtype, DType::F16 | DType::BF16) {
            // Split-K partial sums are kept and added in f32 in the workspace
            // (COMPUTE_TYPE); the in-place and output-type schemes add them in the output's
            // 16 bits. Unsplit algorithms (no scheme) stay allowed.
            let schemes: u32 =
                ltsys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;
            set_pref(
                pref.raw,
                Pref::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                &schemes,
            )?;
        }
        for (attr, align) in [
            Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
            Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
            Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
        ]
        .into_iter()
        .zip(self.key.alignments)
        {
            set_pref(pref.raw, attr, &align)?;
        }
        let mut results: Vec<ltsys::cublasLtMatmulHeuristicResult_t> = Vec::with_capacity(count);
        let mut returned: std::ffi::c_int = 0;
        let (m, n, k) = self.key.mnk;
        // SAFETY: live handle and descriptors; `results` has room for `count` entries, of
        // which the library writes `returned`.
        unsafe {
            ltsys::cublasLtMatmulAlgoGetHeuristic(
                handle,
                self.desc.raw,
                self.la.raw,
                self.lb.raw,
                self.lc.raw,
                self.lc.raw,
                pref.raw,
                count as std::ffi::c_int,
                results.as_mut_ptr(),
                &mut returned,
            )
            .result()
            .map_err(|e| {
                driver_err(
                    &format!("matmul ({m}×{k} · {k}×{n}, {})", self.key.dtype),
                    e,
                )
            })?;
            results.set_len((returned.max(0) as usize).min(count));
        }
        let algos: Vec<_> = results
            .iter()
            .filter(|r| r.state == ltsys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
            .map(|r| r.algo)
            .collect();
        if algos.is_empty() {
            return Err(Error::Runtime(format!(
                "cuBLASLt has no algorithm for a {} product",
                self.key.describe()
            )));
        }
        Ok(algos)
    }
}

/// Whether cuBLAS can run `c`: no bias or GELU epilogue (an addend it adds in place, after
/// copying it into the result), 32-bit sizes.
fn blas_serves(c: &GemmCall) -> bool {
    let fits = |v: usize| v <= i32::MAX as usize;
    c.bias == 0
        && !c.gelu_tanh
        && blas_data_type(c.dtype).is_some()
        && [c.m, c.n, c.k, c.batch, c.m * c.k, c.n * c.k, c.m * c.n]
            .into_iter()
            .all(fits)
}

fn tuning_enabled() -> bool {
    std::env::var("EMBER_CUDA_TUNE_PRODUCTS").map_or(true, |v| v != "0")
}

/// A library forced for every product it serves, unmeasured: `EMBER_CUDA_PRODUCT_LIBRARY`
/// = `cublas` or `cublaslt` (its first heuristic). For tests of each path and comparisons
/// on a GPU.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Forced {
    Blas,
    Lt,
}

fn forced_library() -> Option<Forced> {
    match std::env::var("EMBER_CUDA_PRODUCT_LIBRARY").ok()?.as_str() {
        "cublas" => Some(Forced::Blas),
        "cublaslt" => Some(Forced::Lt),
        _ => None,
    }
}

/// Scratch for measuring on the private stream, freed in stream order on drop.
struct Scratch {
    ptr: sys::CUdeviceptr,
    stream: sys::CUstream,
}

impl Scratch {
    fn new(bytes: usize, stream: sys::CUstream) -> Result<Scratch> {
        // SAFETY: a stream-ordered allocation on our own stream, used only there.
        let ptr = unsafe { drv::malloc_async(stream, bytes.max(1)) }
            .map_err(|e| driver_err(&format!("allocation of {bytes} bytes"), e))?;
        Ok(Scratch { ptr, stream })
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // SAFETY: allocated on `stream` by `new`, freed once in its order.
        let _ = unsafe { drv::free_async(self.ptr, self.stream) };
    }
}

/// A CUDA event of the current context, destroyed on drop.
struct Event(sys::CUevent);

impl Event {
    fn new() -> Result<Event> {
        drv::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map(Event)
            .map_err(|e| driver_err("event creation", e))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by `new`, destroyed once.
        let _ = unsafe { drv::event::destroy(self.0) };
    }
}

impl CudaDevice {
    /// `c.c = c.a · c.b` enqueued on `stream`, by the kernel measured fastest for its shape
    /// (cuBLASLt's first heuristic where it was not measured: inside a capture).
    pub(crate) fn gemm_on(&self, c: &GemmCall, stream: sys::CUstream) -> Result<()> {
        self.gpu.make_current()?;
        let workspace = self.workspace_addr()?;
        let products = &self.gpu.products;
        let setup = Setup::new(c, self.allow_tf32)?;
        let _one_at_a_time = products.lock.lock().unwrap_or_else(|e| e.into_inner());
        let forced = forced_library();
        let choice = match products.choice(&setup.key) {
            _ if forced == Some(Forced::Blas) && products.blas.is_some() && blas_serves(c) => {
                Choice::Blas
            }
            _ if forced.is_some() => Choice::Lt(setup.heuristics(products.lt, 1)?[0]),
            Some(choice) => choice,
            None => {
                let first = Choice::Lt(setup.heuristics(products.lt, 1)?[0]);
                if !tuning_enabled() {
                    products.remember(setup.key, first);
                }
                first
            }
        };
        self.enqueue(&setup, c, choice, c.c, workspace, stream)
    }

    /// Measures the candidates for `c`'s shape unless its choice is known (or measuring is
    /// off). Runs on the private stream, writing only scratch of its own: never inside a
    /// capture, and safe while earlier work of this program still runs on torch's stream.
    pub(crate) fn tune(&self, c: &GemmCall) -> Result<()> {
        if !tuning_enabled() || forced_library().is_some() {
            return Ok(());
        }
        let products = &self.gpu.products;
        // Known shapes (every patch of a recording asks) return before any descriptor is
        // made.
        if products
            .choice(&ProductKey::of(c, self.allow_tf32))
            .is_some()
        {
            return Ok(());
        }
        self.gpu.make_current()?;
        let setup = Setup::new(c, self.allow_tf32)?;
        let _no_capture = self
            .gpu
            .capture_lock
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let _one_at_a_time = products.lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut candidates: Vec<(String, Choice)> = setup
            .heuristics(products.lt, HEURISTICS)?
            .into_iter()
            .enumerate()
            .map(|(i, a)| (format!("cublasLt #{i}"), Choice::Lt(a)))
            .collect();
        if products.blas.is_some() && blas_serves(c) {
            candidates.push(("cublas".to_string(), Choice::Blas));
        }
        if candidates.len() == 1 {
            products.remember(setup.key, candidates[0].1);
            return Ok(());
        }
        // Measuring is an optimization: where it fails (no stream-ordered memory) or no
        // candidate ran, the heuristic's first choice serves (the product itself then
        // reports any real error), and the record says why.
        let timed = self.time_candidates(&setup, c, &candidates);
        let best = timed.as_ref().ok().and_then(|medians| fastest(medians));
        let medians = timed.as_ref().map_or(&[][..], |m| m.as_slice());
        let chosen = match (&timed, best) {
            (_, Some(best)) => candidates[best].0.clone(),
            (Err(e), None) => format!("{} (measuring failed: {e})", candidates[0].0),
            (Ok(_), None) => format!("{} (no candidate ran)", candidates[0].0),
        };
        products.remember(setup.key, candidates[best.unwrap_or(0)].1);
        products.record(Tuning {
            product: setup.key.describe(),
            candidates: candidates
                .iter()
                .zip(medians)
                .map(|((name, _), t)| (name.clone(), *t))
                .collect(),
            chosen,
        });
        Ok(())
    }

    /// Each candidate's median time in µs (None where it failed to run), measured on the
    /// private stream with the L2 cache flushed before each run. The caller holds the
    /// capture lock (the stream is not capturing) and the libraries' lock.
    fn time_candidates(
        &self,
        setup: &Setup,
        c: &GemmCall,
        candidates: &[(String, Choice)],
    ) -> Result<Vec<Option<f64>>> {
        let products = &self.gpu.products;
        let stream = self.gpu.capture_stream;
        // Work still queued on torch's stream (this program's previous run) would share
        // the GPU with the timed runs: let it finish first (once per new shape).
        // SAFETY: a live stream handle, not capturing (`may_measure`).
        unsafe { drv::stream::synchronize(self.stream()) }
            .map_err(|e| driver_err("synchronize", e))?;
        let medians = {
            let out_bytes = c.batch * c.m * c.n * c.dtype.size();
            let workspace = Scratch::new(WORKSPACE_BYTES, stream)?;
            let out = Scratch::new(out_bytes, stream)?;
            let flush = Scratch::new(products.flush_bytes, stream)?;
            let (start, end) = (Event::new()?, Event::new()?);
            let mut medians = Vec::with_capacity(candidates.len());
            for (_, choice) in candidates {
                let time_one = || -> Result<f64> {
                    // SAFETY: our scratch, on our stream.
                    unsafe {
                        drv::memset_d8_async(flush.ptr, 0, products.flush_bytes, stream)
                            .map_err(|e| driver_err("memset", e))?;
                        drv::event::record(start.0, stream)
                            .map_err(|e| driver_err("event record", e))?;
                    }
                    self.enqueue(setup, c, *choice, out.ptr, workspace.ptr, stream)?;
                    // SAFETY: events of this context, recorded on our stream.
                    unsafe {
                        drv::event::record(end.0, stream)
                            .map_err(|e| driver_err("event record", e))?;
                        drv::event::synchronize(end.0).map_err(|e| driver_err("event wait", e))?;
                        drv::event::elapsed(start.0, end.0)
                    }
                    .map(|ms| f64::from(ms) * 1e3)
                    .map_err(|e| driver_err("event timing", e))
                };
                // A candidate the library refuses at run time is left out, not an error.
                let timed = time_one().and_then(|_| {
                    let mut times = Vec::with_capacity(TIMED_RUNS);
                    for _ in 0..TIMED_RUNS {
                        times.push(time_one()?);
                    }
                    Ok(median(&mut times))
                });
                medians.push(timed.ok());
            }
            medians
        };
        // SAFETY: our own stream: the scratch is freed before the next shape is measured.
        unsafe { drv::stream::synchronize(stream) }.map_err(|e| driver_err("synchronize", e))?;
        Ok(medians)
    }

    /// `c` by `choice`, its result written to `d` (`c.c`, or scratch while measuring).
    fn enqueue(
        &self,
        s: &Setup,
        c: &GemmCall,
        choice: Choice,
        d: u64,
        workspace: u64,
        stream: sys::CUstream,
    ) -> Result<()> {
        let products = &self.gpu.products;
        let (one32, zero32, one64, zero64) = (1.0f32, 0.0f32, 1.0f64, 0.0f64);
        let add = c.addend != 0;
        let (alpha, beta): (*const c_void, *const c_void) = match (c.dtype, add) {
            (DType::F64, false) => (&one64 as *const f64 as _, &zero64 as *const f64 as _),
            (DType::F64, true) => (&one64 as *const f64 as _, &one64 as *const f64 as _),
            (_, false) => (&one32 as *const f32 as _, &zero32 as *const f32 as _),
            (_, true) => (&one32 as *const f32 as _, &one32 as *const f32 as _),
        };
        match choice {
            Choice::Lt(algo) => {
                // β = 1 adds the addend (cuBLASLt's C, laid out as the result D), else 0.
                let c_matrix = if add { c.addend } else { d };
                // SAFETY: descriptors of `s`; α and β of the scale type, alive through the
                // call; device pointers from the executor, sized by the plan; `workspace`
                // is the caller's alone while this product runs.
                unsafe {
                    lt::matmul(
                        products.lt,
                        s.desc.raw,
                        alpha,
                        beta,
                        c.b as *const c_void,
                        s.la.raw,
                        c.a as *const c_void,
                        s.lb.raw,
                        c_matrix as *const c_void,
                        s.lc.raw,
                        d as *mut c_void,
                        s.lc.raw,
                        &algo,
                        workspace as *mut c_void,
                        WORKSPACE_BYTES,
                        stream as ltsys::cudaStream_t,
                    )
                }
                .map_err(lt_err("matmul"))
            }
            Choice::Blas => {
                let handle = products
                    .blas
                    .ok_or_else(|| Error::Runtime("cuBLAS is not loaded".into()))?;
                let t = blas_data_type(c.dtype)
                    .ok_or_else(|| Error::Runtime(format!("cuBLAS has no {} product", c.dtype)))?;
                let compute = match (c.dtype, s.key.tf32) {
                    (DType::F64, _) => blassys::cublasComputeType_t::CUBLAS_COMPUTE_64F,
                    (_, true) => blassys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
                    _ => blassys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                };
                let op = |t: bool| {
                    if t {
                        blassys::cublasOperation_t::CUBLAS_OP_T
                    } else {
                        blassys::cublasOperation_t::CUBLAS_OP_N
                    }
                };
                let (m, n, k) = (c.m as i32, c.n as i32, c.k as i32);
                let lda = if c.trans_b { k } else { n };
                let ldb = if c.trans_a { m } else { k };
                if add && c.addend != d {
                    // cuBLAS adds β·C in place: the addend (a residual) is copied into the
                    // result first, then added to the f32 sums and rounded once, as
                    // cuBLASLt's separate C is.
                    let bytes = c.batch * c.m * c.n * c.dtype.size();
                    // SAFETY: both are `bytes` long (shaped as the result), in stream order.
                    unsafe { drv::memcpy_dtod_async(d, c.addend, bytes, stream) }
                        .map_err(|e| driver_err("copy", e))?;
                }
                // SAFETY: a live handle used under `products.lock`; sizes fit i32
                // (`blas_serves`); pointers and strides as the cuBLASLt layouts above.
                unsafe {
                    blassys::cublasSetStream_v2(handle, stream as blassys::cudaStream_t)
                        .result()
                        .map_err(|e| driver_err("cuBLAS stream", e))?;
                    blassys::cublasSetWorkspace_v2(
                        handle,
                        workspace as *mut c_void,
                        WORKSPACE_BYTES,
                    )
                    .result()
                    .map_err(|e| driver_err("cuBLAS workspace", e))?;
                    blassys::cublasGemmStridedBatchedEx(
                        handle,
                        op(c.trans_b),
                        op(c.trans_a),
                        n,
                        m,
                        k,
                        alpha,
                        c.b as *const c_void,
                        t,
                        lda,
                        (c.n * c.k) as i64,
                        c.a as *const c_void,
                        t,
                        ldb,
                        (c.m * c.k) as i64,
                        beta,
                        d as *mut c_void,
                        t,
                        n,
                        (c.m * c.n) as i64,
                        c.batch as i32,
                        compute,
                        blassys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                    .result()
                    .map_err(|e| driver_err("cuBLAS matmul", e))
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fastest_candidate_by_median_wins_and_failures_are_skipped() {
        assert_eq!(fastest(&[Some(3.0), None, Some(2.0), Some(2.5)]), Some(2));
        assert_eq!(fastest(&[None, Some(1.0)]), Some(1));
        assert_eq!(fastest(&[None, None]), None);
        // Ties go to the earlier candidate (cuBLASLt's own order).
        assert_eq!(fastest(&[Some(2.0), Some(2.0)]), Some(0));
    }

    #[test]
    fn the_median_ignores_one_slow_run() {
        assert_eq!(median(&mut [5.0, 1.0, 1.2, 1.1, 90.0]), 1.2);
    }

    #[test]
    fn a_product_is_described_as_the_tests_and_profile_read_it() {
        // `bench/gpu_profile.py` parses this, and the GPU tests look shapes up by it.
        let call = GemmCall {
            a: 0x1000,
            b: 0x2000,
            c: 0x3000,
            trans_a: false,
            trans_b: true,
            batch: 1,
            m: 1,
            n: 40,
            k: 48,
            dtype: DType::BF16,
            bias: 0,
            addend: 0x4002,
            gelu_tanh: false,
        };
        let key = ProductKey::of(&call, true);
        assert_eq!(
            key.describe(),
            "bfloat16 [1×48]·[48×40] b transposed +addend"
        );
        assert_eq!(key.alignments, [256, 256, 2, 256]);
        assert!(!key.tf32, "TF32 is for f32 products only");
        let batched = GemmCall {
            batch: 3,
            dtype: DType::F32,
            addend: 0,
            ..call
        };
        assert_eq!(
            ProductKey::of(&batched, true).describe(),
            "float32 [1×48]·[48×40] ×3 b transposed tf32"
        );
        assert!(blas_serves(&batched));
        assert!(!blas_serves(&GemmCall {
            bias: 0x5000,
            ..batched
        }));
    }

    #[test]
    fn alignment_is_the_largest_power_of_two_up_to_256() {
        assert_eq!(alignment(0x1000), 256);
        assert_eq!(alignment(0x1002), 2);
        assert_eq!(alignment(0x1010), 16);
    }
}
