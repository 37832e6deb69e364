//! Configuration: a TOML file, overridden by flags (each with an environment twin). Everything
//! that drives decisions (agents and their identities) is appended to the log at start-up when it
//! differs from what the log holds, so replay sees the configuration each decision was made under.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use serde::Deserialize;

use anima_engine::subject::SubjectPrefix;
use anima_projections::memory::MemoryConfig;

use crate::auth::Role;

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// gRPC listen address. Without tokens only loopback addresses are accepted.
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// Data directory: the embedded log (when no NATS URL is given) and the checkpoints.
    #[serde(default = "default_data")]
    pub data: PathBuf,
    /// NATS server URL, or a comma-separated list of a cluster's servers; when set the log is the
    /// JetStream stream `stream` there.
    #[serde(default)]
    pub nats: Option<String>,
    #[serde(default = "default_stream")]
    pub stream: String,
    /// The first tokens of every subject the engine writes (`anima.v1` by default): the stream
    /// captures `<subject_prefix>.>`. A second deployment on the same NATS account needs its own
    /// stream name and its own prefix. The embedded log records it too, and both refuse to open
    /// an existing log under another prefix.
    #[serde(default = "default_subject_prefix")]
    pub subject_prefix: String,
    /// JetStream replicas of a newly created stream (3 in a cluster).
    #[serde(default = "default_replicas")]
    pub replicas: usize,
    #[serde(default)]
    pub tokens: Vec<TokenConfig>,
    #[serde(default)]
    pub agents: Vec<AgentConfig>,
    #[serde(default)]
    pub runner: RunnerSettings,
    #[serde(default)]
    pub wakes: WakeSettings,
    /// The memory pass. Appended to the log at start-up when it differs.
    #[serde(default, rename = "memoryCoherence")]
    pub memory_coherence: MemoryCoherenceSettings,
    /// People no agent may DM or @mention, per workspace (Slack team id or chat tenant id):
    /// `[doNotContact]` with `T1 = ["U123", "U456"]`. Appended to the log at start-up when it
    /// differs.
    #[serde(default, rename = "doNotContact")]
    pub do_not_contact: std::collections::BTreeMap<String, Vec<String>>,
    /// Prometheus metrics (`GET /metrics`) on their own HTTP listener; off when unset. The
    /// metrics carry no content and no ids, so the listener has no auth: bind it where only the
    /// scraper reaches it.
    #[serde(default)]
    pub metrics_listen: Option<SocketAddr>,
    /// PEM certificate chain for gRPC over TLS; set together with `tls_key`.
    #[serde(default)]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `tls_cert`.
    #[serde(default)]
    pub tls_key: Option<PathBuf>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenConfig {
    /// The bearer token itself, or...
    #[serde(default)]
    pub token: Option<String>,
    /// ...its SHA-256 in hex, so the file need not hold the secret.
    #[serde(default)]
    pub token_sha256: Option<String>,
    pub role: Role,
    /// For the runtime role: the agents this token may act for.
    #[serde(default)]
    pub agents: Vec<String>,
    /// A label for logs (the token itself is never logged).
    #[serde(default)]
    pub name: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    pub id: String,
    #[serde(default)]
    pub slack_bot_user_id: String,
    #[serde(default)]
    pub slack_bot_id: String,
    #[serde(default)]
    pub display_name: String,
    /// The agent's user id on the generic chat platform: its chat rows are its own, and chat
    /// messages listing it among their mentions mention the agent.
    #[serde(default)]
    pub chat_user_id: String,
}

