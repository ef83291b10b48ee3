//! Secure defaults and addresses, with real processes on loopback: a non-loopback bind
//! without a cluster token refuses to start; `--allow-unauthenticated` starts with a
//! warning; `--advertise-host` is what peers are told; `--api-key` guards the HTTP API
//! but `/health` and `/metrics`; `--allowed-prefill-hosts` keeps D from connecting
//! elsewhere.

mod common;

use anyhow::{Context, Result, ensure};
use common::{Agent, agent_command, client, free_port, log_path, run_to_exit, wait_healthy};
use serde_json::{Value, json};

const PREFILL: &str = env!("CARGO_BIN_EXE_prefill-agent");
const DECODE: &str = env!("CARGO_BIN_EXE_decode-agent");

fn spawn(bin: &str, name: &str, host: &str, args: &[&str], env: &[(&str, &str)]) -> Result<Agent> {
    let port = free_port();
    let log = log_path("secure", name);
    let file = std::fs::File::create(&log)?;
    let cmd = agent_command(bin, name, port, free_port(), "host", file.try_clone()?);
    // The helper listens on 127.0.0.1; this test chooses the address.
    let mut argv: Vec<std::ffi::OsString> = cmd.get_args().map(ToOwned::to_owned).collect();
    if let Some(i) = argv.iter().position(|a| a == "--host") {
        argv[i + 1] = host.into();
    }
    let mut fresh = std::process::Command::new(bin);
    fresh
        .args(argv)
        .args(args)
        .env("RUST_LOG", "info")
        .env_remove("KVLEASE_AUTH_TOKEN")
        .env_remove("KVLEASE_API_KEY")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(file);
    let mut cmd = fresh;
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = cmd.spawn().with_context(|| format!("spawn {bin}"))?;
    Ok(Agent::new(child, name, log, port))
}

fn p_body(prompt: &str) -> Value {
    json!({"prompt": prompt, "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": true}})
}

async fn post(
    c: &reqwest::Client,
    url: &str,
    body: &Value,
    key: Option<&str>,
) -> Result<(u16, Value)> {
    let mut r = c.post(format!("{url}/v1/completions")).json(body);
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    let r = r.send().await?;
    let status = r.status().as_u16();
    let text = r.text().await?;
    Ok((status, serde_json::from_str(&text).with_context(|| text)?))
}

