//! When each agent's daily memory pass falls due: the `memoryCoherence` window
//! settings, the per-agent offset into the window, the slot of a local window-day, and the slot
//! due at an instant with its pass id.
//!
//! Every agent gets one slot per local window-day: the window start plus a fixed offset derived
//! from its id, so that agents spread over the window and each keeps the same local time every
//! day. The fold and the scheduler both use these functions, with the log's timestamp as "now",
//! so every engine instance agrees on which pass is due.
//!
//! Pure: no clock, no IO. Zones come from jiff's bundled copy of the IANA database
//! ([`TimeZoneDatabase::bundled`]), never from `/usr/share/zoneinfo` or `TZ`, so replaying the
//! log on another machine gives the same slots. (A jiff upgrade can bring a newer tz release;
//! that changes future slots only where the zone's rules changed.)
//!
//! # Time-zone transitions
//!
//! The slot of window-day `D` is the local date-time `D 00:00 + window start + offset`, resolved
//! to an instant with the RFC 5545 / Temporal "compatible" rule, so every local day has exactly
//! one slot:
//!
//! * In a gap (the local time does not exist that day, e.g. 02:30 on a spring-forward day in
//!   New York), the slot moves forward by the length of the gap: 02:30 becomes 03:30 EDT.
//! * In an overlap (the local time exists twice, e.g. 01:30 on a fall-back day), the slot is the
//!   earlier of the two instants (01:30 EDT, not 01:30 EST).
//!
//! Slots of consecutive days are then at least 24 h minus the size of the transition apart. A
//! zone that skips a whole calendar day (Pacific/Apia on 2011-12-30) maps the skipped day onto
//! the next day's instant; [`MemoryPassCalendar::due_slot`] then names the day that exists, so the
//! skipped day (which nobody lived through) has no pass.

use std::collections::BTreeMap;

use jiff::civil::{Date, DateTime, Time};
use jiff::tz::{TimeZone, TimeZoneDatabase};
use jiff::{SignedDuration, Timestamp};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Longest window: a whole day. A longer one would give an agent two slots on some days.
pub const WINDOW_MINUTES_MAX: u16 = 1440;
/// Default `windowStart`, local time.
pub const WINDOW_START_DEFAULT: &str = "05:00";
/// Default `windowDurationMinutes`.
pub const WINDOW_MINUTES_DEFAULT: u16 = 120;
/// Default `timezone`: one zone for the whole deployment.
pub const TIMEZONE_DEFAULT: &str = "UTC";
/// Longest accepted zone name. The longest IANA name has 32 bytes; the bound keeps a
/// mistyped value from being echoed into logs and errors at any length.
pub const TIMEZONE_NAME_BYTES_MAX: usize = 64;
/// Bytes of a rejected value quoted back in an error message.
const ERROR_ECHO_BYTES_MAX: usize = 64;

/// Window days before the local date of "now" searched for the due slot. The slot of day `D`
/// lies less than two days after `D 00:00` local (start ≤ 23:59, offset < 1440 minutes); one
/// more day covers a transition of up to a day.
const DUE_SLOT_DAYS_BACK: i64 = 3;

/// The `memoryCoherence` window settings the slot math needs. Plain data, so it can live in the
/// fold's state and in the log's configuration event; build it with
/// [`MemoryPassSettings::parse`] (or check a hand-built one with
/// [`MemoryPassSettings::validate`]) and resolve the zone once with [`MemoryPassCalendar::new`].
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MemoryPassSettings {
    /// Minutes after local midnight at which the window opens (`windowStart`): 0..=1439.
    pub window_start_minutes: u16,
    /// Length of the window in minutes (`windowDurationMinutes`): 1..=1440. Agents' offsets
    /// spread over it.
    pub window_minutes: u16,
    /// IANA zone name as the bundled database spells it (`timezone`), e.g. `Europe/London`.
    pub timezone: String,
}

impl Default for MemoryPassSettings {
    fn default() -> Self {
        MemoryPassSettings {
            window_start_minutes: 5 * 60,
            window_minutes: WINDOW_MINUTES_DEFAULT,
            timezone: TIMEZONE_DEFAULT.to_owned(),
        }
    }
}

/// A `memoryCoherence` value that cannot be used. The caller should refuse to start and show the
/// message, which names the key; nothing here is worth a retry.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MemoryPassSettingsError {
    /// `windowStart` is not a local time `HH:MM` between 00:00 and 23:59. Fix the configuration.
    #[error("memoryCoherence.windowStart: expected a local time HH:MM between 00:00 and 23:59, got {0:?}")]
    WindowStart(String),
    /// `windowDurationMinutes` is outside 1..=1440. Fix the configuration.
    #[error("memoryCoherence.windowDurationMinutes: expected 1..=1440 minutes, got {0}")]
    WindowDurationMinutes(i64),
    /// `timezone` is not a zone of the bundled IANA database. Fix the configuration (names look
    /// like `America/New_York`; `UTC` is the default).
    #[error("memoryCoherence.timezone: {name:?} is not an IANA time zone name ({reason})")]
    Timezone { name: String, reason: String },
}

