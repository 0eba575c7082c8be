//! Element expressions: the value of any node at a multi-index, as CUDA C statements.
//!
//! A kernel computes its root node; every producer that is not materialized (elementwise
//! ops, views, gathers, concatenation, padding, constants) is inlined by rewriting the index
//! it is read at, so views never copy and elementwise chains never touch memory in between.
//! Materialized producers are kernel parameters, read at their contiguous offsets.

use std::collections::HashMap;
use std::fmt::Write;
use std::sync::Arc;

use ember_core::dim::{reshape_runs, Dim, DimOp};
use ember_core::dtype::{DType, Kind, Scalar};
use ember_core::ir::{BinaryOp, Graph, Op, UnaryOp};

use super::types::{compute_type, load, storage_type};
use super::CodegenError;

/// Renders dims as C expressions over the symbol table `meta[1..]`.
pub struct DimRender<'a> {
    pub symbols: &'a [Arc<str>],
}

impl DimRender<'_> {
    pub fn render(&self, d: &Dim) -> String {
        match d {
            Dim::Const(c) => format!("{c}LL"),
            Dim::Sym(s) => {
                let k = self
                    .symbols
                    .iter()
                    .position(|x| x == s)
                    .unwrap_or(usize::MAX);
                // `symbols` holds every symbol of the graph (see `collect_symbols`).
                format!("meta[{}]", k.wrapping_add(1))
            }
            Dim::Expr(e) => {
                let (op, a, b) = &**e;
                let (a, b) = (self.render(a), self.render(b));
                match op {
                    DimOp::Add => format!("({a} + {b})"),
                    DimOp::Sub => format!("({a} - {b})"),
                    DimOp::Mul => format!("({a} * {b})"),
                    DimOp::FloorDiv => format!("ember_dfloordiv({a}, {b})"),
                    DimOp::Mod => format!("ember_dmod({a}, {b})"),
                    DimOp::Min => format!("ember_dmin({a}, {b})"),
                    DimOp::Max => format!("ember_dmax({a}, {b})"),
                }
            }
        }
    }

    /// Product of dims (1 for none).
    pub fn product(&self, dims: &[Dim]) -> String {
        if dims.is_empty() {
            return "1LL".into();
        }
        dims.iter()
            .map(|d| self.render(d))
            .collect::<Vec<_>>()
            .join(" * ")
    }
}

/// A C literal of `s` converted to `dtype`'s compute type.
pub fn scalar_literal(s: Scalar, dtype: DType) -> String {
    let ct = compute_type(dtype);
    match dtype.kind() {
        Kind::Bool => match s {
            Scalar::Bool(b) => b.to_string(),
            Scalar::Int(i) => (i != 0).to_string(),
            Scalar::Float(f) => (f != 0.0).to_string(),
        },
        Kind::Int => {
            let v = match s {
                Scalar::Bool(b) => b as i64,
                Scalar::Int(i) => i,
                Scalar::Float(f) => f as i64,
            };
            if v == i64::MIN {
                format!("(({ct})(-9223372036854775807LL - 1))")
            } else {
                format!("(({ct}){v}LL)")
            }
        }
        Kind::Float => {
            let v = match s {
                Scalar::Bool(b) => b as i64 as f64,
                Scalar::Int(i) => i as f64,
                Scalar::Float(f) => f,
            };
            float_literal(v, dtype)
        }
    }
}

/// A float literal in `dtype`'s compute type (rounded to the dtype first, as a stored value).
pub fn float_literal(v: f64, dtype: DType) -> String {
    let v = match dtype {
        DType::F16 => half::f16::from_f64(v).to_f64(),
        DType::BF16 => half::bf16::from_f64(v).to_f64(),
        DType::F32 => v as f32 as f64,
        _ => v,
    };
    let f64_type = dtype == DType::F64;
    if v.is_nan() {
        return if f64_type { "EMBER_NAN64" } else { "EMBER_NAN" }.into();
    }
    if v.is_infinite() {
        let inf = if f64_type { "EMBER_INF64" } else { "EMBER_INF" };
        return if v > 0.0 {
            inf.into()
        } else {
            format!("(-{inf})")
        };
    }
    // `{:e}` prints the shortest text that reads back exactly.
    if f64_type {
        format!("({v:e})")
    } else {
        format!("({:e}f)", v as f32)
    }
}

