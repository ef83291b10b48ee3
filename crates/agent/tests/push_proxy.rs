//! Push mode end to end: real push-mode P and D agents (`--transfer-mode push`) behind the
//! real `kvlease-proxy --transfer-mode push`, over TCP and over shared memory: every answer
//! verified (digest and text), the proxy's dispatch counted (the first request to a P waits
//! for P's answer, the rest send both legs at once), every reservation and push ended
//! written and nothing held; two P and two D served round robin; a P killed while the
//! proxy knows its identity (the concurrent P leg fails, D cannot send the dead P its
//! registration so the reservation ends `failed` at once, D answers the retryable KV
//! failure and the proxy's retry through the live P answers verified content; later
//! requests whose turn is the dead P go to the P after it; nothing hangs, nothing
//! unverified is returned).

mod common;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use kvlease_agent::kv;
use serde_json::{Value, json};

use common::system::{kv_config, post, prompt};
use common::{
    Agent, SHAPE, client, free_port, log_path, metric_of, shape_args, wait_healthy, wait_metric,
};

/// The tokens every request asks D for.
const MAX_TOKENS: u32 = 4;

/// Every request through the proxy ends within this (P killed included: one lease of D's
/// reservation, the retry, and room for a slow test host).
const REQUEST_BOUND: Duration = Duration::from_secs(20);

fn spawn(bin: &str, name: &str, transport: &str, args: &[&str]) -> Result<Agent> {
    let port = free_port();
    let side_port = free_port();
    let log = log_path("push-proxy", name);
    let mut cmd = std::process::Command::new(bin);
    cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args([
            "--side-channel-port",
            &side_port.to_string(),
            "--engine-id",
            name,
        ])
        .args(shape_args())
        .args(["--transport", transport, "--memory", "host"])
        .args(["--transfer-mode", "push"])
        .args(args)
        .env("RUST_LOG", "info,kvlease_agent=debug")
        .env_remove("KVLEASE_AUTH_TOKEN")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log)?);
    let child = cmd.spawn().with_context(|| format!("spawn {bin}"))?;
    Ok(Agent::new(child, name, log, port))
}

/// The real `kvlease-proxy --transfer-mode push` in front of `ps` and `ds`.
fn spawn_proxy(name: &str, ps: &[Agent], ds: &[Agent]) -> Result<Agent> {
    let port = free_port();
    let log = log_path("push-proxy", name);
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kvlease-proxy"));
    cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--transfer-mode", "push"])
        .arg("--prefill")
        .args(ps.iter().map(|a| a.url.as_str()))
        .arg("--decode")
        .args(ds.iter().map(|a| a.url.as_str()))
        .env("RUST_LOG", "info,kvlease_agent=debug")
        .env_remove("KVLEASE_AUTH_TOKEN")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log)?);
    let child = cmd.spawn().context("spawn kvlease-proxy")?;
    Ok(Agent::new(child, name, log, port))
}

/// A deployment: `np` push P agents, `nd` push D agents (`p_args` / `d_args` added) and the
/// push proxy in front of them, all healthy.
struct Deployment {
    c: reqwest::Client,
    ps: Vec<Agent>,
    ds: Vec<Agent>,
    proxy: Agent,
    transport: String,
}

async fn deploy(
    tag: &str,
    transport: &str,
    (np, nd): (usize, usize),
    p_args: &[&str],
    d_args: &[&str],
) -> Result<Deployment> {
    let c = client();
    let mut ps = Vec::new();
    for i in 0..np {
        let mut p = spawn(
            env!("CARGO_BIN_EXE_prefill-agent"),
            &format!("p{i}-{tag}"),
            transport,
            p_args,
        )?;
        wait_healthy(&c, &mut p).await?;
        ps.push(p);
    }
    let mut ds = Vec::new();
    for i in 0..nd {
        let mut d = spawn(
            env!("CARGO_BIN_EXE_decode-agent"),
            &format!("d{i}-{tag}"),
            transport,
            d_args,
        )?;
        wait_healthy(&c, &mut d).await?;
        ds.push(d);
    }
    let mut proxy = spawn_proxy(&format!("proxy-{tag}"), &ps, &ds)?;
    wait_healthy(&c, &mut proxy).await?;
    Ok(Deployment {
        c,
        ps,
        ds,
        proxy,
        transport: transport.to_owned(),
    })
}

/// D's answer (passed through by the proxy) is the verified KV of `prompt` and its text.
fn check_answer(prompt: &str, transport: &str, d: &Value) -> Result<()> {
    let want = kv::expected_digest(&SHAPE, &kv::tokenize(prompt));
    ensure!(
        d["kv_digest"] == want.to_string(),
        "D digest {} != {want}",
        d["kv_digest"]
    );
    let text = kv::decode_text(want, MAX_TOKENS as usize).concat();
    ensure!(
        d["choices"][0]["text"] == text,
        "text {} != {text}",
        d["choices"][0]["text"]
    );
    ensure!(
        d["usage"]["completion_tokens"] == MAX_TOKENS,
        "usage {}",
        d["usage"]
    );
    ensure!(
        d["kv_transfer_stats"]["backend"] == transport,
        "moved over {}, expected {transport}",
        d["kv_transfer_stats"]["backend"]
    );
    Ok(())
}

