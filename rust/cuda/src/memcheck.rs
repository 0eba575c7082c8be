//! A memory checker for runs on the emulator: what `compute-sanitizer` would tell on a GPU,
//! found on machines without one.
//!
//! Before a run the executor describes its memory to the device (`Watch`): where each
//! value of the arena lives, from which step to which (its first write to its last read),
//! which steps may write it, and the memory outside the arena that the run must leave
//! alone (weights, inputs) or that only some steps write (the caller's outputs). The
//! emulator then, around every item of work (`Checker`):
//!
//! * keeps every arena byte outside a live value *poisoned* (`POISON`: a NaN in every
//!   float type, -1 in every integer), so a kernel that reads a value before it is
//!   written, after it is dead, or past its end reads NaN, and the test comparing with
//!   eager fails;
//! * after the item, finds any poisoned byte that changed (a write out of bounds, or into
//!   a value the planner thinks dead) and any live value, weight or input that changed
//!   although the item does not write it (a write into a neighbour's memory), and fails
//!   the run naming the kernel, the step and the memory it hit.
//!
//! Guard bytes after every buffer the emulator allocates catch writes past its end
//! (`guard_tail`). Nothing here runs on a GPU: the CUDA device does not ask for a watch.

use std::collections::HashMap;

use ember_core::dim::SymbolBindings;
use ember_core::{Error, Result};

use crate::codegen::{Dest, KernelProgram, StepKind};
use crate::layout::{self, Layout};

/// The byte unwritten arena memory holds: `0xff…` is a NaN in f16, bf16, f32 and f64.
pub const POISON: u8 = 0xff;
/// The byte the guard after each emulated buffer holds.
pub const GUARD: u8 = 0xa5;
/// Guard bytes after each emulated buffer.
pub const GUARD_BYTES: usize = 64;

/// A span of device memory a run uses, named for error messages.
#[derive(Clone, Debug)]
pub struct Region {
    pub start: u64,
    pub bytes: usize,
    /// What lives there ("node 'linear_1' (dot)", "scratch of step 4", "input 0").
    pub what: String,
    /// Steps (in program order) during which the region holds a value: the arena's
    /// regions are poisoned outside them. Regions outside the arena live the whole run.
    pub first: usize,
    pub last: usize,
    /// Steps that may write the region; any other step must leave it unchanged.
    pub writers: Vec<usize>,
}

/// A run's memory, as the executor planned it: handed to the device before the run.
#[derive(Clone, Debug)]
pub struct Watch {
    /// The arena: `(address, bytes)`.
    pub arena: (u64, usize),
    /// Values, scratch and partial results inside the arena.
    pub arena_regions: Vec<Region>,
    /// Weights, inputs and outputs (outside the arena).
    pub outside: Vec<Region>,
    /// The step each item of the run's work comes from, in order.
    pub item_steps: Vec<usize>,
    /// Each step's name for error messages ("kernel k3 for node 'softmax_1'").
    pub step_names: Vec<String>,
}

fn node_label(kp: &KernelProgram, n: usize) -> String {
    let node = &kp.graph.nodes[n];
    format!("node '{}' ({})", node.origin, node.op.name())
}

/// The nodes step `s` reads.
fn step_reads(kp: &KernelProgram, s: usize) -> Vec<usize> {
    match &kp.steps[s].kind {
        StepKind::Kernel { args, .. } => args.clone(),
        StepKind::Gemm(g) => g.reads(),
    }
}

/// The places step `s` writes.
fn step_writes(kp: &KernelProgram, s: usize) -> Vec<Dest> {
    let step = &kp.steps[s];
    std::iter::once(step.dest)
        .chain(step.also.iter().map(|&(_, d)| d))
        .collect()
}

/// Everything a run touches, as `Watch::new` needs it.
pub struct RunMemory<'a> {
    pub kp: &'a KernelProgram,
    pub layout: &'a Layout,
    pub env: &'a SymbolBindings,
    /// Arena address and bytes.
    pub arena: (u64, usize),
    /// The address of each input and each output, and of each uploaded weight by node.
    pub inputs: &'a [u64],
    pub outputs: &'a [u64],
    pub weights: Vec<(usize, u64)>,
    pub item_steps: Vec<usize>,
}

