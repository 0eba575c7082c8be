//! Ember's core: the tensor IR, its frontends, the reference interpreter and the backend
//! interface. It knows nothing of Python or of any particular backend.

pub mod backend;
pub mod cache;
pub mod dim;
pub mod dtype;
pub mod egraph;
pub mod error;
pub mod extract;
pub mod frontend;
pub mod interp;
pub mod ir;
pub mod search;
pub mod shapes;
pub mod tensor;

pub use error::{Error, Result};

/// This build's identity (a hash of the core's and the backends' sources, see `build.rs`):
/// caches keyed on it are not reused by an Ember with other rules or kernels.
pub const BUILD_ID: &str = env!("EMBER_BUILD_ID");
