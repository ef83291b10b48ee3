//! What D keeps of its P engines, with real processes on loopback: a request's word never
//! makes D drop a working P (only P's own side channel announces a new instance, checked
//! at most once a second), and D keeps at most `--max-prefill-engines` of them, closing
//! the connections of the idle ones it drops.

mod common;

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use common::system::{check_answer, d_body, decode, do_prefill, post, prefill, prompt};
use common::{client, metric_of, threads_and_fds, wait_healthy};
use serde_json::Value;

/// Both agents of a test share this cluster token; the HTTP client has no credential.
const TOKEN: [&str; 2] = ["--auth-token", "peers-token"];

/// Prefills prompt `i` on `p` and decodes it on `d`, checking the answer byte for byte.
async fn round_trip(
    c: &reqwest::Client,
    p: &common::Agent,
    d: &common::Agent,
    i: usize,
) -> Result<()> {
    let text = prompt(i);
    let pa = do_prefill(c, p, &text).await?;
    let (s, v) = post(c, &d.url, &d_body(&text, 2, &pa)).await?;
    ensure!(s == 200, "request {i}: {s} {v}");
    check_answer(&text, 2, &pa, &v)
}

/// An HTTP client without any credential sends D forty requests that name the real P
/// with its instance plus one (the audit's repro, which used to make D forget P and
/// handshake again each time, leaking connections on both sides until P's per-address
/// cap refused D for good). D now asks P's side channel at most once a second, keeps its
/// connection, and refuses the requests (400 naming `kvlease_instance` once P answered,
/// retryable 503 with `Retry-After` in between); neither D nor P grows, and real requests
/// still work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_naming_a_newer_instance_never_cuts_d_off_from_p() -> Result<()> {
    let c = client();
    let mut p = prefill("peers-p", &TOKEN)?;
    let mut d = decode("peers-d", &TOKEN)?;
    wait_healthy(&c, &mut p).await?;
    wait_healthy(&c, &mut d).await?;
    round_trip(&c, &p, &d, 0).await?;
    let (p_pid, d_pid) = (p.proc.child.id(), d.proc.child.id());
    let (p_before, d_before) = (threads_and_fds(p_pid)?, threads_and_fds(d_pid)?);
    let mut statuses = Vec::new();
    for i in 0..40 {
        let text = prompt(100 + i);
        let mut pa = do_prefill(&c, &p, &text).await?;
        let params = &mut pa["kv_transfer_params"];
        let instance = params["kvlease_instance"].as_u64().context("instance")?;
        params["kvlease_instance"] = Value::from(instance + 1);
        let r = c
            .post(format!("{}/v1/completions", d.url))
            .json(&d_body(&text, 2, &pa))
            .send()
            .await?;
        let status = r.status().as_u16();
        let retry_after = r.headers().get("retry-after").cloned();
        let v: Value = r.json().await?;
        match status {
            400 => ensure!(
                v["error"]["param"] == "kv_transfer_params.kvlease_instance",
                "{v}"
            ),
            503 => ensure!(
                v["error"]["retryable"] == true && retry_after.is_some(),
                "{v} {retry_after:?}"
            ),
            _ => anyhow::bail!("forged request {i}: {status} {v}"),
        }
        statuses.push(status);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    ensure!(statuses.contains(&400), "P was never asked: {statuses:?}");
    let restarts = metric_of(&c, &d, "kvlease_peer_restarts_total").await?;
    ensure!(restarts == 0.0, "D took P for restarted {restarts} times");
    let checks = metric_of(&c, &d, "kvlease_instance_checks_total").await?;
    // 40 requests over about 2-4 s: at most one check a second.
    ensure!((1.0..=6.0).contains(&checks), "{checks} instance checks");
    round_trip(&c, &p, &d, 1).await?;
    let (p_after, d_after) = (threads_and_fds(p_pid)?, threads_and_fds(d_pid)?);
    for (who, (t0, f0), (t1, f1)) in [("P", p_before, p_after), ("D", d_before, d_after)] {
        ensure!(
            t1 <= t0 + 4 && f1 <= f0 + 8,
            "{who} grew from {t0} threads / {f0} fds to {t1} / {f1}"
        );
    }
    Ok(())
}

/// With `--max-prefill-engines 1`, D alternating between two P engines drops the idle
/// one each time (`kvlease_remote_engines_evicted_total`), closing its connections: D's
/// threads and descriptors stay flat however often it alternates, and every request is
/// served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d_keeps_at_most_max_prefill_engines_and_closes_the_dropped_ones() -> Result<()> {
    let c = client();
    let mut pa = prefill("peers-pa", &TOKEN)?;
    let mut pb = prefill("peers-pb", &TOKEN)?;
    let mut d = decode(
        "peers-d1",
        &[&TOKEN[..], &["--max-prefill-engines", "1"]].concat(),
    )?;
    for a in [&mut pa, &mut pb, &mut d] {
        wait_healthy(&c, a).await?;
    }
    round_trip(&c, &pa, &d, 0).await?;
    round_trip(&c, &pb, &d, 1).await?;
    let d_pid = d.proc.child.id();
    let before = threads_and_fds(d_pid)?;
    for i in 0..3 {
        round_trip(&c, &pa, &d, 10 + 2 * i).await?;
        round_trip(&c, &pb, &d, 11 + 2 * i).await?;
    }
    let evicted = metric_of(&c, &d, "kvlease_remote_engines_evicted_total").await?;
    ensure!(evicted == 7.0, "{evicted} engines dropped");
    let kept = metric_of(&c, &d, "kvlease_remote_engines").await?;
    ensure!(kept == 1.0, "D keeps {kept} engines");
    // Dropped connections close on both ends; give P's side a moment to see it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (t0, f0) = before;
    let (t1, f1) = threads_and_fds(d_pid)?;
    ensure!(
        t1 <= t0 + 4 && f1 <= f0 + 8,
        "D grew from {t0} threads / {f0} fds to {t1} / {f1} over 6 alternations"
    );
    Ok(())
}
