//! Per-source fairness on the HTTP listeners of a real `prefill-agent` and a real
//! `kvlease-proxy`: one address flooding idle connections holds its share of the
//! connection cap and no more (each connection beyond it closes the source's oldest idle
//! one), each of them is closed by the pre-header deadline, and `/health` from another
//! address is answered meanwhile.
//!
//! The flood comes from 127.0.0.1, the other source binds 127.0.0.2 (Linux routes all of
//! 127.0.0.0/8 to loopback). Every loop is bounded.

mod common;

use std::net::{IpAddr, Ipv4Addr, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use common::{Agent, Proc, agent_command, closed_within, free_port, log_path, metric};

const PREFILL: &str = env!("CARGO_BIN_EXE_prefill-agent");
const PROXY: &str = env!("CARGO_BIN_EXE_kvlease-proxy");

/// The caps every test below runs with: the flood's share is half of the slots.
const LIMIT_FLAGS: [&str; 6] = [
    "--http-max-connections",
    "8",
    "--http-max-connections-per-source",
    "4",
    "--http-header-timeout-ms",
    "4000",
];

/// A client whose connections come from `ip` and are not kept for reuse.
fn client_from(ip: Ipv4Addr) -> Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .local_address(IpAddr::V4(ip))
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(10))
        .build()?)
}

async fn wait_healthy(url: &str, proc: &mut Proc) -> Result<()> {
    let c = client_from(Ipv4Addr::new(127, 0, 0, 3))?;
    for _ in 0..400 {
        if c.get(format!("{url}/health"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            return Ok(());
        }
        ensure!(
            proc.child.try_wait()?.is_none(),
            "{} exited: {}",
            proc.name,
            proc.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("{} not healthy in 20 s: {}", proc.name, proc.log_tail())
}

/// Floods `port` with 8 idle connections from 127.0.0.1 (the whole global cap) and checks
/// that the newest 4 are kept (the per-source share: each one beyond it closed the
/// source's oldest idle one), `/health` from 127.0.0.2 is answered meanwhile, one more
/// from the flooding source again costs it its oldest, the kept ones are closed by the
/// header deadline, and `evicted_series` counts what was closed to make room.
async fn a_flood_from_one_source_takes_only_its_share(
    url: &str,
    port: u16,
    evicted_series: &str,
) -> Result<()> {
    let mut flood: Vec<TcpStream> = (0..8)
        .map(|_| TcpStream::connect(("127.0.0.1", port)))
        .collect::<std::io::Result<_>>()?;
    let flooded = Instant::now();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut kept = Vec::new();
    let mut closed = Vec::new();
    for (i, mut s) in flood.drain(..).enumerate() {
        if closed_within(&mut s, Duration::from_millis(200))? {
            closed.push(i);
        } else {
            kept.push(s);
        }
    }
    ensure!(
        closed == [0, 1, 2, 3],
        "closed {closed:?} of 8 idle connections from one source; its share is the newest 4"
    );

    // Another source is served while the flood holds its share.
    let other = client_from(Ipv4Addr::new(127, 0, 0, 2))?;
    let health = other
        .get(format!("{url}/health"))
        .send()
        .await
        .context("/health from 127.0.0.2 under the flood")?;
    ensure!(health.status().is_success(), "/health: {}", health.status());
    // One more from the flooding source costs it its oldest kept connection.
    let mut more = TcpStream::connect(("127.0.0.1", port))?;
    ensure!(
        closed_within(&mut kept[0], Duration::from_millis(500))?,
        "the source's oldest idle connection was kept past its share"
    );
    ensure!(
        !closed_within(&mut more, Duration::from_millis(200))?,
        "the newest connection was closed"
    );
    kept[0] = more;
    ensure!(
        flooded.elapsed() < Duration::from_secs(4),
        "the checks above took {:?}, past the header deadline",
        flooded.elapsed()
    );

    // The pre-header deadline frees the flood's slots (4 s after accept).
    for s in &mut kept {
        ensure!(
            closed_within(s, Duration::from_secs(10))?,
            "an idle connection outlived the header deadline"
        );
    }
    ensure!(
        flooded.elapsed() >= Duration::from_secs(3),
        "idle connections closed after {:?}, before the 4 s header deadline",
        flooded.elapsed()
    );
    let text = other
        .get(format!("{url}/metrics"))
        .send()
        .await?
        .text()
        .await?;
    let evicted = metric(&text, evicted_series);
    ensure!(evicted >= 5.0, "{evicted_series} = {evicted}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_http_a_flood_from_one_source_leaves_health_answerable() -> Result<()> {
    let port = free_port();
    let log = log_path("fairness", "p");
    let mut cmd = agent_command(
        PREFILL,
        "fair-p",
        port,
        free_port(),
        "host",
        std::fs::File::create(&log)?,
    );
    cmd.args(LIMIT_FLAGS);
    let mut agent = Agent::new(cmd.spawn().context("spawn prefill-agent")?, "p", log, port);
    wait_healthy(&agent.url, &mut agent.proc).await?;
    a_flood_from_one_source_takes_only_its_share(
        &agent.url,
        port,
        "kvlease_http_connections_evicted_total",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_http_a_flood_from_one_source_leaves_health_answerable() -> Result<()> {
    let port = free_port();
    let log = log_path("fairness", "proxy");
    let child = std::process::Command::new(PROXY)
        .args(["--port", &port.to_string()])
        // Nothing listens there: /health does not ask the upstreams.
        .args([
            "--prefill",
            "http://127.0.0.1:9",
            "--decode",
            "http://127.0.0.1:9",
        ])
        .args(LIMIT_FLAGS)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .spawn()
        .context("spawn kvlease-proxy")?;
    let mut proxy = Agent::new(child, "proxy", log, port);
    wait_healthy(&proxy.url, &mut proxy.proc).await?;
    a_flood_from_one_source_takes_only_its_share(
        &proxy.url,
        port,
        "kvlease_proxy_http_connections_evicted_total",
    )
    .await
}
