//! Equality saturation with the `egglog` crate (DESIGN §4).
//!
//! One egglog program per compile: the schema ([`encode::SCHEMA`]), the rules generated for
//! this graph and backend ([`rules::generate`]), and the graph as terms. A schedule runs the
//! rulesets under iteration, e-node and wall-time budgets and reports whether it reached a
//! fixed point. The e-graph is then read back into plain Rust data ([`EGraphData`]) that
//! extraction (`crate::extract`) works on deterministically.

pub mod encode;
mod merge;
pub mod rules;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use egglog::{EGraph, Value};

pub use encode::{Source, Vocabulary};

use crate::backend::LoweringRule;
use crate::error::{Error, Result};
use crate::ir::Graph;

/// Limits of one saturation run.
#[derive(Clone, Debug)]
pub struct Budget {
    /// Rounds of the whole schedule (every ruleset once per round).
    pub iterations: usize,
    /// Stop once the e-graph holds this many e-nodes.
    pub max_nodes: usize,
    /// Stop once this much wall time has passed.
    pub time: Duration,
}

impl Default for Budget {
    fn default() -> Budget {
        Budget {
            iterations: 16,
            max_nodes: 20_000,
            time: Duration::from_secs(2),
        }
    }
}

/// What a saturation run did.
#[derive(Clone, Debug, Default)]
pub struct SaturationReport {
    pub iterations: usize,
    pub egraph_nodes: usize,
    /// Matches applied per rule name (`ruleset/rule`).
    pub rules_fired: BTreeMap<String, usize>,
    /// True when a whole round changed nothing: every rule's consequences are present.
    pub fixed_point: bool,
    /// Why the schedule stopped: "fixed point", "iteration budget", "node budget", "time budget".
    pub stop_reason: String,
    pub time_s: f64,
}

/// Dense e-class index (sorted by egglog's class id, so the order is deterministic).
pub type ClassId = usize;

/// What an e-node computes.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum NodeKind {
    /// A source node (key into `Vocabulary::sources`).
    Source(String),
    /// An op (key into `Vocabulary::ops`) applied to the children.
    Op(String),
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ENode {
    pub kind: NodeKind,
    pub children: Vec<ClassId>,
}

/// The saturated e-graph as plain data: every class's e-nodes in sorted order.
#[derive(Clone, Debug)]
pub struct EGraphData {
    pub classes: Vec<Vec<ENode>>,
    /// The class of each graph output.
    pub roots: Vec<ClassId>,
    pub vocab: Vocabulary,
}

/// The whole egglog program for `graph` (schema, rules, terms): exposed for tests and
/// debugging (`EMBER_DUMP_EGGLOG`).
pub fn program(graph: &Graph, lowering: &[LoweringRule]) -> (String, Vocabulary) {
    let mut vocab = Vocabulary::default();
    let terms = encode::encode_graph(graph, &mut vocab);
    let rules = rules::generate(graph, &mut vocab, lowering);
    (format!("{}\n{rules}\n{terms}", encode::SCHEMA), vocab)
}

/// Saturates `graph` under `budget`; returns the e-graph and what the run did.
pub fn saturate(
    graph: &Graph,
    lowering: &[LoweringRule],
    budget: &Budget,
) -> Result<(EGraphData, SaturationReport)> {
    let start = Instant::now();
    let (text, vocab) = program(graph, lowering);
    if let Ok(path) = std::env::var("EMBER_DUMP_EGGLOG") {
        let _ = std::fs::write(path, &text);
    }
    let egg_err = |e: egglog::Error| Error::Compile(format!("optimizer (egglog): {e}"));
    let mut eg = EGraph::default();
    eg.parse_and_run_program(None, &text).map_err(egg_err)?;

    let mut report = SaturationReport {
        stop_reason: "iteration budget".into(),
        ..Default::default()
    };
    for round in 0..budget.iterations {
        let mut changed = false;
        for rs in rules::RULESETS {
            let r = eg.step_rules(rs).map_err(egg_err)?;
            changed |= r.updated;
            for (rule, n) in &r.num_matches_per_rule {
                if *n > 0 {
                    *report.rules_fired.entry(rule.to_string()).or_insert(0) += n;
                }
            }
        }
        report.iterations = round + 1;
        report.egraph_nodes = enode_count(&eg);
        if !changed {
            report.fixed_point = true;
            report.stop_reason = "fixed point".into();
            break;
        }
        if report.egraph_nodes >= budget.max_nodes {
            report.stop_reason = "node budget".into();
            break;
        }
        if start.elapsed() >= budget.time {
            report.stop_reason = "time budget".into();
            break;
        }
    }
    report.egraph_nodes = enode_count(&eg);
    let data = read_back(&eg, vocab, graph.outputs.len())?;
    report.time_s = start.elapsed().as_secs_f64();
    Ok((data, report))
}

