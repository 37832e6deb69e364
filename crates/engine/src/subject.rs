//! Subject encoding: every event is stored on a hierarchical subject
//! `anima.v1.<family>.<token>...`, used for filtered replay of one surface or agent and for
//! JetStream's per-subject index.
//!
//! Every token that comes from outside (team, channel, thread ts, session, agent id) goes through
//! [`encode_token`], an injective encoding whose output can never contain `.`, `*`, `>`,
//! whitespace or be empty — so nothing a user controls can split a token, act as a wildcard in a
//! filter, or make two different surfaces share a subject. Builders here are the only place that
//! assembles subjects; [`check_subject`] is what the log checks before storing.

use std::fmt::Write as _;

/// The configuration family: configuration applied at start-up.
pub const CONFIG_SUBJECT: &str = "anima.v1.config";

/// Filter matching every subject the engine writes; the JetStream stream captures exactly this.
pub const ALL_SUBJECTS: &str = "anima.v1.>";

/// Longest subject [`check_subject`] accepts, in bytes. Real subjects are a few dozen bytes;
/// the bound keeps a hostile id from producing multi-kilobyte subjects in every index.
pub const SUBJECT_BYTES_MAX: usize = 1024;

/// The token [`encode_token`] gives the empty string. A non-empty input never encodes to a lone
/// `_`, because `_` is always escaped and every escape is three characters long.
const EMPTY_TOKEN: &str = "_";

/// Why a literal subject was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubjectError {
    /// The subject is the empty string. Build subjects with the builders in this module.
    #[error("subject is empty")]
    Empty,
    /// The subject is longer than [`SUBJECT_BYTES_MAX`]. An id that long is not a real id:
    /// refuse the input.
    #[error("subject is {bytes} bytes long, more than {SUBJECT_BYTES_MAX}")]
    TooLong { bytes: usize },
    /// Two dots in a row, or a leading or trailing dot. A token built from outside input was not
    /// encoded: encode it with [`encode_token`].
    #[error("subject token {index} is empty")]
    EmptyToken { index: usize },
    /// A wildcard (`*`, `>`), whitespace or a control character inside a literal subject. A token
    /// built from outside input was not encoded: encode it with [`encode_token`].
    #[error("subject token {index} contains forbidden character {character:?}")]
    ForbiddenCharacter { index: usize, character: char },
}

/// Whether `byte` is kept as it is by [`encode_token`].
fn is_kept_literally(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || byte == b'-'
}

/// Encodes one token of outside input injectively: `[A-Za-z0-9-]` are kept, every other UTF-8
/// byte (including `_` itself) becomes `_XX` with uppercase hex, and the empty string becomes `_`.
///
/// The result is never empty and never contains `.`, `*`, `>` or whitespace, so it is always one
/// literal subject token. Distinct inputs give distinct tokens: `_` only ever starts a
/// three-character escape, except in the lone `_` that stands for the empty string.
pub fn encode_token(raw: &str) -> String {
    if raw.is_empty() {
        return EMPTY_TOKEN.to_owned();
    }
    let mut token = String::with_capacity(raw.len());
    for &byte in raw.as_bytes() {
        if is_kept_literally(byte) {
            token.push(char::from(byte));
        } else {
            // Writing into a String cannot fail.
            let _ = write!(token, "_{byte:02X}");
        }
    }
    token
}

/// Inverse of [`encode_token`]: `Some(raw)` exactly when `encode_token(raw) == token`.
///
/// Anything `encode_token` cannot produce is `None`: an empty token, a character outside
/// `[A-Za-z0-9_-]`, a truncated or lowercase escape, an escape of a byte that would have been
/// kept literally (`_41` for `A`), or escapes that do not form valid UTF-8.
pub fn decode_token(token: &str) -> Option<String> {
    if token.is_empty() {
        return None;
    }
    if token == EMPTY_TOKEN {
        return Some(String::new());
    }
    let bytes = token.as_bytes();
    let mut raw = Vec::with_capacity(bytes.len());
    let mut position = 0;
    while position < bytes.len() {
        let byte = bytes[position];
        if is_kept_literally(byte) {
            raw.push(byte);
            position += 1;
        } else if byte == b'_' {
            let high = upper_hex_value(*bytes.get(position + 1)?)?;
            let low = upper_hex_value(*bytes.get(position + 2)?)?;
            let escaped = (high << 4) | low;
            if is_kept_literally(escaped) {
                return None;
            }
            raw.push(escaped);
            position += 3;
        } else {
            return None;
        }
    }
    String::from_utf8(raw).ok()
}

