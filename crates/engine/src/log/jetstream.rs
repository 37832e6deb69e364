//! The production event log: one NATS JetStream stream, `ANIMA` by default,
//! capturing `<prefix>.>` (`anima.v1.>` by default) with file storage, replicas from
//! configuration, a duplicate window of at least 10 minutes and no age or size limit unless
//! configured.
//!
//! * Subjects: the stream records the token encoding of its subjects in its metadata
//!   ([`SUBJECT_ENCODING_METADATA_KEY`]) when this log creates it. A stream without the record
//!   was created before it existed and uses the first encoding, so its subjects stay the same
//!   for as long as it lives. Two deployments share one account with different stream names and
//!   different prefixes (the same prefix twice is refused by the server: overlapping subjects).
//! * Appends: every publish carries `Nats-Msg-Id` (the record's `msg_id`), so a retry after a
//!   timeout is deduplicated by the server; a publish that returned an error may still have been
//!   stored (seen in failover tests). `append_batch` pipelines: it keeps at most `ack_window` ack futures in
//!   flight in one `FuturesUnordered`, polled together, because an ack's timeout starts at its
//!   first poll — awaiting them one by one would turn a failover into thousands of sequential
//!   timeouts.
//! * Reads and follows use an ordered push consumer, the fastest reader measured here (a
//!   replay of 1M events ~384k/s on 2.9.10 and ~500k/s on 2.15.1, against ~365k/s and ~433k/s for
//!   a pull consumer fetching 10,000 at a time and ~202k/s for the ordered pull consumer). It is
//!   also the one that recreates itself after a server restart or a gap, from the last delivered
//!   seq, which a long-lived `follow` needs. A `read` knows where to stop from the stream's last
//!   seq captured at call time, the consumer's pending count at creation (a filter that matches
//!   nothing ends at once) and each delivery's pending count (the last match ends it). Measured
//!   again on this machine under load, same run: raw ordered push ~187k/s, raw pull fetch 10,000
//!   ~169k/s, this `read` ~208-283k/s (within noise of the raw ordered push).
//! * A follower that is being polled sees a disconnect and resumes within milliseconds of the
//!   server's return. A consumer can also die while the connection lives: an ordered consumer is
//!   one replica, placed on any node of the stream, and it dies with that node. The library
//!   notices only after two missed 5 s heartbeats (a fold stalled ~15 s by a leader kill), so a
//!   follower replaces its consumer itself, from the next seq it owes, as soon as either signal
//!   comes: the stream elected a leader (the server's `LEADER_ELECTED` advisory, which follows
//!   the death of the leader's node), or an append of this log was acknowledged at a seq the
//!   follower has not delivered for [`FOLLOW_STALL_AFTER`] (any other death, noticed when a
//!   request of this instance waits for it). A new consumer needs the cluster's meta leader,
//!   which may be in an election of its own when its node died too; until a consumer delivers,
//!   a stalled follower reads the owed events one by one by direct get, which any replica
//!   answers (streams that allow direct gets, as this log creates them). Measured by the
//!   cluster tests: a fold applies the first event stored after a stream-leader kill within
//!   0.0-1.0 s of its append instead of up to 15 s later; a follow whose consumer died on a
//!   follower node delivers 1.0 s after the append instead of 20 s. Consumers are ephemeral: the server removes a
//!   dropped reader's consumer after 30 s without interest.
//! * Timestamps are the stream's stored message times, in unix nanoseconds.

use std::task::Poll;
use std::time::{Duration, Instant};

use async_nats::jetstream::{
    self,
    consumer::{push, DeliverPolicy},
    context::{PublishAckFuture, PublishError, PublishErrorKind},
    message::{PublishMessage, StreamMessage},
    publish::PublishAck,
    stream::{DirectGetErrorKind, RawMessageErrorKind, RetentionPolicy, StorageType},
};
use bytes::Bytes;
use futures::stream::{self, BoxStream, FuturesUnordered, StreamExt};

use super::{
    validate_record, AppendOutcome, AppendRecord, EventLog, LogError, LogResult, StoredRecord, SubjectFilter,
    PAYLOAD_BYTES_MAX,
};
use crate::subject::{SubjectEncoding, SubjectPrefix, Subjects};

/// The stream metadata key recording the token encoding of the stream's subjects (its
/// [`SubjectEncoding::label`]). Missing: the first encoding.
pub const SUBJECT_ENCODING_METADATA_KEY: &str = "anima_subject_encoding";

/// Shortest duplicate window accepted: Slack retries for about 5 minutes, and JetStream's default
/// of 2 minutes would let its retries through.
pub const DUPLICATE_WINDOW_MIN: Duration = Duration::from_secs(10 * 60);

/// The header naming each message's event type (`slack_message`, `send`, ...).
pub const EVENT_TYPE_HEADER: &str = "Anima-Event-Type";

/// Shortest `max_age` accepted: the memory pass needs at least two daily pass intervals of
/// history.
pub const MAX_AGE_MIN: Duration = Duration::from_secs(2 * 24 * 60 * 60);

/// Largest `ack_window` accepted. 4096 acks in flight already reach the measured plateau
/// (~121k msg/s); more only adds memory and longer failover stalls.
pub const ACK_WINDOW_MAX: usize = 65_536;

/// The connection-wide async-nats ack window (`max_ack_inflight`) is this many times
/// `ack_window`, so several concurrent batches and single appends can each keep a full window in
/// flight. Past it, publishes wait (backpressure on, as measured: async-nats waits, it does not
/// error, whatever its doc says) rather than failing.
const ACK_INFLIGHT_PER_CONNECTION_FACTOR: usize = 4;

/// How long one msg id may keep answering "duplicate message id is in process" before the
/// stream leader's staged copy is taken as lost. A staged publish is replicated in milliseconds;
/// nats-server (2.11+) drops staged ids on a leader change only when they are the newest, so a
/// proposal lost in an election can leave its id "in process" on the leader for the whole
/// duplicate window (10 minutes here) although the stream never stored it — every retry of that
/// event is refused until then (seen in the cluster test after a leader kill).
const IN_PROCESS_STALE_AFTER: Duration = Duration::from_secs(5);

/// Least time between two stream-leader step-down requests of one log, so a slow cluster is
/// not pushed into election after election.
const STEP_DOWN_PAUSE: Duration = Duration::from_secs(30);

/// Msg ids whose "in process" answers are being timed; past it new ones are not tracked (the
/// oldest are the ones that matter).
const IN_PROCESS_TRACKED_MAX: usize = 4_096;

/// A `read` that receives nothing for this long (or three request timeouts, if longer) ends with
/// `Unavailable` instead of waiting for a server that is gone: the ordered consumer would retry
/// forever.
const READ_STALL_MIN: Duration = Duration::from_secs(15);

/// A follower that has delivered nothing for this long while an append of its log was
/// acknowledged at a seq it has not delivered replaces its consumer. A live consumer delivers an
/// acknowledged event within milliseconds (replicated, then pushed); 1 s leaves room for a loaded
/// machine and still resumes a fold well within 2 s of the first append after a failover.
pub const FOLLOW_STALL_AFTER: Duration = Duration::from_secs(1);

/// Attempts at creating one replacement consumer. A create needs the cluster's meta leader,
/// which may itself be in an election for several seconds (4-9 s measured) when its node died
/// with the stream leader: 40 attempts cover ~24 s. Past the last one the follower keeps its old
/// consumer (the library recreates it on missed heartbeats) and the next stall or election tries
/// again.
const CONSUMER_REPLACEMENT_ATTEMPTS_MAX: u32 = 40;

/// Bound on one attempt at creating a replacement consumer. A create answers in milliseconds
/// (2-5 ms measured under the failover test's load); one sent while there is no meta leader is
/// never answered, and waiting the whole request timeout for it would hold the fold back that
/// long after the meta leader is back (2 s cost the fold 1.6 s after an election in the
/// failover test).
const CONSUMER_REPLACEMENT_ATTEMPT_TIMEOUT_MAX: Duration = Duration::from_millis(500);

/// Pause between two attempts at creating a replacement consumer: with the attempt bound, at
/// most ~2 creates a second per follower while the cluster cannot place one.
const CONSUMER_REPLACEMENT_PAUSE: Duration = Duration::from_millis(100);