const TERM_CONSTRUCTORS: [&str; 6] = ["Src", "Op1", "Op2", "Op3", "Op4", "OpN"];

fn enode_count(eg: &EGraph) -> usize {
    TERM_CONSTRUCTORS.iter().map(|c| eg.get_size(c)).sum()
}

/// Reads the term tables into [`EGraphData`].
fn read_back(eg: &EGraph, vocab: Vocabulary, n_outputs: usize) -> Result<EGraphData> {
    let string =
        |v: Value| -> String { eg.value_to_base::<egglog::sort::S>(v).as_str().to_owned() };
    // List cells: class → (head, tail); lists are never unioned, so one cell per class.
    let mut cons: BTreeMap<Value, (Value, Value)> = BTreeMap::new();
    let egg_err = |e: egglog::Error| Error::Compile(format!("optimizer (egglog): {e}"));
    eg.constructor_enodes("Cons", |en| {
        cons.insert(en.eclass, (en.children[0], en.children[1]));
    })
    .map_err(egg_err)?;
    let mut raw: Vec<(Value, NodeKind, Vec<Value>)> = Vec::new();
    let mut list_error = None;
    for (c, name) in TERM_CONSTRUCTORS.iter().enumerate() {
        eg.constructor_enodes(name, |en| {
            if en.subsumed {
                return;
            }
            let ch = en.children;
            let (kind, children) = match c {
                0 => (NodeKind::Source(string(ch[0])), Vec::new()),
                5 => {
                    let mut items = Vec::new();
                    let mut cell = ch[1];
                    while let Some(&(head, tail)) = cons.get(&cell) {
                        items.push(head);
                        cell = tail;
                        if items.len() > 1 << 20 {
                            list_error = Some("an operand list does not end".to_string());
                            break;
                        }
                    }
                    (NodeKind::Op(string(ch[0])), items)
                }
                // Op1..Op4: key, c operands, dtype, rank.
                arity => (NodeKind::Op(string(ch[0])), ch[1..=arity].to_vec()),
            };
            raw.push((en.eclass, kind, children));
        })
        .map_err(egg_err)?;
    }
    if let Some(e) = list_error {
        return Err(Error::Compile(format!("optimizer: {e}")));
    }
    let mut roots_raw: BTreeMap<i64, Value> = BTreeMap::new();
    eg.constructor_enodes("Root", |en| {
        roots_raw.insert(eg.value_to_base::<i64>(en.children[0]), en.eclass);
    })
    .map_err(egg_err)?;

    // Dense, deterministic class numbering.
    let mut ids: BTreeMap<Value, ClassId> = BTreeMap::new();
    for (class, _, _) in &raw {
        let next = ids.len();
        ids.entry(*class).or_insert(next);
    }
    let sorted: Vec<Value> = ids.keys().copied().collect();
    for (i, v) in sorted.iter().enumerate() {
        ids.insert(*v, i);
    }
    let lookup = |v: &Value| -> Result<ClassId> {
        ids.get(v).copied().ok_or_else(|| {
            Error::Compile("optimizer: an e-node refers to a class with no terms".into())
        })
    };
    let mut classes: Vec<Vec<ENode>> = vec![Vec::new(); ids.len()];
    for (class, kind, children) in raw {
        let children = children.iter().map(lookup).collect::<Result<Vec<_>>>()?;
        classes[lookup(&class)?].push(ENode { kind, children });
    }
    for c in &mut classes {
        c.sort();
        c.dedup();
    }
    let mut roots = Vec::with_capacity(n_outputs);
    for i in 0..n_outputs {
        let v = roots_raw
            .get(&(i as i64))
            .ok_or_else(|| Error::Compile(format!("optimizer: output {i} was lost")))?;
        roots.push(lookup(v)?);
    }
    Ok(EGraphData {
        classes,
        roots,
        vocab,
    })
}
