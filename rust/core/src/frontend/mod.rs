//! Frontends turn a source program (a torch `.pt2` archive; ONNX later) into an IR graph.
//! `builder` holds what every frontend needs: broadcasting, type promotion, casts.

pub mod builder;
pub mod composites;
pub mod conv;
pub mod grid_sample;
pub mod onnx;
pub mod pt2;
pub mod resample;
pub mod sort;
