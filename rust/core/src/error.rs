//! The core's error type. Every failure carries enough context (op, node, shapes) for a user
//! to find the cause; the Python binding maps each variant to its own exception class.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum Error {
    /// An operator Ember does not implement (yet). `node` names the source node.
    #[error("unsupported op '{op}' at node '{node}'{detail}")]
    UnsupportedOp {
        op: String,
        node: String,
        detail: String,
    },
    /// A graph or archive that is malformed or that the IR rejects.
    #[error("{0}")]
    Compile(String),
    /// Shapes that do not fit together.
    #[error("shape error: {0}")]
    Shape(String),
    /// Inputs passed at call time that do not match the compiled program.
    #[error("input error: {0}")]
    Input(String),
    /// A failure inside a backend while running a program.
    #[error("runtime error: {0}")]
    Runtime(String),
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn unsupported(op: impl Into<String>, node: impl Into<String>) -> Error {
        Error::UnsupportedOp {
            op: op.into(),
            node: node.into(),
            detail: String::new(),
        }
    }

    pub fn unsupported_because(
        op: impl Into<String>,
        node: impl Into<String>,
        why: impl AsRef<str>,
    ) -> Error {
        Error::UnsupportedOp {
            op: op.into(),
            node: node.into(),
            detail: format!(": {}", why.as_ref()),
        }
    }
}

/// `bail!(Compile, "...")`-style helper for the common variants.
#[macro_export]
macro_rules! fail {
    ($variant:ident, $($arg:tt)*) => {
        return Err($crate::error::Error::$variant(format!($($arg)*)))
    };
}