impl Watch {
    /// The watch of one run. The lifetimes are worked out here from the steps' reads and
    /// writes, apart from the layout planner, so that a planner that overlaps two live
    /// values is caught too.
    pub fn new(m: RunMemory<'_>) -> Result<Watch> {
        let kp = m.kp;
        let steps = kp.steps.len();
        let mut first_write: HashMap<usize, usize> = HashMap::new();
        let mut writers: HashMap<usize, Vec<usize>> = HashMap::new();
        let mut output_writers: HashMap<usize, Vec<usize>> = HashMap::new();
        let mut last_read: HashMap<usize, usize> = HashMap::new();
        for s in 0..steps {
            for d in step_writes(kp, s) {
                match d {
                    Dest::Node(n) => {
                        first_write.entry(n).or_insert(s);
                        writers.entry(n).or_default().push(s);
                    }
                    Dest::Output(k) => output_writers.entry(k).or_default().push(s),
                }
            }
            for r in step_reads(kp, s) {
                last_read.insert(r, s);
            }
        }

        let mut arena_regions = Vec::new();
        for (&n, &offset) in &m.layout.offsets {
            let first = first_write.get(&n).copied().unwrap_or(0);
            arena_regions.push(Region {
                start: m.arena.0 + offset as u64,
                bytes: layout::node_bytes(kp, n, m.env),
                what: node_label(kp, n),
                first,
                last: last_read.get(&n).copied().unwrap_or(first).max(first),
                writers: writers.get(&n).cloned().unwrap_or_default(),
            });
        }
        for (&s, &(offset, _)) in &m.layout.scratch {
            let blocks = m.layout.geometry[s].map_or(0, |g| g.blocks);
            arena_regions.push(Region {
                start: m.arena.0 + offset as u64,
                bytes: layout::scratch_bytes(kp, s, blocks, m.env)?,
                what: format!("the scratch of step {s}"),
                first: s,
                last: s,
                writers: vec![s],
            });
        }
        for (&s, &(offset, _)) in &m.layout.partials {
            arena_regions.push(Region {
                start: m.arena.0 + offset as u64,
                bytes: layout::partial_bytes(kp, s, m.env)?,
                what: format!("the partial results of step {s}"),
                first: s,
                last: s,
                writers: vec![s],
            });
        }
        arena_regions.sort_by_key(|r| (r.start, r.first));

        let whole_run = |start: u64, bytes: usize, what: String, writers: Vec<usize>| Region {
            start,
            bytes,
            what,
            first: 0,
            last: steps,
            writers,
        };
        let bytes = |n: usize| layout::node_bytes(kp, n, m.env);
        let mut outside = Vec::new();
        for (k, (&a, &n)) in m.inputs.iter().zip(&kp.graph.inputs).enumerate() {
            // An input given as an output's memory (updated in place) is written by the
            // steps writing that output.
            let writers = (m.outputs.iter().enumerate())
                .filter(|&(_, &o)| o == a)
                .flat_map(|(o, _)| output_writers.get(&o).cloned().unwrap_or_default())
                .collect();
            outside.push(whole_run(a, bytes(n), format!("input {k}"), writers));
        }
        for (k, (&a, &n)) in m.outputs.iter().zip(&kp.graph.outputs).enumerate() {
            let w = output_writers.get(&k).cloned().unwrap_or_default();
            outside.push(whole_run(a, bytes(n), format!("output {k}"), w));
        }
        for &(n, a) in &m.weights {
            let what = format!("the weight of {}", node_label(kp, n));
            outside.push(whole_run(a, bytes(n), what, vec![]));
        }

        let step_names = (0..steps)
            .map(|s| {
                let step = &kp.steps[s];
                let what = match &step.kind {
                    StepKind::Kernel { kernel, .. } => {
                        format!("kernel {}", kp.kernels[*kernel].name)
                    }
                    StepKind::Gemm(_) => "the library product".to_string(),
                };
                format!("step {s} ({what} for {})", node_label(kp, step.node))
            })
            .collect();
        Ok(Watch {
            arena: m.arena,
            arena_regions,
            outside,
            item_steps: m.item_steps,
            step_names,
        })
    }
}

