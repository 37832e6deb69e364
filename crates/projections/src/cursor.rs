//! Cursors: per (agent, surface), absent or present@N (rows 1..=N delivered).
//!
//! Every move of a cursor goes through [`State::advance_cursor`], the one home of the rule:
//! never backwards, never beyond the surface's tail. An absent cursor may become present at any
//! ordinal up to the tail; on an empty surface that leaves absent → present@0 as the only move
//! (a channel wake's response thread is established that way). Inbound messages never move a
//! cursor; only an accepted start and a decided send do. A move the rule forbids is an error the
//! caller turns into a fail-closed refusal, never an allow.

use serde::{Deserialize, Serialize};

use crate::intern::SurfaceKey;
use crate::state::{AgentSurface, State};
use crate::surface::SurfaceId;

/// One cursor move: where it was and where it is now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CursorAdvance {
    pub before: Option<u64>,
    pub after: u64,
    /// The surface's tail when it moved.
    pub tail: u64,
}

/// A move the cursor rule forbids. Nothing moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CursorRuleBroken {
    #[error("the cursor at {before} cannot move back to {to}")]
    Backwards { before: u64, to: u64 },
    #[error("the cursor cannot move to {to}, beyond the tail {tail}")]
    BeyondTail { to: u64, tail: u64 },
}

impl State {
    /// Whether the cursor of `key` may move to `to`, and the move it would be. Moves nothing:
    /// a decision that moves several cursors checks them all before it moves any.
    pub(crate) fn check_cursor_advance(
        &self,
        agent: &str,
        surface: &SurfaceId,
        to: u64,
    ) -> Result<CursorAdvance, CursorRuleBroken> {
        let before = self.cursor(agent, surface);
        let tail = self.journal(surface).map_or(0, |journal| journal.tail);
        rule(before, tail, to)
    }

    /// Brings the key of `surface`, the agent's cursor on it and its journal header into memory,
    /// for a fold path that reads them more than once (a send's check, a claim's plan): they
    /// are then read from memory, not from the store each time. The surface's key, if it has one.
    pub(crate) fn ensure_surface_state(&mut self, agent: &str, surface: &SurfaceId) -> Option<SurfaceKey> {
        let key = self.ensure_surface_key(surface)?;
        if let Some(agent) = self.agent_keys.key(agent) {
            self.cursors.ensure(crate::state::CURSORS_TAG, &(key, agent), &self.cold);
        }
        self.journals.ensure(crate::journal::JOURNALS_TAG, &key, &self.cold);
        Some(key)
    }

    /// Moves the cursor of `key` to `to` if the rule allows it; the only place a cursor changes.
    pub(crate) fn advance_cursor(&mut self, key: AgentSurface, to: u64) -> Result<CursorAdvance, CursorRuleBroken> {
        let (agent, surface) = key;
        self.cursors.ensure(crate::state::CURSORS_TAG, &(surface, agent), &self.cold);
        let before = self.cursor_by_key(agent, surface);
        let tail = self.journal_tail(surface);
        let advance = rule(before, tail, to)?;
        debug_assert!(advance.before.is_none_or(|before| before <= advance.after), "a cursor never moves back");
        debug_assert!(advance.after <= advance.tail, "a cursor never passes the tail");
        debug_assert!(advance.tail > 0 || advance.after == 0, "on an empty surface a cursor can only be present@0");
        if advance.before != Some(advance.after) {
            self.cursors.insert((surface, agent), advance.after);
        }
        debug_assert_eq!(self.cursor_by_key(agent, surface), Some(advance.after));
        Ok(advance)
    }
}

/// The rule itself: a cursor at `before` on a surface whose tail is `tail` may move to `to`.
fn rule(before: Option<u64>, tail: u64, to: u64) -> Result<CursorAdvance, CursorRuleBroken> {
    if to > tail {
        return Err(CursorRuleBroken::BeyondTail { to, tail });
    }
    if let Some(before) = before.filter(|before| to < *before) {
        return Err(CursorRuleBroken::Backwards { before, to });
    }
    Ok(CursorAdvance { before, after: to, tail })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_moves_forward_up_to_the_tail_and_never_back() {
        assert_eq!(rule(None, 0, 0), Ok(CursorAdvance { before: None, after: 0, tail: 0 }));
        assert_eq!(rule(None, 0, 1), Err(CursorRuleBroken::BeyondTail { to: 1, tail: 0 }));
        assert_eq!(rule(None, 5, 3), Ok(CursorAdvance { before: None, after: 3, tail: 5 }));
        assert_eq!(rule(Some(3), 5, 3), Ok(CursorAdvance { before: Some(3), after: 3, tail: 5 }));
        assert_eq!(rule(Some(3), 5, 5), Ok(CursorAdvance { before: Some(3), after: 5, tail: 5 }));
        assert_eq!(rule(Some(3), 5, 2), Err(CursorRuleBroken::Backwards { before: 3, to: 2 }));
        assert_eq!(rule(Some(3), 5, 6), Err(CursorRuleBroken::BeyondTail { to: 6, tail: 5 }));
    }
}
