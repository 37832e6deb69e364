//! Progress of long `anima-wake replay` runs (verify, export, timeline, state rebuilds), always on
//! stderr: stdout carries the output (export writes JSON lines there).
//!
//! The replayer calls back every `--progress-every` events with the sequence it reached and the
//! one it runs to ([`ReplayProgress`]). On a terminal that moves an `indicatif` bar with rate and
//! ETA; otherwise (a pipe, a log file, CI) a plain line is printed at most every
//! `--progress-interval-secs`: where it is, how fast, how long is left. Nothing is printed for
//! runs shorter than that, and nothing at all through `--api` (the server folds there).
//!
//! The bar redraws at most [`BAR_REDRAWS_PER_SECOND_MAX`] times a second. Output to the same
//! terminal retires it for the rest of the command (the output itself shows the progress, and
//! redrawing the bar under every chunk of it would flood the terminal); output to a file or a pipe
//! leaves it alone.
//!
//! One command may fold twice (a timeline with outcomes folds up to its range, then reads the
//! range): each run the replayer reports on is a phase with its own start, end and rate. A phase
//! starts when the end sequence changes or the event count starts over.

use std::io::IsTerminal as _;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anima_engine::replay::{ProgressFn, ReplayProgress};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How progress is shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ProgressMode {
    /// A bar when stderr is a terminal, plain lines otherwise.
    Auto,
    Bar,
    Lines,
    Off,
}

/// The bar: the phase's time, where it is, and in the message its rate and ETA, computed as for
/// the plain lines (the phase's average so far: `indicatif`'s own estimate starts from the
/// first jump of a bar made mid-phase, and shows millions per second until it settles).
const BAR_TEMPLATE: &str = "replay {elapsed_precise} [{wide_bar}] {human_pos}/{human_len} ({percent}%) {msg}";

/// Redraws of the bar per second, at most.
const BAR_REDRAWS_PER_SECOND_MAX: u8 = 10;

/// One run of a fold or read, as reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Phase {
    /// The sequence before the first one this run handled (exact when the run reads every
    /// sequence; a subject-filtered read skips some, and then the phase starts a little later).
    before_seq: u64,
    to_seq: u64,
    /// Events handled at the last report: a lower count means a new run.
    events: u64,
}

impl Phase {
    fn of(progress: &ReplayProgress) -> Phase {
        Phase {
            before_seq: progress.seq.saturating_sub(progress.events),
            to_seq: progress.to_seq,
            events: progress.events,
        }
    }

    /// Whether `progress` continues this phase.
    fn continues(&self, progress: &ReplayProgress) -> bool {
        progress.to_seq == self.to_seq && progress.events >= self.events
    }

    /// Sequences this phase covers.
    fn length(&self) -> u64 {
        self.to_seq.saturating_sub(self.before_seq)
    }

    /// Sequences done at `progress`.
    fn done(&self, progress: &ReplayProgress) -> u64 {
        progress.seq.saturating_sub(self.before_seq).min(self.length())
    }
}

/// Rate and time left of a report, averaged over the phase so far.
struct Pace {
    events_per_second: f64,
    /// `unknown` until something is done.
    eta: String,
}

impl Pace {
    fn of(phase: &Phase, progress: &ReplayProgress) -> Pace {
        let seconds = progress.elapsed.as_secs_f64();
        let done = phase.done(progress);
        let events_per_second = if seconds > 0.0 { progress.events as f64 / seconds } else { 0.0 };
        // Sequences per second, not events: a filtered read passes over sequences it does not
        // yield.
        let eta = if seconds > 0.0 && done > 0 {
            let left = progress.to_seq.saturating_sub(progress.seq) as f64;
            format_eta(Duration::from_secs_f64(left * seconds / done as f64))
        } else {
            "unknown".to_owned()
        };
        Pace { events_per_second, eta }
    }
}

/// The plain progress line of a report.
fn progress_line(phase: &Phase, progress: &ReplayProgress) -> String {
    let done = phase.done(progress);
    let percent = if phase.length() == 0 { 100.0 } else { done as f64 * 100.0 / phase.length() as f64 };
    let Pace { events_per_second, eta } = Pace::of(phase, progress);
    format!(
        "replay: seq {} of {} ({percent:.1}%), {} events in {}, {events_per_second:.0} events/s, ETA {eta}",
        progress.seq,
        progress.to_seq,
        progress.events,
        format_eta(progress.elapsed)
    )
}

/// The bar's message: rate and ETA.
fn bar_message(phase: &Phase, progress: &ReplayProgress) -> String {
    let Pace { events_per_second, eta } = Pace::of(phase, progress);
    format!("{events_per_second:.0} events/s, ETA {eta}")
}

