//! bf16 products on Intel AMX tiles (Sapphire Rapids and later): `tdpbf16ps` multiplies a
//! 16×32 tile of bf16 A by a 32×16 tile of bf16 B (k in pairs) into a 16×16 f32 tile,
//! 8 192 multiply-adds an instruction — about eight times what the AVX-512 FMA tiles of
//! `sgemm` reach per cycle, and what eager PyTorch (oneDNN) runs bf16 products on where the
//! CPU has AMX. A task holds a 32×32 block of sums in four tile registers (two A tiles of
//! 16 rows, two B tiles of 16 columns); the activations are copied into tiles once per
//! call (`pack_a`), the weight packed once (`pack`), each tile one contiguous KiB.
//!
//! The products are sums in f32 of exact bf16 products, as `sgemm`'s widened FMAs are, but
//! in another order (pairs of k added first) and with bf16 denormals read as zero: the
//! result differs from the f32 GEMM's by rounding, as eager's own AMX products do. Rust's
//! AMX intrinsics are unstable, so the tile instructions are inline assembly; the tile
//! state is asked of Linux once (`amx_tiles`).

use std::arch::asm;
use std::sync::OnceLock;

use half::bf16;

use super::amx_tiles::TileConfig;
use super::bf16_kernel::{pack_panels, AlignedBf16};
use super::sgemm::Strided;
use crate::elem::halfconv::f32_to_bf16;
use crate::par::{self, SendPtr};

/// k per tile step: a tile row holds 32 bf16 (64 bytes).
pub const K_STEP: usize = 32;
/// Columns of a B tile (a panel of the packed weight).
pub const COLS: usize = 16;
/// bf16 values in a B tile: 16 rows of k pairs × 16 columns × 2.
const TILE: usize = K_STEP * COLS;
/// Rows of A per task: two tiles of 16.
const ROWS: usize = 32;
/// Panel pairs × steps of k in one task's run: 256 KiB of B tiles.
const RUN_TILES: usize = 128;

/// Whether the AMX kernel runs: the CPU has AMX-BF16 and AVX-512, Linux granted the tile
/// data, and `EMBER_CPU_AMX` is not 0 (or `EMBER_CPU_SIMD`).
pub fn available() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        crate::simd::avx512_available()
            && std::env::var("EMBER_CPU_AMX").map_or(true, |v| v.trim() != "0")
            && cpu_has_amx_bf16()
            && super::amx_tiles::tile_data_granted()
    })
}

fn cpu_has_amx_bf16() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    if __cpuid(0).eax < 7 {
        return false;
    }
    // Leaf 7: EDX bit 22 is AMX-BF16, bit 24 AMX-TILE.
    let edx = __cpuid_count(7, 0).edx;
    (edx >> 22) & 1 == 1 && (edx >> 24) & 1 == 1
}

/// bf16 values a `k`×`n` right operand takes in tile layout.
pub fn packed_len(k: usize, n: usize) -> usize {
    n.div_ceil(COLS) * k.div_ceil(K_STEP) * TILE
}

/// One B tile's values (16 rows of 64 bytes).
pub type TileValues = AlignedBf16<TILE>;

/// `src` (`k`×`n`) packed as B tiles: panel `p` (columns `16p..`), step `s` (k `32s..`) is
/// the tile at `(p · steps + s) · TILE`, whose row `r`, column `c` holds the pair
/// B[32s + 2r, 16p + c], B[32s + 2r + 1, 16p + c]; zeros past K and N.
///
/// # Safety
/// `src` must address `k`×`n` readable elements.
pub unsafe fn pack(k: usize, n: usize, src: Strided<bf16>) -> Vec<TileValues> {
    let steps = k.div_ceil(K_STEP);
    let at = |kk: usize, c: usize| (kk / K_STEP) * TILE + (kk % K_STEP) / 2 * 32 + c * 2 + kk % 2;
    // SAFETY: by the contract; `at` maps each (kk, c) of a panel to its own value of the
    // panel's `steps` tiles.
    unsafe { pack_panels((k, n), src, (COLS, steps), at) }
}