/// Statements computing node values for one kernel.
pub struct Emitter<'a> {
    pub g: &'a Graph,
    /// Nodes read from memory (parameters) rather than recomputed.
    pub in_memory: &'a [bool],
    /// The node this kernel computes (computed even though it is in memory).
    pub root: Option<usize>,
    /// Further nodes it computes and writes (in memory, computed here all the same).
    pub also_roots: Vec<usize>,
    pub dims: DimRender<'a>,
    /// Parameter nodes in the order the kernel signature lists them.
    pub params: Vec<usize>,
    pub body: String,
    pub indent: usize,
    counter: usize,
    memo: Vec<HashMap<(usize, Vec<String>), String>>,
    /// Nodes whose every read is one value ([`Emitter::bind`]).
    bound: HashMap<usize, String>,
}

impl<'a> Emitter<'a> {
    pub fn new(
        g: &'a Graph,
        in_memory: &'a [bool],
        root: Option<usize>,
        symbols: &'a [Arc<str>],
    ) -> Self {
        Emitter {
            g,
            in_memory,
            root,
            also_roots: Vec::new(),
            dims: DimRender { symbols },
            params: Vec::new(),
            body: String::new(),
            indent: 1,
            counter: 0,
            memo: vec![HashMap::new()],
            bound: HashMap::new(),
        }
    }

    pub fn fresh(&mut self, prefix: &str) -> String {
        self.counter += 1;
        // The underscore keeps the 64th index temporary from being `i64`, the type.
        format!("{prefix}_{}", self.counter)
    }

    pub fn line(&mut self, s: impl AsRef<str>) {
        for _ in 0..self.indent {
            self.body.push_str("    ");
        }
        self.body.push_str(s.as_ref());
        self.body.push('\n');
    }

    /// Opens a C block (`header {`); values computed inside are not reused after it closes.
    pub fn open(&mut self, header: impl AsRef<str>) {
        self.line(format!("{} {{", header.as_ref()));
        self.indent += 1;
        self.memo.push(HashMap::new());
    }

    pub fn close(&mut self) {
        self.memo.pop();
        self.indent -= 1;
        self.line("}");
    }

    pub fn dim(&self, d: &Dim) -> String {
        self.dims.render(d)
    }

    /// The parameter name of a node read from memory.
    pub fn param(&mut self, node: usize) -> String {
        let k = match self.params.iter().position(|&p| p == node) {
            Some(k) => k,
            None => {
                self.params.push(node);
                self.params.len() - 1
            }
        };
        format!("b{k}")
    }

    /// Declares index variables for the row-major unravelling of `linear` over `shape`.
    pub fn unravel(&mut self, linear: &str, shape: &[Dim]) -> Vec<String> {
        let mut idx = vec![String::new(); shape.len()];
        if shape.is_empty() {
            return idx;
        }
        let rest = self.fresh("r");
        self.line(format!("i64 {rest} = {linear};"));
        for k in (0..shape.len()).rev() {
            let v = self.fresh("i");
            if k == 0 {
                self.line(format!("const i64 {v} = {rest};"));
            } else {
                let d = self.dim(&shape[k]);
                self.line(format!("const i64 {v} = {rest} % {d}; {rest} /= {d};"));
            }
            idx[k] = v;
        }
        idx
    }

    /// The row-major linear offset of `idx` in `shape`, as an expression.
    pub fn offset(&self, idx: &[String], shape: &[Dim]) -> String {
        if idx.is_empty() {
            return "0LL".into();
        }
        let mut e = idx[0].clone();
        for k in 1..idx.len() {
            e = format!("({e}) * {} + {}", self.dim(&shape[k]), idx[k]);
        }
        e
    }

    fn err(&self, node: usize, msg: impl std::fmt::Display) -> CodegenError {
        CodegenError::new(self.g, node, msg)
    }