/// `42s`, `4m05s`, `1h02m`.
fn format_eta(duration: Duration) -> String {
    let seconds = duration.as_secs_f64().round() as u64;
    match seconds {
        0..60 => format!("{seconds}s"),
        60..3_600 => format!("{}m{:02}s", seconds / 60, seconds % 60),
        _ => format!("{}h{:02}m", seconds / 3_600, (seconds % 3_600) / 60),
    }
}

/// How reports are shown, decided once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Display {
    Bar,
    /// A line at most every this long.
    Lines(Duration),
    Off,
}

struct ReporterState {
    phase: Option<Phase>,
    /// The bar of the current phase (bar display only), made at its first report.
    bar: Option<ProgressBar>,
    /// When the last line was printed (lines display); starts at creation, so a run shorter than
    /// one interval prints nothing.
    last_line_at: Instant,
    /// Output went to the terminal the bar is drawn on: no bar from then on.
    bar_retired: bool,
}

/// Shows the replayer's progress reports on stderr. Shared with the replayer's callback.
pub struct ProgressReporter {
    display: Display,
    state: Mutex<ReporterState>,
}

impl ProgressReporter {
    /// A reporter for `mode`; `interval` is the least time between two plain lines.
    pub fn new(mode: ProgressMode, interval: Duration) -> Arc<ProgressReporter> {
        let display = match mode {
            ProgressMode::Auto if std::io::stderr().is_terminal() => Display::Bar,
            ProgressMode::Auto | ProgressMode::Lines => Display::Lines(interval),
            ProgressMode::Bar => Display::Bar,
            ProgressMode::Off => Display::Off,
        };
        Arc::new(ProgressReporter {
            display,
            state: Mutex::new(ReporterState {
                phase: None,
                bar: None,
                last_line_at: Instant::now(),
                bar_retired: false,
            }),
        })
    }

    /// The callback for [`anima_engine::replay::ReplayConfig::progress`]; `None` when progress
    /// is off.
    pub fn callback(self: &Arc<Self>) -> Option<ProgressFn> {
        if self.display == Display::Off {
            return None;
        }
        let reporter = self.clone();
        Some(Arc::new(move |progress: ReplayProgress| reporter.report(progress, Instant::now())))
    }

    fn state(&self) -> MutexGuard<'_, ReporterState> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn report(&self, progress: ReplayProgress, now: Instant) {
        let mut state = self.state();
        let phase = match state.phase {
            Some(mut phase) if phase.continues(&progress) => {
                phase.events = progress.events;
                phase
            }
            _ => {
                if let Some(bar) = state.bar.take() {
                    bar.finish_and_clear();
                }
                Phase::of(&progress)
            }
        };
        state.phase = Some(phase);
        match self.display {
            Display::Bar if state.bar_retired => {}
            Display::Bar => {
                let (done, message) = (phase.done(&progress), bar_message(&phase, &progress));
                match &state.bar {
                    Some(bar) => {
                        bar.set_message(message);
                        bar.set_position(done);
                    }
                    None => state.bar = Some(new_bar(phase.length(), progress.elapsed, done, message)),
                }
            }
            Display::Lines(interval) => {
                if now.saturating_duration_since(state.last_line_at) >= interval {
                    state.last_line_at = now;
                    eprintln!("{}", progress_line(&phase, &progress));
                }
            }
            Display::Off => {}
        }
    }

    /// Output is about to go to the terminal the bar is drawn on: clears the bar and draws none
    /// for the rest of the command, so output and bar never overwrite each other.
    pub fn retire_bar(&self) {
        let mut state = self.state();
        state.bar_retired = true;
        if let Some(bar) = state.bar.take() {
            bar.finish_and_clear();
        }
    }

    /// Clears the bar; call before printing results.
    pub fn finish(&self) {
        if let Some(bar) = self.state().bar.take() {
            bar.finish_and_clear();
        }
    }
}

/// A bar for a phase of `length` sequences that has run for `elapsed` and done `done` of them.
fn new_bar(length: u64, elapsed: Duration, done: u64, message: String) -> ProgressBar {
    let style = ProgressStyle::with_template(BAR_TEMPLATE).expect("the bar template is valid").progress_chars("=> ");
    let target = ProgressDrawTarget::stderr_with_hz(BAR_REDRAWS_PER_SECOND_MAX);
    let bar = ProgressBar::with_draw_target(Some(length), target)
        .with_style(style)
        .with_elapsed(elapsed)
        .with_position(done)
        .with_message(message);
    // Drawn now: the builders above do not draw.
    bar.tick();
    bar
}

/// The command's output (stdout): when it is a terminal, its first write retires the reporter's
/// bar ([`ProgressReporter::retire_bar`]); a file or a pipe does not touch the bar.
pub struct BarSafeWriter<W> {
    inner: W,
    /// Set while the bar still has to be retired before a write.
    reporter: Option<Arc<ProgressReporter>>,
}