impl Deployment {
    /// Request `i` through the proxy: within [`REQUEST_BOUND`], 200, verified content.
    async fn request(&self, i: usize) -> Result<()> {
        let prompt = prompt(i);
        let body = json!({"prompt": prompt, "max_tokens": MAX_TOKENS, "stream": false});
        let started = Instant::now();
        let (s, v) = tokio::time::timeout(REQUEST_BOUND, post(&self.c, &self.proxy.url, &body))
            .await
            .with_context(|| format!("request {i} did not end within {REQUEST_BOUND:?}"))??;
        ensure!(s == 200, "request {i}: {s} {v}");
        check_answer(&prompt, &self.transport, &v)
            .with_context(|| format!("request {i} (took {:?})", started.elapsed()))
    }

    /// Requests `range`, all at once.
    async fn concurrent(&self, range: std::ops::Range<usize>) -> Result<()> {
        let results = futures_util::future::join_all(range.map(|i| self.request(i))).await;
        results.into_iter().collect()
    }

    async fn proxy_metric(&self, series: &str) -> Result<f64> {
        metric_of(&self.c, &self.proxy, series).await
    }

    /// Every P's pushes and every D's reservations ended, nothing held anywhere.
    async fn all_free(&self, ps: &[&Agent]) -> Result<()> {
        let within = Duration::from_secs(10);
        for p in ps {
            wait_metric(&self.c, p, "kvlease_pushes_active", within, |v| v == 0.0).await?;
            wait_metric(&self.c, p, "kvlease_blocks_held", within, |v| v == 0.0).await?;
        }
        for d in &self.ds {
            wait_metric(
                &self.c,
                d,
                "kvlease_push_reservations_active",
                within,
                |v| v == 0.0,
            )
            .await?;
            wait_metric(&self.c, d, "kvlease_blocks_held", within, |v| v == 0.0).await?;
        }
        Ok(())
    }
}

const WRITTEN_D: &str = "kvlease_push_reservations_ended_total{outcome=\"written\"}";
const WRITTEN_P: &str = "kvlease_pushes_ended_total{outcome=\"written\"}";
const CONCURRENT: &str = "kvlease_proxy_push_legs_total{dispatch=\"concurrent\"}";
const SEQUENTIAL: &str = "kvlease_proxy_push_legs_total{dispatch=\"sequential\"}";
const P_FAILURES: &str = "kvlease_proxy_push_prefill_failures_total";
const RETRIES: &str = "kvlease_proxy_retries_total";

