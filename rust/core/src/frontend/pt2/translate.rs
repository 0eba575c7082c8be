//! Walks a serialized ExportedProgram (`models/model.json`) and builds the IR graph.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use serde_json::Value as Json;

use super::archive::{self, element_type, ElementType, Source};
use super::args::{resolve_sym, NodeArgs, SymRef};
use super::complex;
use super::ops;
use super::sym_expr;
use crate::backend::Weights;
use crate::dim::{format_shape, Dim, SymbolRange};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::frontend::builder::Builder;
use crate::ir::{verify, Graph, Op, TensorType, ValueId};

/// A translated program and what a caller needs to run it.
pub struct Pt2Program {
    pub graph: Graph,
    /// Weights read from the archive (empty when not loaded).
    pub weights: Weights,
    /// Fully qualified names of the weights the graph reads, with dtype and shape.
    pub weight_specs: Vec<(String, DType, Vec<usize>)>,
    /// Names of the user inputs, in call order.
    pub input_names: Vec<String>,
    /// Which user inputs are complex tensors, read as their (real, imaginary) pairs.
    pub complex_inputs: Vec<bool>,
    pub output_names: Vec<String>,
}

/// Output names that start with this are the new values of inputs or buffers the program
/// updates in place (`torch.export`'s input and buffer mutations), named by the input's
/// or buffer's name after the prefix. The caller copies them back after each run.
pub const MUTATION_PREFIX: &str = "mutates:";

/// What translating one node produced.
pub enum Out {
    None,
    Value(ValueId),
    /// Several tensor outputs (max.dim, split); `None` for outputs Ember does not produce.
    Values(Vec<Option<ValueId>>),
    Sym(Dim),
}

/// Translation state: the builder plus the names of values and symbols seen so far.
pub struct Ctx {
    pub b: Builder,
    values: HashMap<String, ValueId>,
    syms: HashMap<String, Dim>,
    /// The names of the values that are complex tensors, which Ember holds as (real,
    /// imaginary) pairs along a trailing dim of 2 (see `complex`). By name, since
    /// `view_as_real` gives the same pairs a second, real, name.
    pub complex: HashSet<String>,
}

impl Ctx {
    pub fn value(&self, name: &str) -> Result<ValueId> {
        self.values.get(name).copied().ok_or_else(|| {
            Error::Compile(format!(
                "node '{}' uses unknown value '{name}'",
                self.b.origin
            ))
        })
    }

    pub fn sym(&self, s: &SymRef) -> Result<Dim> {
        resolve_sym(s, &|n| self.syms.get(n).cloned()).ok_or_else(|| {
            Error::Compile(format!(
                "node '{}' uses unknown symbol {s:?}",
                self.b.origin
            ))
        })
    }
}

/// Loads an archive and translates its program. `load_weights = false` leaves weights to
/// the caller (who binds live tensors by name).
pub fn load(source: Source<'_>, load_weights: bool) -> Result<Pt2Program> {
    let archive = archive::read(source, load_weights)?;
    translate(&archive.program, archive.tensors)
}

fn field<'a>(v: &'a Json, path: &[&str]) -> Result<&'a Json> {
    let mut cur = v;
    for p in path {
        cur = cur.get(p).ok_or_else(|| {
            Error::Compile(format!(
                "invalid .pt2 program: missing '{}'",
                path.join(".")
            ))
        })?;
    }
    Ok(cur)
}

fn as_array<'a>(v: &'a Json, what: &str) -> Result<&'a Vec<Json>> {
    v.as_array()
        .ok_or_else(|| Error::Compile(format!("invalid .pt2 program: '{what}' is not a list")))
}

/// Reads one `{"as_int": n}` / `{"as_expr": {"expr_str": ...}}` size.
fn parse_size(v: &Json) -> Result<Dim> {
    if let Some(i) = v.get("as_int").and_then(Json::as_i64) {
        return Ok(Dim::Const(i));
    }
    if let Some(e) = v.get("as_expr") {
        let src = e
            .get("expr_str")
            .and_then(Json::as_str)
            .ok_or_else(|| Error::Compile(format!("invalid symbolic size {v}")))?;
        return sym_expr::parse(src);
    }
    Err(Error::Compile(format!("invalid size {v}")))
}