impl<W> BarSafeWriter<W> {
    pub fn new(inner: W, inner_is_terminal: bool, reporter: Arc<ProgressReporter>) -> Self {
        BarSafeWriter { inner, reporter: inner_is_terminal.then_some(reporter) }
    }
}

impl<W: std::io::Write> std::io::Write for BarSafeWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Some(reporter) = self.reporter.take() {
            reporter.retire_bar();
        }
        self.inner.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seq: u64, to_seq: u64, events: u64, elapsed_secs: u64) -> ReplayProgress {
        ReplayProgress { seq, to_seq, events, elapsed: Duration::from_secs(elapsed_secs) }
    }

    #[test]
    fn a_line_says_where_how_fast_and_how_long_is_left() {
        let progress = at(400_000, 1_000_000, 400_000, 10);
        let line = progress_line(&Phase::of(&progress), &progress);
        assert_eq!(line, "replay: seq 400000 of 1000000 (40.0%), 400000 events in 10s, 40000 events/s, ETA 15s");
    }

    #[test]
    fn a_phase_that_starts_late_in_the_log_counts_from_its_start() {
        // A read of 900,001..=1,000,000: half done after 50,000 events.
        let first = at(910_000, 1_000_000, 10_000, 1);
        let phase = Phase::of(&first);
        let half = at(950_000, 1_000_000, 50_000, 5);
        assert!(phase.continues(&half));
        assert_eq!((phase.done(&half), phase.length()), (50_000, 100_000));
        assert!(progress_line(&phase, &half).contains("(50.0%)"), "{}", progress_line(&phase, &half));
        assert!(progress_line(&phase, &half).ends_with("ETA 5s"));
        assert_eq!(bar_message(&phase, &half), "10000 events/s, ETA 5s");
    }

    #[test]
    fn a_new_end_or_a_restarted_count_is_a_new_phase() {
        let phase = Phase::of(&at(20_000, 50_000, 20_000, 1));
        assert!(!phase.continues(&at(60_000, 90_000, 10_000, 1)), "the read after the fold");
        assert!(!phase.continues(&at(10_000, 50_000, 10_000, 1)), "the same range folded again");
        assert!(phase.continues(&at(30_000, 50_000, 30_000, 2)));
    }

    #[test]
    fn lines_are_printed_at_most_once_per_interval() {
        let reporter = ProgressReporter::new(ProgressMode::Lines, Duration::from_secs(5));
        let start = reporter.state().last_line_at;
        let printed_at = |reporter: &ProgressReporter| reporter.state().last_line_at;
        reporter.report(at(10_000, 100_000, 10_000, 1), start + Duration::from_secs(1));
        assert_eq!(printed_at(&reporter), start, "nothing within the first interval");
        reporter.report(at(50_000, 100_000, 50_000, 5), start + Duration::from_secs(5));
        assert_eq!(printed_at(&reporter), start + Duration::from_secs(5));
        reporter.report(at(60_000, 100_000, 60_000, 6), start + Duration::from_secs(6));
        assert_eq!(printed_at(&reporter), start + Duration::from_secs(5), "one line per interval");
    }

    #[test]
    fn output_to_the_bars_terminal_retires_the_bar_and_output_elsewhere_does_not() {
        use std::io::Write as _;
        let has_bar = |reporter: &ProgressReporter| reporter.state().bar.is_some();
        // Given a bar that is drawn,
        let reporter = ProgressReporter::new(ProgressMode::Bar, Duration::from_secs(5));
        reporter.report(at(10_000, 100_000, 10_000, 1), Instant::now());
        assert!(has_bar(&reporter));
        // output to a file or a pipe leaves it;
        let mut to_file = BarSafeWriter::new(Vec::new(), false, reporter.clone());
        writeln!(to_file, "an event").unwrap();
        assert!(has_bar(&reporter));
        // output to its terminal clears it, and no later report draws one again.
        let mut to_terminal = BarSafeWriter::new(Vec::new(), true, reporter.clone());
        writeln!(to_terminal, "an event").unwrap();
        assert!(!has_bar(&reporter));
        reporter.report(at(20_000, 100_000, 20_000, 2), Instant::now());
        reporter.report(at(10_000, 50_000, 10_000, 1), Instant::now());
        assert!(!has_bar(&reporter));
        assert_eq!(to_terminal.inner, b"an event\n");
    }

    #[test]
    fn durations_read_at_a_glance() {
        assert_eq!(format_eta(Duration::from_secs(42)), "42s");
        assert_eq!(format_eta(Duration::from_secs(245)), "4m05s");
        assert_eq!(format_eta(Duration::from_secs(3_720)), "1h02m");
    }
}
