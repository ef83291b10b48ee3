//! Push mode between real agent processes (`--transfer-mode push`), over TCP and shared
//! memory: both legs of a request at once (D's first and P's first), every answer's KV
//! verified, every reservation and push ended and nothing held at the end; a P killed
//! after D registered (D's reservation expires, D answers the retryable KV failure); a
//! client that goes away while D waits (D releases, P writes nothing that lands); legs
//! that wait for D's full pool in order (and one past `--max-waiting` refused); and legs
//! of the other mode refused with a 400 naming the flag.

mod common;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use kvlease_agent::kv;
use serde_json::{Value, json};

use common::system::{kv_config, post, prompt};
use common::{
    Agent, SHAPE, client, free_port, log_path, metric_of, shape_args, wait_healthy, wait_metric,
};

/// An agent and its side-channel port.
struct Spawned {
    agent: Agent,
    side_port: u16,
}

/// `args` may name `--memory`; host memory otherwise.
fn spawn(bin: &str, name: &str, transport: &str, args: &[&str]) -> Result<Spawned> {
    let port = free_port();
    let side_port = free_port();
    let log = log_path("push", name);
    let mut cmd = std::process::Command::new(bin);
    cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args([
            "--side-channel-port",
            &side_port.to_string(),
            "--engine-id",
            name,
        ])
        .args(shape_args())
        .args(["--transport", transport])
        .args(args)
        .env("RUST_LOG", "info,kvlease_agent=debug")
        .env_remove("KVLEASE_AUTH_TOKEN")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log)?);
    if !args.contains(&"--memory") {
        cmd.args(["--memory", "host"]);
    }
    let child = cmd.spawn().with_context(|| format!("spawn {bin}"))?;
    Ok(Spawned {
        agent: Agent::new(child, name, log, port),
        side_port,
    })
}

async fn push_pair(
    tag: &str,
    transport: &str,
    p_args: &[&str],
    d_args: &[&str],
) -> Result<(reqwest::Client, Spawned, Spawned)> {
    let c = client();
    let mut pa = vec!["--transfer-mode", "push"];
    pa.extend_from_slice(p_args);
    let mut da = vec!["--transfer-mode", "push"];
    da.extend_from_slice(d_args);
    let mut p = spawn(
        env!("CARGO_BIN_EXE_prefill-agent"),
        &format!("p-{tag}"),
        transport,
        &pa,
    )?;
    let mut d = spawn(
        env!("CARGO_BIN_EXE_decode-agent"),
        &format!("d-{tag}"),
        transport,
        &da,
    )?;
    wait_healthy(&c, &mut p.agent).await?;
    wait_healthy(&c, &mut d.agent).await?;
    Ok((c, p, d))
}

fn p_leg(prompt: &str, transfer: &str) -> Value {
    json!({"prompt": prompt, "max_tokens": 1, "stream": false,
        "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false,
            "transfer_id": transfer}})
}

fn d_leg(prompt: &str, max_tokens: u32, transfer: &str, p: &Spawned, p_name: &str) -> Value {
    d_leg_tp(prompt, max_tokens, transfer, p, p_name, 1)
}

fn d_leg_tp(
    prompt: &str,
    max_tokens: u32,
    transfer: &str,
    p: &Spawned,
    p_name: &str,
    tp: u32,
) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "stream": false,
        "kv_transfer_params": {"do_remote_prefill": true, "do_remote_decode": false,
            "transfer_mode": "push", "transfer_id": transfer, "remote_engine_id": p_name,
            "remote_host": "127.0.0.1", "remote_port": p.side_port, "tp_size": tp}})
}

fn check_d_answer(prompt: &str, max_tokens: u32, d: &Value) -> Result<()> {
    let want = kv::expected_digest(&SHAPE, &kv::tokenize(prompt));
    ensure!(
        d["kv_digest"] == want.to_string(),
        "D digest {} != {want}",
        d["kv_digest"]
    );
    let text = kv::decode_text(want, max_tokens as usize).concat();
    ensure!(
        d["choices"][0]["text"] == text,
        "text {} != {text}",
        d["choices"][0]["text"]
    );
    Ok(())
}

async fn end_to_end(transport: &str, tp: u32, n: usize) -> Result<()> {
    end_to_end_in(transport, (tp, tp), n, ("host", "host")).await
}

