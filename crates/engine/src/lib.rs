//! IO side of the Anima wake engine: the event log and its two backends, subject encoding, the
//! projection runner with sled checkpoints, and the command handlers that append a request and
//! wait for the fold's verdict.

pub mod analytics;
pub mod budget;
pub mod checkpoint;
pub mod clock;
pub mod command;
pub mod compact;
pub mod data_dir;
pub mod digest;
pub mod instance;
pub mod log;
pub mod memory;
pub mod metrics;
pub mod projection;
pub mod recent_verdicts;
pub mod redo;
pub mod replay;
pub mod startup_pages;
pub mod store_census;
pub mod subject;
pub mod testing;
pub mod validate;

pub use command::{CommandError, Engine, EngineConfig};
pub use projection::{Projection, Runner, RunnerConfig};
