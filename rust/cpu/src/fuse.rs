//! Fusion planning, done once per program: elementwise nodes are grouped into expression DAGs
//! that run as one blocked pass over the output (`kernels::fused`), and a `dot` or `conv`
//! feeding such a group (then bias add, residual, activation) becomes the group's head,
//! computed straight into the group's output before the elementwise pass runs over it in place.
//!
//! A node joins the group of its consumers when every consumer is in that one group and the
//! node is not a graph output, so each fused intermediate is read only inside its group and
//! never needs a buffer. With fusion off, every elementwise node is a group of its own.

use ember_core::dtype::DType;
use ember_core::ir::{Graph, Op};

use crate::kernels::chain::{self, Run};

/// How the executor treats a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Evaluated by its own kernel.
    Plain,
    /// Computed inside a group (no value of its own).
    Member(usize),
    /// The node whose value a group produces; the group runs when the executor reaches it.
    Root(usize),
}

/// One operation of a group: `node` applied to the values in `args` (slot numbers).
#[derive(Clone, Debug)]
pub struct Step {
    pub node: usize,
    pub args: Vec<usize>,
    /// The scratch slot the result goes to (the root writes to the output instead).
    pub out: usize,
}

/// A matrix product or convolution computed into the group's output first; `leaf` (the
/// dot/conv, or a reshape of it) is then read back from there.
#[derive(Clone, Debug)]
pub struct Head {
    pub dot: usize,
    pub leaf: usize,
}

#[derive(Clone, Debug)]
pub struct Group {
    pub root: usize,
    /// Values read from outside; leaf i is slot i.
    pub leaves: Vec<usize>,
    pub head: Option<Head>,
    /// In topological order; the last one is the root.
    pub steps: Vec<Step>,
    /// Scratch slots needed (leaves first, then reused step slots).
    pub slots: usize,
    /// How the steps run: one by one, or in register-resident chains (`kernels::chain`).
    pub runs: Vec<Run>,
}

pub struct Fusion {
    pub role: Vec<Role>,
    pub groups: Vec<Group>,
}

pub fn is_elementwise(op: &Op) -> bool {
    matches!(
        op,
        Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast { .. }
    )
}

/// Dtypes whose `dot` writes its result straight into a buffer (see `kernels::dot::dot_into`).
pub fn dot_in_place(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64 | DType::F16)
}

impl Fusion {
    pub fn plan(g: &Graph, fuse: bool) -> Fusion {
        let n = g.nodes.len();
        let mut consumers: Vec<Vec<usize>> = vec![Vec::new(); n];
        for (id, node) in g.nodes.iter().enumerate() {
            for &i in &node.inputs {
                if consumers[i].last() != Some(&id) {
                    consumers[i].push(id);
                }
            }
        }
        let mut is_output = vec![false; n];
        for &o in &g.outputs {
            is_output[o] = true;
        }
        // Groups by their root, walking from the last node back.
        let mut group_of: Vec<Option<usize>> = vec![None; n];
        let mut roots: Vec<usize> = Vec::new();
        for id in (0..n).rev() {
            if !is_elementwise(&g.nodes[id].op) {
                continue;
            }
            let joined = match consumers[id].split_first() {
                Some((&c, rest)) if fuse && !is_output[id] => {
                    group_of[c].filter(|&k| rest.iter().all(|&r| group_of[r] == Some(k)))
                }
                _ => None,
            };
            group_of[id] = Some(joined.unwrap_or_else(|| {
                roots.push(id);
                roots.len() - 1
            }));
        }
        let mut role = vec![Role::Plain; n];
        let sole_use = |i: usize, by: usize| !is_output[i] && consumers[i] == [by];
        let mut groups = Vec::with_capacity(roots.len());
        for (k, &root) in roots.iter().enumerate() {
            let members: Vec<usize> = (0..=root).filter(|&i| group_of[i] == Some(k)).collect();
            let mut leaves: Vec<usize> = Vec::new();
            let mut slot_of = vec![usize::MAX; n];
            for &m in &members {
                for &i in &g.nodes[m].inputs {
                    if group_of[i] != Some(k) && !leaves.contains(&i) {
                        slot_of[i] = leaves.len();
                        leaves.push(i);
                    }
                }
            }
            // The head: a dot (through reshapes) read only by this group.
            let head = if fuse {
                leaves.iter().find_map(|&leaf| {
                    let in_group =
                        !is_output[leaf] && consumers[leaf].iter().all(|&c| group_of[c] == Some(k));
                    let mut cur = leaf;
                    while let Op::Reshape { .. } = g.nodes[cur].op {
                        let src = g.nodes[cur].inputs[0];
                        if !sole_use(src, cur) {
                            return None;
                        }
                        cur = src;
                    }
                    let dtype = g.nodes[cur].ty.dtype;
                    // The head is computed into the root's buffer: same dtype needed (a dot
                    // cast to another type, e.g. int32, is its own step).
                    let in_place = dtype == g.nodes[root].ty.dtype
                        && match g.nodes[cur].op {
                            Op::Dot => dot_in_place(dtype),
                            Op::Conv { .. } => crate::kernels::conv::conv_in_place(dtype),
                            _ => false,
                        };
                    (in_group && in_place).then_some(Head { dot: cur, leaf })
                })
            } else {
                None
            };
            if let Some(h) = &head {
                let mut cur = h.leaf;
                loop {
                    role[cur] = Role::Member(k);
                    if cur == h.dot {
                        break;
                    }
                    cur = g.nodes[cur].inputs[0];
                }
            }
            // Steps, with scratch slots reused once their last reader has run.
            let mut last_read = vec![0usize; n];
            for (s, &m) in members.iter().enumerate() {
                for &i in &g.nodes[m].inputs {
                    last_read[i] = s;
                }
            }
            let mut free: Vec<usize> = Vec::new();
            let mut slots = leaves.len();
            let mut steps = Vec::with_capacity(members.len());
            for (s, &m) in members.iter().enumerate() {
                let args: Vec<usize> = g.nodes[m].inputs.iter().map(|&i| slot_of[i]).collect();
                let out = if m == root {
                    usize::MAX
                } else {
                    free.pop().unwrap_or_else(|| {
                        slots += 1;
                        slots - 1
                    })
                };
                for &i in &g.nodes[m].inputs {
                    let slot = slot_of[i];
                    if group_of[i] == Some(k) && last_read[i] == s && !free.contains(&slot) {
                        free.push(slot);
                    }
                }
                slot_of[m] = out;
                steps.push(Step { node: m, args, out });
                role[m] = if m == root {
                    Role::Root(k)
                } else {
                    Role::Member(k)
                };
            }
            let runs = chain::runs(g, &consumers, &steps);
            groups.push(Group {
                root,
                leaves,
                head,
                steps,
                slots,
                runs,
            });
        }
        Fusion { role, groups }
    }

