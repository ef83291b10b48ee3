//! Helpers shared by the real-process test binaries (`system`, `bidir`, `memory`): the
//! small model shape, free ports, the child-process guard and the agent command line.
//!
//! Each test binary compiles this module on its own and uses only a subset of it, so the
//! items the other binaries use would warn as dead code here.
#![allow(dead_code)]

use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use kvlease_agent::kv::KvShape;

/// The model every test agent runs (matches [`shape_args`]).
pub(crate) const SHAPE: KvShape = KvShape {
    num_layers: 2,
    num_kv_heads: 4,
    block_size: 16,
    head_dim: 64,
};

/// The command-line flags for [`SHAPE`].
pub(crate) fn shape_args() -> [&'static str; 8] {
    [
        "--num-layers",
        "2",
        "--num-kv-heads",
        "4",
        "--head-dim",
        "64",
        "--block-size",
        "16",
    ]
}

/// A free loopback port.
pub(crate) fn free_port() -> u16 {
    // Below Linux's ephemeral range (32768..=60999 by default): a port the kernel handed
    // out for `bind(0)` is also what it hands to the next outgoing connection (the agents
    // open several per link), so a port picked that way can be taken before the agent
    // binds it. Here: a pseudo-random port in 20000..32768 that binds now and that this
    // process has not handed out before.
    use std::collections::hash_map::RandomState;
    use std::hash::BuildHasher;
    use std::sync::Mutex;
    static GIVEN: Mutex<Vec<u16>> = Mutex::new(Vec::new());
    let mut given = GIVEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let seed = RandomState::new();
    for attempt in 0u64..10_000 {
        let port = 20_000 + (seed.hash_one((std::process::id(), attempt)) % 12_768) as u16;
        if !given.contains(&port) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
            given.push(port);
            return port;
        }
    }
    // Invariant: binding port 0 on loopback succeeds on any test host.
    #[allow(clippy::expect_used)]
    let l = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    #[allow(clippy::expect_used)]
    l.local_addr().expect("bound socket has an address").port()
}

/// The log file path for child `name` of test binary `suite`.
pub(crate) fn log_path(suite: &str, name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("kvlease-{suite}-{}-{name}.log", std::process::id()))
}

/// The common agent command line: loopback `port`, `side_port`, engine id `name`, the
/// [`SHAPE`] flags, TCP transport with `memory`, logging at info to `log`, no auth token.
/// Callers append their own flags.
pub(crate) fn agent_command(
    bin: &str,
    name: &str,
    port: u16,
    side_port: u16,
    memory: &str,
    log: std::fs::File,
) -> Command {
    let mut cmd = Command::new(bin);
    cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args([
            "--side-channel-port",
            &side_port.to_string(),
            "--engine-id",
            name,
        ])
        .args(shape_args())
        // KVLEASE_TEST_TRANSPORT=auto runs the agents on shared memory (one host).
        .args(["--transport", &transport(), "--memory", memory])
        .env("RUST_LOG", "info")
        .env_remove("KVLEASE_AUTH_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
    cmd
}

/// A child process killed (SIGKILL) on drop.
pub(crate) struct Proc {
    pub(crate) child: Child,
    pub(crate) name: String,
    pub(crate) log: PathBuf,
}

impl Proc {
    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub(crate) fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() || std::env::var_os("KVLEASE_SYSTEM_LOGS").is_some() {
            eprintln!("--- {} log tail ---\n{}", self.name, self.log_tail());
        }
    }
}

/// A running process serving HTTP at `url`.
pub(crate) struct Agent {
    pub(crate) proc: Proc,
    pub(crate) url: String,
}

pub(crate) fn client() -> reqwest::Client {
    // Invariant: a default client with a timeout always builds.
    #[allow(clippy::expect_used)]
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        // Below the agents' 10 s idle keep-alive limit (see demo_load).
        .pool_idle_timeout(Duration::from_secs(4))
        .build()
        .expect("reqwest client")
}

