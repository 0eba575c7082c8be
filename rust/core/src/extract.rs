//! Deterministic extraction (DESIGN §5): a cost model picks the default program bottom-up;
//! a *genome* (one e-node choice per contested e-class) describes every other candidate.
//!
//! Determinism comes from the data: classes are numbered in egglog's id order and each
//! class's e-nodes are sorted, ties keep the first e-node, and nothing iterates a hash map.
//! Candidates are acyclic by construction: the default choice of a class always costs more
//! than each of its children (every op costs > 0), and a genome that closes a cycle is
//! rejected when its graph is built.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crate::dim::{Dim, SymbolBindings};
use crate::egraph::{ClassId, EGraphData, NodeKind};
use crate::error::{Error, Result};
use crate::ir::{infer_type, Graph, Op, TensorType};

/// One e-node choice per contested class; classes not listed take their default.
pub type Genome = BTreeMap<ClassId, usize>;

/// A program the optimizer may run: its choices, its graph and its modelled cost.
#[derive(Clone, Debug)]
pub struct Candidate {
    pub genome: Genome,
    pub graph: Graph,
    pub cost: f64,
    /// What differs from the default program, for reports.
    pub description: String,
}

/// Estimated cost of running one op (arbitrary units ~ element passes over memory).
pub trait CostModel {
    fn node_cost(&self, op: &Op, inputs: &[&TensorType], output: &TensorType) -> f64;

    /// Extra cost of a reshape that cannot be a view because it merges a broadcast dim with
    /// others (backends then copy the broadcast into a full-size buffer).
    fn copy_cost(&self, output: &TensorType) -> f64;
}

/// A backend-neutral model: bytes moved plus arithmetic, plus a fixed per-op overhead, with
/// symbolic dims evaluated at example sizes.
pub struct DefaultCost {
    pub sizes: SymbolBindings,
}

/// Fixed cost of launching any op (in element passes): fewer ops win ties.
const OP_OVERHEAD: f64 = 64.0;

impl DefaultCost {
    fn numel(&self, t: &TensorType) -> f64 {
        t.shape
            .iter()
            .map(|d| dim_size(d, &self.sizes))
            .product::<f64>()
    }
}

/// A dim's value at the example sizes (64 for a symbol with no example).
fn dim_size(d: &Dim, sizes: &SymbolBindings) -> f64 {
    d.eval(sizes).map(|v| v.max(0) as f64).unwrap_or(64.0)
}

impl CostModel for DefaultCost {
    fn node_cost(&self, op: &Op, inputs: &[&TensorType], output: &TensorType) -> f64 {
        let out = self.numel(output);
        let ins: f64 = inputs.iter().map(|t| self.numel(t)).sum();
        match op {
            Op::Input { .. } | Op::Weight { .. } | Op::Constant(_) => 0.0,
            Op::Full { .. } | Op::Iota { .. } => OP_OVERHEAD * 0.5,
            // Views cost little where they are, but each one makes its consumer's loads
            // strided: a small price keeps view chains short.
            op if op.is_view() => 1.0,
            // A backend kernel is an alternative to measure, not a default: a hair dearer.
            Op::Kernel { base, .. } => self.node_cost(base, inputs, output) * 1.02 + 1.0,
            Op::Dot | Op::IntegerDot | Op::BlockQuantDot { .. } => {
                let k = inputs
                    .first()
                    .and_then(|a| a.shape.last())
                    .map(|d| dim_size(d, &self.sizes))
                    .unwrap_or(1.0);
                OP_OVERHEAD + out * k / 8.0 + ins + out
            }
            Op::Softmax { .. } | Op::LayerNorm { .. } | Op::RmsNorm { .. } => {
                OP_OVERHEAD + 3.0 * out
            }
            Op::Attention { .. } => {
                let q = inputs.first().map(|t| self.numel(t)).unwrap_or(out);
                let s = inputs
                    .get(1)
                    .and_then(|k| k.shape.iter().rev().nth(1))
                    .map(|d| dim_size(d, &self.sizes))
                    .unwrap_or(1.0);
                OP_OVERHEAD + q * s / 4.0 + ins + out
            }
            Op::Reduce { .. } | Op::Scan { .. } => OP_OVERHEAD + ins + out,
            _ => OP_OVERHEAD + ins + out,
        }
    }

