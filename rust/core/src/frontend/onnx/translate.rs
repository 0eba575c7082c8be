//! Walks an ONNX graph and builds the IR graph: inputs with symbolic dims, initializers as
//! weights (small ones as constants), one handler per node, outputs checked against the
//! types the model declares.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use super::external::ExternalData;
use super::fold;
use super::functions::{self, Functions};
use super::known::{self, Known};
use super::node::Node;
use super::ops;
use super::proto::{self, ModelProto, ValueInfoProto};
use super::tensor::{self, Decoded};
use crate::backend::Weights;
use crate::dim::{format_shape, Dim, SymbolRange};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::frontend::builder::Builder;
use crate::frontend::pt2::Pt2Program;
use crate::ir::{verify, ConstData, Graph, Op, TensorType, ValueId};
use crate::tensor::HostTensor;

/// The ai.onnx opsets Ember translates.
pub const MIN_OPSET: i64 = 13;
pub const MAX_OPSET: i64 = 25;

/// Initializers up to this many elements become IR constants; larger ones are weights.
const MAX_CONST_ELEMS: usize = 64;

/// Integer vectors up to this length are tracked as known values (shape folding).
const MAX_KNOWN_ELEMS: usize = 4096;

/// Where a model comes from.
pub enum Source<'a> {
    Path(&'a Path),
    Bytes(&'a [u8]),
}

/// One ONNX value during translation: an IR value (made on first use), for small integer
/// tensors the values themselves, and for initializers their data. Initializers and known
/// values enter the IR graph only when an op needs them as tensors, so shape constants and
/// unused initializers leave no nodes behind.
#[derive(Clone, Debug, Default)]
pub struct Val {
    pub id: Option<ValueId>,
    pub known: Option<Known>,
    init: Option<Arc<Initializer>>,
}

#[derive(Debug)]
struct Initializer {
    name: String,
    data: Decoded,
}

impl Val {
    pub fn of(id: ValueId) -> Val {
        Val {
            id: Some(id),
            ..Val::default()
        }
    }

    pub fn known(k: Known) -> Val {
        Val {
            known: Some(k),
            ..Val::default()
        }
    }
}

/// Translation state shared by the op handlers.
pub struct Ctx {
    pub b: Builder,
    values: HashMap<String, Val>,
    /// Initializers that became weights, by name.
    weights: Weights,
    weight_specs: Vec<(String, DType, Vec<usize>)>,
    /// Float values `DequantizeLinear` made from 8-bit integers, by IR value: a product of
    /// two of them runs on the integers (`ops::quant::dequantized_product`).
    pub dequantized: HashMap<ValueId, Dequantized>,
    /// The IR value of each initializer that became a weight, by name: a subgraph run once
    /// per loop iteration binds its initializers again and must not add them twice.
    weight_ids: HashMap<String, ValueId>,
    /// Where external tensor data lives (initializers of subgraphs are read as translated).
    ext: ExternalData,
    opset: i64,
    functions: Arc<Functions>,
    /// How many function calls enclose the node being translated.
    call_depth: usize,
    /// Tensors that translations derive alike for many nodes (the per-sequence masks of
    /// each layer's GroupQueryAttention), by a key naming what they are made from.
    shared: HashMap<String, ValueId>,
}

/// Function calls nest at most this deep (deeper means a recursive function).
const MAX_CALL_DEPTH: usize = 64;

/// `(q - zero) · scale`: a float value dequantized from the 8-bit integers `q`, its scale
/// and zero point shaped to broadcast against `q` (0-d per tensor).
#[derive(Clone, Copy, Debug)]
pub struct Dequantized {
    pub q: ValueId,
    pub scale: ValueId,
    pub zero: Option<ValueId>,
}

impl Ctx {
    fn get(&self, name: &str) -> Result<&Val> {
        self.values.get(name).ok_or_else(|| {
            Error::Compile(format!(
                "node '{}' uses '{name}', which no earlier node or graph input defines",
                self.b.origin
            ))
        })
    }

    /// The IR value of `name`, materializing known values as constants on first use.
    pub fn value(&mut self, name: &str) -> Result<ValueId> {
        let val = self.get(name)?.clone();
        let id = self.id_of(&val)?;
        self.values.get_mut(name).expect("checked").id = Some(id);
        Ok(id)
    }

    /// The IR value of `val`, materializing a known value or initializer.
    pub fn id_of(&mut self, val: &Val) -> Result<ValueId> {
        if let Some(id) = val.id {
            return Ok(id);
        }
        match (&val.init, &val.known) {
            (Some(init), _) => self.initializer(init),
            (None, Some(k)) => self.materialize(k),
            (None, None) => unreachable!("a value is an IR value, an initializer or known"),
        }
    }

    /// The value bound to `name` (for ops that pass values on without looking at them).
    pub fn val(&self, name: &str) -> Result<Val> {
        self.get(name).cloned()
    }

    /// Small initializers become constants (visible to the optimizer), the others weights.
    fn initializer(&mut self, init: &Initializer) -> Result<ValueId> {
        let d = &init.data;
        let numel: usize = d.shape.iter().product();
        if numel <= MAX_CONST_ELEMS {
            return self.constant(d.dtype, d.shape.clone(), d.bytes.clone());
        }
        self.weight(&init.name, || Ok(d.clone()))
    }

    /// The weight `name`, made from `data()` the first time it is asked for (an initializer,
    /// or a tensor a translation computes from initializers, such as dequantized weights).
    pub fn weight(
        &mut self,
        name: &str,
        data: impl FnOnce() -> Result<Decoded>,
    ) -> Result<ValueId> {
        if let Some(&id) = self.weight_ids.get(name) {
            return Ok(id);
        }
        let d = data()?;
        let ty = TensorType::new(d.dtype, d.shape.iter().map(|&s| Dim::from(s)).collect());
        self.weight_specs
            .push((name.to_string(), d.dtype, d.shape.clone()));
        self.weights.insert(
            name.to_string(),
            HostTensor::owned(d.dtype, d.shape.clone(), d.bytes)?,
        );
        let id = self.b.source(
            Op::Weight {
                name: name.to_string(),
            },
            ty,
        )?;
        self.weight_ids.insert(name.to_string(), id);
        Ok(id)
    }

    /// The tensor `key` names, made by `make` the first time it is asked for. The key must
    /// name everything the tensor depends on (input value ids, dims, attributes).
    pub fn shared(
        &mut self,
        key: String,
        make: impl FnOnce(&mut Ctx) -> Result<ValueId>,
    ) -> Result<ValueId> {
        if let Some(&v) = self.shared.get(&key) {
            return Ok(v);
        }
        let v = make(self)?;
        self.shared.insert(key, v);
        Ok(v)
    }

    /// The name and data of input `k` when it is an initializer.
    pub fn initializer_of(&self, n: &Node, k: usize) -> Option<(&str, &Decoded)> {
        let init = self.values.get(n.input(k)?)?.init.as_ref()?;
        Some((init.name.as_str(), &init.data))
    }

    fn materialize(&mut self, k: &Known) -> Result<ValueId> {
        if let Some(c) = k.consts() {
            return self.constant(k.dtype, k.shape(), known::encode(&c, k.dtype));
        }
        let mut parts = Vec::with_capacity(k.dims.len());
        for d in &k.dims {
            let v = self.b.dim_value(d, k.dtype)?;
            parts.push(if k.scalar {
                v
            } else {
                self.b.reshape(v, vec![Dim::Const(1)])?
            });
        }
        if k.scalar {
            return Ok(parts[0]);
        }
        self.b.op(Op::Concat { axis: 0 }, &parts)
    }

    pub fn constant(&mut self, dtype: DType, shape: Vec<usize>, bytes: Vec<u8>) -> Result<ValueId> {
        let ty = TensorType::new(dtype, shape.iter().map(|&d| Dim::from(d)).collect());
        self.b.source(
            Op::Constant(ConstData {
                shape,
                bytes: Arc::new(bytes),
            }),
            ty,
        )
    }

    /// Binds `name` to an IR value: a translation that reuses another op's translation
    /// hands it values under names of its own.
    pub fn bind(&mut self, name: String, id: ValueId) {
        self.values.insert(name, Val::of(id));
    }

    /// Required input `k` of `n`.
    pub fn input(&mut self, n: &Node, k: usize) -> Result<ValueId> {
        let name = n
            .input(k)
            .ok_or_else(|| n.err(format!("input {k} is missing")))?;
        self.value(name)
    }

    pub fn opt_input(&mut self, n: &Node, k: usize) -> Result<Option<ValueId>> {
        n.input(k).map(|name| self.value(name)).transpose()
    }

    /// Known values of input `k`, when translation can tell them.
    pub fn known(&self, n: &Node, k: usize) -> Option<Known> {
        self.known_of(self.values.get(n.input(k)?)?)
    }

    /// Known values of `v`, when translation can tell them.
    pub fn known_of(&self, v: &Val) -> Option<Known> {
        if let Some(k) = &v.known {
            return Some(k.clone());
        }
        // An IR constant made elsewhere (Constant node of a larger integer tensor).
        let id = v.id?;
        let node = &self.b.g.nodes[id];
        let dtype = node.ty.dtype;
        let (Op::Constant(data), true) = (&node.op, dtype.is_int() || dtype == DType::Bool) else {
            // Computed from constants by a route shape folding does not follow.
            return fold::constant_value(&self.b.g, id);
        };
        if data.shape.len() > 1 {
            return None;
        }
        let decoded = Decoded {
            dtype,
            shape: data.shape.clone(),
            bytes: data.bytes.to_vec(),
        };
        let dims = tensor::ints(&decoded)?
            .into_iter()
            .map(Dim::Const)
            .collect();
        Some(Known {
            dtype,
            scalar: data.shape.is_empty(),
            dims,
        })
    }

    /// Values of input `k` that must be known at compile time (a shape, axes, pads).
    pub fn known_required(&self, n: &Node, k: usize, what: &str) -> Result<Known> {
        self.known(n, k).ok_or_else(|| {
            n.unsupported(format!(
                "its {what} (input {k}) is computed at run time; Ember needs it at compile time"
            ))
        })
    }

    /// Like `known_required`, but every element must be a constant.
    pub fn const_ints(&self, n: &Node, k: usize, what: &str) -> Result<Vec<i64>> {
        self.known_required(n, k, what)?.consts().ok_or_else(|| {
            n.unsupported(format!(
                "its {what} (input {k}) depends on a symbolic size; Ember needs constants"
            ))
        })
    }

    /// Float values of a constant input (Constant node, initializer, or a filled tensor).
    pub fn const_floats(&mut self, n: &Node, k: usize) -> Option<Vec<f64>> {
        if let Some(kn) = self.known(n, k) {
            return kn
                .consts()
                .map(|v| v.into_iter().map(|x| x as f64).collect());
        }
        let val = self.values.get(n.input(k)?)?;
        if let Some(init) = &val.init {
            return Some(tensor::floats(&init.data));
        }
        let node = &self.b.g.nodes[val.id?];
        match &node.op {
            Op::Constant(data) => Some(tensor::floats(&Decoded {
                dtype: node.ty.dtype,
                shape: data.shape.clone(),
                bytes: data.bytes.to_vec(),
            })),
            Op::Full { value } => Some(vec![value.as_f64()]),
            _ => None,
        }
    }
}

impl Ctx {
    /// Binds initializers by name; small integer vectors (shapes, axes, indices) are also
    /// known values for shape folding. Data enters the IR only when an op reads it.
    fn bind_initializers(&mut self, inits: &[proto::TensorProto]) -> Result<()> {
        for (i, init) in inits.iter().enumerate() {
            let name = init
                .name
                .clone()
                .filter(|n| !n.is_empty())
                .ok_or_else(|| Error::Compile(format!("initializer {i} has no name")))?;
            self.b.origin = name.clone();
            let data = tensor::decode(init, &self.ext, &name)?;
            let known = match tensor::ints(&data) {
                Some(v) if data.shape.len() <= 1 && v.len() <= MAX_KNOWN_ELEMS => Some(Known {
                    dtype: data.dtype,
                    scalar: data.shape.is_empty(),
                    dims: v.into_iter().map(Dim::Const).collect(),
                }),
                _ => None,
            };
            let init = Arc::new(Initializer {
                name: name.clone(),
                data,
            });
            self.values.insert(
                name,
                Val {
                    id: None,
                    known,
                    init: Some(init),
                },
            );
        }
        Ok(())
    }

    /// Translates one node and binds its outputs.
    fn run_node(&mut self, n: &Node) -> Result<()> {
        self.b.origin = n.name.clone();
        let functions = self.functions.clone();
        let outs = match functions.called_by(n.proto) {
            Some(f) => self.call(f, n)?,
            None => {
                // check_supported refused unknown ops up front; this guards nodes it could
                // not reach (a subgraph nested deeper than it walks).
                let handler = ops::handler_in(n.proto.domain.as_deref(), n.op)
                    .ok_or_else(|| n.unsupported("Ember has no translation for this op"))?;
                handler(self, n).map_err(|e| in_node(e, n))?
            }
        };
        for (k, name) in n.proto.output.iter().enumerate() {
            if name.is_empty() {
                continue;
            }
            let v = outs.get(k).cloned().ok_or_else(|| {
                n.unsupported(format!("Ember does not compute its output {k} ('{name}')"))
            })?;
            self.values.insert(name.clone(), v);
        }
        Ok(())
    }

    /// Translates `graph`, a subgraph of `parent` (`label` says which, e.g. `body[3]`), with
    /// its inputs bound to `inputs`, and gives its outputs. Outer values stay visible, as
    /// ONNX scoping says; the names the subgraph defines are unbound again afterwards, so a
    /// loop body translates once per iteration.
    pub fn subgraph(
        &mut self,
        graph: &proto::GraphProto,
        inputs: Vec<Val>,
        parent: &Node,
        label: &str,
    ) -> Result<Vec<Val>> {
        if inputs.len() != graph.input.len() {
            return Err(parent.err(format!(
                "its {label} declares {} inputs where the op gives {}",
                graph.input.len(),
                inputs.len()
            )));
        }
        if !graph.sparse_initializer.is_empty() {
            return Err(parent.unsupported("its subgraph has a sparse initializer"));
        }
        let defined: Vec<&str> = graph
            .input
            .iter()
            .filter_map(|v| v.name.as_deref())
            .chain(graph.initializer.iter().filter_map(|t| t.name.as_deref()))
            .chain(
                graph
                    .node
                    .iter()
                    .flat_map(|n| n.output.iter().map(String::as_str)),
            )
            .collect();
        self.scoped(&defined, |ctx| {
            for (vi, v) in graph.input.iter().zip(inputs) {
                ctx.values.insert(vi.name.clone().unwrap_or_default(), v);
            }
            ctx.bind_initializers(&graph.initializer)?;
            for (i, proto) in graph.node.iter().enumerate() {
                let n = Node::new(proto, i, ctx.opset);
                let name = format!("{}/{label}/{}", parent.name, n.name);
                ctx.run_node(&n.named(name))?;
            }
            graph
                .output
                .iter()
                .map(|vi| ctx.val(vi.name.as_deref().unwrap_or("")))
                .collect::<Result<Vec<_>>>()
                .map_err(|e| in_node(e, parent))
        })
    }

    /// Inlines a call `n` of the model-local function `f`: its outputs.
    fn call(&mut self, f: &proto::FunctionProto, n: &Node) -> Result<Vec<Val>> {
        if self.call_depth >= MAX_CALL_DEPTH {
            return Err(n.unsupported(format!(
                "function calls nest deeper than {MAX_CALL_DEPTH} (a recursive function)"
            )));
        }
        let body = functions::instantiate(f, n.proto, &n.name)?;
        let inputs = (0..f.input.len())
            .map(|k| n.input(k).map(|name| self.val(name)).transpose())
            .collect::<Result<Vec<_>>>()?;
        let defined: Vec<&str> = f
            .input
            .iter()
            .chain(body.iter().flat_map(|b| b.output.iter()))
            .map(String::as_str)
            .collect();
        self.call_depth += 1;
        let outs = self.scoped(&defined, |ctx| {
            for (name, v) in f.input.iter().zip(inputs) {
                if let Some(v) = v {
                    ctx.values.insert(name.clone(), v);
                }
            }
            for (i, proto) in body.iter().enumerate() {
                let inner = Node::new(proto, i, ctx.opset);
                let name = format!("{}/{}", n.name, inner.name);
                ctx.run_node(&inner.named(name))?;
            }
            f.output
                .iter()
                .take(n.num_outputs())
                .map(|name| ctx.val(name))
                .collect::<Result<Vec<_>>>()
        });
        self.call_depth -= 1;
        outs
    }

    /// Runs `body` with the names in `defined` unbound again afterwards (restored where they
    /// shadowed a value): a subgraph or function body sees outer values but its own names do
    /// not leak, so a loop body translates once per iteration.
    fn scoped<T>(
        &mut self,
        defined: &[&str],
        body: impl FnOnce(&mut Ctx) -> Result<T>,
    ) -> Result<T> {
        let origin = self.b.origin.clone();
        let shadowed: Vec<(String, Option<Val>)> = defined
            .iter()
            .filter(|s| !s.is_empty())
            .map(|&s| (s.to_owned(), self.values.get(s).cloned()))
            .collect();
        let out = body(self)?;
        for (name, old) in shadowed {
            match old {
                Some(v) => self.values.insert(name, v),
                None => self.values.remove(&name),
            };
        }
        self.b.origin = origin;
        Ok(out)
    }
}

/// Reads, validates and translates a model.
pub fn load(source: Source<'_>) -> Result<Pt2Program> {
    let owned;
    let (bytes, path): (&[u8], Option<&Path>) = match source {
        Source::Path(p) => {
            owned = std::fs::read(p).map_err(|e| {
                Error::Compile(format!("cannot read ONNX model '{}': {e}", p.display()))
            })?;
            (&owned, Some(p))
        }
        Source::Bytes(b) => (b, None),
    };
    let model = proto::decode_model(bytes).map_err(|e| {
        Error::Compile(format!(
            "not a valid ONNX model (the protobuf does not decode: {e})"
        ))
    })?;
    translate(&model, &ExternalData::new(path))
}

/// The model's ai.onnx opset, checked against the range Ember supports.
fn opset(model: &ModelProto) -> Result<i64> {
    if model.graph.is_none() {
        return Err(Error::Compile(
            "not a valid ONNX model: it has no graph".into(),
        ));
    }
    let versions: Vec<i64> = model
        .opset_import
        .iter()
        .filter(|o| matches!(o.domain.as_deref(), None | Some("") | Some("ai.onnx")))
        .map(|o| o.version.unwrap_or(0))
        .collect();
    let Some(&v) = versions.iter().max() else {
        return Err(Error::Compile(
            "the ONNX model imports no ai.onnx opset (opset_import is empty)".into(),
        ));
    };
    if !(MIN_OPSET..=MAX_OPSET).contains(&v) {
        return Err(Error::Compile(format!(
            "ONNX opset {v} is not supported: Ember reads ai.onnx opsets {MIN_OPSET} to \
             {MAX_OPSET} (convert the model with onnx.version_converter)"
        )));
    }
    Ok(v)
}

fn is_onnx_domain(d: Option<&str>) -> bool {
    matches!(d, None | Some("") | Some("ai.onnx"))
}

/// The nodes inside the subgraphs of `n` (If branches, Loop and Scan bodies) and, when it
/// calls a model-local function, that function's body, at any depth, named by their path,
/// so that the up-front check sees every op a model runs.
fn nested_nodes<'a>(n: &Node<'a>, fns: &'a Functions, depth: usize, out: &mut Vec<Node<'a>>) {
    if depth > MAX_CALL_DEPTH {
        return; // a recursive function; translating the call reports it
    }
    let bodies: Vec<&'a [proto::NodeProto]> = match fns.called_by(n.proto) {
        Some(f) => vec![&f.node],
        None if ops::control::reads_subgraphs(n.op) => n
            .proto
            .attribute
            .iter()
            .filter_map(|a| a.g.as_deref())
            .map(|g| g.node.as_slice())
            .collect(),
        None => return,
    };
    for body in bodies {
        for (i, inner) in body.iter().enumerate() {
            let inner = Node::new(inner, i, n.opset);
            let name = format!("{}/{}", n.name, inner.name);
            let inner = inner.named(name);
            out.push(inner.clone());
            nested_nodes(&inner, fns, depth + 1, out);
        }
    }
}

