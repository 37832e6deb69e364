//! Calendar arithmetic for rendering log and Slack times in UTC, without a clock or a time-zone
//! database (the fold must stay pure).

/// Formats unix seconds as `YYYY-MM-DD HH:MM:SS UTC`. Always 23 bytes for years 1000..=9999.
pub fn format_utc(unix_seconds: i64) -> String {
    Utc(unix_seconds).to_string()
}

/// Unix seconds shown as [`format_utc`] shows them, written straight into a formatter (a wake's
/// size is counted on the fold's path, with no `String` built).
#[derive(Clone, Copy, Debug)]
pub struct Utc(pub i64);

impl std::fmt::Display for Utc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let days = self.0.div_euclid(86_400);
        let secs_of_day = self.0.rem_euclid(86_400);
        let (year, month, day) = civil_from_days(days);
        write!(
            f,
            "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
            secs_of_day / 3600,
            (secs_of_day / 60) % 60,
            secs_of_day % 60
        )
    }
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian calendar
/// (Howard Hinnant's algorithm).
pub fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Parses a Slack ts (`"1700000000.000100"`) into its whole seconds; `None` when malformed.
pub fn slack_ts_seconds(ts: &str) -> Option<i64> {
    let (secs, micros) = ts.split_once('.')?;
    if secs.is_empty() || secs.len() > 12 || micros.len() != 6 {
        return None;
    }
    if !secs.bytes().all(|b| b.is_ascii_digit()) || !micros.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    secs.parse().ok()
}

/// Whole seconds of a log time (unix ns, a log position's `at_ns`): the time shown for chat
/// rows, which carry none.
pub(crate) fn log_seconds(at_ns: i64) -> i64 {
    at_ns.div_euclid(1_000_000_000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_known_instants() {
        assert_eq!(format_utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(format_utc(1_700_000_000), "2023-11-14 22:13:20 UTC");
        assert_eq!(format_utc(951_782_400), "2000-02-29 00:00:00 UTC");
    }

    #[test]
    fn parses_slack_ts() {
        assert_eq!(slack_ts_seconds("1700000000.000100"), Some(1_700_000_000));
        assert_eq!(slack_ts_seconds("1700000000"), None);
        assert_eq!(slack_ts_seconds("17x0000000.000100"), None);
        assert_eq!(slack_ts_seconds(".000100"), None);
    }
}
