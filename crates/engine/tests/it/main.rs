//! The engine's one integration-test binary (STYLE 10): each area is a module.

mod conformance;
mod memory;
mod replay;
mod runner;
mod simulation;
