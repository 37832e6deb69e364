//! Subjects: every event is stored on a hierarchical subject `<prefix>.<family>.<token>...`
//! (`anima.v1.agent.ada`), used for filtered replay of one surface or agent and for JetStream's
//! per-subject index.
//!
//! A [`Subjects`] value is the only thing that assembles subjects. It carries the deployment's
//! [`SubjectPrefix`] (configurable, so several deployments can share one NATS account) and the
//! [`SubjectEncoding`] of the log it writes to. Each log records its encoding when it is created
//! (JetStream stream metadata, the embedded log's metadata), and a log without that record was
//! written with the first encoding: every instance on one log therefore builds the same subject
//! for the same surface, whatever build created the log.
//!
//! Every token that comes from outside (team, channel, thread ts, session, agent id) is encoded
//! injectively, and its output can never contain `.`, `*`, `>`, whitespace or be empty — so
//! nothing a user controls can split a token, act as a wildcard in a filter, or make two
//! different surfaces share a subject. [`check_subject`] is what the log checks before storing.

use std::fmt::Write as _;

use anima_projections::surface::SurfaceId;

/// The prefix when none is configured: what every log before the prefix became configurable used.
pub const SUBJECT_PREFIX_DEFAULT: &str = "anima.v1";

/// Most tokens a prefix may have. Two are usual (`anima.v1`), a few more name an environment
/// (`acme.prod.anima.v1`); more only lengthen every subject in every index.
pub const SUBJECT_PREFIX_TOKENS_MAX: usize = 8;

/// Longest prefix, in bytes. With it, the longest subject the engine builds (a chat thread of
/// three fully escaped 96-byte ids) still fits [`SUBJECT_BYTES_MAX`].
pub const SUBJECT_PREFIX_BYTES_MAX: usize = 64;

/// Longest subject [`check_subject`] accepts, in bytes. Real subjects are a few dozen bytes;
/// the bound keeps a hostile id from producing multi-kilobyte subjects in every index.
pub const SUBJECT_BYTES_MAX: usize = 1024;

/// Why a configured subject prefix was refused. The caller names the setting it came from.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubjectPrefixError {
    #[error("must not be empty (the default is {SUBJECT_PREFIX_DEFAULT})")]
    Empty,
    #[error("is {bytes} bytes long; at most {SUBJECT_PREFIX_BYTES_MAX}")]
    TooLong { bytes: usize },
    #[error("has {tokens} dot-separated tokens; at most {SUBJECT_PREFIX_TOKENS_MAX}")]
    TooManyTokens { tokens: usize },
    #[error("token {index} is empty (a leading, trailing or doubled dot)")]
    EmptyToken { index: usize },
    #[error(
        "token {index} contains {character:?}; a prefix token holds only ASCII letters, digits, '-' and '_' \
         (no wildcards, no whitespace)"
    )]
    ForbiddenCharacter { index: usize, character: char },
}

/// The first tokens of every subject of one deployment, e.g. `anima.v1` or `acme.anima.v1`.
///
/// Tokens hold only `[A-Za-z0-9_-]`: the characters NATS recommends for subject names. That
/// excludes wildcards and separators, a leading `$` (NATS reserves `$JS`, `$SYS`, ... for
/// itself) and anything a shell or a NATS permission file would need quoted.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SubjectPrefix(String);

