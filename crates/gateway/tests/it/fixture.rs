//! The whole server in this process, on its own embedded log in a temp dir, with an admin token
//! and two agents (ada, bob); a connection to it.

use anima_gateway::server::RunningServer;
use tonic::transport::Channel;

pub const ADMIN_TOKEN: &str = "admin-token-0123456789";

/// ada is in the memory-pass scope, so `Memory.Plan` and `Memory.Status` have something to say;
/// no scheduler runs (`tickSeconds = 0`), so no pass mixes into the wakes the tests claim.
pub const CONFIG: &str = r#"
[[tokens]]
name = "admin"
token = "admin-token-0123456789"
role = "admin"

[[agents]]
id = "ada"
slack_bot_user_id = "U0ADA"
slack_bot_id = "B0ADA"
chat_user_id = "ou_ada"

[[agents]]
id = "bob"
slack_bot_user_id = "U0BOB"
slack_bot_id = "B0BOB"
chat_user_id = "ou_bob"

[memoryCoherence]
scopeAgentIds = ["ada"]
tickSeconds = 0
"#;

pub struct Fixture {
    pub server: RunningServer,
    pub channel: Channel,
    pub dir: tempfile::TempDir,
}

impl Fixture {
    pub async fn start() -> Fixture {
        let dir = tempfile::tempdir().expect("temp dir");
        let config_path = dir.path().join("anima.toml");
        std::fs::write(&config_path, CONFIG).expect("write the config");
        let mut config = anima_gateway::config::Config::load(&config_path).expect("the config");
        config.data = dir.path().join("data");
        config.listen = "127.0.0.1:0".parse().expect("an address");
        let server = anima_gateway::server::start(config).await.expect("the server starts");
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.local_addr))
            .expect("a URI")
            .connect()
            .await
            .expect("connect");
        Fixture { server, channel, dir }
    }
}

/// Puts the admin token on every request.
pub fn admin(mut request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
    request.metadata_mut().insert("authorization", format!("Bearer {ADMIN_TOKEN}").parse().expect("ascii"));
    Ok(request)
}
