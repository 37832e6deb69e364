//! The engine's one integration-test binary (STYLE 10): each area is a module.

mod bad_input;
mod cluster;
mod conformance;
mod explain;
mod memory;
mod recovery;
mod replay;
mod runner;
mod simulation;
mod subjects;
