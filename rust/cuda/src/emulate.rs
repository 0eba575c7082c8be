//! Runs generated CUDA kernels on the host, so that what they compute is tested on machines
//! without a GPU: the translation unit is compiled by the host C++ compiler with a shim that
//! maps the CUDA built-ins onto threads (a block's threads run concurrently when the kernel
//! synchronizes, one after another otherwise; blocks one after another, in a scrambled
//! order, as a GPU keeps none), and `gemm` is a plain host loop.
//!
//! This checks indexing, fusion, reductions and the executor; it cannot check what only a
//! GPU does (cuBLASLt, warp timing, the driver), which the `cuda` tests cover.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};

use ember_core::dtype::DType;
use ember_core::{Error, Result};

use crate::codegen::KernelProgram;
use crate::exec::{Device, DeviceBuffer, GemmCall, Work};
use crate::memcheck::{self, Checker, Watch};

const HOST_SHIM: &str = r#"
#define EMBER_HOST 1
#include <math.h>
#include <cmath>
#include <cstring>
#include <algorithm>
#include <barrier>
#include <memory>
#include <numeric>
#include <thread>
#include <utility>
#include <vector>
struct ember_dim3 { unsigned x, y, z; };
static thread_local ember_dim3 threadIdx;
static ember_dim3 blockIdx, blockDim, gridDim;
static thread_local std::barrier<>* ember_barrier;
static thread_local std::barrier<>* ember_warp_barrier;
#define __global__
#define __shared__ static
#define __restrict__ __restrict
#define __syncthreads() ember_barrier->arrive_and_wait()
// A warp's 32 threads meet at their own barrier, as on the GPU: a kernel that needs the
// block to meet must say `__syncthreads` (a race otherwise, which the thread sanitizer
// finds here as `compute-sanitizer --tool racecheck` would on a GPU).
#define __syncwarp() ember_warp_barrier->arrive_and_wait()
#define EMBER_INF (__builtin_inff())
#define EMBER_NAN (__builtin_nanf(""))
#define EMBER_INF64 (__builtin_inf())
#define EMBER_NAN64 (__builtin_nan(""))
static inline float ember_bits_f(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned ember_f_bits(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline float ember_h2f(unsigned short h) {
    unsigned s = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0x1f) return ember_bits_f(s | 0x7f800000u | (m << 13));
    if (e == 0) { float v = std::ldexp((float)m, -24); return s ? -v : v; }
    return ember_bits_f(s | ((e + 112) << 23) | (m << 13));
}
static inline unsigned short ember_f2h(float f) {
    unsigned u = ember_f_bits(f), s = (u >> 16) & 0x8000u;
    float a = std::fabs(f);
    if (a != a) return (unsigned short)(s | 0x7e00u);
    if (a >= 65520.0f) return (unsigned short)(s | 0x7c00u);
    if (a < 6.103515625e-05f) return (unsigned short)(s | (unsigned)std::nearbyint(a * 16777216.0f));
    unsigned v = ember_f_bits(a), e = (v >> 23) - 112, m = v & 0x7fffffu;
    unsigned r = (e << 10) | (m >> 13), rest = m & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (r & 1u))) r += 1;
    return (unsigned short)(s | r);
}
static inline float ember_b2f(unsigned short b) { return ember_bits_f(((unsigned)b) << 16); }
static inline unsigned short ember_f2b(float f) {
    unsigned u = ember_f_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
template <typename... P, std::size_t... I>
static void ember_call_impl(void (*k)(P...), void** a, std::index_sequence<I...>) { k(*(P*)a[I]...); }
template <typename... P>
static void ember_call(void (*k)(P...), void** a) { ember_call_impl(k, a, std::index_sequence_for<P...>{}); }
// The `i`-th of `n` blocks (or a block's threads that never meet) to run. A GPU runs
// them in no set order, so the emulator does not run them in index order either: a
// stride coprime with `n` from the last one (n-1, n-1+s, ... mod n) puts neighbours far
// apart in both directions, and a kernel whose blocks read what others of the same
// launch write, or count on who finishes last, computes wrong numbers here as it could
// on the GPU.
static unsigned ember_scrambled(unsigned i, unsigned n) {
    if (n < 2) return i;
    unsigned long long s = n / 2 + 1;
    while (std::gcd(s, (unsigned long long)n) != 1) ++s;
    return (unsigned)((n - 1 + i * s) % n);
}
template <typename F>
static void ember_run(unsigned grid, unsigned block, bool cooperative, F f) {
    gridDim = {grid, 1, 1};
    blockDim = {block, 1, 1};
    for (unsigned i = 0; i < grid; ++i) {
        const unsigned b = ember_scrambled(i, grid);
        blockIdx = {b, 0, 0};
        if (!cooperative) {
            for (unsigned j = 0; j < block; ++j) {
                threadIdx = {ember_scrambled(j, block), 0, 0};
                f();
            }
            continue;
        }
        std::barrier<> bar(block);
        std::vector<std::unique_ptr<std::barrier<>>> warps;
        for (unsigned w = 0; w * 32 < block; ++w)
            warps.emplace_back(new std::barrier<>(std::min(32u, block - w * 32)));
        std::vector<std::thread> threads;
        for (unsigned t = 0; t < block; ++t)
            threads.emplace_back([&, t] {
                threadIdx = {t, 0, 0};
                ember_barrier = &bar;
                ember_warp_barrier = warps[t / 32].get();
                f();
            });
        for (auto& th : threads) th.join();
    }
}
"#;

/// A compiled host module, cached by source (in memory, and on disk across processes).
struct HostModule {
    lib: libloading::Library,
    /// The shim's launch state (`gridDim`, `blockIdx`, ...) is global to the module, so
    /// two launches of one module never run at once (two programs of the same source
    /// share a module).
    launching: Mutex<()>,
}

fn cache_dir() -> PathBuf {
    std::env::var_os("EMBER_CACHE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
        .join("emulated-kernels")
}

fn fnv(s: &str) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in s.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

fn host_source(kp: &KernelProgram) -> String {
    let mut src = format!("{HOST_SHIM}\n{}\n{}\n", crate::codegen::PRELUDE, kp.source);
    for k in &kp.kernels {
        src.push_str(&format!(
            "extern \"C\" void launch_{0}(unsigned grid, unsigned block, void** args) {{\n    ember_run(grid, block, {1}, [&] {{ ember_call({0}, args); }});\n}}\n",
            k.name, k.cooperative
        ));
    }
    src
}

/// `EMBER_EMU_SANITIZE=thread` (or `address`, `alignment`): the kernels are compiled with
/// that sanitizer, to find data races between a block's threads (a missing `__syncthreads`
/// or `__syncwarp`), reads and writes outside a buffer, or loads and stores at addresses
/// their type's alignment does not allow (a 16-byte `ember_pack` load at an address
/// that is not a multiple of 16: x86 forgives it, a GPU stops with "misaligned address").
/// The process must have the sanitizer's runtime loaded first (`LD_PRELOAD`;
/// `scripts/emu_sanitize.sh` does it).
fn sanitizer() -> Option<&'static str> {
    match std::env::var("EMBER_EMU_SANITIZE").as_deref() {
        Ok("thread") => Some("thread"),
        Ok("address") => Some("address"),
        Ok("alignment") => Some("alignment"),
        _ => None,
    }
}

fn compile(source: &str) -> Result<Arc<HostModule>> {
    static MODULES: OnceLock<Mutex<HashMap<u64, Arc<HostModule>>>> = OnceLock::new();
    let sanitize = sanitizer();
    let key = fnv(source) ^ fnv(sanitize.unwrap_or(""));
    // Held while compiling: two threads asking for one source must get one module (one
    // launch lock), not two handles on the same loaded library.
    let mut modules = MODULES
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(m) = modules.get(&key) {
        return Ok(m.clone());
    }
    let dir = cache_dir();
    std::fs::create_dir_all(&dir).map_err(|e| Error::Compile(format!("{}: {e}", dir.display())))?;
    let lib_path = dir.join(format!("k{key:016x}.so"));
    if !lib_path.exists() {
        let tag = format!("{key:016x}-{}", std::process::id());
        let src_path = dir.join(format!("k{tag}.cpp"));
        let tmp_lib = dir.join(format!("k{tag}.so"));
        std::fs::write(&src_path, source).map_err(|e| Error::Compile(e.to_string()))?;
        let mut cxx = Command::new(std::env::var("CXX").unwrap_or_else(|_| "c++".into()));
        cxx.args(["-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w"]);
        if let Some(kind) = sanitize {
            cxx.arg(format!("-fsanitize={kind}"))
                .args(["-g", "-fno-omit-frame-pointer"]);
        }
        let out = cxx
            .arg("-o")
            .arg(&tmp_lib)
            .arg(&src_path)
            .output()
            .map_err(|e| Error::Compile(format!("cannot run the host C++ compiler: {e}")))?;
        if sanitize.is_none() {
            // Kept when sanitizing: the sanitizer's reports point into it.
            let _ = std::fs::remove_file(&src_path);
        }
        if !out.status.success() {
            return Err(Error::Compile(format!(
                "the emulated kernels do not compile:\n{}",
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        std::fs::rename(&tmp_lib, &lib_path).map_err(|e| Error::Compile(e.to_string()))?;
    }
    // SAFETY: the library is ours, built just now (or earlier) from generated source.
    let lib = unsafe { libloading::Library::new(&lib_path) }
        .map_err(|e| Error::Compile(format!("cannot load {}: {e}", lib_path.display())))?;
    let m = Arc::new(HostModule {
        lib,
        launching: Mutex::new(()),
    });
    modules.insert(key, m.clone());
    Ok(m)
}

/// Aligned to 16 bytes, as the kernels' packed loads need (`cudaMalloc` gives 256).
#[repr(align(16))]
#[derive(Clone, Copy)]
struct Chunk(#[allow(dead_code)] [u8; 16]);

/// The emulator's live buffers, by address: their sizes, for the guard checks.
type Buffers = Arc<Mutex<HashMap<u64, usize>>>;

/// A buffer poisoned when allocated (as `cudaMalloc`'s memory is not zeroed, a kernel that
/// reads what nothing wrote must not read zeros here) and followed by guard bytes.
struct HostBuffer {
    chunks: Vec<Chunk>,
    live: Buffers,
}

impl HostBuffer {
    fn new(bytes: usize, live: &Buffers) -> HostBuffer {
        let chunks =
            vec![Chunk([memcheck::POISON; 16]); (bytes + memcheck::GUARD_BYTES).div_ceil(16)];
        let addr = chunks.as_ptr() as u64;
        memcheck::guard_tail(addr, bytes, true);
        lock(live).insert(addr, bytes);
        HostBuffer {
            chunks,
            live: live.clone(),
        }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        lock(&self.live).remove(&self.addr());
    }
}

impl DeviceBuffer for HostBuffer {
    fn addr(&self) -> u64 {
        self.chunks.as_ptr() as u64
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

type LaunchFn = unsafe extern "C" fn(u32, u32, *mut *mut std::ffi::c_void);

/// The host standing in for a GPU.
pub struct EmulatedDevice {
    module: Arc<HostModule>,
    launchers: Vec<LaunchFn>,
    kernel_names: Vec<String>,
    /// Every buffer allocated here and alive, for the guard checks after each item.
    buffers: Buffers,
    /// The memory check of the run in progress (`memcheck`).
    checker: Mutex<Option<Checker>>,
    /// Launch like the GPU does (256 threads a block, as many blocks as the work has) when
    /// `EMBER_EMULATE_GPU_LAUNCHES=1`: slower, but it checks the kernels at the GPU's sizes.
    gpu_launches: bool,
    /// `EMBER_EMU_TRACE=1`: every launch is printed (kernel, sizes, arguments).
    trace: bool,
    /// Launches so far, by kernel (what tests check a run skipped or added).
    launches: Mutex<Vec<u64>>,
}

impl EmulatedDevice {
    pub fn new(kp: &KernelProgram) -> Result<Self> {
        let module = compile(&host_source(kp))?;
        let mut launchers = Vec::new();
        for k in &kp.kernels {
            let name = format!("launch_{}", k.name);
            // SAFETY: every kernel has a generated launcher of this signature.
            let f: libloading::Symbol<LaunchFn> = unsafe { module.lib.get(name.as_bytes()) }
                .map_err(|e| Error::Compile(format!("{name}: {e}")))?;
            launchers.push(*f);
        }
        Ok(EmulatedDevice {
            module,
            launchers,
            kernel_names: kp.kernels.iter().map(|k| k.name.clone()).collect(),
            buffers: Arc::default(),
            checker: Mutex::new(None),
            gpu_launches: std::env::var("EMBER_EMULATE_GPU_LAUNCHES").is_ok_and(|v| v == "1"),
            trace: std::env::var("EMBER_EMU_TRACE").is_ok_and(|v| v == "1"),
            launches: Mutex::new(vec![0; kp.kernels.len()]),
        })
    }

    /// How many times each kernel (by index) was launched so far.
    pub fn launch_counts(&self) -> Vec<u64> {
        lock(&self.launches).clone()
    }

    /// Launches as the GPU does from now on (as `EMBER_EMULATE_GPU_LAUNCHES=1` would).
    pub fn launching_as_the_gpu(mut self) -> Self {
        self.gpu_launches = true;
        self
    }

    /// Runs one item of work under the memory check: dead values poisoned before it;
    /// after it, the run's memory and every buffer's guard checked.
    fn checked(&self, what: &dyn Fn() -> String, item: impl FnOnce() -> Result<()>) -> Result<()> {
        let mut checker = lock(&self.checker);
        if let Some(c) = checker.as_mut() {
            c.before_item();
        }
        item()?;
        if let Some(c) = checker.as_mut() {
            c.after_item()?;
        }
        for (&addr, &bytes) in lock(&self.buffers).iter() {
            if let Some(k) = memcheck::guard_tail(addr, bytes, false) {
                return Err(Error::Runtime(format!(
                    "emulator memory check: {} wrote {k} bytes past the end of a buffer of {bytes} bytes",
                    what()
                )));
            }
        }
        Ok(())
    }
}

fn read_f(dtype: DType, base: u64, i: usize) -> f64 {
    // SAFETY (callers): `base` addresses a live buffer holding element `i` of `dtype`.
    unsafe {
        match dtype {
            DType::F32 => *(base as *const f32).add(i) as f64,
            DType::F64 => *(base as *const f64).add(i),
            DType::F16 => half::f16::from_bits(*(base as *const u16).add(i)).to_f64(),
            _ => half::bf16::from_bits(*(base as *const u16).add(i)).to_f64(),
        }
    }
}

fn write_f(dtype: DType, base: u64, i: usize, v: f64) {
    // SAFETY (callers): `base` addresses a live buffer with room for element `i`.
    unsafe {
        match dtype {
            DType::F32 => *(base as *mut f32).add(i) = v as f32,
            DType::F64 => *(base as *mut f64).add(i) = v,
            DType::F16 => *(base as *mut u16).add(i) = half::f16::from_f64(v).to_bits(),
            _ => *(base as *mut u16).add(i) = half::bf16::from_f64(v).to_bits(),
        }
    }
}

/// cuBLASLt's product as a plain host loop (f64 accumulation, rounded once).
fn host_gemm(c: &GemmCall) -> Result<()> {
    let (m, n, k) = (c.m, c.n, c.k);
    for b in 0..c.batch {
        let (ab, bb, cb) = (b * m * k, b * k * n, b * m * n);
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0f64;
                for p in 0..k {
                    let ai = if c.trans_a { p * m + i } else { i * k + p };
                    let bi = if c.trans_b { j * k + p } else { p * n + j };
                    s += read_f(c.dtype, c.a, ab + ai) * read_f(c.dtype, c.b, bb + bi);
                }
                if c.bias != 0 {
                    // cuBLASLt's epilogue: added to the f32 accumulator, rounded once.
                    s += read_f(c.dtype, c.bias, j);
                }
                if c.addend != 0 {
                    // cuBLASLt's β·C, likewise.
                    s += read_f(c.dtype, c.addend, cb + i * n + j);
                }
                if c.gelu_tanh {
                    let inner = 0.797_884_560_802_865_4 * (s + 0.044715 * s * s * s);
                    s = 0.5 * s * (1.0 + inner.tanh());
                }
                write_f(c.dtype, c.c, cb + i * n + j, s);
            }
        }
    }
    Ok(())
}

impl Device for EmulatedDevice {
    /// A recording is the list of work itself, replayed in order (what a CUDA graph of a
    /// chain of nodes does), so the executor's recording, patching and bucketing run here.
    type Recording = Vec<Work>;

    fn alloc(&self, bytes: usize) -> Result<Box<dyn DeviceBuffer>> {
        Ok(Box::new(HostBuffer::new(bytes, &self.buffers)))
    }

    fn upload(&self, dst: u64, src: &[u8]) -> Result<()> {
        // SAFETY: `dst` is one of our buffers, at least `src.len()` bytes long.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }

    fn download(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        // SAFETY: `src` is one of our buffers, at least `dst.len()` bytes long.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn launch(&self, kernel: usize, grid: u32, block: u32, args: &[u64]) -> Result<()> {
        let mut values: Vec<u64> = args.to_vec();
        let mut ptrs: Vec<*mut std::ffi::c_void> = values
            .iter_mut()
            .map(|v| v as *mut u64 as *mut std::ffi::c_void)
            .collect();
        if self.trace {
            let name = self.kernel_names.get(kernel).map_or("?", String::as_str);
            eprintln!("launch k{kernel} {name} grid {grid} block {block} args {args:x?}");
        }
        let launcher = *self
            .launchers
            .get(kernel)
            .ok_or_else(|| Error::Runtime(format!("no kernel {kernel} in the module")))?;
        lock(&self.launches)[kernel] += 1;
        let name = || format!("kernel {}", self.kernel_names[kernel]);
        self.checked(&name, || {
            let _alone = lock(&self.module.launching);
            // SAFETY: the launcher unpacks exactly the kernel's parameters from `ptrs`.
            unsafe { launcher(grid, block, ptrs.as_mut_ptr()) };
            Ok(())
        })
    }

    fn gemm(&self, c: &GemmCall) -> Result<()> {
        if self.trace {
            eprintln!(
                "gemm {}×{}·{}×{} batch {} {}",
                c.m, c.k, c.k, c.n, c.batch, c.dtype
            );
        }
        self.checked(&|| "a library product".to_string(), || host_gemm(c))
    }

    fn checks_memory(&self) -> bool {
        true
    }

    fn watch(&self, watch: Watch) {
        *lock(&self.checker) = Some(Checker::new(watch));
    }

    fn launch_limits(&self, cooperative: bool) -> (u32, u32) {
        if self.gpu_launches {
            return (256, 65535);
        }
        // Few blocks, so the grid-stride loops are exercised and threads stay cheap.
        if cooperative {
            (32, 4)
        } else {
            (64, 4)
        }
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn record(&self, work: &[Work]) -> Result<Option<Vec<Work>>> {
        Ok(Some(work.to_vec()))
    }

    fn update(&self, recording: &mut Vec<Work>, index: usize, work: &Work) -> Result<bool> {
        recording[index] = work.clone();
        Ok(true)
    }

    fn replay(&self, recording: &Vec<Work>) -> Result<()> {
        recording.iter().try_for_each(|w| w.run(self))
    }

    type Mark = std::time::Instant;

    fn mark(&self, _stream: u64) -> Result<std::time::Instant> {
        Ok(std::time::Instant::now())
    }

    fn seconds_between(&self, start: &std::time::Instant, end: &std::time::Instant) -> Result<f64> {
        Ok(end.duration_since(*start).as_secs_f64())
    }
}
