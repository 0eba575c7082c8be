//! The PT2 frontend: reads a `.pt2` archive (`torch.export.save`) and builds an IR graph.
//!
//! `archive` reads the zip safely, `args` parses node arguments, `translate` walks the
//! program, and `ops/` holds one file per family of ATen ops.

mod archive;
mod args;
mod complex;
mod ops;
mod sym_expr;
#[cfg(test)]
mod tests;
mod translate;

pub use archive::Source;
pub use translate::{load, Pt2Program, MUTATION_PREFIX};

/// Whether Ember translates the exported-program op `target` (as serialized, e.g.
/// `torch.ops.aten.add.Tensor` or `_operator.mul`). Decided by name: a supported op can
/// still refuse particular arguments when the graph is loaded.
pub fn supports(target: &str) -> bool {
    ops::handler(target).is_some() || complex::handles(target)
}
