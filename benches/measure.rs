//! What the benchmarks measure next to criterion, for their summary lines: rates of criterion's
//! own samples ([`Tally`]), interleaved comparisons of an engine path with its raw baseline
//! ([`interleave`]), percentiles; and the seeded generator that makes inputs reproducible.
//!
//! Criterion calls a routine first to warm up (with growing iteration counts), then once per
//! sample. A [`Tally`] keeps every call and summarizes only the last [`SAMPLES_SUMMARIZED`] of
//! them, which are the measured samples when the group's sample size is that number (as
//! `main.rs` sets it); in `--test` mode there is one call and it is summarized.

use std::time::Duration;

/// Samples per benchmark, set on every group; also how many calls a [`Tally`] summarizes.
pub const SAMPLES_SUMMARIZED: usize = 10;

/// One call of a benchmark routine.
struct Call {
    elements: u64,
    elapsed: Duration,
}

/// Calls of one benchmark routine, in order.
#[derive(Default)]
pub struct Tally {
    calls: Vec<Call>,
}

impl Tally {
    /// Records a call that handled `elements` in `elapsed` (measured time only).
    pub fn record(&mut self, elements: u64, elapsed: Duration) {
        self.calls.push(Call { elements, elapsed });
    }

    fn summarized(&self) -> &[Call] {
        &self.calls[self.calls.len().saturating_sub(SAMPLES_SUMMARIZED)..]
    }

    /// Elements per second over the summarized calls; `None` when the routine never ran (the
    /// benchmark was filtered out).
    pub fn rate(&self) -> Option<f64> {
        let calls = self.summarized();
        let elements: u64 = calls.iter().map(|c| c.elements).sum();
        let seconds: f64 = calls.iter().map(|c| c.elapsed.as_secs_f64()).sum();
        (elements > 0 && seconds > 0.0).then(|| elements as f64 / seconds)
    }
}

/// Calls summed: elements and seconds per call.
pub struct CallSummary {
    pub elements_per_call: f64,
    pub seconds_per_call: f64,
}

impl Tally {
    /// Elements and seconds per call over every recorded call; `None` when none was recorded.
    pub fn summary(&self) -> Option<CallSummary> {
        if self.calls.is_empty() {
            return None;
        }
        let n = self.calls.len() as f64;
        let elements: u64 = self.calls.iter().map(|c| c.elements).sum();
        let seconds: f64 = self.calls.iter().map(|c| c.elapsed.as_secs_f64()).sum();
        Some(CallSummary { elements_per_call: elements as f64 / n, seconds_per_call: seconds / n })
    }
}

/// Which side of a comparison a run belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The engine's path (the `EventLog` trait, the gateway).
    Engine,
    /// The raw baseline it is built on (sled, async-nats).
    Raw,
}

/// Durations of the runs of both sides of an interleaved comparison.
pub struct Interleaved {
    pub engine: Vec<Duration>,
    pub raw: Vec<Duration>,
}

/// Runs `rounds` rounds of one engine run and one raw run, alternating which goes first, so both
/// sides are measured on the same machine state (other processes, disk, server) within a
/// fraction of a second of each other.
pub fn interleave(rounds: usize, mut run: impl FnMut(Side) -> Duration) -> Interleaved {
    let mut runs = Interleaved { engine: Vec::with_capacity(rounds), raw: Vec::with_capacity(rounds) };
    for round in 0..rounds {
        let order = if round.is_multiple_of(2) { [Side::Engine, Side::Raw] } else { [Side::Raw, Side::Engine] };
        for side in order {
            let elapsed = run(side);
            match side {
                Side::Engine => runs.engine.push(elapsed),
                Side::Raw => runs.raw.push(elapsed),
            }
        }
    }
    runs
}

/// The median of durations (zero when empty).
pub fn median(durations: &[Duration]) -> Duration {
    let mut sorted = durations.to_vec();
    sorted.sort_unstable();
    percentile(&sorted, 50.0)
}

/// On-CPU time of the calling thread so far, from `/proc/thread-self/schedstat` (Linux, ns).
/// Unlike wall time it leaves out time other processes had the core, which on a shared 2-core
/// machine (other builds running) is most of the noise of a single-threaded benchmark. `None`
/// where the file is missing.
pub fn thread_cpu_time() -> Option<Duration> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let nanos: u64 = text.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(nanos))
}

/// The `p`-th percentile (0..=100) of sorted durations, nearest rank.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Formats a latency in µs below 10 ms, else in ms.
pub fn micros(duration: Duration) -> String {
    if duration < Duration::from_millis(10) {
        format!("{} µs", duration.as_micros())
    } else {
        format!("{:.1} ms", duration.as_secs_f64() * 1e3)
    }
}

/// Criterion options that take a value: their value is not the filter.
const CRITERION_OPTIONS_WITH_VALUE: [&str; 20] = [
    "-c",
    "--color",
    "-s",
    "--save-baseline",
    "-b",
    "--baseline",
    "--baseline-lenient",
    "--format",
    "--profile-time",
    "--load-baseline",
    "--sample-size",
    "--warm-up-time",
    "--measurement-time",
    "--nresamples",
    "--noise-threshold",
    "--confidence-level",
    "--significance-level",
    "--plotting-backend",
    "--output-format",
    "-n",
];

/// Whether the harness's filter argument names the benchmark `name`, for benchmarks that run
/// outside criterion's sampling (a rebuild of a million events takes long enough that criterion's
/// ten samples plus warm-up would multiply the run by eleven). Only an explicit filter selects
/// them: a run without one skips them. The filter is matched as criterion matches plain words (a
/// substring, or the whole name with `--exact`); `a|b` alternatives are understood, other regex
/// syntax is not.
pub fn filter_selects(name: &str) -> bool {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let exact = args.iter().any(|arg| arg == "--exact");
    let mut filter = None;
    let mut skip_value = false;
    for arg in &args {
        if std::mem::take(&mut skip_value) {
            continue;
        }
        if arg.starts_with('-') {
            skip_value = !arg.contains('=') && CRITERION_OPTIONS_WITH_VALUE.contains(&arg.as_str());
            continue;
        }
        filter = Some(arg.as_str());
        break;
    }
    let Some(filter) = filter else { return false };
    if exact {
        return filter == name;
    }
    filter.split('|').any(|alternative| name.contains(alternative))
}

/// A count from the environment variable `name`, `default` when unset; a value that does not
/// parse (digits, `_` allowed as a separator) is a mistake worth stopping for.
pub fn env_count(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(value) => value
            .replace('_', "")
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value:?} is not a count like 1000000 or 1_000_000")),
        Err(_) => default,
    }
}

/// CPU time of the whole process so far (every thread, user and system), from `/proc/self/stat`
/// in clock ticks of 10 ms (Linux's `USER_HZ`). For multi-threaded runs on a shared machine:
/// wall time over CPU time shows how much of a run was spent waiting for a core. `None` where the
/// file is missing.
pub fn process_cpu_time() -> Option<Duration> {
    const TICK: Duration = Duration::from_millis(10);
    let text = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces) start at state, field 3.
    let fields: Vec<&str> = text.rsplit_once(')')?.1.split_whitespace().collect();
    let user: u32 = fields.get(11)?.parse().ok()?;
    let system: u32 = fields.get(12)?.parse().ok()?;
    Some(TICK * (user + system))
}
