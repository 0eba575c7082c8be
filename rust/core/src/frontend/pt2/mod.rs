//! PT2 frontend (being written).
