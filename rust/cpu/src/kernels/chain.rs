//! Runs of a fused group's steps evaluated in registers. Where each step of a run feeds only
//! the next, the run loads its operands 16 lanes at a time, applies every op to the vector
//! and stores once. The step-by-step pass (`fused.rs`) stores every intermediate block to
//! an L1 slot and loads it again: on a CPU that stores one vector per cycle (AMD Zen 4),
//! that store was most of an op's cost, and a ten-op requantizing pass of a quantized model
//! ran no faster fused than unfused.
//!
//! AVX-512 only. Each op is the IEEE operation, or the conversion, that the step closures of
//! `elementwise.rs` compute (NaN handling, saturation and wrapping included), so a chain's
//! results are those of its steps bit for bit (a NaN's payload and sign aside, which LLVM
//! keeps in the steps no more than here); `tests/fusion.rs` checks this against the
//! unfused program.

use ember_core::dtype::DType;
use ember_core::ir::{BinaryOp, Graph, Op, UnaryOp};

use crate::elem::vecmath::Kernel;
use crate::fuse::Step;

/// How a chain holds 16 elements in a 512-bit register: f32 bits, or int32 (int8 and
/// uint8 values sign- and zero-extended).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lanes {
    F32,
    I32,
    I8,
    U8,
}

impl Lanes {
    fn of(dtype: DType) -> Option<Lanes> {
        match dtype {
            DType::F32 => Some(Lanes::F32),
            DType::I32 => Some(Lanes::I32),
            DType::I8 => Some(Lanes::I8),
            DType::U8 => Some(Lanes::U8),
            _ => None,
        }
    }
}

/// One op applied to the chain's value `v`, flattened so that each runs as one straight
/// loop over the vectors (a nested match was re-evaluated per vector). `o` is the slot of a
/// binary op's other operand; the `R` forms take the chain's value second (`o - v`).
#[derive(Clone, Copy, Debug)]
enum VecOp {
    AddF(usize),
    SubF(usize),
    RSubF(usize),
    MulF(usize),
    DivF(usize),
    RDivF(usize),
    MaxF(usize),
    RMaxF(usize),
    MinF(usize),
    RMinF(usize),
    AddI(usize),
    SubI(usize),
    RSubI(usize),
    MulI(usize),
    MaxI(usize),
    MinI(usize),
    Neg,
    Abs,
    Relu,
    Round,
    Floor,
    Ceil,
    Trunc,
    Sqrt,
    Recip,
    Rsqrt,
    /// A transcendental kernel of `elem::vecmath`, one vector at a time.
    Transcendental(Kernel),
    /// f32 to int32, saturating, NaN to 0.
    FloatToI32,
    /// Integer lanes to f32.
    IntToFloat,
    /// Integer lanes wrapped to int8 (sign-extended) or uint8 (zero-extended).
    WrapI8,
    WrapU8,
}

/// Consecutive steps of a group, up to step `last`, as one pass: the value of slot `input` through `ops`.
#[derive(Clone, Debug)]
pub struct Chain {
    pub last: usize,
    input: usize,
    input_lanes: Lanes,
    ops: Vec<VecOp>,
    out_lanes: Lanes,
}

/// How a group's steps run: one by one, or a chain of several.
#[derive(Clone, Debug)]
pub enum Run {
    Step(usize),
    Chain(Chain),
}

/// Whether chains run on this CPU (AVX-512 F, BW and VL, unless turned off for
/// comparisons with `EMBER_CPU_AVX512=0`).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| {
            crate::simd::avx512_available()
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vl")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The runs of a group's `steps`: maximal chains of two or more steps where each step's
/// result is read only by the next step, once, and every op has a vector form here
/// (`consumers`: each node's readers in `g`).
pub fn runs(g: &Graph, consumers: &[Vec<usize>], steps: &[Step]) -> Vec<Run> {
    let n = steps.len();
    if !available() {
        return (0..n).map(Run::Step).collect();
    }
    let mut out = Vec::new();
    let mut k = 0;
    while k < n {
        let Some((input, input_lanes, first)) = start(g, &steps[k]) else {
            out.push(Run::Step(k));
            k += 1;
            continue;
        };
        let mut ops = first;
        let mut j = k;
        while j + 1 < n && feeds_only(consumers, &steps[j], &steps[j + 1]) {
            match link(g, &steps[j + 1], steps[j].out) {
                Some(more) => ops.extend(more),
                None => break,
            }
            j += 1;
        }
        match (j > k, Lanes::of(g.nodes[steps[j].node].ty.dtype)) {
            (true, Some(out_lanes)) => out.push(Run::Chain(Chain {
                last: j,
                input,
                input_lanes,
                ops,
                out_lanes,
            })),
            _ => out.extend((k..=j).map(Run::Step)),
        }
        k = j + 1;
    }
    out
}