/// `[memoryCoherence]`, with the key names of the reference product.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct MemoryCoherenceSettings {
    /// Only an explicit `false` disables passes.
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// Local time `HH:MM` the window opens.
    #[serde(default = "default_window_start")]
    pub window_start: String,
    /// 1..=1440.
    #[serde(default = "default_window_minutes")]
    pub window_duration_minutes: i64,
    /// 1..=100 passes queued or running at once, fleet-wide.
    #[serde(default = "default_max_concurrent")]
    pub max_concurrent: i64,
    /// IANA zone name; one zone for the whole deployment.
    #[serde(default = "default_timezone")]
    pub timezone: String,
    /// Agents that get passes; empty: all.
    #[serde(default)]
    pub scope_agent_ids: Vec<String>,
    /// A `MEMORY.md` larger than this gets the consolidation form of the pass's wake text.
    #[serde(default = "default_consolidation_threshold_bytes")]
    pub consolidation_threshold_bytes: u64,
    /// Seconds between scheduler ticks; 0 runs no scheduler on this instance.
    #[serde(default = "default_tick_seconds")]
    pub tick_seconds: u64,
}

impl Default for MemoryCoherenceSettings {
    fn default() -> Self {
        toml::from_str("").expect("the empty memoryCoherence section is valid")
    }
}

impl MemoryCoherenceSettings {
    /// The checked configuration; the error names the key (`memoryCoherence.<key>: ...`).
    pub fn to_config(&self) -> anyhow::Result<MemoryConfig> {
        MemoryConfig::new(
            self.enabled,
            &self.window_start,
            self.window_duration_minutes,
            self.max_concurrent,
            &self.timezone,
            &self.scope_agent_ids,
            self.consolidation_threshold_bytes,
        )
        .map_err(|e| anyhow::anyhow!("{e}"))
    }

    pub fn tick(&self) -> Option<Duration> {
        (self.tick_seconds > 0).then(|| Duration::from_secs(self.tick_seconds))
    }
}

fn default_true() -> bool {
    true
}
fn default_window_start() -> String {
    anima_projections::memory_slot::WINDOW_START_DEFAULT.to_owned()
}
fn default_window_minutes() -> i64 {
    i64::from(anima_projections::memory_slot::WINDOW_MINUTES_DEFAULT)
}
fn default_max_concurrent() -> i64 {
    i64::from(anima_projections::memory::MAX_CONCURRENT_DEFAULT)
}
fn default_timezone() -> String {
    anima_projections::memory_slot::TIMEZONE_DEFAULT.to_owned()
}
fn default_consolidation_threshold_bytes() -> u64 {
    anima_projections::memory::CONSOLIDATION_THRESHOLD_BYTES_DEFAULT
}
fn default_tick_seconds() -> u64 {
    anima_engine::memory::TICK_DEFAULT.as_secs()
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunnerSettings {
    #[serde(default = "default_checkpoint_every_events")]
    pub checkpoint_every_events: u64,
    #[serde(default = "default_checkpoint_interval_ms")]
    pub checkpoint_interval_ms: u64,
    /// How long a request waits for the fold's verdict before `UNAVAILABLE`.
    #[serde(default = "default_verdict_wait_ms")]
    pub verdict_wait_ms: u64,
    /// Memory for sled's page cache of the data dir, MiB (sled's own default, 1 GiB, is never
    /// used). sled is told less, since it counts pages by their size on disk
    /// (`anima_engine::data_dir::open`).
    #[serde(default = "default_sled_cache_mib")]
    pub sled_cache_mib: u64,
    /// Memory for the checkpoint store's block cache, MiB (`anima_engine::checkpoint`).
    #[serde(default = "default_checkpoint_cache_mib")]
    pub checkpoint_cache_mib: u64,
    /// Bodies of recent journal rows kept in memory for rendering, MiB; older ones are read from
    /// the log.
    #[serde(default = "default_body_cache_mib")]
    pub body_cache_mib: u64,
    /// The one bound on what the engine keeps in memory, MiB: sled's cache, the checkpoint
    /// store's cache, the body cache and the fold's state together, with a quarter left for
    /// everything else (requests, buffers, the checkpoint store's write buffer, the allocator's
    /// slack). The fold's state gets what the three caches leave of the other three quarters; beyond it, journal rows and message identities of idle surfaces leave
    /// memory and are read back from the checkpoint when needed. While the process's resident
    /// memory is over nine tenths of this budget, the state's share is lowered by the excess (to
    /// a quarter of it at least), and it grows back when there is room.
    #[serde(default = "default_memory_budget_mib")]
    pub memory_budget_mib: u64,
    /// Let the allocator's memory land in transparent huge pages (2 MiB). Off by default: under
    /// `anima-load` the engine ended 60 s runs with 8–15% less RSS without them, at a throughput
    /// level within the noise (README, "Load it"), and a start never waits on the kernel zeroing
    /// them.
    #[serde(default)]
    pub transparent_huge_pages: bool,
}

impl RunnerSettings {
    /// What the fold's state may take, bytes (see `memory_budget_mib`).
    pub fn state_bytes_max(&self) -> u64 {
        (self.memory_budget_mib * 3 / 4).saturating_sub(self.caches_mib()) * 1024 * 1024
    }

    /// The caches the budget holds beside the fold's state, MiB.
    pub fn caches_mib(&self) -> u64 {
        self.sled_cache_mib + self.checkpoint_cache_mib + self.body_cache_mib
    }
}

impl Default for RunnerSettings {
    fn default() -> Self {
        RunnerSettings {
            checkpoint_every_events: default_checkpoint_every_events(),
            checkpoint_interval_ms: default_checkpoint_interval_ms(),
            verdict_wait_ms: default_verdict_wait_ms(),
            sled_cache_mib: default_sled_cache_mib(),
            checkpoint_cache_mib: default_checkpoint_cache_mib(),
            body_cache_mib: default_body_cache_mib(),
            memory_budget_mib: default_memory_budget_mib(),
            transparent_huge_pages: false,
        }
    }
}

/// `[wakes]`: liveness of claimed and running wakes.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WakeSettings {
    /// A claim not started within this long (log time) is re-queued by the recovery loop, so a
    /// worker that died between Claim and Start does not leave its agent stuck.
    #[serde(default = "default_claim_lease_seconds")]
    pub claim_lease_seconds: u64,
    /// How often the recovery loop looks for expired claims and silent running wakes.
    #[serde(default = "default_recovery_tick_seconds")]
    pub recovery_tick_seconds: u64,
}

