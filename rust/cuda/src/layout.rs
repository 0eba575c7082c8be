//! Where a run's values live and how its kernels are launched: arena offsets planned from
//! liveness, per-block scratch, and launch geometry, sized for one or more dim bindings.
//!
//! A layout sized for several bindings serves every one of them unchanged, which is what
//! lets a recorded CUDA graph (whose addresses and launch sizes are fixed) replay when the
//! dims change: the kernels read the dims from `meta`, loop grid-stride, and so compute the
//! right result on any grid; the arena slots only have to be large enough.

use std::collections::HashMap;

use ember_core::dim::SymbolBindings;
use ember_core::dtype::DType;
use ember_core::Result;

use crate::codegen::{Dest, KernelProgram, Launch, StepKind};

/// Arena allocations are aligned for every dtype and for vectorized access.
pub const ALIGN: usize = 256;
/// Most blocks of a kernel with per-block scratch (attention keeps a row of scores each).
const MAX_SCRATCH_BLOCKS: u32 = 1024;

/// Blocks in the grid and threads in each block (1-D launches).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub blocks: u32,
    pub threads: u32,
}

/// A device's launch limits: (threads per block, most blocks) for plain and cooperative
/// kernels.
pub type Limits<'a> = dyn Fn(bool) -> (u32, u32) + 'a;

pub struct Layout {
    /// Arena offset of each node written to the arena.
    pub offsets: HashMap<usize, usize>,
    /// Bytes reserved at each of those offsets.
    pub slots: HashMap<usize, usize>,
    /// (offset, bytes) of the scratch of each step that needs some.
    pub scratch: HashMap<usize, (usize, usize)>,
    /// (offset, bytes) of the partial results a step writes for the next (both steps).
    pub partials: HashMap<usize, (usize, usize)>,
    /// Launch geometry of each kernel step (`None` for library calls).
    pub geometry: Vec<Option<Geometry>>,
    pub arena_bytes: usize,
}

fn round_up(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

/// The geometry of a launch; empty work gives zero blocks. Kernels with per-block scratch
/// run on fewer blocks (grid-stride), which bounds the scratch they need.
pub fn geometry(
    launch: &Launch,
    env: &SymbolBindings,
    (max_block, mut max_grid): (u32, u32),
    scratch: bool,
) -> Result<Geometry> {
    if scratch {
        max_grid = max_grid.min(MAX_SCRATCH_BLOCKS);
    }
    Ok(match launch {
        Launch::Elements(n) => {
            let n = n.eval(env)?.max(0) as u64;
            Geometry {
                blocks: n.div_ceil(max_block as u64).min(max_grid as u64) as u32,
                threads: max_block,
            }
        }
        Launch::Rows { rows, width } => {
            let rows = rows.eval(env)?.max(0) as u64;
            let width = width.eval(env)?.max(1) as u64;
            Geometry {
                blocks: rows.min(max_grid as u64) as u32,
                threads: width.next_power_of_two().clamp(32, max_block as u64) as u32,
            }
        }
    })
}

/// Bytes of node `n`'s value under `env` (zero when a dim does not evaluate there).
pub(crate) fn node_bytes(kp: &KernelProgram, n: usize, env: &SymbolBindings) -> usize {
    let node = &kp.graph.nodes[n];
    let mut elems = 1usize;
    for d in &node.ty.shape {
        match d.eval(env) {
            Ok(v) => elems = elems.saturating_mul(v.max(0) as usize),
            Err(_) => return 0,
        }
    }
    elems.saturating_mul(node.ty.dtype.size())
}

/// Accumulator bytes of a step's scratch (f64 for f64 nodes, f32 otherwise).
fn scratch_elem(kp: &KernelProgram, node: usize) -> usize {
    if kp.graph.nodes[node].ty.dtype == DType::F64 {
        8
    } else {
        4
    }
}

/// Scratch bytes step `s` needs under `env` when launched on `blocks` blocks.
pub(crate) fn scratch_bytes(
    kp: &KernelProgram,
    s: usize,
    blocks: u32,
    env: &SymbolBindings,
) -> Result<usize> {
    let step = &kp.steps[s];
    let StepKind::Kernel {
        scratch_per_block: Some(per_block),
        ..
    } = &step.kind
    else {
        return Ok(0);
    };
    let per = per_block.eval(env)?.max(0) as usize;
    Ok(blocks as usize * per * scratch_elem(kp, step.node))
}

/// Bytes of the partial results step `s` writes under `env` (0 when it writes none).
pub(crate) fn partial_bytes(kp: &KernelProgram, s: usize, env: &SymbolBindings) -> Result<usize> {
    let step = &kp.steps[s];
    let StepKind::Kernel {
        partials: Some((elems, _)),
        ..
    } = &step.kind
    else {
        return Ok(0);
    };
    Ok(elems.eval(env)?.max(0) as usize * scratch_elem(kp, step.node))
}

/// A kernel step's launch and whether it is cooperative and has per-block scratch (what
/// its geometry depends on); `None` for library calls.
fn kernel_launch<'k>(kp: &KernelProgram, kind: &'k StepKind) -> Option<(&'k Launch, bool, bool)> {
    match kind {
        StepKind::Kernel {
            kernel,
            launch,
            scratch_per_block,
            ..
        } => Some((
            launch,
            kp.kernels[*kernel].cooperative,
            scratch_per_block.is_some(),
        )),
        StepKind::Gemm(_) => None,
    }
}

