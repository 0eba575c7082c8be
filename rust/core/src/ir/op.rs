//! The operator set of the IR. Small, but with the composite ops (softmax, norms, attention)
//! that backends can run fused; each composite has a decomposition (see `ir::decompose`).

use std::fmt;
use std::sync::Arc;

use crate::dim::Dim;
use crate::dtype::{DType, Scalar};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum UnaryOp {
    Neg,
    Abs,
    Sign,
    Floor,
    Ceil,
    /// Round half to even, as torch.round.
    Round,
    Trunc,
    Exp,
    Expm1,
    Log,
    Log1p,
    Sqrt,
    Rsqrt,
    Recip,
    Sin,
    Cos,
    Tan,
    Tanh,
    Sigmoid,
    Erf,
    /// Exact GELU: x·Φ(x).
    Gelu,
    /// GELU with the tanh approximation.
    GeluTanh,
    Silu,
    Relu,
    /// Logical not (any dtype → bool).
    Not,
    /// Bitwise not (integers; on bool it is logical not).
    BitNot,
    IsNan,
    IsInf,
}

impl UnaryOp {
    pub const ALL: [UnaryOp; 28] = [
        UnaryOp::Neg,
        UnaryOp::Abs,
        UnaryOp::Sign,
        UnaryOp::Floor,
        UnaryOp::Ceil,
        UnaryOp::Round,
        UnaryOp::Trunc,
        UnaryOp::Exp,
        UnaryOp::Expm1,
        UnaryOp::Log,
        UnaryOp::Log1p,
        UnaryOp::Sqrt,
        UnaryOp::Rsqrt,
        UnaryOp::Recip,
        UnaryOp::Sin,
        UnaryOp::Cos,
        UnaryOp::Tan,
        UnaryOp::Tanh,
        UnaryOp::Sigmoid,
        UnaryOp::Erf,
        UnaryOp::Gelu,
        UnaryOp::GeluTanh,
        UnaryOp::Silu,
        UnaryOp::Relu,
        UnaryOp::Not,
        UnaryOp::BitNot,
        UnaryOp::IsNan,
        UnaryOp::IsInf,
    ];

    /// Ops that are only defined on floating-point inputs (frontends cast integers first).
    pub fn needs_float(self) -> bool {
        use UnaryOp::*;
        !matches!(
            self,
            Neg | Abs | Sign | Floor | Ceil | Round | Trunc | Relu | Not | BitNot | IsNan | IsInf
        )
    }

    pub fn returns_bool(self) -> bool {
        matches!(self, UnaryOp::Not | UnaryOp::IsNan | UnaryOp::IsInf)
    }

    pub fn name(self) -> &'static str {
        use UnaryOp::*;
        match self {
            Neg => "neg",
            Abs => "abs",
            Sign => "sign",
            Floor => "floor",
            Ceil => "ceil",
            Round => "round",
            Trunc => "trunc",
            Exp => "exp",
            Expm1 => "expm1",
            Log => "log",
            Log1p => "log1p",
            Sqrt => "sqrt",
            Rsqrt => "rsqrt",
            Recip => "recip",
            Sin => "sin",
            Cos => "cos",
            Tan => "tan",
            Tanh => "tanh",
            Sigmoid => "sigmoid",
            Erf => "erf",
            Gelu => "gelu",
            GeluTanh => "gelu_tanh",
            Silu => "silu",
            Relu => "relu",
            Not => "not",
            BitNot => "bitnot",
            IsNan => "isnan",
            IsInf => "isinf",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    /// True division for floats; for integers, division rounding toward zero.
    Div,
    /// Integer or float division rounding toward negative infinity (torch `floor_divide`).
    FloorDiv,
    Pow,
    /// Remainder with the sign of the divisor (Python `%`, torch.remainder).
    Rem,
    /// Remainder with the sign of the dividend (C `fmod`, torch.fmod).
    Fmod,
    Max,
    Min,
    Atan2,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    /// Logical and/or/xor on bool; bitwise on integers.
    And,
    Or,
    Xor,
}

impl BinaryOp {
    pub const ALL: [BinaryOp; 20] = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::FloorDiv,
        BinaryOp::Pow,
        BinaryOp::Rem,
        BinaryOp::Fmod,
        BinaryOp::Max,
        BinaryOp::Min,
        BinaryOp::Atan2,
        BinaryOp::Eq,
        BinaryOp::Ne,
        BinaryOp::Lt,
        BinaryOp::Le,
        BinaryOp::Gt,
        BinaryOp::Ge,
        BinaryOp::And,
        BinaryOp::Or,
        BinaryOp::Xor,
    ];

