//! Tensors crossing the boundary between Ember and its callers: weights bound at compile
//! time and the raw, borrowed views of inputs and outputs passed at call time.

use std::sync::Arc;

use crate::dtype::DType;
use crate::error::{Error, Result};

/// Where a host tensor's bytes live.
#[derive(Clone, Debug)]
pub enum Storage {
    /// Bytes Ember owns (read from an archive, or a constant).
    Owned(Arc<Vec<u8>>),
    /// Bytes owned by the caller (a torch tensor's memory). The caller keeps them alive and
    /// unchanged in size for as long as any program built from them exists.
    External { ptr: usize, len: usize },
}

/// A contiguous tensor in host memory: a weight or a constant.
#[derive(Clone, Debug)]
pub struct HostTensor {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub storage: Storage,
}

impl HostTensor {
    pub fn owned(dtype: DType, shape: Vec<usize>, bytes: Vec<u8>) -> Result<HostTensor> {
        let want = shape.iter().product::<usize>() * dtype.size();
        if bytes.len() != want {
            return Err(Error::Compile(format!(
                "tensor {dtype}{shape:?} needs {want} bytes, got {}",
                bytes.len()
            )));
        }
        Ok(HostTensor {
            dtype,
            shape,
            storage: Storage::Owned(Arc::new(bytes)),
        })
    }

    /// # Safety
    /// `ptr` must point to `numel * dtype.size()` readable bytes that outlive every use.
    pub unsafe fn external(dtype: DType, shape: Vec<usize>, ptr: usize) -> HostTensor {
        let len = shape.iter().product::<usize>() * dtype.size();
        HostTensor {
            dtype,
            shape,
            storage: Storage::External { ptr, len },
        }
    }

    pub fn bytes(&self) -> &[u8] {
        match &self.storage {
            Storage::Owned(v) => v.as_slice(),
            // SAFETY: `external`'s contract keeps the memory valid and sized.
            Storage::External { ptr, len } => unsafe {
                if *len == 0 {
                    &[]
                } else {
                    std::slice::from_raw_parts(*ptr as *const u8, *len)
                }
            },
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A read-only strided view of a caller's tensor (strides in elements, may be 0 or negative
/// never: torch and numpy hand us non-negative strides for the tensors we accept).
#[derive(Clone, Debug)]
pub struct TensorView {
    pub ptr: *const u8,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
}

/// A contiguous output buffer the caller allocated.
#[derive(Clone, Debug)]
pub struct TensorOut {
    pub ptr: *mut u8,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

// SAFETY: views are plain pointers; the caller guarantees exclusive access to outputs and
// the lifetime of inputs for the duration of a run.
unsafe impl Send for TensorView {}
unsafe impl Sync for TensorView {}
unsafe impl Send for TensorOut {}
unsafe impl Sync for TensorOut {}

/// Row-major strides (in elements) of a contiguous tensor.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    strides
}