/// A value's type as Ember holds it (a complex tensor as its real pairs) and whether it is
/// complex.
fn tensor_meta(v: &Json, name: &str) -> Result<(TensorType, bool)> {
    let code = v
        .get("dtype")
        .and_then(Json::as_i64)
        .ok_or_else(|| Error::Compile(format!("tensor '{name}' has no dtype")))?;
    let sizes = as_array(field(v, &["sizes"])?, "sizes")?;
    let mut shape = sizes.iter().map(parse_size).collect::<Result<Vec<_>>>()?;
    Ok(match element_type(code, name)? {
        ElementType::Real(dtype) => (TensorType::new(dtype, shape), false),
        ElementType::Complex(dtype) => {
            shape.push(Dim::Const(2));
            (TensorType::new(dtype, shape), true)
        }
    })
}

fn spec_name(spec: &Json, kind: &str) -> Option<String> {
    let s = spec.get(kind)?;
    let arg = s.get("arg")?;
    arg.get("name")
        .or_else(|| arg.get("as_tensor").and_then(|t| t.get("name")))
        .and_then(Json::as_str)
        .map(str::to_owned)
}

pub fn translate(program: &Json, archive_tensors: Weights) -> Result<Pt2Program> {
    let gm = field(program, &["graph_module"])?;
    let graph_json = field(gm, &["graph"])?;
    let signature = field(gm, &["signature"])?;
    let mut metas: BTreeMap<String, TensorType> = BTreeMap::new();
    let mut complex_names: HashSet<String> = HashSet::new();
    let tensor_values = field(graph_json, &["tensor_values"])?
        .as_object()
        .ok_or_else(|| Error::Compile("tensor_values is not an object".into()))?;
    for (k, v) in tensor_values {
        let (ty, is_complex) = tensor_meta(v, k)?;
        if is_complex {
            complex_names.insert(k.clone());
        }
        metas.insert(k.clone(), ty);
    }

    let nodes = as_array(field(graph_json, &["nodes"])?, "nodes")?;
    let parsed: Vec<NodeArgs> = nodes.iter().map(NodeArgs::parse).collect::<Result<_>>()?;
    let unsupported: Vec<&NodeArgs> = parsed
        .iter()
        .filter(|n| ops::handler(&n.target).is_none() && !complex::handles(&n.target))
        .collect();
    if let Some(first) = unsupported.first() {
        let mut names: Vec<&str> = unsupported.iter().map(|n| n.target.as_str()).collect();
        names.dedup();
        return Err(Error::UnsupportedOp {
            op: short_target(&first.target).to_owned(),
            node: first.name.clone(),
            detail: if names.len() > 1 {
                format!(
                    " (unsupported ops in this graph: {})",
                    names
                        .iter()
                        .map(|t| short_target(t))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            } else {
                String::new()
            },
        });
    }

    let mut ctx = Ctx {
        b: Builder::new(),
        values: HashMap::new(),
        syms: HashMap::new(),
        complex: complex_names,
    };
    if let Some(ranges) = program.get("range_constraints").and_then(Json::as_object) {
        for (name, r) in ranges {
            let min = r.get("min_val").and_then(Json::as_i64).unwrap_or(0).max(0);
            let max = r.get("max_val").and_then(Json::as_i64);
            ctx.b
                .g
                .symbols
                .insert(Arc::from(name.as_str()), SymbolRange { min, max });
        }
    }

    // Named symbolic ints (sizes computed in the graph, symbolic int inputs): their values
    // as expressions over the symbols the input shapes carry.
    if let Some(sym_ints) = graph_json.get("sym_int_values").and_then(Json::as_object) {
        for (name, v) in sym_ints {
            if let Ok(d) = parse_size(v) {
                ctx.syms.insert(name.clone(), d);
            }
        }
    }

    // Inputs, in the order the signature gives them.
    let mut weight_specs = Vec::new();
    let mut input_names = Vec::new();
    let mut weights = Weights::new();
    for spec in as_array(field(signature, &["input_specs"])?, "input_specs")? {
        let (kind, graph_name, fqn) = if let Some(n) = spec_name(spec, "user_input") {
            ("user_input", n.clone(), n)
        } else if spec.get("user_input").is_some() || spec.get("constant_input").is_some() {
            // A non-tensor input (an int or None) that the export specialized into the graph.
            continue;
        } else if let Some(n) = spec_name(spec, "parameter") {
            let fqn = spec["parameter"]["parameter_name"]
                .as_str()
                .unwrap_or(&n)
                .to_owned();
            ("weight", n, fqn)
        } else if let Some(n) = spec_name(spec, "buffer") {
            let fqn = spec["buffer"]["buffer_name"]
                .as_str()
                .unwrap_or(&n)
                .to_owned();
            ("weight", n, fqn)
        } else if let Some(n) = spec_name(spec, "tensor_constant") {
            let fqn = spec["tensor_constant"]["tensor_constant_name"]
                .as_str()
                .unwrap_or(&n)
                .to_owned();
            ("weight", n, fqn)
        } else {
            return Err(Error::unsupported_because(
                "graph input",
                spec.to_string(),
                "only tensor inputs, parameters, buffers and tensor constants are supported",
            ));
        };
        let ty = metas.get(&graph_name).cloned().ok_or_else(|| {
            Error::unsupported_because(
                "non-tensor input",
                &graph_name,
                "Ember compiles graphs whose inputs are tensors",
            )
        })?;
        ctx.b.origin = graph_name.clone();
        let id = if kind == "user_input" {
            let index = input_names.len();
            input_names.push(graph_name.clone());
            ctx.b.source(Op::Input { index }, ty)?
        } else {
            let shape = ty
                .shape
                .iter()
                .map(|d| d.as_const().map(|c| c as usize))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| Error::Compile(format!("weight '{fqn}' has a symbolic shape")))?;
            if let Some(t) = archive_tensors.get(&fqn) {
                if t.dtype != ty.dtype || t.shape != shape {
                    return Err(Error::Compile(format!(
                        "weight '{fqn}' is stored as {}{:?} but the program expects {}{:?}",
                        t.dtype, t.shape, ty.dtype, shape
                    )));
                }
                weights.insert(fqn.clone(), t.clone());
            }
            weight_specs.push((fqn.clone(), ty.dtype, shape));
            ctx.b.source(Op::Weight { name: fqn }, ty)?
        };
        ctx.values.insert(graph_name, id);
    }
    // Symbols are named by the input dims that carry them.
    for &id in &ctx.b.g.inputs.clone() {
        for d in &ctx.b.g.ty(id).shape {
            if let Dim::Sym(s) = d {
                ctx.syms.insert(s.to_string(), d.clone());
            }
        }
    }

    for node in &parsed {
        ctx.b.origin = node.name.clone();
        let out = if complex::involved(&ctx, node) {
            complex::translate(&mut ctx, node)?
        } else {
            let handler = ops::handler(&node.target)
                .ok_or_else(|| Error::unsupported(short_target(&node.target), node.name.clone()))?;
            handler(&mut ctx, node)?
        };
        bind_outputs(&mut ctx, node, out, &metas)?;
    }

    let mut output_names = Vec::new();
    for spec in as_array(field(signature, &["output_specs"])?, "output_specs")? {
        let kind = spec
            .as_object()
            .and_then(|o| o.keys().next().cloned())
            .unwrap_or_default();
        // In-place updates of inputs and buffers are outputs named after what they update;
        // the caller writes them back (see MUTATION_PREFIX).
        let target = match kind.as_str() {
            "user_input_mutation" => spec[&kind]["user_input_name"].as_str(),
            "buffer_mutation" => spec[&kind]["buffer_name"].as_str(),
            _ => None,
        };
        let Some(n) = spec_name(spec, &kind) else {
            return Err(Error::unsupported_because(
                kind,
                "",
                "outputs must be tensors (this one is a constant)",
            ));
        };
        let name = match (kind.as_str(), target) {
            ("user_output", _) => n.clone(),
            ("user_input_mutation" | "buffer_mutation", Some(t)) => {
                format!("{MUTATION_PREFIX}{t}")
            }
            _ => {
                return Err(Error::unsupported_because(
                    kind,
                    n,
                    "an output kind Ember does not know",
                ))
            }
        };
        let id = ctx.value(&n).map_err(|_| {
            Error::unsupported_because("graph output", &n, "outputs must be tensors")
        })?;
        if ctx.complex.contains(&n) {
            return Err(Error::unsupported_because(
                "complex graph output",
                &n,
                "Ember computes complex tensors inside a graph; return torch.view_as_real(z)",
            ));
        }
        ctx.b.g.outputs.push(id);
        output_names.push(name);
    }
    // Attention and RMS norm written out in aten ops run as fused ops. No weight counts as
    // fixed: parameters and buffers can be updated in place and rebound after compiling.
    let mut graph = crate::frontend::composites::recover(&ctx.b.g, &Weights::new())?;
    graph.simplify_dims();
    verify(&graph)?;
    check_symbols_bound(&graph)?;
    let complex_inputs = input_names
        .iter()
        .map(|n| ctx.complex.contains(n))
        .collect();
    Ok(Pt2Program {
        graph,
        weights,
        weight_specs,
        input_names,
        complex_inputs,
        output_names,
    })
}

