//! Placeholder while dependencies build.
fn main() {}
