//! Bidirectional multi-turn KV transfer, end to end: real `prefill-agent` and
//! `decode-agent` processes on loopback over TCP, both `kv_role: kv_both` with
//! `bidirectional_kv_xfer: true`. The test plays the proxy: it sends turn N's D answer's
//! `kv_transfer_params` (D's cached-blocks params) to P with turn N+1.
//!
//! Every wait has a timeout, children are killed on drop, ports are picked free
//! (`KVLEASE_SYSTEM_LOGS=1` prints each agent's log tail when it is dropped).

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use common::{
    Agent, SHAPE, agent_command, client, free_port, log_path, metric_of, post_completion,
    wait_healthy, wait_metric,
};
use kvlease_agent::kv;
use serde_json::{Value, json};

/// Starts `bin` in bidirectional mode with `extra` in `kv_connector_extra_config` and the
/// test clock offset `skew_ms`.
fn spawn(bin: &str, name: &str, extra: &Value, skew_ms: i64, cli: &[&str]) -> Result<Agent> {
    let port = free_port();
    let side_port = free_port();
    let log = log_path("bidir", name);
    let file = std::fs::File::create(&log)?;
    let mut cfg = json!({"bidirectional_kv_xfer": true, "kv_lease_duration": 5});
    if let (Some(c), Some(e)) = (cfg.as_object_mut(), extra.as_object()) {
        c.extend(e.clone());
    }
    let kv_cfg =
        json!({"kv_connector": "kvlease", "kv_role": "kv_both", "kv_connector_extra_config": cfg})
            .to_string();
    let mut cmd = agent_command(bin, name, port, side_port, "host", file);
    cmd.args(["--kv-transfer-config", &kv_cfg])
        .args(cli)
        .env("KVLEASE_TEST_CLOCK_OFFSET_MS", skew_ms.to_string());
    let child = cmd.spawn().with_context(|| format!("spawn {bin}"))?;
    Ok(Agent::new(child, name, log, port))
}

/// A P and a D, both healthy.
async fn pair(
    c: &reqwest::Client,
    tag: &str,
    extra: Value,
    p_skew_ms: i64,
    d_skew_ms: i64,
) -> Result<(Agent, Agent)> {
    let mut p = spawn(
        env!("CARGO_BIN_EXE_prefill-agent"),
        &format!("p-{tag}"),
        &extra,
        p_skew_ms,
        &[],
    )?;
    let mut d = spawn(
        env!("CARGO_BIN_EXE_decode-agent"),
        &format!("d-{tag}"),
        &extra,
        d_skew_ms,
        &[],
    )?;
    wait_healthy(c, &mut p).await?;
    wait_healthy(c, &mut d).await?;
    Ok((p, d))
}

async fn post(c: &reqwest::Client, url: &str, body: &Value) -> Result<Value> {
    let (status, text) = post_completion(c, url, body).await?;
    let v: Value = serde_json::from_str(&text).with_context(|| format!("not JSON: {text}"))?;
    ensure!(status == 200, "{url}: {status} {v}");
    Ok(v)
}

/// One turn through P then D, as the proxy runs it; `cached` is D's params of the previous
/// turn. Returns (P's answer, D's answer); checks both digests against a full recompute.
async fn turn(
    c: &reqwest::Client,
    p: &Agent,
    d: &Agent,
    prompt: &str,
    cached: Option<&Value>,
) -> Result<(Value, Value)> {
    let mut params = json!({"do_remote_decode": true, "do_remote_prefill": false});
    if let (Some(m), Some(Value::Object(cached))) = (params.as_object_mut(), cached) {
        m.extend(cached.clone());
    }
    let pa = post(
        c,
        &p.url,
        &json!({"prompt": prompt, "max_tokens": 1, "kv_transfer_params": params,
            "conversation_id": "conv-1"}),
    )
    .await?;
    let da = post(
        c,
        &d.url,
        &json!({"prompt": prompt, "max_tokens": 4, "conversation_id": "conv-1",
            "kv_transfer_params": pa["kv_transfer_params"]}),
    )
    .await?;
    let want = kv::expected_digest(&SHAPE, &kv::tokenize(prompt)).to_string();
    ensure!(
        pa["kv_digest"] == want,
        "P digest {} != recompute {want}",
        pa["kv_digest"]
    );
    ensure!(
        da["kv_digest"] == want,
        "D digest {} != recompute {want}",
        da["kv_digest"]
    );
    ensure!(
        da["kv_transfer_params"]["kvlease_bidir"] == true,
        "D kept no blocks: {}",
        da["kv_transfer_params"]
    );
    ensure!(da["kv_transfer_params"]["conversation_id"] == "conv-1");
    Ok((pa, da))
}

