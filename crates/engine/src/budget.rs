//! The fold state's share of the memory budget, moved by what the process really takes.
//!
//! The state's own estimate counts most of its entries at sizes measured with a counting
//! allocator (see `State::memory_estimate_bytes`), but the process holds more than the state and the three
//! caches: the allocator's slack, the stores' bookkeeping, request buffers. Those
//! grow with load and with the stores, and no setting bounds them. So after each landed
//! checkpoint the runner reads the process's resident memory, and when it is over nine tenths of
//! the whole budget the state's share is lowered by the excess: a byte of state let go frees at
//! least a byte of RSS, so one step brings the process back under without undershooting by more
//! than the allocator's slack. When there is room again the share grows back, half the room at a
//! time, never past its configured value. The share never falls below a quarter of its configured
//! value, a floor chosen rather than measured: the lower the share, the more of what the fold
//! uses it reads back from the checkpoint store (at the floor, a 10-minute embedded run under
//! `anima-load` did 5.5% fewer calls a second than with the share fixed), and an RSS still over
//! the budget there is over it for reasons the state cannot mend (the log says so, once a
//! minute).
//!
//! A verdict never depends on what is in memory, so moving the share changes speed and memory,
//! never a decision.

use std::time::{Duration, Instant};

/// RSS aimed for, as a fraction of the whole budget: the tenth above it absorbs what grows between
/// two looks (a burst of requests, a checkpoint's buffers).
const GOAL_TENTHS: usize = 9;

/// Between two moves of the share: freed memory reaches the RSS only once the allocator returns
/// it (mimalloc purges after a second), so looking sooner would count one excess twice.
pub const ADJUST_EVERY: Duration = Duration::from_secs(2);

/// How often the log says the budget cannot be held.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// The state's share of the memory budget, adjusted to the process's resident memory.
#[derive(Debug)]
pub struct StateShare {
    configured: usize,
    process_max: usize,
    current: usize,
    adjusted_at: Option<Instant>,
    warned_at: Option<Instant>,
}

impl StateShare {
    /// `configured`: the state's share as set (bytes); `process_max`: the whole budget (bytes;
    /// 0 holds the share at its configured value).
    pub fn new(configured: usize, process_max: usize) -> Self {
        StateShare { configured, process_max, current: configured, adjusted_at: None, warned_at: None }
    }

    /// The least the share is lowered to: a quarter of its configured value.
    fn floor(&self) -> usize {
        self.configured / 4
    }

    /// Moves the share by the process's resident memory (bytes, read by `rss` only when a move
    /// is due; `None` where it cannot be read) at `now`, at most once per [`ADJUST_EVERY`].
    /// Returns the share.
    pub fn adjust(&mut self, now: Instant, rss: impl FnOnce() -> Option<usize>) -> usize {
        if self.process_max == 0 || self.adjusted_at.is_some_and(|at| now.duration_since(at) < ADJUST_EVERY) {
            return self.current;
        }
        self.adjusted_at = Some(now);
        let Some(rss) = rss() else { return self.current };
        let goal = self.process_max / 10 * GOAL_TENTHS;
        let before = self.current;
        if rss > goal {
            self.current = self.current.saturating_sub(rss - goal).max(self.floor());
        } else {
            self.current = (self.current + (goal - rss) / 2).min(self.configured);
        }
        if self.current != before {
            tracing::debug!(
                rss_mib = rss >> 20,
                goal_mib = goal >> 20,
                share_mib = self.current >> 20,
                "the state's share of the memory budget moved"
            );
        }
        if rss > self.process_max
            && self.current == self.floor()
            && self.warned_at.is_none_or(|at| now.duration_since(at) >= WARN_EVERY)
        {
            self.warned_at = Some(now);
            tracing::warn!(
                rss_mib = rss >> 20,
                budget_mib = self.process_max >> 20,
                share_mib = self.current >> 20,
                "the process is over its memory budget with the fold's state at its least share: \
                 what is over is outside the state (the stores' bookkeeping, the allocator); \
                 raise runner.memory_budget_mib"
            );
        }
        self.current
    }
}

/// This process's resident memory, bytes; `None` where there is no `/proc`.
pub fn process_resident_bytes() -> Option<usize> {
    usize::try_from(resident_kib("self")?).ok()?.checked_mul(1024)
}

/// The resident memory of process `process` (a pid, or `self`), KiB: `VmRSS` of
/// `/proc/<process>/status`. The load tool reads the engine's and nats-server's with it.
pub fn resident_kib(process: &str) -> Option<u64> {
    proc_kib_field(&std::fs::read_to_string(format!("/proc/{process}/status")).ok()?, "VmRSS")
}

/// The value of the `name: N kB` line of a `/proc` file's text (`status`, `meminfo`).
pub fn proc_kib_field(text: &str, name: &str) -> Option<u64> {
    let line = text.lines().find(|line| line.split(':').next() == Some(name))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1024 * 1024;

    #[test]
    fn an_rss_over_nine_tenths_of_the_budget_lowers_the_share_by_the_excess() {
        let mut share = StateShare::new(512 * MIB, 1000 * MIB);
        let now = Instant::now();
        assert_eq!(share.adjust(now, || Some(950 * MIB)), 462 * MIB);
        // Within ADJUST_EVERY nothing moves, however high the RSS.
        assert_eq!(share.adjust(now + Duration::from_millis(500), || Some(2000 * MIB)), 462 * MIB);
        // Room again: half of it back, never past the configured share.
        assert_eq!(share.adjust(now + ADJUST_EVERY, || Some(880 * MIB)), 472 * MIB);
        assert_eq!(share.adjust(now + ADJUST_EVERY * 2, || Some(100 * MIB)), 512 * MIB);
    }

    #[test]
    fn the_share_never_falls_below_a_quarter_of_its_configured_value() {
        let mut share = StateShare::new(512 * MIB, 1000 * MIB);
        let now = Instant::now();
        assert_eq!(share.adjust(now, || Some(3000 * MIB)), 128 * MIB);
        assert_eq!(share.adjust(now + ADJUST_EVERY, || Some(3000 * MIB)), 128 * MIB);
    }

    #[test]
    fn without_a_process_budget_or_a_reading_the_share_stays_as_configured() {
        let now = Instant::now();
        assert_eq!(StateShare::new(512 * MIB, 0).adjust(now, || Some(3000 * MIB)), 512 * MIB);
        assert_eq!(StateShare::new(512 * MIB, 1000 * MIB).adjust(now, || None), 512 * MIB);
    }

    #[test]
    fn a_proc_field_is_read_by_its_whole_name() {
        let meminfo = "Dirty:             120 kB\nWriteback:          8 kB\nWritebackTmp:       0 kB\n";
        assert_eq!(proc_kib_field(meminfo, "Writeback"), Some(8));
        assert_eq!(proc_kib_field(meminfo, "Dirty"), Some(120));
        assert_eq!(proc_kib_field(meminfo, "Cached"), None);
    }

    #[test]
    fn this_process_resident_memory_is_read_where_proc_exists() {
        if std::path::Path::new("/proc/self/status").exists() {
            let rss = process_resident_bytes().expect("VmRSS of /proc/self/status");
            assert!(rss > MIB, "a test process holds more than a MiB: {rss}");
        }
    }
}