impl MemoryPassSettingsError {
    /// The configuration key at fault, as spelled in the TOML: `windowStart`,
    /// `windowDurationMinutes` or `timezone`.
    pub fn key(&self) -> &'static str {
        match self {
            MemoryPassSettingsError::WindowStart(_) => "windowStart",
            MemoryPassSettingsError::WindowDurationMinutes(_) => "windowDurationMinutes",
            MemoryPassSettingsError::Timezone { .. } => "timezone",
        }
    }
}

impl MemoryPassSettings {
    /// Checks and converts the configuration values: `window_start` as `HH:MM` (two digits each),
    /// `window_duration_minutes` in 1..=1440, `timezone` an IANA name (matched without regard to
    /// ASCII case and stored as the database spells it).
    pub fn parse(
        window_start: &str,
        window_duration_minutes: i64,
        timezone: &str,
    ) -> Result<MemoryPassSettings, MemoryPassSettingsError> {
        let window_start_minutes = parse_window_start(window_start)?;
        let window_minutes = match u16::try_from(window_duration_minutes) {
            Ok(minutes) if (1..=WINDOW_MINUTES_MAX).contains(&minutes) => minutes,
            _ => return Err(MemoryPassSettingsError::WindowDurationMinutes(window_duration_minutes)),
        };
        let zone = resolve_time_zone(timezone)?;
        let timezone = zone.iana_name().unwrap_or(timezone).to_owned();
        Ok(MemoryPassSettings { window_start_minutes, window_minutes, timezone })
    }

    /// Checks a value built by hand or read back from the log: the same rules as
    /// [`MemoryPassSettings::parse`].
    pub fn validate(&self) -> Result<(), MemoryPassSettingsError> {
        MemoryPassCalendar::new(self).map(|_| ())
    }

    /// The window start as `HH:MM`, as configured.
    pub fn window_start_label(&self) -> String {
        format!("{:02}:{:02}", self.window_start_minutes / 60, self.window_start_minutes % 60)
    }
}

/// Parses `windowStart` (`HH:MM`, 00:00..=23:59) into minutes after local midnight.
pub fn parse_window_start(text: &str) -> Result<u16, MemoryPassSettingsError> {
    let refuse = || MemoryPassSettingsError::WindowStart(echo(text));
    let bytes = text.as_bytes();
    if bytes.len() != 5 || bytes[2] != b':' {
        return Err(refuse());
    }
    let digit = |b: u8| if b.is_ascii_digit() { Ok(u16::from(b - b'0')) } else { Err(refuse()) };
    let hours = digit(bytes[0])? * 10 + digit(bytes[1])?;
    let minutes = digit(bytes[3])? * 10 + digit(bytes[4])?;
    if hours > 23 || minutes > 59 {
        return Err(refuse());
    }
    Ok(hours * 60 + minutes)
}

fn resolve_time_zone(name: &str) -> Result<TimeZone, MemoryPassSettingsError> {
    let refuse = |reason: &str| MemoryPassSettingsError::Timezone { name: echo(name), reason: reason.to_owned() };
    if name.is_empty() || name.len() > TIMEZONE_NAME_BYTES_MAX {
        return Err(refuse("empty or too long"));
    }
    let zone = TimeZoneDatabase::bundled().get(name).map_err(|_| refuse("not in the bundled tz database"))?;
    // jiff answers `Etc/Unknown` with a placeholder zone that behaves as UTC; refuse it rather
    // than schedule by a zone nobody chose.
    if zone.is_unknown() {
        return Err(refuse("the placeholder for an unknown zone"));
    }
    Ok(zone)
}

fn echo(text: &str) -> String {
    let mut end = text.len().min(ERROR_ECHO_BYTES_MAX);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

/// The agent's fixed offset into the window, in minutes: the first 4 bytes of SHA-256 of its id
/// as a big-endian integer, modulo the window length. Stable across releases and machines (it is
/// part of the pass schedule users see).
///
/// `window_minutes` is validated to be at least 1; a zero (a bug) is treated as 1.
pub fn agent_offset_minutes(agent_id: &str, window_minutes: u16) -> u32 {
    debug_assert!(window_minutes >= 1, "window_minutes is validated to 1..=1440");
    let digest = Sha256::digest(agent_id.as_bytes());
    let head = u32::from_be_bytes([digest[0], digest[1], digest[2], digest[3]]);
    head % u32::from(window_minutes.max(1))
}

/// The pass id of an agent's window-day: `memory-pass:{agent}:{YYYY-MM-DD}`. The fold accepts a
/// pass request only for an id it has not seen, so one pass runs per agent and window-day. The
/// date is always the last 10 bytes, so an agent id containing `:` stays unambiguous.
pub fn pass_id(agent_id: &str, window_day: Date) -> String {
    pass_id_of_day(agent_id, &date_label(window_day))
}

/// [`pass_id`] with the window-day already written as `YYYY-MM-DD`.
fn pass_id_of_day(agent_id: &str, date_label: &str) -> String {
    // Written piecewise into one allocation of the right size: the plan makes one per agent.
    const PREFIX: &str = "memory-pass:";
    let mut id = String::with_capacity(PREFIX.len() + agent_id.len() + 1 + date_label.len());
    id.push_str(PREFIX);
    id.push_str(agent_id);
    id.push(':');
    id.push_str(date_label);
    id
}

/// `YYYY-MM-DD` (years 0000..=9999, which covers every instant of the i64-nanosecond log clock).
fn date_label(date: Date) -> String {
    format!("{:04}-{:02}-{:02}", date.year(), date.month(), date.day())
}

/// The slot due at an instant: the latest slot at or before it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryPassSlot {
    /// When the pass became due.
    pub slot: Timestamp,
    /// The same instant as unix nanoseconds, the log's clock.
    pub slot_at_ns: i64,
    /// The local window-day the slot belongs to: the local date of the slot minus the agent's
    /// offset, i.e. the date whose window holds the slot. A slot after local midnight (a
    /// window that crosses midnight) still belongs to the day its window opened.
    pub local_date: Date,
    /// `memory-pass:{agent}:{local_date}`.
    pub pass_id: String,
}