fn first_prompt() -> String {
    format!(
        "<|user|>\nTell me about leases. {}\n<|assistant|>\n",
        "Why do KV blocks need them? ".repeat(4)
    )
}

fn next_prompt(first: &str, answer: &Value) -> String {
    let text = answer["choices"][0]["text"].as_str().unwrap_or("");
    format!("{first}{text}\n<|user|>\nAnd what about heartbeats?\n<|assistant|>\n")
}

fn pulled(pa: &Value) -> u64 {
    pa["cached_tokens_pulled"].as_u64().unwrap_or(u64::MAX)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_turns_pull_the_shared_prefix_and_digests_match_recompute() -> Result<()> {
    let c = client();
    let (p, d) = pair(&c, "pull", json!({"kv_recompute_threshold": 16}), 0, 0).await?;
    let first = first_prompt();
    let (pa1, da1) = turn(&c, &p, &d, &first, None).await?;
    ensure!(pulled(&pa1) == 0, "turn 1 pulled {}", pa1);
    let blocks1 = SHAPE.blocks_for(first.len()) as f64;
    ensure!(
        metric_of(&c, &d, "kvlease_decoder_cached_blocks").await? == blocks1,
        "D should hold turn 1's {blocks1} blocks"
    );
    let second = next_prompt(&first, &da1);
    let (pa2, _da2) = turn(&c, &p, &d, &second, Some(&da1["kv_transfer_params"])).await?;
    let whole = (first.len() / 16 * 16) as u64;
    ensure!(pulled(&pa2) == whole, "turn 2 pulled {} of {whole}", pa2);
    ensure!(metric_of(&c, &p, "kvlease_cached_tokens_pulled_total").await? == whole as f64);
    // P told D it read turn 1: D freed it and now holds turn 2 only.
    wait_metric(
        &c,
        &d,
        "kvlease_decoder_cache_pulled_total",
        Duration::from_secs(5),
        |v| v == 1.0,
    )
    .await?;
    let blocks2 = SHAPE.blocks_for(second.len()) as f64;
    wait_metric(
        &c,
        &d,
        "kvlease_decoder_cached_blocks",
        Duration::from_secs(5),
        |v| v == blocks2,
    )
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_expiry_frees_d_and_the_next_turn_recomputes() -> Result<()> {
    let c = client();
    let extra = json!({"kv_recompute_threshold": 16, "decoder_kv_blocks_ttl": 1.0,
        "pull_safety_margin": 0.2});
    let (p, d) = pair(&c, "ttl", extra, 0, 0).await?;
    let first = first_prompt();
    let (_, da1) = turn(&c, &p, &d, &first, None).await?;
    wait_metric(
        &c,
        &d,
        "kvlease_decoder_cache_expired_total",
        Duration::from_secs(5),
        |v| v == 1.0,
    )
    .await?;
    ensure!(metric_of(&c, &d, "kvlease_decoder_cached_blocks").await? == 0.0);
    let second = next_prompt(&first, &da1);
    let (pa2, _) = turn(&c, &p, &d, &second, Some(&da1["kv_transfer_params"])).await?;
    ensure!(pulled(&pa2) == 0, "pulled after the TTL: {pa2}");
    ensure!(metric_of(&c, &p, "kvlease_pull_recomputes_total").await? == 1.0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_seconds_of_skew_still_give_the_right_decision() -> Result<()> {
    let c = client();
    // D's clock 10 s behind: its deadline (D's now + 25 s) reads as P's now + 15 s, so a
    // naive comparison would refuse with a 20 s margin; the offset-corrected view (25 s
    // left) pulls.
    let extra = json!({"kv_recompute_threshold": 16, "decoder_kv_blocks_ttl": 25.0,
        "pull_safety_margin": 20.0});
    let (p, d) = pair(&c, "skew-behind", extra, 0, -10_000).await?;
    let first = first_prompt();
    let (_, da1) = turn(&c, &p, &d, &first, None).await?;
    let second = next_prompt(&first, &da1);
    let (pa2, _) = turn(&c, &p, &d, &second, Some(&da1["kv_transfer_params"])).await?;
    ensure!(pulled(&pa2) > 0, "skewed D behind: should pull, {pa2}");
    drop((p, d));

    // D's clock 10 s ahead: 1.5 s after turn 1, 3.5 s of the 5 s TTL are left, below the
    // 4.5 s margin; a naive comparison would see 13.5 s and pull.
    let extra = json!({"kv_recompute_threshold": 16, "decoder_kv_blocks_ttl": 5.0,
        "pull_safety_margin": 4.5});
    let (p, d) = pair(&c, "skew-ahead", extra, 0, 10_000).await?;
    let (_, da1) = turn(&c, &p, &d, &first, None).await?;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (pa2, _) = turn(&c, &p, &d, &second, Some(&da1["kv_transfer_params"])).await?;
    ensure!(
        pulled(&pa2) == 0,
        "deadline too close: should recompute, {pa2}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_diverging_inside_the_cached_prefix_pulls_only_common_blocks() -> Result<()> {
    let c = client();
    let (p, d) = pair(&c, "diverge", json!({"kv_recompute_threshold": 16}), 0, 0).await?;
    let first = first_prompt();
    let (_, da1) = turn(&c, &p, &d, &first, None).await?;
    // Same length, one byte changed at position 40: blocks 0 and 1 (tokens 0..32) match.
    let mut bytes = first.clone().into_bytes();
    bytes[40] = if bytes[40] == b'X' { b'Y' } else { b'X' };
    let edited = String::from_utf8(bytes)?;
    let second = next_prompt(&edited, &da1);
    let (pa2, da2) = turn(&c, &p, &d, &second, Some(&da1["kv_transfer_params"])).await?;
    ensure!(
        pulled(&pa2) == 32,
        "should pull the 2 common blocks only: {pa2}"
    );

    // Diverging in the first block pulls nothing.
    let mut bytes = second.clone().into_bytes();
    bytes[3] = if bytes[3] == b'X' { b'Y' } else { b'X' };
    let third = String::from_utf8(bytes)?;
    let (pa3, _) = turn(&c, &p, &d, &third, Some(&da2["kv_transfer_params"])).await?;
    ensure!(pulled(&pa3) == 0, "first block differs: {pa3}");
    Ok(())
}

/// Starts `kvlease-proxy` in front of `p` and `d`.
async fn proxy(c: &reqwest::Client, p: &Agent, d: &Agent) -> Result<Agent> {
    let port = free_port();
    let log = log_path("bidir", "proxy");
    let file = std::fs::File::create(&log)?;
    let child = Command::new(env!("CARGO_BIN_EXE_kvlease-proxy"))
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--prefill", &p.url, "--decode", &d.url])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(file)
        .spawn()
        .context("spawn kvlease-proxy")?;
    let mut a = Agent::new(child, "proxy", log, port);
    wait_healthy(c, &mut a).await?;
    Ok(a)
}

async fn chat(c: &reqwest::Client, url: &str, messages: &Value) -> Result<Value> {
    let r = c
        .post(format!("{url}/v1/chat/completions"))
        .json(&json!({"messages": messages, "max_tokens": 4}))
        .send()
        .await?;
    let status = r.status().as_u16();
    let text = r.text().await?;
    let v: Value = serde_json::from_str(&text).with_context(|| format!("not JSON: {text}"))?;
    ensure!(status == 200, "{url}: {status} {v}");
    Ok(v)
}

/// The prompt P and D build from chat messages (`ChatRequest::into_completion`).
fn chat_prompt(messages: &Value) -> String {
    let mut s = String::new();
    for m in messages.as_array().into_iter().flatten() {
        let role = m["role"].as_str().unwrap_or("");
        let content = m["content"].as_str().unwrap_or("");
        s.push_str(&format!("<|{role}|>\n{content}\n"));
    }
    s.push_str("<|assistant|>\n");
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_carries_d_params_to_the_next_turn_by_first_message() -> Result<()> {
    let c = client();
    let (p, d) = pair(&c, "proxy", json!({"kv_recompute_threshold": 16}), 0, 0).await?;
    let px = proxy(&c, &p, &d).await?;
    let first = format!(
        "Tell me about leases. {}",
        "Why do KV blocks need them? ".repeat(4)
    );
    let mut messages = json!([{"role": "user", "content": first}]);
    let a1 = chat(&c, &px.url, &messages).await?;
    ensure!(a1["cached_tokens_pulled"] == 0, "turn 1: {a1}");
    let reply = a1["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    if let Some(m) = messages.as_array_mut() {
        m.push(json!({"role": "assistant", "content": reply}));
        m.push(json!({"role": "user", "content": "And heartbeats?"}));
    }
    let a2 = chat(&c, &px.url, &messages).await?;
    let turn1 = chat_prompt(&json!([{"role": "user", "content": first}]));
    // Turn 1's prompt ends with "<|assistant|>\n"; turn 2 has the same bytes up to there.
    let whole = (turn1.len() / 16 * 16) as u64;
    ensure!(
        a2["cached_tokens_pulled"] == whole,
        "turn 2 pulled {} of {whole}",
        a2["cached_tokens_pulled"]
    );
    let want = kv::expected_digest(&SHAPE, &kv::tokenize(&chat_prompt(&messages))).to_string();
    ensure!(
        a2["kv_digest"] == want,
        "digest {} != recompute {want}",
        a2["kv_digest"]
    );
    Ok(())
}

/// Symmetric lease: while turn 2 waits on P (P's pool is held by a lease nobody reads), P
/// heartbeats D's cached turn 1 past its 1.5 s TTL, and then pulls it. Without the option
/// the same schedule recomputes.
async fn waits_on_p(symmetric: bool) -> Result<(Value, f64)> {
    let c = client();
    // D's TTL is half of how long the next turn waits on P, with room for heartbeats
    // delayed by a loaded machine.
    let extra = json!({"kv_recompute_threshold": 16, "decoder_kv_blocks_ttl": 3,
        "pull_safety_margin": 0.3, "kv_lease_duration": 6, "symmetric_decoder_lease": symmetric});
    let tag = if symmetric { "sym" } else { "fixed" };
    let mut p = spawn(
        env!("CARGO_BIN_EXE_prefill-agent"),
        &format!("p-{tag}"),
        &extra,
        0,
        &["--num-blocks", "16", "--pool-wait-ms", "15000"],
    )?;
    let mut d = spawn(
        env!("CARGO_BIN_EXE_decode-agent"),
        &format!("d-{tag}"),
        &extra,
        0,
        &[],
    )?;
    wait_healthy(&c, &mut p).await?;
    wait_healthy(&c, &mut d).await?;
    let first = first_prompt();
    let (_, da1) = turn(&c, &p, &d, &first, None).await?;
    // A prefill nobody decodes takes all 16 blocks until its 6 s lease expires (P's
    // requests wait up to 15 s for blocks).
    post(
        &c,
        &p.url,
        &json!({"prompt": "h".repeat(256), "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": true}}),
    )
    .await?;
    let second = next_prompt(&first, &da1);
    let (pa2, _) = turn(&c, &p, &d, &second, Some(&da1["kv_transfer_params"])).await?;
    let expired = metric_of(&c, &d, "kvlease_decoder_cache_expired_total").await?;
    Ok((pa2, expired))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn symmetric_lease_keeps_the_cached_turn_while_the_next_waits_on_p() -> Result<()> {
    let (pa2, expired) = waits_on_p(true).await?;
    ensure!(pulled(&pa2) > 0, "symmetric: should pull, {pa2}");
    ensure!(
        expired == 0.0,
        "symmetric: D expired {expired} cached turns"
    );
    let (pa2, expired) = waits_on_p(false).await?;
    ensure!(pulled(&pa2) == 0, "fixed TTL: should recompute, {pa2}");
    ensure!(
        expired == 1.0,
        "fixed TTL: D expired {expired} cached turns"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_turns_give_way_to_new_requests_on_a_full_d() -> Result<()> {
    let c = client();
    let extra = json!({"kv_recompute_threshold": 16});
    let mut p = spawn(
        env!("CARGO_BIN_EXE_prefill-agent"),
        "p-evict",
        &extra,
        0,
        &[],
    )?;
    let mut d = spawn(
        env!("CARGO_BIN_EXE_decode-agent"),
        "d-evict",
        &extra,
        0,
        &["--num-blocks", "16"],
    )?;
    wait_healthy(&c, &mut p).await?;
    wait_healthy(&c, &mut d).await?;
    let first = first_prompt();
    turn(&c, &p, &d, &first, None).await?;
    ensure!(metric_of(&c, &d, "kvlease_decoder_cached_blocks").await? == 10.0);
    // 13 blocks fit only when turn 1's 10 cached blocks go (the default TTL is 480 s).
    let other = format!("another conversation {}", "y".repeat(180));
    turn(&c, &p, &d, &other, None).await?;
    ensure!(metric_of(&c, &d, "kvlease_decoder_cache_evicted_total").await? == 1.0);
    ensure!(metric_of(&c, &d, "kvlease_decoder_cached_blocks").await? == 13.0);
    Ok(())
}
