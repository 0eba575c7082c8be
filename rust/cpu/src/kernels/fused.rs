//! The fused elementwise kernel: a group (see `fuse.rs`) evaluated block by block over its
//! contiguous output. Each block of every leaf is read once (in place when the leaf is
//! contiguous, else gathered into a small scratch slot), each step writes its block to a
//! scratch slot that stays in L1, and the root writes straight into the output. The steps
//! run the closures of `elementwise.rs`, so every node rounds exactly as it does unfused.

use std::marker::PhantomData;

use ember_core::dtype::DType;
use ember_core::ir::{BinaryOp, Graph, Op, UnaryOp};

use super::chain::{self, Chain, Run};
use super::elementwise::{binary_with, cast_with, unary_with, where_with, Apply1, Apply2, Apply3};
use crate::arena::Dest;
use crate::buffer::Val;
use crate::elem::halfconv;
use crate::elem::vecmath::{Fma, Kernel};
use crate::error::{CpuError, KResult};
use crate::fuse::Group;
use crate::par;
use crate::scratch::with_scratch;
use crate::simd;
use crate::strided::{coalesce, for_runs, PAR_MIN};

/// Elements per block: a slot of the widest dtype is 4 KiB.
const BLOCK: usize = 512;

/// Scratch slots past a group's own for f16 steps computed in f32: two operand blocks and a
/// result block of f32 (`apply`), 6 KiB of these 8.
const WIDE_SLOTS: usize = 2;

/// Where a leaf's block comes from.
enum Kind {
    /// Unit stride over the whole output: read in place.
    Contiguous,
    /// One element broadcast everywhere: filled once per task.
    Scalar,
    /// Unit stride along rows of at least a block (a broadcast row, a slice of wider rows):
    /// a block inside one row is read in place, one that crosses rows is gathered.
    Rows,
    Strided,
}

struct Leaf {
    ptr: *const u8,
    size: usize,
    shape: Vec<usize>,
    strides: [Vec<isize>; 1],
    kind: Kind,
}

impl Leaf {
    /// The address of elements `at..at + len` (row-major) when they lie in one unit-stride
    /// row of the leaf.
    fn in_one_row(&self, at: usize, len: usize) -> Option<*const u8> {
        let row = *self.shape.last()?;
        if row == 0 || at / row != (at + len - 1) / row {
            return None;
        }
        let (mut rest, mut offset) = (at, 0isize);
        for (&d, &s) in self.shape.iter().zip(&self.strides[0]).rev() {
            offset += (rest % d) as isize * s;
            rest /= d;
        }
        Some(self.ptr.wrapping_offset(offset * self.size as isize))
    }
}

/// Raw pointers shared by the tasks (each writes its own disjoint range of the output).
struct Shared {
    leaves: Vec<Leaf>,
    out: *mut u8,
}

// SAFETY: leaves are read-only memory kept alive by `Val`s held for the whole call; the
// output is written at disjoint ranges by different tasks.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

/// A group's blocked pass into `dest` (`head`, if any, is the value viewing `dest`, where
/// the head kernel writes; `leaves[i]` is the value of leaf i, `None` for the head's leaf),
/// prepared once per call: `all` runs it over the whole output, `range` over part of it,
/// so a head kernel (conv) can run it on the outputs it has just written while they are
/// still in cache.
pub struct Pass<'a> {
    g: &'a Graph,
    grp: &'a Group,
    /// Pointers into the leaves' values (and `dest`), which `'a` keeps alive.
    shared: Shared,
    out_size: usize,
    n: usize,
    values: PhantomData<&'a Val>,
}

