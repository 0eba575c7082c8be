//! Graph construction helpers shared by the frontends: explicit broadcasting, torch's type
//! promotion, scalar constants. Frontends speak in source terms (broadcasting binary ops,
//! Python scalars); this turns them into the IR's explicit form.

use crate::dim::{numel, Dim};
use crate::dtype::{result_type_full, DType, Scalar};
use crate::error::{Error, Result};
use crate::ir::{BinaryOp, Graph, Op, TensorType, UnaryOp, ValueId};

/// An operand of a source-level op: a tensor already in the graph, or a Python scalar.
#[derive(Clone, Copy, Debug)]
pub enum Operand {
    Tensor(ValueId),
    Scalar(Scalar),
}

/// Wraps a graph under construction with the name of the source node being translated,
/// so that every error names it.
pub struct Builder {
    pub g: Graph,
    pub origin: String,
    /// `dim_value` results: a symbolic size is counted once per graph, however many ops
    /// need it as a tensor (an LLM's layers each ask for the same lengths).
    dim_values: std::collections::HashMap<(Dim, DType), ValueId>,
}

impl Builder {
    pub fn new() -> Builder {
        Builder {
            g: Graph::new(),
            origin: String::new(),
            dim_values: std::collections::HashMap::new(),
        }
    }

    pub fn ty(&self, v: ValueId) -> &TensorType {
        self.g.ty(v)
    }

    pub fn dtype(&self, v: ValueId) -> DType {
        self.g.ty(v).dtype
    }

    pub fn shape(&self, v: ValueId) -> Vec<Dim> {
        self.g.ty(v).shape.clone()
    }

    pub fn rank(&self, v: ValueId) -> usize {
        self.g.ty(v).shape.len()
    }

    pub fn op(&mut self, op: Op, inputs: &[ValueId]) -> Result<ValueId> {
        let origin = self.origin.clone();
        self.g.add(op, inputs, &origin)
    }

    pub fn source(&mut self, op: Op, ty: TensorType) -> Result<ValueId> {
        let origin = self.origin.clone();
        self.g.add_source(op, ty, &origin)
    }

    /// A tensor of `shape` filled with `value` (as `dtype`).
    pub fn full(&mut self, value: Scalar, dtype: DType, shape: Vec<Dim>) -> Result<ValueId> {
        self.source(Op::Full { value }, TensorType::new(dtype, shape))
    }

    pub fn cast(&mut self, v: ValueId, to: DType) -> Result<ValueId> {
        if self.dtype(v) == to {
            return Ok(v);
        }
        self.op(Op::Cast { to }, &[v])
    }

    pub fn unary(&mut self, op: UnaryOp, v: ValueId) -> Result<ValueId> {
        self.op(Op::Unary(op), &[v])
    }

    pub fn reshape(&mut self, v: ValueId, shape: Vec<Dim>) -> Result<ValueId> {
        if self.g.ty(v).shape == shape {
            return Ok(v);
        }
        self.op(Op::Reshape { shape }, &[v])
    }

