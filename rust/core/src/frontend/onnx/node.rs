//! One ONNX node as the op translators see it: its name, inputs (an empty name is an absent
//! optional input) and typed attribute access with ONNX's defaults.

use super::proto::{AttributeProto, GraphProto, NodeProto, TensorProto};
use crate::error::{Error, Result};

#[derive(Clone)]
pub struct Node<'a> {
    pub proto: &'a NodeProto,
    /// The node's name, or `<op_type>_<index>` when the model leaves it empty.
    pub name: String,
    pub op: &'a str,
    pub opset: i64,
}

impl<'a> Node<'a> {
    pub fn new(proto: &'a NodeProto, index: usize, opset: i64) -> Node<'a> {
        let op = proto.op_type.as_deref().unwrap_or("");
        let name = match proto.name.as_deref() {
            Some(n) if !n.is_empty() => n.to_owned(),
            _ => format!("{op}_{index}"),
        };
        Node {
            proto,
            name,
            op,
            opset,
        }
    }

    /// The same node under another name (a node inside a subgraph is named by its path).
    pub fn named(mut self, name: String) -> Node<'a> {
        self.name = name;
        self
    }

    /// Name of input `k`, or `None` when it is absent (missing or empty).
    pub fn input(&self, k: usize) -> Option<&'a str> {
        self.proto
            .input
            .get(k)
            .map(String::as_str)
            .filter(|s| !s.is_empty())
    }

    pub fn num_inputs(&self) -> usize {
        self.proto.input.len()
    }

    /// Names of the inputs that are present.
    pub fn inputs(&self) -> Vec<&'a str> {
        (0..self.num_inputs())
            .filter_map(|k| self.input(k))
            .collect()
    }

    pub fn num_outputs(&self) -> usize {
        self.proto.output.len()
    }

    /// Whether output `k` is requested (named).
    pub fn wants_output(&self, k: usize) -> bool {
        self.proto.output.get(k).is_some_and(|s| !s.is_empty())
    }

    pub fn err(&self, msg: impl AsRef<str>) -> Error {
        Error::Compile(format!(
            "ONNX {} node '{}': {}",
            self.op,
            self.name,
            msg.as_ref()
        ))
    }

    pub fn unsupported(&self, why: impl AsRef<str>) -> Error {
        Error::unsupported_because(self.op, &self.name, why)
    }

    fn attr(&self, name: &str) -> Option<&'a AttributeProto> {
        self.proto
            .attribute
            .iter()
            .find(|a| a.name.as_deref() == Some(name))
    }

    pub fn has_attr(&self, name: &str) -> bool {
        self.attr(name).is_some()
    }

    fn attr_checked(&self, name: &str) -> Result<Option<&'a AttributeProto>> {
        match self.attr(name) {
            Some(a) if a.ref_attr_name.is_some() => {
                Err(self.unsupported(format!("attribute '{name}' refers to a function attribute")))
            }
            other => Ok(other),
        }
    }

    pub fn int(&self, name: &str, default: i64) -> Result<i64> {
        Ok(match self.attr_checked(name)? {
            Some(a) => {
                a.i.ok_or_else(|| self.err(format!("attribute '{name}' should be an int")))?
            }
            None => default,
        })
    }

    /// A 0/1 attribute; any other value is an invalid model (ONNX Runtime rejects it too).
    pub fn flag(&self, name: &str, default: bool) -> Result<bool> {
        match self.int(name, default as i64)? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(self.err(format!("attribute '{name}' must be 0 or 1, got {v}"))),
        }
    }

    pub fn float(&self, name: &str, default: f32) -> Result<f32> {
        Ok(match self.attr_checked(name)? {
            Some(a) => {
                a.f.ok_or_else(|| self.err(format!("attribute '{name}' should be a float")))?
            }
            None => default,
        })
    }

    pub fn ints(&self, name: &str) -> Result<Option<Vec<i64>>> {
        Ok(self.attr_checked(name)?.map(|a| a.ints.clone()))
    }

    pub fn floats(&self, name: &str) -> Result<Option<Vec<f32>>> {
        Ok(self.attr_checked(name)?.map(|a| a.floats.clone()))
    }

    pub fn string(&self, name: &str, default: &str) -> Result<String> {
        Ok(match self.attr_checked(name)? {
            Some(a) => {
                let s = a
                    .s
                    .as_ref()
                    .ok_or_else(|| self.err(format!("attribute '{name}' should be a string")))?;
                String::from_utf8(s.clone())
                    .map_err(|_| self.err(format!("attribute '{name}' is not UTF-8")))?
            }
            None => default.to_owned(),
        })
    }

    pub fn strings(&self, name: &str) -> Result<Option<Vec<String>>> {
        let Some(a) = self.attr_checked(name)? else {
            return Ok(None);
        };
        a.strings
            .iter()
            .map(|s| {
                String::from_utf8(s.clone())
                    .map_err(|_| self.err(format!("attribute '{name}' is not UTF-8")))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    pub fn tensor(&self, name: &str) -> Result<Option<&'a TensorProto>> {
        Ok(self.attr_checked(name)?.and_then(|a| a.t.as_ref()))
    }

    /// The graph attribute `name` (a branch or loop body).
    pub fn graph(&self, name: &str) -> Result<&'a GraphProto> {
        self.attr_checked(name)?
            .and_then(|a| a.g.as_deref())
            .ok_or_else(|| self.err(format!("graph attribute '{name}' is missing")))
    }

    /// Whether the node carries a subgraph (If, Loop and Scan do).
    pub fn has_subgraph(&self) -> bool {
        self.proto.attribute.iter().any(|a| a.g.is_some())
    }
}