impl SubjectPrefix {
    /// Checks a configured prefix: 1..=[`SUBJECT_PREFIX_TOKENS_MAX`] tokens of `[A-Za-z0-9_-]`,
    /// at most [`SUBJECT_PREFIX_BYTES_MAX`] bytes.
    pub fn new(prefix: &str) -> Result<SubjectPrefix, SubjectPrefixError> {
        if prefix.is_empty() {
            return Err(SubjectPrefixError::Empty);
        }
        if prefix.len() > SUBJECT_PREFIX_BYTES_MAX {
            return Err(SubjectPrefixError::TooLong { bytes: prefix.len() });
        }
        let tokens = prefix.split('.').count();
        if tokens > SUBJECT_PREFIX_TOKENS_MAX {
            return Err(SubjectPrefixError::TooManyTokens { tokens });
        }
        for (index, token) in prefix.split('.').enumerate() {
            if token.is_empty() {
                return Err(SubjectPrefixError::EmptyToken { index });
            }
            if let Some(character) = token.chars().find(|&c| !(c.is_ascii_alphanumeric() || c == '-' || c == '_')) {
                return Err(SubjectPrefixError::ForbiddenCharacter { index, character });
            }
        }
        Ok(SubjectPrefix(prefix.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The prefix's tokens, in order.
    pub fn tokens(&self) -> impl Iterator<Item = &str> {
        self.0.split('.')
    }
}

impl Default for SubjectPrefix {
    fn default() -> Self {
        SubjectPrefix(SUBJECT_PREFIX_DEFAULT.to_owned())
    }
}

impl std::fmt::Display for SubjectPrefix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// How outside ids become subject tokens. Both are injective and never produce `.`, `*`, `>`,
/// whitespace or an empty token; they differ in what stays readable. A log keeps the encoding it
/// was created with for its whole life: its stored subjects were built with it, and a surface's
/// events must keep sharing one subject for filtered replay to find them all.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SubjectEncoding {
    /// Label `"1"`, the first encoding: keeps `[A-Za-z0-9-]`, escapes every other byte as `_XX`
    /// (so `oc_abc` is `oc_5Fabc`); the empty string is a lone `_`. Logs created before the
    /// encoding was recorded were written with it.
    Underscore,
    /// Label `"2"`: keeps every printable ASCII character except `.` (the token separator), `*`
    /// and `>` (wildcards) and `%` (the escape), so `oc_abc`, `ada_bot` and `!room:host` read as
    /// they are; escapes every other byte (whitespace, control characters, non-ASCII UTF-8 bytes)
    /// as `%XX`; the empty string is a lone `%`. Non-ASCII is escaped so subjects stay plain
    /// ASCII in every tool and terminal, with no look-alike characters.
    Percent,
}

impl SubjectEncoding {
    /// What a newly created log records and uses.
    pub const NEWEST: SubjectEncoding = SubjectEncoding::Percent;

    /// Every encoding this build reads, oldest first.
    pub const ALL: [SubjectEncoding; 2] = [SubjectEncoding::Underscore, SubjectEncoding::Percent];

    /// The label a log records (`"1"`, `"2"`).
    pub const fn label(self) -> &'static str {
        match self {
            SubjectEncoding::Underscore => "1",
            SubjectEncoding::Percent => "2",
        }
    }

    /// The encoding a recorded label names; `None` for a label this build does not know (a
    /// newer build created the log: refuse it rather than guess).
    pub fn from_label(label: &str) -> Option<SubjectEncoding> {
        SubjectEncoding::ALL.into_iter().find(|encoding| encoding.label() == label)
    }

    /// The byte that starts every three-byte escape, and alone stands for the empty string.
    const fn escape(self) -> u8 {
        match self {
            SubjectEncoding::Underscore => b'_',
            SubjectEncoding::Percent => b'%',
        }
    }

    /// Whether `byte` is written as it is. Never the escape byte, never `.`, `*`, `>`.
    fn keeps(self, byte: u8) -> bool {
        match self {
            SubjectEncoding::Underscore => byte.is_ascii_alphanumeric() || byte == b'-',
            SubjectEncoding::Percent => byte.is_ascii_graphic() && !matches!(byte, b'.' | b'*' | b'>' | b'%'),
        }
    }

    /// Encodes one token of outside input injectively: kept bytes as they are, every other
    /// UTF-8 byte (including the escape byte itself) as the escape byte and two uppercase hex
    /// digits, the empty string as the lone escape byte.
    ///
    /// Distinct inputs give distinct tokens: kept bytes are never the escape byte, every escape
    /// is exactly three bytes, and a non-empty input never encodes to the lone escape byte (one
    /// byte encodes to itself, which is kept, or to three bytes).
    pub fn encode_token(self, raw: &str) -> String {
        let escape = char::from(self.escape());
        if raw.is_empty() {
            return escape.to_string();
        }
        let mut token = String::with_capacity(raw.len());
        for &byte in raw.as_bytes() {
            if self.keeps(byte) {
                token.push(char::from(byte));
            } else {
                // Writing into a String cannot fail.
                let _ = write!(token, "{escape}{byte:02X}");
            }
        }
        token
    }

    /// Inverse of [`SubjectEncoding::encode_token`]: `Some(raw)` exactly when
    /// `encode_token(raw) == token`.
    ///
    /// Anything the encoding cannot produce is `None`: an empty token, a byte it would have
    /// escaped, a truncated or lowercase escape, an escape of a byte it would have kept (`%41`
    /// for `A`), or escapes that do not form valid UTF-8.
    pub fn decode_token(self, token: &str) -> Option<String> {
        let escape = self.escape();
        let bytes = token.as_bytes();
        match bytes {
            [] => return None,
            [only] if *only == escape => return Some(String::new()),
            _ => {}
        }
        let mut raw = Vec::with_capacity(bytes.len());
        let mut position = 0;
        while position < bytes.len() {
            let byte = bytes[position];
            if self.keeps(byte) {
                raw.push(byte);
                position += 1;
            } else if byte == escape {
                let high = upper_hex_value(*bytes.get(position + 1)?)?;
                let low = upper_hex_value(*bytes.get(position + 2)?)?;
                let escaped = (high << 4) | low;
                if self.keeps(escaped) {
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
}

/// Value of one uppercase hex digit, as the encodings write them.
fn upper_hex_value(digit: u8) -> Option<u8> {
    match digit {
        b'0'..=b'9' => Some(digit - b'0'),
        b'A'..=b'F' => Some(digit - b'A' + 10),
        _ => None,
    }
}

/// The subjects of one log: its prefix and its encoding. Held by the log (which knows both once
/// it is open) and asked of it by everything that builds a subject, so no subject is ever built
/// with another log's encoding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Subjects {
    prefix: SubjectPrefix,
    encoding: SubjectEncoding,
}

impl Subjects {
    pub fn new(prefix: SubjectPrefix, encoding: SubjectEncoding) -> Subjects {
        Subjects { prefix, encoding }
    }

    /// What a log created now under `prefix` uses: the newest encoding.
    pub fn newest(prefix: SubjectPrefix) -> Subjects {
        Subjects::new(prefix, SubjectEncoding::NEWEST)
    }

    /// What a log that recorded neither prefix nor encoding was written with: every log created
    /// before both were recorded used `anima.v1` and the underscore encoding.
    pub fn unrecorded() -> Subjects {
        Subjects::new(SubjectPrefix::default(), SubjectEncoding::Underscore)
    }

    pub fn prefix(&self) -> &SubjectPrefix {
        &self.prefix
    }

    pub fn encoding(&self) -> SubjectEncoding {
        self.encoding
    }

    /// One outside id as a token of this log's subjects.
    pub fn encode_token(&self, raw: &str) -> String {
        self.encoding.encode_token(raw)
    }

    /// The filter matching every subject of this log (`anima.v1.>`); the JetStream stream
    /// captures exactly this.
    pub fn all(&self) -> String {
        format!("{}.>", self.prefix)
    }

    /// Whether `subject` lies under this log's prefix (it may still be malformed otherwise).
    pub fn owns(&self, subject: &str) -> bool {
        subject.strip_prefix(self.prefix.as_str()).is_some_and(|rest| rest.starts_with('.'))
    }

    /// The configuration family: configuration applied at start-up, `<prefix>.config`.
    pub fn config(&self) -> String {
        format!("{}.config", self.prefix)
    }

    /// One Slack surface: a channel's top level or DM main timeline,
    /// `<prefix>.surface.slack.<team>.<channel>`, or one thread,
    /// `<prefix>.surface.slack.<team>.<channel>.thread.<thread_ts>`. Every id is encoded.
    pub fn slack_surface(&self, team: &str, channel: &str, thread_ts: Option<&str>) -> String {
        self.surface_of("slack", team, channel, thread_ts)
    }

    /// One chat surface: a chat's top level, `<prefix>.surface.chat.<tenant>.<chat>`, or one
    /// thread, `<prefix>.surface.chat.<tenant>.<chat>.thread.<thread>`. Every id is encoded.
    pub fn chat_surface(&self, tenant: &str, chat: &str, thread: Option<&str>) -> String {
        self.surface_of("chat", tenant, chat, thread)
    }

    fn surface_of(&self, platform: &str, space: &str, channel: &str, thread: Option<&str>) -> String {
        let mut subject =
            format!("{}.surface.{platform}.{}.{}", self.prefix, self.encode_token(space), self.encode_token(channel));
        if let Some(thread) = thread {
            subject.push_str(".thread.");
            subject.push_str(&self.encode_token(thread));
        }
        subject
    }

    /// One Linear agent session: `<prefix>.linear.<session>`, the session id encoded.
    pub fn linear_session(&self, session: &str) -> String {
        format!("{}.linear.{}", self.prefix, self.encode_token(session))
    }

    /// One agent's own events (wake lifecycle, subscriptions, memory-pass outcomes,
    /// registration): `<prefix>.agent.<agent>`, the agent id encoded.
    pub fn agent(&self, agent: &str) -> String {
        format!("{}.agent.{}", self.prefix, self.encode_token(agent))
    }

    /// One agent's heartbeats, `<prefix>.agent.<agent>.hb`: apart from its other events, so a
    /// replay of the agent can leave them out with a filter.
    pub fn agent_heartbeat(&self, agent: &str) -> String {
        format!("{}.hb", self.agent(agent))
    }

    /// The subject of a surface's events (observations, send requests, confirmations).
    pub fn surface(&self, surface: &SurfaceId) -> String {
        match surface {
            SurfaceId::Slack { team, channel, thread_ts } => self.slack_surface(team, channel, thread_ts.as_deref()),
            SurfaceId::Chat { tenant, chat, thread } => self.chat_surface(tenant, chat, thread.as_deref()),
            SurfaceId::Linear { session } => self.linear_session(session),
            SurfaceId::Memory { agent } => self.agent(agent),
        }
    }
}

/// Why a literal subject was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubjectError {
    /// The subject is the empty string. Build subjects with [`Subjects`].
    #[error("subject is empty")]
    Empty,
    /// The subject is longer than [`SUBJECT_BYTES_MAX`]. An id that long is not a real id:
    /// refuse the input.
    #[error("subject is {bytes} bytes long, more than {SUBJECT_BYTES_MAX}")]
    TooLong { bytes: usize },
    /// Two dots in a row, or a leading or trailing dot. A token built from outside input was not
    /// encoded: build the subject with [`Subjects`].
    #[error("subject token {index} is empty")]
    EmptyToken { index: usize },
    /// A wildcard (`*`, `>`), whitespace or a control character inside a literal subject. A token
    /// built from outside input was not encoded: build the subject with [`Subjects`].
    #[error("subject token {index} contains forbidden character {character:?}")]
    ForbiddenCharacter { index: usize, character: char },
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const UNDERSCORE: SubjectEncoding = SubjectEncoding::Underscore;
    const PERCENT: SubjectEncoding = SubjectEncoding::Percent;

    fn subjects(prefix: &str, encoding: SubjectEncoding) -> Subjects {
        Subjects::new(SubjectPrefix::new(prefix).expect("a valid prefix"), encoding)
    }

    #[test]
    fn the_first_encoding_keeps_its_exact_output() {
        // Logs written with it are read back with these very tokens: it must never change.
        assert_eq!(UNDERSCORE.encode_token("T024BE7LD"), "T024BE7LD");
        assert_eq!(UNDERSCORE.encode_token("a-b"), "a-b");
        assert_eq!(UNDERSCORE.encode_token("1712345678.123456"), "1712345678_2E123456");
        assert_eq!(UNDERSCORE.encode_token("a_b"), "a_5Fb");
        assert_eq!(UNDERSCORE.encode_token("a b*>"), "a_20b_2A_3E");
        assert_eq!(UNDERSCORE.encode_token("é"), "_C3_A9");
        assert_eq!(UNDERSCORE.encode_token(""), "_");
        assert_eq!(UNDERSCORE.encode_token("_"), "_5F");
    }

    #[test]
    fn the_percent_encoding_keeps_what_nats_allows_readable() {
        for readable in ["oc_abc", "ou_x", "ada_bot", "T024BE7LD", "!room:matrix", "$ev", "a-b", "~#@&()[]{}|,;'\"\\"] {
            assert_eq!(PERCENT.encode_token(readable), readable);
        }
        assert_eq!(PERCENT.encode_token("1712345678.123456"), "1712345678%2E123456");
        assert_eq!(PERCENT.encode_token("a b*>"), "a%20b%2A%3E");
        assert_eq!(PERCENT.encode_token("tab\there\n"), "tab%09here%0A");
        assert_eq!(PERCENT.encode_token("100%"), "100%25");
        assert_eq!(PERCENT.encode_token("é"), "%C3%A9");
        assert_eq!(PERCENT.encode_token("\u{7f}"), "%7F");
        assert_eq!(PERCENT.encode_token(""), "%");
        assert_eq!(PERCENT.encode_token("%"), "%25");
    }

    #[test]
    fn decode_refuses_what_encode_cannot_produce() {
        for token in ["", "a.b", "_2", "_2e", "_41", "_G0", "a b", "__", "_C3", "x*", "a%b"] {
            assert_eq!(UNDERSCORE.decode_token(token), None, "underscore token {token:?}");
        }
        assert_eq!(UNDERSCORE.decode_token("_"), Some(String::new()));
        assert_eq!(UNDERSCORE.decode_token("_C3_A9").as_deref(), Some("é"));
        for token in ["", "a.b", "%2", "%2e", "%41", "%5F", "%G0", "a b", "%%", "%C3", "x*", "x>", "é"] {
            assert_eq!(PERCENT.decode_token(token), None, "percent token {token:?}");
        }
        assert_eq!(PERCENT.decode_token("%"), Some(String::new()));
        assert_eq!(PERCENT.decode_token("oc_abc").as_deref(), Some("oc_abc"));
        assert_eq!(PERCENT.decode_token("%C3%A9").as_deref(), Some("é"));
    }

    #[test]
    fn encodings_have_labels_and_unknown_labels_are_refused() {
        for encoding in SubjectEncoding::ALL {
            assert_eq!(SubjectEncoding::from_label(encoding.label()), Some(encoding));
        }
        assert_eq!(SubjectEncoding::NEWEST.label(), "2");
        assert_eq!(SubjectEncoding::from_label("3"), None);
        assert_eq!(SubjectEncoding::from_label(""), None);
    }

    #[test]
    fn prefixes_are_checked_and_the_error_names_the_problem() {
        assert_eq!(SubjectPrefix::default().as_str(), "anima.v1");
        for valid in ["anima.v1", "acme", "acme-prod.anima_2.v1", "a.b.c.d.e.f.g.h"] {
            assert_eq!(SubjectPrefix::new(valid).map(|p| p.to_string()), Ok(valid.to_owned()));
        }
        assert_eq!(SubjectPrefix::new(""), Err(SubjectPrefixError::Empty));
        assert_eq!(SubjectPrefix::new("anima..v1"), Err(SubjectPrefixError::EmptyToken { index: 1 }));
        assert_eq!(SubjectPrefix::new(".anima"), Err(SubjectPrefixError::EmptyToken { index: 0 }));
        assert_eq!(SubjectPrefix::new("anima."), Err(SubjectPrefixError::EmptyToken { index: 1 }));
        assert_eq!(SubjectPrefix::new("a.b.c.d.e.f.g.h.i"), Err(SubjectPrefixError::TooManyTokens { tokens: 9 }));
        assert_eq!(
            SubjectPrefix::new(&"a".repeat(SUBJECT_PREFIX_BYTES_MAX + 1)),
            Err(SubjectPrefixError::TooLong { bytes: SUBJECT_PREFIX_BYTES_MAX + 1 })
        );
        for (prefix, index, character) in
            [("anima.*", 1, '*'), ("anima.>", 1, '>'), ("$JS.x", 0, '$'), ("a b", 0, ' '), ("é", 0, 'é')]
        {
            assert_eq!(
                SubjectPrefix::new(prefix),
                Err(SubjectPrefixError::ForbiddenCharacter { index, character }),
                "{prefix:?}"
            );
        }
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
        let old = subjects("anima.v1", UNDERSCORE);
        assert_eq!(old, Subjects::unrecorded());
        assert_eq!(old.slack_surface("T1", "C1", None), "anima.v1.surface.slack.T1.C1");
        assert_eq!(
            old.slack_surface("T1", "C1", Some("1712345678.123456")),
            "anima.v1.surface.slack.T1.C1.thread.1712345678_2E123456"
        );
        assert_eq!(old.agent("agent.one"), "anima.v1.agent.agent_2Eone");
        assert_eq!(old.chat_surface("t1", "oc_1", None), "anima.v1.surface.chat.t1.oc_5F1");
        assert_eq!(
            old.chat_surface("t1", "!room:matrix.org", Some("$ev.1")),
            "anima.v1.surface.chat.t1._21room_3Amatrix_2Eorg.thread._24ev_2E1"
        );

        let new = subjects("acme.anima", PERCENT);
        assert_eq!(new.config(), "acme.anima.config");
        assert_eq!(new.all(), "acme.anima.>");
        assert_eq!(new.agent("ada_bot"), "acme.anima.agent.ada_bot");
        assert_eq!(new.agent_heartbeat("ada_bot"), "acme.anima.agent.ada_bot.hb");
        assert_eq!(new.linear_session("s-1"), "acme.anima.linear.s-1");
        assert_eq!(new.chat_surface("t1", "oc_1", None), "acme.anima.surface.chat.t1.oc_1");
        assert_eq!(
            new.chat_surface("t1", "!room:matrix.org", Some("$ev.1")),
            "acme.anima.surface.chat.t1.!room:matrix%2Eorg.thread.$ev%2E1"
        );
        assert_eq!(
            new.surface(&SurfaceId::Slack { team: "T1".into(), channel: "C1".into(), thread_ts: None }),
            new.slack_surface("T1", "C1", None)
        );
        assert!(new.owns("acme.anima.agent.ada"));
        assert!(!new.owns("acme.animal.agent.ada"));
        assert!(!new.owns("acme.anima"));
        assert!(!new.owns("anima.v1.agent.ada"));
        assert!(crate::log::SubjectFilter(new.all()).matches(&new.agent("a")));

        // The longest chat ids the engine accepts, all escaped, under the longest prefix, still
        // fit a subject.
        let longest_prefix = format!("{}.{}", "a".repeat(31), "b".repeat(SUBJECT_PREFIX_BYTES_MAX - 32));
        assert_eq!(longest_prefix.len(), SUBJECT_PREFIX_BYTES_MAX);
        let long = "é".repeat(crate::validate::CHAT_ID_BYTES_MAX / 2);
        for encoding in SubjectEncoding::ALL {
            let subjects = subjects(&longest_prefix, encoding);
            assert_eq!(check_subject(&subjects.chat_surface(&long, &long, Some(&long))), Ok(()));
            assert_eq!(check_subject(&subjects.config()), Ok(()));
        }
    }

    fn any_encoding() -> impl Strategy<Value = SubjectEncoding> {
        prop_oneof![Just(UNDERSCORE), Just(PERCENT)]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn encoded_tokens_are_single_literal_tokens(encoding in any_encoding(), raw in any::<String>()) {
            let token = encoding.encode_token(&raw);
            prop_assert!(!token.is_empty());
            prop_assert!(!token.contains(['.', '*', '>']));
            prop_assert!(token.bytes().all(|b| b.is_ascii_graphic()), "{:?}", token);
            prop_assert_eq!(check_subject(&format!("anima.v1.{token}")), Ok(()));
            if encoding == UNDERSCORE {
                prop_assert!(token.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'));
            }
        }

        #[test]
        fn decode_inverts_encode(encoding in any_encoding(), raw in any::<String>()) {
            prop_assert_eq!(encoding.decode_token(&encoding.encode_token(&raw)), Some(raw));
        }

        #[test]
        fn distinct_inputs_give_distinct_tokens(
            encoding in any_encoding(),
            left in any::<String>(),
            right in any::<String>(),
        ) {
            prop_assume!(left != right);
            prop_assert_ne!(encoding.encode_token(&left), encoding.encode_token(&right));
        }

        #[test]
        fn near_collisions_stay_distinct(
            encoding in any_encoding(),
            prefix in "[a-z_%.]{0,4}",
            suffix in "[A-F0-9_%]{0,4}",
        ) {
            // Inputs that look like escapes are the ones an encoding bug would confuse.
            let raw = format!("{prefix}{suffix}");
            let token = encoding.encode_token(&raw);
            prop_assert_eq!(encoding.decode_token(&token), Some(raw.clone()));
            prop_assert_ne!(&token, &encoding.encode_token(&format!("{raw}_")));
            prop_assert_ne!(&token, &encoding.encode_token(&format!("{raw}%")));
        }

        /// Whatever decodes re-encodes to the same token: decoding accepts exactly the image of
        /// encoding, so one id has one token and one token one id.
        #[test]
        fn decoded_tokens_reencode_to_themselves(encoding in any_encoding(), token in "[!-~]{0,12}") {
            if let Some(raw) = encoding.decode_token(&token) {
                prop_assert_eq!(encoding.encode_token(&raw), token);
            }
        }

        /// Ids up to 24 characters of any Unicode: real Slack and agent ids are far shorter, and
        /// longer ones can exceed `SUBJECT_BYTES_MAX` once escaped (refused at append).
        #[test]
        fn builder_output_passes_check_subject(
            encoding in any_encoding(),
            prefix in "[A-Za-z0-9_-]{1,8}(\\.[A-Za-z0-9_-]{1,8}){0,3}",
            team in "(?s).{0,24}",
            channel in "(?s).{0,24}",
            thread_ts in proptest::option::of("(?s).{0,24}"),
            agent in "(?s).{0,24}",
        ) {
            let subjects = subjects(&prefix, encoding);
            let prefix_tokens = prefix.split('.').count();
            let surface = subjects.slack_surface(&team, &channel, thread_ts.as_deref());
            prop_assert_eq!(check_subject(&surface), Ok(()));
            prop_assert!(subjects.owns(&surface));
            prop_assert_eq!(surface.split('.').count(), prefix_tokens + if thread_ts.is_some() { 6 } else { 4 });
            let chat = subjects.chat_surface(&team, &channel, thread_ts.as_deref());
            prop_assert_eq!(check_subject(&chat), Ok(()));
            prop_assert_eq!(chat.split('.').count(), prefix_tokens + if thread_ts.is_some() { 6 } else { 4 });
            let agent = subjects.agent(&agent);
            prop_assert_eq!(check_subject(&agent), Ok(()));
            prop_assert_eq!(agent.split('.').count(), prefix_tokens + 2);
        }
    }
}