/// Value of one uppercase hex digit, as `encode_token` writes them.
fn upper_hex_value(digit: u8) -> Option<u8> {
    match digit {
        b'0'..=b'9' => Some(digit - b'0'),
        b'A'..=b'F' => Some(digit - b'A' + 10),
        _ => None,
    }
}

/// Checks a literal subject (not a filter): non-empty, at most [`SUBJECT_BYTES_MAX`] bytes,
/// non-empty dot-separated tokens, no wildcard, whitespace or control character anywhere.
pub fn check_subject(subject: &str) -> Result<(), SubjectError> {
    if subject.is_empty() {
        return Err(SubjectError::Empty);
    }
    if subject.len() > SUBJECT_BYTES_MAX {
        return Err(SubjectError::TooLong { bytes: subject.len() });
    }
    for (index, token) in subject.split('.').enumerate() {
        if token.is_empty() {
            return Err(SubjectError::EmptyToken { index });
        }
        if let Some(character) = token.chars().find(|c| matches!(c, '*' | '>') || c.is_whitespace() || c.is_control()) {
            return Err(SubjectError::ForbiddenCharacter { index, character });
        }
    }
    Ok(())
}

/// Subject of one Slack surface: a channel's top level or DM main timeline,
/// `anima.v1.surface.slack.<team>.<channel>`, or one thread,
/// `anima.v1.surface.slack.<team>.<channel>.thread.<thread_ts>`. Every id is encoded.
pub fn slack_surface_subject(team: &str, channel: &str, thread_ts: Option<&str>) -> String {
    let mut subject = format!("anima.v1.surface.slack.{}.{}", encode_token(team), encode_token(channel));
    if let Some(thread_ts) = thread_ts {
        subject.push_str(".thread.");
        subject.push_str(&encode_token(thread_ts));
    }
    subject
}

/// Subject of one chat surface: a chat's top level,
/// `anima.v1.surface.chat.<tenant>.<chat>`, or one thread,
/// `anima.v1.surface.chat.<tenant>.<chat>.thread.<thread>`. Every id is encoded.
pub fn chat_surface_subject(tenant: &str, chat: &str, thread: Option<&str>) -> String {
    let mut subject = format!("anima.v1.surface.chat.{}.{}", encode_token(tenant), encode_token(chat));
    if let Some(thread) = thread {
        subject.push_str(".thread.");
        subject.push_str(&encode_token(thread));
    }
    subject
}

/// Subject of one Linear agent session: `anima.v1.linear.<session>`, the session id encoded.
pub fn linear_session_subject(session: &str) -> String {
    format!("anima.v1.linear.{}", encode_token(session))
}

