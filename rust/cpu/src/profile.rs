//! Opt-in per-step timing of CPU programs: where a model's time goes, by op and shape.
//!
//! Off by default (one relaxed atomic load per step). While on, every step `execute` runs
//! (a fused group, a `dot`, a view, ...) adds its wall time to a process-wide table keyed by
//! its label and output shape; `take` hands the table over and clears it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;

static ON: AtomicBool = AtomicBool::new(false);
/// Totals by (label, output shape).
type Table = HashMap<(String, Vec<usize>), Tally>;

static TOTALS: Mutex<Option<Table>> = Mutex::new(None);

#[derive(Clone, Copy, Default)]
struct Tally {
    seconds: f64,
    calls: u64,
}

/// One row of the table: label, output shape, total seconds, steps timed.
pub type Row = (String, Vec<usize>, f64, u64);

pub fn set_enabled(on: bool) {
    ON.store(on, Ordering::Relaxed);
}

/// The start of a step, when profiling is on.
pub(crate) fn start() -> Option<Instant> {
    ON.load(Ordering::Relaxed).then(Instant::now)
}

/// Adds the step begun at `started` (if profiling was on then).
pub(crate) fn record(started: Option<Instant>, label: impl FnOnce() -> String, shape: &[usize]) {
    let Some(t0) = started else { return };
    let seconds = t0.elapsed().as_secs_f64();
    // A poisoned lock only means another thread panicked mid-update; the sums stay usable.
    let mut totals = TOTALS.lock().unwrap_or_else(|e| e.into_inner());
    let tally = totals
        .get_or_insert_with(HashMap::new)
        .entry((label(), shape.to_vec()))
        .or_default();
    tally.seconds += seconds;
    tally.calls += 1;
}

/// The table so far, slowest first, and a fresh one started.
pub fn take() -> Vec<Row> {
    let mut totals = TOTALS.lock().unwrap_or_else(|e| e.into_inner());
    let mut rows: Vec<Row> = totals
        .take()
        .unwrap_or_default()
        .into_iter()
        .map(|((label, shape), t)| (label, shape, t.seconds, t.calls))
        .collect();
    rows.sort_by(|a, b| b.2.total_cmp(&a.2).then_with(|| a.0.cmp(&b.0)));
    rows
}