pub(crate) async fn wait_healthy(c: &reqwest::Client, a: &mut Agent) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(r) = c.get(format!("{}/health", a.url)).send().await
            && r.status().is_success()
        {
            return Ok(());
        }
        if let Ok(Some(status)) = a.proc.child.try_wait() {
            bail!(
                "{} exited with {status}: {}",
                a.proc.name,
                a.proc.log_tail()
            );
        }
        ensure!(
            Instant::now() < deadline,
            "{} not healthy in 20 s",
            a.proc.name
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub(crate) async fn metrics(c: &reqwest::Client, a: &Agent) -> Result<String> {
    Ok(c.get(format!("{}/metrics", a.url))
        .send()
        .await?
        .text()
        .await?)
}

/// The value of the series `series` (name plus labels, exactly as exposed).
pub(crate) fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            (name == series).then(|| value.parse().ok()).flatten()
        })
        .unwrap_or(f64::NAN)
}

pub(crate) async fn metric_of(c: &reqwest::Client, a: &Agent, series: &str) -> Result<f64> {
    Ok(metric(&metrics(c, a).await?, series))
}

/// Polls `series` until `pred` holds, or fails after `timeout`.
pub(crate) async fn wait_metric(
    c: &reqwest::Client,
    a: &Agent,
    series: &str,
    timeout: Duration,
    pred: impl Fn(f64) -> bool,
) -> Result<Duration> {
    let start = Instant::now();
    loop {
        let v = metric_of(c, a, series).await?;
        if pred(v) {
            return Ok(start.elapsed());
        }
        ensure!(
            start.elapsed() < timeout,
            "{series} = {v} after {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

impl Agent {
    /// Guards `child` (logging to `log`) serving HTTP on loopback `port`.
    pub(crate) fn new(child: Child, name: &str, log: PathBuf, port: u16) -> Self {
        Self {
            proc: Proc {
                child,
                name: name.to_owned(),
                log,
            },
            url: format!("http://127.0.0.1:{port}"),
        }
    }
}

/// POSTs `body` to `{url}/v1/completions`; returns the status and the body text.
pub(crate) async fn post_completion(
    c: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
) -> Result<(u16, String)> {
    let r = c
        .post(format!("{url}/v1/completions"))
        .json(body)
        .send()
        .await?;
    let status = r.status().as_u16();
    Ok((status, r.text().await?))
}

/// Runs `bin` with `args` to its exit, killing it after 20 s.
pub(crate) fn run_to_exit(bin: &str, args: &[&str]) -> Result<Output> {
    let mut child = Command::new(bin)
        .args(args)
        .env_remove("KVLEASE_AUTH_TOKEN")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawning {bin}"))?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.try_wait()?.is_none() {
        if Instant::now() > deadline {
            child.kill()?;
            let _ = child.wait();
            bail!("{bin} {args:?} did not exit within 20 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(child.wait_with_output()?)
}

/// `(VmRSS in KiB, Threads)` of `pid`, from /proc.
pub(crate) fn rss_and_threads(pid: u32) -> Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> Result<u64> {
        let line = status
            .lines()
            .find(|l| l.starts_with(name))
            .with_context(|| format!("{name} missing"))?;
        Ok(line
            .split_whitespace()
            .nth(1)
            .context("no value")?
            .parse()?)
    };
    Ok((field("VmRSS:")?, field("Threads:")?))
}

/// `(threads, open file descriptors)` of `pid`, from /proc.
pub(crate) fn threads_and_fds(pid: u32) -> Result<(u64, u64)> {
    let (_, threads) = rss_and_threads(pid)?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))?.count() as u64;
    Ok((threads, fds))
}

/// This host's wall clock in µs since the Unix epoch (an engine instance now).
pub(crate) fn wall_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// The `--transport` the spawned agents get: `KVLEASE_TEST_TRANSPORT`, default `tcp`.
pub(crate) fn transport() -> String {
    std::env::var("KVLEASE_TEST_TRANSPORT").unwrap_or_else(|_| "tcp".to_owned())
}

pub(crate) mod system;

/// Whether the server closed `s` (EOF or reset) within `within`.
pub(crate) fn closed_within(s: &mut TcpStream, within: Duration) -> Result<bool> {
    let deadline = Instant::now() + within;
    let mut buf = [0u8; 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(false);
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut buf) {
            Ok(0) => return Ok(true),
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Ok(false);
            }
            Err(_) => return Ok(true),
        }
    }
}