/// Whether `prev`'s result is read by `next` alone (`consumers`: each node's readers), as
/// exactly one of its operands. (A step before the root is never a graph output: the
/// planner keeps outputs out of groups but as roots.)
fn feeds_only(consumers: &[Vec<usize>], prev: &Step, next: &Step) -> bool {
    consumers[prev.node] == [next.node] && next.args.iter().filter(|&&a| a == prev.out).count() == 1
}

/// `step` as the first ops of a chain: the slot and lanes it reads, and the ops.
fn start(g: &Graph, step: &Step) -> Option<(usize, Lanes, Vec<VecOp>)> {
    let input = *step.args.first()?;
    let ops = vector_ops(g, step, 0)?;
    Some((input, Lanes::of(operand_dtype(g, step, 0))?, ops))
}

/// `step` as the next ops of a chain whose value is in slot `value`.
fn link(g: &Graph, step: &Step, value: usize) -> Option<Vec<VecOp>> {
    let at = step.args.iter().position(|&a| a == value)?;
    vector_ops(g, step, at)
}

fn operand_dtype(g: &Graph, step: &Step, k: usize) -> DType {
    g.nodes[g.nodes[step.node].inputs[k]].ty.dtype
}

/// The vector form of `step` with the chain's value as operand `at`, if it has one (a
/// cast from f32 to an 8-bit integer is two: saturate to int32, then wrap).
fn vector_ops(g: &Graph, step: &Step, at: usize) -> Option<Vec<VecOp>> {
    use VecOp::*;
    let node = &g.nodes[step.node];
    let dtype = operand_dtype(g, step, at);
    let one = |op: VecOp| Some(vec![op]);
    match &node.op {
        // The steps run these as `vecmath` kernels wherever chains run (AVX-512 implies the
        // AVX2+FMA the kernels need), so the chain runs the same code.
        Op::Unary(u) if dtype == DType::F32 => one(match u {
            UnaryOp::Neg => Neg,
            UnaryOp::Abs => Abs,
            UnaryOp::Relu => Relu,
            UnaryOp::Round => Round,
            UnaryOp::Floor => Floor,
            UnaryOp::Ceil => Ceil,
            UnaryOp::Trunc => Trunc,
            UnaryOp::Sqrt => Sqrt,
            UnaryOp::Recip => Recip,
            UnaryOp::Rsqrt => Rsqrt,
            _ => Transcendental(Kernel::of(*u)?),
        }),
        Op::Cast { to } => {
            let (from, to) = (Lanes::of(dtype)?, Lanes::of(*to)?);
            let wrap = match to {
                Lanes::I8 => Some(WrapI8),
                Lanes::U8 => Some(WrapU8),
                _ => None,
            };
            match (from, to) {
                _ if from == to => None,
                (Lanes::F32, _) => Some([FloatToI32].into_iter().chain(wrap).collect()),
                (_, Lanes::F32) => one(IntToFloat),
                // int8/uint8 lanes are already int32 values.
                (_, Lanes::I32) => Some(Vec::new()),
                _ => wrap.map(|w| vec![w]),
            }
        }
        Op::Binary(b) if step.args.len() == 2 && operand_dtype(g, step, 1 - at) == dtype => {
            let o = step.args[1 - at];
            let first = at == 0;
            let op = match (dtype, b, first) {
                (DType::F32, BinaryOp::Add, _) => AddF(o),
                (DType::F32, BinaryOp::Mul, _) => MulF(o),
                (DType::F32, BinaryOp::Sub, true) => SubF(o),
                (DType::F32, BinaryOp::Sub, false) => RSubF(o),
                (DType::F32, BinaryOp::Div, true) => DivF(o),
                (DType::F32, BinaryOp::Div, false) => RDivF(o),
                (DType::F32, BinaryOp::Max, true) => MaxF(o),
                (DType::F32, BinaryOp::Max, false) => RMaxF(o),
                (DType::F32, BinaryOp::Min, true) => MinF(o),
                (DType::F32, BinaryOp::Min, false) => RMinF(o),
                (DType::I32, BinaryOp::Add, _) => AddI(o),
                (DType::I32, BinaryOp::Mul, _) => MulI(o),
                (DType::I32, BinaryOp::Sub, true) => SubI(o),
                (DType::I32, BinaryOp::Sub, false) => RSubI(o),
                (DType::I32, BinaryOp::Max, _) => MaxI(o),
                (DType::I32, BinaryOp::Min, _) => MinI(o),
                _ => return None,
            };
            one(op)
        }
        _ => None,
    }
}