/// Rejects the whole graph up front when any node is unsupported, naming all such ops.
fn check_supported(nodes: &[Node], fns: &Functions) -> Result<()> {
    let mut bad: Vec<(String, &Node, String)> = Vec::new();
    for n in nodes {
        let domain = n.proto.domain.as_deref();
        let label = if is_onnx_domain(domain) {
            n.op.to_owned()
        } else {
            format!("{}::{}", domain.unwrap_or(""), n.op)
        };
        let why = if fns.called_by(n.proto).is_some() {
            continue;
        } else if domain == Some(ops::MICROSOFT) {
            if ops::handler_in(domain, n.op).is_some() {
                continue;
            }
            format!(
                "of the com.microsoft domain Ember reads only {}",
                ops::microsoft_ops().join(", ")
            )
        } else if !is_onnx_domain(domain) {
            format!(
                "domain '{}' is not supported (only ai.onnx and some com.microsoft ops)",
                domain.unwrap_or("")
            )
        } else if n.has_subgraph() && !ops::control::reads_subgraphs(n.op) {
            "of the ops with subgraphs Ember reads only If, Loop and Scan".to_owned()
        } else if let Some(why) = ops::unsupported_reason(n.op) {
            why.to_owned()
        } else if ops::handler(n.op).is_none() {
            "Ember has no translation for this op".to_owned()
        } else {
            continue;
        };
        bad.push((label, n, why));
    }
    let Some((label, first, why)) = bad.first() else {
        return Ok(());
    };
    let mut all: Vec<&str> = bad.iter().map(|b| b.0.as_str()).collect();
    all.sort();
    all.dedup();
    let detail = if all.len() > 1 {
        format!(
            ": {why} (unsupported ops in this model: {})",
            all.join(", ")
        )
    } else {
        format!(": {why}")
    };
    Err(Error::UnsupportedOp {
        op: label.clone(),
        node: first.name.clone(),
        detail,
    })
}

