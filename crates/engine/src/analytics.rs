//! Maintained analytics: the content-free counters of `Analytics.Counts`, kept up to date by the
//! projection runner as it folds (each event's redacted view plus the verdict the fold just
//! recorded for it) and checkpointed with the fold, so a Counts call is O(buckets), never a refold
//! of the history.
//!
//! Counters live in time buckets of the log's clock: one a minute for recent history, rolled up
//! into hours and then days as they age, so memory is bounded by configuration and not by the
//! log's length (about `MINUTE_BUCKETS_MAX + HOUR_BUCKETS_MAX` buckets plus one per day of
//! history). Each bucket remembers the first and last seq it covers. A request is answered from
//! the counters when its range starts and ends on bucket edges and asks for buckets no finer than
//! the ones it covers — the whole log, or whole minutes/hours/days of recent history; any other
//! range is refolded by the replayer as before (exact, but O(range)).
//!
//! The runner appends events in log order and log times only grow (the embedded log makes them
//! strictly monotonic; JetStream stamps in order on the stream leader). An event whose time is
//! before the newest bucket's start (a leader change with a clock behind) is counted in the newest
//! bucket, so buckets stay contiguous in seq; the refold would place it by its own time.

use std::collections::{BTreeMap, BTreeSet};

use anima_projections::redact::{
    AnalyticsCounts, BucketCounts, Figures, RedactedEvent, RedactedOutcome, Redactor, TimeBucket, TypeCounts,
    ANALYTICS_BUCKETS_MAX,
};
use anima_projections::verdict::Verdict;
use serde::{Deserialize, Serialize};

/// Minute buckets kept before the oldest are rolled into hours: three days.
pub const MINUTE_BUCKETS_MAX: usize = 3 * 24 * 60;
/// Hour buckets kept before the oldest are rolled into days: ninety days.
pub const HOUR_BUCKETS_MAX: usize = 90 * 24;

/// One bucket of counters and the seqs it covers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterBucket {
    pub width: TimeBucket,
    pub first_seq: u64,
    pub last_seq: u64,
    pub counts: BucketCounts,
}

/// The maintained counters, by bucket start (unix ns), with the changes since the last
/// checkpoint.
#[derive(Debug, Default)]
pub struct MaintainedAnalytics {
    buckets: BTreeMap<i64, CounterBucket>,
    /// First seq of each bucket → its start: finds the bucket holding a seq.
    by_first_seq: BTreeMap<u64, i64>,
    minute_buckets: usize,
    hour_buckets: usize,
    changed: BTreeSet<i64>,
    removed: BTreeSet<i64>,
}

impl MaintainedAnalytics {
    /// The newest seq counted (0: none).
    pub fn counted_seq(&self) -> u64 {
        self.buckets.last_key_value().map_or(0, |(_, bucket)| bucket.last_seq)
    }

    /// Counts one event the fold has just applied, with the verdict it recorded (if any).
    pub fn observe(&mut self, seq: u64, log_time_ns: i64, subject: &str, payload: &[u8], verdict: Option<&Verdict>) {
        let event = Redactor::schema().redact(seq, log_time_ns, subject, payload);
        self.observe_redacted(event, verdict);
    }

    /// Counts one event already redacted (the runner redacts a batch before it takes the state
    /// lock: the redaction is a reflection decode that needs no state), with its verdict.
    pub fn observe_redacted(&mut self, mut event: RedactedEvent, verdict: Option<&Verdict>) {
        let (seq, log_time_ns) = (event.seq, event.log_time_ns);
        event.outcome = verdict.map(RedactedOutcome::of);
        let minute = TimeBucket::Minute.start_ns(log_time_ns);
        let start = match self.buckets.last_key_value() {
            Some((&newest, _)) if newest >= minute => newest,
            _ => {
                let bucket = CounterBucket {
                    width: TimeBucket::Minute,
                    first_seq: seq,
                    last_seq: seq,
                    counts: BucketCounts::default(),
                };
                self.insert(minute, bucket);
                minute
            }
        };
        let bucket = self.buckets.get_mut(&start).expect("the newest bucket exists");
        debug_assert!(seq > bucket.last_seq || bucket.first_seq == seq, "events are counted once, in log order");
        bucket.last_seq = seq;
        let types = bucket.counts.types.entry(event.event_type.clone()).or_default();
        types.events += 1;
        types.event_bytes += event.event_bytes;
        types.content_bytes += event.content_bytes;
        bucket.counts.figures.observe(&event);
        self.changed.insert(start);
        self.roll_up();
    }

