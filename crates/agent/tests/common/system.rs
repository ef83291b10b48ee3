//! Helpers of the `system` test binary: spawning P and D agents, the request bodies, and
//! the byte-for-byte check of D's answer.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use kvlease_agent::kv;
use serde_json::{Value, json};

use super::{
    Agent, SHAPE, agent_command, client, free_port, log_path, post_completion, transport,
    wait_healthy, wait_metric,
};

pub(crate) fn spawn(bin: &str, name: &str, args: &[String]) -> Result<Agent> {
    let port = free_port();
    let side_port = free_port();
    let log = log_path("system", name);
    let file = std::fs::File::create(&log)?;
    let mut cmd = agent_command(bin, name, port, side_port, "host", file);
    cmd.args(args);
    let child = cmd.spawn().with_context(|| format!("spawn {bin}"))?;
    Ok(Agent::new(child, name, log, port))
}

pub(crate) fn prefill(name: &str, args: &[&str]) -> Result<Agent> {
    let args: Vec<String> = args.iter().map(|s| (*s).to_owned()).collect();
    spawn(env!("CARGO_BIN_EXE_prefill-agent"), name, &args)
}

pub(crate) fn decode(name: &str, args: &[&str]) -> Result<Agent> {
    let args: Vec<String> = args.iter().map(|s| (*s).to_owned()).collect();
    spawn(env!("CARGO_BIN_EXE_decode-agent"), name, &args)
}

pub(crate) fn kv_config(role: &str, extra: Value) -> String {
    json!({"kv_connector": "kvlease", "kv_role": role, "kv_connector_extra_config": extra})
        .to_string()
}

pub(crate) fn prompt(i: usize) -> String {
    format!(
        "request {i}: the quick brown fox jumps over the lazy dog {}",
        "x".repeat(i % 37)
    )
}

pub(crate) async fn post(c: &reqwest::Client, url: &str, body: &Value) -> Result<(u16, Value)> {
    let (status, text) = post_completion(c, url, body).await?;
    let v = serde_json::from_str(&text).with_context(|| format!("not JSON: {text}"))?;
    Ok((status, v))
}

/// Prefills `prompt` on P; returns P's answer.
pub(crate) async fn do_prefill(c: &reqwest::Client, p: &Agent, prompt: &str) -> Result<Value> {
    let body = json!({"prompt": prompt, "max_tokens": 1, "stream": false,
        "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false,
            "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}});
    let (status, v) = post(c, &p.url, &body).await?;
    ensure!(status == 200, "prefill: {status} {v}");
    Ok(v)
}

pub(crate) fn d_body(prompt: &str, max_tokens: u32, p_answer: &Value) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "kv_transfer_params": p_answer["kv_transfer_params"]})
}

/// Checks D's answer byte for byte against what the generator makes for `prompt`.
pub(crate) fn check_answer(
    prompt: &str,
    max_tokens: u32,
    p_answer: &Value,
    d: &Value,
) -> Result<()> {
    let want = kv::expected_digest(&SHAPE, &kv::tokenize(prompt));
    ensure!(
        p_answer["kv_digest"] == want.to_string(),
        "P digest {} != {want}",
        p_answer["kv_digest"]
    );
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
    ensure!(
        d["usage"]["completion_tokens"] == max_tokens,
        "usage {}",
        d["usage"]
    );
    let bytes = d["kv_transfer_stats"]["bytes"].as_u64().unwrap_or(0);
    let blocks = SHAPE.blocks_for(prompt.len()) as u64;
    // Every block of every layer, K and V, every head, block_size × head_dim bf16.
    let full = blocks * 2 * 2 * 4 * 16 * 64 * 2;
    ensure!(bytes == full, "moved {bytes} bytes, expected {full}");
    // The backend D reports is the one the agents were started on (shm on one host for
    // `auto` with host memory), so the shm rerun of these tests really reads over shm.
    let want_backend = match transport().as_str() {
        "auto" | "shm" => "shm",
        other => other,
    }
    .to_owned();
    ensure!(
        d["kv_transfer_stats"]["backend"] == want_backend,
        "read over {}, expected {want_backend}",
        d["kv_transfer_stats"]["backend"]
    );
    Ok(())
}

pub(crate) async fn pd(
    p_args: &[&str],
    d_args: &[&str],
    tag: &str,
) -> Result<(reqwest::Client, Agent, Agent)> {
    let c = client();
    let mut p = prefill(&format!("p-{tag}"), p_args)?;
    let mut d = decode(&format!("d-{tag}"), d_args)?;
    wait_healthy(&c, &mut p).await?;
    wait_healthy(&c, &mut d).await?;
    Ok((c, p, d))
}

pub(crate) async fn assert_nothing_leaks(
    c: &reqwest::Client,
    p: &Agent,
    d: &Agent,
    within: Duration,
) -> Result<()> {
    wait_metric(c, p, "kvlease_blocks_held", within, |v| v == 0.0).await?;
    wait_metric(c, p, "kvlease_leases_active", within, |v| v == 0.0).await?;
    wait_metric(c, d, "kvlease_requests_tracked", within, |v| v == 0.0).await?;
    wait_metric(c, d, "kvlease_blocks_held", within, |v| v == 0.0).await?;
    Ok(())
}

/// Reads an SSE response to the end; returns the text and the last data object.
pub(crate) async fn read_sse(r: reqwest::Response) -> Result<(String, Value)> {
    let body = r.text().await?;
    let mut text = String::new();
    let mut last = Value::Null;
    let mut done = false;
    for line in body.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(data)?;
        if let Some(t) = v["choices"][0]["text"].as_str() {
            text.push_str(t);
        }
        last = v;
    }
    ensure!(done, "stream did not end with [DONE]: {body}");
    Ok((text, last))
}