impl MemoryPassSlot {
    /// The window-day as `YYYY-MM-DD`.
    pub fn local_date_label(&self) -> String {
        date_label(self.local_date)
    }
}

/// Validated settings with their zone resolved: resolve once per configuration, then compute
/// slots for any number of agents without another database lookup.
#[derive(Clone, Debug)]
pub struct MemoryPassCalendar {
    settings: MemoryPassSettings,
    zone: TimeZone,
}

impl MemoryPassCalendar {
    /// Validates the settings and resolves the zone in the bundled database.
    pub fn new(settings: &MemoryPassSettings) -> Result<MemoryPassCalendar, MemoryPassSettingsError> {
        if settings.window_start_minutes >= 24 * 60 {
            let label = format!("{} minutes after midnight", settings.window_start_minutes);
            return Err(MemoryPassSettingsError::WindowStart(label));
        }
        if !(1..=WINDOW_MINUTES_MAX).contains(&settings.window_minutes) {
            return Err(MemoryPassSettingsError::WindowDurationMinutes(i64::from(settings.window_minutes)));
        }
        let zone = resolve_time_zone(&settings.timezone)?;
        Ok(MemoryPassCalendar { settings: settings.clone(), zone })
    }

    pub fn settings(&self) -> &MemoryPassSettings {
        &self.settings
    }

    pub fn time_zone(&self) -> &TimeZone {
        &self.zone
    }

    /// Minutes from local midnight of the window-day to the agent's slot (may exceed a day when
    /// the window crosses midnight).
    fn slot_minutes(&self, agent_id: &str) -> i64 {
        i64::from(self.settings.window_start_minutes)
            + i64::from(agent_offset_minutes(agent_id, self.settings.window_minutes))
    }

    fn slot_at_minutes(&self, window_day: Date, slot_minutes: i64) -> Option<Timestamp> {
        let local: DateTime =
            window_day.to_datetime(Time::midnight()).checked_add(SignedDuration::from_mins(slot_minutes)).ok()?;
        // "Compatible": forward past a gap, the earlier instant of an overlap (module docs).
        self.zone.to_ambiguous_timestamp(local).compatible().ok()
    }

    /// The agent's slot on a local window-day. `None` only at the ends of jiff's range
    /// (years −9999 and 9999).
    pub fn slot_on(&self, window_day: Date, agent_id: &str) -> Option<Timestamp> {
        self.slot_at_minutes(window_day, self.slot_minutes(agent_id))
    }

    /// [`MemoryPassCalendar::slot_on`] as unix nanoseconds; `None` outside the i64 range
    /// (before 1677 or after 2262).
    pub fn slot_on_at_ns(&self, window_day: Date, agent_id: &str) -> Option<i64> {
        self.slot_on(window_day, agent_id).and_then(timestamp_ns)
    }

    /// The slot due at `now`: the latest slot at or before it, from the local date of `now` and
    /// the days before (so a slot missed yesterday is still due until today's arrives). Two
    /// window-days with the same instant (a skipped calendar day) resolve to the later day.
    /// `None` only at the ends of the representable range.
    pub fn due_slot(&self, now: Timestamp, agent_id: &str) -> Option<MemoryPassSlot> {
        let today = self.zone.to_datetime(now).date();
        let (slot, local_date) = self.due_at_minutes(now, today, self.slot_minutes(agent_id))?;
        Some(MemoryPassSlot {
            slot,
            slot_at_ns: timestamp_ns(slot)?,
            local_date,
            pass_id: pass_id(agent_id, local_date),
        })
    }

    /// The rule of [`MemoryPassCalendar::due_slot`] for a slot `slot_minutes` after local
    /// midnight, with `today` the local date of `now`: the slot's instant and its window-day.
    fn due_at_minutes(&self, now: Timestamp, today: Date, slot_minutes: i64) -> Option<(Timestamp, Date)> {
        let mut due: Option<(Timestamp, Date)> = None;
        let mut window_day = today;
        for _ in 0..=DUE_SLOT_DAYS_BACK {
            // Newest day first and strictly later to replace: a tie keeps the later day.
            if let Some(slot) = self.slot_at_minutes(window_day, slot_minutes) {
                if slot <= now && due.is_none_or(|(best, _)| slot > best) {
                    due = Some((slot, window_day));
                }
            }
            let Ok(day_before) = window_day.yesterday() else { break };
            window_day = day_before;
        }
        due
    }

