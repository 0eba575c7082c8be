//! Reference interpreter (being written).
