//! Integration tests of the gateway: the whole server in this process, driven over gRPC.

mod fixture;
mod fuzz;
mod request_id;
