//! Per-surface journals: every observable message gets the next dense ordinal on its surface, in
//! log order. The fold keeps the tail, who owns the trailing run of rows, and the metadata of
//! recent rows — not the bodies. Bodies ([`RowBody`]) come from the engine's bounded cache or from
//! the log by sequence when something is rendered.

use serde::{Deserialize, Serialize};

use crate::intern::SurfaceKey;
pub use crate::row::{RowBody, RowMeta};
use crate::surface::SurfaceId;

/// Metadata of recent rows kept per surface. Held notices and wake texts show at most
/// [`crate::text::ROWS_SHOWN_MAX`] rows, so a window of this size always holds the rows they
/// can show; older metadata is dropped to bound memory per surface.
pub const RECENT_ROWS_MAX: usize = 64;

/// One surface's journal: its tail and who wrote its trailing run. Its rows are the state's
/// `journal_rows` table, one checkpoint entry per row, so a new row writes one small entry; the
/// rows of an idle surface may leave memory (see [`crate::cold`]), this header never does.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SurfaceJournal {
    /// Ordinal of the newest row (0: empty).
    pub tail: u64,
    /// The agent that wrote the trailing run of rows, if one did; with `trailing_run_start` this
    /// answers "the newest row not written by agent A" exactly, whatever the window holds.
    pub trailing_owner: Option<crate::surface::Id>,
    pub trailing_run_start: u64,
}

/// The rows a decision needed were no longer in the window: fail closed.
#[derive(Debug, PartialEq, Eq)]
pub struct RowsMissing {
    pub ordinal: u64,
}

impl SurfaceJournal {
    /// Takes the next row into the header; `meta.ordinal` must be `tail + 1`.
    fn push(&mut self, meta: &RowMeta) {
        debug_assert_eq!(meta.ordinal, self.tail + 1);
        self.tail = meta.ordinal;
        if meta.owner.is_none() || meta.owner != self.trailing_owner {
            self.trailing_owner = meta.owner.clone();
            self.trailing_run_start = meta.ordinal;
        }
    }

    /// Ordinal of the newest row `agent` did not write (0: none).
    pub fn last_foreign_ordinal(&self, agent: &str) -> u64 {
        if self.tail > 0 && self.trailing_owner.as_deref() == Some(agent) {
            self.trailing_run_start - 1
        } else {
            self.tail
        }
    }

    /// The oldest ordinal of the window of kept rows (`tail + 1` when empty).
    pub fn window_first(&self) -> u64 {
        if self.tail == 0 {
            1
        } else {
            self.tail.saturating_sub(RECENT_ROWS_MAX as u64 - 1).max(1)
        }
    }
}

/// Checkpoint tag of `State::journal_rows`.
pub(crate) const JOURNAL_ROWS_TAG: u8 = 26;
/// Checkpoint tag of `State::journals`.
pub(crate) const JOURNALS_TAG: u8 = 42;

impl crate::State {
    /// The journal header of `surface`: borrowed from memory, or else read from the store
    /// without keeping it.
    pub fn journal_by_key(&self, surface: SurfaceKey) -> Option<std::borrow::Cow<'_, SurfaceJournal>> {
        self.journals.get_or_read(JOURNALS_TAG, &surface, &self.cold)
    }

    /// The newest row of `surface` (0: none), its header brought into memory first.
    pub(crate) fn journal_tail(&mut self, surface: SurfaceKey) -> u64 {
        self.journals.ensure(JOURNALS_TAG, &surface, &self.cold);
        self.journals.get(&surface).map_or(0, |journal| journal.tail)
    }

    /// The first and last ordinal of the window of `surface` ((1, 0) when it has no row).
    pub(crate) fn journal_window(&self, surface: SurfaceKey) -> (u64, u64) {
        self.journal_by_key(surface).map_or((1, 0), |journal| (journal.window_first(), journal.tail))
    }

    /// Appends the next row of `surface`, forgetting the one that leaves the window.
    pub(crate) fn push_row(&mut self, surface: SurfaceKey, row: RowMeta) {
        self.journals.entry_or_default(JOURNALS_TAG, &surface, &self.cold).push(&row);
        let ordinal = row.ordinal;
        self.journal_rows.insert((surface, ordinal), row);
        if ordinal > RECENT_ROWS_MAX as u64 {
            self.journal_rows.forget((surface, ordinal - RECENT_ROWS_MAX as u64));
        }
    }

    /// Brings the window's rows of `surface` after `cursor` into memory (see [`crate::cold`]);
    /// a decision that reads rows calls this first.
    pub(crate) fn ensure_rows_after(&mut self, surface: SurfaceKey, cursor: u64) {
        self.journals.ensure(JOURNALS_TAG, &surface, &self.cold);
        let (first, tail) = self.journal_window(surface);
        let first = first.max(cursor + 1);
        if first > tail {
            return;
        }
        // The rows of a surface share their checkpoint-key prefix (tag, surface): one scan.
        let prefix = crate::state::tagged(JOURNAL_ROWS_TAG, &surface);
        self.journal_rows.ensure_by_scan(&prefix, (first..=tail).map(|ordinal| (surface, ordinal)), &self.cold);
    }

    /// Row `ordinal` of `surface` if it is in the window (ensured, or a complete state).
    pub fn journal_row(&self, surface: SurfaceKey, ordinal: u64) -> Option<&RowMeta> {
        let (first, tail) = self.journal_window(surface);
        if ordinal < first || ordinal > tail {
            return None;
        }
        self.journal_rows.get(&(surface, ordinal))
    }

    /// The window's rows of `surface` after `cursor`, newest first (ensured, or a complete state).
    pub fn newest_rows_after(&self, surface: SurfaceKey, cursor: u64) -> impl Iterator<Item = &RowMeta> {
        // The window is read once: every ordinal of the range is in it.
        let (first, tail) = self.journal_window(surface);
        (first.max(cursor.saturating_add(1))..=tail)
            .rev()
            .filter_map(move |ordinal| self.journal_rows.get(&(surface, ordinal)))
    }

    /// The window's rows of `surface`, oldest first, for tools reading a complete state (a
    /// replay); rows that left memory are read from the store.
    pub fn recent_rows(&self, surface: &SurfaceId) -> Vec<RowMeta> {
        let Some(key) = self.surface_key(surface) else { return Vec::new() };
        let (first, tail) = self.journal_window(key);
        (first..=tail)
            .filter_map(|ordinal| match self.journal_rows.is_complete() {
                true => self.journal_rows.get(&(key, ordinal)).cloned(),
                false => self.journal_rows.read_through(JOURNAL_ROWS_TAG, &(key, ordinal), &self.cold),
            })
            .collect()
    }
}

