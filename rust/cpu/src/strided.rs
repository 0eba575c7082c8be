//! Walking strided operands in row-major order: dims are merged where every operand allows
//! it, the innermost dim is visited as runs (unit-stride runs become slices the compiler can
//! vectorize), and large outputs are split into chunks that rayon runs in parallel.

use crate::buffer::View;
use crate::par;
use crate::simd;

/// Outputs at least this large are computed in parallel chunks.
pub const PAR_MIN: usize = 1 << 15;

/// Merges adjacent dims whose strides are compatible for every operand; drops size-1 dims.
pub fn coalesce<const N: usize>(
    shape: &[usize],
    strides: [&[isize]; N],
) -> (Vec<usize>, [Vec<isize>; N]) {
    let mut out_shape: Vec<usize> = Vec::new();
    let mut out_strides: [Vec<isize>; N] = std::array::from_fn(|_| Vec::new());
    for (d, &size) in shape.iter().enumerate() {
        if size == 1 {
            continue;
        }
        let mergeable = out_shape.last().is_some()
            && (0..N).all(|k| *out_strides[k].last().unwrap() == strides[k][d] * size as isize);
        if mergeable {
            *out_shape.last_mut().unwrap() *= size;
            for k in 0..N {
                *out_strides[k].last_mut().unwrap() = strides[k][d];
            }
        } else {
            out_shape.push(size);
            for k in 0..N {
                out_strides[k].push(strides[k][d]);
            }
        }
    }
    (out_shape, out_strides)
}

/// Calls `f(linear_index, offsets, run_len)` for every run along the innermost dim covering
/// row-major linear indices `start..end`. Offsets are in elements, one per operand.
pub fn for_runs<const N: usize>(
    shape: &[usize],
    strides: &[Vec<isize>; N],
    start: usize,
    end: usize,
    mut f: impl FnMut(usize, [isize; N], usize),
) {
    if start >= end {
        return;
    }
    let r = shape.len();
    if r == 0 {
        f(0, [0; N], 1);
        return;
    }
    // The index on the stack for the ranks programs have: a reduction calls this once per
    // output, and a heap allocation each time was most of a short row's cost.
    let (mut on_stack, mut on_heap) = ([0usize; 16], Vec::new());
    let idx: &mut [usize] = if r <= on_stack.len() {
        &mut on_stack[..r]
    } else {
        on_heap.resize(r, 0);
        &mut on_heap
    };
    let mut rem = start;
    for d in (0..r).rev() {
        idx[d] = rem % shape[d];
        rem /= shape[d];
    }
    let mut offs = [0isize; N];
    for (k, o) in offs.iter_mut().enumerate() {
        *o = (0..r).map(|d| idx[d] as isize * strides[k][d]).sum();
    }
    let inner = shape[r - 1];
    let mut lin = start;
    while lin < end {
        let len = (inner - idx[r - 1]).min(end - lin);
        f(lin, offs, len);
        lin += len;
        idx[r - 1] += len;
        for (k, o) in offs.iter_mut().enumerate() {
            *o += len as isize * strides[k][r - 1];
        }
        if idx[r - 1] < inner {
            continue;
        }
        for (k, o) in offs.iter_mut().enumerate() {
            *o -= inner as isize * strides[k][r - 1];
        }
        idx[r - 1] = 0;
        for d in (0..r - 1).rev() {
            idx[d] += 1;
            for (k, o) in offs.iter_mut().enumerate() {
                *o += strides[k][d];
            }
            if idx[d] < shape[d] {
                break;
            }
            for (k, o) in offs.iter_mut().enumerate() {
                *o -= shape[d] as isize * strides[k][d];
            }
            idx[d] = 0;
        }
    }
}

/// Runs `body(start, chunk)` over chunks of `out`, in parallel when `out` is large.
pub fn chunked<B: Send>(out: &mut [B], body: impl Fn(usize, &mut [B]) + Sync) {
    let n = out.len();
    if n < PAR_MIN {
        body(0, out);
        return;
    }
    let chunk = (n / (par::threads() * 4)).max(PAR_MIN / 4);
    par::for_chunks_mut(out, chunk, body);
}

/// `out[i] = f(x[i])` over x's shape in row-major order (out is contiguous).
pub fn map1<A: Copy, B: Copy + Send>(x: &View<A>, out: &mut [B], f: impl Fn(A) -> B + Sync) {
    let (shape, st) = coalesce(&x.shape, [&x.strides]);
    if is_transpose(&shape, &st[0]) {
        return map1_tiles(x, &shape, &st[0], out, f);
    }
    chunked(out, |start, o| {
        for_runs(&shape, &st, start, start + o.len(), |lin, [ox], len| {
            let dst = &mut o[lin - start..lin - start + len];
            let s = st[0].last().copied().unwrap_or(1);
            if s == 1 {
                simd::map1(x.run(ox, len), dst, &f);
            } else {
                for (i, d) in dst.iter_mut().enumerate() {
                    *d = f(x.at(ox + i as isize * s));
                }
            }
        })
    });
}

