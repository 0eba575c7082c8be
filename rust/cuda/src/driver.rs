//! The CUDA driver, loaded at run time: whether a usable GPU is present, and its name and
//! architecture (what NVRTC compiles for).

use cudarc::driver::{result, sys};

/// A GPU the driver reports.
#[derive(Clone, Debug)]
pub struct GpuInfo {
    pub name: String,
    /// `sm_XX` of the device (what kernels are compiled for).
    pub arch: String,
}

/// The GPUs a working driver reports; empty without libcuda, a driver or a device.
pub fn gpus() -> Vec<GpuInfo> {
    // cudarc panics when a library or symbol is missing; a missing driver is not an error.
    std::panic::catch_unwind(|| {
        // SAFETY: probing only; no driver call is made without the library.
        if !unsafe { sys::is_culib_present() } || result::init().is_err() {
            return Vec::new();
        }
        let count = result::device::get_count().unwrap_or(0);
        (0..count)
            .filter_map(|i| {
                let dev = result::device::get(i).ok()?;
                let attr = |a| unsafe { result::device::get_attribute(dev, a) }.ok();
                let major =
                    attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
                let minor =
                    attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
                Some(GpuInfo {
                    name: result::device::get_name(dev).unwrap_or_default(),
                    arch: format!("sm_{major}{minor}"),
                })
            })
            .collect()
    })
    .unwrap_or_default()
}
