//! bf16 products of several rows on a kernel of their own, where the CPU has one: AMX tiles
//! (`amx_bf16`) or `vdpbf16ps` pair panels (`bf16_pairs`). Here: which of them this CPU
//! runs, a weight packed in that kernel's layout, and a product dispatched to it. Where the
//! CPU has neither, bf16 products run on `sgemm`'s FMA tiles, widening the weight as they
//! load it.
//!
//! Both layouts interleave k in pairs (the instructions multiply a pair of bf16 per f32
//! lane) within panels of a few columns, so one packing loop (`pack_panels`) serves both;
//! each kernel supplies only where value (k, column) lies in its panel.

use half::bf16;

use super::sgemm::Strided;
use super::{amx_bf16, bf16_pairs};
use crate::par::{self, SendPtr};

/// `N` bf16 values on cache lines of their own (`N · 2` a multiple of 64 bytes): a kernel's
/// load that straddled two lines would cost twice.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub struct AlignedBf16<const N: usize>(pub [bf16; N]);

impl<const N: usize> AlignedBf16<N> {
    pub const ZERO: Self = AlignedBf16([bf16::ZERO; N]);

    /// The values one after another.
    pub fn flat(lines: &[Self]) -> &[bf16] {
        const { assert!((N * 2).is_multiple_of(64), "whole cache lines, no padding") };
        // SAFETY: `AlignedBf16<N>` is N bf16s and nothing else (`repr(C)`; N · 2 bytes is
        // a multiple of its alignment, asserted above, so there is no padding).
        unsafe { std::slice::from_raw_parts(lines.as_ptr() as *const bf16, lines.len() * N) }
    }
}

/// A kernel of its own for bf16 products of several rows.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Bf16Kernel {
    /// AMX tiles (`amx_bf16`).
    Amx,
    /// `vdpbf16ps` tiles (`bf16_pairs`), where they outrun the FMA tiles.
    Pairs,
}

impl Bf16Kernel {
    /// The kernel bf16 weights are packed for on this CPU, if any (AMX first).
    pub fn of_this_cpu() -> Option<Bf16Kernel> {
        if amx_bf16::available() {
            Some(Bf16Kernel::Amx)
        } else if bf16_pairs::preferred() {
            Some(Bf16Kernel::Pairs)
        } else {
            None
        }
    }

    /// Whether this CPU can run it (whether or not `of_this_cpu` picks it).
    pub fn runs_here(self) -> bool {
        match self {
            Bf16Kernel::Amx => amx_bf16::available(),
            Bf16Kernel::Pairs => super::rowdot::bf16_pairs_available(),
        }
    }

    /// Bytes a `k`×`n` right operand takes packed for this kernel.
    pub fn packed_bytes(self, k: usize, n: usize) -> usize {
        let values = match self {
            Bf16Kernel::Amx => amx_bf16::packed_len(k, n),
            Bf16Kernel::Pairs => bf16_pairs::packed_lines(k, n) * 32,
        };
        values * std::mem::size_of::<bf16>()
    }

    /// `src` (`k`×`n`) packed as this kernel's right operand.
    ///
    /// # Safety
    /// `src` must address `k`×`n` readable elements.
    pub unsafe fn pack(self, k: usize, n: usize, src: Strided<bf16>) -> Bf16Packed {
        // SAFETY: by the contract.
        unsafe {
            match self {
                Bf16Kernel::Amx => Bf16Packed::Amx(amx_bf16::pack(k, n, src)),
                Bf16Kernel::Pairs => Bf16Packed::Pairs(bf16_pairs::pack(k, n, src)),
            }
        }
    }
}

/// A bf16 right operand packed for one of the kernels.
pub enum Bf16Packed {
    Amx(Vec<amx_bf16::TileValues>),
    Pairs(Vec<bf16_pairs::PairLine>),
}

impl Bf16Packed {
    pub fn kernel(&self) -> Bf16Kernel {
        match self {
            Bf16Packed::Amx(_) => Bf16Kernel::Amx,
            Bf16Packed::Pairs(_) => Bf16Kernel::Pairs,
        }
    }

    pub fn bytes(&self) -> usize {
        match self {
            Bf16Packed::Amx(tiles) => std::mem::size_of_val(tiles.as_slice()),
            Bf16Packed::Pairs(lines) => std::mem::size_of_val(lines.as_slice()),
        }
    }

    /// `out = a · b` (this operand, packed from `k`×`n`), each output the f32 sum rounded
    /// once to bf16.
    ///
    /// # Safety
    /// The kernel runs on this CPU (it was packed for `Bf16Kernel::of_this_cpu()`, or its
    /// module says it is available); `a` addresses `m` rows of `k` elements `lda` apart with
    /// unit column stride; this operand was packed from `k`×`n`; `out` holds `m`·`n`
    /// elements and overlaps neither.
    pub unsafe fn product(
        &self,
        (m, n, k): (usize, usize, usize),
        a: *const bf16,
        lda: usize,
        out: *mut bf16,
    ) {
        // SAFETY: by the contract.
        unsafe {
            match self {
                Bf16Packed::Amx(tiles) => {
                    amx_bf16::product((m, n, k), a, lda, AlignedBf16::flat(tiles), out)
                }
                Bf16Packed::Pairs(lines) => bf16_pairs::product((m, n, k), a, lda, lines, out),
            }
        }
    }
}

