//! The gateway of the Anima wake engine: tonic services over the engine, access control,
//! configuration, and the `anima-wake` binary. Only this crate knows tonic and HTTP/2.

pub mod auth;
pub mod config;
pub mod digest_command;
pub mod memory_services;
pub mod metrics;
pub mod replay_command;
pub mod replay_services;
pub mod server;
pub mod services;
pub mod transport_limit;

/// The gRPC API (`proto/anima/v1/api.proto`): its messages (generated in `anima-projections`)
/// and its tonic services (generated here).
pub mod api {
    #![allow(clippy::all, missing_docs)]
    pub use anima_projections::proto::*;
    include!(concat!(env!("OUT_DIR"), "/anima.v1.rs"));

    /// Encoded descriptors of the API and the event schema, for server reflection.
    pub const DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/anima_descriptor.bin"));
}