    fn define(&mut self, node: usize, expr: String) -> String {
        let dtype = self.g.nodes[node].ty.dtype;
        let t = compute_type(dtype);
        // 16-bit results are rounded after every op, as eager PyTorch stores them: fused
        // kernels then match eager exactly instead of being differently (more) accurate.
        let expr = match dtype {
            DType::F16 if !expr.starts_with("ember_h2f(") => {
                format!("ember_h2f(ember_f2h({expr}))")
            }
            DType::BF16 if !expr.starts_with("ember_b2f(") => {
                format!("ember_b2f(ember_f2b({expr}))")
            }
            _ => expr,
        };
        let v = self.fresh("v");
        self.line(format!("const {t} {v} = {expr};"));
        v
    }

    /// Makes every read of `node` in this kernel, at whatever index, read `expr`: a value
    /// the kernel computed itself (in the node's compute type), rounded to the node's dtype
    /// as storing it would. For a product's epilogue, whose reads are all of one element.
    pub fn bind(&mut self, node: usize, expr: &str) {
        let v = self.define(node, expr.to_string());
        self.bound.insert(node, v);
    }

    /// The value of `node` at `idx` (one index per dim of its shape), in its compute type.
    pub fn value(&mut self, node: usize, idx: &[String]) -> Result<String, CodegenError> {
        if let Some(v) = self.bound.get(&node) {
            return Ok(v.clone());
        }
        let key = (node, idx.to_vec());
        if let Some(v) = self.memo.iter().rev().find_map(|m| m.get(&key)) {
            return Ok(v.clone());
        }
        let v = self.compute(node, idx)?;
        if let Some(m) = self.memo.last_mut() {
            m.insert(key, v.clone());
        }
        Ok(v)
    }