/// As [`end_to_end`], with P's TP size `p_tp` and D's `d_tp`, P's pool in `p_mem` and
/// D's in `d_mem` (`--memory`).
async fn end_to_end_in(
    transport: &str,
    (p_tp, d_tp): (u32, u32),
    n: usize,
    (p_mem, d_mem): (&str, &str),
) -> Result<()> {
    let tag = format!("e2e-{transport}-tp{p_tp}to{d_tp}-{p_mem}-{d_mem}");
    let (p_flag, d_flag) = (p_tp.to_string(), d_tp.to_string());
    let p_args = ["--tp-size", p_flag.as_str(), "--memory", p_mem];
    let d_args = ["--tp-size", d_flag.as_str(), "--memory", d_mem];
    let tp = p_tp;
    let (c, p, d) = push_pair(&tag, transport, &p_args, &d_args).await?;
    let p_name = format!("p-{tag}");
    let mut tasks = Vec::new();
    for i in 0..n {
        let c = c.clone();
        let prompt = prompt(i);
        let transfer = format!("xfer-{tag}-{i}");
        let pb = p_leg(&prompt, &transfer);
        let db = d_leg_tp(&prompt, 4, &transfer, &p, &p_name, tp);
        let (p_url, d_url) = (p.agent.url.clone(), d.agent.url.clone());
        let backend = transport.to_owned();
        tasks.push(tokio::spawn(async move {
            // Both legs at once; even requests send D's first, odd ones P's first.
            let d_first = i % 2 == 0;
            let gap = Duration::from_millis(15);
            let (pr, dr) = if d_first {
                let dc = c.clone();
                let dt = tokio::spawn(async move { post(&dc, &d_url, &db).await });
                tokio::time::sleep(gap).await;
                let pr = post(&c, &p_url, &pb).await;
                (pr, dt.await?)
            } else {
                let pc = c.clone();
                let pt = tokio::spawn(async move { post(&pc, &p_url, &pb).await });
                tokio::time::sleep(gap).await;
                let dr = post(&c, &d_url, &db).await;
                (pt.await?, dr)
            };
            let (ps, pv) = pr?;
            let (ds, dv) = dr?;
            ensure!(ps == 200, "P leg {i}: {ps} {pv}");
            ensure!(ds == 200, "D leg {i}: {ds} {dv}");
            let kp = &pv["kv_transfer_params"];
            ensure!(
                kp["transfer_mode"] == "push" && kp["transfer_id"] == transfer,
                "P answer {kp}"
            );
            ensure!(
                kp["remote_engine_id"].is_string() && kp["tp_size"] == tp,
                "P answer {kp}"
            );
            check_d_answer(&prompt, 4, &dv)?;
            ensure!(
                dv["kv_transfer_stats"]["backend"] == backend,
                "moved over {}",
                dv["kv_transfer_stats"]["backend"]
            );
            ensure!(
                dv["kv_transfer_stats"]["remote_workers"] == p_tp,
                "written by {} P workers",
                dv["kv_transfer_stats"]["remote_workers"]
            );
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let within = Duration::from_secs(10);
    let nf = n as f64;
    wait_metric(
        &c,
        &d.agent,
        "kvlease_push_reservations_ended_total{outcome=\"written\"}",
        within,
        |v| v == nf,
    )
    .await?;
    wait_metric(
        &c,
        &p.agent,
        "kvlease_pushes_ended_total{outcome=\"written\"}",
        within,
        |v| v == nf,
    )
    .await?;
    ensure!(metric_of(&c, &p.agent, "kvlease_pushes_admitted_total").await? == nf);
    ensure!(metric_of(&c, &d.agent, "kvlease_push_reservations_total").await? == nf);
    ensure!(metric_of(&c, &p.agent, "kvlease_push_writes_failed_total").await? == 0.0);
    for a in [&p.agent, &d.agent] {
        wait_metric(&c, a, "kvlease_blocks_held", within, |v| v == 0.0).await?;
    }
    wait_metric(&c, &p.agent, "kvlease_pushes_active", within, |v| v == 0.0).await?;
    wait_metric(
        &c,
        &d.agent,
        "kvlease_push_reservations_active",
        within,
        |v| v == 0.0,
    )
    .await?;
    // A pull leg on push agents is refused, naming the flag.
    let (s, v) = post(
        &c,
        &p.agent.url,
        &json!({"prompt": "x", "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": true}}),
    )
    .await?;
    ensure!(
        s == 400 && v.to_string().contains("--transfer-mode"),
        "pull leg on push P: {s} {v}"
    );
    let pull_d = json!({"prompt": "x", "max_tokens": 1, "kv_transfer_params": {
        "do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": p_name,
        "remote_block_ids": [0], "remote_host": "127.0.0.1", "remote_port": p.side_port,
        "remote_request_id": "r", "tp_size": tp, "kvlease_generation": 1,
        "kvlease_num_tokens": 1, "kvlease_instance": 1, "kv_digest": "0"}});
    let (s, v) = post(&c, &d.agent.url, &pull_d).await?;
    ensure!(
        s == 400 && v.to_string().contains("--transfer-mode"),
        "pull leg on push D: {s} {v}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_end_to_end_over_tcp() -> Result<()> {
    end_to_end("tcp", 1, 12).await
}

/// Two TP workers on each side: each P worker writes into the D worker of its rank.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_end_to_end_tp2_over_tcp() -> Result<()> {
    end_to_end("tcp", 2, 6).await
}

/// TP sizes that differ (4 KV heads): P's 4 workers gather into D's 2 (each D worker's
/// block gets one P worker's heads in each half), and P's 1 worker scatters its heads over
/// D's 2; every answer's KV verified against the prompt on D.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_end_to_end_with_differing_tp_over_tcp() -> Result<()> {
    end_to_end_in("tcp", (4, 2), 6, ("host", "host")).await?;
    end_to_end_in("tcp", (1, 2), 6, ("host", "host")).await
}

/// Differing TP sizes over shared memory (D pulls each head slice from P's memfd), one
/// side staged (the slices go through the bounce buffers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_end_to_end_with_differing_tp_over_shm() -> Result<()> {
    end_to_end_in("shm", (2, 4), 6, ("host", "host")).await?;
    end_to_end_in("shm", (2, 1), 4, ("staged", "host")).await
}

/// A push leg whose P TP size does not split the model's 4 KV heads is refused with a
/// 400 naming the field; nothing is reserved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_leg_with_a_tp_size_that_splits_no_heads_is_refused() -> Result<()> {
    let (c, p, d) = push_pair("badtp", "tcp", &[], &[]).await?;
    let body = d_leg_tp(&prompt(1), 4, "xfer-badtp", &p, "p-badtp", 3);
    let (s, v) = post(&c, &d.agent.url, &body).await?;
    ensure!(
        s == 400 && v.to_string().contains("kv_transfer_params.tp_size"),
        "tp 3 of 4 heads: {s} {v}"
    );
    ensure!(metric_of(&c, &d.agent, "kvlease_push_reservations_total").await? == 0.0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_end_to_end_over_shm() -> Result<()> {
    end_to_end("shm", 1, 12).await
}

/// Pools in staged memory (host memory moved as device memory is, through host bounce
/// buffers): P writes out of its staged pool, D lands into its staged pool, every answer's
/// KV verified.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_end_to_end_with_staged_pools_over_tcp() -> Result<()> {
    end_to_end_in("tcp", (1, 1), 6, ("staged", "staged")).await
}

/// Over shared memory: a staged P's payloads go on the socket; D pulls a host P's
/// payloads into a bounce buffer and copies them into its staged pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_end_to_end_with_staged_pools_over_shm() -> Result<()> {
    end_to_end_in("shm", (1, 1), 6, ("staged", "host")).await?;
    end_to_end_in("shm", (1, 1), 6, ("host", "staged")).await
}

