//! The engine's clock outside the log: what the embedded log stamps records with and what the
//! memory-pass scheduler and the recovery loop call "now". Production uses the wall clock; tests
//! inject a [`ManualClock`] to live through days (and DST transitions) in milliseconds. Folds
//! never read a clock: they use the log's timestamps.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Unix time in nanoseconds.
pub trait Clock: Send + Sync + std::fmt::Debug {
    fn now_ns(&self) -> i64;
}

/// The wall clock; a clock before 1970 reads as 0.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ns(&self) -> i64 {
        SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
    }
}

/// A clock that moves only when told to.
#[derive(Debug, Default)]
pub struct ManualClock {
    now_ns: AtomicI64,
}

impl ManualClock {
    pub fn new(now_ns: i64) -> Self {
        ManualClock { now_ns: AtomicI64::new(now_ns) }
    }

    pub fn set(&self, now_ns: i64) {
        self.now_ns.store(now_ns, Ordering::SeqCst);
    }

    pub fn advance(&self, by: std::time::Duration) {
        self.now_ns.fetch_add(i64::try_from(by.as_nanos()).unwrap_or(i64::MAX), Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ns(&self) -> i64 {
        self.now_ns.load(Ordering::SeqCst)
    }
}

/// Runs `tick` at once and then every `interval` (a slow tick delays the next one rather than
/// bunching them) until `shutdown`; a tick in progress finishes first.
pub async fn every<F, Fut>(interval: std::time::Duration, shutdown: &tokio_util::sync::CancellationToken, mut tick: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut timer = tokio::time::interval(interval);
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = timer.tick() => {}
        }
        tick().await;
    }
}