    fn compute(&mut self, node: usize, idx: &[String]) -> Result<String, CodegenError> {
        let g = self.g;
        let n = &g.nodes[node];
        let dtype = n.ty.dtype;
        if self.in_memory[node] && self.root != Some(node) && !self.also_roots.contains(&node) {
            let p = self.param(node);
            let off = self.offset(idx, &n.ty.shape);
            return Ok(self.define(node, load(dtype, &format!("{p}[{off}]"))));
        }
        let input = |k: usize| n.inputs[k];
        let in_shape = |k: usize| &g.nodes[n.inputs[k]].ty.shape;
        match &n.op {
            Op::Full { value } => Ok(scalar_literal(*value, dtype)),
            Op::Iota { start, step } => {
                let (s, t) = (scalar_literal(*start, dtype), scalar_literal(*step, dtype));
                let ct = compute_type(dtype);
                Ok(self.define(node, format!("{s} + {t} * ({ct}){}", idx[0])))
            }
            Op::Unary(u) => {
                let x = self.value(input(0), idx)?;
                let src = g.nodes[input(0)].ty.dtype;
                let e = unary_expr(*u, src, &x).ok_or_else(|| {
                    self.err(node, format!("{} of {src} has no CUDA kernel", u.name()))
                })?;
                Ok(self.define(node, e))
            }
            Op::Binary(b) => {
                let x = self.value(input(0), idx)?;
                let y = self.value(input(1), idx)?;
                let src = g.nodes[input(0)].ty.dtype;
                let e = binary_expr(*b, src, &x, &y).ok_or_else(|| {
                    self.err(node, format!("{} of {src} has no CUDA kernel", b.name()))
                })?;
                Ok(self.define(node, e))
            }
            Op::Where => {
                let c = self.value(input(0), idx)?;
                let x = self.value(input(1), idx)?;
                let y = self.value(input(2), idx)?;
                Ok(self.define(node, format!("{c} ? {x} : {y}")))
            }
            Op::Cast { to } => {
                let x = self.value(input(0), idx)?;
                let from = g.nodes[input(0)].ty.dtype;
                Ok(self.define(node, cast_expr(from, *to, &x)))
            }
            Op::Reshape { .. } => {
                // Run by run (`reshape_runs`): a dim both shapes share passes its index
                // through, so only the dims that really regroup pay for a division.
                let src_shape = in_shape(0).clone();
                let mut inner = Vec::with_capacity(src_shape.len());
                for (from, to) in reshape_runs(&src_shape, &n.ty.shape) {
                    if from.is_empty() {
                        continue; // `to`'s unit dims
                    } else if from.len() == 1 && to.len() == 1 {
                        inner.push(idx[to.start].clone());
                    } else if to.is_empty() {
                        inner.extend(from.map(|_| "0LL".to_string()));
                    } else {
                        let lin = self.fresh("l");
                        let off = self.offset(&idx[to.clone()], &n.ty.shape[to]);
                        self.line(format!("const i64 {lin} = {off};"));
                        inner.extend(self.unravel(&lin, &src_shape[from]));
                    }
                }
                self.value(input(0), &inner)
            }
            Op::Permute { perm } => {
                let mut inner = vec![String::new(); perm.len()];
                for (k, &p) in perm.iter().enumerate() {
                    inner[p] = idx[k].clone();
                }
                self.value(input(0), &inner)
            }
            Op::Expand { .. } => {
                let src_shape = in_shape(0).clone();
                let inner: Vec<String> = src_shape
                    .iter()
                    .zip(&n.ty.shape)
                    .zip(idx)
                    .map(|((s, o), i)| match (s.as_const(), o.as_const()) {
                        (Some(1), Some(1)) => i.clone(),
                        (Some(1), _) => "0LL".into(),
                        (Some(_), _) => i.clone(),
                        (None, _) => format!("({} == 1 ? 0LL : {i})", self.dim(s)),
                    })
                    .collect();
                self.value(input(0), &inner)
            }
            Op::Slice {
                axis, start, step, ..
            } => {
                let mut inner = idx.to_vec();
                inner[*axis] = format!("({} + {} * {step}LL)", self.dim(start), idx[*axis]);
                self.value(input(0), &inner)
            }
            Op::Flip { axes } => {
                let src_shape = in_shape(0).clone();
                let mut inner = idx.to_vec();
                for &a in axes {
                    inner[a] = format!("({} - 1 - {})", self.dim(&src_shape[a]), idx[a]);
                }
                self.value(input(0), &inner)
            }
            Op::Pad { pads, value } => {
                let src_shape = in_shape(0).clone();
                let mut conds = Vec::new();
                let mut inner = idx.to_vec();
                for (a, &(before, _)) in pads.iter().enumerate() {
                    if pads[a] == (0, 0) {
                        continue;
                    }
                    inner[a] = format!("({} - {before}LL)", idx[a]);
                    conds.push(format!(
                        "{0} >= {before}LL && {0} < {before}LL + {1}",
                        idx[a],
                        self.dim(&src_shape[a])
                    ));
                }
                if conds.is_empty() {
                    return self.value(input(0), &inner);
                }
                let t = compute_type(dtype);
                let v = self.fresh("v");
                self.line(format!("{t} {v} = {};", scalar_literal(*value, dtype)));
                self.open(format!("if ({})", conds.join(" && ")));
                let x = self.value(input(0), &inner)?;
                self.line(format!("{v} = {x};"));
                self.close();
                Ok(v)
            }
            Op::Concat { axis } => {
                let t = compute_type(dtype);
                let v = self.fresh("v");
                self.line(format!("{t} {v};"));
                let mut start = String::from("0LL");
                let parts = n.inputs.len();
                for k in 0..parts {
                    let len = self.dim(&in_shape(k)[*axis]);
                    let end = format!("({start} + {len})");
                    let mut inner = idx.to_vec();
                    inner[*axis] = format!("({} - {start})", idx[*axis]);
                    let header = match (k, k + 1 == parts) {
                        (0, true) => "if (true)".to_string(),
                        (0, false) => format!("if ({} < {end})", idx[*axis]),
                        (_, true) => "else".to_string(),
                        (_, false) => format!("else if ({} < {end})", idx[*axis]),
                    };
                    self.open(header);
                    let x = self.value(input(k), &inner)?;
                    self.line(format!("{v} = {x};"));
                    self.close();
                    start = end;
                }
                Ok(v)
            }
            Op::CacheAppend { axis, .. } => {
                // Past's entry before the sequence's length, new's S entries from it, else 0.
                let t = compute_type(dtype);
                let zero = match dtype.is_float() {
                    true => Scalar::Float(0.0),
                    false => Scalar::Int(0),
                };
                let v = self.fresh("v");
                self.line(format!("{t} {v} = {};", scalar_literal(zero, dtype)));
                let first = self.value(input(2), &idx[..1])?;
                let f = self.fresh("f");
                self.line(format!("const i64 {f} = (i64){first};"));
                let (p, s) = (self.dim(&in_shape(0)[*axis]), self.dim(&in_shape(1)[*axis]));
                let j = idx[*axis].clone();
                self.open(format!("if ({j} < {f} && {j} < {p})"));
                let x = self.value(input(0), idx)?;
                self.line(format!("{v} = {x};"));
                self.close();
                self.open(format!("else if ({j} >= {f} && {j} - {f} < {s})"));
                let mut inner = idx.to_vec();
                inner[*axis] = format!("({j} - {f})");
                let x = self.value(input(1), &inner)?;
                self.line(format!("{v} = {x};"));
                self.close();
                Ok(v)
            }
            Op::Gather { axis } => {
                let j = self.value(input(1), idx)?;
                let len = self.dim(&in_shape(0)[*axis]);
                let mut inner = idx.to_vec();
                let k = self.fresh("j");
                self.line(format!(
                    "const i64 {k} = ember_index(meta, (i64){j}, {len}, {node}LL);"
                ));
                inner[*axis] = k;
                self.value(input(0), &inner)
            }
            Op::IndexSelect { axis } => {
                let rank_i = in_shape(1).len();
                let j = self.value(input(1), &idx[*axis..*axis + rank_i])?;
                let len = self.dim(&in_shape(0)[*axis]);
                let k = self.fresh("j");
                self.line(format!(
                    "const i64 {k} = ember_index(meta, (i64){j}, {len}, {node}LL);"
                ));
                let mut inner = idx[..*axis].to_vec();
                inner.push(k);
                inner.extend_from_slice(&idx[*axis + rank_i..]);
                self.value(input(0), &inner)
            }
            _ => Err(self.err(
                node,
                "internal: this op is computed by its own kernel but was not materialized",
            )),
        }
    }
}

