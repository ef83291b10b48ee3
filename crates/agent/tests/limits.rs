//! Hostile input against real `prefill-agent` / `decode-agent` processes on loopback: many
//! slow pre-auth side-channel connections, oversized announced frames, oversized and slow
//! HTTP requests, connections over the cap, and a stalled engine behind `/health`.
//!
//! Every loop is bounded in count and time; only 127.0.0.1 is used. The data port's
//! pre-auth deadline is tested on real sockets in `kvlease-transport`'s `tests/tcp_auth.rs`.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use common::{
    Agent, agent_command, client, closed_within, free_port, log_path, metric_of, post_completion,
    rss_and_threads, wait_healthy,
};
use serde_json::{Value, json};

const PREFILL: &str = env!("CARGO_BIN_EXE_prefill-agent");
const TOKEN: &str = "limits-test-token";

/// A running agent and its side-channel port.
struct Spawned {
    agent: Agent,
    side_port: u16,
}

fn spawn(name: &str, args: &[&str], env: &[(&str, &str)]) -> Result<Spawned> {
    let port = free_port();
    let side_port = free_port();
    let log = log_path("limits", name);
    let file = std::fs::File::create(&log)?;
    let mut cmd = agent_command(PREFILL, name, port, side_port, "host", file);
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = cmd.spawn().context("spawn prefill-agent")?;
    Ok(Spawned {
        agent: Agent::new(child, name, log, port),
        side_port,
    })
}

fn prefill_body(prompt: &str) -> Value {
    json!({"prompt": prompt, "max_tokens": 1, "stream": false,
        "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false,
            "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
            "remote_port": null}})
}

/// One honest prefill; returns how long it took.
async fn honest_prefill(c: &reqwest::Client, a: &Agent) -> Result<Duration> {
    let start = Instant::now();
    let (status, text) = post_completion(c, &a.url, &prefill_body("an honest request")).await?;
    ensure!(status == 200, "honest prefill: {status} {text}");
    Ok(start.elapsed())
}

