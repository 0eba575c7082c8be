//! The ONNX frontend: decodes a `ModelProto` and builds an IR graph.
//!
//! `proto` declares the protobuf messages, `tensor` and `external` read tensor payloads,
//! `node` gives typed attribute access, `functions` inlines model-local functions, `known`
//! folds shape arithmetic into IR dims, `fold` evaluates other values computed from
//! constants only, `translate` walks the graph, and `ops/` holds one file per family of ONNX
//! ops (`ops/control.rs`: If, Loop and Scan, unrolled).

mod external;
mod fold;
mod functions;
mod known;
mod node;
mod ops;
mod proto;
mod tensor;
#[cfg(test)]
mod tests;
mod translate;

pub use translate::{load, Source, MAX_OPSET, MIN_OPSET};