/// The declared type of a graph input or output; unknown dims become fresh symbols.
fn declared_type(vi: &ValueInfoProto, role: &str) -> Result<Option<TensorType>> {
    let name = vi.name.clone().unwrap_or_default();
    let Some(tt) = vi.r#type.as_ref() else {
        return Ok(None);
    };
    let Some(t) = tt.tensor_type.as_ref() else {
        // An output may leave its type empty; an input must be a tensor.
        if role == "output" {
            return Ok(None);
        }
        return Err(Error::unsupported_because(
            format!("non-tensor graph {role}"),
            &name,
            "Ember supports tensor inputs and outputs only (no sequences, maps or optionals)",
        ));
    };
    let dtype = tensor::dtype_from_onnx(t.elem_type.unwrap_or(0), &name)?;
    let Some(shape) = t.shape.as_ref() else {
        // No shape at all means an unknown rank, which the IR cannot express.
        if role == "output" {
            return Ok(None);
        }
        return Err(Error::unsupported_because(
            "graph input of unknown rank",
            &name,
            "Ember needs the rank of every input (dims may be symbolic)",
        ));
    };
    let dims = shape
        .dim
        .iter()
        .enumerate()
        .map(|(i, d)| match (&d.dim_value, &d.dim_param) {
            (Some(v), _) if *v >= 0 => Ok(Dim::Const(*v)),
            (Some(v), _) => Err(Error::Compile(format!(
                "graph {role} '{name}' has a negative dim {v}"
            ))),
            (None, Some(p)) if !p.is_empty() => Ok(Dim::sym(p)),
            _ => Ok(Dim::sym(&format!("{name}_dim{i}"))),
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Some(TensorType::new(dtype, dims)))
}