impl<'a> Pass<'a> {
    /// The pass of `grp` into `dest`. The head's values are read only when a range runs, so
    /// the head may be written into `dest` after this.
    pub fn new(
        g: &'a Graph,
        grp: &'a Group,
        leaves: &[Option<&'a Val>],
        head: Option<&'a Val>,
        dest: &mut Dest,
    ) -> KResult<Pass<'a>> {
        let n = dest.numel();
        let mut prepared = Vec::with_capacity(leaves.len());
        for (i, v) in leaves.iter().enumerate() {
            let is_head = v.is_none();
            let v = match (v, head) {
                (Some(v), _) => *v,
                (None, Some(h)) => h,
                (None, None) => return Err(CpuError::Internal(format!("leaf {i} has no value"))),
            };
            if v.numel() != n {
                return Err(CpuError::Shape(format!(
                    "fused operand {:?} does not match the output {:?}",
                    v.shape(),
                    dest.shape
                )));
            }
            let size = v.dtype.size();
            let (shape, strides) = coalesce(v.shape(), [&v.layout.strides]);
            let kind = if strides[0].iter().all(|&s| s == 0) {
                Kind::Scalar
            } else if !is_head && shape.len() == 1 && strides[0][0] == 1 {
                Kind::Contiguous
            } else if !is_head && strides[0].last() == Some(&1) && shape[shape.len() - 1] >= BLOCK {
                Kind::Rows
            } else {
                Kind::Strided
            };
            prepared.push(Leaf {
                ptr: v
                    .storage
                    .ptr()
                    .wrapping_add(v.layout.offset as usize * size),
                size,
                shape,
                strides,
                kind,
            });
        }
        Ok(Pass {
            g,
            grp,
            shared: Shared {
                leaves: prepared,
                out: dest.ptr(),
            },
            out_size: dest.dtype.size(),
            n,
            values: PhantomData,
        })
    }

    /// Whether the whole pass is a ReLU of the head's result (`max(x, 0)` elementwise, in
    /// place), which a head kernel may apply to its sums before storing them instead.
    pub fn is_relu_of_head(&self) -> bool {
        let (Some(head), [step]) = (&self.grp.head, &self.grp.steps[..]) else {
            return false;
        };
        let slot = self.grp.leaves.iter().position(|&l| l == head.leaf);
        matches!(self.g.nodes[step.node].op, Op::Unary(UnaryOp::Relu))
            && slot.is_some_and(|i| step.args == [i])
    }

    /// The other operand `r` when the whole pass is `relu(head + r)` (either order) with `r`
    /// a contiguous f32 value the size of the output, which a conv kernel may add to its
    /// sums before the clamp (a residual block's second conv).
    pub fn relu_of_head_plus(&self) -> Option<&[f32]> {
        let (Some(head), [add, relu]) = (&self.grp.head, &self.grp.steps[..]) else {
            return None;
        };
        let h = self.grp.leaves.iter().position(|&l| l == head.leaf)?;
        let is_add = matches!(self.g.nodes[add.node].op, Op::Binary(BinaryOp::Add));
        let is_relu = matches!(self.g.nodes[relu.node].op, Op::Unary(UnaryOp::Relu));
        let r = match add.args[..] {
            [a, b] if a == h => b,
            [a, b] if b == h => a,
            _ => return None,
        };
        let leaf = self.shared.leaves.get(r)?;
        let f32_everywhere = [add.node, relu.node, self.grp.leaves[r]]
            .iter()
            .all(|&i| self.g.nodes[i].ty.dtype == DType::F32);
        if !is_add || !is_relu || relu.args != [add.out] || r == h || !f32_everywhere {
            return None;
        }
        if !matches!(leaf.kind, Kind::Contiguous) {
            return None;
        }
        // SAFETY: a contiguous leaf covers the n elements of the output from `ptr`, and its
        // value outlives the pass ('a, which outlives &self).
        Some(unsafe { std::slice::from_raw_parts(leaf.ptr as *const f32, self.n) })
    }

    /// Elements of the output.
    pub fn len(&self) -> usize {
        self.n
    }

    /// Runs the pass over output elements `start..end` on this thread. Ranges run by
    /// different threads must not overlap.
    pub fn range(&self, start: usize, end: usize) -> KResult<()> {
        if start >= end {
            return Ok(());
        }
        if end > self.n {
            return Err(CpuError::Internal("fused range past the output".into()));
        }
        with_scratch((self.grp.slots + WIDE_SLOTS) * BLOCK, |base| {
            self.blocks(start, end, base)
        })
    }

