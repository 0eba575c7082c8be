//! bf16 products of several rows on `vdpbf16ps` (AVX512-BF16), for CPUs that have it but
//! no AMX — AMD's Zen 4 and Zen 5 among them. There `vdpbf16ps` retires as many
//! instructions a cycle as a 16-lane FMA and does twice its multiply-adds (16 lanes of a
//! pair each), so a tile of it runs twice the arithmetic of `sgemm`'s FMA tiles, which also
//! spend instructions widening each bf16 weight. Measured on a Zen 4 VM (RESULTS, stop 51).
//! On Intel Xeons the same tiles ran ~1.45× slower than the FMA tiles (RESULTS, stop 49):
//! their `vdpbf16ps` issues on one port where FMAs issue on two, so the choice is the
//! CPU's vendor (`preferred`), and Intel CPUs with AMX take `amx_bf16` anyway.
//!
//! The weight is packed once as panels of 32 columns: per pair of k, two 64-byte lines of
//! 16 (even k, odd k) pairs, the instruction's operand layout. Per call the activations'
//! rows are copied as pairs (`pack_a`: for each pair of k, the 32-bit pairs of 12 rows one
//! after another) so a tile broadcasts each row's pair from one pointer. A 12×32 tile keeps
//! 24 accumulators over the whole of k (a 32-column panel of even a long k streams from L2
//! at a few bytes a cycle), then rounds each sum to bf16 once.
//!
//! Sums in f32 of exact bf16 products, each pair added first, denormal inputs read as zero
//! (the instruction's own rule): another rounding order than the FMA tiles', as eager's
//! oneDNN products on these CPUs (`vdpbf16ps` too).

use std::arch::x86_64::*;
use std::sync::OnceLock;

use half::bf16;

use super::bf16_kernel::{pack_panels, AlignedBf16};
use super::sgemm::Strided;
use crate::par::{self, SendPtr};

/// Columns of a packed panel: two vectors of 16 pairs.
pub const COLS: usize = 32;
/// Rows of the register tile: 12 × 2 accumulators of the 32 registers.
const ROWS: usize = 12;
/// Row tiles per task: a panel read from L2 once per block of 48 rows.
const BLOCK_TILES: usize = 4;
/// Multiply-adds below which a product runs on the calling thread alone (waking a helper
/// costs about as much as a million).
const PAR_MIN_WORK: usize = 1 << 21;

/// One 64-byte line of a packed panel: 16 (even k, odd k) pairs.
pub type PairLine = AlignedBf16<32>;

/// Whether bf16 weights are packed for this kernel: the CPU has AVX512-BF16 (and the
/// AVX-512 kernels are on), no AMX for `amx_bf16`, and is not Intel's — or
/// `EMBER_CPU_BF16_PAIRS=1` asks for it anyway (`=0` never).
pub fn preferred() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        if !super::rowdot::bf16_pairs_available() || super::amx_bf16::available() {
            return false;
        }
        match std::env::var("EMBER_CPU_BF16_PAIRS")
            .as_deref()
            .map(str::trim)
        {
            Ok("0") => false,
            Ok("1") => true,
            _ => !cpu_is_intel(),
        }
    })
}

fn cpu_is_intel() -> bool {
    let id = __cpuid(0);
    // The vendor string in EBX, EDX, ECX order: "GenuineIntel".
    (id.ebx, id.edx, id.ecx) == (0x756e_6547, 0x4965_6e69, 0x6c65_746e)
}

/// Steps of k in pairs.
fn pairs(k: usize) -> usize {
    k.div_ceil(2)
}

/// Lines a `k`×`n` right operand takes packed.
pub fn packed_lines(k: usize, n: usize) -> usize {
    n.div_ceil(COLS) * pairs(k) * 2
}

/// `src` (`k`×`n`) packed as panels: panel `q` (columns `32q..`), pair `p` is the two lines
/// at `(q · pairs + p) · 2`; line `h`, lane `j` holds B[2p, 32q + 16h + j] then
/// B[2p + 1, 32q + 16h + j]; zeros past K and N.
///
/// # Safety
/// `src` must address `k`×`n` readable elements.
pub unsafe fn pack(k: usize, n: usize, src: Strided<bf16>) -> Vec<PairLine> {
    // Column c of k row kk: line c / 16 of pair kk / 2, lane c % 16, half kk % 2.
    let at = |kk: usize, c: usize| (kk / 2) * 64 + (c / 16) * 32 + (c % 16) * 2 + kk % 2;
    // SAFETY: by the contract; `at` maps each (kk, c) of a panel to its own value of the
    // panel's `2 · pairs` lines.
    unsafe { pack_panels((k, n), src, (COLS, pairs(k) * 2), at) }
}