    fn insert(&mut self, start: i64, bucket: CounterBucket) {
        match bucket.width {
            TimeBucket::Minute => self.minute_buckets += 1,
            TimeBucket::Hour => self.hour_buckets += 1,
            TimeBucket::Day => {}
        }
        self.by_first_seq.insert(bucket.first_seq, start);
        self.buckets.insert(start, bucket);
        self.changed.insert(start);
        self.removed.remove(&start);
    }

    fn remove(&mut self, start: i64) -> Option<CounterBucket> {
        let bucket = self.buckets.remove(&start)?;
        match bucket.width {
            TimeBucket::Minute => self.minute_buckets -= 1,
            TimeBucket::Hour => self.hour_buckets -= 1,
            TimeBucket::Day => {}
        }
        self.by_first_seq.remove(&bucket.first_seq);
        self.changed.remove(&start);
        self.removed.insert(start);
        Some(bucket)
    }

    /// Rolls the oldest minutes into their hour and the oldest hours into their day while more
    /// are kept than the bounds allow. The newest bucket is never rolled (it is still filling).
    fn roll_up(&mut self) {
        while self.minute_buckets > MINUTE_BUCKETS_MAX {
            let Some(oldest) = self.oldest_of(TimeBucket::Minute) else { break };
            self.merge_into(TimeBucket::Hour, TimeBucket::Minute, oldest);
        }
        while self.hour_buckets > HOUR_BUCKETS_MAX {
            let Some(oldest) = self.oldest_of(TimeBucket::Hour) else { break };
            self.merge_into(TimeBucket::Day, TimeBucket::Hour, oldest);
        }
    }

    fn oldest_of(&self, width: TimeBucket) -> Option<i64> {
        let newest = *self.buckets.last_key_value()?.0;
        self.buckets.iter().find(|(&start, b)| b.width == width && start != newest).map(|(&start, _)| start)
    }

    /// Merges every `from`-wide bucket inside the `to`-wide bucket holding `start` (they are
    /// contiguous: times grow with seqs) into one `to`-wide bucket.
    fn merge_into(&mut self, to: TimeBucket, from: TimeBucket, start: i64) {
        let target = to.start_ns(start);
        let end = target + to.width_ns();
        let newest = *self.buckets.last_key_value().map(|(k, _)| k).unwrap_or(&i64::MAX);
        let members: Vec<i64> =
            self.buckets.range(target..end).filter(|(&s, b)| b.width == from && s != newest).map(|(&s, _)| s).collect();
        // A `to`-wide bucket already at `target` (an earlier roll-up) is the base; a `from`-wide
        // bucket starting exactly there is one of the members.
        let mut merged = match self.buckets.get(&target) {
            Some(bucket) if bucket.width == to => self.remove(target),
            _ => None,
        };
        for member in members {
            let Some(bucket) = self.remove(member) else { continue };
            merged = Some(match merged {
                None => CounterBucket { width: to, ..bucket },
                Some(mut into) => {
                    into.first_seq = into.first_seq.min(bucket.first_seq);
                    into.last_seq = into.last_seq.max(bucket.last_seq);
                    merge_bucket_counts(&mut into.counts, &bucket.counts);
                    into
                }
            });
        }
        if let Some(merged) = merged {
            self.insert(target, merged);
        }
    }

