//! NVRTC: generated CUDA source → CUBIN for one real architecture (`sm_90`), never PTX (a
//! newer NVRTC's PTX can be refused by an older driver). Results are cached by a hash of the
//! source and architecture, in memory and on disk (`$EMBER_CACHE_DIR/cuda-kernels`).
//!
//! libnvrtc is loaded at run time; the Python package loads torch's copy first (see
//! `ember/cuda.py`), so nothing needs `LD_LIBRARY_PATH`.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, CString};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::sys;
use ember_core::{Error, Result};

/// Is libnvrtc loadable in this process?
pub fn available() -> bool {
    // SAFETY: only probes for the library; loads nothing into use.
    std::panic::catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false)
}

/// NVRTC's (major, minor) version.
pub fn version() -> Result<(i32, i32)> {
    require()?;
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: plain out-parameters.
    check(
        unsafe { sys::nvrtcVersion(&mut major, &mut minor) },
        "nvrtcVersion",
    )?;
    Ok((major, minor))
}

fn require() -> Result<()> {
    if available() {
        Ok(())
    } else {
        Err(Error::Runtime(
            "libnvrtc was not found: install the CUDA build of torch (it ships libnvrtc) or a \
             CUDA toolkit, and import ember (which loads torch's copy) before compiling"
                .into(),
        ))
    }
}

fn check(r: sys::nvrtcResult, what: &str) -> Result<()> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(Error::Runtime(format!("{what} failed: {r:?}")))
    }
}

fn fnv(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for p in parts {
        for b in p.bytes().chain([0u8]) {
            h ^= b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
    }
    h
}

fn disk_dir() -> Option<PathBuf> {
    let base = std::env::var_os("EMBER_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache").join("ember"))
        })?;
    Some(base.join("cuda-kernels"))
}

/// Compiles `source` for `arch` (e.g. `"sm_90"`) and returns the CUBIN.
pub fn compile(source: &str, arch: &str) -> Result<Arc<Vec<u8>>> {
    static CACHE: OnceLock<Mutex<HashMap<u64, Arc<Vec<u8>>>>> = OnceLock::new();
    let (major, minor) = version()?;
    let nvrtc = format!("{major}.{minor}");
    let key = fnv(&[source, arch, &nvrtc, &options(arch).join(" ")]);
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(c) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(c.clone());
    }
    let path = disk_dir().map(|d| d.join(format!("{key:016x}-{arch}.cubin")));
    // A file that is not an ELF object (cut short, overwritten) is compiled again.
    let cached = path.as_ref().and_then(|p| std::fs::read(p).ok());
    if let Some(bytes) = cached.filter(|b| b.starts_with(b"\x7fELF")) {
        let c = Arc::new(bytes);
        cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, c.clone());
        return Ok(c);
    }
    let cubin = Arc::new(compile_uncached(source, arch)?);
    if let Some(p) = path {
        // The cache is an optimization: a failed write only costs a recompile later.
        if let Some(dir) = p.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, cubin.as_slice()).is_ok() {
            let _ = std::fs::rename(&tmp, &p);
        }
    }
    cache
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key, cubin.clone());
    Ok(cubin)
}

/// NVRTC's options for `arch` (part of the cache key: other options, other code).
fn options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        // Exact IEEE division and square roots: results must match eager PyTorch.
        "--prec-div=true".into(),
        "--prec-sqrt=true".into(),
        // Multiply-adds fuse (one rounding instead of two), as in torch's own CUDA kernels
        // and Inductor's: within an ulp of the host emulator, which rounds each step.
        "--fmad=true".into(),
    ]
}

fn compile_uncached(source: &str, arch: &str) -> Result<Vec<u8>> {
    let src =
        CString::new(source).map_err(|_| Error::Compile("CUDA source holds a NUL byte".into()))?;
    let name = CString::new("ember_kernels.cu").unwrap_or_default();
    let options: Vec<CString> = options(arch)
        .into_iter()
        .filter_map(|o| CString::new(o).ok())
        .collect();
    let opt_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: valid C strings that outlive the calls; `prog` is destroyed below.
    unsafe {
        check(
            sys::nvrtcCreateProgram(
                &mut prog,
                src.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            ),
            "nvrtcCreateProgram",
        )?;
        let compiled = sys::nvrtcCompileProgram(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr());
        let result = if compiled == sys::nvrtcResult::NVRTC_SUCCESS {
            let mut size = 0usize;
            check(sys::nvrtcGetCUBINSize(prog, &mut size), "nvrtcGetCUBINSize").and_then(|_| {
                let mut out = vec![0u8; size];
                check(
                    sys::nvrtcGetCUBIN(prog, out.as_mut_ptr() as *mut c_char),
                    "nvrtcGetCUBIN",
                )
                .map(|_| out)
            })
        } else {
            Err(Error::Compile(format!(
                "NVRTC could not compile the generated kernels for {arch} ({compiled:?}):\n{}",
                program_log(prog)
            )))
        };
        let _ = sys::nvrtcDestroyProgram(&mut prog);
        result
    }
}

/// # Safety
/// `prog` must be a live NVRTC program.
unsafe fn program_log(prog: sys::nvrtcProgram) -> String {
    let mut size = 0usize;
    if sys::nvrtcGetProgramLogSize(prog, &mut size) != sys::nvrtcResult::NVRTC_SUCCESS {
        return String::new();
    }
    let mut log = vec![0u8; size];
    if sys::nvrtcGetProgramLog(prog, log.as_mut_ptr() as *mut c_char)
        != sys::nvrtcResult::NVRTC_SUCCESS
    {
        return String::new();
    }
    String::from_utf8_lossy(&log)
        .trim_end_matches('\0')
        .to_string()
}
