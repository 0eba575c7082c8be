//! Per-thread scratch memory reused across calls, for kernels whose temporaries would
//! otherwise be a fresh allocation per call or task (a zeroed allocation per fused group
//! and call was ~5 % of a decode step; attention's score rows of a long sequence are large
//! enough that each fresh one is mapped and page-faulted in).

use std::cell::RefCell;

thread_local! {
    static SCRATCH: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with at least `words` words of this thread's scratch (arbitrary contents, 8-byte
/// aligned). A call made while `f` runs on the same thread gets a buffer of its own.
pub fn with_scratch<R>(words: usize, f: impl FnOnce(*mut u64) -> R) -> R {
    SCRATCH.with(|cell| {
        let mut fresh = Vec::new();
        let mut held = cell.try_borrow_mut();
        let buf = match held.as_mut() {
            Ok(b) => &mut **b,
            Err(_) => &mut fresh,
        };
        if buf.len() < words {
            buf.resize(words, 0);
        }
        f(buf.as_mut_ptr())
    })
}