/// P is killed after D registered: no heartbeat renews the reservation, which expires
/// within about one lease; D frees its blocks and answers the retryable KV failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_p_killed_after_registration_expires_on_d() -> Result<()> {
    let lease = 2u64;
    let p_cfg = kv_config("kv_producer", json!({"kv_lease_duration": lease}));
    let d_cfg = kv_config("kv_consumer", json!({"kv_lease_duration": lease}));
    let (c, mut p, d) = push_pair(
        "killed",
        "tcp",
        &["--kv-transfer-config", &p_cfg],
        &["--kv-transfer-config", &d_cfg],
    )
    .await?;
    let body = d_leg(&prompt(3), 4, "xfer-killed", &p, "p-killed");
    let d_url = d.agent.url.clone();
    let dc = c.clone();
    let answer = tokio::spawn(async move { post(&dc, &d_url, &body).await });
    wait_metric(
        &c,
        &d.agent,
        "kvlease_push_reservations_total",
        Duration::from_secs(10),
        |v| v == 1.0,
    )
    .await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    p.agent.proc.kill();
    let killed = Instant::now();
    let (s, v) = answer.await??;
    let took = killed.elapsed();
    ensure!(s == 503, "D answered {s} {v}");
    ensure!(v["error"]["type"] == "kv_load_failed", "D answered {v}");
    ensure!(v.get("kv_digest").is_none(), "no content: {v}");
    ensure!(
        took <= Duration::from_secs(lease) + Duration::from_secs(2),
        "expired after {took:?}"
    );
    ensure!(
        metric_of(
            &c,
            &d.agent,
            "kvlease_push_reservations_ended_total{outcome=\"expired\"}"
        )
        .await?
            == 1.0
    );
    wait_metric(
        &c,
        &d.agent,
        "kvlease_blocks_held",
        Duration::from_secs(5),
        |v| v == 0.0,
    )
    .await?;
    Ok(())
}