/// `src` (`k`×`n`) packed as panels of `cols` columns, `N · lines` values each: value
/// (kk, c) of panel q (c counted from the panel's first column) at `at(kk, c)` in the
/// panel; zeros past K and N. Panels are packed in parallel, each from row-major or
/// transposed (`linear` weight) sources in the order the source is contiguous.
///
/// # Safety
/// `src` must address `k`×`n` readable elements; `at` must map every (kk < k, c < cols)
/// to a distinct index below `N · lines`.
pub(super) unsafe fn pack_panels<const N: usize>(
    (k, n): (usize, usize),
    src: Strided<bf16>,
    (cols, lines): (usize, usize),
    at: impl Fn(usize, usize) -> usize + Sync,
) -> Vec<AlignedBf16<N>> {
    let panels = n.div_ceil(cols);
    let mut data = vec![AlignedBf16::<N>::ZERO; panels * lines];
    let base = SendPtr(data.as_mut_ptr() as *mut bf16);
    // The source as an address: closures capture fields, and a raw pointer is not `Sync`.
    let (base, start, rs, cs) = (&base, src.ptr as usize, src.rs, src.cs);
    par::for_each(panels, |q| {
        let live = cols.min(n - q * cols);
        let start = start as *const bf16;
        // SAFETY: panel q owns its `lines` lines of `data` and `at` stays inside them;
        // reads inside the k×n source.
        unsafe {
            let panel = base.0.add(q * lines * N);
            if cs == 1 {
                for kk in 0..k {
                    let row = start.offset(kk as isize * rs + (q * cols) as isize);
                    for c in 0..live {
                        *panel.add(at(kk, c)) = *row.add(c);
                    }
                }
            } else {
                // A `linear` weight read transposed: each column's k are contiguous.
                for c in 0..live {
                    let col = start.offset((q * cols + c) as isize * cs);
                    for kk in 0..k {
                        *panel.add(at(kk, c)) = *col.offset(kk as isize * rs);
                    }
                }
            }
        }
    });
    data
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The values of a `k`×`n` operand (distinct, none zero) and its transpose, as sources.
    fn operand(k: usize, n: usize) -> (Vec<bf16>, Vec<bf16>) {
        let b: Vec<bf16> = (0..k * n).map(|i| bf16::from_f32(1.0 + i as f32)).collect();
        let bt: Vec<bf16> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
        (b, bt)
    }

    fn sources<'a>(b: &'a [bf16], bt: &'a [bf16], k: usize, n: usize) -> [Strided<bf16>; 2] {
        let rows = Strided {
            ptr: b.as_ptr(),
            rs: n as isize,
            cs: 1,
        };
        let cols = Strided {
            ptr: bt.as_ptr(),
            rs: 1,
            cs: k as isize,
        };
        [rows, cols]
    }

    /// Each kernel's packing puts B[kk, c] where its module says, zeros everywhere else,
    /// from either source: checked on any x86-64 CPU (the kernels themselves run only
    /// where the CPU has them).
    #[test]
    fn packs_each_layout_as_documented() {
        for &(k, n) in &[(1, 1), (3, 17), (33, 40), (64, 33), (70, 70)] {
            let (b, bt) = operand(k, n);
            let expected = |kernel: Bf16Kernel| {
                let values = kernel.packed_bytes(k, n) / 2;
                let mut want = vec![bf16::ZERO; values];
                for kk in 0..k {
                    for c in 0..n {
                        let at = match kernel {
                            // Tile (panel c/16, step kk/32): row (kk%32)/2, column c%16.
                            Bf16Kernel::Amx => {
                                let steps = k.div_ceil(32);
                                ((c / 16) * steps + kk / 32) * 512
                                    + (kk % 32) / 2 * 32
                                    + (c % 16) * 2
                                    + kk % 2
                            }
                            // Panel c/32, pair kk/2: line (c%32)/16, lane c%16.
                            Bf16Kernel::Pairs => {
                                let pairs = k.div_ceil(2);
                                ((c / 32) * pairs + kk / 2) * 64
                                    + (c % 32) / 16 * 32
                                    + (c % 16) * 2
                                    + kk % 2
                            }
                        };
                        want[at] = b[kk * n + c];
                    }
                }
                want
            };
            for kernel in [Bf16Kernel::Amx, Bf16Kernel::Pairs] {
                let want = expected(kernel);
                for src in sources(&b, &bt, k, n) {
                    // SAFETY: both sources address k×n elements.
                    let packed = unsafe { kernel.pack(k, n, src) };
                    assert_eq!(packed.kernel(), kernel);
                    assert_eq!(packed.bytes(), want.len() * 2, "{kernel:?} {k}x{n}");
                    let got = match &packed {
                        Bf16Packed::Amx(t) => AlignedBf16::flat(t),
                        Bf16Packed::Pairs(l) => AlignedBf16::flat(l),
                    };
                    assert!(got == want, "{kernel:?} {k}x{n}: packed layout");
                }
            }
        }
    }
}