#[test]
fn beyond_loopback_without_a_token_refuses_to_start() -> Result<()> {
    for bin in [PREFILL, DECODE] {
        let out = run_to_exit(bin, &["--host", "0.0.0.0"])?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        ensure!(!out.status.success(), "{bin} started: {stderr}");
        ensure!(
            stderr.contains("--auth-token")
                && stderr.contains("KVLEASE_AUTH_TOKEN")
                && stderr.contains("--allow-unauthenticated"),
            "{stderr}"
        );
    }
    let out = run_to_exit(PREFILL, &["--advertise-host", "0.0.0.0"])?;
    ensure!(
        String::from_utf8_lossy(&out.stderr).contains("--advertise-host"),
        "an unspecified advertise address is refused"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advertised_address_api_key_and_allow_list() -> Result<()> {
    let c = client();
    let token = [("KVLEASE_AUTH_TOKEN", "cluster-secret")];
    // P listens everywhere but tells peers 127.0.0.2 (another loopback address).
    let mut p = spawn(
        PREFILL,
        "p-adv",
        "0.0.0.0",
        &["--advertise-host", "127.0.0.2"],
        &token,
    )?;
    let key = [
        ("KVLEASE_AUTH_TOKEN", "cluster-secret"),
        ("KVLEASE_API_KEY", "k3y"),
    ];
    let mut d = spawn(DECODE, "d-key", "127.0.0.1", &[], &key)?;
    let mut fenced = spawn(
        DECODE,
        "d-allow",
        "127.0.0.1",
        &["--allowed-prefill-hosts", "10.0.0.0/8,fd00::/8"],
        &token,
    )?;
    wait_healthy(&c, &mut p).await?;
    wait_healthy(&c, &mut d).await?;
    wait_healthy(&c, &mut fenced).await?;
    let log = std::fs::read_to_string(&p.proc.log)?;
    ensure!(log.contains("advertising this address to peers"), "{log}");

    let (s, pa) = post(&c, &p.url, &p_body("secure prompt"), None).await?;
    ensure!(s == 200, "prefill: {s} {pa}");
    ensure!(
        pa["kv_transfer_params"]["remote_host"] == "127.0.0.2",
        "P advertises --advertise-host: {pa}"
    );
    let d_body = json!({"prompt": "secure prompt", "max_tokens": 2,
        "kv_transfer_params": pa["kv_transfer_params"]});

    // The API key: missing or wrong is a 401 in the JSON shape; /health stays open.
    let (s, v) = post(&c, &d.url, &d_body, None).await?;
    ensure!(s == 401 && v["error"]["type"] == "unauthorized", "{s} {v}");
    let (s, v) = post(&c, &d.url, &d_body, Some("wrong")).await?;
    ensure!(s == 401, "{s} {v}");
    let abort = c.post(format!("{}/v1/abort/x", d.url)).send().await?;
    ensure!(
        abort.status().as_u16() == 401,
        "the abort route is guarded too"
    );
    let health = c.get(format!("{}/health", d.url)).send().await?;
    ensure!(health.status().is_success(), "/health stays open");
    let m = c.get(format!("{}/metrics", d.url)).send().await?;
    ensure!(m.status().is_success(), "/metrics stays open");
    // With the key, D reads from P at the advertised address, byte-exact.
    let (s, v) = post(&c, &d.url, &d_body, Some("k3y")).await?;
    ensure!(s == 200, "with the key: {s} {v}");
    ensure!(v["kv_digest"] == pa["kv_digest"], "{v}");

    // The default allow-list: loopback and this host's attached
    // networks. A `remote_host` elsewhere (a documentation address) is refused at once,
    // before D connects anywhere.
    let mut far = pa["kv_transfer_params"].clone();
    far["remote_host"] = json!("198.51.100.7");
    far["remote_engine_id"] = json!("p-elsewhere");
    let body = json!({"prompt": "secure prompt", "max_tokens": 1, "kv_transfer_params": far});
    let (s, v) = post(&c, &d.url, &body, Some("k3y")).await?;
    ensure!(
        s == 403 && v["error"]["type"] == "prefill_host_not_allowed",
        "default allow-list: {s} {v}"
    );
    let log = std::fs::read_to_string(&d.proc.log)?;
    ensure!(log.contains("--allowed-prefill-hosts not set"), "{log}");

    // The allow-list: P at 127.0.0.2 is outside 10.0.0.0/8.
    let (s, pa2) = post(&c, &p.url, &p_body("another prompt"), None).await?;
    ensure!(s == 200, "{s} {pa2}");
    let body = json!({"prompt": "another prompt", "max_tokens": 1,
        "kv_transfer_params": pa2["kv_transfer_params"]});
    let (s, v) = post(&c, &fenced.url, &body, None).await?;
    ensure!(
        s == 403 && v["error"]["type"] == "prefill_host_not_allowed",
        "{s} {v}"
    );
    Ok(())
}

/// A hello naming D workers that accept TCP but never answer (a firewall that drops, a
/// dead host) used to stall P's engine thread for the transport's handshake timeout per
/// worker (measured: 15.4 s for three). P now connects back off the engine thread: the
/// next prefill is served at once. The bound asserted (4 s) is below one stalled worker's
/// timeout, far above a normal prefill here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_naming_silent_workers_stalls_no_prefill() -> Result<()> {
    let c = client();
    let token = "hello-token";
    let mut p = spawn(
        PREFILL,
        "p-silent",
        "127.0.0.1",
        &[],
        &[("KVLEASE_AUTH_TOKEN", token)],
    )?;
    wait_healthy(&c, &mut p).await?;
    // Silent workers: listeners that never accept (the kernel completes the TCP
    // handshake; nothing ever answers the transport's).
    let silent: Vec<std::net::TcpListener> = (0..3)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<_>>()?;
    let mut mds = Vec::new();
    for (i, l) in silent.iter().enumerate() {
        let mut cfg = kvlease_transport::AgentConfig::new(format!("d-silent/d{i}"));
        cfg.backend = kvlease_transport::BackendChoice::Tcp;
        cfg.auth_token = Some(token.as_bytes().to_vec());
        cfg.advertise = Some(l.local_addr()?);
        let a = kvlease_transport::Agent::new(cfg)?;
        mds.push(a.metadata());
    }
    let side = std::fs::read_to_string(&p.proc.log)?;
    let port: u16 = side
        .split("side_channel=")
        .nth(1)
        .and_then(|s| {
            s.split(|ch: char| !ch.is_ascii_digit() && ch != '.' && ch != ':')
                .next()
        })
        .and_then(|s| s.rsplit(':').next())
        .and_then(|s| s.parse().ok())
        .context("side channel address in P's log")?;
    let addr = format!("127.0.0.1:{port}");
    tokio::task::spawn_blocking(move || {
        kvlease_agent::sidechannel::handshake(&addr, Some(token), None, "d-silent", 3, &mds, 1)
    })
    .await??;
    let t0 = std::time::Instant::now();
    let (s, v) = post(&c, &p.url, &p_body("a prompt after the hello"), None).await?;
    let took = t0.elapsed();
    ensure!(s == 200, "{s} {v}");
    ensure!(
        took < std::time::Duration::from_secs(4),
        "a prefill after the hello took {took:?}"
    );
    drop(silent);
    Ok(())
}

/// Side-channel port of an agent, from its start-up log line.
fn side_channel_port(a: &Agent) -> Result<u16> {
    let log = std::fs::read_to_string(&a.proc.log)?;
    log.split("side_channel=")
        .nth(1)
        .and_then(|s| {
            s.split(|ch: char| !ch.is_ascii_digit() && ch != '.' && ch != ':')
                .next()
        })
        .and_then(|s| s.rsplit(':').next())
        .and_then(|s| s.parse().ok())
        .context("side channel address in the log")
}

type Answer = tokio::task::JoinHandle<Result<(u16, Value)>>;

/// P and a slow D (`d_engine`, one decode slot) with a lease D claimed: the first request
/// holds D's only slot for ~8 s (200 tokens x 40 ms), so the second (`pa`, P's answer for
/// the prompt "the claimed prompt") waits on D, tracked and heartbeated: D's next
/// heartbeat names it, and D's engine claims its lease. Until a lease is claimed, any
/// cluster member that knows its (unguessable) id could abort it.
struct ClaimedLease {
    c: reqwest::Client,
    p: Agent,
    _d: Agent,
    pa: Value,
    lease: kvlease_lease::RequestId,
    slow: Answer,
    honest: Answer,
}

impl ClaimedLease {
    async fn start(p_engine: &str, d_engine: &str, token: &str) -> Result<Self> {
        let c = client();
        let env = [("KVLEASE_AUTH_TOKEN", token)];
        let mut p = spawn(
            PREFILL,
            p_engine,
            "127.0.0.1",
            &["--num-blocks", "64"],
            &env,
        )?;
        let mut d = spawn(
            DECODE,
            d_engine,
            "127.0.0.1",
            &["--max-running", "1", "--step-ms", "40"],
            &env,
        )?;
        wait_healthy(&c, &mut p).await?;
        wait_healthy(&c, &mut d).await?;
        let (s, first) = post(&c, &p.url, &p_body("the first prompt"), None).await?;
        ensure!(s == 200, "{s} {first}");
        let (s, pa) = post(&c, &p.url, &p_body("the claimed prompt"), None).await?;
        ensure!(s == 200, "{s} {pa}");
        let body = |prompt: &str, params: &Value, max_tokens: u32| {
            json!({"prompt": prompt, "max_tokens": max_tokens,
                "kv_transfer_params": params["kv_transfer_params"]})
        };
        let (c1, d_url) = (c.clone(), d.url.clone());
        let b1 = body("the first prompt", &first, 200);
        let slow = tokio::spawn(async move { post(&c1, &d_url, &b1, None).await });
        common::wait_metric(
            &c,
            &d,
            "kvlease_requests_running",
            std::time::Duration::from_secs(10),
            |v| v >= 1.0,
        )
        .await?;
        let (c2, d_url) = (c.clone(), d.url.clone());
        let b2 = body("the claimed prompt", &pa, 4);
        let honest = tokio::spawn(async move { post(&c2, &d_url, &b2, None).await });
        common::wait_metric(
            &c,
            &p,
            "kvlease_heartbeat_ids_received_total",
            std::time::Duration::from_secs(10),
            |v| v >= 2.0,
        )
        .await?;
        let lease = kvlease_lease::RequestId::new(
            pa["kv_transfer_params"]["remote_request_id"]
                .as_str()
                .context("remote_request_id")?,
        )?;
        Ok(Self {
            c,
            p,
            _d: d,
            pa,
            lease,
            slow,
            honest,
        })
    }

    /// A token holder's transport agent `agent_name`, and the connection it tries to P's
    /// worker 0 with the metadata (and the session) of a side-channel handshake it
    /// completed as engine `engine`, naming itself as that engine's worker.
    async fn intruder(
        &self,
        token: &'static str,
        agent_name: &str,
        engine: &'static str,
    ) -> Result<(
        kvlease_transport::Agent,
        Result<kvlease_transport::PeerId, kvlease_transport::ConnectError>,
    )> {
        let mut cfg = kvlease_transport::AgentConfig::new(agent_name);
        cfg.backend = kvlease_transport::BackendChoice::Tcp;
        cfg.auth_token = Some(token.as_bytes().to_vec());
        let agent = kvlease_transport::Agent::new(cfg)?;
        let addr = format!("127.0.0.1:{}", side_channel_port(&self.p)?);
        let md = agent.metadata();
        let welcome = tokio::task::spawn_blocking(move || {
            kvlease_agent::sidechannel::handshake(
                &addr,
                Some(token),
                None,
                engine,
                1,
                &[md],
                common::wall_us(),
            )
        })
        .await??;
        let info = kvlease_proto::engine_info::EngineInfo::from_value(&welcome.info)?;
        let bytes = info
            .worker(0)
            .context("P's worker 0")?
            .agent_metadata
            .clone();
        let peer = match &welcome.session {
            Some(s) => agent.connect_with_session(&bytes, s),
            None => agent.connect(&bytes),
        };
        Ok((agent, peer))
    }

    /// The lease survived: it is still active, and both of D's requests end with the
    /// right bytes.
    async fn survived(self) -> Result<()> {
        let active = common::metric_of(&self.c, &self.p, "kvlease_leases_active").await?;
        ensure!(active >= 1.0, "the forged messages released the lease");
        let (s, v) = self.honest.await??;
        ensure!(s == 200, "the honest request: {s} {v}");
        ensure!(v["kv_digest"] == self.pa["kv_digest"], "{v}");
        let (s, v) = self.slow.await??;
        ensure!(s == 200, "{s} {v}");
        Ok(())
    }
}

/// An authenticated third peer that learned a lease's id forges heartbeats, completions
/// and aborts for it after the honest D claimed it: P ignores and counts them
/// (`kvlease_notifs_foreign_total`), the lease stays, and the honest D's request ends with
/// the right bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_lease_messages_from_a_third_peer_are_ignored() -> Result<()> {
    use kvlease_lease::{ConsumerId, EngineId};
    let token = "forge-token";
    let claimed = ClaimedLease::start("p-forge", "d-honest", token).await?;
    // The rogue: a cluster member (it has the token) under its own name.
    let (rogue, peer) = claimed.intruder(token, "rogue/d0", "rogue").await?;
    let peer = peer?;
    let lease = &claimed.lease;
    let rogue_id = EngineId::new("rogue")?;
    let honest_id = EngineId::new("d-honest")?;
    for m in [
        kvlease_notif::Abort {
            request: lease.clone(),
            consumer: ConsumerId::new(rogue_id.clone(), 0),
        }
        .encode(),
        kvlease_notif::ReadComplete {
            request: lease.clone(),
            consumer: ConsumerId::new(rogue_id.clone(), 0),
            consumers_total: 1,
        }
        .encode(),
        // Naming the honest engine as the consumer does not help either.
        kvlease_notif::ReadComplete {
            request: lease.clone(),
            consumer: ConsumerId::new(honest_id, 0),
            consumers_total: 1,
        }
        .encode(),
    ] {
        rogue.send_notif(peer, m)?;
    }
    common::wait_metric(
        &claimed.c,
        &claimed.p,
        "kvlease_notifs_foreign_total",
        std::time::Duration::from_secs(10),
        |v| v >= 3.0,
    )
    .await?;
    claimed.survived().await
}

