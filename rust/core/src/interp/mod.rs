//! The reference interpreter: slow, simple, and the oracle every backend and rewrite is
//! tested against. It implements docs/IR.md literally: floats are computed in f64 and
//! integers in wrapping i64, and every node's result is rounded (floats, to nearest even;
//! f16/bf16 through f32 as torch does) or wrapped (integers) to the node's dtype.
//!
//! It never panics on a graph or on data: malformed graphs are rejected by `ir::verify`,
//! shapes by `shapes::resolve`, and everything that depends on values (indices out of range,
//! the max of nothing) is an `Error::Runtime` naming the op and the node.

mod elementwise;
mod erf;
mod linalg;
mod movement;
mod reduce;
mod value;
mod window;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_ops;

use std::borrow::Cow;
use std::collections::BTreeMap;

pub use erf::erf;
pub use value::{round_float, wrap_int, Data, Value};

use crate::backend::{Backend, Executable, Weights};
use crate::dtype::{DType, Scalar};
use crate::error::{Error, Result};
use crate::ir::{verify, Graph, Node, Op};
use crate::shapes::{resolve, Resolved};
use crate::tensor::{HostTensor, TensorOut, TensorView};

/// Errors inside an op, before the op and node are named.
pub(crate) type R<T> = std::result::Result<T, String>;

/// Runs the graph. Weights are looked up by name in `weights` (converted on each call; use
/// `ReferenceBackend` or `run_bound` to convert them once).
pub fn run(graph: &Graph, weights: &Weights, inputs: &[Value]) -> Result<Vec<Value>> {
    verify(graph)?;
    let bound = bind_weights(graph, weights)?;
    execute(graph, &bound, inputs)
}

/// Runs the graph with weights already converted to values.
pub fn run_bound(
    graph: &Graph,
    weights: &BTreeMap<String, Value>,
    inputs: &[Value],
) -> Result<Vec<Value>> {
    verify(graph)?;
    // `execute` trusts weights (they are checked where they are bound); these were built
    // by the caller.
    for (name, v) in weights {
        v.check()
            .map_err(|m| Error::Input(format!("weight '{name}': {m}")))?;
    }
    execute(graph, weights, inputs)
}

/// Converts the weights the graph reads into values.
fn bind_weights(graph: &Graph, weights: &Weights) -> Result<BTreeMap<String, Value>> {
    let mut bound = BTreeMap::new();
    for (name, _) in graph.weights() {
        if bound.contains_key(name) {
            continue;
        }
        let t: &HostTensor = weights
            .get(name)
            .ok_or_else(|| Error::Compile(format!("weight '{name}' is not bound")))?;
        let v = Value::from_bytes(t.dtype, t.shape.clone(), t.bytes())
            .map_err(|e| Error::Compile(format!("weight '{name}': {e}")))?;
        bound.insert(name.to_string(), v);
    }
    Ok(bound)
}

/// Runs a verified graph.
fn execute(
    graph: &Graph,
    weights: &BTreeMap<String, Value>,
    inputs: &[Value],
) -> Result<Vec<Value>> {
    for (k, v) in inputs.iter().enumerate() {
        v.check()
            .map_err(|m| Error::Input(format!("input {k}: {m}")))?;
    }
    let shapes: Vec<Vec<usize>> = inputs.iter().map(|v| v.shape.clone()).collect();
    let resolved = resolve(graph, &shapes)?;

    // Transposes only products read (a linear layer's `x · wᵀ`) are never made: the
    // product reads their input as stored.
    let deferred = deferred_transposes(graph);
    // Free each value after its last use; outputs live to the end.
    let mut last_use: Vec<usize> = (0..graph.nodes.len()).collect();
    for (id, node) in graph.nodes.iter().enumerate() {
        for &i in &node.inputs {
            last_use[i] = id;
            if let Some(src) = deferred[i] {
                last_use[src] = id;
            }
        }
    }
    for &o in &graph.outputs {
        last_use[o] = usize::MAX;
    }

    let mut vals: Vec<Option<Cow<Value>>> = vec![None; graph.nodes.len()];
    for (id, node) in graph.nodes.iter().enumerate() {
        let fail = |m: String| {
            Error::Runtime(format!("{} at node '{}': {m}", node.op.name(), node.origin))
        };
        if deferred[id].is_some() {
            continue;
        }
        let transposed = node.inputs.get(1).and_then(|&b| deferred[b]);
        let out = if let Some(src) = transposed {
            let value = |i: usize| {
                vals.get(i)
                    .and_then(|v| v.as_deref())
                    .ok_or_else(|| fail(format!("input %{i} has no value")))
            };
            let product = linalg::dot_transposed(value(node.inputs[0])?, value(src)?);
            Cow::Owned(product.map_err(fail)?)
        } else {
            let mut args = Vec::with_capacity(node.inputs.len());
            for &i in &node.inputs {
                let v = vals.get(i).and_then(|v| v.as_deref());
                args.push(v.ok_or_else(|| fail(format!("input %{i} has no value")))?);
            }
            eval_node(node, &args, &resolved, id, weights, inputs).map_err(fail)?
        };
        // Inputs were checked on entry and weights as they were bound; a view re-indexes
        // its input, whose elements were checked as they were made.
        let checked_already = matches!(node.op, Op::Input { .. } | Op::Weight { .. })
            || node.op.semantics().is_view();
        if checked_already {
            out.check_layout().map_err(fail)?;
        } else {
            out.check().map_err(fail)?;
        }
        let want = &resolved.shapes[id];
        if out.dtype != node.ty.dtype || &out.shape != want {
            return Err(fail(format!(
                "produced {} {:?}, but the graph says {} {want:?}",
                out.dtype, out.shape, node.ty.dtype
            )));
        }
        vals[id] = Some(out);
        let sources = node.inputs.iter().filter_map(|&i| deferred[i]);
        for i in node.inputs.iter().copied().chain(sources).chain([id]) {
            if last_use[i] == id {
                vals[i] = None;
            }
        }
    }
    graph
        .outputs
        .iter()
        .map(|&o| {
            vals.get(o)
                .and_then(|v| v.as_deref())
                .cloned()
                .ok_or_else(|| Error::Runtime(format!("output %{o} has no value")))
        })
        .collect()
}

