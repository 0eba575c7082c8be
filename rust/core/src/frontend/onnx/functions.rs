//! Model-local functions (`ModelProto.functions`): a call is inlined, its body's nodes
//! rewritten for that call: attributes that refer to the call's attributes (`ref_attr_name`)
//! take the call's values or the function's defaults, and inputs the call leaves out are
//! absent in the body.

use std::collections::HashMap;

use super::proto::{AttributeProto, FunctionProto, NodeProto};
use crate::error::{Error, Result};

/// The model's functions by (domain, name, overload).
#[derive(Default)]
pub struct Functions {
    by_key: HashMap<(String, String, String), FunctionProto>,
}

fn key(
    domain: Option<&str>,
    name: Option<&str>,
    overload: Option<&str>,
) -> (String, String, String) {
    let domain = match domain.unwrap_or("") {
        "ai.onnx" => "",
        d => d,
    };
    (
        domain.to_owned(),
        name.unwrap_or("").to_owned(),
        overload.unwrap_or("").to_owned(),
    )
}

impl Functions {
    pub fn new(functions: &[FunctionProto]) -> Functions {
        let by_key = functions
            .iter()
            .map(|f| {
                let k = key(
                    f.domain.as_deref(),
                    f.name.as_deref(),
                    f.overload.as_deref(),
                );
                (k, f.clone())
            })
            .collect();
        Functions { by_key }
    }

    /// The function `node` calls, if it calls a model-local one.
    pub fn called_by(&self, node: &NodeProto) -> Option<&FunctionProto> {
        if self.by_key.is_empty() {
            return None;
        }
        self.by_key.get(&key(
            node.domain.as_deref(),
            node.op_type.as_deref(),
            node.overload.as_deref(),
        ))
    }
}

/// The body of `f` as called by `call`: attribute references resolved, and the names of
/// formal inputs the call leaves out erased (an absent optional input).
pub fn instantiate(f: &FunctionProto, call: &NodeProto, call_name: &str) -> Result<Vec<NodeProto>> {
    if call.input.len() > f.input.len() || call.output.len() > f.output.len() {
        return Err(Error::Compile(format!(
            "node '{call_name}' calls function '{}' with {} inputs and {} outputs; it takes {} \
             and gives {}",
            f.name.as_deref().unwrap_or(""),
            call.input.len(),
            call.output.len(),
            f.input.len(),
            f.output.len()
        )));
    }
    let missing: Vec<&str> = f
        .input
        .iter()
        .enumerate()
        .filter(|&(k, _)| call.input.get(k).is_none_or(|s| s.is_empty()))
        .map(|(_, name)| name.as_str())
        .collect();
    let value_of = |name: &str| -> Option<&AttributeProto> {
        call.attribute
            .iter()
            .find(|a| a.name.as_deref() == Some(name))
            .or_else(|| {
                f.attribute_proto
                    .iter()
                    .find(|a| a.name.as_deref() == Some(name))
            })
    };
    let mut body = Vec::with_capacity(f.node.len());
    for node in &f.node {
        let mut node = node.clone();
        for input in node.input.iter_mut() {
            if missing.contains(&input.as_str()) {
                input.clear();
            }
        }
        let mut attributes = Vec::with_capacity(node.attribute.len());
        for a in node.attribute {
            let Some(r) = a.ref_attr_name.as_deref() else {
                attributes.push(a);
                continue;
            };
            // An attribute the call does not set and the function gives no default for is
            // unset in the body: the op's own default applies.
            if let Some(v) = value_of(r) {
                attributes.push(AttributeProto {
                    name: a.name.clone(),
                    ref_attr_name: None,
                    ..v.clone()
                });
            }
        }
        node.attribute = attributes;
        body.push(node);
    }
    Ok(body)
}
