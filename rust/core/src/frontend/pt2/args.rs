//! The arguments of a serialized FX node (`{"name": ..., "arg": {"as_int": 3}}`), parsed
//! tolerantly: unknown argument kinds are kept as `Arg::Other` and only rejected by ops that
//! need them.

use serde_json::Value as Json;

use super::archive::{element_type, ElementType};
use crate::dim::Dim;
use crate::dtype::{DType, Scalar};
use crate::error::{Error, Result};

/// Variants no op reads yet still show up in error messages through `Debug`.
#[allow(dead_code)]
#[derive(Clone, Debug)]
pub enum Arg {
    None,
    Tensor(String),
    Tensors(Vec<String>),
    OptTensors(Vec<Option<String>>),
    Int(i64),
    Ints(Vec<i64>),
    Float(f64),
    Floats(Vec<f64>),
    Bool(bool),
    Bools(Vec<bool>),
    Str(String),
    /// A symbolic integer: by name, or a constant.
    SymInt(SymRef),
    SymInts(Vec<SymRef>),
    ScalarType(DType),
    /// A complex dtype, by the dtype of its parts.
    ComplexType(DType),
    Other(String),
}

#[derive(Clone, Debug)]
pub enum SymRef {
    Name(String),
    Const(i64),
}

fn name_of(v: &Json) -> Option<String> {
    v.get("name").and_then(Json::as_str).map(str::to_owned)
}

fn sym_ref(v: &Json) -> Option<SymRef> {
    if let Some(n) = v.get("as_name").and_then(Json::as_str) {
        return Some(SymRef::Name(n.to_owned()));
    }
    v.get("as_int").and_then(Json::as_i64).map(SymRef::Const)
}

/// Parses one `{"as_xxx": ...}` argument.
pub fn parse(v: &Json) -> Result<Arg> {
    let Some(obj) = v.as_object() else {
        return Ok(Arg::Other(v.to_string()));
    };
    let Some((kind, val)) = obj.iter().next() else {
        return Ok(Arg::None);
    };
    let bad = || Error::Compile(format!("malformed argument {v}"));
    Ok(match kind.as_str() {
        "as_none" => Arg::None,
        "as_tensor" | "as_optional_tensor" => match val.get("as_tensor").or(Some(val)) {
            Some(t) if t.get("name").is_some() => Arg::Tensor(name_of(t).ok_or_else(bad)?),
            _ if val.get("as_none").is_some() => Arg::None,
            _ => return Err(bad()),
        },
        "as_tensors" => Arg::Tensors(
            val.as_array()
                .ok_or_else(bad)?
                .iter()
                .map(|t| name_of(t).ok_or_else(bad))
                .collect::<Result<_>>()?,
        ),
        "as_optional_tensors" => Arg::OptTensors(
            val.as_array()
                .ok_or_else(bad)?
                .iter()
                .map(|t| t.get("as_tensor").and_then(name_of))
                .collect(),
        ),
        "as_int" => Arg::Int(val.as_i64().ok_or_else(bad)?),
        "as_ints" => Arg::Ints(
            val.as_array()
                .ok_or_else(bad)?
                .iter()
                .map(|x| x.as_i64().ok_or_else(bad))
                .collect::<Result<_>>()?,
        ),
        "as_float" => Arg::Float(float_value(val).ok_or_else(bad)?),
        "as_floats" => Arg::Floats(
            val.as_array()
                .ok_or_else(bad)?
                .iter()
                .map(|x| float_value(x).ok_or_else(bad))
                .collect::<Result<_>>()?,
        ),
        "as_bool" => Arg::Bool(val.as_bool().ok_or_else(bad)?),
        "as_bools" => Arg::Bools(
            val.as_array()
                .ok_or_else(bad)?
                .iter()
                .map(|x| x.as_bool().ok_or_else(bad))
                .collect::<Result<_>>()?,
        ),
        "as_string" => Arg::Str(val.as_str().ok_or_else(bad)?.to_owned()),
        "as_sym_int" => Arg::SymInt(sym_ref(val).ok_or_else(bad)?),
        "as_sym_ints" => Arg::SymInts(
            val.as_array()
                .ok_or_else(bad)?
                .iter()
                .map(|x| sym_ref(x).ok_or_else(bad))
                .collect::<Result<_>>()?,
        ),
        "as_scalar_type" => match element_type(val.as_i64().ok_or_else(bad)?, "arg")? {
            ElementType::Real(d) => Arg::ScalarType(d),
            ElementType::Complex(d) => Arg::ComplexType(d),
        },
        other => Arg::Other(other.to_owned()),
    })
}