fn bind_outputs(
    ctx: &mut Ctx,
    node: &NodeArgs,
    out: Out,
    metas: &BTreeMap<String, TensorType>,
) -> Result<()> {
    let values: Vec<Option<ValueId>> = match out {
        Out::None => return Ok(()),
        Out::Sym(d) => {
            if let Some(Some(name)) = node.outputs.first() {
                ctx.syms.insert(name.clone(), d);
            }
            return Ok(());
        }
        Out::Value(v) => vec![Some(v)],
        Out::Values(vs) => vs,
    };
    for (name, v) in node.outputs.iter().zip(values) {
        let (Some(name), Some(v)) = (name, v) else {
            continue;
        };
        if let Some(meta) = metas.get(name) {
            check_against_torch(ctx, node, v, meta)?;
        }
        ctx.values.insert(name.clone(), v);
    }
    Ok(())
}

/// torch recorded each value's dtype and shape; a translation that disagrees is a bug in
/// Ember, reported instead of producing wrong numbers later.
fn check_against_torch(ctx: &Ctx, node: &NodeArgs, v: ValueId, want: &TensorType) -> Result<()> {
    let got = ctx.b.ty(v);
    let shape_ok = got.shape.len() == want.shape.len()
        && got
            .shape
            .iter()
            .zip(&want.shape)
            .all(|(a, b)| a.provably_equal(b) != Some(false));
    if got.dtype != want.dtype || !shape_ok {
        return Err(Error::Compile(format!(
            "internal error translating node '{}' ({}): Ember computed {}{} but torch recorded {}{}",
            node.name,
            node.target,
            got.dtype,
            format_shape(&got.shape),
            want.dtype,
            format_shape(&want.shape)
        )));
    }
    Ok(())
}