    pub fn is_comparison(self) -> bool {
        use BinaryOp::*;
        matches!(self, Eq | Ne | Lt | Le | Gt | Ge)
    }

    pub fn is_logical(self) -> bool {
        matches!(self, BinaryOp::And | BinaryOp::Or | BinaryOp::Xor)
    }

    pub fn name(self) -> &'static str {
        use BinaryOp::*;
        match self {
            Add => "add",
            Sub => "sub",
            Mul => "mul",
            Div => "div",
            FloorDiv => "floordiv",
            Pow => "pow",
            Rem => "rem",
            Fmod => "fmod",
            Max => "max",
            Min => "min",
            Atan2 => "atan2",
            Eq => "eq",
            Ne => "ne",
            Lt => "lt",
            Le => "le",
            Gt => "gt",
            Ge => "ge",
            And => "and",
            Or => "or",
            Xor => "xor",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ReduceOp {
    Sum,
    Prod,
    Max,
    Min,
    /// Index of the first maximum (int64 result); single axis only.
    ArgMax,
    /// Index of the first minimum (int64 result); single axis only.
    ArgMin,
}

impl ReduceOp {
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::ArgMax => "argmax",
            ReduceOp::ArgMin => "argmin",
        }
    }

    pub fn is_arg(self) -> bool {
        matches!(self, ReduceOp::ArgMax | ReduceOp::ArgMin)
    }
}

/// What a `Scan` accumulates along its axis: out[j] = x[0] ⊕ … ⊕ x[j].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ScanOp {
    /// Floats accumulate in f64 (as torch's CPU kernel), integers wrap, bools or.
    Sum,
    /// Floats accumulate in f64, integers wrap, bools and.
    Prod,
    /// The running maximum; a NaN stays once seen, as in torch.
    Max,
    /// The running minimum; a NaN stays once seen, as in torch.
    Min,
}

impl ScanOp {
    pub fn name(self) -> &'static str {
        match self {
            ScanOp::Sum => "cumsum",
            ScanOp::Prod => "cumprod",
            ScanOp::Max => "cummax",
            ScanOp::Min => "cummin",
        }
    }
}

/// How `Scatter` combines an update with the element it lands on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ScatterReduce {
    /// The update replaces the element.
    None,
    Add,
    Mul,
    Max,
    Min,
}

/// Which window reduction a `Pool` node computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PoolKind {
    /// Maximum over the in-bounds window elements (padding never wins).
    Max,
    /// Sum of the in-bounds window elements divided by `divisor` when given, else by the
    /// window size clipped to the padded input (`count_include_pad`) or by the number of
    /// in-bounds elements.
    Avg {
        count_include_pad: bool,
        divisor: Option<i64>,
    },
}

/// Constant tensor data, little-endian, contiguous, in the node's dtype.
#[derive(Clone, PartialEq)]
pub struct ConstData {
    pub shape: Vec<usize>,
    pub bytes: Arc<Vec<u8>>,
}

impl fmt::Debug for ConstData {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ConstData({:?}, {} bytes)", self.shape, self.bytes.len())
    }
}