    /// The counts of `from..=to` in `width` buckets, when the counters can answer it exactly:
    /// the range starts and ends on bucket edges and no covered bucket is wider than `width`.
    /// `None`: refold instead. `counted_to` is the newest seq counted so far.
    pub fn counts(&self, from: u64, to: u64, width: TimeBucket, counted_to: u64) -> Option<AnalyticsCounts> {
        let mut counts = AnalyticsCounts::new(width);
        if from > to {
            return Some(counts);
        }
        if to > counted_to {
            return None;
        }
        let (_, &first_start) = self.by_first_seq.range(..=from).next_back()?;
        if self.buckets.get(&first_start)?.first_seq != from {
            return None;
        }
        for (&start, bucket) in self.buckets.range(first_start..) {
            if bucket.first_seq > to {
                break;
            }
            if bucket.last_seq > to || bucket.width.width_ns() > width.width_ns() {
                return None;
            }
            counts.first_seq.get_or_insert(bucket.first_seq);
            counts.last_seq = Some(bucket.last_seq);
            merge_figures(&mut counts.total, &bucket.counts.figures);
            let bucket_start = width.start_ns(start);
            if !counts.buckets.contains_key(&bucket_start) && counts.buckets.len() >= ANALYTICS_BUCKETS_MAX {
                counts.buckets_truncated = true;
                continue;
            }
            merge_bucket_counts(counts.buckets.entry(bucket_start).or_default(), &bucket.counts);
        }
        (counts.last_seq == Some(to)).then_some(counts)
    }

    /// Changed buckets since the last call, as checkpoint entries (key: the bucket start as
    /// big-endian bytes with the sign flipped, so keys sort by time; `None` removes the key).
    pub fn drain_changes(&mut self) -> Vec<(Vec<u8>, Option<Vec<u8>>)> {
        let mut out = Vec::with_capacity(self.changed.len() + self.removed.len());
        for start in std::mem::take(&mut self.removed) {
            out.push((bucket_key(start).to_vec(), None));
        }
        for start in std::mem::take(&mut self.changed) {
            let bucket = &self.buckets[&start];
            out.push((bucket_key(start).to_vec(), Some(postcard::to_allocvec(bucket).expect("buckets encode"))));
        }
        out
    }

    /// Loads one checkpoint entry written by [`MaintainedAnalytics::drain_changes`].
    pub fn load_entry(&mut self, key: &[u8], value: &[u8]) -> Result<(), String> {
        let start = bucket_start(key).ok_or_else(|| format!("analytics key of {} bytes", key.len()))?;
        let bucket: CounterBucket = postcard::from_bytes(value).map_err(|e| e.to_string())?;
        self.insert(start, bucket);
        self.changed.remove(&start);
        Ok(())
    }

    /// Buckets kept now (for tests and metrics).
    pub fn buckets_len(&self) -> usize {
        self.buckets.len()
    }
}

fn bucket_key(start: i64) -> [u8; 8] {
    ((start as u64) ^ (1 << 63)).to_be_bytes()
}

fn bucket_start(key: &[u8]) -> Option<i64> {
    let bytes: [u8; 8] = key.try_into().ok()?;
    Some((u64::from_be_bytes(bytes) ^ (1 << 63)) as i64)
}

fn merge_bucket_counts(into: &mut BucketCounts, from: &BucketCounts) {
    for (event_type, counts) in &from.types {
        let TypeCounts { events, event_bytes, content_bytes } = counts;
        let sum = into.types.entry(event_type.clone()).or_default();
        sum.events += events;
        sum.event_bytes += event_bytes;
        sum.content_bytes += content_bytes;
    }
    merge_figures(&mut into.figures, &from.figures);
}

fn merge_maps(into: &mut BTreeMap<String, u64>, from: &BTreeMap<String, u64>) {
    for (name, count) in from {
        *into.entry(name.clone()).or_default() += count;
    }
}