/// For each node, the input it transposes where it is a swap of the last two axes that
/// only products read, and only as their right operand (`Dot(x, Permute(w))`, a linear
/// layer): `execute` skips it and those products read the input transposed in place.
fn deferred_transposes(graph: &Graph) -> Vec<Option<usize>> {
    let swaps_last_two = |perm: &[usize]| {
        let r = perm.len();
        r >= 2
            && perm[..r - 2].iter().enumerate().all(|(i, &p)| i == p)
            && perm[r - 2] == r - 1
            && perm[r - 1] == r - 2
    };
    let mut deferred: Vec<Option<usize>> = graph
        .nodes
        .iter()
        .map(|n| match &n.op {
            Op::Permute { perm } if swaps_last_two(perm) => Some(n.inputs[0]),
            _ => None,
        })
        .collect();
    for node in &graph.nodes {
        let product = matches!(node.op.base(), Op::Dot);
        for (k, &i) in node.inputs.iter().enumerate() {
            if !(product && k == 1) {
                deferred[i] = None;
            }
        }
    }
    for &o in &graph.outputs {
        deferred[o] = None;
    }
    deferred
}

fn one<'v>(args: &[&'v Value], n: usize) -> R<&'v Value> {
    args.get(n)
        .copied()
        .ok_or_else(|| format!("missing operand {n}"))
}

fn dim(resolved: &Resolved, d: &crate::dim::Dim) -> R<i64> {
    resolved.dim(d).map_err(|e| e.to_string())
}