/// `np` P and `nd` D behind the proxy, `n` requests: the first to each P one at a time
/// (the proxy learns its identity from its answer), the rest all at once (both legs at
/// once). Every answer verified; every P and D served its round-robin share; every
/// reservation and push ended written; nothing held.
async fn through_proxy(transport: &str, (np, nd): (usize, usize), n: usize) -> Result<()> {
    let tag = format!("{transport}-{np}x{nd}");
    let dep = deploy(&tag, transport, (np, nd), &[], &[]).await?;
    for i in 0..np {
        dep.request(i).await?;
    }
    ensure!(dep.proxy_metric(SEQUENTIAL).await? == np as f64);
    ensure!(dep.proxy_metric(CONCURRENT).await? == 0.0);
    dep.concurrent(np..n).await?;
    let within = Duration::from_secs(10);
    let nf = n as f64;
    // The P legs sent with their D legs may still be answering: wait for them.
    for (i, p) in dep.ps.iter().enumerate() {
        let share = (n / np + usize::from(i < n % np)) as f64;
        wait_metric(&dep.c, p, WRITTEN_P, within, |v| v == share)
            .await
            .with_context(|| format!("P {i} pushes written"))?;
        ensure!(metric_of(&dep.c, p, "kvlease_pushes_admitted_total").await? == share);
        ensure!(metric_of(&dep.c, p, "kvlease_push_writes_failed_total").await? == 0.0);
    }
    for (i, d) in dep.ds.iter().enumerate() {
        let share = (n / nd + usize::from(i < n % nd)) as f64;
        wait_metric(&dep.c, d, WRITTEN_D, within, |v| v == share)
            .await
            .with_context(|| format!("D {i} reservations written"))?;
        ensure!(metric_of(&dep.c, d, "kvlease_push_reservations_total").await? == share);
    }
    ensure!(dep.proxy_metric(SEQUENTIAL).await? == np as f64);
    ensure!(dep.proxy_metric(CONCURRENT).await? == nf - np as f64);
    ensure!(dep.proxy_metric(P_FAILURES).await? == 0.0);
    ensure!(dep.proxy_metric(RETRIES).await? == 0.0);
    ensure!(
        dep.proxy_metric("kvlease_proxy_requests_total{outcome=\"ok\"}")
            .await?
            == nf
    );
    let ps: Vec<&Agent> = dep.ps.iter().collect();
    dep.all_free(&ps).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_proxy_end_to_end_over_tcp() -> Result<()> {
    through_proxy("tcp", (1, 1), 16).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_proxy_end_to_end_over_shm() -> Result<()> {
    through_proxy("shm", (1, 1), 16).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_proxy_two_prefills_two_decodes_round_robin() -> Result<()> {
    through_proxy("tcp", (2, 2), 16).await
}

/// P0 is killed (SIGKILL) while the proxy knows its identity and D is connected to it; P1
/// lives. The next request's P leg to P0 fails (counted) while its D leg reserves for P0:
/// D cannot send P0 the registration (the connection broke), so nothing can write the
/// reservation and it ends `failed` at once (not after the lease), D answers the
/// retryable `kv_load_failed`, and the proxy's one retry (a new transfer id, the P after
/// P0: P1) answers verified content. Later requests whose turn is P0 wait for its answer,
/// find it unreachable and go to the P after it (one at a time and at once: never P0
/// again, whatever the rotation says). Every request ends within a bound with verified
/// content.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_proxy_prefill_killed_is_retried_through_the_live_one() -> Result<()> {
    // Long enough that waiting for the reservation's expiry would show.
    let lease = 10u64;
    let p_cfg = kv_config("kv_producer", json!({"kv_lease_duration": lease}));
    let d_cfg = kv_config("kv_consumer", json!({"kv_lease_duration": lease}));
    let mut dep = deploy(
        "killed",
        "tcp",
        (2, 1),
        &["--kv-transfer-config", &p_cfg],
        &["--kv-transfer-config", &d_cfg],
    )
    .await?;
    // P0, P1 (their identities learned), then P0, P1 with both legs at once.
    for i in 0..4 {
        dep.request(i).await?;
    }
    ensure!(dep.proxy_metric(SEQUENTIAL).await? == 2.0);
    ensure!(dep.proxy_metric(CONCURRENT).await? == 2.0);
    let d = &dep.ds[0];
    wait_metric(&dep.c, d, WRITTEN_D, Duration::from_secs(10), |v| v == 4.0).await?;
    dep.ps[0].proc.kill();
    // P0's turn: its leg fails, D's reservation for P0 fails at once, the retry goes to P1.
    let killed = Instant::now();
    dep.request(4).await?;
    let took = killed.elapsed();
    ensure!(
        took < Duration::from_secs(lease / 2),
        "the request after P0's death took {took:?} (lease {lease} s)"
    );
    ensure!(dep.proxy_metric(P_FAILURES).await? == 1.0);
    ensure!(dep.proxy_metric(RETRIES).await? == 1.0);
    ensure!(dep.proxy_metric(CONCURRENT).await? == 4.0);
    ensure!(
        dep.proxy_metric("kvlease_proxy_requests_total{outcome=\"ok_after_retry\"}")
            .await?
            == 1.0
    );
    let d = &dep.ds[0];
    let expired = metric_of(
        &dep.c,
        d,
        "kvlease_push_reservations_ended_total{outcome=\"expired\"}",
    )
    .await?;
    let failed = metric_of(
        &dep.c,
        d,
        "kvlease_push_reservations_ended_total{outcome=\"failed\"}",
    )
    .await?;
    ensure!(
        (expired, failed) == (0.0, 1.0),
        "D's reservation for dead P0: expired {expired}, failed {failed}"
    );
    ensure!(metric_of(&dep.c, d, WRITTEN_D).await? == 5.0);
    // Later requests: P0's turns wait for P0's answer, find it unreachable and go to P1
    // (one at a time, then at once).
    for i in 5..8 {
        dep.request(i).await?;
    }
    dep.concurrent(8..20).await?;
    ensure!(dep.proxy_metric(P_FAILURES).await? == 1.0);
    ensure!(dep.proxy_metric(RETRIES).await? == 1.0);
    ensure!(
        dep.proxy_metric("kvlease_proxy_requests_total{outcome=\"ok\"}")
            .await?
            == 19.0
    );
    wait_metric(&dep.c, d, WRITTEN_D, Duration::from_secs(10), |v| v == 20.0).await?;
    // P1 wrote all but P0's first two.
    wait_metric(
        &dep.c,
        &dep.ps[1],
        WRITTEN_P,
        Duration::from_secs(10),
        |v| v == 18.0,
    )
    .await?;
    let live = [&dep.ps[1]];
    dep.all_free(&live).await
}
