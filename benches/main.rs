//! The one criterion harness of the workspace (`harness = false`).
//!
//! * `fold` — `State::apply_bytes` over a generated realistic event mix, one core.
//! * `embedded_append` — `EmbeddedLog::append_batch` next to raw sled doing the same writes.
//! * `jetstream_append` — `JetStreamLog::append_batch` next to raw pipelined async-nats publishes.
//! * `send_decision` — `Sends.Send` latency over gRPC on loopback JetStream next to one raw
//!   JetStream publish-and-ack round trip.
//!
//! Absolute figures drift ±30% between runs on these machines (FIELD-NOTES.md), so every IO
//! benchmark runs its raw baseline in the same run and prints the ratio, measured interleaved
//! with the engine path after criterion's own runs. Each group prints one summary line; all of
//! them are repeated at the end. Run with `cargo bench -p anima-benches`
//! (about a minute of measuring after the build), or `cargo bench -p anima-benches -- --test`
//! to run every routine once. Fixtures (nats-server, the gateway) start lazily, so a filter such
//! as `cargo bench -p anima-benches -- fold` starts nothing it does not need.

mod append;
mod fold;
mod measure;
mod send_latency;

use std::time::Duration;

use criterion::Criterion;

/// Warm-up per benchmark.
const WARM_UP: Duration = Duration::from_secs(1);
/// Measurement per benchmark: eight benchmarks keep the whole run near a minute.
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

    criterion.final_summary();
    if !summary.is_empty() {
        println!("\n== anima-benches summary ==");
        for line in &summary {
            println!("{line}");
        }
    }
}
