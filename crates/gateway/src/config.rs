//! Configuration: a TOML file, overridden by flags (each with an environment twin). Everything
//! that drives decisions (agents and their identities) is appended to the log at start-up when it
//! differs from what the log holds, so replay sees the configuration each decision was made under.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use serde::Deserialize;

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
    /// NATS URL; when set the log is the JetStream stream `stream` there.
    #[serde(default)]
    pub nats: Option<String>,
    #[serde(default = "default_stream")]
    pub stream: String,
    /// JetStream replicas of a newly created stream (3 in a cluster).
    #[serde(default = "default_replicas")]
    pub replicas: usize,
    #[serde(default)]
    pub tokens: Vec<TokenConfig>,
    #[serde(default)]
    pub agents: Vec<AgentConfig>,
    #[serde(default)]
    pub runner: RunnerSettings,
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
}

impl Default for RunnerSettings {
    fn default() -> Self {
        RunnerSettings {
            checkpoint_every_events: default_checkpoint_every_events(),
            checkpoint_interval_ms: default_checkpoint_interval_ms(),
            verdict_wait_ms: default_verdict_wait_ms(),
        }
    }
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
fn default_replicas() -> usize {
    1
}
fn default_checkpoint_every_events() -> u64 {
    10_000
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
        if self.replicas == 0 || self.replicas > 5 {
            bail!("replicas: must be 1..=5");
        }
        if self.runner.checkpoint_every_events == 0 {
            bail!("runner.checkpoint_every_events: must be at least 1");
        }
        Ok(())
    }

    pub fn checkpoint_interval(&self) -> Duration {
        Duration::from_millis(self.runner.checkpoint_interval_ms.max(10))
    }
}