/// P is stalled (SIGSTOP) while it heartbeats D's reservation (the push leg waits on P
/// for free blocks): the heartbeats stop, D's reservation expires within about one
/// extension, D answers the retryable KV failure and tells P; once P runs again nothing
/// it writes lands, and both sides free everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_p_stalled_while_heartbeating_expires_on_d() -> Result<()> {
    let lease = 2u64;
    let p_cfg = kv_config("kv_producer", json!({"kv_lease_duration": lease}));
    let d_cfg = kv_config("kv_consumer", json!({"kv_lease_duration": lease}));
    let (c, p, d) = push_pair(
        "stalled",
        "tcp",
        &[
            "--kv-transfer-config",
            &p_cfg,
            "--num-blocks",
            "8",
            "--pool-wait-ms",
            "30000",
        ],
        &["--kv-transfer-config", &d_cfg],
    )
    .await?;
    let within = Duration::from_secs(10);
    // A push leg whose D never registers holds P's whole pool for the registration wait.
    let (s, v) = post(&c, &p.agent.url, &p_leg(&"a".repeat(120), "xfer-hog")).await?;
    ensure!(s == 200, "hog: {s} {v}");
    wait_metric(&c, &p.agent, "kvlease_blocks_held", within, |v| v == 8.0).await?;
    let prompt = prompt(2);
    let pb = p_leg(&prompt, "xfer-stalled");
    let db = d_leg(&prompt, 4, "xfer-stalled", &p, "p-stalled");
    let (p_url, d_url) = (p.agent.url.clone(), d.agent.url.clone());
    let (pc, dc) = (c.clone(), c.clone());
    let p_task = tokio::spawn(async move { post(&pc, &p_url, &pb).await });
    let d_task = tokio::spawn(async move { post(&dc, &d_url, &db).await });
    wait_metric(
        &c,
        &d.agent,
        "kvlease_push_reservations_total",
        within,
        |v| v == 1.0,
    )
    .await?;
    let reserved = Instant::now();
    // P holds both the leg (waiting for blocks) and the registration: it heartbeats. Past
    // three quarters of the lease its heartbeats have renewed the reservation beyond its
    // first expiry (P's pool stays full until the hog's registration wait ends, one lease
    // after the hog's prefill).
    tokio::time::sleep(Duration::from_millis(lease * 750)).await;
    let beats = metric_of(&c, &d.agent, "kvlease_heartbeats_received_total").await?;
    ensure!(beats >= 2.0, "{beats} heartbeats");
    let pid = p.agent.proc.child.id().to_string();
    let signal = |sig: &str| {
        std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
    };
    ensure!(signal("-STOP")?.success());
    let stalled = Instant::now();
    let answer = d_task.await?;
    let took = stalled.elapsed();
    let lived = reserved.elapsed();
    ensure!(signal("-CONT")?.success());
    let (s, v) = answer?;
    ensure!(
        s == 503 && v["error"]["type"] == "kv_load_failed",
        "D answered {s} {v}"
    );
    // Renewed: it outlived its first expiry (one lease after the reservation).
    ensure!(
        lived > Duration::from_secs(lease),
        "expired {lived:?} after the reservation"
    );
    // Expiry = last heartbeat + extension (2/3 of the lease), plus the reaper's step.
    ensure!(
        took <= Duration::from_secs(lease) + Duration::from_secs(1),
        "expired after {took:?}"
    );
    ensure!(
        metric_of(
            &c,
            &d.agent,
            "kvlease_push_reservations_ended_total{outcome=\"expired\"}"
        )
        .await?
            == 1.0
    );
    let (ps, pv) = p_task.await??;
    ensure!(ps == 200, "P leg: {ps} {pv}");
    wait_metric(&c, &p.agent, "kvlease_pushes_active", within, |v| v == 0.0).await?;
    ensure!(
        metric_of(
            &c,
            &p.agent,
            "kvlease_pushes_ended_total{outcome=\"written\"}"
        )
        .await?
            == 0.0
    );
    ensure!(
        metric_of(
            &c,
            &p.agent,
            "kvlease_pushes_ended_total{outcome=\"no_registration\"}"
        )
        .await?
            == 1.0
    );
    ensure!(
        metric_of(
            &c,
            &d.agent,
            "kvlease_push_reservations_ended_total{outcome=\"written\"}"
        )
        .await?
            == 0.0
    );
    for a in [&p.agent, &d.agent] {
        wait_metric(&c, a, "kvlease_blocks_held", within, |v| v == 0.0).await?;
    }
    Ok(())
}

