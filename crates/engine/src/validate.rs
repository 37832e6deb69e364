//! Input validation at the engine's edge: every field a client sends is checked and bounded
//! before anything is appended. Errors name the field.

use anima_projections::time::slack_ts_seconds;

use crate::command::CommandError;

/// Slack message text: 40,000 characters, at most 160,000 bytes.
pub const SLACK_TEXT_CHARS_MAX: usize = 40_000;
pub const SLACK_TEXT_BYTES_MAX: usize = 160_000;
/// Agent, worker and request ids.
pub const ID_BYTES_MAX: usize = 128;
/// Slack team, channel, user and bot ids.
pub const SLACK_ID_BYTES_MAX: usize = 64;
pub const SLACK_SUBTYPE_BYTES_MAX: usize = 64;
pub const USER_NAME_BYTES_MAX: usize = 256;
pub const FILES_PER_MESSAGE_MAX: usize = 100;
pub const FILE_NAME_BYTES_MAX: usize = 1_024;
/// Chat tenant, chat, thread, message, sender and user ids. Three of them, each escaped to at most
/// three bytes per byte, keep a chat subject within `subject::SUBJECT_BYTES_MAX`.
pub const CHAT_ID_BYTES_MAX: usize = 96;
/// Mentioned user ids listed by one chat message.
pub const CHAT_MENTIONS_MAX: usize = 64;
/// Wake item ids (message identities, escaped): a chat identity holds three escaped ids.
pub const ITEM_ID_BYTES_MAX: usize = 1_024;
/// Receiving agents named by one observation.
pub const RECEIVERS_MAX: usize = 64;
/// Linear prompt text and response bodies.
pub const LINEAR_TEXT_BYTES_MAX: usize = 160_000;
/// Linear installation ids, issue identifiers and agent activity ids.
pub const LINEAR_ID_BYTES_MAX: usize = 128;
/// Linear issue URLs.
pub const LINEAR_URL_BYTES_MAX: usize = 2_048;
/// Linear issue titles.
pub const LINEAR_TITLE_BYTES_MAX: usize = 4_096;
/// Free-text reasons (finish reasons).
pub const REASON_BYTES_MAX: usize = 4_096;

/// Longest part of a client's value a refusal message repeats, in bytes. A refusal that copied a
/// 1 MB value would itself exceed gRPC's metadata limit and reach the client as
/// `RESOURCE_EXHAUSTED` "metadata size exceeds hard limit" instead of naming the field.
pub const ECHO_BYTES_MAX: usize = 64;

/// A value quoted for a refusal message: Debug-quoted (control characters escaped), at most
/// [`ECHO_BYTES_MAX`] bytes of it (cut on a code-point boundary), and `…` when cut.
pub fn echo(value: &str) -> String {
    if value.len() <= ECHO_BYTES_MAX {
        return format!("{value:?}");
    }
    let mut end = ECHO_BYTES_MAX;
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    format!("{:?}…", &value[..end])
}

pub fn invalid(field: &'static str, reason: impl Into<String>) -> CommandError {
    CommandError::InvalidArgument { field, reason: reason.into() }
}

/// An engine id (agent, worker): 1..=128 bytes, no whitespace or control characters.
pub fn id(field: &'static str, value: &str) -> Result<(), CommandError> {
    if value.is_empty() {
        return Err(invalid(field, "must not be empty"));
    }
    if value.len() > ID_BYTES_MAX {
        return Err(invalid(field, format!("must be at most {ID_BYTES_MAX} bytes")));
    }
    if value.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(invalid(field, "must not contain whitespace or control characters"));
    }
    Ok(())
}

/// A Slack id (team, channel, user, bot): ASCII letters and digits.
pub fn slack_id(field: &'static str, value: &str, required: bool) -> Result<(), CommandError> {
    if value.is_empty() {
        return if required { Err(invalid(field, "must not be empty")) } else { Ok(()) };
    }
    if value.len() > SLACK_ID_BYTES_MAX || !value.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return Err(invalid(field, format!("must be 1..={SLACK_ID_BYTES_MAX} ASCII letters and digits")));
    }
    Ok(())
}

/// A chat platform id (tenant, chat, thread, message, sender, user): 1..=96 bytes, no whitespace
/// or control characters. Any other character is allowed: subjects encode it, surface keys
/// escape `:`.
pub fn chat_id(field: &'static str, value: &str, required: bool) -> Result<(), CommandError> {
    if value.is_empty() {
        return if required { Err(invalid(field, "must not be empty")) } else { Ok(()) };
    }
    if value.len() > CHAT_ID_BYTES_MAX {
        return Err(invalid(field, format!("must be at most {CHAT_ID_BYTES_MAX} bytes")));
    }
    if value.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(invalid(field, "must not contain whitespace or control characters"));
    }
    Ok(())
}

/// A Slack ts: `<seconds>.<6 digits>`.
pub fn slack_ts(field: &'static str, value: &str, required: bool) -> Result<(), CommandError> {
    if value.is_empty() && !required {
        return Ok(());
    }
    slack_ts_seconds(value)
        .map(|_| ())
        .ok_or_else(|| invalid(field, format!("{} is not a Slack ts like \"1700000000.000100\"", echo(value))))
}

