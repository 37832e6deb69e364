//! Black-box tests: the real `anima-wake` binary, started as a process, driven by real gRPC
//! clients, on both log backends.

mod chat;
mod fixture;
mod linear;
mod race;
mod send_hold;
mod wakes;