/// Pause before reading an owed event directly again after no replica had it (one that lags
/// behind the leader) or none answered.
const DIRECT_READ_PAUSE: Duration = Duration::from_millis(100);

/// The advisory subject prefix a JetStream cluster announces a stream's new leader on (followed
/// by the stream name).
const LEADER_ELECTED_ADVISORY_PREFIX: &str = "$JS.EVENT.ADVISORY.STREAM.LEADER_ELECTED";

/// Most servers one server list may name. A cluster has 3 or 5; the bound keeps a mistaken list
/// (a pasted file) from becoming thousands of connection attempts.
pub const SERVERS_MAX: usize = 32;

/// Longest server URL accepted, in bytes: a host name is at most 253, credentials and a port fit
/// in the rest.
pub const SERVER_URL_BYTES_MAX: usize = 1_024;

/// Interval of the client's PINGs on an idle connection. async-nats drops a connection when a
/// third PING finds two unanswered, so a frozen server (SIGSTOP, a dead route) is left for
/// another one after about three intervals: ~6 s here, against ~3 minutes with the library's
/// default of 60 s. Any traffic from the server resets the timer, so a busy connection sends none.
pub const PING_INTERVAL: Duration = Duration::from_secs(2);

/// Longest wait for one server's handshake (TCP, INFO, CONNECT). A healthy one takes
/// milliseconds; a frozen server still accepts the TCP connection (the kernel does) and then
/// says nothing, so a reconnect that picks it again would otherwise wait the whole
/// `request_timeout` (measured: 15 s to leave a frozen node with 10 s, ~8 s with this bound).
pub const CONNECT_TIMEOUT_MAX: Duration = Duration::from_secs(2);

/// The servers of a comma-separated list such as `nats://10.0.0.1:4222,nats://10.0.0.2:4222`, in
/// order (`host:port` alone means `nats://`). The error names the entry (quoted, clipped) and
/// what is wrong with it, for a message that then names the flag or key it came from.
pub fn parse_servers(list: &str) -> Result<Vec<async_nats::ServerAddr>, String> {
    let entries: Vec<&str> = list.split(',').map(str::trim).collect();
    if entries.len() > SERVERS_MAX {
        return Err(format!("names {} servers; at most {SERVERS_MAX}", entries.len()));
    }
    let mut servers = Vec::with_capacity(entries.len());
    for (index, entry) in entries.iter().enumerate() {
        if entry.is_empty() {
            return Err(if entries.len() == 1 {
                "must name at least one server, e.g. nats://127.0.0.1:4222".to_owned()
            } else {
                format!("server {} of {} is empty (a stray comma?)", index + 1, entries.len())
            });
        }
        if entry.len() > SERVER_URL_BYTES_MAX {
            return Err(format!(
                "{} is {} bytes; a server URL has at most {SERVER_URL_BYTES_MAX}",
                crate::validate::echo(entry),
                entry.len()
            ));
        }
        let server: async_nats::ServerAddr =
            entry.parse().map_err(|e| format!("{} is not a NATS server URL: {e}", crate::validate::echo(entry)))?;
        if server.host().is_empty() {
            return Err(format!("{} names no host", crate::validate::echo(entry)));
        }
        servers.push(server);
    }
    Ok(servers)
}

/// Connects a client to the first reachable server of `config.url` (a comma-separated list),
/// with the bounds this log relies on: [`CONNECT_TIMEOUT_MAX`] per handshake, the request
/// timeout and [`PING_INTERVAL`]. A malformed list is a configuration error (`Store`), not `Unavailable`:
/// retrying cannot fix it.
pub async fn connect_client(config: &JetStreamConfig, name: &str) -> LogResult<async_nats::Client> {
    let servers = parse_servers(&config.url).map_err(|e| LogError::Store(format!("NATS server list: {e}")))?;
    async_nats::ConnectOptions::new()
        .name(name)
        .connection_timeout(config.request_timeout.min(CONNECT_TIMEOUT_MAX))
        .request_timeout(Some(config.request_timeout))
        .ping_interval(PING_INTERVAL)
        .connect(servers)
        .await
        .map_err(|e| LogError::Unavailable(format!("cannot connect to NATS at {}: {e}", config.url)))
}

/// Default [`JetStreamConfig::ack_timeout`]: 2 s, about 10× a loaded R3 ack with 4096 in flight
/// on this project's machines (~130 ms), and short enough that publishes sent to a leader that
/// died are retried while the cluster elects the next one (4–7 s measured), not 10 s later.
pub const ACK_TIMEOUT_DEFAULT: Duration = Duration::from_secs(2);

/// Settings of the JetStream log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JetStreamConfig {
    /// Server URL(s), e.g. `nats://127.0.0.1:4222`; comma-separated for a cluster (see
    /// [`parse_servers`]). The client connects to the first that answers and learns the rest of
    /// the cluster from it, so an engine can start while any one listed node is down.
    pub url: String,
    /// Stream name. Several deployments can share an account under different names only if their
    /// subjects do not overlap: each needs its own `subject_prefix` too.
    pub stream: String,
    /// The first tokens of every subject; the stream captures `<subject_prefix>.>`. An existing
    /// stream must capture exactly that, or it is refused.
    pub subject_prefix: SubjectPrefix,
    /// Replicas of the stream when it is created: 1 for one server, 3 in a cluster.
    pub replicas: usize,
    /// JetStream's dedupe window; at least [`DUPLICATE_WINDOW_MIN`].
    pub duplicate_window: Duration,
    /// Age after which JetStream drops events. `None` (default) keeps everything; when set, at
    /// least [`MAX_AGE_MIN`].
    pub max_age: Option<Duration>,
    /// Publish acks in flight per `append_batch`. 256 in flight give ~108k msg/s, 4096 ~121k
    /// (measured here); the bound also limits how much a failover can leave undecided.
    pub ack_window: usize,
    /// Bound on connecting and every JetStream API request.
    pub request_timeout: Duration,
    /// Bound on each publish's ack, from its first poll (acks are polled together as soon as
    /// they are sent). An R3 ack takes milliseconds; one that is missing after this long was
    /// sent to a stream leader that died, and the client would otherwise wait the whole
    /// `request_timeout` before the caller could retry it with the new leader. The append then
    /// fails `Unavailable`, and a retry with the same msg ids is deduplicated.
    pub ack_timeout: Duration,
}

impl Default for JetStreamConfig {
    fn default() -> Self {
        JetStreamConfig {
            url: "nats://127.0.0.1:4222".into(),
            stream: "ANIMA".into(),
            subject_prefix: SubjectPrefix::default(),
            replicas: 1,
            duplicate_window: DUPLICATE_WINDOW_MIN,
            max_age: None,
            ack_window: 1024,
            request_timeout: Duration::from_secs(10),
            ack_timeout: ACK_TIMEOUT_DEFAULT,
        }
    }
}

impl JetStreamConfig {
    /// Refuses settings that would break the log's guarantees, before touching the server.
    fn validate(&self) -> LogResult<()> {
        let misconfigured = |what: String| Err(LogError::Store(format!("JetStream log: {what}")));
        if self.stream.is_empty()
            || self.stream.chars().any(|c| matches!(c, '.' | '*' | '>' | '/' | '\\') || c.is_whitespace())
        {
            return misconfigured(format!(
                "stream name {:?} must be non-empty without '.', '*', '>', slashes or whitespace",
                self.stream
            ));
        }
        if !(1..=5).contains(&self.replicas) {
            return misconfigured(format!("replicas must be 1..=5, not {}", self.replicas));
        }
        if self.duplicate_window < DUPLICATE_WINDOW_MIN {
            return misconfigured(format!(
                "duplicate_window {:?} is below the minimum {DUPLICATE_WINDOW_MIN:?} \
                 (connector retries would be stored twice)",
                self.duplicate_window
            ));
        }
        if let Some(max_age) = self.max_age {
            if max_age < MAX_AGE_MIN {
                return misconfigured(format!(
                    "max_age {max_age:?} is below the minimum {MAX_AGE_MIN:?} \
                     (the memory pass needs two days of history)"
                ));
            }
        }
        if !(1..=ACK_WINDOW_MAX).contains(&self.ack_window) {
            return misconfigured(format!("ack_window must be 1..={ACK_WINDOW_MAX}, not {}", self.ack_window));
        }
        if self.request_timeout.is_zero() {
            return misconfigured("request_timeout must be positive".into());
        }
        if self.ack_timeout.is_zero() {
            return misconfigured("ack_timeout must be positive".into());
        }
        if let Err(e) = parse_servers(&self.url) {
            return misconfigured(format!("NATS server list: {e}"));
        }
        Ok(())
    }