/// Floats may be serialized as strings for inf/nan.
fn float_value(v: &Json) -> Option<f64> {
    if let Some(f) = v.as_f64() {
        return Some(f);
    }
    match v.as_str()? {
        "inf" | "Infinity" => Some(f64::INFINITY),
        "-inf" | "-Infinity" => Some(f64::NEG_INFINITY),
        "nan" | "NaN" => Some(f64::NAN),
        s => s.parse().ok(),
    }
}

/// A node's arguments, looked up by schema name (or position as a fallback).
#[derive(Clone)]
pub struct NodeArgs {
    pub target: String,
    pub name: String,
    args: Vec<(String, Arg)>,
    pub outputs: Vec<Option<String>>,
}

impl NodeArgs {
    pub fn parse(node: &Json) -> Result<NodeArgs> {
        let target = node
            .get("target")
            .and_then(Json::as_str)
            .unwrap_or("<unknown>")
            .to_owned();
        let inputs = node.get("inputs").and_then(Json::as_array);
        let mut args = Vec::new();
        for inp in inputs.into_iter().flatten() {
            let name = inp
                .get("name")
                .and_then(Json::as_str)
                .unwrap_or("")
                .to_owned();
            let arg = parse(inp.get("arg").unwrap_or(&Json::Null))?;
            args.push((name, arg));
        }
        let mut outputs = Vec::new();
        for out in node
            .get("outputs")
            .and_then(Json::as_array)
            .into_iter()
            .flatten()
        {
            match parse(out)? {
                Arg::Tensor(n) => outputs.push(Some(n)),
                Arg::Tensors(ns) => outputs.extend(ns.into_iter().map(Some)),
                Arg::SymInt(SymRef::Name(n)) => outputs.push(Some(n)),
                _ => outputs.push(None),
            }
        }
        let name = node
            .get("name")
            .and_then(Json::as_str)
            .map(str::to_owned)
            .or_else(|| outputs.iter().flatten().next().cloned())
            .unwrap_or_else(|| target.clone());
        Ok(NodeArgs {
            target,
            name,
            args,
            outputs,
        })
    }

