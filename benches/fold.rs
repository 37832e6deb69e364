//! Fold throughput: `State::apply_bytes` (prost decode included) over the generated, realistic
//! mix of stored events ([`anima_benches::mix`]), on one core.
//!
//! The benchmark folds the encoded bytes into a fresh `State` per iteration and checks once that
//! it reaches the state the generator reached (so it folds what was generated, not a stream of
//! refusals).
//!
//! Like the runner, the benchmark drains the changed keys every `checkpoint_every_events`
//! (untimed), so the tables' change sets stay as small as in production. Wall time is what
//! criterion sees; on-CPU time of the folding thread is reported next to it because other
//! processes on a shared 2-core machine inflate wall time.

use std::time::{Duration, Instant};

use anima_benches::mix::{generate, EventMix, EVENTS_PER_ITERATION, MIX_SEED};
use anima_engine::RunnerConfig;
use anima_projections::{proto, LogPosition, State};
use criterion::{BenchmarkId, Criterion, SamplingMode, Throughput};
use prost::Message;

use crate::measure::{thread_cpu_time, Tally};

/// The rate the fold must sustain on one core (events per second).
const TARGET_EVENTS_PER_SECOND: f64 = 1_000_000.0;
/// The fold's rate over the rate of decoding the same bytes alone, measured in the same run.
const TARGET_RATIO_TO_DECODE: f64 = 0.5;

fn fold_all(events: &[(LogPosition, Vec<u8>)]) -> State {
    let mut state = State::new();
    for (at, bytes) in events {
        state.apply_bytes(*at, bytes);
    }
    state
}

/// Benchmarks the fold and returns its summary line.
pub fn bench(c: &mut Criterion) -> Option<String> {
    let mut group = c.benchmark_group("fold");
    group.sampling_mode(SamplingMode::Flat);
    group.throughput(Throughput::Elements(EVENTS_PER_ITERATION as u64));
    let mut mix: Option<EventMix> = None;
    let mut tally = Tally::default();
    let mut tally_cpu = Tally::default();
    let mut tally_decode = Tally::default();
    // The runner's take of changed keys at every checkpoint, timed apart from the fold: it runs
    // on the fold's path (the fold waits for it), so its cost per checkpoint matters as much.
    // Their encoding runs on the checkpoint writer's task, beside the fold; timed apart too.
    let mut tally_take = Tally::default();
    let mut tally_encode = Tally::default();
    let checkpoint_every_events = RunnerConfig::default().checkpoint_every_events as usize;
    group.bench_function(BenchmarkId::new("apply_bytes", "realistic_mix"), |b| {
        let mix = mix.get_or_insert_with(|| {
            let started = Instant::now();
            let mix = generate(MIX_SEED, EVENTS_PER_ITERATION);
            println!(
                "fold mix (seed {MIX_SEED:#x}, generated in {:.2?}): {}",
                started.elapsed(),
                mix.counts.describe(mix.events.len())
            );
            let folded = fold_all(&mix.events);
            assert!(folded.meta.halted.is_none(), "the fold halted: {:?}", folded.meta.halted);
            assert_eq!(folded.meta.applied_seq, mix.events.len() as u64);
            assert!(
                folded.canonical_bytes() == mix.final_state.canonical_bytes(),
                "folding the encoded mix must reach the generator's state (seed {MIX_SEED:#x})"
            );
            mix
        });
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let mut state = State::new();
                let (mut wall, mut cpu) = (Duration::ZERO, Some(Duration::ZERO));
                for chunk in mix.events.chunks(checkpoint_every_events) {
                    let cpu_before = thread_cpu_time();
                    let started = Instant::now();
                    for (at, bytes) in chunk {
                        state.apply_bytes(*at, bytes);
                    }
                    wall += started.elapsed();
                    cpu =
                        cpu.zip(cpu_before.zip(thread_cpu_time())).map(|(sum, (before, after))| sum + (after - before));
                    // The runner takes changed keys at every checkpoint; timed apart from the fold.
                    let started = Instant::now();
                    let changes = std::hint::black_box(state.take_changes());
                    let taken = started.elapsed();
                    let started = Instant::now();
                    let encoded = std::hint::black_box(changes.encode());
                    // Counted as written: keys of a cold table that share a slot are one entry.
                    tally_take.record(encoded.len() as u64, taken);
                    tally_encode.record(encoded.len() as u64, started.elapsed());
                    drop(encoded);
                }
                total += wall;
                tally.record(mix.events.len() as u64, wall);
                if let Some(cpu) = cpu {
                    tally_cpu.record(mix.events.len() as u64, cpu);
                }
                // Dropping the state is not part of the fold either.
                drop(std::hint::black_box(state));
                // The raw baseline, interleaved with the fold so both see the same machine: a
                // decode-only pass over the same bytes (what the fold cannot go below).
                let started = Instant::now();
                for (_, bytes) in &mix.events {
                    drop(std::hint::black_box(proto::Envelope::decode(std::hint::black_box(bytes.as_slice()))));
                }
                tally_decode.record(mix.events.len() as u64, started.elapsed());
            }
            total
        });
    });
    group.finish();
    let rate = tally.rate()?;
    let on_cpu = tally_cpu.rate().map_or_else(String::new, |r| format!(", {r:.0} ev/s on-CPU"));
    let verdict = if rate >= TARGET_EVENTS_PER_SECOND { "meets" } else { "BELOW" };
    let decode = tally_decode.rate()?;
    let ratio = rate / decode;
    let ratio_verdict = if ratio >= TARGET_RATIO_TO_DECODE { "meets" } else { "BELOW" };
    let drain = tally_take.summary().zip(tally_encode.summary()).map_or_else(String::new, |(take, encode)| {
        format!(
            "; checkpoint every {checkpoint_every_events} events: {:.0} entries, taken on the fold's path in {:.2} ms \
             ({:.0} ns per entry), encoded beside it in {:.2} ms",
            take.elements_per_call,
            take.seconds_per_call * 1e3,
            take.seconds_per_call * 1e9 / take.elements_per_call.max(1.0),
            encode.seconds_per_call * 1e3,
        )
    });
    Some(format!(
        "fold: {rate:.0} ev/s wall{on_cpu} over {EVENTS_PER_ITERATION} events per iteration, prost decode \
         included ({verdict} the 1,000,000 ev/s target); decode-only {decode:.0} ev/s, ratio {ratio:.2} \
         ({ratio_verdict} the {TARGET_RATIO_TO_DECODE} target){drain}"
    ))
}