/// Message text (Slack's bound, applied to chat text too).
pub fn slack_text(field: &'static str, value: &str) -> Result<(), CommandError> {
    if value.len() > SLACK_TEXT_BYTES_MAX || value.chars().count() > SLACK_TEXT_CHARS_MAX {
        return Err(CommandError::TooLarge {
            field,
            reason: format!(
                "{} bytes; at most {SLACK_TEXT_CHARS_MAX} characters and {SLACK_TEXT_BYTES_MAX} bytes are accepted",
                value.len()
            ),
        });
    }
    Ok(())
}

pub fn bounded(field: &'static str, value: &str, max: usize) -> Result<(), CommandError> {
    if value.len() > max {
        return Err(CommandError::TooLarge { field, reason: format!("{} bytes; at most {max}", value.len()) });
    }
    Ok(())
}

pub fn files(field: &'static str, files: &[anima_projections::proto::SlackFile]) -> Result<(), CommandError> {
    if files.len() > FILES_PER_MESSAGE_MAX {
        return Err(CommandError::TooLarge {
            field,
            reason: format!("{} files; at most {FILES_PER_MESSAGE_MAX}", files.len()),
        });
    }
    for file in files {
        bounded(field, &file.name, FILE_NAME_BYTES_MAX)?;
    }
    Ok(())
}

/// Link previews per message.
pub const PREVIEWS_PER_MESSAGE_MAX: usize = 10;
/// Bytes of a preview's URL, title and text.
pub const PREVIEW_URL_BYTES_MAX: usize = 2_048;
pub const PREVIEW_TITLE_BYTES_MAX: usize = 1_024;
pub const PREVIEW_TEXT_BYTES_MAX: usize = 16_000;

pub fn previews(field: &'static str, previews: &[anima_projections::proto::LinkPreview]) -> Result<(), CommandError> {
    if previews.len() > PREVIEWS_PER_MESSAGE_MAX {
        return Err(CommandError::TooLarge {
            field,
            reason: format!("{} link previews; at most {PREVIEWS_PER_MESSAGE_MAX}", previews.len()),
        });
    }
    for preview in previews {
        bounded(field, &preview.url, PREVIEW_URL_BYTES_MAX)?;
        bounded(field, &preview.title, PREVIEW_TITLE_BYTES_MAX)?;
        bounded(field, &preview.text, PREVIEW_TEXT_BYTES_MAX)?;
    }
    Ok(())
}

/// A Linear agent session id: a UUID in its hyphenated form (the canonical surface key).
pub fn linear_session_id(field: &'static str, value: &str) -> Result<(), CommandError> {
    match uuid::Uuid::parse_str(value) {
        Ok(parsed) if parsed.hyphenated().to_string() == value.to_ascii_lowercase() && value.len() == 36 => {
            if value.bytes().any(|b| b.is_ascii_uppercase()) {
                return Err(invalid(field, "must be a lowercase hyphenated UUID"));
            }
            Ok(())
        }
        _ => Err(invalid(field, "must be a hyphenated UUID")),
    }
}

/// Linear text (a prompt or a response body): at most 160,000 bytes.
pub fn linear_text(field: &'static str, value: &str) -> Result<(), CommandError> {
    if value.len() > LINEAR_TEXT_BYTES_MAX {
        return Err(CommandError::TooLarge {
            field,
            reason: format!("{} bytes; at most {LINEAR_TEXT_BYTES_MAX} are accepted", value.len()),
        });
    }
    Ok(())
}

/// A memory digest (`anima-wake digest`): SHA-256, so exactly this many bytes.
pub const MEMORY_DIGEST_BYTES: usize = 32;

/// An optional memory digest: empty, or exactly [`MEMORY_DIGEST_BYTES`]. Anything else is refused
/// before it reaches the log (a 900 KB "digest" would otherwise be stored in every replica).
pub fn memory_digest(field: &'static str, value: &[u8]) -> Result<(), CommandError> {
    if value.is_empty() || value.len() == MEMORY_DIGEST_BYTES {
        return Ok(());
    }
    Err(invalid(
        field,
        format!("{} bytes; a memory digest is empty or exactly {MEMORY_DIGEST_BYTES} (SHA-256)", value.len()),
    ))
}

/// An optional client request id: empty, or a UUID.
pub fn request_id(value: &str) -> Result<Option<uuid::Uuid>, CommandError> {
    request_id_named("request_id", value)
}

/// A request id in a field of another name (e.g. the `send_request_id` of a confirmation).
pub fn request_id_named(field: &'static str, value: &str) -> Result<Option<uuid::Uuid>, CommandError> {
    if value.is_empty() {
        return Ok(None);
    }
    uuid::Uuid::parse_str(value)
        .map(Some)
        .map_err(|_| invalid(field, format!("{} is not a UUID (send one, or leave it empty)", echo(value))))
}
