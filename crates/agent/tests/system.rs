//! System tests: real `prefill-agent` and `decode-agent` processes on loopback over TCP.
//!
//! Every wait has a timeout, children are killed on drop, ports are picked free
//! (`KVLEASE_SYSTEM_LOGS=1` prints each agent's log tail when it is dropped). Models
//! are small (2 layers, 4 KV heads, head_dim 64, block_size 16) and leases short so that
//! the whole binary runs in well under a minute on two cores.

mod common;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use common::system::{
    assert_nothing_leaks, check_answer, d_body, decode, do_prefill, kv_config, pd, post, prefill,
    prompt, read_sse,
};
use common::{
    Agent, SHAPE, agent_command, client, free_port, log_path, metric, metric_of, metrics,
    wait_healthy, wait_metric,
};
use kvlease_agent::kv;
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn happy_path_byte_exact_digests() -> Result<()> {
    let (c, p, d) = pd(
        &["--tp-size", "2", "--num-blocks", "256"],
        &[
            "--tp-size",
            "2",
            "--num-blocks",
            "256",
            "--max-running",
            "8",
            "--step-ms",
            "2",
        ],
        "happy",
    )
    .await?;
    let n = 120;
    let mut tasks = tokio::task::JoinSet::new();
    let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(8));
    for i in 0..n {
        let (c, purl, durl, sem) = (c.clone(), p.url.clone(), d.url.clone(), sem.clone());
        tasks.spawn(async move {
            let _permit = sem.acquire_owned().await?;
            let prompt = prompt(i);
            let pa = {
                let body = json!({"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}});
                let (s, v) = post(&c, &purl, &body).await?;
                ensure!(s == 200, "prefill {i}: {s} {v}");
                v
            };
            let max_tokens = 1 + (i % 5) as u32;
            if i % 10 == 0 {
                // Streaming: OpenAI chunks ending with [DONE].
                let mut body = d_body(&prompt, max_tokens, &pa);
                body["stream"] = json!(true);
                let r = c.post(format!("{durl}/v1/completions")).json(&body).send().await?;
                ensure!(r.status() == 200, "stream {i}: {}", r.status());
                let (text, last) = read_sse(r).await?;
                let want = kv::expected_digest(&SHAPE, &kv::tokenize(&prompt));
                ensure!(text == kv::decode_text(want, max_tokens as usize).concat(), "stream text {text}");
                ensure!(last["kv_digest"] == want.to_string(), "stream digest {}", last["kv_digest"]);
            } else {
                let (s, v) = post(&c, &durl, &d_body(&prompt, max_tokens, &pa)).await?;
                ensure!(s == 200, "decode {i}: {s} {v}");
                check_answer(&prompt, max_tokens, &pa, &v)?;
            }
            Ok::<_, anyhow::Error>(())
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    assert_nothing_leaks(&c, &p, &d, Duration::from_secs(5)).await?;
    let pm = metrics(&c, &p).await?;
    let dm = metrics(&c, &d).await?;
    assert_eq!(metric(&pm, "kvlease_leases_granted_total"), n as f64);
    assert_eq!(
        metric(&pm, "kvlease_leases_released_total{reason=\"completed\"}"),
        n as f64
    );
    assert_eq!(
        metric(&pm, "kvlease_requests_total{outcome=\"ok\"}"),
        n as f64
    );
    assert_eq!(
        metric(&dm, "kvlease_requests_total{outcome=\"ok\"}"),
        n as f64
    );
    assert!(metric(&dm, "kvlease_transfer_bytes_total") > 0.0);
    // Every byte D read is counted once, under the backend its batch really used.
    let by_backend: f64 = ["tcp", "shm", "cma", "verbs"]
        .iter()
        .map(|b| metric(&dm, &format!("kvlease_read_bytes_total{{backend=\"{b}\"}}")))
        .sum();
    assert_eq!(by_backend, metric(&dm, "kvlease_transfer_bytes_total"));
    Ok(())
}

async fn tp_case(p_tp: &str, d_tp: &str, tag: &str) -> Result<()> {
    let (c, p, d) = pd(
        &["--tp-size", p_tp, "--num-blocks", "64"],
        &["--tp-size", d_tp, "--num-blocks", "64", "--step-ms", "2"],
        tag,
    )
    .await?;
    for i in 0..6 {
        let prompt = prompt(i * 7);
        let pa = do_prefill(&c, &p, &prompt).await?;
        ensure!(pa["kv_transfer_params"]["tp_size"] == json!(p_tp.parse::<u32>()?));
        let (s, v) = post(&c, &d.url, &d_body(&prompt, 3, &pa)).await?;
        ensure!(s == 200, "{tag} decode {i}: {s} {v}");
        check_answer(&prompt, 3, &pa, &v)?;
    }
    assert_nothing_leaks(&c, &p, &d, Duration::from_secs(5)).await?;
    // Every lease completed: P freed after all D ranks reported.
    assert_eq!(
        metric_of(
            &c,
            &p,
            "kvlease_leases_released_total{reason=\"completed\"}"
        )
        .await?,
        6.0
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heterogeneous_tp_4_to_2() -> Result<()> {
    tp_case("4", "2", "tp42").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heterogeneous_tp_1_to_2() -> Result<()> {
    tp_case("1", "2", "tp12").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_crash_reclaims_within_extension_plus_interval() -> Result<()> {
    // Lease 3 s: interval 0.5 s, extension 2 s.
    let lease = kv_config("kv_producer", json!({"kv_lease_duration": 3}));
    let dlease = kv_config("kv_consumer", json!({"kv_lease_duration": 3}));
    let (c, p, mut d) = pd(
        &["--num-blocks", "64", "--kv-transfer-config", &lease],
        // One running request decoding for a long time: the others wait with their leases.
        &[
            "--num-blocks",
            "64",
            "--max-running",
            "1",
            "--step-ms",
            "50",
            "--kv-transfer-config",
            &dlease,
        ],
        "crash",
    )
    .await?;
    let n = 4;
    for i in 0..n {
        let prompt = prompt(i);
        let pa = do_prefill(&c, &p, &prompt).await?;
        let (c2, url) = (c.clone(), d.url.clone());
        let body = d_body(&prompt, 1000, &pa);
        // Never answered: D dies first.
        tokio::spawn(async move { post(&c2, &url, &body).await });
    }
    // Past the initial lease: only heartbeats keep the blocks.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let held = metric_of(&c, &p, "kvlease_blocks_held").await?;
    ensure!(
        held > 0.0,
        "P should still hold renewed blocks, holds {held}"
    );
    ensure!(metric_of(&c, &p, "kvlease_lease_extensions_total").await? > 0.0);
    d.proc.kill();
    let killed = Instant::now();
    let bound = Duration::from_millis(2000 + 500 + 1000);
    wait_metric(
        &c,
        &p,
        "kvlease_blocks_held",
        bound + Duration::from_secs(2),
        |v| v == 0.0,
    )
    .await?;
    let reclaim = killed.elapsed();
    eprintln!("reclaim after kill -9: {reclaim:?} (bound {bound:?})");
    ensure!(
        reclaim <= bound,
        "reclaimed after {reclaim:?}, bound {bound:?}"
    );
    let pm = metrics(&c, &p).await?;
    // One request had been read (the running one): its lease completed; the rest expired.
    assert_eq!(
        metric(&pm, "kvlease_leases_released_total{reason=\"expired\"}"),
        (n - 1) as f64
    );
    assert_eq!(metric(&pm, "kvlease_leases_active"), 0.0);
    Ok(())
}

/// D with `--max-running 1` and a queue that waits far longer than the lease.
async fn overload(p_extra: Value, tag: &str) -> Result<(Vec<(u16, Value)>, String)> {
    let pcfg = kv_config("kv_producer", p_extra);
    let dcfg = kv_config("kv_consumer", json!({"kv_lease_duration": 1.5}));
    let (c, p, d) = pd(
        &["--num-blocks", "64", "--kv-transfer-config", &pcfg],
        &[
            "--num-blocks",
            "64",
            "--max-running",
            "1",
            "--step-ms",
            "20",
            "--kv-transfer-config",
            &dcfg,
        ],
        tag,
    )
    .await?;
    // 9 requests × 50 tokens × 20 ms: the last waits ≈ 8 s ≥ 5 × 1.5 s.
    let mut tasks = Vec::new();
    for i in 0..9 {
        let prompt = prompt(i);
        let pa = do_prefill(&c, &p, &prompt).await?;
        let (c2, url) = (c.clone(), d.url.clone());
        let body = d_body(&prompt, 50, &pa);
        tasks.push(tokio::spawn(async move { post(&c2, &url, &body).await }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await??);
    }
    assert_nothing_leaks(&c, &p, &d, Duration::from_secs(5)).await?;
    Ok((out, metrics(&c, &p).await?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_leases_never_expire_but_fixed_timeout_does() -> Result<()> {
    let (lease, fixed) = tokio::join!(
        overload(json!({"kv_lease_duration": 1.5}), "ovl-lease"),
        overload(
            json!({"kv_lease_duration": 1.5, "lease_mode": "fixed", "abort_request_timeout": 1.5}),
            "ovl-fixed"
        ),
    );
    let (answers, pm) = lease?;
    for (s, v) in &answers {
        ensure!(*s == 200, "lease mode: {s} {v}");
    }
    assert_eq!(
        metric(&pm, "kvlease_leases_released_total{reason=\"expired\"}"),
        0.0
    );
    assert_eq!(
        metric(&pm, "kvlease_leases_released_total{reason=\"completed\"}"),
        9.0
    );

    let (answers, pm) = fixed?;
    let retryable = answers
        .iter()
        .filter(|(s, v)| {
            *s == 503 && v["error"]["type"] == "kv_load_failed" && v["error"]["retryable"] == true
        })
        .count();
    let ok = answers.iter().filter(|(s, _)| *s == 200).count();
    ensure!(
        retryable > 0,
        "fixed mode: no retryable failure: {answers:?}"
    );
    assert_eq!(retryable + ok, answers.len(), "{answers:?}");
    ensure!(metric(&pm, "kvlease_leases_released_total{reason=\"expired\"}") > 0.0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_frees_p_at_once() -> Result<()> {
    let cfg = |role| kv_config(role, json!({"kv_lease_duration": 30}));
    let (c, p, d) = pd(
        &[
            "--num-blocks",
            "64",
            "--kv-transfer-config",
            &cfg("kv_producer"),
        ],
        &[
            "--num-blocks",
            "64",
            "--max-running",
            "1",
            "--step-ms",
            "20",
            "--kv-transfer-config",
            &cfg("kv_consumer"),
        ],
        "abort",
    )
    .await?;
    // A long-running request occupies the only slot.
    let busy = do_prefill(&c, &p, &prompt(1)).await?;
    let (c2, url, body) = (c.clone(), d.url.clone(), d_body(&prompt(1), 200, &busy));
    let running = tokio::spawn(async move { post(&c2, &url, &body).await });
    // It must hold the only slot before the victim arrives.
    wait_metric(
        &c,
        &d,
        "kvlease_requests_running",
        Duration::from_secs(5),
        |v| v >= 1.0,
    )
    .await?;
    // Queued request aborted through the API.
    let queued = do_prefill(&c, &p, &prompt(2)).await?;
    let body = json!({"prompt": prompt(2), "max_tokens": 5, "request_id": "victim-1",
        "kv_transfer_params": queued["kv_transfer_params"]});
    let (c2, url) = (c.clone(), d.url.clone());
    let victim = tokio::spawn(async move { post(&c2, &url, &body).await });
    wait_metric(
        &c,
        &d,
        "kvlease_requests_waiting",
        Duration::from_secs(5),
        |v| v >= 1.0,
    )
    .await?;
    let r = c
        .post(format!("{}/v1/abort/victim-1", d.url))
        .send()
        .await?;
    ensure!(r.status() == 200, "abort: {}", r.status());
    let (s, v) = victim.await??;
    ensure!(
        s == 499 && v["error"]["type"] == "aborted",
        "victim: {s} {v}"
    );
    // P released at once (lease is 30 s).
    wait_metric(
        &c,
        &p,
        "kvlease_leases_released_total{reason=\"aborted\"}",
        Duration::from_secs(2),
        |v| v == 1.0,
    )
    .await?;
    // A client that disconnects while queued: D aborts and tells P.
    let gone = do_prefill(&c, &p, &prompt(3)).await?;
    let short = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()?;
    let r = post(&short, &d.url, &d_body(&prompt(3), 5, &gone)).await;
    ensure!(r.is_err(), "the short client should time out");
    wait_metric(
        &c,
        &p,
        "kvlease_leases_released_total{reason=\"aborted\"}",
        Duration::from_secs(3),
        |v| v == 2.0,
    )
    .await?;
    // Unknown id: 404.
    let r = c.post(format!("{}/v1/abort/nope", d.url)).send().await?;
    ensure!(r.status() == 404);
    let r = c
        .post(format!("{}/v1/abort/victim-1", d.url))
        .send()
        .await?;
    ensure!(r.status() == 404, "an aborted request is gone");
    running.abort();
    assert_nothing_leaks(&c, &p, &d, Duration::from_secs(5)).await?;
    let dm = metrics(&c, &d).await?;
    assert_eq!(
        metric(&dm, "kvlease_requests_total{outcome=\"aborted\"}"),
        3.0
    );
    Ok(())
}

/// Malformed JSON on both sides, bad `kv_transfer_params` on P and on D, and unknown
/// engines: each a 400 that names the field or the engine.
async fn refusals_name_the_field_or_engine(
    c: &reqwest::Client,
    p: &Agent,
    d: &Agent,
) -> Result<()> {
    // Malformed JSON, both sides.
    for a in [p, d] {
        let r = c
            .post(format!("{}/v1/completions", a.url))
            .header("content-type", "application/json")
            .body("{\"prompt\": ")
            .send()
            .await?;
        ensure!(r.status() == 400);
        let v: Value = r.json().await?;
        ensure!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("malformed JSON")),
            "{v}"
        );
    }
    // Bad kv_transfer_params on P and on D; the error names the field.
    let (s, v) = post(
        c,
        &p.url,
        &json!({"prompt": "hi", "kv_transfer_params": {"do_remote_decode": "yes"}}),
    )
    .await?;
    ensure!(
        s == 400 && v["error"]["param"] == "kv_transfer_params.do_remote_decode",
        "{s} {v}"
    );
    let pa = do_prefill(c, p, &prompt(5)).await?;
    let mut bad = d_body(&prompt(5), 2, &pa);
    bad["kv_transfer_params"]["remote_block_ids"] = json!("nope");
    let (s, v) = post(c, &d.url, &bad).await?;
    ensure!(
        s == 400 && v["error"]["param"] == "kv_transfer_params.remote_block_ids",
        "{s} {v}"
    );
    let bad = d_body("a different prompt", 2, &pa);
    let (s, v) = post(c, &d.url, &bad).await?;
    ensure!(
        s == 400 && v["error"]["param"] == "kv_transfer_params.kvlease_num_tokens",
        "{s} {v}"
    );
    // Unknown engine: P's side channel serves another engine; and nothing listens.
    let mut bad = d_body(&prompt(5), 2, &pa);
    bad["kv_transfer_params"]["remote_engine_id"] = json!("no-such-engine");
    let (s, v) = post(c, &d.url, &bad).await?;
    ensure!(
        s == 400
            && v["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("unknown engine")),
        "{s} {v}"
    );
    let mut bad = d_body(&prompt(5), 2, &pa);
    bad["kv_transfer_params"]["remote_engine_id"] = json!("ghost");
    bad["kv_transfer_params"]["remote_port"] = json!(free_port());
    let (s, v) = post(c, &d.url, &bad).await?;
    ensure!(
        s == 400
            && v["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("unknown engine")),
        "{s} {v}"
    );
    Ok(())
}

/// A P with the token `right` and a D with `wrong`, both healthy.
async fn agents_with_other_tokens(
    c: &reqwest::Client,
    pc: &str,
    dc: &str,
) -> Result<(Agent, Agent)> {
    let mut tp = prefill(
        "p-auth",
        &[
            "--num-blocks",
            "16",
            "--kv-transfer-config",
            pc,
            "--auth-token",
            "right",
        ],
    )?;
    let mut td = decode(
        "d-auth",
        &[
            "--num-blocks",
            "16",
            "--kv-transfer-config",
            dc,
            "--auth-token",
            "wrong",
        ],
    )?;
    wait_healthy(c, &mut tp).await?;
    wait_healthy(c, &mut td).await?;
    Ok((tp, td))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_clear_4xx_and_nothing_leaks() -> Result<()> {
    let cfg = |role| kv_config(role, json!({"kv_lease_duration": 1}));
    let (pc, dc) = (cfg("kv_producer"), cfg("kv_consumer"));
    let (c, p, d) = pd(
        &["--num-blocks", "64", "--kv-transfer-config", &pc],
        &[
            "--num-blocks",
            "64",
            "--step-ms",
            "5",
            "--kv-transfer-config",
            &dc,
        ],
        "bad",
    )
    .await?;
    refusals_name_the_field_or_engine(&c, &p, &d).await?;
    // A real request still works afterwards. (It gets its own prefill: a refusal of a
    // request with valid P coordinates tells a connected P to free that lease at once.)
    let pa = do_prefill(&c, &p, &prompt(5)).await?;
    let (s, v) = post(&c, &d.url, &d_body(&prompt(5), 2, &pa)).await?;
    ensure!(s == 200, "{s} {v}");
    check_answer(&prompt(5), 2, &pa, &v)?;
    // Now that D is connected to P, a refusal with valid coordinates frees P's lease.
    let aborted = metric_of(&c, &p, "kvlease_leases_released_total{reason=\"aborted\"}").await?;
    let pa = do_prefill(&c, &p, &prompt(7)).await?;
    let (s, v) = post(&c, &d.url, &d_body("not the prompt P prefilled", 2, &pa)).await?;
    ensure!(s == 400, "{s} {v}");
    wait_metric(
        &c,
        &p,
        "kvlease_leases_released_total{reason=\"aborted\"}",
        Duration::from_secs(5),
        |n| n >= aborted + 1.0,
    )
    .await?;

    // Wrong auth token: a P with a token, a D with another.
    let (tp, td) = agents_with_other_tokens(&c, &pc, &dc).await?;
    let pa = do_prefill(&c, &tp, &prompt(6)).await?;
    let (s, v) = post(&c, &td.url, &d_body(&prompt(6), 2, &pa)).await?;
    ensure!(
        s == 403 && v["error"]["type"] == "peer_auth_failed",
        "{s} {v}"
    );
    // Nothing leaks: D tracks nothing; P's unread leases expire (lease 1 s).
    assert_nothing_leaks(&c, &p, &d, Duration::from_secs(4)).await?;
    assert_nothing_leaks(&c, &tp, &td, Duration::from_secs(4)).await?;
    let dm = metrics(&c, &d).await?;
    assert_eq!(
        metric(&dm, "kvlease_requests_total{outcome=\"bad_request\"}"),
        6.0
    );
    assert_eq!(
        metric_of(&c, &td, "kvlease_requests_total{outcome=\"unauthorized\"}").await?,
        1.0
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_read_is_fenced_and_chat_works() -> Result<()> {
    let cfg = |role| kv_config(role, json!({"kv_lease_duration": 0.6}));
    let (c, p, d) = pd(
        &[
            "--num-blocks",
            "64",
            "--kv-transfer-config",
            &cfg("kv_producer"),
        ],
        &[
            "--num-blocks",
            "64",
            "--step-ms",
            "5",
            "--kv-transfer-config",
            &cfg("kv_consumer"),
        ],
        "stale",
    )
    .await?;
    // Chat through P then D.
    let messages =
        json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]);
    let r = c
        .post(format!("{}/v1/chat/completions", p.url))
        .json(&json!({"messages": messages, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}))
        .send()
        .await?;
    ensure!(r.status() == 200, "P chat: {}", r.status());
    let pa: Value = r.json().await?;
    let r = c
        .post(format!("{}/v1/chat/completions", d.url))
        .json(&json!({"messages": messages, "max_tokens": 4, "kv_transfer_params": pa["kv_transfer_params"]}))
        .send()
        .await?;
    ensure!(r.status() == 200, "D chat: {}", r.status());
    let v: Value = r.json().await?;
    let tokens = kv::tokenize("<|system|>\nbe brief\n<|user|>\nhello\n<|assistant|>\n");
    let want = kv::expected_digest(&SHAPE, &tokens);
    ensure!(v["kv_digest"] == want.to_string(), "{v}");
    ensure!(
        v["choices"][0]["message"]["content"] == kv::decode_text(want, 4).concat(),
        "{v}"
    );

    // A request that reaches D only after P reclaimed its lease (no D ever heartbeated it,
    // so no expiry notice): the read happens, the fence catches it, nothing is output.
    let pa = do_prefill(&c, &p, &prompt(9)).await?;
    wait_metric(
        &c,
        &p,
        "kvlease_leases_released_total{reason=\"expired\"}",
        Duration::from_secs(3),
        |v| v == 1.0,
    )
    .await?;
    let (s, v) = post(&c, &d.url, &d_body(&prompt(9), 3, &pa)).await?;
    ensure!(
        s == 503 && v["error"]["type"] == "kv_load_failed" && v["error"]["retryable"] == true,
        "{s} {v}"
    );
    ensure!(
        v.get("choices").is_none(),
        "a stale read must not produce output: {v}"
    );
    let dm = metrics(&c, &d).await?;
    assert_eq!(metric(&dm, "kvlease_stale_reads_total"), 1.0);
    assert_eq!(
        metric(&dm, "kvlease_requests_total{outcome=\"kv_load_failed\"}"),
        1.0
    );
    assert_nothing_leaks(&c, &p, &d, Duration::from_secs(3)).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_pool_waits_bounded_then_503() -> Result<()> {
    let c = client();
    // 4 blocks; a 40-token prompt needs 3.
    let long = "p".repeat(40);
    let short_lease = kv_config("kv_producer", json!({"kv_lease_duration": 0.5}));
    let long_lease = kv_config("kv_producer", json!({"kv_lease_duration": 30}));
    let mut waits = prefill(
        "p-pool-wait",
        &[
            "--num-blocks",
            "4",
            "--pool-wait-ms",
            "5000",
            "--kv-transfer-config",
            &short_lease,
        ],
    )?;
    let mut full = prefill(
        "p-pool-full",
        &[
            "--num-blocks",
            "4",
            "--pool-wait-ms",
            "300",
            "--kv-transfer-config",
            &long_lease,
        ],
    )?;
    wait_healthy(&c, &mut waits).await?;
    wait_healthy(&c, &mut full).await?;

    // The second request waits until the first (never read) lease expires, then runs.
    do_prefill(&c, &waits, &long).await?;
    let started = Instant::now();
    let second = do_prefill(&c, &waits, &format!("{long}!")).await?;
    let waited = started.elapsed();
    ensure!(waited >= Duration::from_millis(300), "no wait: {waited:?}");
    ensure!(
        second["kvlease"]["pool_wait_ms"].as_f64().unwrap_or(0.0) > 200.0,
        "{second}"
    );

    // With a 30 s lease the wait is bounded by --pool-wait-ms: 503 overloaded.
    do_prefill(&c, &full, &long).await?;
    let started = Instant::now();
    let (s, v) = post(
        &c,
        &full.url,
        &json!({"prompt": format!("{long}?"), "kv_transfer_params": {"do_remote_decode": true}}),
    )
    .await?;
    ensure!(
        s == 503 && v["error"]["type"] == "overloaded" && v["error"]["retryable"] == true,
        "{s} {v}"
    );
    ensure!(
        started.elapsed() >= Duration::from_millis(300),
        "answered before the pool wait"
    );
    // A prompt that can never fit is a 400 naming the prompt, at once.
    let (s, v) = post(
        &c,
        &full.url,
        &json!({"prompt": "q".repeat(100), "kv_transfer_params": {"do_remote_decode": true}}),
    )
    .await?;
    ensure!(s == 400 && v["error"]["param"] == "prompt", "{s} {v}");
    let pm = metrics(&c, &full).await?;
    assert_eq!(
        metric(&pm, "kvlease_requests_total{outcome=\"overloaded\"}"),
        1.0
    );
    assert_eq!(metric(&pm, "kvlease_blocks_held"), 3.0);
    Ok(())
}

/// P killed and restarted under the same engine id (and ports) while D is connected to the
/// old instance: the request caught in the restart ends in one retryable error, and the
/// next request (naming the new instance) makes D handshake again and succeeds. Before the
/// engine cores knew instances, D answered 503 "no live connection" until it restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_restart_under_the_same_engine_id() -> Result<()> {
    let c = client();
    let (port, side_port) = (free_port(), free_port());
    let start_p = |n: u32| -> Result<Agent> {
        let log = log_path("system", &format!("p-restart-{n}"));
        let file = std::fs::File::create(&log)?;
        let mut cmd = agent_command(
            env!("CARGO_BIN_EXE_prefill-agent"),
            "p-restart",
            port,
            side_port,
            "host",
            file,
        );
        cmd.args(["--num-blocks", "64"]);
        let child = cmd.spawn().context("spawn prefill-agent")?;
        Ok(Agent::new(child, "p-restart", log, port))
    };
    let mut p = start_p(1)?;
    let mut d = decode("d-restart", &["--num-blocks", "64"])?;
    wait_healthy(&c, &mut p).await?;
    wait_healthy(&c, &mut d).await?;
    let pa = do_prefill(&c, &p, &prompt(1)).await?;
    let (s, v) = post(&c, &d.url, &d_body(&prompt(1), 2, &pa)).await?;
    ensure!(s == 200, "before the restart: {s} {v}");
    // A lease granted by the old instance, then P dies and comes back.
    let caught = do_prefill(&c, &p, &prompt(2)).await?;
    p.proc.kill();
    let mut p = start_p(2)?;
    wait_healthy(&c, &mut p).await?;
    let (s, v) = post(&c, &d.url, &d_body(&prompt(2), 2, &caught)).await?;
    ensure!(
        s == 503 && v["error"]["retryable"] == true,
        "a request caught in the restart ends in one retryable error: {s} {v}"
    );
    for i in 3..6 {
        let pa = do_prefill(&c, &p, &prompt(i)).await?;
        let (s, v) = post(&c, &d.url, &d_body(&prompt(i), 2, &pa)).await?;
        ensure!(s == 200, "after the restart, request {i}: {s} {v}");
        check_answer(&prompt(i), 2, &pa, &v)?;
    }
    let handshakes = metric_of(&c, &d, "kvlease_handshakes_total{outcome=\"ok\"}").await?;
    ensure!(handshakes == 2.0, "D handshook {handshakes} times, want 2");
    assert_nothing_leaks(&c, &p, &d, Duration::from_secs(4)).await?;
    Ok(())
}

/// Clients that abort while their reads are in flight get their answer at once; D's
/// blocks come back when the reads end (the shell keeps polling them for the core).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborts_during_reads_free_d_blocks() -> Result<()> {
    let (c, p, d) = pd(
        &["--num-blocks", "512"],
        &[
            "--num-blocks",
            "512",
            "--max-running",
            "8",
            "--step-ms",
            "1",
        ],
        "abort-reads",
    )
    .await?;
    // Long prompts: their reads take a while, so some aborts land while they run.
    let long = |i: usize| format!("{} {}", prompt(i), "y".repeat(1500));
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..24 {
        let pa = do_prefill(&c, &p, &long(i)).await?;
        let id = format!("abort-reads-{i}");
        let body = json!({"prompt": long(i), "max_tokens": 50, "request_id": id,
            "kv_transfer_params": pa["kv_transfer_params"]});
        let (c2, url) = (c.clone(), d.url.clone());
        tasks.spawn(async move { post(&c2, &url, &body).await });
        tokio::time::sleep(Duration::from_millis(u64::try_from(i % 4).unwrap_or(0))).await;
        c.post(format!("{}/v1/abort/{id}", d.url)).send().await?;
    }
    while let Some(r) = tasks.join_next().await {
        let (s, v) = r??;
        ensure!(
            s == 200 || (s == 499 && v["error"]["type"] == "aborted"),
            "{s} {v}"
        );
    }
    wait_metric(
        &c,
        &d,
        "kvlease_blocks_held",
        Duration::from_secs(10),
        |v| v == 0.0,
    )
    .await?;
    wait_metric(
        &c,
        &d,
        "kvlease_requests_running",
        Duration::from_secs(10),
        |v| v == 0.0,
    )
    .await?;
    Ok(())
}