/// Adds `from` to `into`. Destructured so that a new field of `Figures` fails to compile here
/// until it is merged too.
fn merge_figures(into: &mut Figures, from: &Figures) {
    let Figures {
        events,
        event_bytes,
        sends_allowed,
        sends_held,
        wakes_by_reason,
        settled_without_turn,
        claims,
        notes_shown,
        starts,
        finishes_by_outcome,
        refusals_by_kind,
        dm_replies_threaded,
        dm_replies_top_level,
        memory_passes_queued,
        memory_outcomes,
        memory_delay_seconds_sum,
        memory_delay_count,
        wakes_not_queued_queue_full,
        failure_notices_owed,
        failure_notices_settled,
        sends_not_contacted,
    } = from;
    into.events += events;
    into.event_bytes += event_bytes;
    into.sends_allowed += sends_allowed;
    into.sends_held += sends_held;
    merge_maps(&mut into.wakes_by_reason, wakes_by_reason);
    into.settled_without_turn += settled_without_turn;
    into.claims += claims;
    into.notes_shown += notes_shown;
    into.starts += starts;
    merge_maps(&mut into.finishes_by_outcome, finishes_by_outcome);
    merge_maps(&mut into.refusals_by_kind, refusals_by_kind);
    into.dm_replies_threaded += dm_replies_threaded;
    into.dm_replies_top_level += dm_replies_top_level;
    into.memory_passes_queued += memory_passes_queued;
    merge_maps(&mut into.memory_outcomes, memory_outcomes);
    into.memory_delay_seconds_sum += memory_delay_seconds_sum;
    into.memory_delay_count += memory_delay_count;
    into.wakes_not_queued_queue_full += wakes_not_queued_queue_full;
    into.failure_notices_owed += failure_notices_owed;
    into.failure_notices_settled += failure_notices_settled;
    into.sends_not_contacted += sends_not_contacted;
}