fn error_type(text: &str) -> Result<(String, u64)> {
    let v: Value = serde_json::from_str(text).with_context(|| format!("not JSON: {text}"))?;
    let e = &v["error"];
    ensure!(
        e["message"].is_string() && e.get("param").is_some() && e["retryable"].is_boolean(),
        "not the error shape: {text}"
    );
    Ok((
        e["type"].as_str().unwrap_or_default().to_owned(),
        e["code"].as_u64().unwrap_or_default(),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_pre_auth_side_channel_connections_stay_bounded() -> Result<()> {
    let mut p = spawn(
        "sc-slow",
        &[
            "--auth-token",
            TOKEN,
            "--side-channel-max-connections",
            "16",
            "--side-channel-handshake-timeout-ms",
            "2000",
        ],
        &[],
    )?;
    let c = client();
    wait_healthy(&c, &mut p.agent).await?;
    let pid = p.agent.proc.child.id();
    let (rss0, threads0) = rss_and_threads(pid)?;
    // 400 connections, each announcing a first frame (a hello) of the largest size allowed
    // before auth and sending 1 KiB of it, then holding on.
    let mut held = Vec::new();
    for _ in 0..400 {
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", p.side_port)) else {
            continue;
        };
        let _ = s.write_all(&side_channel_header(kvlease_proto::auth::MAX_BODY as u32));
        let _ = s.write_all(&[b' '; 1024]);
        held.push(s);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (rss1, threads1) = rss_and_threads(pid)?;
    ensure!(
        threads1 <= threads0 + 16 + 2,
        "threads {threads0} -> {threads1} with 400 slow connections (cap 16)"
    );
    ensure!(
        rss1 <= rss0 + 64 * 1024,
        "VmRSS {rss0} KiB -> {rss1} KiB with 400 slow connections"
    );
    // The agent keeps serving: an honest request in normal time.
    let took = honest_prefill(&c, &p.agent).await?;
    ensure!(
        took < Duration::from_secs(5),
        "honest prefill took {took:?}"
    );
    // Each connection over the cap took the slot of the oldest slow one: none was refused.
    let evicted = metric_of(&c, &p.agent, "kvlease_side_channel_evicted_total").await?;
    ensure!(
        evicted >= 300.0,
        "kvlease_side_channel_evicted_total = {evicted}"
    );
    // An honest D, from the same address, gets its handshake while the slow connections
    // still hold every slot: it takes the oldest one's.
    let addr = format!("127.0.0.1:{}", p.side_port);
    let deadline = Instant::now() + Duration::from_secs(2);
    let welcome = loop {
        match tokio::task::spawn_blocking({
            let addr = addr.clone();
            move || {
                kvlease_agent::sidechannel::handshake(
                    &addr,
                    Some(TOKEN),
                    None,
                    "d-honest",
                    1,
                    &[],
                    1,
                )
            }
        })
        .await?
        {
            Ok(w) => break w,
            // Cut off by the flood's last connections: retry at once.
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => bail!("honest handshake never served: {e}"),
        }
    };
    ensure!(welcome.info["engine_id"] == "sc-slow", "{:?}", welcome.info);
    drop(held);
    ensure!(p.agent.proc.child.try_wait()?.is_none(), "agent exited");
    Ok(())
}

/// The header of a side-channel hello frame announcing `len` body bytes.
fn side_channel_header(len: u32) -> Vec<u8> {
    let mut h = vec![kvlease_proto::sidechannel::Kind::Hello as u8];
    h.extend_from_slice(&len.to_le_bytes());
    h
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_four_mib_side_channel_frame_before_auth_is_refused_unread() -> Result<()> {
    let mut p = spawn("sc-big", &["--auth-token", TOKEN], &[])?;
    let c = client();
    wait_healthy(&c, &mut p.agent).await?;
    let pid = p.agent.proc.child.id();
    let (rss0, _) = rss_and_threads(pid)?;
    let mut closed = 0;
    for _ in 0..50 {
        let mut s = TcpStream::connect(("127.0.0.1", p.side_port))?;
        s.write_all(&side_channel_header(4u32 << 20))?;
        // Offer data the server should never wait for.
        let _ = s.write_all(&[b'{'; 64 << 10]);
        if closed_within(&mut s, Duration::from_secs(3))? {
            closed += 1;
        }
    }
    ensure!(
        closed == 50,
        "only {closed} of 50 oversized frames were refused"
    );
    let (rss1, _) = rss_and_threads(pid)?;
    ensure!(
        rss1 <= rss0 + 32 * 1024,
        "VmRSS {rss0} KiB -> {rss1} KiB after 50 announced 4 MiB frames"
    );
    honest_prefill(&c, &p.agent).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_bodies_and_prompts_are_refused_in_the_json_shape() -> Result<()> {
    let mut p = spawn(
        "http-size",
        &[
            "--http-max-body-bytes",
            "65536",
            "--http-max-prompt-bytes",
            "1000",
        ],
        &[],
    )?;
    let c = client();
    wait_healthy(&c, &mut p.agent).await?;
    // A body over the limit: 413.
    let big = prefill_body(&"x".repeat(100 << 10));
    let (status, text) = post_completion(&c, &p.agent.url, &big).await?;
    ensure!(status == 413, "{status} {text}");
    ensure!(error_type(&text)? == ("request_too_large".to_owned(), 413));
    // Chat too.
    let r = c
        .post(format!("{}/v1/chat/completions", p.agent.url))
        .json(&json!({"messages": [{"role": "user", "content": "y".repeat(100 << 10)}]}))
        .send()
        .await?;
    ensure!(r.status() == 413);
    ensure!(error_type(&r.text().await?)?.0 == "request_too_large");
    // A prompt over its limit inside an acceptable body: 400 before tokenizing.
    let (status, text) =
        post_completion(&c, &p.agent.url, &prefill_body(&"z".repeat(2000))).await?;
    ensure!(status == 400, "{status} {text}");
    ensure!(text.contains("bytes of text"), "{text}");
    ensure!(error_type(&text)?.0 == "invalid_request_error");
    // Both counted as bad requests, and the agent serves on.
    let bad = metric_of(
        &c,
        &p.agent,
        "kvlease_requests_total{outcome=\"bad_request\"}",
    )
    .await?;
    ensure!(bad >= 3.0, "bad_request = {bad}");
    honest_prefill(&c, &p.agent).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_headers_and_idle_connections_are_closed_and_idle_ones_make_room() -> Result<()> {
    let mut p = spawn(
        "http-slow",
        &[
            "--http-header-timeout-ms",
            "1000",
            "--http-body-timeout-ms",
            "1000",
            "--http-max-connections",
            "8",
        ],
        &[],
    )?;
    let c = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(30))
        .build()?;
    wait_healthy(&c, &mut p.agent).await?;
    let port = p
        .agent
        .url
        .rsplit(':')
        .next()
        .context("url has a port")?
        .parse::<u16>()?;
    let pid = p.agent.proc.child.id();
    let (_, threads0) = rss_and_threads(pid)?;

    // Slow-loris headers: one header byte every 200 ms; closed by the 1 s header timeout.
    let mut loris = TcpStream::connect(("127.0.0.1", port))?;
    loris.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")?;
    let start = Instant::now();
    let mut closed_after = None;
    for _ in 0..50 {
        if loris.write_all(b"X").is_err() || closed_within(&mut loris, Duration::from_millis(200))?
        {
            closed_after = Some(start.elapsed());
            break;
        }
    }
    let closed_after = closed_after.context("slow-loris connection never closed in 10 s")?;
    ensure!(
        closed_after < Duration::from_secs(4),
        "slow headers held the connection {closed_after:?}"
    );

    // A slow body: headers in time, then the body never completes: 408 in the JSON shape.
    let mut slow = TcpStream::connect(("127.0.0.1", port))?;
    slow.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pro",
    )?;
    slow.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut answer = Vec::new();
    let _ = slow.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    ensure!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    ensure!(answer.contains("request_timeout"), "{answer}");

    // An idle connection (no request at all) is closed by the same timeout.
    let mut idle = TcpStream::connect(("127.0.0.1", port))?;
    ensure!(
        closed_within(&mut idle, Duration::from_secs(5))?,
        "idle connection kept open"
    );

    // The cap (8; 7 per address): idle connections never keep a newcomer out. Two
    // addresses fill it with idle connections (the audit's 2 addresses left /health
    // unanswered); /health from a third is answered, taking an idle one's slot.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let to = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut fill = Vec::new();
    for from in ["127.0.0.2", "127.0.0.3"] {
        for _ in 0..4 {
            fill.push(connect_from(from, to).await?);
        }
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let health = reqwest::Client::builder()
        .local_address("127.0.0.4".parse::<std::net::IpAddr>()?)
        .timeout(Duration::from_secs(5))
        .build()?
        .get(format!("http://127.0.0.1:{port}/health"))
        .send()
        .await?;
    ensure!(health.status().is_success(), "/health: {}", health.status());
    let closed = fill
        .iter_mut()
        .map(|s| closed_within(s, Duration::from_millis(300)))
        .collect::<Result<Vec<bool>>>()?;
    ensure!(
        closed.iter().filter(|&&c| c).count() >= 1,
        "no idle connection made room: {closed:?}"
    );
    let (_, threads1) = rss_and_threads(pid)?;
    ensure!(
        threads1 <= threads0 + 2,
        "threads {threads0} -> {threads1}: connections must not cost threads"
    );
    drop(fill);
    // Busy connections are not cut off: 7 requests whose bodies trickle hold this
    // address's share, and an 8th connection from it gets a 503 that says to retry.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut busy = Vec::new();
    for _ in 0..7 {
        let mut s = TcpStream::connect(to)?;
        s.write_all(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{",
        )?;
        busy.push(s);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut over = TcpStream::connect(to)?;
    over.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut answer = Vec::new();
    let _ = over.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    ensure!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    ensure!(
        answer.contains("retry-after: 1") && answer.contains(r#""retryable":true"#),
        "{answer}"
    );
    drop(busy);
    // Honest requests are served again, once the server has seen the busy connections
    // close (until then the address's share is still full and a newcomer is told to
    // retry, before it has sent anything).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match honest_prefill(&c, &p.agent).await {
            Ok(_) => break,
            Err(e) if Instant::now() < deadline => {
                eprintln!("honest prefill not served yet: {e:#}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e.context("honest prefill 5 s after the busy connections closed")),
        }
    }
    let refused = metric_of(&c, &p.agent, "kvlease_http_connections_refused_total").await?;
    ensure!(
        refused >= 1.0,
        "kvlease_http_connections_refused_total = {refused}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_answers_503_while_the_engine_is_stalled() -> Result<()> {
    let mut p = spawn(
        "health-stall",
        &["--health-engine-stall-ms", "1000"],
        &[("KVLEASE_TEST_STALL_ENGINE_MS", "4000")],
    )?;
    let c = client();
    let url = format!("{}/health", p.agent.url);
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut saw_503 = None;
    let recovered = loop {
        ensure!(
            Instant::now() < deadline,
            "health never recovered: {saw_503:?}"
        );
        if let Ok(Some(status)) = p.agent.proc.child.try_wait() {
            bail!("agent exited with {status}: {}", p.agent.proc.log_tail());
        }
        if let Ok(r) = c.get(&url).send().await {
            let status = r.status().as_u16();
            let text = r.text().await?;
            match status {
                503 => {
                    ensure!(error_type(&text)? == ("engine_stalled".to_owned(), 503));
                    saw_503.get_or_insert(text);
                }
                200 if saw_503.is_some() => break true,
                200 => {}
                other => bail!("/health answered {other}: {text}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    ensure!(recovered && saw_503.is_some());
    // Once the loop runs again, so do requests.
    wait_healthy(&c, &mut p.agent).await?;
    honest_prefill(&c, &p.agent).await?;
    Ok(())
}

/// A TCP connection to `to` from the local address `from` (a second loopback address
/// plays a second host).
async fn connect_from(from: &str, to: std::net::SocketAddr) -> Result<TcpStream> {
    let s = tokio::net::TcpSocket::new_v4()?;
    s.bind(format!("{from}:0").parse()?)?;
    let stream = s.connect(to).await?.into_std()?;
    stream.set_nonblocking(false)?;
    Ok(stream)
}

/// Connection caps were global (the audit: 2 addresses stopped HTTP, 4 x 16 the side
/// channel, 5 the data port), so a few sources holding idle connections made every other
/// peer's handshake fail. Now a newcomer takes the slot of the oldest connection of the
/// address holding the most: idle connections from a few addresses keep no one out. The
/// side channel (8 slots, 4 per address) filled from two addresses serves a D at a third
/// at once; the data port, whose authenticated connections are capped at 8 (4 per
/// address) while unauthenticated ones take at most 8 per address of the few pre-auth
/// slots, serves a peer at another address at once while four addresses flood it, and
/// holds no thread for most of the flood.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_few_addresses_cannot_take_every_side_channel_or_data_port_slot() -> Result<()> {
    let mut p = spawn(
        "per-address",
        &[
            "--auth-token",
            TOKEN,
            "--side-channel-max-connections",
            "8",
            "--side-channel-max-connections-per-address",
            "4",
            "--side-channel-handshake-timeout-ms",
            "30000",
            "--transport-max-connections",
            "8",
            "--transport-max-connections-per-address",
            "4",
            "--transport-handshake-timeout-ms",
            "30000",
        ],
        &[],
    )?;
    let c = client();
    wait_healthy(&c, &mut p.agent).await?;
    let side: std::net::SocketAddr = format!("127.0.0.1:{}", p.side_port).parse()?;
    // Side channel: 8 idle connections (the global cap) from 127.0.0.1 and 127.0.0.3...
    let mut held = Vec::new();
    for from in ["127.0.0.1", "127.0.0.3"] {
        for _ in 0..4 {
            held.push(connect_from(from, side).await?);
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // ...hold no slot a D at 127.0.0.2 needs: it completes its handshake at once.
    let mut s = connect_from("127.0.0.2", side).await?;
    let served = tokio::task::spawn_blocking(move || {
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        let registration = kvlease_transport::sidechannel::Registration {
            tp_size: 1,
            instance: 1,
            workers: Vec::new(),
        };
        anyhow::Ok(kvlease_transport::sidechannel::fetch(
            &mut s,
            "d-other-host",
            Some(TOKEN.as_bytes()),
            Some("per-address"),
            &registration,
            4 << 20,
        )?)
    })
    .await??;
    let info = kvlease_proto::engine_info::EngineInfo::decode(&served.welcome.payload)?;
    let evicted = metric_of(&c, &p.agent, "kvlease_side_channel_evicted_total").await?;
    ensure!(
        evicted >= 1.0,
        "kvlease_side_channel_evicted_total = {evicted}"
    );

    // Data port: four addresses open 20 idle connections each (80, over every cap)...
    let md = info
        .worker(0)
        .context("P's worker 0")?
        .agent_metadata
        .clone();
    let data: std::net::SocketAddr = kvlease_transport::metadata::decode_metadata(&md)?
        .tcp_addr
        .parse()?;
    let pid = p.agent.proc.child.id();
    let (_, threads0) = rss_and_threads(pid)?;
    for from in ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"] {
        for _ in 0..20 {
            held.push(connect_from(from, data).await?);
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (_, threads1) = rss_and_threads(pid)?;
    ensure!(
        threads1 <= threads0 + 4 * 8 + 4,
        "threads {threads0} -> {threads1} with 80 idle connections (8 pre-auth per address)"
    );
    // ...and a peer at 127.0.0.1 (one data and one notification connection) gets in.
    let mut cfg = kvlease_transport::AgentConfig::new("d-other-host/d0");
    cfg.backend = kvlease_transport::BackendChoice::Tcp;
    cfg.auth_token = Some(TOKEN.as_bytes().to_vec());
    cfg.num_connections = 1;
    let d = kvlease_transport::Agent::new(cfg)?;
    let connected = tokio::task::spawn_blocking(move || d.connect(&md).map(|_| d)).await?;
    ensure!(
        connected.is_ok(),
        "a peer at another address was refused: {:?}",
        connected.err()
    );
    drop(held);
    ensure!(p.agent.proc.child.try_wait()?.is_none(), "agent exited");
    Ok(())
}