/// Evaluates one node on its operands.
fn eval_node<'a>(
    node: &Node,
    args: &[&Value],
    resolved: &Resolved,
    id: usize,
    weights: &'a BTreeMap<String, Value>,
    inputs: &'a [Value],
) -> R<Cow<'a, Value>> {
    use elementwise as ew;
    if let Op::Kernel { base, .. } = &node.op {
        // A backend's kernel choice does not change what the node computes.
        let plain = Node {
            op: (**base).clone(),
            ..node.clone()
        };
        return eval_node(&plain, args, resolved, id, weights, inputs);
    }
    let x = || one(args, 0);
    let dtype = node.ty.dtype;
    let shape = resolved.shapes[id].clone();
    let owned = match &node.op {
        Op::Input { index } => {
            let v = inputs.get(*index).ok_or("no such input")?;
            if v.dtype != dtype {
                return Err(format!("input {index} is {}, expected {dtype}", v.dtype));
            }
            return Ok(Cow::Borrowed(v));
        }
        Op::Weight { name } => {
            let v = weights.get(name).ok_or("weight is not bound")?;
            if v.dtype != dtype || v.shape != shape {
                return Err(format!(
                    "weight '{name}' is {} {:?}, expected {dtype} {shape:?}",
                    v.dtype, v.shape
                ));
            }
            return Ok(Cow::Borrowed(v));
        }
        Op::Constant(c) => {
            Value::from_bytes(dtype, c.shape.clone(), &c.bytes).map_err(|e| e.to_string())?
        }
        Op::Full { value } => {
            let n = value::checked_numel(&shape).ok_or("shape overflows")?;
            Value::splat(dtype, shape, n, *value)
        }
        Op::Iota { start, step } => iota(dtype, &shape, *start, *step)?,
        Op::Unary(u) => ew::unary(*u, x()?)?,
        Op::Binary(b) => ew::binary(*b, x()?, one(args, 1)?)?,
        Op::Where => ew::where_(x()?, one(args, 1)?, one(args, 2)?)?,
        Op::Cast { to } => ew::cast(*to, x()?),
        Op::Reduce { op, axes, keepdim } => reduce::reduce(*op, axes, *keepdim, x()?)?,
        Op::Dot => linalg::dot(x()?, one(args, 1)?)?,
        Op::IntegerDot => linalg::integer_dot(x()?, one(args, 1)?)?,
        Op::BlockQuantDot { bits, block } => linalg::block_quant_dot(
            x()?,
            one(args, 1)?,
            one(args, 2)?,
            one(args, 3)?,
            *bits,
            *block,
        )?,
        Op::Reshape { .. } => movement::reshape(x()?, &shape)?,
        Op::Permute { perm } => movement::permute(x()?, perm)?,
        Op::Expand { .. } => movement::expand(x()?, &shape)?,
        Op::Slice {
            axis,
            start,
            end,
            step,
        } => movement::slice(
            x()?,
            *axis,
            dim(resolved, start)?,
            dim(resolved, end)?,
            *step,
        )?,
        Op::Flip { axes } => movement::flip(x()?, axes)?,
        Op::Pad { pads, value } => movement::pad(x()?, pads, *value)?,
        Op::Concat { axis } => movement::concat(args, *axis)?,
        Op::CacheAppend { axis, .. } => {
            movement::cache_append(x()?, one(args, 1)?, one(args, 2)?, *axis, shape[*axis])?
        }
        Op::Gather { axis } => movement::gather(x()?, *axis, one(args, 1)?)?,
        Op::IndexSelect { axis } => movement::index_select(x()?, *axis, one(args, 1)?)?,
        Op::Scatter { axis, reduce } => {
            movement::scatter(x()?, *axis, one(args, 1)?, one(args, 2)?, *reduce)?
        }
        Op::Scan { axis, op } => reduce::scan(*axis, *op, x()?)?,
        Op::Argsort { axis, descending } => reduce::argsort(*axis, *descending, x()?)?,
        Op::GroupedDot => linalg::grouped_dot(x()?, one(args, 1)?, one(args, 2)?)?,
        Op::Softmax { axis, log } => reduce::softmax(*axis, *log, x()?)?,
        Op::LayerNorm {
            axis,
            eps,
            has_weight,
            has_bias,
        } => {
            let w = has_weight.then(|| one(args, 1)).transpose()?;
            let b = has_bias
                .then(|| one(args, 1 + *has_weight as usize))
                .transpose()?;
            reduce::layer_norm(*axis, *eps, x()?, w, b)?
        }
        Op::RmsNorm {
            axis,
            eps,
            has_weight,
        } => {
            let w = has_weight.then(|| one(args, 1)).transpose()?;
            reduce::rms_norm(*axis, *eps, x()?, w)?
        }
        Op::Attention {
            scale,
            causal,
            has_mask,
        } => {
            let mask = has_mask.then(|| one(args, 3)).transpose()?;
            linalg::attention(x()?, one(args, 1)?, one(args, 2)?, mask, *scale, *causal)?
        }
        Op::Kernel { .. } => return Err("internal: a kernel node reached the op switch".into()),
        Op::Conv {
            stride,
            padding,
            dilation,
            groups,
            has_bias,
        } => {
            let bias = has_bias.then(|| one(args, 2)).transpose()?;
            let p = window::ConvParams {
                stride,
                padding,
                dilation,
                groups: *groups,
            };
            window::conv(x()?, one(args, 1)?, bias, &p)?
        }
        Op::Pool {
            kind,
            kernel,
            stride,
            padding,
            dilation,
            ceil_mode,
        } => window::pool(
            x()?,
            &window::PoolParams {
                kind: *kind,
                kernel,
                stride,
                padding,
                dilation,
                ceil_mode: *ceil_mode,
            },
        )?,
    };
    Ok(Cow::Owned(owned))
}

