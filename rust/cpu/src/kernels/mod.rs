//! The kernels, by op family, and the row helpers several of them share.

#[cfg(target_arch = "x86_64")]
pub mod amx_bf16;
#[cfg(target_arch = "x86_64")]
mod amx_tiles;
pub mod attention;
#[cfg(target_arch = "x86_64")]
pub mod bf16_kernel;
#[cfg(target_arch = "x86_64")]
pub mod bf16_pairs;
pub mod block_quant_dot;
pub mod chain;
pub mod conv;
pub mod dot;
pub mod elementwise;
pub mod fused;
pub mod index;
pub mod integer_dot;
pub mod movement;
pub mod norm;
pub mod pool;
pub mod reduce;
pub mod rowdot;
pub mod sgemm;
#[cfg(test)]
pub(crate) mod testing;
pub mod window;

use crate::buffer::{Layout, Val, View};
use crate::error::KResult;
use crate::par;
use crate::strided::{batch_offsets, PAR_MIN};

/// The permutation that moves `axis` last, keeping the other dims in order.
pub fn axis_last_perm(rank: usize, axis: usize) -> Vec<usize> {
    let mut perm: Vec<usize> = (0..rank).filter(|&d| d != axis).collect();
    perm.push(axis);
    perm
}

/// A contiguous value whose dims are the original dims permuted by `perm`, seen again in
/// the original order (a strided view, no copy).
pub fn unpermute(val: Val, perm: &[usize]) -> KResult<Val> {
    let mut layout = Layout {
        shape: vec![0; perm.len()],
        strides: vec![0; perm.len()],
        offset: val.layout.offset,
    };
    for (i, &p) in perm.iter().enumerate() {
        layout.shape[p] = val.layout.shape[i];
        layout.strides[p] = val.layout.strides[i];
    }
    val.with_layout(layout)
}

/// Calls `body(row, out_row)` for every row of `v` along its last dim (rows in row-major order
/// of the other dims); `out` holds equal chunks for the rows, back to back. Rows are contiguous slices (copied
/// when the last dim is strided). Runs in parallel when the work is large.
pub fn for_rows<T: Copy + Send + Sync, R: Send>(
    v: &View<T>,
    out: &mut [R],
    body: impl Fn(&[T], &mut [R]) + Sync,
) {
    let r = v.shape.len();
    let (len, stride) = match r {
        0 => (1, 1),
        _ => (v.shape[r - 1], v.strides[r - 1]),
    };
    let outer = r.saturating_sub(1);
    let bases = batch_offsets(&v.shape[..outer], [&v.strides[..outer]]);
    if len == 0 || bases.is_empty() || out.len() < bases.len() {
        return;
    }
    let per = out.len() / bases.len();
    let run = |base: isize, o: &mut [R], tmp: &mut Vec<T>| {
        if stride == 1 {
            body(v.run(base, len), o);
        } else {
            tmp.clear();
            tmp.extend((0..len as isize).map(|j| v.at(base + j * stride)));
            body(tmp, o);
        }
    };
    if out.len() >= PAR_MIN && bases.len() > 1 {
        // A few chunks of whole rows per thread, each at least PAR_MIN / 4 elements.
        let rows = bases.len();
        let min_rows = (PAR_MIN / 4).div_ceil(per.max(1));
        let rows_per = rows.div_ceil(par::threads() * 4).max(min_rows).max(1);
        par::for_chunks_mut(&mut out[..rows * per], rows_per * per, |start, o| {
            let mut tmp = Vec::new();
            let first = start / per;
            for (o, b) in o.chunks_mut(per).zip(&bases[first..]) {
                run(b[0], o, &mut tmp);
            }
        });
    } else {
        let mut tmp = Vec::new();
        for (o, b) in out.chunks_mut(per).zip(&bases) {
            run(b[0], o, &mut tmp);
        }
    }
}