fn translate(model: &ModelProto, ext: &ExternalData) -> Result<Pt2Program> {
    let opset = opset(model)?;
    let graph = model.graph.as_ref().expect("checked by opset()");
    if !graph.sparse_initializer.is_empty() {
        return Err(Error::unsupported_because(
            "sparse initializer",
            graph.name.clone().unwrap_or_default(),
            "Ember reads dense initializers only",
        ));
    }
    let nodes: Vec<Node> = graph
        .node
        .iter()
        .enumerate()
        .map(|(i, n)| Node::new(n, i, opset))
        .collect();
    let functions = Arc::new(Functions::new(&model.functions));
    let mut all = Vec::new();
    for n in &nodes {
        all.push(n.clone());
        nested_nodes(n, &functions, 0, &mut all);
    }
    check_supported(&all, &functions)?;

    let mut ctx = Ctx {
        b: Builder::new(),
        values: HashMap::new(),
        weights: Weights::new(),
        weight_specs: Vec::new(),
        dequantized: HashMap::new(),
        weight_ids: HashMap::new(),
        ext: ext.clone(),
        opset,
        functions: functions.clone(),
        call_depth: 0,
        shared: HashMap::new(),
    };

    // Initializers first: a graph input with an initializer of the same name is a weight
    // with a default (IR version < 4), and Ember binds the default.
    ctx.bind_initializers(&graph.initializer)?;

    let mut input_names = Vec::new();
    for vi in &graph.input {
        let name = vi.name.clone().unwrap_or_default();
        if ctx.values.contains_key(&name) {
            continue;
        }
        ctx.b.origin = name.clone();
        let ty = declared_type(vi, "input")?
            .ok_or_else(|| Error::Compile(format!("graph input '{name}' has no type")))?;
        for d in &ty.shape {
            if let Dim::Sym(s) = d {
                ctx.b
                    .g
                    .symbols
                    .entry(s.clone())
                    .or_insert(SymbolRange { min: 0, max: None });
            }
        }
        let id = ctx.b.source(
            Op::Input {
                index: input_names.len(),
            },
            ty,
        )?;
        input_names.push(name.clone());
        ctx.values.insert(name, Val::of(id));
    }

    for n in &nodes {
        ctx.run_node(n)?;
    }

    let mut output_names = Vec::new();
    for vi in &graph.output {
        let name = vi.name.clone().unwrap_or_default();
        ctx.b.origin = name.clone();
        let id = ctx.value(&name)?;
        if let Some(want) = declared_type(vi, "output")? {
            check_declared(&ctx.b.g, id, &want, &name)?;
        }
        ctx.b.g.outputs.push(id);
        output_names.push(name);
    }
    if output_names.is_empty() {
        return Err(Error::Compile("the ONNX graph has no outputs".into()));
    }
    // Attention and RMS norm as exporters spell them run as fused ops; initializers are
    // the file's, fixed once loaded.
    let mut graph = crate::frontend::composites::recover(&ctx.b.g, &ctx.weights)?;
    graph.simplify_dims();
    verify(&graph)?;
    check_symbols_bound(&graph)?;
    check_sizes(&graph)?;
    Ok(Pt2Program {
        graph,
        weights: ctx.weights,
        weight_specs: ctx.weight_specs,
        complex_inputs: vec![false; input_names.len()],
        input_names,
        output_names,
    })
}

