//! The CPU backend's errors. Kernels return `CpuError`; the executor adds the op and node
//! and turns it into `ember_core::Error`.

use ember_core::Error;

#[derive(Debug, thiserror::Error)]
pub enum CpuError {
    /// An index tensor holds a value outside the indexed dim.
    #[error("index {index} is out of range for a dim of size {size}")]
    IndexOutOfRange { index: i64, size: usize },
    /// Shapes that do not fit together at run time.
    #[error("{0}")]
    Shape(String),
    /// Caller inputs or outputs that do not match the program.
    #[error("{0}")]
    Input(String),
    /// A dtype/op combination the IR allows but that has no meaning.
    #[error("{0}")]
    Unsupported(String),
    /// A broken invariant inside the backend.
    #[error("internal error: {0}")]
    Internal(String),
}

pub type KResult<T> = std::result::Result<T, CpuError>;

impl CpuError {
    /// The core error for a failure while running `op` at node `origin`.
    pub fn at_node(self, op: &str, origin: &str) -> Error {
        let msg = format!("{self} (op {op}, node '{origin}')");
        match self {
            CpuError::Shape(_) => Error::Shape(msg),
            CpuError::Input(_) => Error::Input(msg),
            _ => Error::Runtime(msg),
        }
    }
}

impl From<CpuError> for Error {
    fn from(e: CpuError) -> Error {
        match e {
            CpuError::Shape(m) => Error::Shape(m),
            CpuError::Input(m) => Error::Input(m),
            other => Error::Runtime(other.to_string()),
        }
    }
}