    fn blocks(&self, start: usize, end: usize, base: *mut u64) -> KResult<()> {
        let shared = &self.shared;
        let slot = |s: usize| base.wrapping_add(s * BLOCK) as *mut u8;
        for (i, l) in shared.leaves.iter().enumerate() {
            if let Kind::Scalar = l.kind {
                // SAFETY: the leaf's element 0 is readable (n > 0); the slot holds BLOCK elements.
                unsafe { fill(l, slot(i)) };
            }
        }
        let mut ptrs: Vec<*const u8> = (0..self.grp.slots).map(|s| slot(s) as *const u8).collect();
        let wide = slot(self.grp.slots) as *mut f32;
        let mut at = start;
        while at < end {
            let len = BLOCK.min(end - at);
            for (i, l) in shared.leaves.iter().enumerate() {
                match l.kind {
                    Kind::Contiguous => ptrs[i] = l.ptr.wrapping_add(at * l.size),
                    Kind::Scalar => {}
                    Kind::Rows => {
                        ptrs[i] = match l.in_one_row(at, len) {
                            Some(p) => p,
                            None => {
                                // SAFETY: as for `Strided` below.
                                unsafe { gather(l, at, len, slot(i)) };
                                slot(i)
                            }
                        }
                    }
                    // SAFETY: the leaf covers the output's n elements; the slot holds BLOCK.
                    Kind::Strided => unsafe { gather(l, at, len, slot(i)) },
                }
            }
            for run in &self.grp.runs {
                let last = match run {
                    Run::Step(k) | Run::Chain(Chain { last: k, .. }) => &self.grp.steps[*k],
                };
                let dst = if last.out == usize::MAX {
                    shared.out.wrapping_add(at * self.out_size)
                } else {
                    slot(last.out)
                };
                match run {
                    Run::Step(_) => apply(self.g, last.node, &last.args, &ptrs, (dst, wide), len)?,
                    // SAFETY: chains are planned only where they run; every slot holds this
                    // block's `len` elements of its dtype and `dst` has room for `len`.
                    Run::Chain(c) => unsafe { chain::run(c, &ptrs, dst, len) },
                }
            }
            at += len;
        }
        Ok(())
    }

    /// Runs the pass over the whole output, split over threads when it is worth it.
    pub fn all(&self) -> KResult<()> {
        let n = self.n;
        if n == 0 {
            return Ok(());
        }
        // Transcendental steps cost several cheap ones, so such groups go parallel (and
        // split finer) at fewer elements: offering chunks costs the caller a few µs at most
        // (`par.rs`).
        let cost: usize = self
            .grp
            .steps
            .iter()
            .map(|s| step_cost(&self.g.nodes[s.node].op))
            .sum();
        let cost = cost.max(1);
        if n.saturating_mul(cost) < PAR_MIN {
            return self.range(0, n);
        }
        let chunk = (n / (par::threads() * 4))
            .max(PAR_MIN / 4 / cost)
            .next_multiple_of(BLOCK);
        par::try_for_each(n.div_ceil(chunk), |t| {
            self.range(t * chunk, ((t + 1) * chunk).min(n))
        })
    }
}

/// Rough cost of one element of an op, in cheap arithmetic ops (a polynomial transcendental
/// is a few dozen instructions; add/mul/compare one).
fn step_cost(op: &Op) -> usize {
    use ember_core::ir::{BinaryOp as B, UnaryOp as U};
    match op {
        Op::Unary(
            U::Exp
            | U::Expm1
            | U::Log
            | U::Log1p
            | U::Sin
            | U::Cos
            | U::Tan
            | U::Tanh
            | U::Sigmoid
            | U::Erf
            | U::Gelu
            | U::GeluTanh
            | U::Silu,
        )
        | Op::Binary(B::Pow | B::Atan2) => 8,
        _ => 1,
    }
}

/// Runs `$body` with `$U` an unsigned type of `$size` bytes.
macro_rules! with_bytes {
    ($size:expr, $U:ident => $body:expr) => {
        match $size {
            1 => {
                type $U = u8;
                $body
            }
            2 => {
                type $U = u16;
                $body
            }
            4 => {
                type $U = u32;
                $body
            }
            _ => {
                type $U = u64;
                $body
            }
        }
    };
}

/// Copies one element to the whole slot.
///
/// # Safety
/// `l.ptr` must be readable; `dst` must hold BLOCK elements of `l.size` bytes.
unsafe fn fill(l: &Leaf, dst: *mut u8) {
    with_bytes!(l.size, U => {
        // SAFETY: by the contract.
        unsafe {
            let v = *(l.ptr as *const U);
            std::slice::from_raw_parts_mut(dst as *mut U, BLOCK).fill(v);
        }
    })
}

