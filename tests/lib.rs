//! Black-box tests live in `blackbox/`; this library target is empty.