/// A token holder tries to speak for D engine `vic` through transport connections that
/// vic's side-channel exchange did not make: an agent named like vic's real worker
/// (`vic/d0`, guessable) or another one (`vic/x9`), with P's worker metadata from a
/// handshake under its own engine id (`mallory`, whose registration names `vic/x9` in
/// vain). Each connection used to be accepted, and an abort on it released vic's lease.
/// Now a connection under vic's name must prove the session of vic's own side-channel
/// exchange: P refuses both at the transport's handshake, counts them
/// (`kvlease_session_refusals_total`) and logs a warning naming them; vic's lease stays
/// and its request ends with the right bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_holder_cannot_speak_through_a_registered_engines_worker_names() -> Result<()> {
    let token = "ident-token";
    let claimed = ClaimedLease::start("p-ident", "vic", token).await?;
    let (c, p) = (&claimed.c, &claimed.p);
    for name in ["vic/d0", "vic/x9"] {
        let (_attacker, peer) = claimed.intruder(token, name, "mallory").await?;
        ensure!(
            matches!(
                peer,
                Err(kvlease_transport::ConnectError::AuthRejected { .. })
            ),
            "{name}: {peer:?}"
        );
    }
    let refused = common::metric_of(c, p, "kvlease_session_refusals_total").await?;
    ensure!(refused == 2.0, "{refused} connections refused");
    let log = std::fs::read_to_string(&p.proc.log)?;
    ensure!(
        log.lines().any(|l| l.contains("WARN")
            && l.contains("vic/d0")
            && l.contains("did not prove that registration's session")),
        "no warning names the clash"
    );
    claimed.survived().await
}