/// D's client goes away while D waits for P's write (P is still prefilling): D clears
/// the fence, frees and tells P (`KVL1:RR:`); P's write, planned before the release
/// reached it, is refused by D's fence, and P frees its blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_client_abort_releases_and_no_write_lands() -> Result<()> {
    // About 1.5 s of prefill for the prompt below: the abort comes first.
    let (c, p, d) = push_pair("abort", "tcp", &["--prefill-us-per-token", "20000"], &[]).await?;
    let prompt = prompt(5);
    let pb = p_leg(&prompt, "xfer-abort");
    let db = d_leg(&prompt, 4, "xfer-abort", &p, "p-abort");
    let p_url = p.agent.url.clone();
    let pc = c.clone();
    let p_task = tokio::spawn(async move { post(&pc, &p_url, &pb).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let short = reqwest::Client::builder()
        .timeout(Duration::from_millis(400))
        .build()?;
    let r = short
        .post(format!("{}/v1/completions", d.agent.url))
        .json(&db)
        .send()
        .await;
    ensure!(r.is_err(), "D answered before the client gave up: {r:?}");
    let within = Duration::from_secs(10);
    wait_metric(
        &c,
        &d.agent,
        "kvlease_push_reservations_ended_total{outcome=\"aborted\"}",
        within,
        |v| v == 1.0,
    )
    .await?;
    let (ps, pv) = p_task.await??;
    ensure!(ps == 200, "P leg: {ps} {pv}");
    wait_metric(
        &c,
        &p.agent,
        "kvlease_pushes_ended_total{outcome=\"reservation_gone\"}",
        within,
        |v| v == 1.0,
    )
    .await?;
    let posted = metric_of(&c, &p.agent, "kvlease_push_writes_posted_total").await?;
    let failed = metric_of(&c, &p.agent, "kvlease_push_writes_failed_total").await?;
    ensure!(
        posted == failed,
        "a write succeeded after D released: posted {posted}, failed {failed}"
    );
    ensure!(
        metric_of(
            &c,
            &d.agent,
            "kvlease_push_reservations_ended_total{outcome=\"written\"}"
        )
        .await?
            == 0.0
    );
    for a in [&p.agent, &d.agent] {
        wait_metric(&c, a, "kvlease_blocks_held", within, |v| v == 0.0).await?;
    }
    Ok(())
}

/// A push leg reaching pull agents is a 400 naming `--transfer-mode`, never a pull.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_leg_on_pull_agents_is_a_400() -> Result<()> {
    let c = client();
    let mut p = spawn(env!("CARGO_BIN_EXE_prefill-agent"), "p-pull", "tcp", &[])?;
    let mut d = spawn(env!("CARGO_BIN_EXE_decode-agent"), "d-pull", "tcp", &[])?;
    wait_healthy(&c, &mut p.agent).await?;
    wait_healthy(&c, &mut d.agent).await?;
    let (s, v) = post(&c, &p.agent.url, &p_leg("hello", "t1")).await?;
    ensure!(
        s == 400 && v.to_string().contains("--transfer-mode"),
        "P: {s} {v}"
    );
    let (s, v) = post(&c, &d.agent.url, &d_leg("hello", 2, "t1", &p, "p-pull")).await?;
    ensure!(
        s == 400 && v.to_string().contains("--transfer-mode"),
        "D: {s} {v}"
    );
    Ok(())
}

