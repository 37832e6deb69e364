//! The fold state's estimate of its own memory (`State::memory_estimate_bytes`: what the runner
//! holds to the state's share of the memory budget, and what the `anima_state_estimate_bytes`
//! gauge and `anima-load` show) against what the state really allocates, counted by a counting
//! allocator, on the benchmarks' generated mix.
//!
//! Its own test binary with one test: the count is of the whole process, so nothing else may
//! allocate beside it.

use anima_benches::mix::{generate, MIX_SEED};

#[global_allocator]
static ALLOCATOR: cap::Cap<std::alloc::System> = cap::Cap::new(std::alloc::System, usize::MAX);

/// Events of the mix: weeks of a small fleet's traffic in the generator's time.
const EVENTS: usize = 100_000;

/// What the estimate may be off by, as a fraction of what the state allocates.
const OFF_BY_MAX: f64 = 0.2;

/// Bytes the allocator got back while `free` ran: what it dropped.
fn freed_by(free: impl FnOnce()) -> usize {
    let before = ALLOCATOR.allocated();
    free();
    before.saturating_sub(ALLOCATOR.allocated())
}

#[test]
fn the_state_estimate_is_within_a_fifth_of_what_the_state_allocates() {
    let mix = generate(MIX_SEED, EVENTS);
    let mut state = mix.final_state;
    drop(mix.events);
    // As the runner does at every checkpoint: the change sets are not state.
    drop(state.take_changes());
    let estimate = state.memory_estimate_bytes();

    // What each table takes, table by table, for the report (the rest is dropped last).
    let mut tables: Vec<(&str, usize, usize)> = Vec::new();
    macro_rules! measure {
        ($($field:ident: $entries:expr),* $(,)?) => {$(
            let entries = $entries;
            let bytes = freed_by(|| drop(std::mem::take(&mut state.$field)));
            tables.push((stringify!($field), entries, bytes));
        )*};
    }
    measure! {
        journal_rows: state.journal_rows.resident_len(),
        identities: state.identities.resident_len(),
        identity_order: state.identity_order.resident_len(),
        journals: state.journals.resident_len(),
        surface_keys: state.surface_keys.resident_len(),
        surface_ids: state.surface_ids.resident_len(),
        cursors: state.cursors.resident_len(),
        subscriptions: state.subscriptions.resident_len(),
        settled_ids: state.settled_ids.resident_len(),
        settled_order: state.settled_order.resident_len(),
        queues: state.queues.iter().map(|(_, queue)| queue.resident_len() + 1).sum(),
        verdicts: state.verdicts.len(),
    }
    let rest = freed_by(|| drop(state));
    let real: usize = tables.iter().map(|(_, _, bytes)| bytes).sum::<usize>() + rest;

    let report = tables
        .iter()
        .map(|(name, entries, bytes)| {
            format!("{name}: {entries} entries, {bytes} bytes, {:.0} a entry", *bytes as f64 / (*entries).max(1) as f64)
        })
        .chain([format!("the rest: {rest} bytes")])
        .collect::<Vec<_>>()
        .join("\n  ");
    let off_by = (estimate as f64 - real as f64) / real as f64;
    eprintln!("estimate {estimate} bytes, allocated {real} bytes (off by {:+.1}%):\n  {report}", off_by * 100.0);
    assert!(
        off_by.abs() <= OFF_BY_MAX,
        "the state's estimate of its memory ({estimate} bytes) is off by {:+.1}% from what it allocates \
         ({real} bytes); by table:\n  {report}",
        off_by * 100.0
    );
}