    pub fn permute(&mut self, v: ValueId, perm: Vec<usize>) -> Result<ValueId> {
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            return Ok(v);
        }
        self.op(Op::Permute { perm }, &[v])
    }

    /// Elements `start, start+step, … < end` of `axis`.
    pub fn slice(
        &mut self,
        v: ValueId,
        axis: usize,
        start: Dim,
        end: Dim,
        step: i64,
    ) -> Result<ValueId> {
        self.op(
            Op::Slice {
                axis,
                start,
                end,
                step,
            },
            &[v],
        )
    }

    /// `Concat` on `axis`, except that `[−x[h..2h], x[0..h]]` (rotary embeddings'
    /// `rotate_half`) becomes x's two halves swapped through a flip of a pair axis, times
    /// −1 on the first: one elementwise op over views (the same values, negation being
    /// exact), which a backend fuses with the rotation around it, where a concat is a copy
    /// of its own.
    pub fn concat(&mut self, vals: &[ValueId], axis: usize) -> Result<ValueId> {
        match self.rotated_half(vals, axis) {
            Some((x, half)) => self.swap_halves_negating_first(x, axis, half),
            None => self.op(Op::Concat { axis }, vals),
        }
    }

    /// `(x, h)` when `vals` are `[neg(x[h..2h]), x[0..h]]` along `axis`, x being 2h long.
    fn rotated_half(&self, vals: &[ValueId], axis: usize) -> Option<(ValueId, i64)> {
        let [first, second] = vals else {
            return None;
        };
        let neg = &self.g.nodes[*first];
        if !matches!(neg.op, Op::Unary(UnaryOp::Neg)) {
            return None;
        }
        let (upper, lower) = (&self.g.nodes[neg.inputs[0]], &self.g.nodes[*second]);
        let bounds = |op: &Op| match op {
            Op::Slice {
                axis: a,
                start,
                end,
                step: 1,
            } if *a == axis => Some((start.as_const()?, end.as_const()?)),
            _ => None,
        };
        let (x, half) = (lower.inputs[0], bounds(&lower.op)?.1);
        let whole = self.g.ty(x).shape.get(axis)?.as_const()?;
        // Floats only: the sign is a float constant (and −x of an unsigned value wraps).
        let fits = upper.inputs[0] == x
            && self.dtype(x).is_float()
            && bounds(&lower.op)? == (0, half)
            && bounds(&upper.op)? == (half, 2 * half)
            && whole == 2 * half
            && half > 0;
        fits.then_some((x, half))
    }

    /// x (2·`half` long on `axis`) with its halves swapped, the first negated.
    fn swap_halves_negating_first(
        &mut self,
        x: ValueId,
        axis: usize,
        half: i64,
    ) -> Result<ValueId> {
        let shape = self.shape(x);
        let mut paired = shape[..axis].to_vec();
        paired.extend([Dim::Const(2), Dim::Const(half)]);
        paired.extend_from_slice(&shape[axis + 1..]);
        let pairs = self.reshape(x, paired)?;
        let swapped = self.swap_pairs_negating_first(pairs, axis)?;
        self.reshape(swapped, shape)
    }

    /// `pairs` (2 long on `axis`, a float tensor) with the two members of each pair
    /// swapped and the first negated, `(a, b) → (−b, a)`: a flip of `axis` (a view) times
    /// (−1, 1), the rotation by a quarter turn that rotary embeddings apply.
    pub fn swap_pairs_negating_first(&mut self, pairs: ValueId, axis: usize) -> Result<ValueId> {
        let shape = self.shape(pairs);
        let swapped = self.op(Op::Flip { axes: vec![axis] }, &[pairs])?;
        let sign = self.source(
            Op::Iota {
                start: Scalar::Float(-1.0),
                step: Scalar::Float(2.0),
            },
            TensorType::new(self.dtype(pairs), vec![Dim::Const(2)]),
        )?;
        let mut sign_shape = vec![Dim::Const(1); shape.len()];
        sign_shape[axis] = Dim::Const(2);
        let sign = self.reshape(sign, sign_shape)?;
        let sign = self.broadcast_to(sign, &shape)?;
        self.op(Op::Binary(BinaryOp::Mul), &[swapped, sign])
    }

    /// numpy/torch `matmul` for any ranks ≥ 1, built from `Dot` with explicit broadcasting:
    /// 1-D operands gain (then lose) a unit dim; batch dims broadcast.
    pub fn matmul(&mut self, x: ValueId, y: ValueId) -> Result<ValueId> {
        self.matmul_with(Op::Dot, x, y)
    }

    /// `matmul` of 8-bit integers into int32 (`Op::IntegerDot`), numpy's shape rules.
    pub fn integer_matmul(&mut self, x: ValueId, y: ValueId) -> Result<ValueId> {
        self.matmul_with(Op::IntegerDot, x, y)
    }

    /// numpy `matmul` shapes around a product node `dot` (`Dot` or `IntegerDot`).
    fn matmul_with(&mut self, dot: Op, x: ValueId, y: ValueId) -> Result<ValueId> {
        let b = self;
        if dot == Op::Dot && b.dtype(x) != b.dtype(y) {
            return Err(Error::Compile(format!(
                "matmul of {} and {} at node '{}' (torch requires equal dtypes)",
                b.dtype(x),
                b.dtype(y),
                b.origin
            )));
        }
        let (rx, ry) = (b.rank(x), b.rank(y));
        if rx == 0 || ry == 0 {
            return Err(Error::Shape(format!(
                "matmul of a 0-d tensor at node '{}'",
                b.origin
            )));
        }
        // Vectors become matrices, and the added dim is dropped at the end.
        let mut xs = b.shape(x);
        let mut ys = b.shape(y);
        let x_vec = rx == 1;
        let y_vec = ry == 1;
        if x_vec {
            xs.insert(0, Dim::Const(1));
        }
        if y_vec {
            ys.push(Dim::Const(1));
        }
        let x = b.reshape(x, xs.clone())?;
        let y = b.reshape(y, ys.clone())?;
        let (m, k) = (xs[xs.len() - 2].clone(), xs[xs.len() - 1].clone());
        let nn = ys[ys.len() - 1].clone();
        let k2 = &ys[ys.len() - 2];
        if k.provably_equal(k2) == Some(false) {
            return Err(Error::Shape(format!(
                "matmul of {} and {}: inner dims {k} and {k2} differ at node '{}'",
                crate::dim::format_shape(&xs),
                crate::dim::format_shape(&ys),
                b.origin
            )));
        }
        let out = if ys.len() == 2 {
            // [..., M, K] @ [K, N]: fold the leading dims into M; the weight stays 2-D.
            let lead = xs[..xs.len() - 2].to_vec();
            let rows = numel(&[numel(&lead), m.clone()]);
            let x2 = b.reshape(x, vec![rows, k])?;
            let d = b.op(dot, &[x2, y])?;
            let mut shape = lead;
            shape.extend([m, nn.clone()]);
            b.reshape(d, shape)?
        } else {
            let batch = broadcast_shapes(&xs[..xs.len() - 2], &ys[..ys.len() - 2])?;
            let mut xt = batch.clone();
            xt.extend([m.clone(), k.clone()]);
            let mut yt = batch.clone();
            yt.extend([k2.clone(), nn.clone()]);
            let x = b.broadcast_to(x, &xt)?;
            let y = b.broadcast_to(y, &yt)?;
            b.op(dot, &[x, y])?
        };
        let mut shape = b.shape(out);
        if y_vec {
            shape.pop();
        }
        if x_vec {
            let r = shape.len();
            shape.remove(r - if y_vec { 1 } else { 2 });
        }
        b.reshape(out, shape)
    }

    /// numpy-style broadcasting of `v` to `shape` (leading dims added by reshape).
    pub fn broadcast_to(&mut self, v: ValueId, shape: &[Dim]) -> Result<ValueId> {
        let cur = self.shape(v);
        if cur.as_slice() == shape {
            return Ok(v);
        }
        if cur.len() > shape.len() {
            return Err(Error::Shape(format!(
                "cannot broadcast {} to {} at node '{}'",
                crate::dim::format_shape(&cur),
                crate::dim::format_shape(shape),
                self.origin
            )));
        }
        let mut padded = vec![Dim::Const(1); shape.len() - cur.len()];
        padded.extend(cur);
        let v = self.reshape(v, padded.clone())?;
        if padded.as_slice() == shape {
            return Ok(v);
        }
        self.op(
            Op::Expand {
                shape: shape.to_vec(),
            },
            &[v],
        )
    }

    /// Broadcasts each operand tensor to their common shape; scalars become full tensors.
    pub fn broadcast_all(&mut self, vals: &[ValueId]) -> Result<Vec<ValueId>> {
        let mut shape: Vec<Dim> = Vec::new();
        for &v in vals {
            shape = broadcast_shapes(&shape, &self.shape(v))
                .map_err(|e| Error::Shape(format!("{e} at node '{}'", self.origin)))?;
        }
        vals.iter().map(|&v| self.broadcast_to(v, &shape)).collect()
    }

    /// torch's result type of a set of operands.
    pub fn result_type(&self, operands: &[Operand]) -> DType {
        let mut dims = Vec::new();
        let mut zero = Vec::new();
        let mut scalars = Vec::new();
        for o in operands {
            match *o {
                Operand::Tensor(v) if self.rank(v) == 0 => zero.push(self.dtype(v)),
                Operand::Tensor(v) => dims.push(self.dtype(v)),
                Operand::Scalar(s) => scalars.push(s),
            }
        }
        result_type_full(&dims, &zero, &scalars)
    }

    /// Materializes an operand as a tensor of `dtype` (scalars become 0-d `Full`s).
    pub fn operand(&mut self, o: Operand, dtype: DType) -> Result<ValueId> {
        match o {
            Operand::Tensor(v) => self.cast(v, dtype),
            Operand::Scalar(s) => self.full(s, dtype, vec![]),
        }
    }

    /// A broadcasting binary op computed in `dtype` (operands are cast to it first).
    pub fn binary_in(
        &mut self,
        op: BinaryOp,
        a: Operand,
        b: Operand,
        dtype: DType,
    ) -> Result<ValueId> {
        let a = self.operand(a, dtype)?;
        let b = self.operand(b, dtype)?;
        let v = self.broadcast_all(&[a, b])?;
        self.op(Op::Binary(op), &[v[0], v[1]])
    }

    /// A broadcasting binary op with torch's type promotion.
    pub fn binary(&mut self, op: BinaryOp, a: Operand, b: Operand) -> Result<ValueId> {
        let dtype = self.result_type(&[a, b]);
        self.binary_in(op, a, b, dtype)
    }

    pub fn where_(&mut self, cond: ValueId, a: Operand, b: Operand) -> Result<ValueId> {
        let dtype = self.result_type(&[a, b]);
        let cond = self.cast(cond, DType::Bool)?;
        let a = self.operand(a, dtype)?;
        let b = self.operand(b, dtype)?;
        let v = self.broadcast_all(&[cond, a, b])?;
        self.op(Op::Where, &v)
    }

    /// Grouped-query attention: each k/v head (dim `rank - 3`) repeated `q_heads / kv_heads`
    /// times, as a view.
    pub fn repeat_heads(&mut self, v: ValueId, q_heads: &Dim) -> Result<ValueId> {
        let shape = self.shape(v);
        let r = shape.len();
        if r < 3 || &shape[r - 3] == q_heads {
            return Ok(v);
        }
        let (hk, hq) = match (shape[r - 3].as_const(), q_heads.as_const()) {
            (Some(a), Some(b)) if a > 0 && b % a == 0 => (a, b),
            _ => {
                return Err(Error::Shape(format!(
                    "attention with {} kv heads for {q_heads} query heads at node '{}'",
                    shape[r - 3],
                    self.origin
                )))
            }
        };
        let mut split = shape[..r - 2].to_vec();
        split.push(Dim::Const(1));
        split.extend(shape[r - 2..].iter().cloned());
        let v = self.reshape(v, split.clone())?;
        let mut wide = split;
        wide[r - 2] = Dim::Const(hq / hk);
        let v = self.broadcast_to(v, &wide)?;
        let mut merged = shape.clone();
        merged[r - 3] = Dim::Const(hq);
        self.reshape(v, merged)
    }

    /// Sum over `axes` divided by the number of reduced elements.
    pub fn mean(&mut self, v: ValueId, axes: Vec<usize>, keepdim: bool) -> Result<ValueId> {
        let shape = self.shape(v);
        let count = numel(&axes.iter().map(|&a| shape[a].clone()).collect::<Vec<_>>());
        let dtype = self.dtype(v);
        let sum = self.op(
            Op::Reduce {
                op: crate::ir::ReduceOp::Sum,
                axes,
                keepdim,
            },
            &[v],
        )?;
        let n = self.dim_value(&count, dtype)?;
        self.binary_in(
            BinaryOp::Div,
            Operand::Tensor(sum),
            Operand::Tensor(n),
            dtype,
        )
    }

    /// A 0-d tensor holding the value of a dim (constant, or computed from a symbolic shape).
    pub fn dim_value(&mut self, d: &Dim, dtype: DType) -> Result<ValueId> {
        let key = (d.clone(), dtype);
        if let Some(&v) = self.dim_values.get(&key) {
            return Ok(v);
        }
        let v = self.count_dim(d, dtype)?;
        self.dim_values.insert(key, v);
        Ok(v)
    }

    fn count_dim(&mut self, d: &Dim, dtype: DType) -> Result<ValueId> {
        match d.as_const() {
            Some(c) => self.full(Scalar::Int(c), dtype, vec![]),
            None => {
                // Count the elements of a ones tensor of that length: exact for any size.
                let ones = self.full(Scalar::Int(1), DType::I64, vec![d.clone()])?;
                let n = self.op(
                    Op::Reduce {
                        op: crate::ir::ReduceOp::Sum,
                        axes: vec![0],
                        keepdim: false,
                    },
                    &[ones],
                )?;
                self.cast(n, dtype)
            }
        }
    }
}

