//! Wake-text rendering throughput: `render::render_wake_text`, the render path of `Wakes.Claim`
//! (`Engine::claim` in `crates/engine/src/command.rs`), over the wakes a realistic mix claims.
//!
//! The realistic mix of [`anima_benches::mix::generate`] is folded once more (untimed), keeping every
//! journaled row's body by its log sequence, as the runner's body cache does; at every claim the
//! fold granted, the claim's verdict is kept with the bodies of its trigger and shown rows. The
//! benchmark renders all of them per iteration, building the `(meta, body)` pairs as
//! `Engine::claim` does. The raw baseline copies the same bytes: a `String` made from each wake's
//! rendered text, so the ratio is what rendering costs over producing a string of that size.
//! Criterion measures each side on its own; the printed ratio comes from rounds that alternate
//! the two, so both see the same machine.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anima_projections::journal::{RowBody, RowMeta};
use anima_projections::proto::{self, envelope::Payload};
use anima_projections::render::render_wake_text;
use anima_projections::verdict::{ClaimVerdict, ClaimedWake, Verdict};
use anima_projections::State;
use criterion::{BenchmarkId, Criterion, SamplingMode};
use prost::Message;

use crate::measure::{interleave, median, Side};
use anima_benches::mix::{generate, EVENTS_PER_ITERATION, MIX_SEED};

/// Interleaved rounds (all wakes rendered, all copied) behind the printed ratio.
const ROUNDS: usize = 30;
const QUICK_ROUNDS: usize = 2;

/// What `Engine::claim` renders one wake from.
struct ClaimedWakeInput {
    reader: String,
    claimed: ClaimedWake,
    trigger_body: RowBody,
    /// The shown rows with their bodies, in the verdict's order.
    rows: Vec<(RowMeta, RowBody)>,
}

impl ClaimedWakeInput {
    fn render(&self) -> String {
        let shown: Vec<(&RowMeta, &RowBody)> = self.rows.iter().map(|(meta, body)| (meta, body)).collect();
        render_wake_text(&self.reader, &self.claimed, &self.trigger_body, &shown)
    }
}

/// The claimed wakes of the mix and their rendered texts.
struct ClaimedWakes {
    inputs: Vec<ClaimedWakeInput>,
    texts: Vec<String>,
    bytes: u64,
}

impl ClaimedWakes {
    fn collect() -> ClaimedWakes {
        let started = Instant::now();
        let mix = generate(MIX_SEED, EVENTS_PER_ITERATION);
        let mut state = State::new();
        let mut bodies: HashMap<u64, RowBody> = HashMap::new();
        let mut inputs = Vec::new();
        for (at, bytes) in &mix.events {
            let envelope = proto::Envelope::decode(bytes.as_slice()).expect("the mix decodes");
            state.apply(*at, &envelope);
            if let Some(body) = RowBody::from_envelope(&envelope) {
                bodies.insert(at.seq, body);
            }
            let Some(Payload::WakeClaim(request)) = &envelope.payload else { continue };
            let Some(Verdict::Claim(ClaimVerdict::Claimed(claimed))) = state.verdict(at.seq) else { continue };
            let body = |meta: &RowMeta| bodies.get(&meta.seq).cloned().expect("every journaled row has a body");
            inputs.push(ClaimedWakeInput {
                reader: request.agent_id.clone(),
                trigger_body: body(&claimed.item.trigger),
                rows: claimed.rows.iter().map(|meta| (meta.clone(), body(meta))).collect(),
                claimed: ClaimedWake::clone(claimed),
            });
        }
        assert!(!inputs.is_empty(), "the mix claims wakes");
        let texts: Vec<String> = inputs.iter().map(ClaimedWakeInput::render).collect();
        let bytes = texts.iter().map(|t| t.len() as u64).sum();
        let rows: usize = inputs.iter().map(|i| i.rows.len()).sum();
        let largest = texts.iter().map(String::len).max().unwrap_or(0);
        println!(
            "wake_render: {} claimed wakes from {EVENTS_PER_ITERATION} events (seed {MIX_SEED:#x}, collected in \
             {:.1?}): {:.0} B mean, {largest} B largest, {:.1} rows shown besides the trigger on average",
            inputs.len(),
            started.elapsed(),
            bytes as f64 / inputs.len() as f64,
            rows as f64 / inputs.len() as f64,
        );
        ClaimedWakes { inputs, texts, bytes }
    }

    /// Renders every wake; returns the time it took.
    fn render_all(&self) -> Duration {
        let started = Instant::now();
        for input in &self.inputs {
            drop(std::hint::black_box(input.render()));
        }
        started.elapsed()
    }

    /// Copies every rendered text into a new `String`; returns the time it took.
    fn copy_all(&self) -> Duration {
        let started = Instant::now();
        for text in &self.texts {
            drop(std::hint::black_box(String::from(std::hint::black_box(text.as_str()))));
        }
        started.elapsed()
    }
}

/// Benchmarks rendering against copying; returns the summary line, or `None` when filtered out.
pub fn bench(c: &mut Criterion, quick: bool) -> Option<String> {
    let mut group = c.benchmark_group("wake_render");
    group.sampling_mode(SamplingMode::Flat);
    let mut wakes: Option<ClaimedWakes> = None;
    for (name, raw) in [("render_wake_text", false), ("raw_string_copy_same_bytes", true)] {
        group.bench_function(BenchmarkId::new(name, "realistic_claims"), |b| {
            let wakes = wakes.get_or_insert_with(ClaimedWakes::collect);
            b.iter_custom(|iters| (0..iters).map(|_| if raw { wakes.copy_all() } else { wakes.render_all() }).sum())
        });
    }
    group.finish();
    let wakes = wakes?;

    let rounds = if quick { QUICK_ROUNDS } else { ROUNDS };
    let runs = interleave(rounds, |side| match side {
        Side::Engine => wakes.render_all(),
        Side::Raw => wakes.copy_all(),
    });
    let count = wakes.inputs.len() as f64;
    let render_rate = count / median(&runs.engine).as_secs_f64();
    let copy_rate = count / median(&runs.raw).as_secs_f64();
    let megabytes = |rate: f64| rate * wakes.bytes as f64 / count / 1e6;
    Some(format!(
        "wake_render: {render_rate:.0} renders/s ({:.0} MB/s), raw String copy of the same bytes: {copy_rate:.0}/s \
         ({:.0} MB/s), ratio {:.3} ({} realistic claimed wakes of {:.0} B mean; median of {} interleaved rounds)",
        megabytes(render_rate),
        megabytes(copy_rate),
        render_rate / copy_rate,
        wakes.inputs.len(),
        wakes.bytes as f64 / count,
        runs.engine.len(),
    ))
}