/// `out = a · b` for `a` (`m`×`k` bf16, rows `lda` apart, unit column stride) and `b`
/// packed by `pack` (`k`×`n`), `out` `m`×`n` bf16 (rows `n` apart), each output the f32 sum
/// rounded once.
///
/// # Safety
/// `available()`; `a` addresses m rows of k elements; `b` holds `packed_len(k, n)` values;
/// `out` holds m·n elements and overlaps neither.
pub unsafe fn product(
    (m, n, k): (usize, usize, usize),
    a: *const bf16,
    lda: usize,
    b: &[bf16],
    out: *mut bf16,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        b.len() >= packed_len(k, n),
        "AMX tiles of a smaller operand"
    );
    if k == 0 {
        // SAFETY: out holds m·n elements.
        unsafe { std::slice::from_raw_parts_mut(out, m * n).fill(bf16::ZERO) };
        return;
    }
    let (blocks, pairs) = (m.div_ceil(ROWS), n.div_ceil(2 * COLS));
    let steps = k.div_ceil(K_STEP);
    let need = blocks * steps * 2 * TILE;
    // The packed activations in this thread's scratch (a fresh allocation of this size
    // would be page-faulted in on every call), from its first cache line boundary.
    crate::scratch::with_scratch(need.div_ceil(4) + 8, |words| {
        let skip = (words as *mut u8).align_offset(64);
        // SAFETY: the scratch holds `need` bf16s (4 a word) past the ≤ 56 bytes skipped,
        // this call's alone.
        let tiles = unsafe {
            std::slice::from_raw_parts_mut((words as *mut u8).add(skip) as *mut bf16, need)
        };
        // SAFETY: `a` addresses m rows of k elements `lda` apart; `tiles` holds `need`.
        unsafe { pack_a(tiles, (m, k), a, lda) };
        // Tasks of a row block and a run of panel pairs, under one tile configuration
        // (`ldtilecfg` costs about as much as a few tile products): several per thread,
        // and runs short enough that their B tiles (1 KiB per panel and step) stay in L2
        // while the row blocks take them in turn (tasks go run by run).
        let per_run = pairs
            .div_ceil((par::threads() * 4).div_ceil(blocks))
            .clamp(1, (RUN_TILES / steps).max(1));
        let runs = pairs.div_ceil(per_run);
        let (a_tiles, out) = (SendPtr(tiles.as_mut_ptr()), SendPtr(out));
        let (a_tiles, out) = (&a_tiles, &out);
        par::for_each(blocks * runs, |t| {
            let (run, block) = (t / blocks, t % blocks);
            let row0 = block * ROWS;
            let first = run * per_run;
            let task = Task {
                k,
                n,
                rows: (m - row0).min(ROWS),
                // SAFETY: block < blocks: inside the packed A tiles and `out`.
                a: unsafe { a_tiles.0.add(block * steps * 2 * TILE) },
                b: b.as_ptr(),
                out: unsafe { out.0.add(row0 * n) },
            };
            // SAFETY: by this function's contract; the task's rows and panels lie inside.
            unsafe { task.run(first * 2..((first + per_run) * 2).min(n.div_ceil(COLS))) };
        });
    });
}

/// `a`'s rows (`m`×`k`, rows `lda` apart) as A tiles: rows 16h.. of block b (32 rows) at
/// step s is the tile at `((b · steps + s) · 2 + h) · TILE`, 32 k a row, zeros past K. An A
/// tile read in place would take its 16 rows `lda` apart — for K of 1024 or 2048, rows
/// 2 or 4 KiB apart, all in the same few L1 sets — and a partial last step would read past
/// the rows (a NaN there is not cancelled by B's zeros).
///
/// # Safety
/// `a` addresses m rows of k elements; `dst` holds ⌈m/32⌉ · steps · 2 · TILE values.
unsafe fn pack_a(dst: &mut [bf16], (m, k): (usize, usize), a: *const bf16, lda: usize) {
    let steps = k.div_ceil(K_STEP);
    assert!(dst.len() >= m.div_ceil(ROWS) * steps * 2 * TILE);
    let (base, start) = (SendPtr(dst.as_mut_ptr()), a as usize);
    let base = &base;
    par::for_each(m.div_ceil(16), |half| {
        let (block, h) = (half / 2, half % 2);
        for r in 0..16.min(m - half * 16) {
            // SAFETY: row 16·half + r < m of `a`; its tiles' rows lie inside `dst`.
            unsafe {
                let row = (start as *const bf16).add((half * 16 + r) * lda);
                for s in 0..steps {
                    let tile_row = base
                        .0
                        .add(((block * steps + s) * 2 + h) * TILE + r * K_STEP);
                    let live = K_STEP.min(k - s * K_STEP);
                    std::ptr::copy_nonoverlapping(row.add(s * K_STEP), tile_row, live);
                    std::ptr::write_bytes(tile_row.add(live), 0, K_STEP - live);
                }
            }
        }
    });
}

