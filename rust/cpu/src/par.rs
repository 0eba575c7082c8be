//! Parallel loops over numbered chunks of work.
//!
//! A call whose kernels are all Ember's own runs on the caller's thread, and each parallel
//! loop *offers* its chunks to [`Helpers`]: the caller claims chunks from a shared counter
//! itself, helpers claim what is left when they arrive, and the caller waits only for chunks
//! a helper has actually started. A helper that arrives late (a busy machine) finds nothing
//! left and leaves, so it never delays the call — unlike `ThreadPool::install` plus a rayon
//! split, which costs two thread hand-offs per call and waits for every worker (measured:
//! ≈ 15–20 µs of a 30 µs `x * 2` on [64, 512]).
//!
//! Helpers wait for the next loop by spinning for a while ([`spin_window`]) before they
//! sleep, as ONNX Runtime's and OpenMP's workers do: a program's steps are often 10–50 µs,
//! and waking a sleeping thread costs about that much again (a one-token decode step ran
//! its matrix-vector products slower on two threads than on one). Calls whose products the
//! `gemm` crate computes run inside a rayon pool instead, where these loops fall back to
//! rayon's own work splitting.

use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

use rayon::prelude::*;

thread_local! {
    /// The helpers (and the thread count) that loops on this thread may use.
    static HELPERS: RefCell<Option<(Arc<Helpers>, usize)>> = const { RefCell::new(None) };
}

/// Threads that take chunks of the loops offered to them.
pub struct Helpers {
    shared: Arc<Shared>,
    threads: Vec<Thread>,
}

struct Shared {
    /// The loop offered last (helpers take it when `epoch` moves).
    job: Mutex<Option<Arc<Job>>>,
    epoch: AtomicU64,
    /// Per helper: asleep (or about to be), so an offer must wake it.
    asleep: Vec<AtomicBool>,
}

/// How long an idle helper spins for the next loop before it sleeps: `EMBER_CPU_SPIN_US`
/// microseconds (read once; 0 sleeps at once, for machines shared with other work), else
/// 1 ms — longer than the gaps between a program's steps and between back-to-back calls.
pub fn spin_window() -> Duration {
    static WINDOW: OnceLock<Duration> = OnceLock::new();
    *WINDOW.get_or_init(|| {
        let us = std::env::var("EMBER_CPU_SPIN_US")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(1000);
        Duration::from_micros(us)
    })
}

impl Helpers {
    /// The process's helpers for calls on `threads` threads (`threads - 1` helper threads,
    /// started on first use and shared by every program of that thread count). An OS that
    /// refuses threads leaves fewer helpers; loops then run on fewer threads.
    pub fn for_threads(threads: usize) -> Arc<Helpers> {
        type ByThreads = Vec<(usize, Arc<Helpers>)>;
        static ALL: OnceLock<Mutex<ByThreads>> = OnceLock::new();
        let mut all = ALL
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some((_, h)) = all.iter().find(|(t, _)| *t == threads) {
            return h.clone();
        }
        let n = threads.saturating_sub(1);
        let shared = Arc::new(Shared {
            job: Mutex::new(None),
            epoch: AtomicU64::new(0),
            asleep: (0..n).map(|_| AtomicBool::new(false)).collect(),
        });
        let mut started = Vec::new();
        for k in 0..n {
            let s = shared.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("ember-helper-{k}"))
                .spawn(move || helper_loop(&s, k));
            match spawned {
                Ok(handle) => started.push(handle.thread().clone()),
                Err(_) => break,
            }
        }
        let h = Arc::new(Helpers {
            shared,
            threads: started,
        });
        all.push((threads, h.clone()));
        h
    }

    /// Hands `job` to every helper, waking those asleep.
    fn offer(&self, job: &Arc<Job>) {
        *self.shared.job.lock().unwrap_or_else(|p| p.into_inner()) = Some(job.clone());
        self.shared.epoch.fetch_add(1, Ordering::SeqCst);
        for (k, t) in self.threads.iter().enumerate() {
            if self.shared.asleep[k].load(Ordering::SeqCst) {
                t.unpark();
            }
        }
    }
}

fn helper_loop(shared: &Shared, k: usize) {
    let mut seen = shared.epoch.load(Ordering::SeqCst);
    loop {
        // Spin until a new loop is offered or the window passes, then sleep until woken.
        let mut idle_since = Instant::now();
        let mut spins = 0u32;
        loop {
            let epoch = shared.epoch.load(Ordering::SeqCst);
            if epoch != seen {
                seen = epoch;
                break;
            }
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256) && idle_since.elapsed() >= spin_window() {
                // `asleep` is set before the epoch is read again: an offer either sees it
                // and unparks (a parked token is kept), or came before the read and is seen.
                shared.asleep[k].store(true, Ordering::SeqCst);
                if shared.epoch.load(Ordering::SeqCst) == seen {
                    std::thread::park();
                }
                shared.asleep[k].store(false, Ordering::SeqCst);
                idle_since = Instant::now();
            }
        }
        let job = shared.job.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(job) = job {
            job.work();
        }
    }
}

