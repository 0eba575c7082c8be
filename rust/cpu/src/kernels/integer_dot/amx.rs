//! Intel AMX (Sapphire Rapids and later) for `IntegerDot`: `tdpbusd` (`tdpbssd`) multiplies
//! a 16×64 tile of uint8 (int8) A by a 64×16 tile of int8 B into a 16×16 int32 tile, 16 384
//! multiply-adds an instruction. With an instruction for either signedness of A, A is read
//! as it is (no flip): of `PackedB`'s terms only the row terms `β·rowsum(A)` remain.
//! Rust's AMX intrinsics are unstable, so the few tile instructions are inline assembly;
//! Linux lends a process the tile registers only after it asks
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), and `available` asks once.
//!
//! The packed B (`PackedB`) is laid out in the tiles' format: four k of a column in 32
//! bits, 16 quads × 16 columns in one contiguous KiB.

use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::super::amx_tiles::TileConfig;
use super::{PackedB, WIDTH};
use crate::par;

/// Rows of A per task: two tiles of 16.
const ROWS: usize = 32;
/// k per tile step: a tile row holds 64 bytes.
pub const K_STEP: usize = 64;

/// Whether the AMX kernel runs: the VNNI kernels may, the CPU has AMX-INT8, Linux granted
/// the tile data, and `EMBER_CPU_AMX` is not 0.
pub fn available() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        super::vnni_available()
            && std::env::var("EMBER_CPU_AMX").map_or(true, |v| v.trim() != "0")
            && cpu_has_amx_int8()
            && super::super::amx_tiles::tile_data_granted()
    })
}

fn cpu_has_amx_int8() -> bool {
    if __cpuid(0).eax < 7 {
        return false;
    }
    // Leaf 7: EDX bit 24 is AMX-TILE, bit 25 AMX-INT8.
    (__cpuid_count(7, 0).edx >> 24) & 3 == 3
}

/// Whether the AMX kernel takes this product: whole tile steps of k.
pub fn takes(p: &PackedB) -> bool {
    p.k.is_multiple_of(K_STEP) && p.k > 0
}

struct Out(*mut i32);
// SAFETY: tasks write disjoint blocks of the output, which outlives the loop.
unsafe impl Sync for Out {}

/// `a` (`[m, k]`) times `p` into `out` (`[m, n]`), each row's term of `rows` added.
///
/// # Safety
/// `available()` and `takes(p)`; `a` holds m·k bytes, `rows` m row terms (`row_terms`) and
/// `out` m·n int32 for p's k and n.
pub unsafe fn product(a: &[u8], m: usize, p: &PackedB, rows: &[i32], out: &mut [i32]) {
    let (k, n) = (p.k, p.n);
    if m == 0 || n == 0 {
        return;
    }
    let blocks = m.div_ceil(ROWS);
    let panels = n.div_ceil(WIDTH);
    // A task takes a row block and a run of panels under one tile configuration
    // (`ldtilecfg` and `tilerelease` cost about as much as a small panel's products).
    let per_task = panels.div_ceil(PANEL_RUNS);
    let runs = panels.div_ceil(per_task);
    let out_ptr = Out(out.as_mut_ptr());
    par::for_each(blocks * runs, |t| {
        let out_ptr = &out_ptr;
        let (run, block) = (t / blocks, t % blocks);
        let row0 = block * ROWS;
        let block_rows = (m - row0).min(ROWS);
        let first = run * per_task;
        let last = (first + per_task).min(panels);
        // SAFETY: by this function's contract; the block's rows and the panels' columns
        // lie inside `a`, `p` and `out`.
        unsafe {
            block_panels(
                a.as_ptr().add(row0 * k),
                p,
                first..last,
                &rows[row0..row0 + block_rows],
                out_ptr.0.add(row0 * n),
            )
        }
    });
}

/// Runs of panels per row block: enough tasks to share among threads.
const PANEL_RUNS: usize = 4;