impl Default for WakeSettings {
    fn default() -> Self {
        WakeSettings {
            claim_lease_seconds: default_claim_lease_seconds(),
            recovery_tick_seconds: default_recovery_tick_seconds(),
        }
    }
}

/// Bounds of `[wakes]` and `[runner]` values, checked at start-up.
pub const CLAIM_LEASE_SECONDS_MAX: u64 = 86_400;
pub const RECOVERY_TICK_SECONDS_MAX: u64 = 3_600;
pub const CACHE_MIB_MAX: u64 = 64 * 1024;

fn default_claim_lease_seconds() -> u64 {
    u64::from(anima_projections::wake::CLAIM_LEASE_DEFAULT_SECONDS)
}
fn default_recovery_tick_seconds() -> u64 {
    30
}
fn default_sled_cache_mib() -> u64 {
    anima_engine::data_dir::SLED_CACHE_BYTES_DEFAULT / (1024 * 1024)
}
fn default_checkpoint_cache_mib() -> u64 {
    anima_engine::checkpoint::CHECKPOINT_CACHE_BYTES_DEFAULT / (1024 * 1024)
}
fn default_body_cache_mib() -> u64 {
    64
}
fn default_memory_budget_mib() -> u64 {
    1024
}

fn default_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 50051))
}
fn default_data() -> PathBuf {
    PathBuf::from("./data")
}
fn default_stream() -> String {
    "ANIMA".into()
}
fn default_subject_prefix() -> String {
    anima_engine::subject::SUBJECT_PREFIX_DEFAULT.into()
}
fn default_replicas() -> usize {
    1
}
fn default_checkpoint_every_events() -> u64 {
    2_000
}
fn default_checkpoint_interval_ms() -> u64 {
    5_000
}
fn default_verdict_wait_ms() -> u64 {
    10_000
}

impl Default for Config {
    fn default() -> Self {
        toml::from_str("").expect("the empty config is valid")
    }
}