/// Runs `f` on this thread with `helpers` available to its parallel loops.
pub fn with_helpers<R>(helpers: &Arc<Helpers>, threads: usize, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<(Arc<Helpers>, usize)>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let prev = self.0.take();
            HELPERS.with(|h| *h.borrow_mut() = prev);
        }
    }
    let threads = threads.min(helpers.threads.len() + 1);
    let prev = HELPERS.with(|h| h.borrow_mut().replace((helpers.clone(), threads)));
    let _restore = Restore(prev);
    f()
}

/// Threads a parallel loop started here can use.
pub fn threads() -> usize {
    if rayon::current_thread_index().is_some() {
        return rayon::current_num_threads();
    }
    HELPERS.with(|h| h.borrow().as_ref().map_or(1, |(_, t)| *t))
}

/// Calls `body(i)` for every `i < n`, in parallel where threads are available.
pub fn for_each(n: usize, body: impl Fn(usize) + Sync) {
    if n <= 1 {
        if n == 1 {
            body(0);
        }
        return;
    }
    if rayon::current_thread_index().is_some() {
        let body = &body;
        (0..n).into_par_iter().for_each(body);
        return;
    }
    let helpers = HELPERS.with(|h| h.borrow().clone());
    match helpers {
        Some((helpers, threads)) if threads > 1 => offer(&helpers, n, &body),
        _ => (0..n).for_each(body),
    }
}

/// As `for_each`, stopping at (and returning) the first error.
pub fn try_for_each<E: Send>(
    n: usize,
    body: impl Fn(usize) -> Result<(), E> + Sync,
) -> Result<(), E> {
    let err: Mutex<Option<E>> = Mutex::new(None);
    let failed = AtomicBool::new(false);
    for_each(n, |i| {
        if failed.load(Ordering::Relaxed) {
            return;
        }
        if let Err(e) = body(i) {
            failed.store(true, Ordering::Relaxed);
            err.lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert(e);
        }
    });
    match err.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// `out` split into chunks of `chunk` elements (the last may be shorter); calls
/// `body(start, chunk_slice)` for each, in parallel where threads are available.
pub fn for_chunks_mut<T: Send>(out: &mut [T], chunk: usize, body: impl Fn(usize, &mut [T]) + Sync) {
    let n = out.len();
    let chunk = chunk.max(1);
    let base = SendPtr(out.as_mut_ptr());
    for_each(n.div_ceil(chunk), |i| {
        let start = i * chunk;
        let len = chunk.min(n - start);
        let base = &base; // the Sync wrapper, not its raw field
                          // SAFETY: chunk i covers start..start + len inside `out`, disjoint from every other
                          // chunk, and `out` is borrowed mutably for the whole loop.
        let part = unsafe { std::slice::from_raw_parts_mut(base.0.add(start), len) };
        body(start, part);
    });
}

/// Calls `body(i, &mut out[parts[i]])` for every part, in parallel where threads are
/// available. The parts must be in order and must not overlap (checked).
pub fn for_parts_mut<T: Send>(
    out: &mut [T],
    parts: &[std::ops::Range<usize>],
    body: impl Fn(usize, &mut [T]) + Sync,
) {
    let mut end = 0;
    for part in parts {
        assert!(
            end <= part.start && part.start <= part.end && part.end <= out.len(),
            "parts must be ordered, disjoint and inside the slice"
        );
        end = part.end;
    }
    let base = SendPtr(out.as_mut_ptr());
    for_each(parts.len(), |i| {
        let base = &base; // the Sync wrapper, not its raw field
        let part = &parts[i];
        // SAFETY: the parts are disjoint ranges inside `out` (checked above), and `out` is
        // borrowed mutably for the whole loop.
        let slice = unsafe { std::slice::from_raw_parts_mut(base.0.add(part.start), part.len()) };
        body(i, slice);
    });
}

/// A pointer into one exclusively borrowed buffer, shared with the tasks of a loop so that
/// each writes its own disjoint part (which the user of every `SendPtr` must ensure).
pub struct SendPtr<T>(pub *mut T);
// SAFETY: tasks only write disjoint parts of the buffer, which outlives the loop.
unsafe impl<T> Sync for SendPtr<T> {}
unsafe impl<T> Send for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// The pointer (a method, so closures capture the whole `Sync` struct, not the field).
    pub fn get(&self) -> *mut T {
        self.0
    }
}

/// The chunks of one loop, claimed one at a time by the caller and by helpers.
struct Job {
    next: AtomicUsize,
    done: AtomicUsize,
    n: usize,
    panicked: AtomicBool,
    /// Valid while some chunk index below `n` is unfinished: the caller does not return before
    /// `done == n`, and a helper calls it only after claiming such an index.
    body: *const (dyn Fn(usize) + Sync),
}