    /// The slots due at `now` for many agents: [`DueSlots::of`] gives what
    /// [`MemoryPassCalendar::due_slot`] gives, doing the zone math and the labels once per
    /// distinct offset rather than once per agent (10,000 agents over a 120-minute window share
    /// at most 120 slots).
    pub fn due_slots(&self, now_at_ns: i64) -> DueSlots<'_> {
        let now = Timestamp::from_nanosecond(i128::from(now_at_ns)).ok();
        let today = now.map(|now| self.zone.to_datetime(now).date());
        DueSlots { calendar: self, now: now.zip(today), by_minutes: BTreeMap::new() }
    }

    /// [`MemoryPassCalendar::due_slot`] with `now` as unix nanoseconds (the log's clock).
    pub fn due_slot_at_ns(&self, now_at_ns: i64, agent_id: &str) -> Option<MemoryPassSlot> {
        self.due_slot(Timestamp::from_nanosecond(i128::from(now_at_ns)).ok()?, agent_id)
    }

    /// The first slot strictly after `now` (for status and plans), named like
    /// [`MemoryPassCalendar::due_slot`] will name it when it arrives.
    pub fn next_slot(&self, now: Timestamp, agent_id: &str) -> Option<MemoryPassSlot> {
        let mut window_day = match self.due_slot(now, agent_id) {
            Some(due) => due.local_date,
            None => self.zone.to_datetime(now).date().yesterday().ok()?.yesterday().ok()?,
        };
        let slot_minutes = self.slot_minutes(agent_id);
        for _ in 0..=DUE_SLOT_DAYS_BACK {
            window_day = window_day.tomorrow().ok()?;
            let slot = self.slot_at_minutes(window_day, slot_minutes)?;
            if slot > now {
                // A skipped calendar day shares its instant with the next day; `due_slot` picks
                // the day that exists.
                return self.due_slot(slot, agent_id);
            }
        }
        None
    }

    /// [`MemoryPassCalendar::next_slot`] with `now` as unix nanoseconds.
    pub fn next_slot_at_ns(&self, now_at_ns: i64, agent_id: &str) -> Option<MemoryPassSlot> {
        self.next_slot(Timestamp::from_nanosecond(i128::from(now_at_ns)).ok()?, agent_id)
    }

    /// An instant in the configured zone for people and wake text: `YYYY-MM-DD HH:MM ABBR`,
    /// e.g. `2024-03-10 03:30 EDT`.
    pub fn local_label(&self, at: Timestamp) -> String {
        at.to_zoned_datetime(self.zone.clone()).strftime("%Y-%m-%d %H:%M %Z").to_string()
    }
}

/// The slots due at one instant, computed once per distinct slot time
/// ([`MemoryPassCalendar::due_slots`]).
pub struct DueSlots<'a> {
    calendar: &'a MemoryPassCalendar,
    /// The instant and its local date; `None` outside the representable range.
    now: Option<(Timestamp, Date)>,
    /// By minutes from local midnight to the slot: the due slot, if one is representable.
    by_minutes: BTreeMap<i64, Option<DueAt>>,
}

/// A due slot shared by every agent with the same offset.
struct DueAt {
    slot: Timestamp,
    slot_at_ns: i64,
    local_date: Date,
    /// `local_date` as `YYYY-MM-DD`.
    date_label: String,
    /// The slot as [`MemoryPassCalendar::local_label`] shows it.
    local_label: String,
}

impl DueSlots<'_> {
    /// The agent's due slot, with its window-day as `YYYY-MM-DD` and the slot's local label:
    /// the same values as [`MemoryPassCalendar::due_slot`], [`MemoryPassSlot::local_date_label`]
    /// and [`MemoryPassCalendar::local_label`] of it.
    pub fn of(&mut self, agent_id: &str) -> Option<(MemoryPassSlot, &str, &str)> {
        let (now, today) = self.now?;
        let calendar = self.calendar;
        let slot_minutes = calendar.slot_minutes(agent_id);
        let due = self.by_minutes.entry(slot_minutes).or_insert_with(|| {
            let (slot, local_date) = calendar.due_at_minutes(now, today, slot_minutes)?;
            Some(DueAt {
                slot,
                slot_at_ns: timestamp_ns(slot)?,
                local_date,
                date_label: date_label(local_date),
                local_label: calendar.local_label(slot),
            })
        });
        let due = due.as_ref()?;
        let slot = MemoryPassSlot {
            slot: due.slot,
            slot_at_ns: due.slot_at_ns,
            local_date: due.local_date,
            pass_id: pass_id_of_day(agent_id, &due.date_label),
        };
        Some((slot, &due.date_label, &due.local_label))
    }
}

fn timestamp_ns(at: Timestamp) -> Option<i64> {
    i64::try_from(at.as_nanosecond()).ok()
}

/// [`MemoryPassCalendar::slot_on`] for callers holding only the settings. Resolves the zone on
/// every call; hold a [`MemoryPassCalendar`] when computing many. `None` when the settings are
/// invalid or the date is at the end of the range.
pub fn slot_on(window_day: Date, agent_id: &str, settings: &MemoryPassSettings) -> Option<Timestamp> {
    MemoryPassCalendar::new(settings).ok()?.slot_on(window_day, agent_id)
}