    /// The subjects filter the stream captures, `<subject_prefix>.>`.
    fn stream_subjects(&self) -> String {
        format!("{}.>", self.subject_prefix)
    }

    /// The stream configuration this log creates when the stream is missing: it records the
    /// newest subject encoding, which the new stream then keeps.
    fn stream_config(&self) -> jetstream::stream::Config {
        jetstream::stream::Config {
            name: self.stream.clone(),
            subjects: vec![self.stream_subjects()],
            metadata: [(SUBJECT_ENCODING_METADATA_KEY.to_owned(), SubjectEncoding::NEWEST.label().to_owned())].into(),
            storage: StorageType::File,
            retention: RetentionPolicy::Limits,
            num_replicas: self.replicas,
            duplicate_window: self.duplicate_window,
            max_age: self.max_age.unwrap_or(Duration::ZERO),
            // No size limits: discarding old events would silently rewrite history.
            max_bytes: -1,
            max_messages: -1,
            max_messages_per_subject: -1,
            allow_direct: true,
            // An event log is append-only: data is retired by a configured max age, never by
            // deleting or purging messages (NATS refuses both on this stream).
            deny_delete: true,
            deny_purge: true,
            description: Some("Anima wake engine event log".into()),
            ..Default::default()
        }
    }
}

/// The JetStream log. Cheap to share behind an `Arc`; every operation is independent.
pub struct JetStreamLog {
    client: async_nats::Client,
    /// The publishing context: its timeout is the ack timeout.
    context: jetstream::Context,
    stream: jetstream::stream::Stream,
    stream_name: String,
    identity: String,
    subjects: Subjects,
    ack_window: usize,
    /// Whether the stream allows direct gets; if not, `get` asks the leader.
    allow_direct: bool,
    read_stall_timeout: Duration,
    request_timeout: Duration,
    in_process: std::sync::Mutex<InProcessWatch>,
    /// The newest seq an append of this log was acknowledged at: followers compare it with what
    /// they delivered to notice a dead consumer ([`FOLLOW_STALL_AFTER`]).
    acknowledged: tokio::sync::watch::Sender<u64>,
}

/// Times the msg ids the stream leader keeps answering "in process" for, and says when to ask
/// it to step down (see [`IN_PROCESS_STALE_AFTER`]). A step-down is safe: the new leader stores
/// the event if the stream never did, or answers "duplicate" with its seq if it did, because
/// followers learn msg ids only from replicated, stored messages — never from a staging table.
#[derive(Debug, Default)]
struct InProcessWatch {
    /// Msg id → (first, last) "in process" answer.
    answered: std::collections::HashMap<String, (Instant, Instant)>,
    last_step_down: Option<Instant>,
}

impl InProcessWatch {
    fn in_process(&mut self, msg_id: &str, now: Instant) {
        if let Some((_, last)) = self.answered.get_mut(msg_id) {
            *last = now;
            return;
        }
        if self.answered.len() >= IN_PROCESS_TRACKED_MAX {
            // Ids nobody retried lately were given up by their callers.
            self.answered.retain(|_, (_, last)| now.duration_since(*last) < IN_PROCESS_STALE_AFTER);
        }
        if self.answered.len() < IN_PROCESS_TRACKED_MAX {
            self.answered.insert(msg_id.to_owned(), (now, now));
        }
    }

    fn settled(&mut self, msg_id: &str) {
        if !self.answered.is_empty() {
            self.answered.remove(msg_id);
        }
    }

    /// Whether to ask for a step-down now: some id has answered "in process" for longer than
    /// [`IN_PROCESS_STALE_AFTER`] and still does, and no step-down was asked within
    /// [`STEP_DOWN_PAUSE`]. When it says yes, the timings start over.
    fn step_down_due(&mut self, now: Instant) -> bool {
        let stuck = self.answered.values().any(|(first, last)| {
            now.duration_since(*first) >= IN_PROCESS_STALE_AFTER && now.duration_since(*last) < IN_PROCESS_STALE_AFTER
        });
        let paused = self.last_step_down.is_some_and(|last| now.duration_since(last) < STEP_DOWN_PAUSE);
        if !stuck || paused {
            return false;
        }
        self.last_step_down = Some(now);
        self.answered.clear();
        true
    }
}

impl std::fmt::Debug for JetStreamLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JetStreamLog")
            .field("identity", &self.identity)
            .field("ack_window", &self.ack_window)
            .finish_non_exhaustive()
    }
}

impl JetStreamLog {
    /// Connects, then creates the stream if it is missing or checks that the existing one is
    /// compatible (subjects, storage, retention, duplicate window, limits). Unreachable server:
    /// `Unavailable`; incompatible stream or settings: `Store` naming every problem.
    pub async fn connect(config: JetStreamConfig) -> LogResult<Self> {
        config.validate()?;
        let client = connect_client(&config, "anima-engine").await?;
        // Two contexts on one connection: API requests (stream info, consumers, gets) wait up to
        // `request_timeout`; publishes go through their own, whose timeout is the ack timeout
        // (async-nats bounds each ack by its context's timeout, so this costs no timer of ours).
        let api_context = jetstream::ContextBuilder::new().timeout(config.request_timeout).build(client.clone());
        let context = jetstream::ContextBuilder::new()
            .timeout(config.ack_timeout.min(config.request_timeout))
            .max_ack_inflight(config.ack_window.saturating_mul(ACK_INFLIGHT_PER_CONNECTION_FACTOR))
            .backpressure_on_inflight(true)
            .build(client.clone());

        let stream = open_stream(&api_context, &config).await?;
        let info = stream.cached_info();
        let problems = incompatibilities(&info.config, &config);
        if !problems.is_empty() {
            return Err(LogError::Store(format!(
                "JetStream stream {} is incompatible with this engine: {}",
                config.stream,
                problems.join("; ")
            )));
        }
        if info.config.num_replicas != config.replicas {
            tracing::warn!(
                stream = %config.stream,
                configured = config.replicas,
                actual = info.config.num_replicas,
                "stream replicas differ from the configuration; keeping the stream's"
            );
        }
        let subjects = Subjects::new(config.subject_prefix.clone(), recorded_encoding(&info.config, &config.stream)?);
        let allow_direct = info.config.allow_direct;
        if !allow_direct {
            tracing::warn!(stream = %config.stream, "stream does not allow direct get; reads of single events go to the leader");
        }
        let identity = format!("{}@{}", config.stream, datetime_ns(info.created));
        tracing::info!(
            stream = %config.stream,
            %identity,
            subjects = %subjects.all(),
            subject_encoding = subjects.encoding().label(),
            last_seq = info.state.last_sequence,
            "JetStream log connected"
        );
        Ok(JetStreamLog {
            client,
            context,
            stream_name: config.stream.clone(),
            stream,
            identity,
            subjects,
            ack_window: config.ack_window,
            allow_direct,
            read_stall_timeout: config.request_timeout.saturating_mul(3).max(READ_STALL_MIN),
            request_timeout: config.request_timeout,
            in_process: std::sync::Mutex::new(InProcessWatch::default()),
            acknowledged: tokio::sync::watch::channel(0).0,
        })
    }

    /// The name of the server this log's connection is on now (it moves on failover): for
    /// operators' logs and failover tests.
    pub fn connected_server(&self) -> String {
        self.client.server_info().server_name
    }

    /// Publishes one record; the returned future resolves to its ack. Every message carries its
    /// event type in the `Anima-Event-Type` header (read from the envelope's field numbers, not
    /// decoded), so NATS tools and consumers filter without decoding.
    async fn publish(&self, record: &AppendRecord) -> LogResult<PublishAckFuture> {
        let event_type = anima_projections::redact::Redactor::schema().stored_event_type(&record.payload);
        let message = PublishMessage::build()
            .payload(record.payload.clone())
            .message_id(&record.msg_id)
            .header(EVENT_TYPE_HEADER, event_type);
        self.context.send_publish(record.subject.clone(), message).await.map_err(publish_error)
    }

