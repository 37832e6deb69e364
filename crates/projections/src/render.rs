//! The wake text an agent is shown, assembled from the areas' types (the claimed wake, its item,
//! a Linear session or a memory pass) with the blocks of [`crate::text`]. Above the areas: no
//! area imports it; the fold sized every block with `text` when it decided what the wake shows.
//! The held notice is written from plain values and sits in `text` whole
//! ([`crate::text::render_held_notice`]).

use crate::row::{RowBody, RowMeta};
use crate::text::{
    put_fenced_text, put_field, put_files, put_notes, put_previews, put_row, put_sender, put_text, put_wake_head,
    put_wake_latest_header, put_wake_tail, Extras, Sink,
};
use crate::time::Utc;

/// The trigger's extras after its text, in the order notes, previews, files, as far as `extras`
/// keeps them.
fn put_extras(out: &mut impl Sink, item: &crate::wake::WakeItem, body: &RowBody, extras: Extras) {
    if extras.note {
        put_notes(out, item.note.as_ref());
    }
    put_previews(out, &body.previews, extras.previews);
    if extras.files && !body.files.is_empty() {
        out.put("=== files ===\n");
        put_files(out, &body.files);
    }
}

/// A Linear wake: the session and prompt fields, the log time, the issue link, the
/// prompt fenced like all content (only the new one on `prompted`), and the exact reply target.
/// The body's `user_name` holds the issue title. The item id is not shown: the session and
/// activity ids are, as fields.
fn put_linear_wake(
    out: &mut impl Sink,
    item: &crate::wake::WakeItem,
    linear: &crate::wake::LinearWake,
    body: &RowBody,
) {
    out.put("=== anima wake ===\n");
    if item.resume_after_restart {
        out.put("[anima] A runtime restart interrupted your previous turn on this wake. Continue that task; do not repeat external side effects that already happened (check what you already answered in this session).\n");
    }
    out.put("=== linear session ===\n");
    out.put_fmt(format_args!("reason: {}\n", item.reason.as_str()));
    put_field(out, "event", linear.kind.as_str());
    put_field(out, "session_id", &linear.session_id);
    if !linear.agent_activity_id.is_empty() {
        put_field(out, "agent_activity_id", &linear.agent_activity_id);
    }
    out.put_fmt(format_args!("time: {}\n", Utc(item.trigger.ts_seconds)));
    put_field(out, "issue", if linear.issue_identifier.is_empty() { "-" } else { &linear.issue_identifier });
    put_field(out, "issue_url", if linear.issue_url.is_empty() { "-" } else { &linear.issue_url });
    if !body.user_name.trim().is_empty() {
        out.put("issue_title:\n");
        put_fenced_text(out, &body.user_name);
    }
    out.put(match linear.kind {
        crate::surface::LinearReceiptKind::Created => "=== prompt ===\n",
        crate::surface::LinearReceiptKind::Prompted => "=== new prompt ===\n",
    });
    if body.text.trim().is_empty() {
        out.put("(no prompt text)\n");
    } else {
        put_fenced_text(out, &body.text);
    }
    put_wake_tail(out, &item.reply_to);
}

/// A memory pass: when it runs, the slot it was scheduled for in the configured
/// zone, and what it is for — the maintenance form, or the consolidation form when the claim
/// reported a `MEMORY.md` above the threshold. No content of any conversation appears here.
pub fn put_memory_wake(
    out: &mut impl Sink,
    item: &crate::wake::WakeItem,
    memory: &crate::memory::MemoryWake,
    memory_md_bytes: u64,
    consolidation_threshold_bytes: u64,
) {
    out.put("[anima] memory pass\n");
    if item.resume_after_restart {
        out.put(
            "[anima] A runtime restart interrupted this memory pass. Continue it from the files as they are now.\n",
        );
    }
    out.put("=== latest wake ===\n");
    out.put("reason: memory\n");
    out.put_fmt(format_args!("time: {}\n", Utc(item.trigger.ts_seconds)));
    out.put_fmt(format_args!(
        "scheduled: {} ({})\n",
        Utc(memory.slot_at_ns.div_euclid(1_000_000_000)),
        memory.slot_label
    ));
    out.put_fmt(format_args!("window_day: {}\n", memory.window_day));
    let consolidate = memory_md_bytes > consolidation_threshold_bytes;
    if consolidate {
        out.put_fmt(format_args!(
            "form: consolidation (MEMORY.md is {memory_md_bytes} bytes, above {consolidation_threshold_bytes})\n"
        ));
        out.put("This is your daily memory pass. MEMORY.md has grown past the size it is meant to stay under: this pass is for consolidating it, so that what matters is short enough to be read on every wake, with details moved into notes/ and what no longer holds removed.\n");
    } else {
        out.put("form: maintenance\n");
        out.put("This is your daily memory pass. It is for bringing MEMORY.md and notes/ up to date with what happened since the last pass, so that your next wakes start from an accurate picture. Nothing is waiting for an answer.\n");
    }
    out.put("=== reply ===\n");
    out.put("reply_to: none (a memory pass answers nobody); finish it with the digests of MEMORY.md and notes/ taken before and after\n");
}

/// Renders a claimed wake from the fold's verdict and the bodies of its rows.
pub fn render_wake_text(
    reader: &str,
    claimed: &crate::verdict::ClaimedWake,
    trigger_body: &RowBody,
    rows: &[(&RowMeta, &RowBody)],
) -> String {
    let item = &claimed.item;
    let mut out = String::new();
    if let Some(memory) = &item.memory {
        put_memory_wake(&mut out, item, memory, claimed.memory_md_bytes, claimed.consolidation_threshold_bytes);
        return out;
    }
    if let Some(linear) = &item.linear {
        put_linear_wake(&mut out, item, linear, trigger_body);
        return out;
    }
    put_wake_head(&mut out, claimed.not_shown, item.resume_after_restart);
    if rows.is_empty() && claimed.not_shown == 0 {
        out.put("(nothing else is new)\n");
    }
    for (meta, body) in rows {
        put_row(&mut out, meta, body, Some(reader));
    }
    put_wake_latest_header(&mut out, &item.frame());
    put_sender(&mut out, &item.trigger, &trigger_body.user_name, Some(reader));
    out.put("\n");
    put_text(&mut out, trigger_body);
    put_extras(&mut out, item, trigger_body, claimed.extras);
    put_wake_tail(&mut out, &item.reply_to);
    out
}