/// [`MemoryPassCalendar::due_slot`] for callers holding only the settings; `None` when the
/// settings are invalid.
pub fn due_slot(now: Timestamp, agent_id: &str, settings: &MemoryPassSettings) -> Option<MemoryPassSlot> {
    MemoryPassCalendar::new(settings).ok()?.due_slot(now, agent_id)
}

/// [`due_slot`] with `now` as unix nanoseconds.
pub fn due_slot_at_ns(now_at_ns: i64, agent_id: &str, settings: &MemoryPassSettings) -> Option<MemoryPassSlot> {
    MemoryPassCalendar::new(settings).ok()?.due_slot_at_ns(now_at_ns, agent_id)
}

#[cfg(test)]
mod tests {
    use expect_test::{expect, Expect};
    use jiff::civil::date;
    use proptest::prelude::*;

    use super::*;

    fn calendar(zone: &str, start: &str, window_minutes: i64) -> MemoryPassCalendar {
        MemoryPassCalendar::new(&MemoryPassSettings::parse(start, window_minutes, zone).unwrap()).unwrap()
    }

    /// The slot of one window-day with a one-minute window (offset 0, so the slot is exactly the
    /// window start), shown in UTC and local time, and the pass due at that slot.
    #[track_caller]
    fn check_slot(zone: &str, start: &str, day: Date, expect: Expect) {
        let calendar = calendar(zone, start, 1);
        let slot = calendar.slot_on(day, "agent").unwrap();
        let due = calendar.due_slot(slot, "agent").unwrap();
        let before = calendar.due_slot(slot - SignedDuration::from_nanos(1), "agent").unwrap();
        let actual =
            format!("{slot} = {}, due {} (1 ns before: {})", calendar.local_label(slot), due.pass_id, before.pass_id);
        expect.assert_eq(&actual);
    }

    #[test]
    fn plain_days_use_the_window_start() {
        check_slot(
            "UTC",
            "05:00",
            date(2024, 6, 1),
            expect!["2024-06-01T05:00:00Z = 2024-06-01 05:00 UTC, due memory-pass:agent:2024-06-01 (1 ns before: memory-pass:agent:2024-05-31)"],
        );
        check_slot(
            "America/New_York",
            "05:00",
            date(2024, 6, 1),
            expect!["2024-06-01T09:00:00Z = 2024-06-01 05:00 EDT, due memory-pass:agent:2024-06-01 (1 ns before: memory-pass:agent:2024-05-31)"],
        );
    }

    #[test]
    fn a_slot_in_a_gap_moves_forward_by_the_gap() {
        check_slot(
            "America/New_York",
            "02:30",
            date(2024, 3, 10),
            expect!["2024-03-10T07:30:00Z = 2024-03-10 03:30 EDT, due memory-pass:agent:2024-03-10 (1 ns before: memory-pass:agent:2024-03-09)"],
        );
        check_slot(
            "Europe/London",
            "01:30",
            date(2024, 3, 31),
            expect!["2024-03-31T01:30:00Z = 2024-03-31 02:30 BST, due memory-pass:agent:2024-03-31 (1 ns before: memory-pass:agent:2024-03-30)"],
        );
        // Lord Howe moves its clocks by 30 minutes: 02:00 becomes 02:30.
        check_slot(
            "Australia/Lord_Howe",
            "02:15",
            date(2024, 10, 6),
            expect!["2024-10-05T15:45:00Z = 2024-10-06 02:45 +11, due memory-pass:agent:2024-10-06 (1 ns before: memory-pass:agent:2024-10-05)"],
        );
    }

    #[test]
    fn a_slot_in_an_overlap_takes_the_earlier_instant() {
        check_slot(
            "America/New_York",
            "01:30",
            date(2024, 11, 3),
            expect!["2024-11-03T05:30:00Z = 2024-11-03 01:30 EDT, due memory-pass:agent:2024-11-03 (1 ns before: memory-pass:agent:2024-11-02)"],
        );
        check_slot(
            "Europe/London",
            "01:30",
            date(2024, 10, 27),
            expect!["2024-10-27T00:30:00Z = 2024-10-27 01:30 BST, due memory-pass:agent:2024-10-27 (1 ns before: memory-pass:agent:2024-10-26)"],
        );
        check_slot(
            "Australia/Lord_Howe",
            "01:45",
            date(2024, 4, 7),
            expect!["2024-04-06T14:45:00Z = 2024-04-07 01:45 +11, due memory-pass:agent:2024-04-07 (1 ns before: memory-pass:agent:2024-04-06)"],
        );
    }

    #[test]
    fn the_second_occurrence_of_an_overlapped_time_does_not_start_another_pass() {
        let calendar = calendar("America/New_York", "01:30", 1);
        let first = calendar.slot_on(date(2024, 11, 3), "agent").unwrap();
        let second = first + SignedDuration::from_hours(1); // 01:30 EST
        assert_eq!(calendar.due_slot(second, "agent").unwrap().pass_id, "memory-pass:agent:2024-11-03");
        assert_eq!(calendar.due_slot(second, "agent").unwrap().slot, first);
    }