/// A side-channel registration as engine `vic` with instance 2^63 (the audit's repro)
/// used to take vic's registration over for good: vic's own, after its restart, had a
/// smaller instance and was ignored, so its notifications were dropped. Now an instance
/// more than a minute ahead of P's clock is refused (`kvlease_registrations_refused_total`,
/// D is told why), and one within that minute ranks no higher than the moment it was
/// registered: vic, restarted later under the same engine id, gets its id back and its
/// lease messages count again (its read completion releases the lease).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_ahead_of_the_clock_never_pins_an_engine_id() -> Result<()> {
    let c = client();
    let token = "pin-token";
    let env = [("KVLEASE_AUTH_TOKEN", token)];
    let mut p = spawn(PREFILL, "p-pin", "127.0.0.1", &[], &env)?;
    let mut vic = spawn(DECODE, "vic", "127.0.0.1", &[], &env)?;
    wait_healthy(&c, &mut p).await?;
    wait_healthy(&c, &mut vic).await?;
    let round_trip = |d_url: String, prompt: &'static str| {
        let (c, p_url) = (c.clone(), p.url.clone());
        async move {
            let (s, pa) = post(&c, &p_url, &p_body(prompt), None).await?;
            ensure!(s == 200, "{s} {pa}");
            let body = json!({"prompt": prompt, "max_tokens": 2,
                "kv_transfer_params": pa["kv_transfer_params"]});
            let (s, v) = post(&c, &d_url, &body, None).await?;
            ensure!(s == 200 && v["kv_digest"] == pa["kv_digest"], "{s} {v}");
            anyhow::Ok(())
        }
    };
    round_trip(vic.url.clone(), "before the attack").await?;
    let addr = format!("127.0.0.1:{}", side_channel_port(&p)?);
    let mut cfg = kvlease_transport::AgentConfig::new("vic/d0");
    cfg.backend = kvlease_transport::BackendChoice::Tcp;
    cfg.auth_token = Some(token.as_bytes().to_vec());
    let fake = kvlease_transport::Agent::new(cfg)?;
    let register = |instance: u64| {
        let (addr, md) = (addr.clone(), fake.metadata());
        tokio::task::spawn_blocking(move || {
            kvlease_agent::sidechannel::handshake(
                &addr,
                Some(token),
                None,
                "vic",
                1,
                &[md],
                instance,
            )
        })
    };
    let e = register(1 << 63).await?.expect_err("2^63 is refused");
    ensure!(e.to_string().contains("ahead of this host's clock"), "{e}");
    let refused = common::metric_of(&c, &p, "kvlease_registrations_refused_total").await?;
    ensure!(refused == 1.0, "{refused}");
    // Half a minute ahead passes (clocks differ), and takes vic over for now.
    register(common::wall_us() + 30_000_000).await??;
    // vic restarts under the same engine id: its registration outranks the claim.
    drop(vic);
    let mut vic = spawn(DECODE, "vic", "127.0.0.1", &[], &env)?;
    wait_healthy(&c, &mut vic).await?;
    let completed = "kvlease_leases_released_total{reason=\"completed\"}";
    let before = common::metric_of(&c, &p, completed).await?;
    round_trip(vic.url.clone(), "after vic restarted").await?;
    common::wait_metric(&c, &p, completed, std::time::Duration::from_secs(10), |v| {
        v > before
    })
    .await?;
    let refused = common::metric_of(&c, &p, "kvlease_registrations_refused_total").await?;
    ensure!(
        refused == 1.0,
        "vic's own registration was refused: {refused}"
    );
    let dropped = common::metric_of(&c, &p, "kvlease_notifs_unregistered_total").await?;
    ensure!(dropped == 0.0, "{dropped} of vic's notifications dropped");
    Ok(())
}

