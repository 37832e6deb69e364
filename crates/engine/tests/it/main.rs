//! The engine's one integration-test binary (STYLE 10): each area is a module.

mod conformance;
mod replay;
mod runner;
mod memory;
