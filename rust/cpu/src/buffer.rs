//! Run-time values: a storage (caller memory, a weight, or a buffer we own) seen through a
//! strided layout. Every `Val` is bounds-checked against its storage when it is made, so the
//! kernels' raw reads through a `View` stay inside the allocation by construction.

use std::sync::Arc;

use ember_core::dtype::DType;
use ember_core::tensor::contiguous_strides;

use crate::error::{CpuError, KResult};

/// Bytes a value lives in. Owned buffers are 8-byte aligned; external memory is checked for
/// element alignment before it is used (and copied once if it is not aligned).
pub enum Storage {
    External { ptr: *const u8, bytes: usize },
    Owned { data: Vec<u64>, bytes: usize },
}

// SAFETY: external storage is read-only memory the caller keeps alive for the whole call (or
// the program's life, for weights); owned storage is a plain vector.
unsafe impl Send for Storage {}
unsafe impl Sync for Storage {}

impl Storage {
    pub fn zeroed(bytes: usize) -> Storage {
        Storage::Owned {
            data: vec![0u64; bytes.div_ceil(8)],
            bytes,
        }
    }

    /// An aligned copy of `src`.
    pub fn copy_of(src: &[u8]) -> Storage {
        let mut s = Storage::zeroed(src.len());
        if let Storage::Owned { data, .. } = &mut s {
            // SAFETY: `data` holds at least `src.len()` bytes and does not overlap `src`.
            unsafe {
                std::ptr::copy_nonoverlapping(src.as_ptr(), data.as_mut_ptr() as *mut u8, src.len())
            };
        }
        s
    }

    pub fn ptr(&self) -> *const u8 {
        match self {
            Storage::External { ptr, .. } => *ptr,
            Storage::Owned { data, .. } => data.as_ptr() as *const u8,
        }
    }

    pub fn bytes(&self) -> usize {
        match self {
            Storage::External { bytes, .. } | Storage::Owned { bytes, .. } => *bytes,
        }
    }
}

/// Shape, strides (in elements, possibly 0 or negative) and offset of a value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub shape: Vec<usize>,
    pub strides: Vec<isize>,
    pub offset: isize,
}

impl Layout {
    pub fn contiguous(shape: &[usize]) -> Layout {
        Layout {
            shape: shape.to_vec(),
            strides: contiguous_strides(shape)
                .into_iter()
                .map(|s| s as isize)
                .collect(),
            offset: 0,
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Row-major contiguous (dims of size 1 may have any stride).
    pub fn is_contiguous(&self) -> bool {
        let mut expect = 1isize;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d != 1 && s != expect {
                return false;
            }
            expect *= d as isize;
        }
        true
    }

    /// Smallest and largest element offsets reached, or None for an empty tensor.
    pub fn extent(&self) -> Option<(isize, isize)> {
        if self.shape.contains(&0) {
            return None;
        }
        let (mut lo, mut hi) = (self.offset, self.offset);
        for (&d, &s) in self.shape.iter().zip(&self.strides) {
            let span = (d as isize - 1) * s;
            if span < 0 {
                lo += span;
            } else {
                hi += span;
            }
        }
        Some((lo, hi))
    }
}

/// Whether `ptr` is aligned for elements of `size` bytes (a power of two).
pub fn is_aligned(ptr: *const u8, size: usize) -> bool {
    (ptr as usize) & (size - 1) == 0
}

/// A value during a call.
#[derive(Clone)]
pub struct Val {
    pub dtype: DType,
    pub storage: Arc<Storage>,
    pub layout: Layout,
}

impl Val {
    /// Checks that every element the layout reaches lies inside the storage.
    pub fn new(dtype: DType, storage: Arc<Storage>, layout: Layout) -> KResult<Val> {
        if layout.shape.len() != layout.strides.len() {
            return Err(CpuError::Internal("layout rank mismatch".into()));
        }
        if let Some((lo, hi)) = layout.extent() {
            let n = (storage.bytes() / dtype.size()) as isize;
            if lo < 0 || hi >= n {
                return Err(CpuError::Internal(format!(
                    "layout {layout:?} reaches outside a buffer of {n} elements"
                )));
            }
            if !is_aligned(storage.ptr(), dtype.size()) {
                return Err(CpuError::Internal("misaligned storage".into()));
            }
        }
        Ok(Val {
            dtype,
            storage,
            layout,
        })
    }