/// Adds the ONNX op and node to errors raised inside a handler.
fn in_node(e: Error, n: &Node) -> Error {
    let tag = format!("ONNX {} node '{}'", n.op, n.name);
    match e {
        Error::Shape(m) if !m.contains(&tag) => Error::Shape(format!("{m} (in {tag})")),
        Error::Compile(m) if !m.contains(&tag) => Error::Compile(format!("{m} (in {tag})")),
        other => other,
    }
}

/// A model whose declared output type disagrees with what Ember computed would give wrong
/// numbers or shapes; refuse it instead. Symbolic dims are checked at run time.
fn check_declared(g: &Graph, id: ValueId, want: &TensorType, name: &str) -> Result<()> {
    let got = g.ty(id);
    let shape_ok = got.shape.len() == want.shape.len()
        && got
            .shape
            .iter()
            .zip(&want.shape)
            .all(|(a, b)| a.provably_equal(b) != Some(false));
    if got.dtype != want.dtype || !shape_ok {
        return Err(Error::Compile(format!(
            "graph output '{name}' is declared as {}{} but the graph computes {}{}",
            want.dtype,
            format_shape(&want.shape),
            got.dtype,
            format_shape(&got.shape)
        )));
    }
    Ok(())
}

/// Every symbol a shape mentions must be fixed by the input shapes, since inputs are all a
/// program receives at run time.
fn check_symbols_bound(g: &Graph) -> Result<()> {
    let mut bound = Vec::new();
    for &i in &g.inputs {
        for d in &g.ty(i).shape {
            if let Dim::Sym(s) = d {
                bound.push(s.clone());
            }
        }
    }
    for node in &g.nodes {
        let mut used = Vec::new();
        node.ty.shape.iter().for_each(|d| d.symbols(&mut used));
        if let Some(s) = used.iter().find(|s| !bound.contains(s)) {
            return Err(Error::Compile(format!(
                "symbolic size '{s}' at node '{}' is not determined by the input shapes",
                node.origin
            )));
        }
    }
    Ok(())
}

/// Refuses statically huge intermediate tensors (a corrupt shape constant) before any
/// backend tries to allocate them.
fn check_sizes(g: &Graph) -> Result<()> {
    for node in &g.nodes {
        let dims: Option<Vec<i64>> = node.ty.shape.iter().map(Dim::as_const).collect();
        if let Some(dims) = dims {
            tensor::checked_numel(&dims, node.ty.dtype, &node.origin)?;
        }
    }
    Ok(())
}