/// `out = a · b` for `a` (`m`×`k` bf16, rows `lda` apart, unit column stride) and `b`
/// packed by `pack` (`k`×`n`), `out` `m`×`n` bf16 (rows `n` apart), each output the f32 sum
/// rounded once (to nearest even, as `halfconv::f32_to_bf16`).
///
/// # Safety
/// `preferred()` (or at least `rowdot::bf16_pairs_available()`); `a` addresses m rows of
/// k elements; `b` holds `packed_lines(k, n)` lines; `out` holds m·n elements and overlaps
/// neither.
pub unsafe fn product(
    (m, n, k): (usize, usize, usize),
    a: *const bf16,
    lda: usize,
    b: &[PairLine],
    out: *mut bf16,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        b.len() >= packed_lines(k, n),
        "bf16 pair panels of a smaller operand"
    );
    let steps = pairs(k);
    let tiles = m.div_ceil(ROWS);
    let need = tiles * steps * ROWS;
    // The activations as pairs in this thread's scratch (a fresh allocation of this size
    // would be page-faulted in on every call).
    crate::scratch::with_scratch(need.div_ceil(2), |words| {
        // SAFETY: the scratch holds `need` u32s, this call's alone.
        let a_pairs = unsafe { std::slice::from_raw_parts_mut(words as *mut u32, need) };
        // SAFETY: `a` addresses m rows of k elements `lda` apart.
        unsafe { pack_a(a_pairs, (m, k), a, lda) };
        let (panels, blocks) = (n.div_ceil(COLS), tiles.div_ceil(BLOCK_TILES));
        let threads = match m * n * k >= PAR_MIN_WORK {
            true => par::threads(),
            false => 1,
        };
        // Tasks of a row block and a group of panels, several per thread.
        let per_group = panels.div_ceil((threads * 4).div_ceil(blocks)).max(1);
        let groups = panels.div_ceil(per_group);
        let (a_pairs, out) = (SendPtr(a_pairs.as_mut_ptr()), SendPtr(out));
        let (a_pairs, out, b) = (&a_pairs, &out, AlignedBf16::flat(b).as_ptr() as usize);
        let task = |t: usize| {
            let (group, block) = (t / blocks, t % blocks);
            let first_tile = block * BLOCK_TILES;
            let last_tile = (first_tile + BLOCK_TILES).min(tiles);
            for q in group * per_group..((group + 1) * per_group).min(panels) {
                let cols = COLS.min(n - q * COLS);
                for tile in first_tile..last_tile {
                    let rows = ROWS.min(m - tile * ROWS);
                    // SAFETY: tile and panel lie inside the packed operands; the tile's
                    // rows and the panel's columns inside `out`.
                    unsafe {
                        run_tile(
                            rows,
                            a_pairs.0.add(tile * steps * ROWS),
                            (b as *const bf16).add(q * steps * 64),
                            steps,
                            out.0.add(tile * ROWS * n + q * COLS),
                            (n, cols),
                        )
                    };
                }
            }
        };
        match threads > 1 {
            true => par::for_each(blocks * groups, task),
            false => (0..blocks * groups).for_each(task),
        }
    });
}