impl Config {
    /// Reads a TOML config file.
    pub fn load(path: &Path) -> anyhow::Result<Config> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading config {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("parsing config {}", path.display()))
    }

    /// Checks what the file cannot express by its types. Errors name the key.
    pub fn validate(&self) -> anyhow::Result<()> {
        let bounded = [
            ("wakes.claim_lease_seconds", self.wakes.claim_lease_seconds, 1, CLAIM_LEASE_SECONDS_MAX),
            ("wakes.recovery_tick_seconds", self.wakes.recovery_tick_seconds, 1, RECOVERY_TICK_SECONDS_MAX),
            ("runner.sled_cache_mib", self.runner.sled_cache_mib, 1, CACHE_MIB_MAX),
            ("runner.checkpoint_cache_mib", self.runner.checkpoint_cache_mib, 1, CACHE_MIB_MAX),
            ("runner.body_cache_mib", self.runner.body_cache_mib, 1, CACHE_MIB_MAX),
            ("runner.memory_budget_mib", self.runner.memory_budget_mib, 64, CACHE_MIB_MAX),
        ];
        for (key, value, min, max) in bounded {
            if !(min..=max).contains(&value) {
                bail!("{key}: expected {min}..={max}, got {value}");
            }
        }
        let caches = self.runner.caches_mib();
        if caches * 2 > self.runner.memory_budget_mib {
            bail!(
                "runner.memory_budget_mib: {} MiB leaves too little for the fold's state beside \
                 sled_cache_mib + checkpoint_cache_mib + body_cache_mib = {caches} MiB (the caches may \
                 take at most half)",
                self.runner.memory_budget_mib
            );
        }
        match (&self.tls_cert, &self.tls_key) {
            (Some(_), None) => {
                bail!("tls_key: missing; tls_cert is set, and TLS needs both (or neither, for plain text)")
            }
            (None, Some(_)) => {
                bail!("tls_cert: missing; tls_key is set, and TLS needs both (or neither, for plain text)")
            }
            _ => {}
        }
        if self.tokens.is_empty() && !self.listen.ip().is_loopback() {
            bail!(
                "listen: {} is not a loopback address and no tokens are configured; add [[tokens]] or listen on 127.0.0.1",
                self.listen
            );
        }
        for (index, token) in self.tokens.iter().enumerate() {
            match (&token.token, &token.token_sha256) {
                (Some(t), None) if t.len() >= 16 => {}
                (Some(_), None) => bail!("tokens[{index}].token: must be at least 16 characters"),
                (None, Some(h)) if h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()) => {}
                (None, Some(_)) => bail!("tokens[{index}].token_sha256: must be 64 hex digits"),
                _ => bail!("tokens[{index}]: set exactly one of token, token_sha256"),
            }
            if token.role == Role::Runtime && token.agents.is_empty() {
                bail!("tokens[{index}].agents: a runtime token must name the agents it acts for");
            }
        }
        // One secret under two entries would give whoever holds it the first entry's role and
        // silently ignore the second: refuse it, naming both (never the secret).
        let mut digests: std::collections::BTreeMap<String, usize> = std::collections::BTreeMap::new();
        for (index, token) in self.tokens.iter().enumerate() {
            let digest = match (&token.token, &token.token_sha256) {
                (Some(secret), _) => hex_sha256(secret),
                (None, Some(hex_digest)) => hex_digest.to_ascii_lowercase(),
                (None, None) => continue,
            };
            if let Some(first) = digests.insert(digest, index) {
                bail!(
                    "tokens[{index}]: the same token as tokens[{first}] (roles {:?} and {:?}); every entry needs its own secret",
                    self.tokens[first].role,
                    token.role
                );
            }
        }
        let mut agent_ids: std::collections::BTreeMap<&str, usize> = std::collections::BTreeMap::new();
        for (index, agent) in self.agents.iter().enumerate() {
            if let Some(first) = agent_ids.insert(agent.id.as_str(), index) {
                bail!(
                    "agents[{index}].id: {} is already agents[{first}].id; each [[agents]] entry needs its own id",
                    anima_engine::validate::echo(&agent.id)
                );
            }
        }
        if let Some(metrics_listen) = self.metrics_listen {
            if self.tokens.is_empty() && !metrics_listen.ip().is_loopback() {
                bail!(
                    "metrics_listen (--metrics-listen, ANIMA_METRICS_LISTEN): {metrics_listen} is not a loopback address and no \
                     tokens are configured; a server without tokens serves only this machine, its metrics too"
                );
            }
        }
        for (index, agent) in self.agents.iter().enumerate() {
            if agent.id.is_empty()
                || agent.id.len() > 128
                || agent.id.chars().any(|c| c.is_whitespace() || c.is_control())
            {
                bail!("agents[{index}].id: must be 1..=128 bytes without whitespace");
            }
            for (key, value) in [("slack_bot_user_id", &agent.slack_bot_user_id), ("slack_bot_id", &agent.slack_bot_id)]
            {
                if !value.bytes().all(|b| b.is_ascii_alphanumeric()) || value.len() > 64 {
                    bail!("agents[{index}].{key}: must be ASCII letters and digits");
                }
            }
            if agent.chat_user_id.len() > 96 || agent.chat_user_id.chars().any(|c| c.is_whitespace() || c.is_control())
            {
                bail!("agents[{index}].chat_user_id: must be at most 96 bytes without whitespace");
            }
        }
        if let Some(nats) = &self.nats {
            // Checked here so a typo reads as the setting it is, not as "event log unavailable".
            anima_engine::log::jetstream::parse_servers(nats)
                .map_err(|e| anyhow::anyhow!("nats (--nats, ANIMA_NATS): {e}"))?;
        }
        self.checked_subject_prefix()?;
        if self.replicas == 0 || self.replicas > 5 {
            bail!("replicas: must be 1..=5");
        }
        if self.runner.checkpoint_every_events == 0 {
            bail!("runner.checkpoint_every_events: must be at least 1");
        }
        self.memory_coherence.to_config()?;
        self.do_not_contact_config()?;
        Ok(())
    }

    /// The do-not-contact lists, checked; the error names the workspace and the entry.
    pub fn do_not_contact_config(&self) -> anyhow::Result<anima_projections::do_not_contact::DoNotContact> {
        use anima_projections::proto::{DoNotContactConfigured, DoNotContactList};
        let lists = self
            .do_not_contact
            .iter()
            .map(|(workspace, users)| DoNotContactList { workspace_id: workspace.clone(), user_ids: users.clone() })
            .collect();
        anima_projections::do_not_contact::DoNotContact::from_proto(&DoNotContactConfigured { lists })
            .map_err(|e| anyhow::anyhow!("doNotContact: {e}"))
    }

    /// The subject prefix, checked; the error names the setting and its flag and variable.
    pub fn checked_subject_prefix(&self) -> anyhow::Result<SubjectPrefix> {
        SubjectPrefix::new(&self.subject_prefix).map_err(|e| {
            anyhow::anyhow!(
                "subject_prefix (--subject-prefix, ANIMA_SUBJECT_PREFIX): {} {e}",
                anima_engine::validate::echo(&self.subject_prefix)
            )
        })
    }

    /// The certificate and key files when TLS is configured (`validate` checked they come together).
    pub fn tls_files(&self) -> Option<(&Path, &Path)> {
        Some((self.tls_cert.as_deref()?, self.tls_key.as_deref()?))
    }

    pub fn checkpoint_interval(&self) -> Duration {
        Duration::from_millis(self.runner.checkpoint_interval_ms.max(10))
    }
}

