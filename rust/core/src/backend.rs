//! The interface every backend implements. The core never names a backend: the Python
//! binding picks one and hands it graphs.

use std::collections::BTreeMap;

use crate::error::Result;
use crate::ir::Graph;
use crate::tensor::{HostTensor, TensorOut, TensorView};

/// Weights by name, bound once when a program is compiled.
pub type Weights = BTreeMap<String, HostTensor>;

pub trait Backend: Send + Sync {
    /// Short name for reports and cache keys ("cpu", "cuda").
    fn name(&self) -> &'static str;

    /// Turns a verified graph into an executable program. Weights are bound here, once.
    fn compile(&self, graph: &Graph, weights: &Weights) -> Result<Box<dyn Executable>>;
}

/// A compiled program. It may be run from several threads at once.
pub trait Executable: Send + Sync {
    /// Shapes of the outputs for inputs of the given shapes (binds dynamic dims, checks
    /// every input shape against the graph).
    fn output_shapes(&self, input_shapes: &[Vec<usize>]) -> Result<Vec<Vec<usize>>>;

    /// Runs the program on the caller's inputs, writing contiguous outputs of the shapes
    /// `output_shapes` returned.
    ///
    /// # Safety
    /// Every input view must be valid for reads over its shape and strides, and every output
    /// must be valid for writes of its full size and not alias any input, for the whole call.
    unsafe fn run(&self, inputs: &[TensorView], outputs: &[TensorOut]) -> Result<()>;
}