/// `a`'s rows as pairs: row `r` of tile `t`, pair `p` (k `2p`, `2p + 1`) is the u32 at
/// `(t · pairs + p) · 12 + r`, its high half zero past K.
///
/// # Safety
/// `a` addresses m rows of k elements `lda` apart; `dst` holds ⌈m/12⌉ · 12 · pairs u32s.
unsafe fn pack_a(dst: &mut [u32], (m, k): (usize, usize), a: *const bf16, lda: usize) {
    let steps = pairs(k);
    assert!(dst.len() >= m.div_ceil(ROWS) * ROWS * steps);
    let (base, start) = (SendPtr(dst.as_mut_ptr()), a as usize);
    let base = &base;
    let rows = |t: usize| {
        for r in 0..ROWS.min(m - t * ROWS) {
            // SAFETY: row 12·t + r < m of `a`; its pairs lie inside `dst`.
            unsafe {
                let row = (start as *const bf16).add((t * ROWS + r) * lda) as *const u16;
                let tile = base.0.add(t * steps * ROWS + r);
                for p in 0..k / 2 {
                    *tile.add(p * ROWS) = (row.add(2 * p) as *const u32).read_unaligned();
                }
                if k % 2 == 1 {
                    *tile.add((steps - 1) * ROWS) = *row.add(k - 1) as u32;
                }
            }
        }
    };
    match m * k >= 1 << 16 {
        true => par::for_each(m.div_ceil(ROWS), rows),
        false => (0..m.div_ceil(ROWS)).for_each(rows),
    }
}

/// A tile of `rows` (≤ 12) rows: dispatches to the tile of that many rows.
///
/// # Safety
/// As `tile`.
unsafe fn run_tile(
    rows: usize,
    a: *const u32,
    b: *const bf16,
    steps: usize,
    out: *mut bf16,
    shape: (usize, usize),
) {
    // SAFETY: by the caller's contract; `preferred` (or the caller) checked the CPU.
    unsafe {
        match rows {
            12 => tile::<12>(a, b, steps, out, shape),
            11 => tile::<11>(a, b, steps, out, shape),
            10 => tile::<10>(a, b, steps, out, shape),
            9 => tile::<9>(a, b, steps, out, shape),
            8 => tile::<8>(a, b, steps, out, shape),
            7 => tile::<7>(a, b, steps, out, shape),
            6 => tile::<6>(a, b, steps, out, shape),
            5 => tile::<5>(a, b, steps, out, shape),
            4 => tile::<4>(a, b, steps, out, shape),
            3 => tile::<3>(a, b, steps, out, shape),
            2 => tile::<2>(a, b, steps, out, shape),
            _ => tile::<1>(a, b, steps, out, shape),
        }
    }
}

/// `R` rows of pairs (`pack_a`'s tile, 12 u32s a pair) times one packed panel (`steps`
/// pairs of two lines), each sum rounded to bf16 into `out` (rows `row_stride` apart,
/// `cols` ≤ 32 live columns).
///
/// # Safety
/// The CPU has AVX512-BF16 and AVX512-BW/VL; `a` holds `steps` · 12 u32s, `b` `steps` · 64
/// bf16s; `out` R rows of `cols` elements.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[allow(clippy::needless_range_loop)] // `r` indexes the rows and their accumulators
unsafe fn tile<const R: usize>(
    a: *const u32,
    b: *const bf16,
    steps: usize,
    out: *mut bf16,
    (row_stride, cols): (usize, usize),
) {
    #[inline(always)]
    fn pairs(v: __m512i) -> __m512bh {
        // SAFETY: both are 512 plain bits.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
    }
    // SAFETY (whole body): loads stay inside the tile's pairs and the panel's lines, stores
    // inside the R rows of `cols` outputs (masked).
    unsafe {
        let mut left = [_mm512_setzero_ps(); R];
        let mut right = [_mm512_setzero_ps(); R];
        for p in 0..steps {
            let line = b.add(p * 64);
            let b0 = pairs(_mm512_load_si512(line as *const __m512i));
            let b1 = pairs(_mm512_load_si512(line.add(32) as *const __m512i));
            let pair = a.add(p * ROWS);
            for r in 0..R {
                let x = pairs(_mm512_set1_epi32(*pair.add(r) as i32));
                left[r] = _mm512_dpbf16_ps(left[r], x, b0);
                right[r] = _mm512_dpbf16_ps(right[r], x, b1);
            }
        }
        let masks = [lanes(cols.min(16)), lanes(cols.saturating_sub(16))];
        for r in 0..R {
            let row = out.add(r * row_stride);
            for (h, sums) in [left[r], right[r]].into_iter().enumerate() {
                if masks[h] != 0 {
                    _mm256_mask_storeu_epi16(row.add(16 * h) as *mut i16, masks[h], round(sums));
                }
            }
        }
    }
}