/// A token holder's worker metadata must not make P connect (for expiry notices) to
/// any address: P connects back only to D workers on the address the
/// side-channel handshake came from: a hello from loopback naming a worker at another
/// address is refused and counted (`kvlease_connect_back_refused_total`), while a worker
/// on loopback is connected to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p_connects_back_only_to_the_handshakes_address() -> Result<()> {
    let c = client();
    let token = "connect-back-token";
    let mut p = spawn(
        PREFILL,
        "p-connect-back",
        "127.0.0.1",
        &[],
        &[("KVLEASE_AUTH_TOKEN", token)],
    )?;
    wait_healthy(&c, &mut p).await?;
    let worker = |name: &str, advertise: &str| -> Result<kvlease_transport::Agent> {
        let mut cfg = kvlease_transport::AgentConfig::new(name);
        cfg.backend = kvlease_transport::BackendChoice::Tcp;
        cfg.auth_token = Some(token.as_bytes().to_vec());
        cfg.advertise = Some(advertise.parse()?);
        Ok(kvlease_transport::Agent::new(cfg)?)
    };
    // A worker claiming a documentation address (192.0.2.0/24, reachable nowhere).
    let far = worker("d-far/d0", "192.0.2.7:4000")?;
    let addr = format!("127.0.0.1:{}", side_channel_port(&p)?);
    let md = far.metadata();
    let a = addr.clone();
    tokio::task::spawn_blocking(move || {
        kvlease_agent::sidechannel::handshake(&a, Some(token), None, "d-far", 1, &[md], 1)
    })
    .await??;
    common::wait_metric(
        &c,
        &p,
        "kvlease_connect_back_refused_total",
        std::time::Duration::from_secs(10),
        |v| v >= 1.0,
    )
    .await?;
    // A worker on loopback, as the handshake: connected back to, nothing refused.
    let near = worker("d-near/d0", "127.0.0.1:0")?;
    let md = near.metadata();
    tokio::task::spawn_blocking(move || {
        kvlease_agent::sidechannel::handshake(&addr, Some(token), None, "d-near", 1, &[md], 1)
    })
    .await??;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while near.stats().connections_accepted == 0 {
        ensure!(
            std::time::Instant::now() < deadline,
            "P never connected back to the loopback worker"
        );
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    let refused = common::metric_of(&c, &p, "kvlease_connect_back_refused_total").await?;
    ensure!(refused == 1.0, "refused {refused}");
    Ok(())
}