/// Subject of one agent's own events (wake lifecycle, subscriptions, memory-pass outcomes,
/// registration): `anima.v1.agent.<agent>`, the agent id encoded.
pub fn agent_subject(agent: &str) -> String {
    format!("anima.v1.agent.{}", encode_token(agent))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn keeps_safe_characters_and_escapes_the_rest() {
        assert_eq!(encode_token("T024BE7LD"), "T024BE7LD");
        assert_eq!(encode_token("a-b"), "a-b");
        assert_eq!(encode_token("1712345678.123456"), "1712345678_2E123456");
        assert_eq!(encode_token("a_b"), "a_5Fb");
        assert_eq!(encode_token("a b*>"), "a_20b_2A_3E");
        assert_eq!(encode_token("é"), "_C3_A9");
        assert_eq!(encode_token(""), "_");
        assert_eq!(encode_token("_"), "_5F");
    }

    #[test]
    fn decode_refuses_what_encode_cannot_produce() {
        for token in ["", "a.b", "_2", "_2e", "_41", "_G0", "a b", "__", "_C3", "x*"] {
            assert_eq!(decode_token(token), None, "token {token:?}");
        }
        assert_eq!(decode_token("_"), Some(String::new()));
        assert_eq!(decode_token("_C3_A9").as_deref(), Some("é"));
    }

    #[test]
    fn check_subject_names_the_problem() {
        assert_eq!(check_subject("anima.v1.config"), Ok(()));
        assert_eq!(check_subject(""), Err(SubjectError::Empty));
        assert_eq!(check_subject("anima..v1"), Err(SubjectError::EmptyToken { index: 1 }));
        assert_eq!(check_subject("anima.v1."), Err(SubjectError::EmptyToken { index: 2 }));
        assert_eq!(check_subject("anima.v1.*"), Err(SubjectError::ForbiddenCharacter { index: 2, character: '*' }));
        assert_eq!(check_subject("anima.v1.a>"), Err(SubjectError::ForbiddenCharacter { index: 2, character: '>' }));
        assert_eq!(check_subject("anima.v1.a b"), Err(SubjectError::ForbiddenCharacter { index: 2, character: ' ' }));
        let long = format!("anima.v1.{}", "a".repeat(SUBJECT_BYTES_MAX));
        assert!(matches!(check_subject(&long), Err(SubjectError::TooLong { .. })));
    }

    #[test]
    fn builders_give_the_documented_shapes() {
        assert_eq!(slack_surface_subject("T1", "C1", None), "anima.v1.surface.slack.T1.C1");
        assert_eq!(
            slack_surface_subject("T1", "C1", Some("1712345678.123456")),
            "anima.v1.surface.slack.T1.C1.thread.1712345678_2E123456"
        );
        assert_eq!(agent_subject("agent.one"), "anima.v1.agent.agent_2Eone");
        assert_eq!(chat_surface_subject("t1", "oc_1", None), "anima.v1.surface.chat.t1.oc_5F1");
        assert_eq!(
            chat_surface_subject("t1", "!room:matrix.org", Some("$ev.1")),
            "anima.v1.surface.chat.t1._21room_3Amatrix_2Eorg.thread._24ev_2E1"
        );
        // The longest chat ids the engine accepts, all escaped, still fit a subject.
        let long = "%".repeat(crate::validate::CHAT_ID_BYTES_MAX);
        assert_eq!(check_subject(&chat_surface_subject(&long, &long, Some(&long))), Ok(()));
        assert_eq!(check_subject(CONFIG_SUBJECT), Ok(()));
        assert!(crate::log::SubjectFilter(ALL_SUBJECTS.into()).matches(&agent_subject("a")));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn encoded_tokens_are_single_literal_tokens(raw in any::<String>()) {
            let token = encode_token(&raw);
            prop_assert!(!token.is_empty());
            prop_assert!(!token.contains(['.', '*', '>']));
            prop_assert!(!token.chars().any(char::is_whitespace));
            prop_assert!(token.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'));
        }

        #[test]
        fn decode_inverts_encode(raw in any::<String>()) {
            prop_assert_eq!(decode_token(&encode_token(&raw)), Some(raw));
        }

        #[test]
        fn distinct_inputs_give_distinct_tokens(left in any::<String>(), right in any::<String>()) {
            prop_assume!(left != right);
            prop_assert_ne!(encode_token(&left), encode_token(&right));
        }

        #[test]
        fn near_collisions_stay_distinct(
            prefix in "[a-z_.]{0,4}",
            suffix in "[A-F0-9_]{0,4}",
        ) {
            // Inputs that look like escapes are the ones an encoding bug would confuse.
            let raw = format!("{prefix}{suffix}");
            let token = encode_token(&raw);
            prop_assert_eq!(decode_token(&token), Some(raw.clone()));
            prop_assert_ne!(token, encode_token(&format!("{raw}_")));
        }

        #[test]
        fn decoded_tokens_reencode_to_themselves(token in "[A-Za-z0-9_-]{0,12}") {
            if let Some(raw) = decode_token(&token) {
                prop_assert_eq!(encode_token(&raw), token);
            }
        }

        /// Ids up to 24 characters of any Unicode: real Slack and agent ids are far shorter, and
        /// longer ones can exceed `SUBJECT_BYTES_MAX` once escaped (refused at append).
        #[test]
        fn builder_output_passes_check_subject(
            team in "(?s).{0,24}",
            channel in "(?s).{0,24}",
            thread_ts in proptest::option::of("(?s).{0,24}"),
            agent in "(?s).{0,24}",
        ) {
            let surface = slack_surface_subject(&team, &channel, thread_ts.as_deref());
            prop_assert_eq!(check_subject(&surface), Ok(()));
            prop_assert_eq!(surface.split('.').count(), if thread_ts.is_some() { 8 } else { 6 });
            let chat = chat_surface_subject(&team, &channel, thread_ts.as_deref());
            prop_assert_eq!(check_subject(&chat), Ok(()));
            prop_assert_eq!(chat.split('.').count(), if thread_ts.is_some() { 8 } else { 6 });
            let agent = agent_subject(&agent);
            prop_assert_eq!(check_subject(&agent), Ok(()));
            prop_assert_eq!(agent.split('.').count(), 4);
        }
    }
}