    /// Turns an ack into an outcome. An ack from another stream means another stream captures
    /// our subjects: fail closed.
    fn outcome(&self, ack: Result<PublishAck, PublishError>, msg_id: &str) -> LogResult<AppendOutcome> {
        let ack = match ack {
            Ok(ack) => {
                self.watch().settled(msg_id);
                self.acknowledged.send_if_modified(|newest| {
                    let newer = ack.sequence > *newest;
                    if newer {
                        *newest = ack.sequence;
                    }
                    newer
                });
                ack
            }
            Err(e) => {
                if is_in_process(&e) {
                    self.watch().in_process(msg_id, Instant::now());
                }
                return Err(publish_error(e));
            }
        };
        if ack.stream != self.stream_name {
            return Err(LogError::Store(format!(
                "publish was stored by stream {} instead of {}",
                ack.stream, self.stream_name
            )));
        }
        Ok(if ack.duplicate {
            AppendOutcome::Duplicate { seq: ack.sequence }
        } else {
            AppendOutcome::Appended { seq: ack.sequence }
        })
    }

    fn watch(&self) -> std::sync::MutexGuard<'_, InProcessWatch> {
        // The watch holds only timings: one left half-updated by a panic is still usable.
        self.in_process.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// After a failed append: when a msg id has been "in process" on the stream leader for too
    /// long, asks the leader to step down so the caller's next retry meets a leader without the
    /// lost staged copy. A refused or unanswered request is only logged: the caller retries
    /// either way, and the next stuck answer asks again after [`STEP_DOWN_PAUSE`].
    async fn step_down_if_stuck(&self) {
        if !self.watch().step_down_due(Instant::now()) {
            return;
        }
        match self.step_down_leader().await {
            Ok(()) => tracing::warn!(
                stream = %self.stream_name,
                "a publish stayed \"in process\" on the stream leader for {IN_PROCESS_STALE_AFTER:?}; the leader was asked to step down"
            ),
            Err(e) => tracing::warn!(stream = %self.stream_name, error = %e, "stream leader step-down request failed"),
        }
    }

    /// Asks the stream's leader to step down (`$JS.API.STREAM.LEADER.STEPDOWN`); the other
    /// replicas elect a new one within seconds. The engine's NATS user needs publish permission on
    /// that API subject for the stuck-publish remedy to work. A one-replica stream has no one to
    /// hand over to: the server refuses (`Store`).
    pub async fn step_down_leader(&self) -> LogResult<()> {
        #[derive(serde::Deserialize)]
        struct Answer {
            #[serde(default)]
            success: bool,
            error: Option<jetstream::Error>,
        }
        let subject = format!("$JS.API.STREAM.LEADER.STEPDOWN.{}", self.stream_name);
        let answer = tokio::time::timeout(self.request_timeout, self.client.request(subject, Bytes::new()))
            .await
            .map_err(|_| LogError::Unavailable("stream leader step-down: no answer".into()))?
            .map_err(|e| LogError::Unavailable(format!("stream leader step-down: {e}")))?;
        let answer: Answer = serde_json::from_slice(&answer.payload)
            .map_err(|e| LogError::Store(format!("stream leader step-down: unreadable answer: {e}")))?;
        match answer.error {
            Some(error) => Err(LogError::Store(format!("stream leader step-down refused: {error}"))),
            None if answer.success => Ok(()),
            None => Err(LogError::Store("stream leader step-down: the server did not confirm it".into())),
        }
    }

    async fn append_once(&self, record: AppendRecord) -> LogResult<AppendOutcome> {
        validate_record(&record, &self.subjects)?;
        let ack = self.publish(&record).await?;
        self.outcome(ack.await, &record.msg_id)
    }

    async fn append_batch_once(&self, records: Vec<AppendRecord>) -> LogResult<Vec<AppendOutcome>> {
        for record in &records {
            validate_record(record, &self.subjects)?;
        }
        let mut outcomes: Vec<Option<AppendOutcome>> = vec![None; records.len()];
        let mut in_flight = FuturesUnordered::new();
        let id_of = |index: usize| records[index].msg_id.as_str();
        for (index, record) in records.iter().enumerate() {
            while in_flight.len() >= self.ack_window {
                if let Some((acked, ack)) = in_flight.next().await {
                    outcomes[acked] = Some(self.outcome(ack, id_of(acked))?);
                }
            }
            // Keep polling the acks already in flight while this publish waits (for the
            // connection's ack window or the socket): their permits are released only when they
            // complete, so not polling them could stall concurrent batches on each other.
            let publish = self.publish(record);
            tokio::pin!(publish);
            // Usually the publish is sent at once; only when it has to wait is the select needed.
            let ack = match futures::poll!(&mut publish) {
                Poll::Ready(sent) => sent?,
                Poll::Pending => loop {
                    tokio::select! {
                        biased;
                        sent = &mut publish => break sent?,
                        Some((acked, ack)) = in_flight.next(), if !in_flight.is_empty() => {
                            outcomes[acked] = Some(self.outcome(ack, id_of(acked))?);
                        }
                    }
                },
            };
            in_flight.push(async move { (index, ack.await) });
        }
        while let Some((acked, ack)) = in_flight.next().await {
            outcomes[acked] = Some(self.outcome(ack, id_of(acked))?);
        }
        outcomes
            .into_iter()
            .map(|outcome| outcome.ok_or_else(|| LogError::Store("a publish in the batch got no ack".into())))
            .collect()
    }

    /// The stream's first and last seq, asked of the server now.
    async fn stream_bounds(&self) -> LogResult<(u64, u64)> {
        let info = self.stream.get_info().await.map_err(|e| classify("stream info", &e))?;
        Ok((info.state.first_sequence, info.state.last_sequence))
    }

    /// The stream's last seq, asked of the server now.
    async fn stream_last_seq(&self) -> LogResult<u64> {
        let info = self.stream.get_info().await.map_err(|e| classify("stream info", &e))?;
        Ok(info.state.last_sequence)
    }

    /// What a reader's consumers are created from: the stream, the connection and `filter_subject`.
    fn consumer_source(&self, filter_subject: String) -> ConsumerSource {
        ConsumerSource {
            stream: self.stream.clone(),
            client: self.client.clone(),
            filter_subject,
            attempt_timeout: self.request_timeout.min(CONSUMER_REPLACEMENT_ATTEMPT_TIMEOUT_MAX),
            allow_direct: self.allow_direct,
        }
    }
}

/// Everything needed to create a reader's ordered consumer, owned, so a follow stream can
/// replace its consumer without borrowing the log.
#[derive(Clone)]
struct ConsumerSource {
    stream: jetstream::stream::Stream,
    client: async_nats::Client,
    filter_subject: String,
    attempt_timeout: Duration,
    /// Whether the stream answers direct gets; without them a stalled follow only waits for its
    /// replacement consumer.
    allow_direct: bool,
}

impl ConsumerSource {
    /// Creates an ordered push consumer from `from_seq` with the filter, returning its messages
    /// and the number of matching events pending when it was created.
    async fn create(&self, from_seq: u64) -> LogResult<(push::Ordered, u64)> {
        let consumer = self
            .stream
            .create_consumer(push::OrderedConfig {
                deliver_subject: self.client.new_inbox(),
                filter_subject: self.filter_subject.clone(),
                deliver_policy: DeliverPolicy::ByStartSequence { start_sequence: from_seq },
                description: Some("anima-engine reader".into()),
                ..Default::default()
            })
            .await
            .map_err(|e| classify("create consumer", &e))?;
        let pending = consumer.cached_info().num_pending;
        let messages = consumer.messages().await.map_err(|e| classify("subscribe to consumer", &e))?;
        Ok((messages, pending))
    }

    /// The event at `seq`, read directly from whichever replica answers (no consumer, so no
    /// meta leader needed), bounded like a replacement attempt. `None` when no replica has it
    /// yet or none answered in time: the caller tries again after [`DIRECT_READ_PAUSE`].
    async fn direct(&self, seq: u64) -> Option<StoredRecord> {
        if !self.allow_direct {
            return None;
        }
        match tokio::time::timeout(self.attempt_timeout, self.stream.direct_get(seq)).await {
            Ok(Ok(message)) => stream_message_record(message).ok(),
            Ok(Err(e)) => {
                tracing::debug!(seq, error = %e, "direct read of an owed event failed; retrying");
                None
            }
            Err(_) => None,
        }
    }