/// D's pool holds one request's blocks at a time: push legs that find it full wait in
/// D's queue (first come first served) and reserve as blocks come free, every answer
/// verified; a leg past `--max-waiting` gets the retryable 503 at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_legs_wait_for_a_full_pool_in_order_and_past_the_queue_get_a_503() -> Result<()> {
    // 0.6 s of prefill a request on P: the legs all reach D while the first one holds
    // D's pool. An 8 s lease: a leg waits for D's blocks up to 4 s, and P frees the
    // refused leg's blocks 8 s after its prefill.
    let lease = json!({"kv_lease_duration": 8});
    let p_cfg = kv_config("kv_producer", lease.clone());
    let d_cfg = kv_config("kv_consumer", lease);
    let (c, p, d) = push_pair(
        "queue",
        "tcp",
        &[
            "--prefill-us-per-token",
            "5000",
            "--kv-transfer-config",
            &p_cfg,
        ],
        &[
            "--num-blocks",
            "8",
            "--max-waiting",
            "2",
            "--kv-transfer-config",
            &d_cfg,
        ],
    )
    .await?;
    let n = 4;
    let mut tasks = Vec::new();
    for i in 0..n {
        // 120 tokens: 8 blocks of 16, D's whole pool.
        let prompt = format!("{i}{}", "q".repeat(119));
        let transfer = format!("xfer-queue-{i}");
        let pb = p_leg(&prompt, &transfer);
        let db = d_leg(&prompt, 4, &transfer, &p, "p-queue");
        let (pc, dc) = (c.clone(), c.clone());
        let (p_url, d_url) = (p.agent.url.clone(), d.agent.url.clone());
        tasks.push(tokio::spawn(async move {
            let pt = tokio::spawn(async move { post(&pc, &p_url, &pb).await });
            let dr = post(&dc, &d_url, &db).await?;
            let pr = pt.await??;
            anyhow::Ok((prompt, pr, dr))
        }));
    }
    let (mut ok, mut refused) = (0, 0);
    for t in tasks {
        let (prompt, (ps, pv), (ds, dv)) = t.await??;
        ensure!(ps == 200, "P leg: {ps} {pv}");
        if ds == 503 {
            ensure!(
                dv["error"]["type"] == "overloaded"
                    && dv.to_string().contains("push legs wait already"),
                "D refused: {dv}"
            );
            refused += 1;
        } else {
            ensure!(ds == 200, "D leg: {ds} {dv}");
            check_d_answer(&prompt, 4, &dv)?;
            ok += 1;
        }
    }
    // One reserves, two wait, the fourth finds the queue full.
    ensure!((ok, refused) == (3, 1), "{ok} answered, {refused} refused");
    let log = std::fs::read_to_string(&d.agent.proc.log)?;
    ensure!(
        log.matches("push leg waits for free KV blocks").count() >= 2,
        "no leg waited"
    );
    let within = Duration::from_secs(10);
    wait_metric(
        &c,
        &d.agent,
        "kvlease_push_reservations_ended_total{outcome=\"written\"}",
        within,
        |v| v == 3.0,
    )
    .await?;
    ensure!(metric_of(&c, &d.agent, "kvlease_push_legs_waiting").await? == 0.0);
    // P wrote three; the refused leg's push found no registration and freed its blocks.
    wait_metric(
        &c,
        &p.agent,
        "kvlease_pushes_active",
        Duration::from_secs(20),
        |v| v == 0.0,
    )
    .await?;
    for a in [&p.agent, &d.agent] {
        wait_metric(&c, a, "kvlease_blocks_held", within, |v| v == 0.0).await?;
    }
    Ok(())
}
