//! Window geometry the conv and pool kernels share: spatial dims seen as three (missing
//! leading ones have size 1) and the range of outputs whose tap lands inside the input.

use crate::error::{CpuError, KResult};

/// One spatial axis of a sliding window.
#[derive(Clone, Copy, Debug)]
pub struct Axis {
    pub len: usize,
    pub out: usize,
    pub kernel: usize,
    pub stride: usize,
    pub dilation: usize,
    /// Padding before the first element.
    pub pad: usize,
}

impl Axis {
    pub const UNIT: Axis = Axis {
        len: 1,
        out: 1,
        kernel: 1,
        stride: 1,
        dilation: 1,
        pad: 0,
    };

    /// Offset (in input elements) of tap `k` for output 0: `k·dilation - pad`.
    pub fn tap_offset(&self, k: usize) -> isize {
        (k * self.dilation) as isize - self.pad as isize
    }

    /// Outputs `lo..hi` for which `o·stride + off` lies in `0..len`.
    pub fn valid_outputs(&self, off: isize) -> (usize, usize) {
        let s = self.stride as isize;
        let lo = if off >= 0 { 0 } else { (-off + s - 1) / s };
        let room = self.len as isize - off;
        let hi = if room > 0 { (room + s - 1) / s } else { 0 };
        let hi = (hi as usize).min(self.out);
        let lo = (lo as usize).min(hi);
        (lo, hi)
    }

    /// Taps `lo..hi` of output `o` that land inside the input.
    pub fn valid_taps(&self, o: usize) -> (usize, usize) {
        let start = (o * self.stride) as isize - self.pad as isize;
        let d = self.dilation as isize;
        let lo = if start >= 0 { 0 } else { (-start + d - 1) / d };
        let room = self.len as isize - start;
        let hi = if room > 0 { (room + d - 1) / d } else { 0 };
        let hi = (hi as usize).min(self.kernel);
        ((lo as usize).min(hi), hi)
    }
}

/// Pads up to three axes to exactly three, unit axes first.
pub fn three(axes: &[Axis]) -> KResult<[Axis; 3]> {
    if axes.is_empty() || axes.len() > 3 {
        return Err(CpuError::Unsupported(format!(
            "{} spatial dims (1 to 3 supported)",
            axes.len()
        )));
    }
    let mut a = [Axis::UNIT; 3];
    a[3 - axes.len()..].copy_from_slice(axes);
    Ok(a)
}

/// A non-negative attribute as a size.
pub fn size(v: i64, what: &str) -> KResult<usize> {
    usize::try_from(v).map_err(|_| CpuError::Shape(format!("negative {what} {v}")))
}