/// A layout that serves every binding in `envs` and, if given, is at least as large as
/// `floor` everywhere (so a layout grown for a new binding still serves the old ones).
pub fn plan(
    kp: &KernelProgram,
    limits: &Limits<'_>,
    envs: &[&SymbolBindings],
    floor: Option<&Layout>,
) -> Result<Layout> {
    // Geometry: the largest grid and block any binding asks for (grid-stride loops make
    // a larger launch correct for a smaller size).
    let mut geometry = Vec::with_capacity(kp.steps.len());
    for (s, step) in kp.steps.iter().enumerate() {
        let Some((launch, coop, scratch)) = kernel_launch(kp, &step.kind) else {
            geometry.push(None);
            continue;
        };
        let mut best = floor.and_then(|f| f.geometry[s]).unwrap_or(Geometry {
            blocks: 0,
            threads: 0,
        });
        for env in envs {
            let g = self::geometry(launch, env, limits(coop), scratch)?;
            best.blocks = best.blocks.max(g.blocks);
            best.threads = best.threads.max(g.threads);
        }
        geometry.push(Some(best));
    }

    // The last step reading each node.
    let mut last_read: HashMap<usize, usize> = HashMap::new();
    for (s, step) in kp.steps.iter().enumerate() {
        let reads: Vec<usize> = match &step.kind {
            StepKind::Kernel { args, .. } => args.clone(),
            StepKind::Gemm(gm) => gm.reads(),
        };
        for r in reads {
            last_read.insert(r, s);
        }
    }
    // First-fit offsets over the live intervals (the arena is reused as values die).
    let mut live: Vec<(usize, usize, usize)> = Vec::new(); // (offset, size, dies after step)
    let mut top = 0usize;
    let mut place = |size: usize, dies: usize, s: usize, live: &mut Vec<(usize, usize, usize)>| {
        live.retain(|&(_, _, d)| d >= s);
        live.sort_unstable();
        let mut at = 0usize;
        for &(o, sz, _) in live.iter() {
            if at + size <= o {
                break;
            }
            at = at.max(o + sz);
        }
        live.push((at, size, dies));
        top = top.max(at + size);
        at
    };
    let mut offsets = HashMap::new();
    let mut slots = HashMap::new();
    let mut scratch = HashMap::new();
    let mut partials = HashMap::new();
    for (s, step) in kp.steps.iter().enumerate() {
        // Partial results live during the step that writes and combines them.
        if let StepKind::Kernel {
            partials: Some(_), ..
        } = &step.kind
        {
            let mut need = floor
                .and_then(|f| f.partials.get(&s))
                .map_or(0, |&(_, b)| b);
            for env in envs {
                need = need.max(partial_bytes(kp, s, env)?);
            }
            let size = round_up(need.max(1));
            partials.insert(s, (place(size, s, s, &mut live), size));
        }
        if let (Some(Geometry { blocks, .. }), Some((_, _, true))) =
            (geometry[s], kernel_launch(kp, &step.kind))
        {
            let mut need = floor.and_then(|f| f.scratch.get(&s)).map_or(0, |&(_, b)| b);
            for env in envs {
                need = need.max(scratch_bytes(kp, s, blocks, env)?);
            }
            let size = round_up(need.max(1));
            scratch.insert(s, (place(size, s, s, &mut live), size));
        }
        // A node written by several steps (scatter: copy, then updates) is placed once.
        let written = std::iter::once(step.dest).chain(step.also.iter().map(|&(_, d)| d));
        let unplaced: Vec<usize> = written
            .filter_map(|d| match d {
                Dest::Node(n) if !offsets.contains_key(&n) => Some(n),
                _ => None,
            })
            .collect();
        for n in unplaced {
            let mut bytes = floor.and_then(|f| f.slots.get(&n)).copied().unwrap_or(0);
            for env in envs {
                bytes = bytes.max(node_bytes(kp, n, env));
            }
            let size = round_up(bytes.max(1));
            let dies = last_read.get(&n).copied().unwrap_or(s).max(s);
            offsets.insert(n, place(size, dies, s, &mut live));
            slots.insert(n, size);
        }
    }
    Ok(Layout {
        offsets,
        slots,
        scratch,
        partials,
        geometry,
        arena_bytes: top,
    })
}

impl Layout {
    /// Whether this layout serves `env`: every value and scratch fits its slot, and no step
    /// this layout skips (zero blocks) has work under `env`.
    pub fn serves(&self, kp: &KernelProgram, limits: &Limits<'_>, env: &SymbolBindings) -> bool {
        let check = || -> Result<bool> {
            for (&n, &slot) in &self.slots {
                if node_bytes(kp, n, env) > slot {
                    return Ok(false);
                }
            }
            for (s, step) in kp.steps.iter().enumerate() {
                let (Some(have), Some((launch, coop, scratch))) =
                    (self.geometry[s], kernel_launch(kp, &step.kind))
                else {
                    continue;
                };
                let want = geometry(launch, env, limits(coop), scratch)?;
                if have.blocks == 0 && want.blocks > 0 {
                    return Ok(false);
                }
                if let Some(&(_, bytes)) = self.scratch.get(&s) {
                    if scratch_bytes(kp, s, have.blocks, env)? > bytes {
                        return Ok(false);
                    }
                }
                if let Some(&(_, bytes)) = self.partials.get(&s) {
                    if partial_bytes(kp, s, env)? > bytes {
                        return Ok(false);
                    }
                }
            }
            Ok(true)
        };
        check().unwrap_or(false)
    }
}

/// The bucket a dim value falls in: the next power of two, at least 16 (a decode loop's
/// growing length then changes graphs once per doubling).
pub fn bucket(v: i64) -> i64 {
    (v.max(16) as u64).next_power_of_two() as i64
}