/// Tiles of a transposed walk are `TILE`×`TILE` elements: the source lines a tile reads
/// (`TILE` of them, 64 elements each) stay in L1 while its rows are written.
const TILE: usize = 64;

/// Whether a walk over `shape` reads a transpose: the innermost dim strided, the one before
/// it unit-stride (a `linear` weight's `[N, K]` read as `[K, N]`). Walked element by
/// element, each read would touch a new cache line (and, for a large weight, a new page).
fn is_transpose(shape: &[usize], strides: &[isize]) -> bool {
    let r = shape.len();
    r >= 2
        && strides[r - 2] == 1
        && !matches!(strides[r - 1], 0 | 1)
        && shape[r - 1] >= 8
        && shape[r - 2] >= 8
}

/// `map1` over a transposed walk (`is_transpose`), by tiles: bands of `TILE` output rows
/// (rows of the last dim, across the leading dims), each band's columns `TILE` at a time.
fn map1_tiles<A: Copy, B: Copy + Send>(
    x: &View<A>,
    shape: &[usize],
    strides: &[isize],
    out: &mut [B],
    f: impl Fn(A) -> B + Sync,
) {
    let r = shape.len();
    let (cols, col_stride) = (shape[r - 1], strides[r - 1]);
    let rows = out.len() / cols;
    // Source offset of each output row: its leading index's offset plus its row (stride 1).
    let row_offsets = |first: usize, n: usize| -> Vec<isize> {
        let lead = [strides[..r - 1].to_vec()];
        let mut offs = Vec::with_capacity(n);
        for_runs(&shape[..r - 1], &lead, first, first + n, |_, [o], len| {
            offs.extend((0..len as isize).map(|i| o + i));
        });
        offs
    };
    let band = |start: usize, o: &mut [B]| {
        let first = start / cols;
        let offs = row_offsets(first, o.len() / cols);
        for c0 in (0..cols).step_by(TILE) {
            let c1 = (c0 + TILE).min(cols);
            for (row, &base) in offs.iter().enumerate() {
                let dst = &mut o[row * cols + c0..row * cols + c1];
                let mut at = base + c0 as isize * col_stride;
                for d in dst {
                    *d = f(x.at(at));
                    at += col_stride;
                }
            }
        }
    };
    let band_len = TILE * cols;
    if out.len() < PAR_MIN || rows <= TILE {
        for (i, o) in out.chunks_mut(band_len).enumerate() {
            band(i * band_len, o);
        }
    } else {
        par::for_chunks_mut(out, band_len, band);
    }
}

/// As `map1` with a kernel over whole slices: `f(xs, outs)` maps each unit-stride run of x
/// (strided runs are gathered into a small buffer first).
pub fn map1_slices<A: Copy + Default, B: Copy + Send>(
    x: &View<A>,
    out: &mut [B],
    f: impl Fn(&[A], &mut [B]) + Sync,
) {
    const GATHER: usize = 256;
    let (shape, st) = coalesce(&x.shape, [&x.strides]);
    chunked(out, |start, o| {
        for_runs(&shape, &st, start, start + o.len(), |lin, [ox], len| {
            let dst = &mut o[lin - start..lin - start + len];
            let s = st[0].last().copied().unwrap_or(1);
            if s == 1 {
                f(x.run(ox, len), dst);
            } else {
                let mut buf = [A::default(); GATHER];
                for (p, d) in dst.chunks_mut(GATHER).enumerate() {
                    let first = ox + (p * GATHER) as isize * s;
                    for (i, b) in buf[..d.len()].iter_mut().enumerate() {
                        *b = x.at(first + i as isize * s);
                    }
                    f(&buf[..d.len()], d);
                }
            }
        })
    });
}

/// `out[i] = f(x[i], y[i])`; x and y have out's shape.
pub fn map2<A: Copy, B: Copy, C: Copy + Send>(
    x: &View<A>,
    y: &View<B>,
    out: &mut [C],
    f: impl Fn(A, B) -> C + Sync,
) {
    let (shape, st) = coalesce(&x.shape, [&x.strides, &y.strides]);
    chunked(out, |start, o| {
        for_runs(&shape, &st, start, start + o.len(), |lin, [ox, oy], len| {
            let dst = &mut o[lin - start..lin - start + len];
            let sx = st[0].last().copied().unwrap_or(1);
            let sy = st[1].last().copied().unwrap_or(1);
            if sx == 1 && sy == 1 {
                simd::map2(x.run(ox, len), y.run(oy, len), dst, &f);
            } else if sx == 1 && sy == 0 {
                let b = y.at(oy);
                simd::map1(x.run(ox, len), dst, |a| f(a, b));
            } else if sx == 0 && sy == 1 {
                let a = x.at(ox);
                simd::map1(y.run(oy, len), dst, |b| f(a, b));
            } else {
                for (i, d) in dst.iter_mut().enumerate() {
                    let i = i as isize;
                    *d = f(x.at(ox + i * sx), y.at(oy + i * sy));
                }
            }
        })
    });
}