/// Gathers elements `at..at + len` (row-major) of a strided leaf into `dst`.
///
/// # Safety
/// The leaf's layout must be readable (a checked `Val`); `dst` must hold `len` elements.
unsafe fn gather(l: &Leaf, at: usize, len: usize, dst: *mut u8) {
    with_bytes!(l.size, U => {
        let src = l.ptr as *const U;
        let dst = dst as *mut U;
        let s = l.strides[0].last().copied().unwrap_or(1);
        for_runs(&l.shape, &l.strides, at, at + len, |lin, [o], run| {
            // SAFETY: offsets come from walking the leaf's checked layout; `lin - at < len`.
            unsafe {
                let d = dst.add(lin - at);
                if s == 1 {
                    std::ptr::copy_nonoverlapping(src.offset(o), d, run);
                } else if s == 0 {
                    // Broadcast along the run (a per-row scale): one value, filled wide.
                    std::slice::from_raw_parts_mut(d, run).fill(*src.offset(o));
                } else {
                    for i in 0..run {
                        *d.add(i) = *src.offset(o + i as isize * s);
                    }
                }
            }
        })
    })
}

/// Runs node `id` of the graph over one block; its operands are `slots[args[k]]`. `wide`:
/// scratch for three blocks of f32, apart from every slot.
fn apply(
    g: &Graph,
    id: usize,
    args: &[usize],
    slots: &[*const u8],
    (dst, wide): (*mut u8, *mut f32),
    len: usize,
) -> KResult<()> {
    let node = &g.nodes[id];
    let dt = |k: usize| g.nodes[node.inputs[k]].ty.dtype;
    let arg = |k: usize| {
        args.get(k)
            .map(|&a| slots[a])
            .ok_or_else(|| CpuError::Internal(format!("{} lacks operand {k}", node.op.name())))
    };
    let src1 = || Ok::<_, CpuError>([arg(0)?]);
    // f16 arithmetic as the f32 op between whole-vector conversions (F16C): the f16 closures
    // compute in f32 and round once, exactly this, but convert element by element (~10
    // instructions each way). Not for ops with an f32 vector kernel, whose approximation
    // differs in the last f32 bit from the element-wise one the f16 closure runs.
    let f16_in_f32 = node.ty.dtype == DType::F16
        && match &node.op {
            Op::Binary(_) => dt(0) == DType::F16 && dt(1) == DType::F16,
            Op::Unary(u) => dt(0) == DType::F16 && Kernel::of(*u).is_none(),
            _ => false,
        }
        && halfconv::f16_vectors();
    if f16_in_f32 && len <= BLOCK {
        // SAFETY: `wide` holds three blocks of f32 (scratch: any bits are a value) that no
        // operand or destination overlaps.
        let [a, b, out] =
            [0, 1, 2].map(|i| unsafe { std::slice::from_raw_parts_mut(wide.add(i * BLOCK), len) });
        for (k, buf) in [&mut *a, &mut *b]
            .into_iter()
            .enumerate()
            .take(node.inputs.len())
        {
            // SAFETY: operand k is a block of `len` f16 (see `Block`).
            let x = unsafe { std::slice::from_raw_parts(arg(k)? as *const half::f16, len) };
            halfconv::widen_f16(x, buf);
        }
        let (dst_wide, src) = (out.as_mut_ptr() as *mut u8, [a.as_ptr(), b.as_ptr()]);
        let src = src.map(|p| p as *const u8);
        match &node.op {
            Op::Unary(u) => unary_with(
                *u,
                DType::F32,
                Block {
                    src: [src[0]],
                    dst: dst_wide,
                    len,
                },
            ),
            Op::Binary(op) => binary_with(
                *op,
                DType::F32,
                Block {
                    src,
                    dst: dst_wide,
                    len,
                },
            ),
            op => Err(CpuError::Internal(format!("{} computed in f32", op.name()))),
        }?;
        // SAFETY: `dst` is a slot of `len` f16 (see `Block`).
        let o = unsafe { std::slice::from_raw_parts_mut(dst as *mut half::f16, len) };
        halfconv::narrow_f16(out, o);
        return Ok(());
    }
    match &node.op {
        Op::Unary(u) => unary_with(
            *u,
            dt(0),
            Block {
                src: src1()?,
                dst,
                len,
            },
        ),
        // f16 ↔ f32 by whole vectors (F16C) where the CPU converts them: the same values.
        Op::Cast { to: DType::F32 } if dt(0) == DType::F16 && halfconv::f16_vectors() => {
            // SAFETY: operand 0 is a block of `len` f16 and `dst` a slot of `len` f32, as
            // every step's (see `Block`).
            let (x, o) = unsafe {
                let x = std::slice::from_raw_parts(arg(0)? as *const half::f16, len);
                (x, std::slice::from_raw_parts_mut(dst as *mut f32, len))
            };
            halfconv::widen_f16(x, o);
            Ok(())
        }
        Op::Cast { to: DType::F16 } if dt(0) == DType::F32 && halfconv::f16_vectors() => {
            // SAFETY: as above, the other way.
            let (x, o) = unsafe {
                let x = std::slice::from_raw_parts(arg(0)? as *const f32, len);
                (
                    x,
                    std::slice::from_raw_parts_mut(dst as *mut half::f16, len),
                )
            };
            halfconv::narrow_f16(x, o);
            Ok(())
        }
        Op::Cast { to } => cast_with(
            dt(0),
            *to,
            Block {
                src: src1()?,
                dst,
                len,
            },
        ),
        Op::Binary(b) => {
            let src = [arg(0)?, arg(1)?];
            binary_with(*b, dt(0), Block { src, dst, len })
        }
        Op::Where => {
            let src = [arg(0)?, arg(1)?, arg(2)?];
            where_with(dt(1), Block { src, dst, len })
        }
        op => Err(CpuError::Internal(format!(
            "{} in a fused group",
            op.name()
        ))),
    }
}