/// One IR operation. Every node has exactly one output; ops with several results in the
/// source graph (max with indices, split) become several nodes.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// The `index`-th runtime input.
    Input {
        index: usize,
    },
    /// A named weight, bound once when the program is compiled.
    Weight {
        name: String,
    },
    /// A small constant tensor embedded in the graph.
    Constant(ConstData),
    /// A tensor of the node's shape filled with one value.
    Full {
        value: Scalar,
    },
    /// `start + step * i` along a 1-D output (arange).
    Iota {
        start: Scalar,
        step: Scalar,
    },
    Unary(UnaryOp),
    /// Both operands have the same dtype and shape (frontends cast and expand).
    Binary(BinaryOp),
    /// `where(cond, a, b)`: cond is bool; a, b share the output dtype and shape.
    Where,
    /// Elementwise conversion. Float → integer truncates toward zero, saturates to int64's
    /// range for int64 and to int32's for the narrower types (NaN → 0), then wraps to the
    /// type; integer → integer wraps; anything → bool is `!= 0`.
    Cast {
        to: DType,
    },
    /// Reduction over `axes` (sorted, unique). Arg reductions take exactly one axis.
    Reduce {
        op: ReduceOp,
        axes: Vec<usize>,
        keepdim: bool,
    },
    /// Batched contraction: `[B.., M, K] x [B.., K, N] -> [B.., M, N]`, equal batch dims.
    Dot,
    /// `Dot` of 8-bit integers (uint8 or int8, each operand either) into int32, every
    /// product and sum exact (wrapping past the int32 range, as int32 accumulation does):
    /// the core of quantized matrix products (ONNX `MatMulInteger`, QDQ `MatMul`).
    IntegerDot,
    /// `x · wᵀ` with `w` `[N, K]` stored block-quantized (ONNX Runtime's `MatMulNBits`):
    /// inputs x `[M, K]` (float), packed `[N, blocks · block · bits / 8]` (uint8, each row's
    /// values `bits` wide, low bits first, `blocks = ⌈K / block⌉`), scales and zeros
    /// `[N, blocks]` (f32). Weight element `(n, k)` is `(q − zeros[n, b]) · scales[n, b]`
    /// with `b = k / block`; out `[M, N]` in x's dtype. Kept packed so an int4 model's
    /// weights stay a quarter-byte per element and its products read that much.
    BlockQuantDot {
        bits: u8,
        block: usize,
    },
    /// Same elements, new shape (element count preserved).
    Reshape {
        shape: Vec<Dim>,
    },
    Permute {
        perm: Vec<usize>,
    },
    /// Broadcast size-1 dims to `shape` (same rank; frontends add leading dims by reshape).
    Expand {
        shape: Vec<Dim>,
    },
    /// Elements `start, start+step, ... < end` of `axis` (0 ≤ start ≤ end ≤ size, step ≥ 1).
    Slice {
        axis: usize,
        start: Dim,
        end: Dim,
        step: i64,
    },
    Flip {
        axes: Vec<usize>,
    },
    /// Constant padding: `pads[i] = (before, after)` for each axis (non-negative).
    Pad {
        pads: Vec<(i64, i64)>,
        value: Scalar,
    },
    Concat {
        axis: usize,
    },
    /// A key/value cache with new entries written after each sequence's cached ones: inputs
    /// past `[B, .., P, ..]` and new `[B, .., S, ..]` (equal dims except `axis` ≥ 1) and
    /// lengths `[B]` (integer). Along `axis` (`len` long), sequence b's output holds past's
    /// entries before `lengths[b]` (zeros for any at or past P), new's S entries from
    /// `lengths[b]` on, zeros after them: GroupQueryAttention's present key/value, written
    /// in one pass instead of a concatenation and a row gather.
    CacheAppend {
        axis: usize,
        len: Dim,
    },
    /// `torch.gather`: index has the input's rank; out[i][j] = in[index[i][j]][j] on `axis`.
    Gather {
        axis: usize,
    },
    /// `index_select`/`embedding`: out = in[..axis] ++ index.shape ++ in[axis+1..].
    IndexSelect {
        axis: usize,
    },
    /// `torch.scatter` / ONNX ScatterElements: inputs x, index (x's rank, integer), updates
    /// (index's shape, x's dtype); out = x with out[.., index[i], ..] (on `axis`) = updates[i]
    /// (or combined with it by `reduce`). Several updates of one element: any one wins
    /// without a reduction (as in torch and ONNX), all combine with one.
    Scatter {
        axis: usize,
        reduce: ScatterReduce,
    },
    /// Inclusive scan along `axis` (cumsum, cumprod, cummax, cummin): the input's type.
    Scan {
        axis: usize,
        op: ScanOp,
    },
    /// The positions that sort each line along `axis` (i64, the input's shape): ascending or
    /// descending, stable (equal elements keep their order). NaN ranks above every number
    /// (last ascending, first descending), as in torch.
    Argsort {
        axis: usize,
        descending: bool,
    },
    /// Grouped matrix product (mixture-of-experts experts): inputs x `[S, K]`, w `[G, K, N]`
    /// and ends `[G]` (integer, non-decreasing). Row s of the output `[S, N]` is x[s]·w[g]
    /// for the group with `ends[g-1] ≤ s < ends[g]` (`ends[-1]` = 0); rows past the last end
    /// are zero. Ends are clamped into `[previous end, S]`, so a bad offset empties groups
    /// instead of reading out of bounds.
    GroupedDot,
    /// Softmax (or log-softmax) along `axis`.
    Softmax {
        axis: usize,
        log: bool,
    },
    /// Normalizes over the trailing dims from `axis`: inputs x, then weight and bias if flagged.
    LayerNorm {
        axis: usize,
        eps: f64,
        has_weight: bool,
        has_bias: bool,
    },
    /// Root-mean-square norm over trailing dims from `axis`: inputs x, then weight if flagged.
    RmsNorm {
        axis: usize,
        eps: f64,
        has_weight: bool,
    },
    /// Scaled dot-product attention. Inputs q `[B.., L, E]`, k `[B.., S, E]`, v `[B.., S, Ev]`,
    /// optional mask `[B.., L, S]` (bool: keep where true; float: added to scores).
    Attention {
        scale: f64,
        causal: bool,
        has_mask: bool,
    },
    /// `base` computed by a named backend kernel (`"cpu.rowwise"`): the same semantics as
    /// `base`, chosen by a backend's lowering rules. Backends reject kernel names they do not
    /// know; the interpreter evaluates `base`.
    Kernel {
        name: String,
        base: Box<Op>,
    },
    /// N-d convolution (cross-correlation, as torch) over the trailing `stride.len()` dims.
    /// Inputs x `[N, C, *S]`, weight `[O, C/groups, *K]`, then bias `[O]` if flagged.
    /// `padding[i] = (before, after)` zeros; `out = (S + before + after - dilation·(K-1) - 1)
    /// / stride + 1` (floor).
    Conv {
        stride: Vec<i64>,
        padding: Vec<(i64, i64)>,
        dilation: Vec<i64>,
        groups: i64,
        has_bias: bool,
    },
    /// Max/average pooling over the trailing `kernel.len()` dims (leading dims are batch).
    /// `padding` is symmetric, as torch's; `ceil_mode` rounds the output size up (but a
    /// window never starts in the right padding), which needs constant spatial dims.
    Pool {
        kind: PoolKind,
        kernel: Vec<i64>,
        stride: Vec<i64>,
        padding: Vec<i64>,
        dilation: Vec<i64>,
        ceil_mode: bool,
    },
}

