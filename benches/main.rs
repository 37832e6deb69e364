//! The one criterion harness of the workspace (`harness = false`).
//!
//! * `fold` — `State::apply_bytes` over a generated realistic event mix, one core.
//! * `embedded_append` — `EmbeddedLog::append_batch` next to raw sled doing the same writes.
//! * `jetstream_append` — `JetStreamLog::append_batch` next to raw pipelined async-nats publishes.
//! * `send_decision` — `Sends.Send` latency over gRPC on loopback JetStream next to one raw
//!   JetStream publish-and-ack round trip.
//! * `claim_start` — `Wakes.Claim` and `Wakes.Start` latency over gRPC on loopback JetStream,
//!   next to the same raw round trip.
//! * `wake_render` — `render_wake_text` over realistic claimed wakes next to a copy of the same
//!   bytes.
//! * `memory_tick` — the memory-pass scheduler's plan over 10,000 agents next to computing their
//!   slot offsets alone.
//! * `rebuild_embedded`, `rebuild_jetstream` — a rebuild of all projections from a long log
//!   (`REBUILD_EVENTS`, default 1,000,000) next to a raw read of it, and a restart from a
//!   checkpoint next to that rebuild. They run only when a filter names them (minutes each at the
//!   default size): `cargo bench -p anima-benches -- rebuild`.
//!
//! Absolute figures drift ±30% between runs on these machines, so every IO
//! benchmark runs its raw baseline in the same run and prints the ratio, measured interleaved
//! with the engine path after criterion's own runs. Each group prints one summary line; all of
//! them are repeated at the end. Run with `cargo bench -p anima-benches`
//! (about two minutes of measuring after the build), or `cargo bench -p anima-benches -- --test`
//! to run every routine once. Fixtures (nats-server, the gateway) start lazily, so a filter such
//! as `cargo bench -p anima-benches -- fold` starts nothing it does not need.

mod append;
mod claim_latency;
mod fold;
mod loopback_gateway;
mod measure;
mod memory_tick;
mod rebuild;
mod send_latency;
mod wake_render;

use std::time::Duration;

use criterion::Criterion;

/// The engine's allocator (`anima-wake` runs on mimalloc), so that the fold, the memory tick and
/// the in-process gateway are measured as the engine runs them, not on the system allocator.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Warm-up per benchmark.
const WARM_UP: Duration = Duration::from_secs(1);
/// Measurement per benchmark: eleven criterion benchmarks keep the whole run near two minutes.
const MEASUREMENT: Duration = Duration::from_secs(4);
/// Worker threads of the runtime that drives the IO benchmarks (the machines have two cores).
const RUNTIME_WORKER_THREADS: usize = 2;

fn main() {
    let mut criterion = Criterion::default()
        .sample_size(measure::SAMPLES_SUMMARIZED)
        .warm_up_time(WARM_UP)
        .measurement_time(MEASUREMENT)
        .configure_from_args();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(RUNTIME_WORKER_THREADS)
        .enable_all()
        .build()
        .expect("build the tokio runtime");
    let test_mode = std::env::args().any(|arg| arg == "--test");

    let mut summary = Vec::new();
    let mut report = |line: Option<String>| {
        if let Some(line) = line {
            let line = if test_mode { format!("{line} [--test: a few runs, not a measurement]") } else { line };
            println!("{line}");
            summary.push(line);
        }
    };
    report(fold::bench(&mut criterion));
    report(append::bench_embedded(&mut criterion, &runtime, test_mode));
    report(append::bench_jetstream(&mut criterion, &runtime, test_mode));
    report(send_latency::bench(&mut criterion, &runtime, test_mode));
    report(claim_latency::bench(&mut criterion, &runtime, test_mode));
    report(wake_render::bench(&mut criterion, test_mode));
    report(memory_tick::bench(&mut criterion, test_mode));
    for line in rebuild::bench(&runtime, test_mode) {
        report(Some(line));
    }

    criterion.final_summary();
    if !summary.is_empty() {
        println!("\n== anima-benches summary ==");
        for line in &summary {
            println!("{line}");
        }
    }
}