/// A registered token holder heartbeats a lease that nobody reads (the audit held 18
/// blocks that way for as long as it kept sending). P reclaims it at its maximum lifetime
/// (`kv_lease_max_lifetime`, 3 s here, lease 1 s) whatever the heartbeats say, counts it
/// (`kvlease_leases_max_lifetime_total`) and holds no block after that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_never_hold_a_lease_past_its_max_lifetime() -> Result<()> {
    let c = client();
    let token = "lifetime-token";
    let kv = json!({"kv_connector": "kvlease", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"kv_lease_duration": 1, "kv_lease_max_lifetime": 3}})
    .to_string();
    let mut p = spawn(
        PREFILL,
        "p-lifetime",
        "127.0.0.1",
        &["--kv-transfer-config", &kv],
        &[("KVLEASE_AUTH_TOKEN", token)],
    )?;
    wait_healthy(&c, &mut p).await?;
    let mut cfg = kvlease_transport::AgentConfig::new("squatter/d0");
    cfg.backend = kvlease_transport::BackendChoice::Tcp;
    cfg.auth_token = Some(token.as_bytes().to_vec());
    let squatter = kvlease_transport::Agent::new(cfg)?;
    let (addr, md) = (
        format!("127.0.0.1:{}", side_channel_port(&p)?),
        squatter.metadata(),
    );
    let welcome = tokio::task::spawn_blocking(move || {
        kvlease_agent::sidechannel::handshake(
            &addr,
            Some(token),
            None,
            "squatter",
            1,
            &[md],
            common::wall_us(),
        )
    })
    .await??;
    let info = kvlease_proto::engine_info::EngineInfo::from_value(&welcome.info)?;
    let p0 = &info.worker(0).context("P's worker 0")?.agent_metadata;
    let session = welcome.session.context("a session under a token")?;
    let peer = squatter.connect_with_session(p0, &session)?;
    let (s, pa) = post(&c, &p.url, &p_body("a lease nobody reads"), None).await?;
    ensure!(s == 200, "{s} {pa}");
    let granted = std::time::Instant::now();
    // The gauge follows the engine loop: wait until it shows the lease.
    common::wait_metric(
        &c,
        &p,
        "kvlease_leases_active",
        std::time::Duration::from_secs(2),
        |v| v >= 1.0,
    )
    .await?;
    let id = pa["kv_transfer_params"]["remote_request_id"]
        .as_str()
        .context("remote_request_id")?
        .to_owned();
    let mut reclaimed = None;
    while granted.elapsed() < std::time::Duration::from_secs(6) {
        squatter.send_notif(peer, format!("HB:{id}").into_bytes())?;
        let _ = squatter.get_new_notifs();
        if reclaimed.is_none() && common::metric_of(&c, &p, "kvlease_leases_active").await? == 0.0 {
            reclaimed = Some(granted.elapsed());
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let at = reclaimed.context("the heartbeats held the lease for 6 s")?;
    ensure!(
        at >= std::time::Duration::from_millis(2_500),
        "reclaimed after {at:?}: before its max lifetime, so the heartbeats did not count"
    );
    let capped = common::metric_of(&c, &p, "kvlease_leases_max_lifetime_total").await?;
    ensure!(capped == 1.0, "{capped}");
    let held = common::metric_of(&c, &p, "kvlease_blocks_held").await?;
    ensure!(held == 0.0, "{held} blocks still held");
    Ok(())
}