/// One task's rows (≤ 32) of `out`, and their A tiles (`pack_a`).
struct Task {
    k: usize,
    n: usize,
    rows: usize,
    a: *const bf16,
    b: *const bf16,
    out: *mut bf16,
}

impl Task {
    /// The task's rows times the panels `panels` (taken in pairs).
    ///
    /// # Safety
    /// As `product`, for the task's rows and these panels.
    unsafe fn run(&self, panels: std::ops::Range<usize>) {
        let (k, rows) = (self.k, self.rows);
        let (top, bottom) = (rows.min(16), rows.saturating_sub(16));
        let steps = k.div_ceil(K_STEP);
        let config = TileConfig::new(top, bottom);
        let mut sums = [0.0f32; ROWS * 2 * COLS];
        let sums_ptr = sums.as_mut_ptr();
        let (a_stride, c_stride) = (K_STEP * 2, 2 * COLS * 4);
        // SAFETY (the whole block): tile loads read `top`/`bottom` rows of 64 bytes from
        // inside the packed A and B tiles; stores write inside `sums`.
        unsafe {
            asm!("ldtilecfg [{}]", in(reg) &config, options(nostack, readonly));
            let mut q = panels.start;
            while q < panels.end {
                let pair = q + 1 < panels.end;
                // Only configured tiles: 2 and 3 hold rows only when there is a bottom half.
                asm!("tilezero tmm0", options(nostack, nomem));
                if pair {
                    asm!("tilezero tmm1", options(nostack, nomem));
                }
                if bottom > 0 {
                    asm!("tilezero tmm2", options(nostack, nomem));
                    if pair {
                        asm!("tilezero tmm3", options(nostack, nomem));
                    }
                }
                for s in 0..steps {
                    let a_top = self.a.add(s * 2 * TILE);
                    let b0 = self.b.add((q * steps + s) * TILE);
                    asm!(
                        "tileloadd tmm4, [{a} + {sa}*1]",
                        "tileloadd tmm6, [{b} + {sb}*1]",
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        a = in(reg) a_top,
                        b = in(reg) b0,
                        sa = in(reg) a_stride,
                        sb = in(reg) 64usize,
                        options(nostack, readonly),
                    );
                    if pair {
                        asm!(
                            "tileloadd tmm7, [{b} + {sb}*1]",
                            "tdpbf16ps tmm1, tmm4, tmm7",
                            b = in(reg) b0.add(steps * TILE),
                            sb = in(reg) 64usize,
                            options(nostack, readonly),
                        );
                    }
                    if bottom > 0 {
                        let a_bottom = a_top.add(TILE);
                        asm!(
                            "tileloadd tmm5, [{a} + {sa}*1]",
                            "tdpbf16ps tmm2, tmm5, tmm6",
                            a = in(reg) a_bottom,
                            sa = in(reg) a_stride,
                            options(nostack, readonly),
                        );
                        if pair {
                            asm!("tdpbf16ps tmm3, tmm5, tmm7", options(nostack, nomem));
                        }
                    }
                }
                asm!(
                    "tilestored [{c} + {sc}*1], tmm0",
                    c = in(reg) sums_ptr,
                    sc = in(reg) c_stride,
                    options(nostack),
                );
                if pair {
                    asm!(
                        "tilestored [{c} + {sc}*1], tmm1",
                        c = in(reg) sums_ptr.add(COLS),
                        sc = in(reg) c_stride,
                        options(nostack),
                    );
                }
                if bottom > 0 {
                    asm!(
                        "tilestored [{c} + {sc}*1], tmm2",
                        c = in(reg) sums_ptr.add(16 * 2 * COLS),
                        sc = in(reg) c_stride,
                        options(nostack),
                    );
                    if pair {
                        asm!(
                            "tilestored [{c} + {sc}*1], tmm3",
                            c = in(reg) sums_ptr.add(16 * 2 * COLS + COLS),
                            sc = in(reg) c_stride,
                            options(nostack),
                        );
                    }
                }
                // Columns q·16.. of the task's rows: the sums of a pair (or one panel), cut
                // at N, rounded once.
                let cols = ((1 + pair as usize) * COLS).min(self.n - q * COLS);
                for r in 0..rows {
                    let dst =
                        std::slice::from_raw_parts_mut(self.out.add(r * self.n + q * COLS), cols);
                    for (d, &v) in dst.iter_mut().zip(&sums[r * 2 * COLS..]) {
                        *d = f32_to_bf16(v);
                    }
                }
                q += 1 + pair as usize;
            }
            asm!("tilerelease", options(nostack, nomem));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every tile shape (1–32 rows, partial row tiles, one panel or pairs, N cut inside a
    /// panel, K a whole number of steps or not) from row-major and transposed sources,
    /// against the f64 sum of the same bf16 values rounded once.
    #[test]
    fn matches_a_plain_bf16_product() {
        if !available() {
            return;
        }
        let value = |i: usize, seed: usize| {
            bf16::from_f32(((i * 7 + seed * 13) % 23) as f32 * 0.125 - 1.375)
        };
        let helpers = par::Helpers::for_threads(2);
        for &(m, n, k) in &[
            (1, 16, 32),
            (2, 17, 33),
            (5, 48, 64),
            (16, 40, 300),
            (17, 33, 31),
            (32, 64, 96),
            (45, 70, 257),
            (64, 20, 8),
        ] {
            let a: Vec<bf16> = (0..m * k).map(|i| value(i, 1)).collect();
            let b: Vec<bf16> = (0..k * n).map(|i| value(i, 2)).collect();
            let bt: Vec<bf16> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
            let want: Vec<f32> = (0..m * n)
                .map(|o| {
                    let (i, j) = (o / n, o % n);
                    let s: f64 = (0..k)
                        .map(|p| a[i * k + p].to_f64() * b[p * n + j].to_f64())
                        .sum();
                    s as f32
                })
                .collect();
            // SAFETY: b and bt address k×n elements as described.
            let packs = unsafe {
                [
                    pack(
                        k,
                        n,
                        Strided {
                            ptr: b.as_ptr(),
                            rs: n as isize,
                            cs: 1,
                        },
                    ),
                    pack(
                        k,
                        n,
                        Strided {
                            ptr: bt.as_ptr(),
                            rs: 1,
                            cs: k as isize,
                        },
                    ),
                ]
            };
            assert_eq!(
                AlignedBf16::flat(&packs[0]),
                AlignedBf16::flat(&packs[1]),
                "{m}x{n}x{k}: one layout from either source"
            );
            for threads in [1, 2] {
                let mut out = vec![bf16::NAN; m * n];
                par::with_helpers(&helpers, threads, || unsafe {
                    product(
                        (m, n, k),
                        a.as_ptr(),
                        k,
                        AlignedBf16::flat(&packs[0]),
                        out.as_mut_ptr(),
                    )
                });
                for (o, (g, w)) in out.iter().zip(&want).enumerate() {
                    // Sums of exact products: f32 accumulation in another order, then one
                    // bf16 rounding (half an ulp, plus the f32 error).
                    let tol = w.abs() * 2f32.powi(-8) + 1e-3;
                    assert!(
                        (g.to_f32() - w).abs() <= tol,
                        "{m}x{n}x{k} threads {threads} at {o}: {g} vs {w}"
                    );
                }
            }
        }
    }
}