/// How long a Counts call waits for the fold to count the newest event of its range before it
/// refolds instead.
const COUNTED_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// `Analytics.Counts` of `range`: from the maintained counters of `projection` when they answer
/// it exactly (see the module docs), else by refolding the range with `replayer`. Returns the seq
/// range covered and the counts.
pub async fn answer_counts(
    replayer: &crate::replay::Replayer,
    projection: Option<&crate::projection::Projection>,
    range: crate::replay::LogRange,
    width: TimeBucket,
) -> Result<(u64, u64, AnalyticsCounts), crate::replay::ReplayError> {
    if let Some(projection) = projection {
        let (from, to) = replayer.resolve(range).await?;
        if range.to.is_none() {
            // "Up to now" is what the fold has counted: a moment behind the log under load,
            // never a wait for it, and read under the same lock as the counts (the fold goes on
            // counting meanwhile; an end read before would fall inside its newest bucket and
            // send the answer to a refold of the whole log). Not bounded by the log's end read
            // above either: the fold may have counted past it since.
            let analytics = projection.analytics();
            let to = analytics.counted_seq();
            if let Some(counts) = analytics.counts(from, to, width, to) {
                return Ok((from, to, counts));
            }
        } else if from > to || projection.wait_applied(to, COUNTED_WAIT).await.is_ok() {
            let answered = projection.analytics().counts(from, to, width, projection.applied_seq());
            if let Some(counts) = answered {
                return Ok((from, to, counts));
            }
        }
    }
    replayer.counts(range, width).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use anima_projections::proto::{self, envelope::Payload};
    use prost::Message;

    const MINUTE_NS: i64 = 60_000_000_000;

    /// Encoded observations of one DM each, the `n`th at `n * gap` after a fixed start.
    fn events(total: u64, gap_ns: i64) -> Vec<(u64, i64, Vec<u8>)> {
        (1..=total)
            .map(|seq| {
                let envelope = proto::Envelope {
                    event_id: format!("e{seq}"),
                    min_reader_version: 1,
                    payload: Some(Payload::SlackMessage(proto::SlackMessageObserved {
                        receiving_agent_id: "ada".into(),
                        team_id: "T1".into(),
                        channel_id: "D1".into(),
                        ts: format!("{}.000100", 1_700_000_000 + seq),
                        user_id: "U1".into(),
                        text: "x".repeat((seq % 50) as usize),
                        ..Default::default()
                    })),
                    ..Default::default()
                };
                (seq, 1_700_000_000_000_000_000 + seq as i64 * gap_ns, envelope.encode_to_vec())
            })
            .collect()
    }

    /// What a refold counts: every redacted event observed in order.
    fn refold(events: &[(u64, i64, Vec<u8>)], width: TimeBucket) -> AnalyticsCounts {
        let mut counts = AnalyticsCounts::new(width);
        for (seq, at, payload) in events {
            counts.observe(&Redactor::schema().redact(*seq, *at, "anima.v1.surface.x", payload));
        }
        counts
    }

    fn maintained(events: &[(u64, i64, Vec<u8>)]) -> MaintainedAnalytics {
        let mut analytics = MaintainedAnalytics::default();
        for (seq, at, payload) in events {
            analytics.observe(*seq, *at, "anima.v1.surface.x", payload, None);
        }
        analytics
    }

    #[test]
    fn the_counters_answer_like_a_refold_and_stay_bounded_as_history_ages() {
        // 6,000 events 31 minutes apart: about 129 days, so minutes roll into hours and hours
        // into days.
        let events = events(6_000, 31 * MINUTE_NS);
        let analytics = maintained(&events);
        assert!(analytics.buckets_len() <= MINUTE_BUCKETS_MAX + HOUR_BUCKETS_MAX + 200, "{}", analytics.buckets_len());
        assert!(analytics.buckets_len() < 6_000, "old minutes were rolled up");
        let last = events.len() as u64;
        assert_eq!(analytics.counts(1, last, TimeBucket::Day, last), Some(refold(&events, TimeBucket::Day)));
        // Minute buckets of days that were rolled up cannot be answered: refold instead.
        assert_eq!(analytics.counts(1, last, TimeBucket::Minute, last), None);
        // The recent minutes are still minutes.
        let recent = &events[events.len() - 10..];
        assert_eq!(
            analytics.counts(recent[0].0, last, TimeBucket::Minute, last),
            Some(refold(recent, TimeBucket::Minute))
        );
        // Not yet counted, or not on a bucket edge: refold.
        assert_eq!(analytics.counts(1, last + 1, TimeBucket::Day, last), None);
    }

    #[test]
    fn a_range_inside_a_bucket_is_left_to_the_refold() {
        // Ten events a second apart share one minute bucket.
        let events = events(10, 1_000_000_000);
        let analytics = maintained(&events);
        assert_eq!(analytics.counts(1, 10, TimeBucket::Minute, 10), Some(refold(&events, TimeBucket::Minute)));
        assert_eq!(analytics.counts(3, 10, TimeBucket::Minute, 10), None);
        assert_eq!(analytics.counts(1, 5, TimeBucket::Minute, 10), None);
    }

    #[test]
    fn the_checkpointed_buckets_restore_the_same_answers() {
        // 5,000 minutes: the second checkpoint rolls the oldest into hours.
        let events = events(5_000, 97 * MINUTE_NS);
        let mut analytics = maintained(&events[..2_500]);
        let mut restored = MaintainedAnalytics::default();
        // The checkpoint tree: the first checkpoint's entries, then the second's on top.
        let mut stored = BTreeMap::new();
        for (key, value) in analytics.drain_changes() {
            let value = value.expect("no removal before the first checkpoint");
            restored.load_entry(&key, &value).unwrap();
            stored.insert(key, value);
        }
        for (seq, at, payload) in &events[2_500..] {
            analytics.observe(*seq, *at, "anima.v1.surface.x", payload, None);
            restored.observe(*seq, *at, "anima.v1.surface.x", payload, None);
        }
        // A second checkpoint carries roll-ups as removals and rewrites.
        let mut reloaded = MaintainedAnalytics::default();
        for (key, value) in restored.drain_changes() {
            match value {
                Some(value) => stored.insert(key, value),
                None => stored.remove(&key),
            };
        }
        for (key, value) in &stored {
            reloaded.load_entry(key, value).unwrap();
        }
        let last = events.len() as u64;
        let expected = Some(refold(&events, TimeBucket::Day));
        assert_eq!(analytics.counts(1, last, TimeBucket::Day, last), expected);
        assert_eq!(restored.counts(1, last, TimeBucket::Day, last), expected);
        assert_eq!(reloaded.counts(1, last, TimeBucket::Day, last), expected);
    }
}
