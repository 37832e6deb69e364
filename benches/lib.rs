//! Benchmarks live in `main.rs`; this library target is empty.