/// One block of an op: `len` elements per operand, written to `dst` (never an operand).
struct Block<const N: usize> {
    src: [*const u8; N],
    dst: *mut u8,
    len: usize,
}

impl<const N: usize> Block<N> {
    /// # Safety
    /// The pointers must address `len` elements of T, aligned, and `dst` alias no operand.
    unsafe fn parts<T>(&self, k: usize) -> &[T] {
        // SAFETY: by the contract.
        unsafe { std::slice::from_raw_parts(self.src[k] as *const T, self.len) }
    }
    /// # Safety
    /// As `parts`.
    #[allow(clippy::mut_from_ref)]
    unsafe fn out<T>(&self) -> &mut [T] {
        // SAFETY: by the contract.
        unsafe { std::slice::from_raw_parts_mut(self.dst as *mut T, self.len) }
    }
}

// SAFETY (the three impls): operands are leaf blocks (in place or gathered) or scratch slots
// of `len` ≤ BLOCK elements of the operand's dtype, and `dst` is a scratch slot or the
// output block; the planner never gives a step an output slot that one of its operands uses,
// and head leaves (which live in the output) are always gathered.
impl Apply1 for Block<1> {
    type Out = ();
    fn apply<A: Copy + Send + Sync, B: Copy + Send + Sync>(
        self,
        _: DType,
        f: impl Fn(A) -> B + Sync,
    ) -> KResult<()> {
        let (x, o) = unsafe { (self.parts::<A>(0), self.out::<B>()) };
        simd::map1(x, o, f);
        Ok(())
    }

    fn apply_kernel(self, kernel: Kernel, fma: Fma) -> KResult<()> {
        let (x, o) = unsafe { (self.parts::<f32>(0), self.out::<f32>()) };
        fma.run(kernel, x, o);
        Ok(())
    }
}

impl Apply2 for Block<2> {
    type Out = ();
    fn apply<A: Copy + Send + Sync, B: Copy + Send + Sync, C: Copy + Send + Sync>(
        self,
        _: DType,
        f: impl Fn(A, B) -> C + Sync,
    ) -> KResult<()> {
        let (x, y, o) = unsafe { (self.parts::<A>(0), self.parts::<B>(1), self.out::<C>()) };
        simd::map2(x, y, o, f);
        Ok(())
    }
}

impl Apply3 for Block<3> {
    type Out = ();
    fn apply<
        A: Copy + Send + Sync,
        B: Copy + Send + Sync,
        C: Copy + Send + Sync,
        D: Copy + Send + Sync,
    >(
        self,
        _: DType,
        f: impl Fn(A, B, C) -> D + Sync,
    ) -> KResult<()> {
        let (x, y, z, o) = unsafe {
            (
                self.parts::<A>(0),
                self.parts::<B>(1),
                self.parts::<C>(2),
                self.out::<D>(),
            )
        };
        simd::map3(x, y, z, o, f);
        Ok(())
    }
}