    /// The argument named `name` (or at position `pos`), if present and not None.
    pub fn get(&self, name: &str, pos: usize) -> Option<&Arg> {
        let found = self
            .args
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, a)| a)
            .or_else(|| {
                // Only fall back to position when the archive carries no argument names.
                if self.args.iter().all(|(n, _)| n.is_empty()) {
                    self.args.get(pos).map(|(_, a)| a)
                } else {
                    None
                }
            });
        match found {
            Some(Arg::None) | None => None,
            Some(a) => Some(a),
        }
    }

    fn err(&self, what: &str) -> Error {
        Error::Compile(format!("node '{}' ({}): {what}", self.name, self.target))
    }

    pub fn tensor(&self, name: &str, pos: usize) -> Result<&str> {
        match self.get(name, pos) {
            Some(Arg::Tensor(t)) => Ok(t),
            other => Err(self.err(&format!(
                "argument '{name}' should be a tensor, got {other:?}"
            ))),
        }
    }

    pub fn opt_tensor(&self, name: &str, pos: usize) -> Result<Option<&str>> {
        match self.get(name, pos) {
            None => Ok(None),
            Some(Arg::Tensor(t)) => Ok(Some(t)),
            other => Err(self.err(&format!(
                "argument '{name}' should be a tensor, got {other:?}"
            ))),
        }
    }

    pub fn tensors(&self, name: &str, pos: usize) -> Result<Vec<String>> {
        match self.get(name, pos) {
            Some(Arg::Tensors(t)) => Ok(t.clone()),
            Some(Arg::Tensor(t)) => Ok(vec![t.clone()]),
            other => Err(self.err(&format!(
                "argument '{name}' should be tensors, got {other:?}"
            ))),
        }
    }

    pub fn int(&self, name: &str, pos: usize) -> Result<i64> {
        self.opt_int(name, pos)?
            .ok_or_else(|| self.err(&format!("missing integer argument '{name}'")))
    }

    pub fn opt_int(&self, name: &str, pos: usize) -> Result<Option<i64>> {
        match self.get(name, pos) {
            None => Ok(None),
            Some(Arg::Int(i)) => Ok(Some(*i)),
            Some(Arg::SymInt(SymRef::Const(i))) => Ok(Some(*i)),
            Some(Arg::Bool(b)) => Ok(Some(*b as i64)),
            other => Err(self.err(&format!(
                "argument '{name}' should be an int, got {other:?}"
            ))),
        }
    }

    pub fn ints(&self, name: &str, pos: usize) -> Result<Vec<i64>> {
        Ok(self.opt_ints(name, pos)?.unwrap_or_default())
    }

    pub fn opt_ints(&self, name: &str, pos: usize) -> Result<Option<Vec<i64>>> {
        match self.get(name, pos) {
            None => Ok(None),
            Some(Arg::Ints(v)) => Ok(Some(v.clone())),
            Some(Arg::Int(i)) => Ok(Some(vec![*i])),
            Some(Arg::SymInts(v)) => v
                .iter()
                .map(|s| match s {
                    SymRef::Const(c) => Ok(*c),
                    SymRef::Name(n) => {
                        Err(self.err(&format!("symbolic '{n}' where ints expected")))
                    }
                })
                .collect::<Result<_>>()
                .map(Some),
            other => Err(self.err(&format!("argument '{name}' should be ints, got {other:?}"))),
        }
    }

    pub fn float(&self, name: &str, pos: usize) -> Result<Option<f64>> {
        match self.get(name, pos) {
            None => Ok(None),
            Some(Arg::Float(f)) => Ok(Some(*f)),
            Some(Arg::Int(i)) => Ok(Some(*i as f64)),
            other => Err(self.err(&format!(
                "argument '{name}' should be a float, got {other:?}"
            ))),
        }
    }

    pub fn bool(&self, name: &str, pos: usize, default: bool) -> Result<bool> {
        match self.get(name, pos) {
            None => Ok(default),
            Some(Arg::Bool(b)) => Ok(*b),
            Some(Arg::Int(i)) => Ok(*i != 0),
            other => Err(self.err(&format!(
                "argument '{name}' should be a bool, got {other:?}"
            ))),
        }
    }

    pub fn string(&self, name: &str, pos: usize) -> Result<Option<&str>> {
        match self.get(name, pos) {
            None => Ok(None),
            Some(Arg::Str(s)) => Ok(Some(s)),
            other => Err(self.err(&format!(
                "argument '{name}' should be a string, got {other:?}"
            ))),
        }
    }

    pub fn dtype(&self, name: &str, pos: usize) -> Result<Option<DType>> {
        match self.get(name, pos) {
            None => Ok(None),
            Some(Arg::ScalarType(d)) => Ok(Some(*d)),
            other => Err(self.err(&format!(
                "argument '{name}' should be a dtype, got {other:?}"
            ))),
        }
    }

    /// A Python scalar argument (`other` of `add.Scalar`).
    pub fn scalar(&self, name: &str, pos: usize) -> Result<Option<Scalar>> {
        match self.get(name, pos) {
            None => Ok(None),
            Some(Arg::Int(i)) => Ok(Some(Scalar::Int(*i))),
            Some(Arg::Float(f)) => Ok(Some(Scalar::Float(*f))),
            Some(Arg::Bool(b)) => Ok(Some(Scalar::Bool(*b))),
            Some(Arg::SymInt(SymRef::Const(i))) => Ok(Some(Scalar::Int(*i))),
            other => Err(self.err(&format!(
                "argument '{name}' should be a scalar, got {other:?}"
            ))),
        }
    }

    pub fn raw(&self, name: &str, pos: usize) -> Option<&Arg> {
        self.get(name, pos)
    }

    /// (argument name, tensor name) of every tensor argument, lists flattened.
    pub fn tensor_args(&self) -> impl Iterator<Item = (&str, &str)> {
        self.args.iter().flat_map(|(n, a)| {
            let names: Vec<&str> = match a {
                Arg::Tensor(t) => vec![t.as_str()],
                Arg::Tensors(ts) => ts.iter().map(String::as_str).collect(),
                Arg::OptTensors(ts) => ts.iter().flatten().map(String::as_str).collect(),
                _ => vec![],
            };
            names.into_iter().map(move |t| (n.as_str(), t))
        })
    }

    /// The names of every tensor argument.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensor_args().map(|(_, t)| t)
    }

    /// These arguments with `name` (at `pos` when unnamed) set to `arg`.
    pub fn with(&self, name: &str, pos: usize, arg: Arg) -> NodeArgs {
        let mut out = self.clone();
        let unnamed = out.args.iter().all(|(n, _)| n.is_empty());
        let at = match unnamed {
            true => (pos < out.args.len()).then_some(pos),
            false => out.args.iter().position(|(n, _)| n == name),
        };
        match at {
            Some(i) => out.args[i].1 = arg,
            None if unnamed => {
                out.args.resize(pos, (String::new(), Arg::None));
                out.args.push((String::new(), arg));
            }
            None => out.args.push((name.to_owned(), arg)),
        }
        out
    }
}

/// A size argument resolved against the symbols known so far.
pub fn resolve_sym(s: &SymRef, lookup: &dyn Fn(&str) -> Option<Dim>) -> Option<Dim> {
    match s {
        SymRef::Const(c) => Some(Dim::Const(*c)),
        SymRef::Name(n) => lookup(n),
    }
}
