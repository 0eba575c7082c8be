//! The IR as egglog terms.
//!
//! Every term carries its dtype and rank as constructor arguments (DESIGN §4), so a rule
//! written for one rank or dtype cannot match another, and no union can change a type. The
//! op itself (with all its attributes) is a string key; [`Vocabulary`] maps every key back to
//! the op it stands for, so extraction never parses strings. Shapes are not part of terms:
//! they are recomputed by the IR's type rules when a candidate graph is rebuilt, and the
//! shapes the input graph already knows are given to the rules as `HasShape` facts.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Arc;

use crate::dim::format_shape;
use crate::dtype::{DType, Scalar};
use crate::ir::{Graph, Op, TensorType};

/// Declarations every program starts with.
pub const SCHEMA: &str = r#"
(sort Expr)
(datatype List (Nil) (Cons Expr List))
(constructor Src (String String i64) Expr)
(constructor Op1 (String Expr String i64) Expr)
(constructor Op2 (String Expr Expr String i64) Expr)
(constructor Op3 (String Expr Expr Expr String i64) Expr)
(constructor Op4 (String Expr Expr Expr Expr String i64) Expr)
(constructor OpN (String List String i64) Expr)
(constructor Root (i64) Expr)
(relation HasShape (Expr String))
(relation DTypeOf (Expr String))
(relation OneLike (Expr))
(relation ZeroLike (Expr))
(relation IsReshape (String))
(relation IsExpand (String))
(relation ReshapeTo (String String))
(relation ExpandTo (String String))
(relation ElementwiseUnary (String))
(relation ElementwiseBinary (String))
"#;

/// A source node (input, weight, constant, full, iota) a `Src` term stands for.
#[derive(Clone, Debug)]
pub struct Source {
    pub op: Op,
    pub ty: TensorType,
    pub origin: Arc<str>,
}

/// What every key string in the e-graph stands for.
#[derive(Clone, Debug, Default)]
pub struct Vocabulary {
    pub ops: BTreeMap<String, Op>,
    pub sources: BTreeMap<String, Source>,
}

impl Vocabulary {
    /// The key of a (non-source) op, registering it.
    pub fn op(&mut self, op: &Op) -> String {
        let key = op_key(op);
        self.ops.entry(key.clone()).or_insert_with(|| op.clone());
        key
    }

    /// The key of a `full` source of the given type, registering it.
    pub fn full(&mut self, value: Scalar, ty: &TensorType) -> String {
        self.source(Op::Full { value }, ty)
    }

    /// The key of a source op (full, iota) of the given type that rules create, registering it.
    pub fn source(&mut self, op: Op, ty: &TensorType) -> String {
        let key = sanitize(&format!("{op:?} {}{}", ty.dtype, format_shape(&ty.shape)));
        self.sources.entry(key.clone()).or_insert_with(|| Source {
            op,
            ty: ty.clone(),
            origin: Arc::from("optimizer"),
        });
        key
    }
}

/// The unique, printable key of an op with its attributes.
pub fn op_key(op: &Op) -> String {
    sanitize(&format!("{op:?}"))
}

/// egglog string literals cannot hold `"`; keys never need one.
fn sanitize(s: &str) -> String {
    s.replace(['"', '\\'], "'")
}

/// `"text"` as an egglog string literal.
pub fn lit(s: &str) -> String {
    format!("\"{}\"", sanitize(s))
}

pub fn dtype_lit(d: DType) -> String {
    lit(d.name())
}

/// A term applying op key `key` (already a literal or a variable) to `args`.
pub fn term(key: &str, args: &[String], dtype: &str, rank: &str) -> String {
    match args.len() {
        1..=4 => format!("(Op{} {key} {} {dtype} {rank})", args.len(), args.join(" ")),
        _ => {
            let mut list = "(Nil)".to_string();
            for a in args.iter().rev() {
                list = format!("(Cons {a} {list})");
            }
            format!("(OpN {key} {list} {dtype} {rank})")
        }
    }
}

/// The key of the source term for node `id` of the input graph.
pub fn node_source_key(id: usize) -> String {
    format!("%{id}")
}

/// The graph as `let` bindings (`n<id>`), with shape and constant facts, and its outputs as
/// `Root` terms. Returns the program text.
pub fn encode_graph(graph: &Graph, vocab: &mut Vocabulary) -> String {
    let mut out = String::new();
    for (id, node) in graph.nodes.iter().enumerate() {
        let (d, r) = (dtype_lit(node.ty.dtype), node.ty.rank().to_string());
        let t = if node.inputs.is_empty() {
            let key = node_source_key(id);
            vocab.sources.insert(
                key.clone(),
                Source {
                    op: node.op.clone(),
                    ty: node.ty.clone(),
                    origin: node.origin.clone(),
                },
            );
            format!("(Src {} {d} {r})", lit(&key))
        } else {
            let key = lit(&vocab.op(&node.op));
            let args: Vec<String> = node.inputs.iter().map(|i| format!("n{i}")).collect();
            term(&key, &args, &d, &r)
        };
        let _ = writeln!(out, "(let n{id} {t})");
        let _ = writeln!(
            out,
            "(HasShape n{id} {})",
            lit(&format_shape(&node.ty.shape))
        );
        if let Op::Full { value } = node.op {
            if value.as_f64() == 1.0 {
                let _ = writeln!(out, "(OneLike n{id})");
            } else if value.as_f64().to_bits() == 0 {
                // +0 only: `x - (-0.0)` is not `x` when x is -0.
                let _ = writeln!(out, "(ZeroLike n{id})");
            }
        }
    }
    for (i, o) in graph.outputs.iter().enumerate() {
        let _ = writeln!(out, "(union (Root {i}) n{o})");
    }
    out
}