    /// A fresh zeroed contiguous buffer filled by `fill`.
    pub fn build<T: Copy>(
        dtype: DType,
        shape: &[usize],
        fill: impl FnOnce(&mut [T]) -> KResult<()>,
    ) -> KResult<Val> {
        if std::mem::size_of::<T>() != dtype.size() {
            return Err(CpuError::Internal(format!(
                "element size mismatch for {dtype}"
            )));
        }
        let n: usize = shape.iter().product();
        let mut storage = Storage::zeroed(n * dtype.size());
        if let Storage::Owned { data, .. } = &mut storage {
            // SAFETY: the buffer holds `n` elements of T's size, is 8-byte aligned and zeroed
            // (a valid value of every element type).
            let slice = unsafe { std::slice::from_raw_parts_mut(data.as_mut_ptr() as *mut T, n) };
            fill(slice)?;
        }
        Val::new(dtype, Arc::new(storage), Layout::contiguous(shape))
    }

    pub fn shape(&self) -> &[usize] {
        &self.layout.shape
    }

    pub fn numel(&self) -> usize {
        self.layout.numel()
    }

    /// A typed read view. `T` must have the dtype's size.
    pub fn view<T: Copy>(&self) -> KResult<View<T>> {
        if std::mem::size_of::<T>() != self.dtype.size() {
            return Err(CpuError::Internal(format!(
                "viewing {} with a type of {} bytes",
                self.dtype,
                std::mem::size_of::<T>()
            )));
        }
        Ok(View {
            ptr: (self.storage.ptr() as *const T).wrapping_offset(self.layout.offset),
            shape: self.layout.shape.clone(),
            strides: self.layout.strides.clone(),
            _keep: self.storage.clone(),
        })
    }

    /// Same storage, another layout (checked).
    pub fn with_layout(&self, layout: Layout) -> KResult<Val> {
        Val::new(self.dtype, self.storage.clone(), layout)
    }

    /// This value, or a contiguous copy of it when its layout is not contiguous.
    pub fn contiguous(&self) -> KResult<Val> {
        if self.layout.is_contiguous() {
            return Ok(self.clone());
        }
        crate::with_size!(self.dtype, U => {
            let v = self.view::<U>()?;
            Val::build::<U>(self.dtype, self.shape(), |out| {
                crate::strided::map1(&v, out, |x| x);
                Ok(())
            })
        })
    }

    /// The contiguous elements as a slice (copying first if needed).
    pub fn to_vec<T: Copy + Send>(&self) -> KResult<Vec<T>> {
        let v = self.view::<T>()?;
        let n = v.numel();
        if n == 0 {
            return Ok(Vec::new());
        }
        if self.layout.is_contiguous() {
            return Ok(v.run(0, n).to_vec());
        }
        // Every element overwritten by `map1` (which copies a transposed layout by tiles).
        let mut out = vec![v.at(0); n];
        crate::strided::map1(&v, &mut out, |x| x);
        Ok(out)
    }
}

/// Read access to a value's elements: `ptr` points at element (0, .., 0).
pub struct View<T> {
    pub ptr: *const T,
    pub shape: Vec<usize>,
    pub strides: Vec<isize>,
    /// Keeps the memory alive while the view exists.
    _keep: Arc<Storage>,
}

// SAFETY: a view only reads memory that its `Val` checked and keeps alive.
unsafe impl<T> Send for View<T> {}
unsafe impl<T> Sync for View<T> {}

impl<T: Copy> View<T> {
    /// The element at `off` elements from (0, .., 0). `off` must come from walking this view's
    /// shape and strides (every such offset was bounds-checked when the value was made).
    #[inline(always)]
    pub fn at(&self, off: isize) -> T {
        // SAFETY: see above.
        unsafe { *self.ptr.wrapping_offset(off) }
    }

    /// `len` elements from `off` with unit stride, as a slice (same contract as `at`).
    #[inline(always)]
    pub fn run(&self, off: isize, len: usize) -> &[T] {
        if len == 0 {
            return &[];
        }
        // SAFETY: see `at`; aligned because the storage was checked for alignment.
        unsafe { std::slice::from_raw_parts(self.ptr.wrapping_offset(off), len) }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Same data with dims reordered (out dim i = dim perm[i]).
    pub fn permuted(&self, perm: &[usize]) -> View<T> {
        View {
            ptr: self.ptr,
            shape: perm.iter().map(|&p| self.shape[p]).collect(),
            strides: perm.iter().map(|&p| self.strides[p]).collect(),
            _keep: self._keep.clone(),
        }
    }

    /// The sub-view with the leading dims fixed at offset `off` (from `batch_offsets`).
    pub fn inner(&self, lead: usize, off: isize) -> View<T> {
        View {
            ptr: self.ptr.wrapping_offset(off),
            shape: self.shape[lead..].to_vec(),
            strides: self.strides[lead..].to_vec(),
            _keep: self._keep.clone(),
        }
    }
}