// SAFETY: `body` is `Sync` and only called under the claim protocol above.
unsafe impl Send for Job {}
unsafe impl Sync for Job {}

impl Job {
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.n {
                return;
            }
            // SAFETY: index i < n is claimed and not yet done, so the caller is still waiting
            // and `body` is alive.
            let body = unsafe { &*self.body };
            if catch_unwind(AssertUnwindSafe(|| body(i))).is_err() {
                self.panicked.store(true, Ordering::Relaxed);
            }
            self.done.fetch_add(1, Ordering::Release);
        }
    }
}

fn offer(helpers: &Helpers, n: usize, body: &(dyn Fn(usize) + Sync)) {
    // SAFETY (lifetime erasure): see `Job::body`; this function returns only after every
    // chunk is done, and helpers touch `body` only for claimed chunks.
    let body: &'static (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(body) };
    let job = Arc::new(Job {
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        n,
        panicked: AtomicBool::new(false),
        body,
    });
    helpers.offer(&job);
    job.work();
    let mut spins = 0u32;
    while job.done.load(Ordering::Acquire) < n {
        if spins < 1 << 12 {
            std::hint::spin_loop();
            spins += 1;
        } else {
            std::thread::yield_now();
        }
    }
    if job.panicked.load(Ordering::Relaxed) {
        panic!("a parallel CPU kernel panicked on a helper thread");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    fn pool(threads: usize) -> Arc<rayon::ThreadPool> {
        Arc::new(
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap(),
        )
    }

    #[test]
    fn every_chunk_runs_exactly_once_on_the_caller_and_in_the_pool() {
        let p = pool(3);
        for n in [0, 1, 2, 7, 64, 1000] {
            let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
            let count = |i: usize| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            };
            with_helpers(&Helpers::for_threads(3), 3, || for_each(n, count));
            p.install(|| for_each(n, count));
            for_each(n, count); // no helpers: sequential
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 3),
                "n = {n}"
            );
        }
    }

    #[test]
    fn chunks_of_a_slice_are_disjoint_and_cover_it() {
        let mut v = vec![0usize; 1003];
        with_helpers(&Helpers::for_threads(2), 2, || {
            for_chunks_mut(&mut v, 100, |start, part| {
                for (k, x) in part.iter_mut().enumerate() {
                    *x += start + k;
                }
            })
        });
        assert!(v.iter().enumerate().all(|(i, &x)| x == i));
    }

    #[test]
    fn callers_on_several_threads_share_the_helpers() {
        // Offers from different callers overwrite each other's job slot: a caller whose
        // job was replaced runs its chunks itself, so every chunk still runs exactly once.
        let helpers = Helpers::for_threads(2);
        std::thread::scope(|scope| {
            for caller in 0..3 {
                let helpers = helpers.clone();
                scope.spawn(move || {
                    for round in 0..200 {
                        let n = 1 + (caller * 7 + round) % 40;
                        let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
                        with_helpers(&helpers, 2, || {
                            for_each(n, |i| {
                                hits[i].fetch_add(1, Ordering::Relaxed);
                            })
                        });
                        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
                    }
                });
            }
        });
    }

    #[test]
    fn idle_helpers_sleep_and_wake_for_the_next_loop() {
        let helpers = Helpers::for_threads(4);
        let count = AtomicU32::new(0);
        with_helpers(&helpers, 4, || {
            for_each(64, |_| {
                count.fetch_add(1, Ordering::Relaxed);
            })
        });
        // Past the spin window every helper parks (it would otherwise burn a core).
        let deadline = std::time::Instant::now() + spin_window() + Duration::from_secs(5);
        while helpers
            .shared
            .asleep
            .iter()
            .any(|a| !a.load(Ordering::SeqCst))
        {
            assert!(
                std::time::Instant::now() < deadline,
                "helpers still spinning"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        // Sleeping helpers are woken by the next offer; slow chunks give them time to join.
        let on_helpers = AtomicU32::new(0);
        let caller = std::thread::current().id();
        with_helpers(&helpers, 4, || {
            for_each(32, |_| {
                if std::thread::current().id() != caller {
                    on_helpers.fetch_add(1, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(2));
            })
        });
        assert!(on_helpers.load(Ordering::Relaxed) > 0, "no helper woke up");
    }

    #[test]
    fn errors_and_panics_reach_the_caller() {
        let p = Helpers::for_threads(2);
        let r = with_helpers(&p, 2, || {
            try_for_each(50, |i| if i == 33 { Err(i) } else { Ok(()) })
        });
        assert_eq!(r, Err(33));
        let caught = std::panic::catch_unwind(AssertUnwindSafe(|| {
            with_helpers(&p, 2, || {
                for_each(50, |i| {
                    if i % 2 == 1 {
                        std::thread::sleep(std::time::Duration::from_micros(50));
                    }
                    assert!(i != 41, "chunk 41");
                })
            })
        }));
        assert!(caught.is_err());
        // The helpers are restored after the panic.
        assert_eq!(threads(), 1);
    }
}