    #[test]
    fn a_skipped_calendar_day_has_no_pass() {
        // Samoa moved across the date line: 2011-12-29 23:59:59 -10 was followed by
        // 2011-12-31 00:00:00 +14.
        let calendar = calendar("Pacific/Apia", "05:00", 1);
        let skipped = calendar.slot_on(date(2011, 12, 30), "agent").unwrap();
        let next = calendar.slot_on(date(2011, 12, 31), "agent").unwrap();
        assert_eq!(skipped, next);
        let due = calendar.due_slot(next, "agent").unwrap();
        assert_eq!(due.pass_id, "memory-pass:agent:2011-12-31");
        let before = calendar.due_slot(next - SignedDuration::from_nanos(1), "agent").unwrap();
        assert_eq!(before.pass_id, "memory-pass:agent:2011-12-29");
        let next_slot = calendar.next_slot(next - SignedDuration::from_nanos(1), "agent").unwrap();
        assert_eq!(next_slot.pass_id, "memory-pass:agent:2011-12-31");
    }

    #[test]
    fn a_window_across_midnight_keeps_the_day_it_opened() {
        // Offset of "agent" in a 120-minute window.
        let offset = agent_offset_minutes("agent", 120);
        let calendar = calendar("UTC", "23:30", 120);
        let slot = calendar.slot_on(date(2024, 6, 1), "agent").unwrap();
        let expected_minutes = 23 * 60 + 30 + i64::from(offset);
        assert_eq!(
            slot,
            date(2024, 6, 1).to_zoned_datetime(TimeZone::UTC).unwrap().timestamp()
                + SignedDuration::from_mins(expected_minutes)
        );
        let due = calendar.due_slot(slot + SignedDuration::from_hours(1), "agent").unwrap();
        assert_eq!(due.local_date, date(2024, 6, 1));
        assert_eq!(due.pass_id, "memory-pass:agent:2024-06-01");
    }

    #[test]
    fn offset_is_the_big_endian_head_of_sha256_modulo_the_window() {
        // SHA-256("abc") = ba7816bf 8f01cfea ...; 0xba7816bf = 3_128_432_319.
        assert_eq!(agent_offset_minutes("abc", 1440), 3_128_432_319 % 1440);
        assert_eq!(agent_offset_minutes("abc", 120), 3_128_432_319 % 120);
        assert_eq!(agent_offset_minutes("abc", 1), 0);
        for agent in ["a", "b", "agent-7", ""] {
            assert!(agent_offset_minutes(agent, 7) < 7);
        }
    }

    #[test]
    fn the_due_slot_includes_the_agent_offset() {
        let settings = MemoryPassSettings::default();
        let offset = agent_offset_minutes("abc", 120);
        let slot = slot_on(date(2024, 1, 2), "abc", &settings).unwrap();
        assert_eq!(slot.to_string(), format!("2024-01-02T{:02}:{:02}:00Z", 5 + offset / 60, offset % 60));
        let now_at_ns = i64::try_from(slot.as_nanosecond()).unwrap();
        let due = due_slot_at_ns(now_at_ns, "abc", &settings).unwrap();
        assert_eq!((due.slot_at_ns, due.local_date_label().as_str()), (now_at_ns, "2024-01-02"));
        assert_eq!(due_slot(slot, "abc", &settings), Some(due));
    }