/// `torch.ops.aten.add.Tensor` → `aten.add.Tensor`.
pub fn short_target(target: &str) -> &str {
    target.strip_prefix("torch.ops.").unwrap_or(target)
}

/// Every symbol a shape or attribute mentions must be fixed by the input shapes, since
/// inputs are all a program receives at run time. (A symbolic *int* input that export did
/// not tie to a tensor dim is not supported yet; callers specialize such graphs.)
fn check_symbols_bound(g: &Graph) -> Result<()> {
    let mut bound = Vec::new();
    for &i in &g.inputs {
        for d in &g.ty(i).shape {
            if let Dim::Sym(s) = d {
                bound.push(s.clone());
            }
        }
    }
    let mut used = Vec::new();
    for node in &g.nodes {
        for d in &node.ty.shape {
            d.symbols(&mut used);
        }
        match &node.op {
            Op::Reshape { shape } | Op::Expand { shape } => {
                shape.iter().for_each(|d| d.symbols(&mut used))
            }
            Op::Slice { start, end, .. } => {
                start.symbols(&mut used);
                end.symbols(&mut used);
            }
            _ => {}
        }
    }
    match used.iter().find(|s| !bound.contains(s)) {
        Some(s) => Err(Error::Compile(format!(
            "symbolic size '{s}' is not determined by the shapes of the tensor inputs"
        ))),
        None => Ok(()),
    }
}