/// A 64-bit hash of a span of memory (changes are what matters, not strength).
fn hash(start: u64, bytes: usize) -> u64 {
    // SAFETY (callers): `start` addresses `bytes` readable bytes of an emulated buffer.
    let data = unsafe { std::slice::from_raw_parts(start as *const u8, bytes) };
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ bytes as u64;
    let mut words = data.chunks_exact(8);
    for w in &mut words {
        let v = u64::from_le_bytes(w.try_into().unwrap_or([0; 8]));
        h = (h ^ v).wrapping_mul(0x0100_0000_01b3).rotate_left(29);
    }
    for &b in words.remainder() {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn fill(start: u64, bytes: usize, byte: u8) {
    // SAFETY (callers): `start` addresses `bytes` writable bytes of an emulated buffer.
    unsafe { std::ptr::write_bytes(start as *mut u8, byte, bytes) };
}

/// The first offset in `[start, start + bytes)` not holding `byte`.
fn first_not(start: u64, bytes: usize, byte: u8) -> Option<usize> {
    // SAFETY (callers): `start` addresses `bytes` readable bytes of an emulated buffer.
    let data = unsafe { std::slice::from_raw_parts(start as *const u8, bytes) };
    data.iter().position(|&b| b != byte)
}

/// The guard after a buffer of `bytes` at `start` (`GUARD_BYTES` long): writes it, or
/// tells where it was overwritten.
pub fn guard_tail(start: u64, bytes: usize, write: bool) -> Option<usize> {
    let tail = start + bytes as u64;
    if write {
        fill(tail, GUARD_BYTES, GUARD);
        return None;
    }
    first_not(tail, GUARD_BYTES, GUARD)
}

/// The check of one run, item by item (held by the emulator).
pub struct Checker {
    watch: Watch,
    /// Items run so far.
    item: usize,
    /// Arena regions still holding a value (not yet re-poisoned after their last read).
    alive: Vec<bool>,
    /// Each region's hash after the last item that could write it.
    arena_hashes: Vec<Option<u64>>,
    outside_hashes: Vec<u64>,
}

impl Checker {
    /// Starts a run: the arena poisoned everywhere, the memory outside it hashed.
    pub fn new(watch: Watch) -> Checker {
        fill(watch.arena.0, watch.arena.1, POISON);
        let outside_hashes = watch
            .outside
            .iter()
            .map(|r| hash(r.start, r.bytes))
            .collect();
        Checker {
            alive: vec![true; watch.arena_regions.len()],
            arena_hashes: vec![None; watch.arena_regions.len()],
            outside_hashes,
            item: 0,
            watch,
        }
    }

    /// The step of the next item (`None` once every item ran: then nothing is checked).
    fn step(&self) -> Option<usize> {
        self.watch.item_steps.get(self.item).copied()
    }

    /// Before an item: values dead by its step are poisoned again.
    pub fn before_item(&mut self) {
        let Some(s) = self.step() else { return };
        for (r, alive) in self.watch.arena_regions.iter().zip(&mut self.alive) {
            if *alive && r.last < s {
                fill(r.start, r.bytes, POISON);
                *alive = false;
            }
        }
    }

    /// After an item: fails naming the item's step if it wrote where it may not.
    pub fn after_item(&mut self) -> Result<()> {
        let Some(s) = self.step() else { return Ok(()) };
        self.item += 1;
        let w = &self.watch;
        let fail = |what: String| {
            Error::Runtime(format!(
                "emulator memory check: {} {what}",
                w.step_names
                    .get(s)
                    .map_or("an unknown step", String::as_str)
            ))
        };
        // Live regions: unchanged unless this step writes them.
        let mut live: Vec<(u64, u64)> = Vec::new();
        for (i, r) in w.arena_regions.iter().enumerate() {
            if r.first > s || r.last < s {
                continue;
            }
            live.push((r.start, r.start + r.bytes as u64));
            let h = hash(r.start, r.bytes);
            if r.writers.contains(&s) {
                self.arena_hashes[i] = Some(h);
            } else if let Some(before) = self.arena_hashes[i] {
                if before != h {
                    return Err(fail(format!("changed {}, which it does not write", r.what)));
                }
            } else {
                self.arena_hashes[i] = Some(h);
            }
        }
        // Everything else in the arena: still poisoned.
        live.sort_unstable();
        let (base, end) = (w.arena.0, w.arena.0 + w.arena.1 as u64);
        let mut at = base;
        for &(lo, hi) in live.iter().chain(std::iter::once(&(end, end))) {
            if lo > at {
                if let Some(k) = first_not(at, (lo - at) as usize, POISON) {
                    let off = at + k as u64;
                    return Err(fail(format!(
                        "wrote arena byte {} outside every live value ({})",
                        off - base,
                        self.neighbours(off)
                    )));
                }
            }
            at = at.max(hi);
        }
        for (r, &before) in w.outside.iter().zip(&self.outside_hashes) {
            if !r.writers.contains(&s) && hash(r.start, r.bytes) != before {
                return Err(fail(format!("changed {}, which it does not write", r.what)));
            }
        }
        for (i, r) in w.outside.iter().enumerate() {
            if r.writers.contains(&s) {
                self.outside_hashes[i] = hash(r.start, r.bytes);
            }
        }
        Ok(())
    }

    /// The arena values nearest below and above address `at`, for error messages.
    fn neighbours(&self, at: u64) -> String {
        let w = &self.watch;
        let below = w
            .arena_regions
            .iter()
            .filter(|r| r.start <= at)
            .max_by_key(|r| r.start + r.bytes as u64);
        let above = w
            .arena_regions
            .iter()
            .filter(|r| r.start > at)
            .min_by_key(|r| r.start);
        let show = |r: Option<&Region>| {
            r.map_or("nothing".to_string(), |r| {
                format!(
                    "{} at byte {} ({} bytes, live in steps {}..={})",
                    r.what,
                    r.start - w.arena.0,
                    r.bytes,
                    r.first,
                    r.last
                )
            })
        };
        format!("below: {}; above: {}", show(below), show(above))
    }
}