impl Op {
    /// The op a backend's kernel choice wraps (`Kernel { base, .. }`), or the op itself:
    /// what the node computes.
    pub fn base(&self) -> &Op {
        match self {
            Op::Kernel { base, .. } => base.base(),
            other => other,
        }
    }

    pub fn name(&self) -> String {
        match self {
            Op::Input { .. } => "input".into(),
            Op::Weight { .. } => "weight".into(),
            Op::Constant(_) => "constant".into(),
            Op::Full { .. } => "full".into(),
            Op::Iota { .. } => "iota".into(),
            Op::Unary(u) => u.name().into(),
            Op::Binary(b) => b.name().into(),
            Op::Where => "where".into(),
            Op::Cast { .. } => "cast".into(),
            Op::Reduce { op, .. } => format!("reduce_{}", op.name()),
            Op::Dot => "dot".into(),
            Op::IntegerDot => "integer_dot".into(),
            Op::BlockQuantDot { .. } => "block_quant_dot".into(),
            Op::Reshape { .. } => "reshape".into(),
            Op::Permute { .. } => "permute".into(),
            Op::Expand { .. } => "expand".into(),
            Op::Slice { .. } => "slice".into(),
            Op::Flip { .. } => "flip".into(),
            Op::Pad { .. } => "pad".into(),
            Op::Concat { .. } => "concat".into(),
            Op::CacheAppend { .. } => "cache_append".into(),
            Op::Gather { .. } => "gather".into(),
            Op::IndexSelect { .. } => "index_select".into(),
            Op::Scatter { .. } => "scatter".into(),
            Op::Scan { op, .. } => op.name().into(),
            Op::Argsort { .. } => "argsort".into(),
            Op::GroupedDot => "grouped_dot".into(),
            Op::Softmax { log: false, .. } => "softmax".into(),
            Op::Softmax { log: true, .. } => "log_softmax".into(),
            Op::LayerNorm { .. } => "layer_norm".into(),
            Op::RmsNorm { .. } => "rms_norm".into(),
            Op::Attention { .. } => "attention".into(),
            Op::Conv { .. } => "conv".into(),
            Op::Pool {
                kind: PoolKind::Max,
                ..
            } => "max_pool".into(),
            Op::Pool {
                kind: PoolKind::Avg { .. },
                ..
            } => "avg_pool".into(),
            Op::Kernel { name, base } => format!("{}@{name}", base.name()),
        }
    }

    /// The op whose semantics this node has: `base` for a backend kernel, else itself.
    pub fn semantics(&self) -> &Op {
        match self {
            Op::Kernel { base, .. } => base.semantics(),
            op => op,
        }
    }

    /// Ops whose output is a re-indexing of their single input: backends may implement them
    /// without copying.
    pub fn is_view(&self) -> bool {
        if let Op::Kernel { .. } = self {
            // A kernel materializes its result, even for a view base.
            return false;
        }
        matches!(
            self,
            Op::Reshape { .. }
                | Op::Permute { .. }
                | Op::Expand { .. }
                | Op::Slice { .. }
                | Op::Flip { .. }
        )
    }
}