/// Storage declaration of a kernel parameter.
pub fn param_decl(g: &Graph, node: usize, name: &str) -> String {
    let t = storage_type(g.nodes[node].ty.dtype);
    let mut s = String::new();
    let _ = write!(s, "const {t}* __restrict__ {name}");
    s
}

fn is_float(d: DType) -> bool {
    d.kind() == Kind::Float
}

fn unary_expr(op: UnaryOp, src: DType, x: &str) -> Option<String> {
    use UnaryOp::*;
    let ct = compute_type(src);
    if src == DType::Bool {
        return Some(match op {
            Not | BitNot => format!("!{x}"),
            IsNan | IsInf => "false".into(),
            Abs | Relu | Floor | Ceil | Round | Trunc | Sign => x.into(),
            _ => return None,
        });
    }
    if !is_float(src) {
        return Some(match op {
            Neg => format!("({ct})(-{x})"),
            Abs => format!("({ct})({x} < 0 ? -{x} : {x})"),
            Sign => format!("ember_sign<{ct}>({x})"),
            Relu => format!("({x} < 0 ? ({ct})0 : {x})"),
            Not => format!("({x} == 0)"),
            BitNot => format!("({ct})(~{x})"),
            IsNan | IsInf => "false".into(),
            Floor | Ceil | Round | Trunc => x.into(),
            _ => return None,
        });
    }
    let f = ct == "float";
    let lit = |v: f64| {
        if f {
            format!("{v:e}f")
        } else {
            format!("{v:e}")
        }
    };
    Some(match op {
        Neg => format!("-{x}"),
        Abs => format!("{}({x})", if f { "fabsf" } else { "fabs" }),
        Sign => format!("ember_sign<{ct}>({x})"),
        Floor => format!("{}({x})", if f { "floorf" } else { "floor" }),
        Ceil => format!("{}({x})", if f { "ceilf" } else { "ceil" }),
        Round => format!("ember_round({x})"),
        Trunc => format!("{}({x})", if f { "truncf" } else { "trunc" }),
        Exp => format!("ember_exp({x})"),
        Expm1 => format!("{}({x})", if f { "expm1f" } else { "expm1" }),
        Log => format!("ember_log({x})"),
        Log1p => format!("{}({x})", if f { "log1pf" } else { "log1p" }),
        Sqrt => format!("ember_sqrt({x})"),
        Rsqrt => format!("ember_rsqrt({x})"),
        Recip => format!("{} / {x}", lit(1.0)),
        Sin => format!("{}({x})", if f { "sinf" } else { "sin" }),
        Cos => format!("{}({x})", if f { "cosf" } else { "cos" }),
        Tan => format!("{}({x})", if f { "tanf" } else { "tan" }),
        Tanh => format!("ember_tanh({x})"),
        Sigmoid => format!("ember_sigmoid({x})"),
        Erf => format!("ember_erf({x})"),
        Gelu => format!("ember_gelu({x})"),
        GeluTanh => format!("ember_gelu_tanh({x})"),
        Silu => format!("{x} * ember_sigmoid({x})"),
        Relu => format!("({x} < {0} ? {0} : {x})", lit(0.0)),
        Not => format!("({x} == {})", lit(0.0)),
        IsNan => format!("({x} != {x})"),
        IsInf => format!(
            "({x} == {0} || {x} == -{0})",
            if f { "EMBER_INF" } else { "EMBER_INF64" }
        ),
        BitNot => return None,
    })
}