    #[test]
    fn settings_parse_and_name_the_key() {
        let settings = MemoryPassSettings::parse("05:00", 120, "america/new_york").unwrap();
        assert_eq!(
            settings,
            MemoryPassSettings { window_start_minutes: 300, window_minutes: 120, timezone: "America/New_York".into() }
        );
        assert_eq!(settings.window_start_label(), "05:00");
        assert_eq!(MemoryPassSettings::parse("05:00", 120, "UTC").unwrap(), MemoryPassSettings::default());
        assert_eq!(MemoryPassSettings::parse("23:59", 1440, "UTC").unwrap().window_start_minutes, 1439);

        let refused = |start: &str, minutes: i64, zone: &str| {
            let error = MemoryPassSettings::parse(start, minutes, zone).unwrap_err();
            format!("{}: {error}", error.key())
        };
        let actual = [
            refused("5:00", 120, "UTC"),
            refused("24:00", 120, "UTC"),
            refused("05:60", 120, "UTC"),
            refused("05-00", 120, "UTC"),
            refused("+5:00", 120, "UTC"),
            refused("05:00", 0, "UTC"),
            refused("05:00", 1441, "UTC"),
            refused("05:00", -5, "UTC"),
            refused("05:00", 120, "Mars/Olympus_Mons"),
            refused("05:00", 120, ""),
            refused("05:00", 120, "Etc/Unknown"),
            refused("05:00", 120, "+05:00"),
        ]
        .join("\n");
        expect![[r#"
            windowStart: memoryCoherence.windowStart: expected a local time HH:MM between 00:00 and 23:59, got "5:00"
            windowStart: memoryCoherence.windowStart: expected a local time HH:MM between 00:00 and 23:59, got "24:00"
            windowStart: memoryCoherence.windowStart: expected a local time HH:MM between 00:00 and 23:59, got "05:60"
            windowStart: memoryCoherence.windowStart: expected a local time HH:MM between 00:00 and 23:59, got "05-00"
            windowStart: memoryCoherence.windowStart: expected a local time HH:MM between 00:00 and 23:59, got "+5:00"
            windowDurationMinutes: memoryCoherence.windowDurationMinutes: expected 1..=1440 minutes, got 0
            windowDurationMinutes: memoryCoherence.windowDurationMinutes: expected 1..=1440 minutes, got 1441
            windowDurationMinutes: memoryCoherence.windowDurationMinutes: expected 1..=1440 minutes, got -5
            timezone: memoryCoherence.timezone: "Mars/Olympus_Mons" is not an IANA time zone name (not in the bundled tz database)
            timezone: memoryCoherence.timezone: "" is not an IANA time zone name (empty or too long)
            timezone: memoryCoherence.timezone: "Etc/Unknown" is not an IANA time zone name (the placeholder for an unknown zone)
            timezone: memoryCoherence.timezone: "+05:00" is not an IANA time zone name (not in the bundled tz database)"#]]
        .assert_eq(&actual);
    }

    #[test]
    fn hand_built_settings_are_validated() {
        let mut settings = MemoryPassSettings::default();
        assert_eq!(settings.validate(), Ok(()));
        settings.window_minutes = 0;
        assert_eq!(settings.validate().unwrap_err().key(), "windowDurationMinutes");
        assert_eq!(slot_on(date(2024, 1, 1), "a", &settings), None);
        settings = MemoryPassSettings { window_start_minutes: 1440, ..MemoryPassSettings::default() };
        assert_eq!(settings.validate().unwrap_err().key(), "windowStart");
        settings = MemoryPassSettings { timezone: "Nowhere".into(), ..MemoryPassSettings::default() };
        assert_eq!(settings.validate().unwrap_err().key(), "timezone");
        assert_eq!(due_slot_at_ns(0, "a", &settings), None);
    }

    const ZONES: &[&str] = &[
        "UTC",
        "America/New_York",
        "Europe/London",
        "Australia/Lord_Howe",
        "America/St_Johns",
        "Asia/Kathmandu",
        "Pacific/Chatham",
        "America/Santiago",
        "Europe/Dublin",
        "Africa/Casablanca",
    ];

    /// Instants from 1975 to 2060, as unix seconds.
    const INSTANT_SECONDS: std::ops::Range<i64> = 157_766_400..2_840_140_800;

    fn settings_strategy() -> impl Strategy<Value = MemoryPassSettings> {
        (prop::sample::select(ZONES), 0u16..1440, prop_oneof![Just(1u16), Just(120), Just(1440), 1u16..=1440]).prop_map(
            |(zone, window_start_minutes, window_minutes)| MemoryPassSettings {
                window_start_minutes,
                window_minutes,
                timezone: zone.to_owned(),
            },
        )
    }

    fn agent_strategy() -> impl Strategy<Value = String> {
        "[a-z0-9._-]{1,24}"
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// The due slot is the latest slot at or before now: not after now, and the next
        /// window-day's slot is after now.
        #[test]
        fn due_slot_is_the_latest_slot_not_after_now(
            settings in settings_strategy(),
            agent in agent_strategy(),
            now_seconds in INSTANT_SECONDS,
            now_subsec_ns in 0i64..1_000_000_000,
        ) {
            let calendar = MemoryPassCalendar::new(&settings).unwrap();
            let now_at_ns = now_seconds * 1_000_000_000 + now_subsec_ns;
            let due = calendar.due_slot_at_ns(now_at_ns, &agent).unwrap();
            prop_assert!(due.slot_at_ns <= now_at_ns);
            prop_assert_eq!(due.slot_at_ns, i64::try_from(due.slot.as_nanosecond()).unwrap());
            prop_assert_eq!(Some(due.slot), calendar.slot_on(due.local_date, &agent));
            prop_assert_eq!(&due.pass_id, &format!("memory-pass:{agent}:{}", due.local_date));
            let next_day_slot = calendar.slot_on(due.local_date.tomorrow().unwrap(), &agent).unwrap();
            prop_assert!(next_day_slot.as_nanosecond() > i128::from(now_at_ns));
            let next = calendar.next_slot(due.slot, &agent).unwrap();
            prop_assert_eq!(next.slot, next_day_slot);
            prop_assert_eq!(next.local_date, due.local_date.tomorrow().unwrap());
            // Window-day: the slot minus the agent's offset lies on that local date, up to the
            // size of a transition between window start and slot.
            let offset = SignedDuration::from_mins(i64::from(agent_offset_minutes(&agent, settings.window_minutes)));
            let opened = calendar.time_zone().to_datetime(due.slot - offset);
            let distance = opened.date().since(due.local_date).unwrap().get_days().abs();
            prop_assert!(distance <= 1, "window opened {opened} for day {}", due.local_date);
        }

        /// A plan's shared slots give every agent what its own computation gives: the same due
        /// slot and pass id, its day's label and its local label, whichever agents came first
        /// and share its offset.
        #[test]
        fn shared_due_slots_match_each_agents_own(
            settings in settings_strategy(),
            agents in prop::collection::vec(agent_strategy(), 1..40),
            now_seconds in INSTANT_SECONDS,
            now_subsec_ns in 0i64..1_000_000_000,
        ) {
            let calendar = MemoryPassCalendar::new(&settings).unwrap();
            let now_at_ns = now_seconds * 1_000_000_000 + now_subsec_ns;
            let mut shared = calendar.due_slots(now_at_ns);
            for agent in agents.iter().chain(&agents) {
                let own = calendar.due_slot_at_ns(now_at_ns, agent).unwrap();
                let (slot, day, label) = shared.of(agent).unwrap();
                prop_assert_eq!(day, own.local_date_label());
                prop_assert_eq!(label, calendar.local_label(own.slot));
                prop_assert_eq!(slot, own);
            }
        }

        /// The slot of a window-day does not depend on when or how it is computed, and days follow
        /// each other: consecutive days have distinct pass ids and increasing slots, each at
        /// least 24 h minus the largest clock change (3 h, with margin) apart.
        #[test]
        fn slots_are_stable_and_consecutive(
            settings in settings_strategy(),
            agent in agent_strategy(),
            day_seconds in INSTANT_SECONDS,
        ) {
            let calendar = MemoryPassCalendar::new(&settings).unwrap();
            let first_day = Timestamp::from_second(day_seconds).unwrap().to_zoned_datetime(TimeZone::UTC).date();
            let mut previous: Option<(Timestamp, String)> = None;
            let mut day = first_day;
            for _ in 0..10 {
                let slot = calendar.slot_on(day, &agent).unwrap();
                prop_assert_eq!(Some(slot), slot_on(day, &agent, &settings));
                prop_assert_eq!(Some(slot), MemoryPassCalendar::new(&settings).unwrap().slot_on(day, &agent));
                let id = pass_id(&agent, day);
                // At its own slot, the day's pass is the one due.
                prop_assert_eq!(&calendar.due_slot(slot, &agent).unwrap().pass_id, &id);
                if let Some((previous_slot, previous_id)) = &previous {
                    prop_assert_ne!(previous_id, &id);
                    prop_assert!(slot - *previous_slot >= SignedDuration::from_hours(21));
                    prop_assert!(slot - *previous_slot <= SignedDuration::from_hours(27));
                    // Just before this slot, the previous day's pass is still the one due.
                    let before = calendar.due_slot(slot - SignedDuration::from_nanos(1), &agent).unwrap();
                    prop_assert_eq!(&before.pass_id, previous_id);
                }
                previous = Some((slot, id));
                day = day.tomorrow().unwrap();
            }
        }

        /// Walking the clock forward over several days (through whatever transitions fall in
        /// them), each window-day yields exactly one pass id with one slot, the ids arrive in
        /// consecutive day order, and an id never comes back once the next one is due.
        #[test]
        fn walking_the_clock_gives_one_pass_per_window_day(
            settings in settings_strategy(),
            agent in agent_strategy(),
            start_seconds in INSTANT_SECONDS,
            steps_minutes in prop::collection::vec(1i64..=240, 40..80),
        ) {
            let calendar = MemoryPassCalendar::new(&settings).unwrap();
            let mut now = Timestamp::from_second(start_seconds).unwrap();
            let mut seen: Vec<MemoryPassSlot> = Vec::new();
            for step in steps_minutes {
                let due = calendar.due_slot(now, &agent).unwrap();
                prop_assert!(due.slot <= now);
                match seen.last() {
                    Some(last) if last.pass_id == due.pass_id => prop_assert_eq!(last, &due),
                    Some(last) => {
                        prop_assert_eq!(last.local_date.tomorrow().unwrap(), due.local_date);
                        prop_assert!(last.slot < due.slot);
                        prop_assert!(seen.iter().all(|earlier| earlier.pass_id != due.pass_id));
                        seen.push(due);
                    }
                    None => seen.push(due),
                }
                now += SignedDuration::from_mins(step);
            }
        }

        /// The zones of the spec with instants chosen right at their transitions.
        #[test]
        fn transition_days_have_one_slot(
            zone in prop::sample::select(&["America/New_York", "Europe/London", "Australia/Lord_Howe"][..]),
            agent in agent_strategy(),
            window_start_minutes in 0u16..1440,
            window_minutes in 1u16..=1440,
            year in 1990i16..2040,
            transition_index in 0usize..2,
        ) {
            let settings = MemoryPassSettings { window_start_minutes, window_minutes, timezone: zone.to_owned() };
            let calendar = MemoryPassCalendar::new(&settings).unwrap();
            let year_start = date(year, 1, 1).to_zoned_datetime(calendar.time_zone().clone()).unwrap().timestamp();
            let transition = calendar.time_zone().following(year_start).nth(transition_index).unwrap();
            let around = transition.timestamp();
            // Each window-day in the days around the transition has one slot, and at that
            // slot the due pass is that day's.
            let transition_day = calendar.time_zone().to_datetime(around).date();
            let mut day = transition_day.yesterday().unwrap().yesterday().unwrap();
            let mut previous: Option<Timestamp> = None;
            for _ in 0..5 {
                let slot = calendar.slot_on(day, &agent).unwrap();
                prop_assert_eq!(&calendar.due_slot(slot, &agent).unwrap().pass_id, &pass_id(&agent, day));
                if let Some(previous) = previous {
                    prop_assert!(previous < slot);
                }
                previous = Some(slot);
                day = day.tomorrow().unwrap();
            }
        }
    }
}