/// Lowercase hex SHA-256 of a token, to compare secrets with `token_sha256` entries.
fn hex_sha256(secret: &str) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(secret.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check(toml_text: &str, expect: Result<(), &str>) {
        let config: Config = toml::from_str(toml_text).expect("parses");
        match (config.validate(), expect) {
            (Ok(()), Ok(())) => {}
            (Err(error), Err(start)) => assert!(error.to_string().starts_with(start), "{error}"),
            (got, want) => panic!("validate gave {got:?}, expected {want:?}"),
        }
    }

    const TOKEN: &str = "[[tokens]]\ntoken = \"admin-token-0123456789\"\nrole = \"admin\"\n";

    #[test]
    fn tls_needs_both_files_and_names_the_missing_one() {
        check("tls_cert = \"cert.pem\"", Err("tls_key: missing"));
        check("tls_key = \"key.pem\"", Err("tls_cert: missing"));
        check("tls_cert = \"cert.pem\"\ntls_key = \"key.pem\"", Ok(()));
    }

    #[test]
    fn tls_does_not_lift_the_loopback_rule_without_tokens() {
        let tls = "tls_cert = \"cert.pem\"\ntls_key = \"key.pem\"\n";
        check(&format!("listen = \"0.0.0.0:50051\"\n{tls}"), Err("listen: 0.0.0.0:50051 is not a loopback address"));
        check(&format!("listen = \"0.0.0.0:50051\"\n{tls}{TOKEN}"), Ok(()));
        check(&format!("listen = \"0.0.0.0:50051\"\n{TOKEN}"), Ok(()));
        check(&format!("listen = \"[::1]:50051\"\n{tls}"), Ok(()));
    }

    #[test]
    fn one_secret_under_two_entries_is_refused_naming_both() {
        let twice = "[[tokens]]\ntoken = \"shared-secret-0123456789\"\nrole = \"analytics\"\n\
                     [[tokens]]\ntoken = \"shared-secret-0123456789\"\nrole = \"admin\"\n";
        check(twice, Err("tokens[1]: the same token as tokens[0] (roles Analytics and Admin)"));
        let hashed = format!(
            "[[tokens]]\ntoken = \"shared-secret-0123456789\"\nrole = \"replay\"\n\
             [[tokens]]\ntoken_sha256 = \"{}\"\nrole = \"admin\"\n",
            hex_sha256("shared-secret-0123456789").to_ascii_uppercase()
        );
        check(&hashed, Err("tokens[1]: the same token as tokens[0]"));
        let distinct = "[[tokens]]\ntoken = \"first-secret-0123456789\"\nrole = \"analytics\"\n\
                        [[tokens]]\ntoken = \"other-secret-0123456789\"\nrole = \"admin\"\n";
        check(distinct, Ok(()));
        let error = toml::from_str::<Config>(twice).expect("parses").validate().expect_err("refused").to_string();
        assert!(!error.contains("shared-secret"), "the secret is never shown: {error}");
    }

    #[test]
    fn a_duplicate_agent_id_is_refused() {
        check("[[agents]]\nid = \"ada\"\n[[agents]]\nid = \"bob\"\n", Ok(()));
        check(
            "[[agents]]\nid = \"ada\"\n[[agents]]\nid = \"bob\"\n[[agents]]\nid = \"ada\"\n",
            Err("agents[2].id: \"ada\" is already agents[0].id"),
        );
    }

    #[test]
    fn metrics_off_loopback_need_tokens() {
        check("metrics_listen = \"127.0.0.1:9090\"", Ok(()));
        check(
            "metrics_listen = \"0.0.0.0:9090\"",
            Err("metrics_listen (--metrics-listen, ANIMA_METRICS_LISTEN): 0.0.0.0:9090 is not a loopback address"),
        );
        check(&format!("metrics_listen = \"0.0.0.0:9090\"\n{TOKEN}"), Ok(()));
    }

    #[test]
    fn nats_takes_a_server_list_and_a_bad_entry_names_the_setting() {
        check("nats = \"nats://127.0.0.1:4222\"", Ok(()));
        check("nats = \"nats://127.0.0.1:4222,nats://127.0.0.1:4223, 127.0.0.1:4224\"", Ok(()));
        check(
            "nats = \"nats://127.0.0.1:4222,nats://127.0.0.1:99999\"",
            Err("nats (--nats, ANIMA_NATS): \"nats://127.0.0.1:99999\" is not a NATS server URL"),
        );
        check("nats = \"http://127.0.0.1:4222\"", Err("nats (--nats, ANIMA_NATS): \"http://127.0.0.1:4222\" is not"));
        check("nats = \"nats://127.0.0.1:4222,\"", Err("nats (--nats, ANIMA_NATS): server 2 of 2 is empty"));
        check("nats = \"\"", Err("nats (--nats, ANIMA_NATS): must name at least one server"));
        let long = format!("nats = \"nats://{}:4222\"", "h".repeat(100_000));
        let config: Config = toml::from_str(&long).expect("parses");
        let error = config.validate().expect_err("a 100 kB host is refused").to_string();
        assert!(error.len() < 400, "the refusal echoes at most a clipped part: {} bytes", error.len());
    }

    #[test]
    fn the_subject_prefix_is_checked_and_a_bad_one_names_the_setting() {
        assert_eq!(Config::default().checked_subject_prefix().expect("default").as_str(), "anima.v1");
        check("subject_prefix = \"acme.anima.v1\"", Ok(()));
        let setting = "subject_prefix (--subject-prefix, ANIMA_SUBJECT_PREFIX):";
        check("subject_prefix = \"\"", Err(&format!("{setting} \"\" must not be empty")));
        check("subject_prefix = \"acme.*\"", Err(&format!("{setting} \"acme.*\" token 1 contains '*'")));
        check("subject_prefix = \"acme..v1\"", Err(&format!("{setting} \"acme..v1\" token 1 is empty")));
        check("subject_prefix = \"$JS.acme\"", Err(&format!("{setting} \"$JS.acme\" token 0 contains '$'")));
        check("subject_prefix = \"a.b.c.d.e.f.g.h.i\"", Err(&format!("{setting} \"a.b.c.d.e.f.g.h.i\" has 9")));
        let long = format!("subject_prefix = \"{}\"", "a".repeat(65));
        check(&long, Err(setting));
    }

    #[test]
    fn do_not_contact_lists_are_checked_and_errors_name_the_workspace() {
        check("[doNotContact]\nT1 = [\"U1\", \"U2\"]\nT2 = []", Ok(()));
        check("[doNotContact]\nT1 = [\"\"]", Err("doNotContact: workspace T1: entry 0 is empty"));
        check("[doNotContact]\nT1 = [\"U 1\"]", Err("doNotContact: workspace T1: entry 0 contains whitespace"));
        let long = format!("[doNotContact]\nT1 = [\"{}\"]", "U".repeat(97));
        check(&long, Err("doNotContact: workspace T1: entry 0 is 97 bytes"));
    }

    #[test]
    fn memory_coherence_values_are_checked_and_errors_name_the_key() {
        check("[memoryCoherence]\nwindowStart = \"25:00\"", Err("memoryCoherence.windowStart:"));
        check("[memoryCoherence]\nwindowDurationMinutes = 0", Err("memoryCoherence.windowDurationMinutes:"));
        check("[memoryCoherence]\nwindowDurationMinutes = 1441", Err("memoryCoherence.windowDurationMinutes:"));
        check("[memoryCoherence]\nmaxConcurrent = 0", Err("memoryCoherence.maxConcurrent:"));
        check("[memoryCoherence]\nmaxConcurrent = 101", Err("memoryCoherence.maxConcurrent:"));
        check("[memoryCoherence]\ntimezone = \"Mars/Olympus\"", Err("memoryCoherence.timezone:"));
        check(
            "[memoryCoherence]\nenabled = false\nwindowStart = \"23:30\"\nwindowDurationMinutes = 1440\n\
             maxConcurrent = 100\ntimezone = \"Australia/Lord_Howe\"\nscopeAgentIds = [\"ada\"]",
            Ok(()),
        );
    }

    #[test]
    fn memory_coherence_defaults_follow_the_design() {
        let config = Config::default().memory_coherence.to_config().expect("defaults are valid");
        assert!(config.enabled, "only an explicit false disables");
        assert_eq!(config.settings.window_start_label(), "05:00");
        assert_eq!(config.settings.window_minutes, 120);
        assert_eq!(config.max_concurrent, 1);
        assert_eq!(config.settings.timezone, "UTC");
        assert!(config.scope_agent_ids.is_empty());
        assert_eq!(config.consolidation_threshold_bytes, 20 * 1024);
    }
}
