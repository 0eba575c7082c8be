//! Buffer reuse: buffers freed after their last use go to a free list keyed by size, and the
//! kernels that overwrite every element of their output (fused elementwise, `dot`, conv,
//! concat, softmax and the norms) take their output from it instead of allocating. An arena
//! serves one call at a time (concurrent calls take different arenas) and is kept for the
//! next call, so a model called repeatedly stops allocating, zeroing and page-faulting its
//! intermediates; `end_call` drops buffers the last call did not use, so changing shapes do
//! not pile up memory.

use std::collections::BTreeMap;
use std::sync::Arc;

use ember_core::dtype::DType;

use crate::buffer::{is_aligned, Layout, Storage, Val};
use crate::compile::Plan;
use crate::error::{CpuError, KResult};

#[derive(Default)]
pub struct Arena {
    /// Free buffers by length in 8-byte words, each with the call that last gave it back.
    free: BTreeMap<usize, Vec<(Vec<u64>, u64)>>,
    /// Calls served so far.
    call: u64,
    /// The last call's table of node values and its plan: the plan's fixed values stay in
    /// it, so the next call of that plan starts without cloning them.
    values: Option<(Arc<Plan>, Vec<Option<Val>>)>,
}

impl Arena {
    /// A call's table of node values, holding `plan`'s fixed values (`Plan::fixed`) and
    /// nothing else.
    pub fn values_for(&mut self, plan: &Arc<Plan>) -> Vec<Option<Val>> {
        match self.values.take() {
            Some((kept, vals)) if Arc::ptr_eq(&kept, plan) => vals,
            _ => plan.fixed.clone(),
        }
    }

    /// Keeps a finished call's table for the next call of `plan`, less every value that
    /// is not fixed.
    pub fn keep_values(&mut self, plan: &Arc<Plan>, mut vals: Vec<Option<Val>>) {
        for (v, fixed) in vals.iter_mut().zip(&plan.fixed) {
            if fixed.is_none() {
                *v = None;
            }
        }
        self.values = Some((plan.clone(), vals));
    }

    /// A buffer of at least `bytes` bytes, reused when one of up to twice the size is free.
    /// Its contents are arbitrary (every bit pattern is a valid element).
    fn take(&mut self, bytes: usize) -> Vec<u64> {
        let words = bytes.div_ceil(8);
        if words == 0 {
            return Vec::new();
        }
        let hit = self
            .free
            .range_mut(words..=words * 2)
            .next()
            .map(|(&k, list)| {
                let v = list.pop();
                (k, v, list.is_empty())
            });
        if let Some((k, Some((v, _)), empty)) = hit {
            if empty {
                self.free.remove(&k);
            }
            return v;
        }
        vec![0u64; words]
    }

    /// Takes back a value's buffer when nothing else refers to it.
    pub fn give(&mut self, val: Val) {
        if let Ok(Storage::Owned { data, .. }) = Arc::try_unwrap(val.storage) {
            if !data.is_empty() {
                self.free
                    .entry(data.len())
                    .or_default()
                    .push((data, self.call));
            }
        }
    }

    /// Ends a call: frees the buffers this call did not give back (left from calls with
    /// other shapes), keeping the ones the next call of the same shapes will take again.
    pub fn end_call(&mut self) {
        let call = self.call;
        self.free.retain(|_, list| {
            list.retain(|(_, c)| *c == call);
            !list.is_empty()
        });
        self.call += 1;
    }

    /// Somewhere to write a contiguous result of `dtype` and `shape`: the caller's output
    /// buffer when one is given (and aligned), else a buffer from the free list.
    pub fn dest(&mut self, dtype: DType, shape: &[usize], caller: Option<*mut u8>) -> Dest {
        let bytes = shape.iter().product::<usize>() * dtype.size();
        let buf = match caller {
            Some(p) if bytes > 0 && is_aligned(p, dtype.size()) => Buf::Caller(p),
            _ => Buf::Owned(self.take(bytes)),
        };
        Dest {
            buf,
            bytes,
            dtype,
            shape: shape.to_vec(),
        }
    }
}

enum Buf {
    Owned(Vec<u64>),
    /// A caller's output buffer (valid for writes, aliasing no input: `run`'s contract).
    Caller(*mut u8),
}

/// A contiguous result being written.
pub struct Dest {
    buf: Buf,
    bytes: usize,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl Dest {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The first byte (aligned for the dtype; dangling but aligned when empty).
    pub fn ptr(&mut self) -> *mut u8 {
        match &mut self.buf {
            Buf::Owned(v) => v.as_mut_ptr() as *mut u8,
            Buf::Caller(p) => *p,
        }
    }

    /// The elements as a typed slice (`T` must have the dtype's size).
    pub fn slice<T: Copy>(&mut self) -> KResult<&mut [T]> {
        if std::mem::size_of::<T>() != self.dtype.size() {
            return Err(CpuError::Internal("destination element size".into()));
        }
        let n = self.numel();
        if n == 0 {
            return Ok(&mut []);
        }
        // SAFETY: the buffer holds `bytes` = n·size bytes, aligned for T (owned buffers are
        // 8-byte aligned, caller buffers were checked), and we hold it exclusively.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr() as *mut T, n) })
    }

    /// A read-only value seeing what has been written so far (for in-place epilogues). It
    /// must be dropped before the buffer is written again through `slice`/`ptr`.
    pub fn peek(&mut self) -> KResult<Val> {
        let storage = Storage::External {
            ptr: self.ptr(),
            bytes: self.bytes,
        };
        Val::new(
            self.dtype,
            Arc::new(storage),
            Layout::contiguous(&self.shape),
        )
    }

    pub fn finish(self) -> KResult<Val> {
        let storage = match self.buf {
            Buf::Owned(data) => Storage::Owned {
                data,
                bytes: self.bytes,
            },
            Buf::Caller(ptr) => Storage::External {
                ptr,
                bytes: self.bytes,
            },
        };
        Val::new(
            self.dtype,
            Arc::new(storage),
            Layout::contiguous(&self.shape),
        )
    }
}