/// `out[i] = f(x[i], y[i], z[i])`; all have out's shape.
pub fn map3<A: Copy, B: Copy, C: Copy, D: Copy + Send>(
    x: &View<A>,
    y: &View<B>,
    z: &View<C>,
    out: &mut [D],
    f: impl Fn(A, B, C) -> D + Sync,
) {
    let (shape, st) = coalesce(&x.shape, [&x.strides, &y.strides, &z.strides]);
    chunked(out, |start, o| {
        for_runs(
            &shape,
            &st,
            start,
            start + o.len(),
            |lin, [ox, oy, oz], len| {
                let dst = &mut o[lin - start..lin - start + len];
                let sx = st[0].last().copied().unwrap_or(1);
                let sy = st[1].last().copied().unwrap_or(1);
                let sz = st[2].last().copied().unwrap_or(1);
                for (i, d) in dst.iter_mut().enumerate() {
                    let i = i as isize;
                    *d = f(x.at(ox + i * sx), y.at(oy + i * sy), z.at(oz + i * sz));
                }
            },
        )
    });
}

/// Copies `src` into the region of `dst` that starts at `dst_offset` and has src's shape with
/// `dst_strides`. The region must lie inside `dst` (checked).
pub fn copy_into<T: Copy>(src: &View<T>, dst: &mut [T], dst_offset: usize, dst_strides: &[isize]) {
    let n = src.numel();
    if n == 0 {
        return;
    }
    let (shape, st) = coalesce(&src.shape, [&src.strides, dst_strides]);
    for_runs(&shape, &st, 0, n, |_, [os, od], len| {
        let ss = st[0].last().copied().unwrap_or(1);
        let sd = st[1].last().copied().unwrap_or(1);
        if ss == 1 && sd == 1 {
            // Contiguous on both sides (a KV cache's rows): one bounds-checked block copy.
            let j = (dst_offset as isize + od) as usize;
            dst[j..j + len].copy_from_slice(src.run(os, len));
            return;
        }
        for i in 0..len as isize {
            let j = (dst_offset as isize + od + i * sd) as usize;
            dst[j] = src.at(os + i * ss);
        }
    });
}

/// Offsets of every index of the leading `shape` dims, for each operand's strides.
pub fn batch_offsets<const N: usize>(shape: &[usize], strides: [&[isize]; N]) -> Vec<[isize; N]> {
    let n: usize = shape.iter().product();
    let st: [Vec<isize>; N] = std::array::from_fn(|k| strides[k][..shape.len()].to_vec());
    let mut out = Vec::with_capacity(n);
    for_runs(shape, &st, 0, n, |_, offs, len| {
        for i in 0..len as isize {
            out.push(std::array::from_fn(|k| {
                offs[k] + i * st[k].last().copied().unwrap_or(0)
            }));
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use crate::buffer::Val;
    use crate::kernels::movement::permute;
    use ember_core::dtype::DType;

    /// `shape` filled with 0, 1, 2, … (as f32).
    fn counting(shape: &[usize]) -> Val {
        Val::build::<f32>(DType::F32, shape, |out| {
            for (i, o) in out.iter_mut().enumerate() {
                *o = i as f32;
            }
            Ok(())
        })
        .unwrap()
    }

    /// Transposes copied by tiles (`map1_tiles`) hold what element-by-element indexing
    /// reads: bands crossing leading dims, edges of partial tiles, bands split in chunks.
    #[test]
    fn a_transposed_copy_by_tiles_matches_indexing() {
        for (shape, perm) in [
            (vec![9, 8], vec![1, 0]),
            (vec![257, 300], vec![1, 0]),
            (vec![3, 70, 130], vec![0, 2, 1]),
            (vec![5, 67, 3, 11], vec![3, 1, 2, 0]),
            (vec![2, 64, 65], vec![1, 2, 0]),
        ] {
            let x = counting(&shape);
            let t = permute(&x, &perm).unwrap();
            let got = t.to_vec::<f32>().unwrap();
            let out_shape: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
            let strides = crate::buffer::Layout::contiguous(&shape).strides;
            let mut idx = vec![0usize; out_shape.len()];
            for (lin, g) in got.iter().enumerate() {
                let mut rem = lin;
                for d in (0..out_shape.len()).rev() {
                    idx[d] = rem % out_shape[d];
                    rem /= out_shape[d];
                }
                let src: isize = (0..idx.len())
                    .map(|d| idx[d] as isize * strides[perm[d]])
                    .sum();
                assert_eq!(*g, src as f32, "{shape:?} by {perm:?} at {lin}");
            }
        }
    }
}