/// Runs `chain` over `len` elements: operands at `slots[s]` (element 0 of the block), the
/// result to `dst`.
///
/// # Safety
/// `available()` must hold; every slot the chain reads must hold `len` elements of its
/// dtype and `dst` room for `len` of the chain's result. `dst` may be one of the slots
/// (each lane is read before it is written).
pub unsafe fn run(chain: &Chain, slots: &[*const u8], dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: this function's contract.
    unsafe {
        x86::run(chain, slots, dst, len)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (chain, slots, dst, len);
        unreachable!("chains are planned only where available() holds");
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Chain, Kernel, Lanes, VecOp};
    use crate::elem::vecmath::x86_512 as vm;

    /// Vectors per pass over the ops: enough independent work to hide each op's latency.
    const U: usize = 4;
    type Vals = [__m512i; U];

    #[inline(always)]
    fn masks(len: usize, at: usize) -> [u16; U] {
        let mut m = [0u16; U];
        for (u, m) in m.iter_mut().enumerate() {
            *m = crate::simd::first_lanes(len.saturating_sub(at + 16 * u));
        }
        m
    }

    // Plain loops, no closures: a closure is not compiled with the caller's target
    // features, so the intrinsics inside it would become calls. `FULL`: every lane of
    // the U vectors is an element (unmasked loads and stores, which AMD runs faster).
    #[inline(always)]
    unsafe fn load<const FULL: bool>(
        ptr: *const u8,
        lanes: Lanes,
        at: usize,
        m: &[u16; U],
    ) -> Vals {
        let mut v = [_mm512_setzero_si512(); U];
        for u in 0..U {
            let i = at + 16 * u;
            v[u] = match (lanes, FULL) {
                (Lanes::F32 | Lanes::I32, true) => _mm512_loadu_si512(ptr.add(4 * i) as *const _),
                (Lanes::F32 | Lanes::I32, false) => {
                    _mm512_maskz_loadu_epi32(m[u], ptr.add(4 * i) as *const i32)
                }
                (Lanes::I8 | Lanes::U8, _) => {
                    let bytes = match FULL {
                        true => _mm_loadu_si128(ptr.add(i) as *const _),
                        false => _mm_maskz_loadu_epi8(m[u], ptr.add(i) as *const i8),
                    };
                    match lanes {
                        Lanes::I8 => _mm512_cvtepi8_epi32(bytes),
                        _ => _mm512_cvtepu8_epi32(bytes),
                    }
                }
            };
        }
        v
    }

    #[inline(always)]
    unsafe fn store<const FULL: bool>(
        ptr: *mut u8,
        lanes: Lanes,
        at: usize,
        m: &[u16; U],
        v: &Vals,
    ) {
        for u in 0..U {
            let i = at + 16 * u;
            match (lanes, FULL) {
                (Lanes::F32 | Lanes::I32, true) => {
                    _mm512_storeu_si512(ptr.add(4 * i) as *mut _, v[u])
                }
                (Lanes::F32 | Lanes::I32, false) => {
                    _mm512_mask_storeu_epi32(ptr.add(4 * i) as *mut i32, m[u], v[u])
                }
                // Truncating: the values fit (8-bit lanes are kept extended). Narrowed in a
                // register, then stored: `vpmovdb` to memory is slow on AMD.
                (Lanes::I8 | Lanes::U8, true) => {
                    _mm_storeu_si128(ptr.add(i) as *mut _, _mm512_cvtepi32_epi8(v[u]))
                }
                (Lanes::I8 | Lanes::U8, false) => {
                    _mm_mask_storeu_epi8(ptr.add(i) as *mut i8, m[u], _mm512_cvtepi32_epi8(v[u]))
                }
            }
        }
    }

    /// `if p > q { p } else { q }` (`<` for the minimum), then a NaN p wins, as
    /// `binary_float::<f32>` computes Max and Min.
    #[inline(always)]
    unsafe fn pick<const CMP: i32>(p: __m512, q: __m512) -> __m512 {
        let m = _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<CMP>(p, q), q, p);
        _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_UNORD_Q>(p, p), m, p)
    }

    /// `x - 0`, as the slice kernels subtract their shift (0) before the op: the same for
    /// every x but a signaling NaN, which it quiets.
    #[inline(always)]
    unsafe fn unshifted(x: __m512) -> __m512 {
        _mm512_sub_ps(x, _mm512_setzero_ps())
    }

    #[inline(always)]
    fn f(v: __m512i) -> __m512 {
        // SAFETY: a bit cast.
        unsafe { _mm512_castsi512_ps(v) }
    }

    #[inline(always)]
    fn i(v: __m512) -> __m512i {
        // SAFETY: a bit cast.
        unsafe { _mm512_castps_si512(v) }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn run(chain: &Chain, slots: &[*const u8], dst: *mut u8, len: usize) {
        let mut at = 0;
        while at + 16 * U <= len {
            vectors::<true>(chain, slots, dst, at, &[u16::MAX; U]);
            at += 16 * U;
        }
        if at < len {
            vectors::<false>(chain, slots, dst, at, &masks(len, at));
        }
    }

    /// The chain over the U vectors from element `at` (`m`: their lanes, when not FULL).
    #[inline(always)]
    unsafe fn vectors<const FULL: bool>(
        chain: &Chain,
        slots: &[*const u8],
        dst: *mut u8,
        at: usize,
        m: &[u16; U],
    ) {
        {
            let mut v = load::<FULL>(slots[chain.input], chain.input_lanes, at, m);
            // Every arm: one loop over the U vectors, with `$x` the value, `$y` the other
            // operand.
            macro_rules! each {
                (|$x:ident| $e:expr) => {
                    for $x in v.iter_mut() {
                        *$x = $e;
                    }
                };
                ($o:expr, $lanes:expr, |$x:ident, $y:ident| $e:expr) => {{
                    let w = load::<FULL>(slots[$o], $lanes, at, m);
                    for (x, &$y) in v.iter_mut().zip(&w) {
                        let $x = *x;
                        *x = $e;
                    }
                }};
            }
            use Lanes::{F32, I32};
            for op in &chain.ops {
                match *op {
                    VecOp::AddF(o) => each!(o, F32, |x, y| i(_mm512_add_ps(f(x), f(y)))),
                    VecOp::SubF(o) => each!(o, F32, |x, y| i(_mm512_sub_ps(f(x), f(y)))),
                    VecOp::RSubF(o) => each!(o, F32, |x, y| i(_mm512_sub_ps(f(y), f(x)))),
                    VecOp::MulF(o) => each!(o, F32, |x, y| i(_mm512_mul_ps(f(x), f(y)))),
                    VecOp::DivF(o) => each!(o, F32, |x, y| i(_mm512_div_ps(f(x), f(y)))),
                    VecOp::RDivF(o) => each!(o, F32, |x, y| i(_mm512_div_ps(f(y), f(x)))),
                    VecOp::MaxF(o) => each!(o, F32, |x, y| i(pick::<_CMP_GT_OQ>(f(x), f(y)))),
                    VecOp::RMaxF(o) => each!(o, F32, |x, y| i(pick::<_CMP_GT_OQ>(f(y), f(x)))),
                    VecOp::MinF(o) => each!(o, F32, |x, y| i(pick::<_CMP_LT_OQ>(f(x), f(y)))),
                    VecOp::RMinF(o) => each!(o, F32, |x, y| i(pick::<_CMP_LT_OQ>(f(y), f(x)))),
                    VecOp::AddI(o) => each!(o, I32, |x, y| _mm512_add_epi32(x, y)),
                    VecOp::SubI(o) => each!(o, I32, |x, y| _mm512_sub_epi32(x, y)),
                    VecOp::RSubI(o) => each!(o, I32, |x, y| _mm512_sub_epi32(y, x)),
                    VecOp::MulI(o) => each!(o, I32, |x, y| _mm512_mullo_epi32(x, y)),
                    VecOp::MaxI(o) => each!(o, I32, |x, y| _mm512_max_epi32(x, y)),
                    VecOp::MinI(o) => each!(o, I32, |x, y| _mm512_min_epi32(x, y)),
                    VecOp::Neg => each!(|x| _mm512_xor_si512(*x, _mm512_set1_epi32(i32::MIN))),
                    VecOp::Abs => each!(|x| _mm512_and_si512(*x, _mm512_set1_epi32(i32::MAX))),
                    // `if c < 0 { 0 } else { c }`: NaN and -0 pass.
                    VecOp::Relu => each!(|x| _mm512_maskz_mov_epi32(
                        !_mm512_cmp_ps_mask::<_CMP_LT_OQ>(f(*x), _mm512_setzero_ps()),
                        *x
                    )),
                    VecOp::Round => each!(|x| i(_mm512_roundscale_ps::<
                        { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
                    >(f(*x)))),
                    VecOp::Floor => each!(|x| i(_mm512_roundscale_ps::<
                        { _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC },
                    >(f(*x)))),
                    VecOp::Ceil => each!(|x| i(_mm512_roundscale_ps::<
                        { _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC },
                    >(f(*x)))),
                    VecOp::Trunc => each!(|x| i(_mm512_roundscale_ps::<
                        { _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC },
                    >(f(*x)))),
                    VecOp::Sqrt => each!(|x| i(_mm512_sqrt_ps(f(*x)))),
                    VecOp::Recip => each!(|x| i(_mm512_div_ps(_mm512_set1_ps(1.0), f(*x)))),
                    VecOp::Rsqrt => {
                        each!(|x| i(_mm512_div_ps(_mm512_set1_ps(1.0), _mm512_sqrt_ps(f(*x)))))
                    }
                    // One arm per kernel: the kernel is matched once, not per vector.
                    VecOp::Transcendental(k) => match k {
                        Kernel::Exp => each!(|x| i(vm::exp(unshifted(f(*x))))),
                        Kernel::Tanh => each!(|x| i(vm::tanh(unshifted(f(*x))))),
                        Kernel::Sigmoid => each!(|x| i(vm::sigmoid(unshifted(f(*x))))),
                        Kernel::Silu => each!(|x| i(vm::silu(unshifted(f(*x))))),
                        Kernel::Gelu => each!(|x| i(vm::gelu(unshifted(f(*x))))),
                        Kernel::GeluTanh => each!(|x| i(vm::gelu_tanh(unshifted(f(*x))))),
                        Kernel::Log => each!(|x| i(vm::log(unshifted(f(*x))))),
                        Kernel::Erf => each!(|x| i(vm::erf(unshifted(f(*x))))),
                        Kernel::Sin => each!(|x| i(vm::sin(unshifted(f(*x))))),
                        Kernel::Cos => each!(|x| i(vm::cos(unshifted(f(*x))))),
                        Kernel::Tan => each!(|x| i(vm::tan(unshifted(f(*x))))),
                        Kernel::Expm1 => each!(|x| i(vm::expm1(unshifted(f(*x))))),
                        Kernel::Log1p => each!(|x| i(vm::log1p(unshifted(f(*x))))),
                    },
                    // `saturate_to_i32`: out of range and NaN convert to i32::MIN; the two
                    // that differ are fixed.
                    VecOp::FloatToI32 => each!(|x| {
                        let t = _mm512_cvttps_epi32(f(*x));
                        let high = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(
                            f(*x),
                            _mm512_set1_ps(2_147_483_648.0),
                        );
                        let t = _mm512_mask_mov_epi32(t, high, _mm512_set1_epi32(i32::MAX));
                        _mm512_maskz_mov_epi32(!_mm512_cmp_ps_mask::<_CMP_UNORD_Q>(f(*x), f(*x)), t)
                    }),
                    VecOp::IntToFloat => each!(|x| i(_mm512_cvtepi32_ps(*x))),
                    VecOp::WrapI8 => {
                        each!(|x| _mm512_srai_epi32::<24>(_mm512_slli_epi32::<24>(*x)))
                    }
                    VecOp::WrapU8 => each!(|x| _mm512_and_si512(*x, _mm512_set1_epi32(0xff))),
                }
            }
            store::<FULL>(dst, chain.out_lanes, at, m, &v);
        }
    }
}
