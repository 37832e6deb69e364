//! Black-box tests: the real `anima-wake` binary, started as a process, driven by real gRPC
//! clients, on both log backends.

mod access;
mod bad_input;
mod chat;
mod cluster_race;
mod fixture;
mod limits;
mod linear;
mod memory;
mod metrics;
mod race;
mod replay_tool;
mod reply_guards;
mod send_hold;
mod tls;
mod wakes;