fn binary_expr(op: BinaryOp, src: DType, a: &str, b: &str) -> Option<String> {
    use BinaryOp::*;
    let ct = compute_type(src);
    if op.is_comparison() {
        let c = match op {
            Eq => "==",
            Ne => "!=",
            Lt => "<",
            Le => "<=",
            Gt => ">",
            _ => ">=",
        };
        return Some(format!("({a} {c} {b})"));
    }
    if src == DType::Bool {
        return Some(match op {
            And | Mul | Min => format!("({a} && {b})"),
            Or | Add | Max => format!("({a} || {b})"),
            Xor | Ne => format!("({a} != {b})"),
            _ => return None,
        });
    }
    if !is_float(src) {
        return Some(match op {
            Add => format!("({ct})({a} + {b})"),
            Sub => format!("({ct})({a} - {b})"),
            Mul => format!("({ct})({a} * {b})"),
            Div => format!("ember_idiv<{ct}>({a}, {b})"),
            FloorDiv => format!("ember_ifloordiv<{ct}>({a}, {b})"),
            Rem => format!("ember_irem<{ct}>({a}, {b})"),
            Fmod => format!("ember_ifmod<{ct}>({a}, {b})"),
            Pow => format!("ember_ipow<{ct}>({a}, {b})"),
            Max => format!("ember_imax<{ct}>({a}, {b})"),
            Min => format!("ember_imin<{ct}>({a}, {b})"),
            And => format!("({ct})({a} & {b})"),
            Or => format!("({ct})({a} | {b})"),
            Xor => format!("({ct})({a} ^ {b})"),
            _ => return None,
        });
    }
    let f = ct == "float";
    Some(match op {
        Add => format!("{a} + {b}"),
        Sub => format!("{a} - {b}"),
        Mul => format!("{a} * {b}"),
        Div => format!("{a} / {b}"),
        FloorDiv => format!("ember_ffloordiv({a}, {b})"),
        Rem => format!("ember_frem({a}, {b})"),
        Fmod => format!("{}({a}, {b})", if f { "fmodf" } else { "fmod" }),
        Pow => format!("{}({a}, {b})", if f { "powf" } else { "pow" }),
        Max => format!("ember_fmax<{ct}>({a}, {b})"),
        Min => format!("ember_fmin<{ct}>({a}, {b})"),
        Atan2 => format!("{}({a}, {b})", if f { "atan2f" } else { "atan2" }),
        _ => return None,
    })
}

/// Converts a compute value of `from` into the compute value of `to` (rounding to `to`'s
/// precision, as storing and reloading would).
pub fn cast_expr(from: DType, to: DType, x: &str) -> String {
    let ct = compute_type(to);
    match (from.kind(), to.kind()) {
        (_, Kind::Bool) => format!("({x} != 0)"),
        // Saturated to int32 (int64 for int64), as the IR's `Cast` says.
        (Kind::Float, Kind::Int) if to == DType::I64 => format!("({ct})(i64)({x})"),
        (Kind::Float, Kind::Int) => format!("({ct})(int)({x})"),
        _ => match to {
            DType::F16 => format!("ember_h2f(ember_f2h((float)({x})))"),
            DType::BF16 => format!("ember_b2f(ember_f2b((float)({x})))"),
            _ => format!("({ct})({x})"),
        },
    }
}