    /// A new consumer from `from_seq`, retried (bounded) while the cluster cannot create one,
    /// e.g. while it elects a meta leader.
    fn replacement(&self, from_seq: u64) -> futures::future::BoxFuture<'static, LogResult<push::Ordered>> {
        let source = self.clone();
        Box::pin(async move {
            let mut attempt = 1;
            loop {
                let failure = match tokio::time::timeout(source.attempt_timeout, source.create(from_seq)).await {
                    Ok(Ok((messages, _))) => return Ok(messages),
                    Ok(Err(e)) => e,
                    Err(_) => {
                        LogError::Unavailable(format!("create consumer: no answer within {:?}", source.attempt_timeout))
                    }
                };
                if attempt >= CONSUMER_REPLACEMENT_ATTEMPTS_MAX {
                    return Err(failure);
                }
                tracing::debug!(attempt, error = %failure, from_seq, "replacement consumer not created yet; retrying");
                tokio::time::sleep(CONSUMER_REPLACEMENT_PAUSE).await;
                attempt += 1;
            }
        })
    }
}

#[async_trait::async_trait]
impl EventLog for JetStreamLog {
    fn identity(&self) -> String {
        self.identity.clone()
    }

    fn subjects(&self) -> &Subjects {
        &self.subjects
    }

    async fn append(&self, record: AppendRecord) -> LogResult<AppendOutcome> {
        let appended = self.append_once(record).await;
        if appended.is_err() {
            self.step_down_if_stuck().await;
        }
        appended
    }

    async fn append_batch(&self, records: Vec<AppendRecord>) -> LogResult<Vec<AppendOutcome>> {
        let appended = self.append_batch_once(records).await;
        if appended.is_err() {
            self.step_down_if_stuck().await;
        }
        appended
    }

    async fn read(
        &self,
        from_seq: u64,
        to_seq: u64,
        filter: Option<SubjectFilter>,
    ) -> LogResult<BoxStream<'static, LogResult<StoredRecord>>> {
        let from_seq = from_seq.max(1);
        let filter_subject = match plan_filter(filter.as_ref(), self.subjects.prefix())? {
            FilterPlan::Nothing => return Ok(stream::empty().boxed()),
            FilterPlan::Subject(subject) => subject,
        };
        if from_seq > to_seq {
            return Ok(stream::empty().boxed());
        }
        let (first_seq, last_seq) = self.stream_bounds().await?;
        let bound = to_seq.min(last_seq);
        if from_seq > bound || first_seq > bound {
            return Ok(stream::empty().boxed());
        }
        // Without a filter every seq from the stream's first to `bound` is stored (the stream
        // denies deletes; age only removes the oldest), so the read ends at `bound` and a
        // consumer's pending count is not trusted: a consumer placed on a replica that is still
        // catching up reports nothing pending for events that exist (seen on a cluster). It
        // delivers them once its replica has them, or the read fails `Unavailable` on a stall —
        // never a silently short read. With a filter, pending is the only way to know the end.
        let unfiltered = filter_subject.is_empty();
        let (messages, pending) = self.consumer_source(filter_subject).create(from_seq).await?;
        if pending == 0 && !unfiltered {
            return Ok(stream::empty().boxed());
        }
        let reader = ConsumerReader { messages, next_seq: from_seq };
        let stall_timeout = self.read_stall_timeout;
        let records = stream::unfold(Some(reader), move |reader| async move {
            let mut reader = reader?;
            let next = {
                let next_record = reader.next_record();
                tokio::pin!(next_record);
                // Arm the stall timer only when the next record is not already buffered: a timer
                // per record would cost more than the rest of the read.
                match futures::poll!(&mut next_record) {
                    Poll::Ready(next) => next,
                    Poll::Pending => match tokio::time::timeout(stall_timeout, next_record).await {
                        Ok(next) => next,
                        Err(_) => Err(LogError::Unavailable(format!(
                            "read stalled: nothing received for {stall_timeout:?} before seq {bound}"
                        ))),
                    },
                }
            };
            match next {
                Ok((record, _)) if record.seq > bound => None,
                Ok((record, pending)) => {
                    let done = record.seq >= bound || (pending == 0 && !unfiltered);
                    Some((Ok(record), (!done).then_some(reader)))
                }
                Err(e) => Some((Err(e), None)),
            }
        });
        Ok(records.boxed())
    }

    async fn follow(
        &self,
        from_seq: u64,
        filter: Option<SubjectFilter>,
    ) -> LogResult<BoxStream<'static, LogResult<StoredRecord>>> {
        let from_seq = from_seq.max(1);
        let filter_subject = match plan_filter(filter.as_ref(), self.subjects.prefix())? {
            // Nothing can ever match: a live stream that never yields.
            FilterPlan::Nothing => return Ok(stream::pending().boxed()),
            FilterPlan::Subject(subject) => subject,
        };
        // Watched before the first consumer is created, so no election after its creation goes
        // unseen (one just before only replaces a consumer that was fine).
        let elections = match self
            .client
            .subscribe(format!("{LEADER_ELECTED_ADVISORY_PREFIX}.{}", self.stream_name))
            .await
        {
            Ok(elections) => Some(elections),
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch stream leader elections; a consumer lost with the leader is noticed later");
                None
            }
        };
        let source = self.consumer_source(filter_subject);
        let (messages, _) = source.create(from_seq).await?;
        let acknowledged = source.filter_subject.is_empty().then(|| self.acknowledged.subscribe());
        let follower = Follower {
            reader: ConsumerReader { messages, next_seq: from_seq },
            source,
            elections,
            acknowledged,
            stall_deadline: None,
            replacement: None,
        };
        let records = stream::unfold(Some(follower), |follower| async move {
            let mut follower = follower?;
            match follower.next_record().await {
                Ok(record) => Some((Ok(record), Some(follower))),
                Err(e) => Some((Err(e), None)),
            }
        });
        Ok(records.boxed())
    }

    async fn get(&self, seq: u64) -> LogResult<Option<StoredRecord>> {
        if seq == 0 {
            return Ok(None);
        }
        if self.allow_direct {
            match self.stream.direct_get(seq).await {
                Ok(message) => return stream_message_record(message).map(Some),
                // A replica may lag behind the leader: confirm a miss with the leader below.
                Err(e) if e.kind() == DirectGetErrorKind::NotFound => {}
                Err(e) => {
                    return Err(match e.kind() {
                        DirectGetErrorKind::InvalidSubject => LogError::Store(format!("direct get of {seq}: {e}")),
                        _ => LogError::Unavailable(format!("direct get of {seq}: {e}")),
                    })
                }
            }
        }
        match self.stream.get_raw_message(seq).await {
            Ok(message) => stream_message_record(message).map(Some),
            Err(e) => match e.kind() {
                RawMessageErrorKind::NoMessageFound => Ok(None),
                RawMessageErrorKind::JetStream(api) if retryable(&api) => {
                    Err(LogError::Unavailable(format!("get of {seq} (retry): {e}")))
                }
                RawMessageErrorKind::JetStream(_) | RawMessageErrorKind::InvalidSubject => {
                    Err(LogError::Store(format!("get of {seq}: {e}")))
                }
                RawMessageErrorKind::Other => Err(classify(&format!("get of {seq}"), &e)),
            },
        }
    }

    async fn last_seq(&self) -> LogResult<u64> {
        self.stream_last_seq().await
    }
}

/// A `follow`: its ordered consumer, and what tells it that the consumer may have died with its
/// node (see the module header), so it can replace it from the next seq it owes.
struct Follower {
    reader: ConsumerReader,
    source: ConsumerSource,
    /// The stream's leader-elected advisories; `None` when they cannot be watched.
    elections: Option<async_nats::Subscriber>,
    /// The newest seq an append of this log was acknowledged at. `None` for a filtered follow (an
    /// acknowledged seq on another subject is owed to nobody) and once the log is dropped.
    acknowledged: Option<tokio::sync::watch::Receiver<u64>>,
    /// Set while an acknowledged seq is owed: when it passes without a delivery, the consumer is
    /// replaced.
    stall_deadline: Option<tokio::time::Instant>,
    /// The consumer being created to replace the current one.
    replacement: Option<futures::future::BoxFuture<'static, LogResult<push::Ordered>>>,
}