impl Default for Builder {
    fn default() -> Self {
        Builder::new()
    }
}

/// numpy broadcasting of two shapes. Symbolic dims are assumed equal unless one is 1; the
/// run-time shape check catches a wrong assumption.
pub fn broadcast_shapes(a: &[Dim], b: &[Dim]) -> Result<Vec<Dim>> {
    let n = a.len().max(b.len());
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let x = if i + a.len() >= n {
            Some(&a[i + a.len() - n])
        } else {
            None
        };
        let y = if i + b.len() >= n {
            Some(&b[i + b.len() - n])
        } else {
            None
        };
        out.push(match (x, y) {
            (Some(x), None) => x.clone(),
            (None, Some(y)) => y.clone(),
            (Some(x), Some(y)) => {
                if x.as_const() == Some(1) {
                    y.clone()
                } else if y.as_const() == Some(1) || x == y {
                    x.clone()
                } else if let (Some(p), Some(q)) = (x.as_const(), y.as_const()) {
                    return Err(Error::Shape(format!(
                        "shapes {} and {} do not broadcast ({p} vs {q})",
                        crate::dim::format_shape(a),
                        crate::dim::format_shape(b)
                    )));
                } else if x.is_const() {
                    x.clone()
                } else {
                    y.clone()
                }
            }
            (None, None) => unreachable!("i < max(len)"),
        });
    }
    Ok(out)
}

/// Normalizes a possibly negative axis for a tensor of `rank` (rank 0 accepts -1 and 0).
pub fn norm_axis(axis: i64, rank: usize, origin: &str) -> Result<usize> {
    let r = rank.max(1) as i64;
    let a = if axis < 0 { axis + r } else { axis };
    if a < 0 || a >= r {
        return Err(Error::Shape(format!(
            "dimension {axis} out of range for a tensor of rank {rank} at node '{origin}'"
        )));
    }
    Ok(a as usize)
}