/// A mask of the first `n` (≤ 16) lanes.
fn lanes(n: usize) -> __mmask16 {
    ((1u32 << n) - 1) as __mmask16
}

/// 16 f32 rounded to bf16 as `halfconv::f32_to_bf16` rounds each: to nearest even, NaN
/// quieted (the instruction `vcvtneps2bf16` would read denormals as zero).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn round(v: __m512) -> __m256i {
    let x = _mm512_castps_si512(v);
    let odd = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    let bias = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd);
    let rounded = _mm512_srli_epi32(_mm512_add_epi32(x, bias), 16);
    let nan = _mm512_or_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(0x40));
    let is_nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, is_nan, nan))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::elem::halfconv::f32_to_bf16;

    /// Every tile height (1–12 rows and blocks past one), one panel or several, N cut
    /// inside a panel and inside its second half, odd and even K, from row-major and
    /// transposed sources, on one and two threads, against the f64 sum of the same bf16
    /// values rounded once.
    #[test]
    fn matches_a_plain_bf16_product() {
        if !super::super::rowdot::bf16_pairs_available() {
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
            (12, 40, 300),
            (13, 33, 31),
            (30, 64, 96),
            (61, 70, 257),
            (64, 20, 1),
            (110, 96, 640), // m·k past 2^16: the activations copied on the pool
        ] {
            let a: Vec<bf16> = (0..m * k).map(|i| value(i, 1)).collect();
            let b: Vec<bf16> = (0..k * n).map(|i| value(i, 2)).collect();
            let bt: Vec<bf16> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
            let want: Vec<bf16> = (0..m * n)
                .map(|o| {
                    let (i, j) = (o / n, o % n);
                    let s: f64 = (0..k)
                        .map(|p| a[i * k + p].to_f64() * b[p * n + j].to_f64())
                        .sum();
                    f32_to_bf16(s as f32)
                })
                .collect();
            let source = |ptr: &Vec<bf16>, rs: usize, cs: usize| Strided {
                ptr: ptr.as_ptr(),
                rs: rs as isize,
                cs: cs as isize,
            };
            // SAFETY: b and bt address k×n elements as described.
            let packs = unsafe { [pack(k, n, source(&b, n, 1)), pack(k, n, source(&bt, 1, k))] };
            assert_eq!(
                AlignedBf16::flat(&packs[0]),
                AlignedBf16::flat(&packs[1]),
                "{m}x{n}x{k}: one layout from either source"
            );
            for threads in [1, 2] {
                let mut out = vec![bf16::NAN; m * n];
                par::with_helpers(&helpers, threads, || unsafe {
                    product((m, n, k), a.as_ptr(), k, &packs[0], out.as_mut_ptr())
                });
                for (o, (g, w)) in out.iter().zip(&want).enumerate() {
                    // The values' products and sums are exact in f32 here (multiples of
                    // 1/64 below 2^24/64): any order of summing gives the same bf16.
                    assert_eq!(g, w, "{m}x{n}x{k} threads {threads} at {o}");
                }
            }
        }
    }

    /// Rounding a vector gives `f32_to_bf16` of each lane, ties, NaN and infinities
    /// included.
    #[test]
    fn rounds_as_halfconv() {
        if !super::super::rowdot::bf16_pairs_available() {
            return;
        }
        let values: Vec<f32> = [
            1.0,
            -0.0,
            f32::from_bits(0x3F80_8000), // a tie, kept part even
            f32::from_bits(0x3F81_8000), // a tie, kept part odd
            f32::from_bits(0x3F80_7FFF),
            f32::MAX,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(0xFF81_2345), // a signalling NaN with a payload
            1e-40,                       // denormal
            -3.3e38,
            65504.0,
            0.1,
            -7.75e-3,
            2.5,
        ]
        .to_vec();
        let mut got = [0u16; 16];
        // SAFETY: the CPU has the features; 16 lanes in, 16 out.
        unsafe {
            let v = _mm512_loadu_ps(values.as_ptr());
            _mm256_storeu_si256(got.as_mut_ptr() as *mut __m256i, round(v));
        }
        for (v, g) in values.iter().zip(got) {
            assert_eq!(g, f32_to_bf16(*v).to_bits(), "{v:e}");
        }
    }
}