/// A row's metadata with the byte sizes rendering will give it (measured once, at ingest).
#[allow(clippy::too_many_arguments)]
pub(crate) fn row_meta(
    at: crate::state::LogPosition,
    ordinal: u64,
    ts: &str,
    ts_seconds: i64,
    user_id: &str,
    bot_id: &str,
    owner: Option<crate::surface::Id>,
    body: crate::row::BodyRef<'_>,
) -> RowMeta {
    let mut meta = RowMeta {
        ordinal,
        seq: at.seq,
        at_ns: at.at_ns,
        ts: ts.into(),
        ts_seconds,
        user_id: user_id.into(),
        bot_id: bot_id.into(),
        owner,
        row_bytes: 0,
        sender_bytes: 0,
        body_bytes: 0,
    };
    let sizes = crate::text::row_sizes(&meta, body);
    meta.row_bytes = u32_saturating(sizes.row_bytes);
    meta.sender_bytes = u32_saturating(sizes.sender_bytes);
    meta.body_bytes = u32_saturating(sizes.body_bytes);
    meta
}

fn u32_saturating(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(ordinal: u64, owner: Option<&str>) -> RowMeta {
        RowMeta {
            ordinal,
            seq: ordinal,
            at_ns: 0,
            ts: crate::surface::Id::default(),
            ts_seconds: 0,
            user_id: crate::surface::Id::default(),
            bot_id: crate::surface::Id::default(),
            owner: owner.map(Into::into),
            row_bytes: 10,
            sender_bytes: 1,
            body_bytes: 1,
        }
    }

    #[test]
    fn last_foreign_follows_the_trailing_run() {
        let mut state = crate::State::new();
        let surface =
            state.intern_surface(&SurfaceId::Slack { team: "T1".into(), channel: "C1".into(), thread_ts: None });
        let journal = |state: &crate::State| state.journal_by_key(surface).map(|j| j.into_owned()).unwrap_or_default();
        assert_eq!(journal(&state).last_foreign_ordinal("a"), 0);
        state.push_row(surface, row(1, Some("a")));
        assert_eq!(journal(&state).last_foreign_ordinal("a"), 0);
        assert_eq!(journal(&state).last_foreign_ordinal("b"), 1);
        state.push_row(surface, row(2, None));
        state.push_row(surface, row(3, Some("a")));
        state.push_row(surface, row(4, Some("a")));
        assert_eq!(journal(&state).last_foreign_ordinal("a"), 2);
        state.push_row(surface, row(5, Some("b")));
        assert_eq!(journal(&state).last_foreign_ordinal("a"), 5);
        assert_eq!(journal(&state).last_foreign_ordinal("b"), 4);
        for n in 6..200 {
            state.push_row(surface, row(n, None));
        }
        assert_eq!(state.journal_rows.resident_len(), RECENT_ROWS_MAX, "rows beyond the window are forgotten");
        assert!(state.journal_row(surface, 5).is_none());
        assert_eq!(state.journal_row(surface, 199).map(|r| r.ordinal), Some(199));
        assert_eq!(state.newest_rows_after(surface, 197).map(|r| r.ordinal).collect::<Vec<_>>(), vec![199, 198]);
    }
}
