//! The one integration-test binary of `anima-projections`: the fold tested by its features,
//! through the public API only.
//!
//! Every area reads as given/when/then: `given` events are folded at log sequences 1..n with
//! increasing log time, `when` is folded next, and its recorded verdict is rendered as text and
//! compared with a snapshot (`UPDATE_EXPECT=1 cargo test -p anima-projections` refreshes them).
//! The vocabulary of events is in [`events`]; stamping, folding and resolving requests from state
//! is in [`log`].

mod chat;
mod determinism;
mod do_not_contact;
mod events;
mod failure_notice;
mod journal;
mod linear;
mod log;
mod memory;
mod redact;
mod routing;
mod schema;
mod send_hold;
mod thread_stop;
mod wake;
mod wake_text;