/// One task: the rows of A with a term in `row_fix` (≤ 32) times the panels `panels`,
/// written to `out` (the block's first output row; rows `p.n` apart) with those terms
/// added.
#[target_feature(enable = "avx512f")]
unsafe fn block_panels(
    a: *const u8,
    p: &PackedB,
    panels: std::ops::Range<usize>,
    row_fix: &[i32],
    out: *mut i32,
) {
    let (k, ldc, rows) = (p.k, p.n, row_fix.len());
    let top = rows.min(16);
    let bottom = rows - top;
    let config = TileConfig::new(top, bottom);
    let mut sums = std::mem::MaybeUninit::<[i32; ROWS * WIDTH]>::uninit();
    let sums = sums.as_mut_ptr() as *mut i32;
    // A's rows, a B tile's rows (contiguous), the sums' rows.
    let (a_stride, b_stride, c_stride): (usize, usize, usize) = (k, 64, WIDTH * 4);
    asm!("ldtilecfg [{}]", in(reg) &config, options(nostack, readonly));
    for panel in panels {
        let panel_data = p.data.as_ptr().add(panel * p.quads * WIDTH * 4);
        for half in 0..2 {
            asm!("tilezero tmm0", "tilezero tmm1", options(nostack, nomem));
            if bottom > 0 {
                asm!("tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
            }
            for step in 0..k / K_STEP {
                let a_top = a.add(step * K_STEP);
                // Quads 16·step.., columns 32·half.. and 32·half + 16..: two whole tiles.
                let b0 = panel_data.add(super::tile_offset(step * 16, half * 32));
                asm!(
                    "tileloadd tmm4, [{a} + {sa}*1]",
                    "tileloadd tmm6, [{b} + {sb}*1]",
                    "tileloadd tmm7, [{b1} + {sb}*1]",
                    a = in(reg) a_top,
                    b = in(reg) b0,
                    b1 = in(reg) b0.add(1024),
                    sa = in(reg) a_stride,
                    sb = in(reg) b_stride,
                    options(nostack, readonly),
                );
                match p.a_signed {
                    true => asm!(
                        "tdpbssd tmm0, tmm4, tmm6",
                        "tdpbssd tmm1, tmm4, tmm7",
                        options(nostack, nomem)
                    ),
                    false => asm!(
                        "tdpbusd tmm0, tmm4, tmm6",
                        "tdpbusd tmm1, tmm4, tmm7",
                        options(nostack, nomem)
                    ),
                }
                if bottom > 0 {
                    asm!(
                        "tileloadd tmm5, [{a} + {sa}*1]",
                        a = in(reg) a_top.add(16 * k),
                        sa = in(reg) a_stride,
                        options(nostack, readonly),
                    );
                    match p.a_signed {
                        true => asm!(
                            "tdpbssd tmm2, tmm5, tmm6",
                            "tdpbssd tmm3, tmm5, tmm7",
                            options(nostack, nomem)
                        ),
                        false => asm!(
                            "tdpbusd tmm2, tmm5, tmm6",
                            "tdpbusd tmm3, tmm5, tmm7",
                            options(nostack, nomem)
                        ),
                    }
                }
            }
            let c0 = sums.add(half * 32);
            asm!(
                "tilestored [{c} + {sc}*1], tmm0",
                "tilestored [{c1} + {sc}*1], tmm1",
                c = in(reg) c0,
                c1 = in(reg) c0.add(16),
                sc = in(reg) c_stride,
                options(nostack),
            );
            if bottom > 0 {
                let c2 = c0.add(16 * WIDTH);
                asm!(
                    "tilestored [{c} + {sc}*1], tmm2",
                    "tilestored [{c1} + {sc}*1], tmm3",
                    c = in(reg) c2,
                    c1 = in(reg) c2.add(16),
                    sc = in(reg) c_stride,
                    options(nostack),
                );
            }
        }
        // The sums of rows < `rows` were all written by the tile stores above.
        let cols = (p.n - panel * WIDTH).min(WIDTH);
        let out = out.add(panel * WIDTH);
        for (r, &fix_r) in row_fix.iter().enumerate() {
            let row = _mm512_set1_epi32(fix_r);
            for v in 0..WIDTH / 16 {
                let lanes = cols.saturating_sub(v * 16).min(16);
                if lanes == 0 {
                    break;
                }
                let s = _mm512_loadu_si512(sums.add(r * WIDTH + v * 16) as *const _);
                let res = _mm512_add_epi32(s, row);
                let mask = crate::simd::first_lanes(lanes);
                _mm512_mask_storeu_epi32(out.add(r * ldc + v * 16), mask, res);
            }
        }
    }
    asm!("tilerelease", options(nostack, nomem));
}