impl Follower {
    async fn next_record(&mut self) -> LogResult<StoredRecord> {
        loop {
            let Follower { reader, source, elections, acknowledged, stall_deadline, replacement } = self;
            let newest_acknowledged = acknowledged.as_mut().map(|newest| *newest.borrow_and_update());
            let owed = newest_acknowledged.is_some_and(|newest| newest >= reader.next_seq);
            if !owed {
                *stall_deadline = None;
            } else if stall_deadline.is_none() {
                *stall_deadline = Some(tokio::time::Instant::now() + FOLLOW_STALL_AFTER);
            }
            let stall = async {
                match *stall_deadline {
                    Some(deadline) => tokio::time::sleep_until(deadline).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                // A buffered record comes before any verdict on the consumer: a follower that was
                // not polled for a while has not stalled.
                biased;
                next = reader.next_record() => {
                    *stall_deadline = None;
                    return next.map(|(record, _)| record);
                }
                replaced = async { replacement.as_mut().expect("guarded by the condition").await },
                    if replacement.is_some() =>
                {
                    *replacement = None;
                    // The new consumer gets its own time to deliver what is owed.
                    *stall_deadline = None;
                    match replaced {
                        Ok(messages) => {
                            // The old consumer's subscription ends here; the server removes the
                            // consumer, if its node still lives, once it has no interest.
                            reader.messages = messages;
                            tracing::info!(from_seq = reader.next_seq, "follow consumer replaced");
                        }
                        Err(e) => tracing::warn!(error = %e, "follow consumer not replaced; keeping the old one"),
                    }
                }
                election = async { elections.as_mut().expect("guarded by the condition").next().await },
                    if elections.is_some() =>
                {
                    match election {
                        Some(_) => {
                            // A replacement already under way was placed before this election:
                            // start again from what is owed now.
                            tracing::info!(from_seq = reader.next_seq, "stream leader elected; replacing the follow consumer");
                            *replacement = Some(source.replacement(reader.next_seq));
                        }
                        None => *elections = None,
                    }
                }
                changed = async { acknowledged.as_mut().expect("guarded by the condition").changed().await },
                    if !owed && acknowledged.is_some() =>
                {
                    if changed.is_err() {
                        *acknowledged = None;
                    }
                }
                () = stall => {
                    if replacement.is_none() {
                        tracing::info!(
                            from_seq = reader.next_seq,
                            acknowledged = newest_acknowledged,
                            "follow consumer delivered nothing for {FOLLOW_STALL_AFTER:?} while an acknowledged event is owed; replacing it"
                        );
                        *replacement = Some(source.replacement(reader.next_seq));
                    }
                    // Until a consumer delivers again, the owed events are read one by one from
                    // any replica: a new consumer needs the meta leader, which may be in an
                    // election of its own, a direct get does not.
                    match source.direct(reader.next_seq).await {
                        Some(record) => {
                            debug_assert!(record.seq >= reader.next_seq, "a direct get never goes back");
                            reader.next_seq = record.seq + 1;
                            // Still stalled: the next owed event is read the same way at once.
                            *stall_deadline = Some(tokio::time::Instant::now());
                            return Ok(record);
                        }
                        None => {
                            let pause = if source.allow_direct { DIRECT_READ_PAUSE } else { FOLLOW_STALL_AFTER };
                            *stall_deadline = Some(tokio::time::Instant::now() + pause);
                        }
                    }
                }
            }
        }
    }
}

/// The ordered consumer behind one `read` or `follow`.
struct ConsumerReader {
    messages: push::Ordered,
    /// Lowest seq still to yield. The ordered consumer may redeliver from seq 1 when it recreates
    /// itself before its first delivery (async-nats 0.51 recreates with `DeliverPolicy::All`
    /// then), so anything below is skipped rather than yielded twice or out of range.
    next_seq: u64,
}

impl ConsumerReader {
    /// The next record at or after `next_seq`, with the consumer's pending count after it.
    /// Missed heartbeats are skipped: the ordered consumer recreates itself on the next poll.
    async fn next_record(&mut self) -> LogResult<(StoredRecord, u64)> {
        loop {
            let message = match self.messages.next().await {
                None => return Err(LogError::Unavailable("the NATS connection closed the consumer".into())),
                Some(Err(e)) if e.kind() == push::OrderedErrorKind::MissingHeartbeat => {
                    tracing::debug!(error = %e, "ordered consumer missed a heartbeat; recreating");
                    continue;
                }
                Some(Err(e)) => return Err(classify("ordered consumer", &e)),
                Some(Ok(message)) => message,
            };
            let info = message.info().map_err(|e| LogError::Store(format!("JetStream delivery without info: {e}")))?;
            let seq = info.stream_sequence;
            let pending = info.pending;
            let timestamp_ns = datetime_ns(info.published);
            if seq < self.next_seq {
                continue;
            }
            self.next_seq = seq + 1;
            let record = StoredRecord {
                seq,
                subject: message.message.subject.clone(),
                timestamp_ns,
                payload: message.message.payload.clone(),
            };
            return Ok((record, pending));
        }
    }
}

/// How a subject filter maps onto the stream, whose subjects all start with its prefix.
#[derive(Debug, PartialEq, Eq)]
enum FilterPlan {
    /// The filter cannot match any subject of the stream.
    Nothing,
    /// Consumer filter subject; empty for everything.
    Subject(String),
}

/// Validates a filter and rewrites it for the stream: the server refuses consumer filters that
/// are not within `<prefix>.>`, while the embedded log simply matches nothing, so filters
/// outside become `Nothing` and filters wider than the stream become "everything". Within the
/// stream the first tokens are always the prefix, so `*.*.agent.x` is `anima.v1.agent.x`.
fn plan_filter(filter: Option<&SubjectFilter>, prefix: &SubjectPrefix) -> LogResult<FilterPlan> {
    let Some(filter) = filter else {
        return Ok(FilterPlan::Subject(String::new()));
    };
    filter.validate()?;
    let tokens: Vec<&str> = filter.0.split('.').collect();
    let mut rest = tokens.as_slice();
    for literal in prefix.tokens() {
        match rest.split_first() {
            Some((&">", _)) => return Ok(FilterPlan::Subject(String::new())),
            Some((&token, tail)) if token == literal || token == "*" => rest = tail,
            _ => return Ok(FilterPlan::Nothing),
        }
    }
    match rest {
        // The prefix itself is not a subject of the stream.
        [] => Ok(FilterPlan::Nothing),
        [">"] => Ok(FilterPlan::Subject(String::new())),
        rest => Ok(FilterPlan::Subject(format!("{prefix}.{}", rest.join(".")))),
    }
}

/// The subject encoding a stream recorded; the first one when it recorded none (it was created
/// before the record existed). A label this build does not know is refused: a newer build
/// created the stream, and guessing would put one surface's events on two subjects.
fn recorded_encoding(stream: &jetstream::stream::Config, name: &str) -> LogResult<SubjectEncoding> {
    match stream.metadata.get(SUBJECT_ENCODING_METADATA_KEY) {
        None => Ok(SubjectEncoding::Underscore),
        Some(label) => SubjectEncoding::from_label(label).ok_or_else(|| {
            LogError::Store(format!(
                "JetStream stream {name} records subject encoding {} ({SUBJECT_ENCODING_METADATA_KEY}), which this \
                 build does not know (it reads {}): a newer anima-wake created it",
                crate::validate::echo(label),
                SubjectEncoding::ALL.map(SubjectEncoding::label).join(", ")
            ))
        }),
    }
}

/// The prefix of a stream capturing exactly `<prefix>.>`, if that is what its subjects are: the
/// replay tool reads an existing stream with the prefix the stream itself holds.
pub fn stream_subject_prefix(subjects: &[String]) -> Option<SubjectPrefix> {
    match subjects {
        [only] => SubjectPrefix::new(only.strip_suffix(".>")?).ok(),
        _ => None,
    }
}

/// Gets the stream, creating it when missing. Two engines creating it at once is fine: the
/// loser of the race reads the winner's stream (and then checks it like any other).
async fn open_stream(context: &jetstream::Context, config: &JetStreamConfig) -> LogResult<jetstream::stream::Stream> {
    use jetstream::context::CreateStreamErrorKind;
    match context.get_or_create_stream(config.stream_config()).await {
        Ok(stream) => Ok(stream),
        Err(e) => match e.kind() {
            CreateStreamErrorKind::JetStream(api) if api.error_code() == jetstream::ErrorCode::STREAM_NAME_EXIST => {
                context
                    .get_stream(&config.stream)
                    .await
                    .map_err(|e| LogError::Unavailable(format!("cannot read stream {}: {e}", config.stream)))
            }
            CreateStreamErrorKind::JetStream(api)
                if api.error_code() == jetstream::ErrorCode::STREAM_SUBJECT_OVERLAP =>
            {
                Err(LogError::Store(format!(
                    "cannot create stream {}: its subjects {} overlap another stream's on this account \
                     (another deployment? each needs its own stream name and its own subject prefix): {e}",
                    config.stream,
                    config.stream_subjects()
                )))
            }
            CreateStreamErrorKind::JetStream(api) if retryable(&api) => Err(LogError::Unavailable(format!(
                "cannot create stream {} yet (the cluster is electing or placing it): {e}",
                config.stream
            ))),
            CreateStreamErrorKind::JetStream(_)
            | CreateStreamErrorKind::EmptyStreamName
            | CreateStreamErrorKind::InvalidStreamName
            | CreateStreamErrorKind::DomainAndExternalSet => {
                Err(LogError::Store(format!("cannot create stream {}: {e}", config.stream)))
            }
            CreateStreamErrorKind::JetStreamUnavailable => {
                Err(LogError::Unavailable(format!("JetStream is not enabled or not reachable at {}: {e}", config.url)))
            }
            _ => Err(LogError::Unavailable(format!("cannot open stream {}: {e}", config.stream))),
        },
    }
}

/// Every reason an existing stream cannot serve as this engine's log.
fn incompatibilities(existing: &jetstream::stream::Config, wanted: &JetStreamConfig) -> Vec<String> {
    let mut problems = Vec::new();
    let wanted_subjects = wanted.stream_subjects();
    if existing.subjects != [wanted_subjects.as_str()] {
        problems.push(format!(
            "subjects are {:?}, expected exactly [{wanted_subjects:?}] (the configured subject prefix is {})",
            existing.subjects, wanted.subject_prefix
        ));
    }
    if existing.storage != StorageType::File {
        problems.push(format!(
            "storage is {:?}, expected file (memory storage loses the log on restart)",
            existing.storage
        ));
    }
    if existing.retention != RetentionPolicy::Limits {
        problems.push(format!(
            "retention is {:?}, expected limits (other policies delete consumed events)",
            existing.retention
        ));
    }
    if existing.duplicate_window < wanted.duplicate_window {
        problems.push(format!(
            "duplicate window is {:?}, below the configured {:?}",
            existing.duplicate_window, wanted.duplicate_window
        ));
    }
    if !existing.max_age.is_zero() {
        match wanted.max_age {
            None => problems.push(format!(
                "events expire after {:?} but no max_age is configured (history would be lost)",
                existing.max_age
            )),
            Some(max_age) if existing.max_age < max_age => problems.push(format!(
                "events expire after {:?}, sooner than the configured max_age {max_age:?}",
                existing.max_age
            )),
            Some(_) => {}
        }
    }
    for (limit, value) in [
        ("max_bytes", existing.max_bytes),
        ("max_msgs", existing.max_messages),
        ("max_msgs_per_subject", existing.max_messages_per_subject),
    ] {
        if value > 0 {
            problems.push(format!("{limit} is {value}: size limits silently discard events"));
        }
    }
    if existing.max_message_size > 0 && (existing.max_message_size as usize) < PAYLOAD_BYTES_MAX {
        problems.push(format!(
            "max_msg_size is {} bytes, below the {PAYLOAD_BYTES_MAX} bytes events may need",
            existing.max_message_size
        ));
    }
    if existing.sealed {
        problems.push("the stream is sealed (refuses appends)".into());
    }
    if existing.no_ack {
        problems.push("no_ack is set (appends could not be confirmed)".into());
    }
    if existing.mirror.is_some() {
        problems.push("the stream is a mirror (refuses appends)".into());
    }
    if existing.subject_transform.is_some() {
        problems.push("a subject transform rewrites stored subjects".into());
    }
    problems
}

fn stream_message_record(message: StreamMessage) -> LogResult<StoredRecord> {
    Ok(StoredRecord {
        seq: message.sequence,
        subject: message.subject,
        timestamp_ns: datetime_ns(message.time),
        payload: message.payload,
    })
}

/// Unix nanoseconds of a JetStream time, saturating outside the `i64` range (year 2262).
fn datetime_ns(time: async_nats::datetime::DateTime) -> i64 {
    let nanos = time.unix_timestamp_nanos();
    i64::try_from(nanos).unwrap_or(if nanos < 0 { i64::MIN } else { i64::MAX })
}

/// Whether a publish was refused because the leader is still replicating an earlier copy with
/// the same msg id (10158).
fn is_in_process(e: &PublishError) -> bool {
    let mut source = std::error::Error::source(e);
    while let Some(current) = source {
        if let Some(api) = current.downcast_ref::<jetstream::Error>() {
            return api.error_code() == jetstream::ErrorCode::STREAM_DUPLICATE_MESSAGE_CONFLICT;
        }
        source = current.source();
    }
    false
}

fn publish_error(e: PublishError) -> LogError {
    match e.kind() {
        PublishErrorKind::MaxPayloadExceeded => {
            LogError::Invalid(format!("event exceeds the server's max payload: {e}"))
        }
        PublishErrorKind::WrongLastMessageId | PublishErrorKind::WrongLastSequence => {
            LogError::Store(format!("publish refused: {e}"))
        }
        PublishErrorKind::Other => classify("publish", &e),
        PublishErrorKind::StreamNotFound
        | PublishErrorKind::TimedOut
        | PublishErrorKind::BrokenPipe
        | PublishErrorKind::MaxAckPending => LogError::Unavailable(format!(
            "publish not confirmed (it may still have been stored; retry with the same msg_id): {e}"
        )),
    }
}

/// Whether a JetStream API error may succeed if the same request is retried: the cluster is
/// between leaders or still replicating, not refusing the request for good.
///
/// * `duplicate message id is in process` (10158): a retry reached the leader while the first
///   copy was still being replicated; retrying with the same msg id then answers "duplicate".
/// * No leader, no quorum, peers or placement missing, a Raft or member change under way
///   (10004-10009, 10041, 10075, 10202): an election or a node coming back, over in seconds.
///
/// Everything else (a wrong configuration, limits, a missing stream) is permanent: fail closed.
fn retryable(error: &jetstream::Error) -> bool {
    use jetstream::ErrorCode;
    const RETRYABLE: [ErrorCode; 10] = [
        ErrorCode::STREAM_DUPLICATE_MESSAGE_CONFLICT,
        ErrorCode::CLUSTER_INCOMPLETE,
        ErrorCode::CLUSTER_NO_PEERS,
        ErrorCode::CLUSTER_NOT_ACTIVE,
        ErrorCode::CLUSTER_NOT_ASSIGNED,
        ErrorCode::CLUSTER_NOT_AVAILABLE,
        ErrorCode::CLUSTER_NOT_LEADER,
        ErrorCode::RAFT_GENERAL,
        ErrorCode::PEER_REMAP,
        ErrorCode::CLUSTER_SERVER_MEMBER_CHANGE_INFLIGHT,
    ];
    RETRYABLE.contains(&error.error_code())
}

/// A JetStream API error that may pass on retry ([`retryable`]), or no API error at all
/// (timeouts, no responders during an election, a dropped connection), is `Unavailable`: the
/// caller retries with the same msg id. Any other API error anywhere in the chain means the
/// server answered and refused for good: `Store` (fail closed).
fn classify(operation: &str, error: &(dyn std::error::Error + 'static)) -> LogError {
    let mut source = Some(error);
    while let Some(current) = source {
        if let Some(api) = current.downcast_ref::<jetstream::Error>() {
            if retryable(api) {
                return LogError::Unavailable(format!("{operation} (retry with the same msg_id): {error}"));
            }
            return LogError::Store(format!("{operation}: {error}"));
        }
        source = current.source();
    }
    LogError::Unavailable(format!("{operation}: {error}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(filter: &str) -> LogResult<FilterPlan> {
        plan_filter(Some(&SubjectFilter(filter.into())), &SubjectPrefix::default())
    }

    fn plan_under(prefix: &str, filter: &str) -> LogResult<FilterPlan> {
        plan_filter(Some(&SubjectFilter(filter.into())), &SubjectPrefix::new(prefix).expect("prefix"))
    }

    fn subject(filter: &str) -> Option<FilterPlan> {
        Some(FilterPlan::Subject(filter.into()))
    }

    #[test]
    fn filters_are_mapped_onto_the_stream() {
        assert_eq!(plan_filter(None, &SubjectPrefix::default()).ok(), subject(""));
        assert_eq!(plan(">").ok(), subject(""));
        assert_eq!(plan("anima.>").ok(), subject(""));
        assert_eq!(plan("anima.v1.>").ok(), subject(""));
        assert_eq!(plan("*.*.>").ok(), subject(""));
        assert_eq!(plan("anima.v1.agent.*").ok(), subject("anima.v1.agent.*"));
        assert_eq!(plan("*.*.agent.a1").ok(), subject("anima.v1.agent.a1"));
        assert_eq!(plan("other.>").ok(), Some(FilterPlan::Nothing));
        assert_eq!(plan("anima.v2.>").ok(), Some(FilterPlan::Nothing));
        assert_eq!(plan("anima.v1").ok(), Some(FilterPlan::Nothing));
        assert_eq!(plan("anima").ok(), Some(FilterPlan::Nothing));
        for malformed in ["", "anima..v1", "anima.>.x", "anima.v1.a*", "anima.v1.a b"] {
            assert!(matches!(plan(malformed), Err(LogError::Invalid(_))), "{malformed:?}");
        }
        // Another deployment's prefix, one token or three.
        assert_eq!(plan_under("acme", "acme.agent.*").ok(), subject("acme.agent.*"));
        assert_eq!(plan_under("acme", "*.agent.a1").ok(), subject("acme.agent.a1"));
        assert_eq!(plan_under("acme", "acme.>").ok(), subject(""));
        assert_eq!(plan_under("acme", "anima.v1.agent.a1").ok(), Some(FilterPlan::Nothing));
        assert_eq!(plan_under("acme", "acme").ok(), Some(FilterPlan::Nothing));
        assert_eq!(plan_under("a.b.c", "a.*.c.agent.x").ok(), subject("a.b.c.agent.x"));
        assert_eq!(plan_under("a.b.c", "a.b.>").ok(), subject(""));
        assert_eq!(plan_under("a.b.c", "a.b.d.agent.x").ok(), Some(FilterPlan::Nothing));
        assert_eq!(plan_under("a.b.c", "a.b").ok(), Some(FilterPlan::Nothing));
    }

    #[test]
    fn a_stream_without_an_encoding_record_uses_the_first_encoding() {
        let created = JetStreamConfig::default().stream_config();
        assert_eq!(recorded_encoding(&created, "ANIMA").ok(), Some(SubjectEncoding::NEWEST));
        let unrecorded = jetstream::stream::Config { metadata: Default::default(), ..created.clone() };
        assert_eq!(recorded_encoding(&unrecorded, "ANIMA").ok(), Some(SubjectEncoding::Underscore));
        let newer = jetstream::stream::Config {
            metadata: [(SUBJECT_ENCODING_METADATA_KEY.to_owned(), "9".to_owned())].into(),
            ..created
        };
        assert!(matches!(recorded_encoding(&newer, "ANIMA"), Err(LogError::Store(m)) if m.contains("\"9\"")));
        assert_eq!(stream_subject_prefix(&["acme.anima.>".into()]), SubjectPrefix::new("acme.anima").ok());
        assert_eq!(stream_subject_prefix(&["acme.*".into()]), None);
        assert_eq!(stream_subject_prefix(&["a.>".into(), "b.>".into()]), None);
    }

    fn api_error(code: usize, err_code: u64, description: &str) -> PublishError {
        let api: jetstream::Error = serde_json::from_value(serde_json::json!({
            "code": code, "err_code": err_code, "description": description,
        }))
        .expect("an API error");
        PublishError::with_source(PublishErrorKind::Other, api)
    }

    #[test]
    fn errors_that_pass_on_retry_are_unavailable_and_refusals_fail_closed() {
        let retry = [
            api_error(409, 10158, "duplicate message id is in process"),
            api_error(503, 10008, "JetStream system temporarily unavailable"),
            api_error(500, 10009, "JetStream cluster can not handle request"),
            api_error(500, 10041, "raft general error"),
        ];
        for error in retry {
            let shown = error.to_string();
            assert!(matches!(publish_error(error), LogError::Unavailable(_)), "{shown}");
        }
        let refused = [
            api_error(400, 10054, "message size exceeds maximum allowed"),
            api_error(400, 10047, "insufficient storage resources available"),
            api_error(503, 10039, "jetstream not enabled for account"),
        ];
        for error in refused {
            let shown = error.to_string();
            assert!(matches!(publish_error(error), LogError::Store(_)), "{shown}");
        }
        assert!(matches!(publish_error(PublishError::new(PublishErrorKind::TimedOut)), LogError::Unavailable(_)));
        assert!(matches!(publish_error(PublishError::new(PublishErrorKind::StreamNotFound)), LogError::Unavailable(_)));
    }

    #[test]
    fn only_the_in_process_conflict_is_recognised_as_one() {
        assert!(is_in_process(&api_error(409, 10158, "duplicate message id is in process")));
        assert!(!is_in_process(&api_error(503, 10008, "JetStream system temporarily unavailable")));
        assert!(!is_in_process(&PublishError::new(PublishErrorKind::TimedOut)));
    }

    #[test]
    fn a_msg_id_stuck_in_process_asks_for_one_step_down_per_pause() {
        let start = Instant::now();
        let at = |seconds: u64| start + Duration::from_secs(seconds);
        let mut watch = InProcessWatch::default();
        watch.in_process("e1", at(0));
        watch.in_process("e1", at(3));
        assert!(!watch.step_down_due(at(3)), "replication may take a moment");
        watch.in_process("e1", at(6));
        assert!(watch.step_down_due(at(6)), "in process for 6 s and still answered so");
        watch.in_process("e1", at(7));
        watch.in_process("e1", at(13));
        assert!(!watch.step_down_due(at(13)), "a step-down was asked 7 s ago");
        watch.in_process("e1", at(36));
        watch.in_process("e1", at(42));
        assert!(watch.step_down_due(at(42)), "the pause is over and the id is still stuck");

        // An id that got its ack, or that nobody retries any more, asks for nothing.
        let mut watch = InProcessWatch::default();
        watch.in_process("ok", at(0));
        watch.settled("ok");
        watch.in_process("given-up", at(0));
        watch.in_process("fresh", at(20));
        assert!(!watch.step_down_due(at(20)));
    }

    #[test]
    fn configuration_bounds_are_enforced() {
        assert!(JetStreamConfig::default().validate().is_ok());
        let short_window = JetStreamConfig { duplicate_window: Duration::from_secs(120), ..JetStreamConfig::default() };
        assert!(matches!(short_window.validate(), Err(LogError::Store(_))));
        let short_age = JetStreamConfig { max_age: Some(Duration::from_secs(3600)), ..JetStreamConfig::default() };
        assert!(matches!(short_age.validate(), Err(LogError::Store(_))));
        let no_window = JetStreamConfig { ack_window: 0, ..JetStreamConfig::default() };
        assert!(matches!(no_window.validate(), Err(LogError::Store(_))));
        let bad_name = JetStreamConfig { stream: "A.B".into(), ..JetStreamConfig::default() };
        assert!(matches!(bad_name.validate(), Err(LogError::Store(_))));
    }

    #[test]
    fn incompatible_streams_are_described() {
        let wanted = JetStreamConfig::default();
        assert!(incompatibilities(&wanted.stream_config(), &wanted).is_empty());
        let existing = jetstream::stream::Config {
            subjects: vec!["anima.>".into()],
            storage: StorageType::Memory,
            duplicate_window: Duration::from_secs(120),
            max_age: Duration::from_secs(3600),
            max_messages: 1000,
            ..wanted.stream_config()
        };
        let problems = incompatibilities(&existing, &wanted);
        assert_eq!(problems.len(), 5, "{problems:#?}");
    }
}