/// `start + step * i`, in i64 for integer (and bool) dtypes and in f64 for floats.
fn iota(dtype: DType, shape: &[usize], start: Scalar, step: Scalar) -> R<Value> {
    let &[n] = shape else {
        return Err(format!("iota must be 1-D, got shape {shape:?}"));
    };
    let data = if dtype.is_float() {
        let (a, d) = (start.as_f64(), step.as_f64());
        Data::F((0..n).map(|i| a + d * i as f64).collect())
    } else {
        let (a, d) = (start.as_i64(), step.as_i64());
        Data::I(
            (0..n)
                .map(|i| a.wrapping_add(d.wrapping_mul(i as i64)))
                .collect(),
        )
    };
    Ok(Value::from_data(dtype, vec![n], data))
}

/// The interpreter as a backend (name "reference"), so that callers can run graphs through
/// it for testing.
#[derive(Clone, Copy, Debug, Default)]
pub struct ReferenceBackend;

impl Backend for ReferenceBackend {
    fn name(&self) -> &'static str {
        "reference"
    }

    fn compile(&self, graph: &Graph, weights: &Weights) -> Result<Box<dyn Executable>> {
        verify(graph)?;
        let weights = bind_weights(graph, weights)?;
        Ok(Box::new(ReferenceExecutable {
            graph: graph.clone(),
            weights,
        }))
    }
}

/// A graph and its weights (converted once at compile time).
struct ReferenceExecutable {
    graph: Graph,
    weights: BTreeMap<String, Value>,
}

/// Copies a strided view into a value.
///
/// # Safety
/// The view must be valid for reads over its shape and strides.
unsafe fn read_view(k: usize, view: &TensorView) -> Result<Value> {
    let bad = |m: String| Error::Input(format!("input {k}: {m}"));
    if view.strides.len() != view.shape.len() {
        return Err(bad(format!(
            "{} strides for shape {:?}",
            view.strides.len(),
            view.shape
        )));
    }
    let size = view.dtype.size();
    let n = value::checked_numel(&view.shape)
        .and_then(|n| n.checked_mul(size))
        .ok_or_else(|| bad("shape overflows".into()))?;
    let mut bytes = Vec::with_capacity(n);
    value::try_for_each_index(&view.shape, |idx| {
        let mut off = 0usize;
        for (&i, &s) in idx.iter().zip(&view.strides) {
            off = i
                .checked_mul(s)
                .and_then(|x| off.checked_add(x))
                .ok_or("offset overflows")?;
        }
        let byte = off.checked_mul(size).ok_or("offset overflows")?;
        // SAFETY: the caller guarantees the view is readable over its shape and strides.
        let src = unsafe { std::slice::from_raw_parts(view.ptr.add(byte), size) };
        bytes.extend_from_slice(src);
        Ok::<(), &str>(())
    })
    .map_err(|m| bad(m.into()))?;
    Value::from_bytes(view.dtype, view.shape.clone(), &bytes)
}

impl Executable for ReferenceExecutable {
    fn output_shapes(&self, input_shapes: &[Vec<usize>]) -> Result<Vec<Vec<usize>>> {
        let r = resolve(&self.graph, input_shapes)?;
        Ok(self
            .graph
            .outputs
            .iter()
            .map(|&o| r.shapes[o].clone())
            .collect())
    }

    unsafe fn run(&self, inputs: &[TensorView], outputs: &[TensorOut]) -> Result<()> {
        let mut vals = Vec::with_capacity(inputs.len());
        for (k, view) in inputs.iter().enumerate() {
            if let Some(&id) = self.graph.inputs.get(k) {
                let want = self.graph.nodes[id].ty.dtype;
                if view.dtype != want {
                    return Err(Error::Input(format!(
                        "input {k} ('{}') should be {want}, got {}",
                        self.graph.nodes[id].origin, view.dtype
                    )));
                }
            }
            // SAFETY: forwarded from this function's contract.
            vals.push(unsafe { read_view(k, view)? });
        }
        let results = execute(&self.graph, &self.weights, &vals)?;
        if outputs.len() != results.len() {
            return Err(Error::Input(format!(
                "expected {} output buffers, got {}",
                results.len(),
                outputs.len()
            )));
        }
        for (k, (out, v)) in outputs.iter().zip(&results).enumerate() {
            if out.dtype != v.dtype || out.shape != v.shape {
                return Err(Error::Input(format!(
                    "output {k} is {} {:?}, but its buffer is {} {:?}",
                    v.dtype, v.shape, out.dtype, out.shape
                )));
            }
            let bytes = v.to_bytes();
            // SAFETY: the caller guarantees the buffer holds the full output and does not
            // alias any input.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.ptr, bytes.len()) };
        }
        Ok(())
    }
}