    /// The values node `id` reads when the executor runs it (none for members).
    pub fn reads(&self, g: &Graph, id: usize) -> Vec<usize> {
        match self.role[id] {
            Role::Plain => g.nodes[id].inputs.clone(),
            Role::Member(_) => Vec::new(),
            Role::Root(k) => {
                let grp = &self.groups[k];
                let mut r: Vec<usize> = grp
                    .leaves
                    .iter()
                    .copied()
                    .filter(|&l| grp.head.as_ref().is_none_or(|h| h.leaf != l))
                    .collect();
                if let Some(h) = &grp.head {
                    r.extend(&g.nodes[h.dot].inputs);
                }
                r
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ember_core::dim::Dim;
    use ember_core::ir::{BinaryOp, TensorType, UnaryOp};

    fn input(g: &mut Graph, index: usize, shape: &[usize]) -> usize {
        let ty = TensorType::new(DType::F32, shape.iter().map(|&d| Dim::from(d)).collect());
        g.add_source(Op::Input { index }, ty, "in").unwrap()
    }

    #[test]
    fn chain_is_one_group_and_shared_values_split_groups() {
        let mut g = Graph::new();
        let x = input(&mut g, 0, &[4]);
        let e = g.add(Op::Unary(UnaryOp::Exp), &[x], "e").unwrap();
        let s = g.add(Op::Binary(BinaryOp::Mul), &[e, e], "sq").unwrap();
        let t = g.add(Op::Unary(UnaryOp::Tanh), &[s], "t").unwrap();
        let u = g.add(Op::Binary(BinaryOp::Add), &[t, x], "u").unwrap();
        let sm = g
            .add(
                Op::Softmax {
                    axis: 0,
                    log: false,
                },
                &[t],
                "sm",
            )
            .unwrap();
        g.outputs.extend([u, sm]);
        let f = Fusion::plan(&g, true);
        // t is read by u and by the softmax: it roots its own group {e, s, t}; u is alone.
        assert_eq!(f.groups.len(), 2);
        assert_eq!(
            f.role[t],
            Role::Root(f.groups.iter().position(|k| k.root == t).unwrap())
        );
        assert!(matches!(f.role[e], Role::Member(_)) && matches!(f.role[s], Role::Member(_)));
        let gt = f.groups.iter().find(|k| k.root == t).unwrap();
        assert_eq!(gt.leaves, vec![x]);
        assert_eq!(gt.steps.len(), 3);
        assert_eq!(f.reads(&g, u), vec![t, x]);
        let off = Fusion::plan(&g, false);
        assert_eq!(off.groups.len(), 4);
        assert!(off.role.iter().all(|r| !matches!(r, Role::Member(_))));
    }

    #[test]
    fn linear_gets_a_head() {
        let mut g = Graph::new();
        let x = input(&mut g, 0, &[2, 3, 4]);
        let w = input(&mut g, 1, &[5, 4]);
        let b = input(&mut g, 2, &[5]);
        let x2 = g
            .add(
                Op::Reshape {
                    shape: vec![Dim::from(6usize), Dim::from(4usize)],
                },
                &[x],
                "f",
            )
            .unwrap();
        let wt = g.add(Op::Permute { perm: vec![1, 0] }, &[w], "wt").unwrap();
        let d = g.add(Op::Dot, &[x2, wt], "dot").unwrap();
        let shape: Vec<Dim> = [2usize, 3, 5].iter().map(|&v| Dim::from(v)).collect();
        let d3 = g
            .add(
                Op::Reshape {
                    shape: shape.clone(),
                },
                &[d],
                "u",
            )
            .unwrap();
        let one: Vec<Dim> = [1usize, 1, 5].iter().map(|&v| Dim::from(v)).collect();
        let br = g.add(Op::Reshape { shape: one }, &[b], "r").unwrap();
        let be = g.add(Op::Expand { shape }, &[br], "e").unwrap();
        let a = g.add(Op::Binary(BinaryOp::Add), &[d3, be], "add").unwrap();
        let y = g.add(Op::Unary(UnaryOp::Gelu), &[a], "gelu").unwrap();
        g.outputs.push(y);
        let f = Fusion::plan(&g, true);
        assert_eq!(f.groups.len(), 1);
        let h = f.groups[0].head.as_ref().unwrap();
        assert_eq!((h.dot, h.leaf), (d, d3));
        assert!(matches!(f.role[d], Role::Member(0)) && matches!(f.role[d3], Role::Member(0)));
        assert_eq!(f.reads(&g, y), vec![be, x2, wt]);
        assert!(Fusion::plan(&g, false)
            .groups
            .iter()
            .all(|k| k.head.is_none()));
    }

    /// A quantizing pass (scale, round, shift, clamp, cast to int8) is one register chain
    /// where the CPU runs chains; a step whose result is read twice ends a chain.
    #[test]
    fn quantize_pass_is_one_chain() {
        let mut g = Graph::new();
        let x = input(&mut g, 0, &[4, 40]);
        let s = input(&mut g, 1, &[4, 40]);
        let bin = |g: &mut Graph, op, a, b| g.add(Op::Binary(op), &[a, b], "b").unwrap();
        let d = bin(&mut g, BinaryOp::Div, x, s);
        let r = g.add(Op::Unary(UnaryOp::Round), &[d], "r").unwrap();
        let a = bin(&mut g, BinaryOp::Add, r, s);
        let lo = bin(&mut g, BinaryOp::Max, a, s);
        let hi = bin(&mut g, BinaryOp::Min, lo, s);
        let q = g.add(Op::Cast { to: DType::I8 }, &[hi], "q").unwrap();
        g.outputs.push(q);
        let f = Fusion::plan(&g, true);
        let runs = &f.groups[0].runs;
        match chain::available() {
            true => assert!(
                matches!(runs[..], [Run::Chain(ref c)] if c.last == 5),
                "{runs:?}"
            ),
            false => assert_eq!(runs.len(), 6),
        }
        // `r` also read later: the chain ends at `r`, whose value a second chain reads.
        let mut g = Graph::new();
        let x = input(&mut g, 0, &[4, 40]);
        let s = input(&mut g, 1, &[4, 40]);
        let d = bin(&mut g, BinaryOp::Div, x, s);
        let r = g.add(Op::Unary(UnaryOp::Round), &[d], "r").unwrap();
        let a = bin(&mut g, BinaryOp::Add, r, s);
        let m = bin(&mut g, BinaryOp::Max, a, s);
        let t = bin(&mut g, BinaryOp::Add, m, r);
        let q = g.add(Op::Cast { to: DType::I8 }, &[t], "q").unwrap();
        g.outputs.push(q);
        let f = Fusion::plan(&g, true);
        let chains: Vec<usize> = f.groups[0]
            .runs
            .iter()
            .filter_map(|r| match r {
                Run::Chain(c) => Some(c.last),
                Run::Step(_) => None,
            })
            .collect();
        if chain::available() {
            assert_eq!(chains, vec![1, 5], "{:?}", f.groups[0].runs);
        }
    }
}