    fn copy_cost(&self, output: &TensorType) -> f64 {
        OP_OVERHEAD + 2.0 * self.numel(output)
    }
}

/// Types, costs and default choices of every class of a saturated e-graph.
pub struct Extractor<'a> {
    pub data: &'a EGraphData,
    /// The type of each class (None: no e-node's inputs could be typed).
    pub types: Vec<Option<TensorType>>,
    /// Per class, per e-node: the op it computes (None: untypable or unknown key).
    ops: Vec<Vec<Option<Op>>>,
    /// Cost of the default (cheapest) tree rooted at each class.
    pub cost: Vec<f64>,
    /// The default e-node of each class.
    pub best: Vec<Option<usize>>,
    /// The modelled cost of each e-node itself (without its children).
    node_costs: Vec<Vec<f64>>,
    /// Origin names of the input graph's nodes by op key, for error messages in candidates.
    origins: BTreeMap<String, Arc<str>>,
}

impl<'a> Extractor<'a> {
    pub fn new(data: &'a EGraphData, original: &Graph, model: &dyn CostModel) -> Extractor<'a> {
        let n = data.classes.len();
        let mut ops: Vec<Vec<Option<Op>>> = Vec::with_capacity(n);
        for class in &data.classes {
            ops.push(
                class
                    .iter()
                    .map(|en| match &en.kind {
                        NodeKind::Source(k) => data.vocab.sources.get(k).map(|s| s.op.clone()),
                        NodeKind::Op(k) => data.vocab.ops.get(k).cloned(),
                    })
                    .collect(),
            );
        }
        let mut origins = BTreeMap::new();
        for node in &original.nodes {
            origins
                .entry(crate::egraph::encode::op_key(&node.op))
                .or_insert_with(|| node.origin.clone());
        }
        let mut ex = Extractor {
            data,
            types: vec![None; n],
            ops,
            cost: vec![f64::INFINITY; n],
            best: vec![None; n],
            node_costs: data.classes.iter().map(|c| vec![0.0; c.len()]).collect(),
            origins,
        };
        ex.infer_types();
        ex.compute_costs(model);
        ex
    }

    /// Types every class from any e-node whose inputs are typed, to a fixed point.
    fn infer_types(&mut self) {
        let mut changed = true;
        while changed {
            changed = false;
            for c in 0..self.data.classes.len() {
                if self.types[c].is_some() {
                    continue;
                }
                for (i, en) in self.data.classes[c].iter().enumerate() {
                    if let Some(t) = self.enode_type(c, i, &en.children) {
                        self.types[c] = Some(t);
                        changed = true;
                        break;
                    }
                }
            }
        }
    }

    fn enode_type(&self, c: ClassId, i: usize, children: &[ClassId]) -> Option<TensorType> {
        let op = self.ops[c][i].as_ref()?;
        match &self.data.classes[c][i].kind {
            NodeKind::Source(k) => Some(self.data.vocab.sources.get(k)?.ty.clone()),
            NodeKind::Op(_) => {
                let ins: Vec<&TensorType> = children
                    .iter()
                    .map(|&ch| self.types[ch].as_ref())
                    .collect::<Option<_>>()?;
                infer_type(op, &ins, None).ok()
            }
        }
    }

    /// An e-node is usable when its op is known and its type matches its class's type.
    fn usable(&self, c: ClassId, i: usize) -> bool {
        let en = &self.data.classes[c][i];
        match (&self.types[c], self.enode_type(c, i, &en.children)) {
            (Some(want), Some(got)) => want.dtype == got.dtype && want.rank() == got.rank(),
            _ => false,
        }
    }

    /// Bottom-up costs to a fixed point (Bellman-Ford style; positive op costs make the
    /// default choices acyclic).
    fn compute_costs(&mut self, model: &dyn CostModel) {
        let n = self.data.classes.len();
        let broadcast: Vec<bool> = (0..n).map(|c| self.is_broadcast(c)).collect();
        for c in 0..n {
            for i in 0..self.data.classes[c].len() {
                let en = &self.data.classes[c][i];
                let cost = match (&self.ops[c][i], &self.types[c]) {
                    (Some(op), Some(out)) if self.usable(c, i) => {
                        let ins: Vec<&TensorType> = en
                            .children
                            .iter()
                            .filter_map(|&ch| self.types[ch].as_ref())
                            .collect();
                        let copies = matches!(op, Op::Reshape { .. })
                            && en.children.first().is_some_and(|&ch| broadcast[ch])
                            && ins.first().is_some_and(|x| !same_but_unit_dims(x, out));
                        // Strictly positive for ops, so a class costs more than its children.
                        model.node_cost(op, &ins, out).max(0.0)
                            + if copies { model.copy_cost(out) } else { 0.0 }
                            + if en.children.is_empty() { 0.0 } else { 1e-3 }
                    }
                    _ => f64::INFINITY,
                };
                self.node_costs[c][i] = cost;
            }
        }
        let mut changed = true;
        while changed {
            changed = false;
            for c in 0..n {
                for (i, en) in self.data.classes[c].iter().enumerate() {
                    let own = self.node_costs[c][i];
                    if !own.is_finite() {
                        continue;
                    }
                    let total = own + en.children.iter().map(|&ch| self.cost[ch]).sum::<f64>();
                    // Strictly cheaper only: ties keep the earlier e-node.
                    if total < self.cost[c] {
                        self.cost[c] = total;
                        self.best[c] = Some(i);
                        changed = true;
                    }
                }
            }
        }
    }

    /// Whether class `c` is a broadcast: one of its e-nodes expands a size-1 dim.
    fn is_broadcast(&self, c: ClassId) -> bool {
        let Some(out) = &self.types[c] else {
            return false;
        };
        self.data.classes[c].iter().enumerate().any(|(i, en)| {
            let (Some(Op::Expand { .. }), Some(&x)) = (&self.ops[c][i], en.children.first()) else {
                return false;
            };
            self.types[x].as_ref().is_some_and(|xt| {
                xt.shape
                    .iter()
                    .zip(&out.shape)
                    .any(|(a, b)| a.as_const() == Some(1) && b.as_const() != Some(1))
            })
        })
    }

    /// The usable e-nodes of class `c` other than its default, with their tree costs.
    pub fn alternatives(&self, c: ClassId) -> Vec<(usize, f64)> {
        let mut out = Vec::new();
        for (i, en) in self.data.classes[c].iter().enumerate() {
            if Some(i) == self.best[c] || !self.node_costs[c][i].is_finite() {
                continue;
            }
            let total =
                self.node_costs[c][i] + en.children.iter().map(|&ch| self.cost[ch]).sum::<f64>();
            if total.is_finite() {
                out.push((i, total));
            }
        }
        out
    }

    /// Classes the default program reads, in sorted order.
    pub fn default_classes(&self) -> BTreeSet<ClassId> {
        let mut seen = BTreeSet::new();
        let mut stack: Vec<ClassId> = self.data.roots.clone();
        while let Some(c) = stack.pop() {
            if !seen.insert(c) {
                continue;
            }
            if let Some(i) = self.best[c] {
                stack.extend(&self.data.classes[c][i].children);
            }
        }
        seen
    }

    /// Builds the program a genome describes. `original` supplies the inputs, in order, so
    /// that the candidate keeps the caller's signature even for unused inputs.
    pub fn build(&self, genome: &Genome, original: &Graph) -> Result<Graph> {
        let mut g = Graph::new();
        g.symbols = original.symbols.clone();
        let mut built: BTreeMap<ClassId, usize> = BTreeMap::new();
        let mut sources: BTreeMap<String, usize> = BTreeMap::new();
        for &i in &original.inputs {
            let node = &original.nodes[i];
            let id = g.add_source(node.op.clone(), node.ty.clone(), &node.origin)?;
            sources.insert(crate::egraph::encode::node_source_key(i), id);
        }
        let mut outputs = Vec::new();
        for &root in &self.data.roots {
            let mut on_path = BTreeSet::new();
            outputs.push(self.build_class(
                root,
                genome,
                &mut g,
                &mut built,
                &mut sources,
                &mut on_path,
            )?);
        }
        g.outputs = outputs;
        // Types re-inferred from the ops bring back clamps the frontend simplified away.
        g.simplify_dims();
        crate::ir::verify(&g)?;
        for (k, (&o, &want)) in g.outputs.iter().zip(&original.outputs).enumerate() {
            let (a, b) = (g.ty(o), original.ty(want));
            if a.dtype != b.dtype || a.rank() != b.rank() {
                return Err(Error::Compile(format!(
                    "optimizer: candidate output {k} is {a:?}, the program's is {b:?}"
                )));
            }
        }
        Ok(g)
    }

    fn build_class(
        &self,
        c: ClassId,
        genome: &Genome,
        g: &mut Graph,
        built: &mut BTreeMap<ClassId, usize>,
        sources: &mut BTreeMap<String, usize>,
        on_path: &mut BTreeSet<ClassId>,
    ) -> Result<usize> {
        if let Some(&id) = built.get(&c) {
            return Ok(id);
        }
        if !on_path.insert(c) {
            return Err(Error::Compile(
                "optimizer: this choice of e-nodes is cyclic".into(),
            ));
        }
        // Genomes may come from a cache written for another e-graph: check every index.
        let i = genome
            .get(&c)
            .copied()
            .or_else(|| self.best.get(c).copied().flatten())
            .ok_or_else(|| Error::Compile(format!("optimizer: class {c} has no program")))?;
        let en = self
            .data
            .classes
            .get(c)
            .and_then(|class| class.get(i))
            .ok_or_else(|| Error::Compile(format!("optimizer: no e-node {i} in class {c}")))?;
        let id = match &en.kind {
            NodeKind::Source(key) => {
                if let Some(&id) = sources.get(key) {
                    id
                } else {
                    let s = self.data.vocab.sources.get(key).ok_or_else(|| {
                        Error::Compile(format!("optimizer: unknown source '{key}'"))
                    })?;
                    let id = g.add_source(s.op.clone(), s.ty.clone(), &s.origin)?;
                    sources.insert(key.clone(), id);
                    id
                }
            }
            NodeKind::Op(key) => {
                let op =
                    self.data.vocab.ops.get(key).ok_or_else(|| {
                        Error::Compile(format!("optimizer: unknown op key '{key}'"))
                    })?;
                let mut ins = Vec::with_capacity(en.children.len());
                for &ch in &en.children {
                    ins.push(self.build_class(ch, genome, g, built, sources, on_path)?);
                }
                let origin = self
                    .origins
                    .get(key)
                    .cloned()
                    .unwrap_or_else(|| Arc::from("optimizer"));
                g.add(op.clone(), &ins, &origin)?
            }
        };
        on_path.remove(&c);
        built.insert(c, id);
        Ok(id)
    }

    /// A readable form of e-node `i` of class `c`: its op applied to the default ops of
    /// its operands (`dot(reshape, permute@cpu.packed)`).
    /// The op e-node `i` of class `c` computes (None: unknown key).
    pub fn op(&self, c: ClassId, i: usize) -> Option<&Op> {
        self.ops.get(c)?.get(i)?.as_ref()
    }

    pub fn describe(&self, c: ClassId, i: usize) -> String {
        let name = |c: ClassId, i: usize| match &self.ops[c][i] {
            Some(op) => op.name(),
            None => "?".into(),
        };
        let args: Vec<String> = self.data.classes[c][i]
            .children
            .iter()
            .map(|&ch| self.best[ch].map(|b| name(ch, b)).unwrap_or_default())
            .collect();
        if args.is_empty() {
            name(c, i)
        } else {
            format!("{}({})", name(c, i), args.join(", "))
        }
    }
}

/// Whether `a` and `b` list the same dims once size-1 dims are dropped (a reshape between
/// them only adds or removes unit dims, so it stays a view even of a broadcast).
fn same_but_unit_dims(a: &TensorType, b: &TensorType) -> bool {
    let non_unit = |t: &TensorType| -> Vec<Dim> {
        t.shape
            .iter()
            .filter(|d| d.as_const() != Some(1))
            .cloned()
            .collect()
    };
    non_unit(a) == non_unit(b)
}
