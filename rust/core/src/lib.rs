//! Ember's core: the tensor IR, its frontends, the reference interpreter and the backend
//! interface. It knows nothing of Python or of any particular backend.

pub mod backend;
pub mod dim;
pub mod dtype;
pub mod error;
pub mod frontend;
pub mod interp;
pub mod ir;
pub mod shapes;
pub mod tensor;

pub use error::{Error, Result};
