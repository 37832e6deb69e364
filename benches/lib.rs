//! Benchmarks live in `main.rs`, the load and scale tools in `load/` and `scale/`. This library
//! holds what they and the tests share: the generated mix of stored events ([`mix`]).

pub mod mix;
