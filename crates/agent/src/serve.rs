//! What the binaries run: build the engine from the command line, start its thread, the
//! side channel (P) and the HTTP API on a tokio runtime, and stop on SIGINT/SIGTERM.
//!
//! Threads of a P: the engine (forward loop), the side channel (one listener plus one
//! short-lived thread per handshake), the transport's serving threads, and the tokio
//! runtime (HTTP). A D has the engine, a handshake thread per new P engine, the transport's
//! threads and the runtime. Neither has a heartbeat thread.
//!
//! The `--*` limit flags ([`LimitArgs`]) are turned here into each layer's limits: the side
//! channel's [`sidechannel::ServerLimits`], the transport's [`Limits`] and the HTTP layer's
//! [`HttpLimits`].
//!
//! Test-only: `KVLEASE_TEST_STALL_ENGINE_MS=N` makes the engine thread sleep N ms once,
//! before its loop starts, so that tests can watch `/health` report a stalled engine.
//! Never set it in production.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use kvlease_gpu_mem::MemoryRequest;
use kvlease_lease::{DecoderTtl, LeaseConfig, LeaseMode};
use kvlease_transport::{BackendChoice, Limits};

use kvlease_engine::{DeadlineBasis, PullPolicy};

use crate::bidir::{ClockProbeServer, PeerClock, ProbeHandle, test_clock_offset_from_env};
use crate::config::{
    AgentRole, CommonArgs, DecodeArgs, KvRole, KvTransferConfig, LeaseModeSetting, LimitArgs,
    MemoryChoice, PrefillArgs, TransferMode, TransportChoice,
};
use crate::decode::{DecodeAgentConfig, DecodeBidir, DecodeEngine};
use crate::health::EngineHeartbeat;
use crate::http::{self, DecodeApi, HttpLimits, PrefillApi};
use crate::kv::KvShape;
use crate::link::LinkConfig;
use crate::metrics::Metrics;
use crate::prefill::{PrefillAgentConfig, PrefillBidir, PrefillEngine};
use crate::shell::EngineError;
use crate::sidechannel;

/// Jobs the HTTP layer may queue to an engine before handlers wait (back-pressure).
const JOB_QUEUE: usize = 4096;

/// Why an agent stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The engine could not start.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A flag was unusable.
    #[error("{flag}: {message}")]
    Flag {
        /// The flag.
        flag: &'static str,
        /// Why.
        message: String,
    },
    /// Binding or serving failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

fn shape(c: &CommonArgs) -> KvShape {
    KvShape {
        num_layers: c.num_layers,
        num_kv_heads: c.num_kv_heads,
        block_size: c.block_size,
        head_dim: c.head_dim,
    }
}

fn memory(c: &CommonArgs) -> MemoryRequest {
    match c.memory {
        MemoryChoice::Host => MemoryRequest::Host,
        MemoryChoice::Pinned => MemoryRequest::Pinned,
        MemoryChoice::Cuda => MemoryRequest::Cuda { ordinal: 0 },
        MemoryChoice::Staged => MemoryRequest::StagedHost,
        _ => MemoryRequest::Auto,
    }
}

/// What peers are told to reach this agent at.
#[derive(Debug, Clone)]
struct Advertised {
    /// `remote_host` and the bidirectional params: a host name or an IP.
    host: String,
    /// The IP in the transport metadata.
    ip: IpAddr,
}

/// The advertised address: `--advertise-host`; else `--host`; else, when `--host` is an
/// unspecified address, the address this host would send from to a routed destination
/// (its primary non-loopback address). Logged at start.
fn advertised(c: &CommonArgs) -> Result<Advertised, ServeError> {
    let bind: IpAddr = c.host.parse().map_err(|e| ServeError::Flag {
        flag: "--host",
        message: format!("{}: {e} (an IP address)", c.host),
    })?;
    let found = if let Some(h) = &c.advertise_host {
        let bare = h.trim_start_matches('[').trim_end_matches(']');
        let ip = match bare.parse::<IpAddr>() {
            Ok(ip) => ip,
            Err(_) => std::net::ToSocketAddrs::to_socket_addrs(&(bare, 0))
                .map_err(|source| ServeError::Io {
                    what: format!("--advertise-host: cannot resolve {bare}"),
                    source,
                })?
                .map(|a| a.ip())
                .find(|ip| ip.is_ipv4() == bind.is_ipv4() || bind.is_unspecified())
                .ok_or_else(|| ServeError::Flag {
                    flag: "--advertise-host",
                    message: format!("{bare} resolves to no address of --host's family"),
                })?,
        };
        Advertised {
            host: bare.to_owned(),
            ip,
        }
    } else if bind.is_unspecified() {
        let ip = primary_address(bind.is_ipv6()).ok_or_else(|| ServeError::Flag {
            flag: "--advertise-host",
            message: format!(
                "--host {bind} listens everywhere and this host has no routed non-loopback \
                 address to advertise: name the address peers should use"
            ),
        })?;
        Advertised {
            host: ip.to_string(),
            ip,
        }
    } else {
        Advertised {
            host: c.host.clone(),
            ip: bind,
        }
    };
    tracing::info!(host = %found.host, ip = %found.ip, "advertising this address to peers");
    Ok(found)
}

/// The local address this host would use towards a routed destination: a UDP socket
/// "connected" to an address of the benchmarking ranges (198.18.0.0/15, 2001:2::/48)
/// picks it from the routing table; no packet is sent.
fn primary_address(v6: bool) -> Option<IpAddr> {
    let (bind, probe): (SocketAddr, SocketAddr) = if v6 {
        ("[::]:0".parse().ok()?, "[2001:2::1]:9".parse().ok()?)
    } else {
        ("0.0.0.0:0".parse().ok()?, "198.18.0.1:9".parse().ok()?)
    };
    let s = std::net::UdpSocket::bind(bind).ok()?;
    s.connect(probe).ok()?;
    let ip = s.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

/// Warns when peers are served without a token beyond loopback (allowed only with
/// `--allow-unauthenticated`; `CommonArgs::validate` refuses it otherwise).
fn warn_unauthenticated(c: &CommonArgs) {
    let beyond_loopback = c.host.parse::<IpAddr>().is_ok_and(|ip| !ip.is_loopback());
    if beyond_loopback && c.auth_token.is_none() {
        tracing::warn!(
            host = %c.host,
            "serving peers WITHOUT a cluster token (--allow-unauthenticated): anyone who \
             reaches this agent can read its KV pool and forge lease messages"
        );
    }
}

/// The test-only engine stall (see the module doc).
const TEST_STALL_ENGINE_ENV: &str = "KVLEASE_TEST_STALL_ENGINE_MS";

fn test_engine_stall() -> Result<Option<Duration>, ServeError> {
    let Ok(v) = std::env::var(TEST_STALL_ENGINE_ENV) else {
        return Ok(None);
    };
    let ms: u64 = v.parse().map_err(|e| ServeError::Flag {
        flag: TEST_STALL_ENGINE_ENV,
        message: format!("{v}: {e} (milliseconds)"),
    })?;
    tracing::warn!(
        ms,
        "{TEST_STALL_ENGINE_ENV} is set: the engine stalls once (test only)"
    );
    Ok(Some(Duration::from_millis(ms)))
}

fn transport_limits(l: &LimitArgs) -> Limits {
    let mut limits = Limits::default();
    limits.max_inbound_connections = l.transport_max_connections;
    limits.max_inbound_per_address = l.transport_max_connections_per_address;
    limits.handshake_timeout = l.transport_handshake_timeout();
    limits.verbs_stall_timeout = l.verbs_stall_timeout();
    limits.max_pending_notif_bytes = l.max_pending_notif_bytes;
    limits
}

fn http_limits(l: &LimitArgs) -> HttpLimits {
    HttpLimits {
        max_connections: l.http_max_connections,
        max_connections_per_source: l.http_max_connections_per_source(),
        max_body_bytes: l.http_max_body_bytes,
        max_prompt_bytes: l.http_max_prompt_bytes,
        body_timeout: l.http_body_timeout(),
        header_timeout: l.http_header_timeout(),
        request_timeout: l.http_request_timeout(),
        engine_stall: l.health_engine_stall(),
    }
}

fn side_channel_limits(l: &LimitArgs) -> sidechannel::ServerLimits {
    sidechannel::ServerLimits {
        max_connections: l.side_channel_max_connections,
        max_per_address: l.side_channel_max_connections_per_address,
        handshake_timeout: l.side_channel_handshake_timeout(),
        max_frame: l.side_channel_max_frame_bytes,
    }
}

fn link(
    c: &CommonArgs,
    advertise: &Advertised,
    metrics: &Metrics,
) -> Result<LinkConfig, ServeError> {
    let listen_ip: IpAddr = c.host.parse().map_err(|e| ServeError::Flag {
        flag: "--host",
        message: format!("{}: {e} (an IP address)", c.host),
    })?;
    Ok(LinkConfig {
        advertise_ip: advertise.ip,
        backend: match c.transport {
            TransportChoice::Tcp => BackendChoice::Tcp,
            TransportChoice::Verbs => BackendChoice::Verbs,
            TransportChoice::Shm => BackendChoice::Shm,
            _ => BackendChoice::Auto,
        },
        listen_ip,
        auth_token: c
            .auth_token
            .as_ref()
            .map(|t| String::from_utf8_lossy(t.as_bytes()).into_owned()),
        limits: transport_limits(&c.limits),
        metrics: metrics.clone(),
    })
}

fn lease_config(c: &CommonArgs, role: AgentRole) -> Result<LeaseConfig, ServeError> {
    let kv = c.kv_config(role);
    let bad = |e: kvlease_lease::ConfigError| ServeError::Flag {
        flag: "--kv-transfer-config",
        message: e.to_string(),
    };
    // `lease_mode: fixed` holds for `abort_request_timeout`, heartbeats ignored: P's leases,
    // and in push mode also D's reservations (P's heartbeats then extend nothing).
    let fixed_here = role == AgentRole::Prefill || c.transfer_mode == TransferMode::Push;
    let config = match kv.lease_mode {
        LeaseModeSetting::Fixed if fixed_here => {
            LeaseConfig::from_duration(kv.abort_request_timeout)
                .map_err(bad)?
                .with_mode(LeaseMode::Fixed)
        }
        _ => LeaseConfig::from_duration(kv.lease_duration).map_err(bad)?,
    };
    match kv.lease_max_lifetime {
        Some(max) => config.with_max_lifetime(max).map_err(bad),
        None => Ok(config),
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, ServeError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("http")
        .build()
        .map_err(|source| ServeError::Io {
            what: "tokio runtime".into(),
            source,
        })
}

async fn shutdown_signal(stop: Arc<AtomicBool>) {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
    tracing::info!("shutting down");
    stop.store(true, Ordering::Relaxed);
}

async fn bind_http(c: &CommonArgs) -> Result<tokio::net::TcpListener, ServeError> {
    let addr = format!("{}:{}", c.host, c.port);
    tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|source| ServeError::Io {
            what: format!("--port: cannot listen on {addr}"),
            source,
        })
}

/// P's bidirectional mode: on with `bidirectional_kv_xfer: true` and `kv_role: kv_both`.
fn prefill_bidir(c: &CommonArgs) -> Result<Option<PrefillBidir>, ServeError> {
    let kv = c.kv_config(AgentRole::Prefill);
    if !(kv.bidirectional_kv_xfer && kv.role == KvRole::Both) {
        return Ok(None);
    }
    let offset = test_clock_offset_from_env().map_err(|e| ServeError::Flag {
        flag: "KVLEASE_TEST_CLOCK_OFFSET_MS",
        message: e.to_string(),
    })?;
    Ok(Some(PrefillBidir {
        policy: PullPolicy {
            threshold_tokens: kv.recompute_threshold_tokens,
            safety_margin: kv.pull_safety_margin,
            basis: DeadlineBasis::ClockOffset,
        },
        clock: PeerClock::new(offset),
        read_timeout: Duration::from_secs(10),
        symmetric: kv.symmetric_decoder_lease,
    }))
}

/// Runs `prefill-agent` until a signal.
///
/// # Errors
/// [`ServeError`] when the engine, the side channel or the HTTP listener cannot start.
pub fn run_prefill(args: &PrefillArgs) -> Result<(), ServeError> {
    let c = &args.common;
    let metrics = Metrics::new();
    let engine_id = c.engine_id();
    warn_unauthenticated(c);
    let adv = advertised(c)?;
    let cfg = PrefillAgentConfig {
        engine_id: engine_id.clone(),
        tp_size: c.tp_size,
        shape: shape(c),
        num_blocks: c.num_blocks,
        lease: lease_config(c, AgentRole::Prefill)?,
        cost_per_token: args.prefill_cost_per_token(),
        pool_wait: args.pool_wait(),
        advertise_host: adv.host.clone(),
        side_channel_port: c.side_channel_port,
        memory: memory(c),
        link: link(c, &adv, &metrics)?,
        bidir: prefill_bidir(c)?,
        connect_back_any_host: args.connect_back_any_host,
        transfer_mode: c.transfer_mode,
    };
    let token = cfg.link.auth_token.clone();
    let listen_ip = cfg.link.listen_ip;
    let mut engine = PrefillEngine::new(cfg, metrics.clone())?;
    let info = engine.info();
    let registrar = engine.registrar();
    let side = spawn_side_channel(
        info,
        token,
        Box::new(move |h| registrar.register(h)),
        listen_ip,
        c,
        &metrics,
    )?;
    let (jobs_tx, jobs_rx) = crossbeam_channel::bounded(JOB_QUEUE);
    let (engine_thread, heartbeat) = spawn_engine("p-engine", move |stop, beat| {
        engine.run(jobs_rx, stop, beat);
    })?;
    let rt = runtime()?;
    let limits = http_limits(&c.limits);
    let api = PrefillApi {
        jobs: jobs_tx,
        metrics: metrics.clone(),
        model: engine_id.to_string(),
        limits,
        heartbeat,
        transfer_mode: c.transfer_mode,
    };
    let router = http::prefill_router(api);
    let served = serve_http(
        &rt,
        c,
        router,
        &limits,
        &metrics,
        &engine_thread.stop,
        || {
            tracing::info!(
                engine = %engine_id,
                http = %format!("{}:{}", c.host, c.port),
                side_channel = %side.addr,
                tp = c.tp_size,
                "prefill agent ready"
            );
        },
    );
    engine_thread.stop(rt);
    drop(side);
    served
}

/// D's bidirectional mode: its clock (offset for tests), the cached blocks' TTL, and the
/// clock probe, listening on an ephemeral port of `listen_ip`.
fn decode_bidir(
    c: &CommonArgs,
    kv: &KvTransferConfig,
    listen_ip: IpAddr,
    advertise_host: String,
) -> Result<(DecodeBidir, ProbeHandle), ServeError> {
    let clock = PeerClock::new(test_clock_offset_from_env().map_err(|e| ServeError::Flag {
        flag: "KVLEASE_TEST_CLOCK_OFFSET_MS",
        message: e.to_string(),
    })?);
    let ttl =
        DecoderTtl::from_duration(kv.decoder_kv_blocks_ttl).map_err(|e| ServeError::Flag {
            flag: "--kv-transfer-config",
            message: format!("decoder_kv_blocks_ttl: {e}"),
        })?;
    let handle = ClockProbeServer::new(move || clock.now_ns())
        .spawn(SocketAddr::new(listen_ip, 0))
        .map_err(|source| ServeError::Io {
            what: "clock probe: cannot listen".into(),
            source,
        })?;
    let bidir = DecodeBidir {
        ttl,
        symmetric: kv.symmetric_decoder_lease,
        clock,
        advertise_host,
        side_channel_port: c.side_channel_port,
        clock_port: handle.addr.port(),
    };
    Ok((bidir, handle))
}

/// Runs `decode-agent` until a signal.
///
/// # Errors
/// [`ServeError`] when the engine or the HTTP listener cannot start.
pub fn run_decode(args: &DecodeArgs) -> Result<(), ServeError> {
    let c = &args.common;
    let metrics = Metrics::new();
    let engine_id = c.engine_id();
    let kv = c.kv_config(AgentRole::Decode);
    warn_unauthenticated(c);
    let adv = advertised(c)?;
    let mut cfg = DecodeAgentConfig {
        engine_id: engine_id.clone(),
        tp_size: c.tp_size,
        shape: shape(c),
        num_blocks: c.num_blocks,
        lease: lease_config(c, AgentRole::Decode)?,
        step: args.step(),
        max_running: args.max_running,
        max_waiting: args.max_waiting,
        policy: kv.load_failure_policy,
        memory: memory(c),
        link: link(c, &adv, &metrics)?,
        read_timeout: Duration::from_secs(30),
        bidir: None,
        allowed_prefill: allowed_prefill_hosts(args),
        max_engines: args.max_prefill_engines,
        transfer_mode: c.transfer_mode,
        advertise_host: adv.host.clone(),
        side_channel_port: c.side_channel_port,
    };
    let listen_ip = cfg.link.listen_ip;
    let token = cfg.link.auth_token.clone();
    // Bidirectional mode: a clock probe (ephemeral port, advertised in the params) and a
    // side channel serving D's cached-block regions to P.
    let mut probe = None;
    if kv.bidirectional_kv_xfer && kv.role == KvRole::Both {
        let (bidir, handle) = decode_bidir(c, &kv, listen_ip, adv.host)?;
        cfg.bidir = Some(bidir);
        probe = Some(handle);
    }
    let engine = DecodeEngine::new(cfg, metrics.clone())?;
    let side = match engine.info() {
        Some(info) => {
            // P's pulls need nothing back from D but the notifications on the
            // transport, which P's connection carries.
            let handle =
                spawn_side_channel(info, token, Box::new(|_| Ok(())), listen_ip, c, &metrics)?;
            Some(handle)
        }
        None => None,
    };
    let (jobs_tx, jobs_rx) = crossbeam_channel::bounded(JOB_QUEUE);
    let (engine_thread, heartbeat) = spawn_engine("d-engine", move |stop, beat| {
        engine.run(jobs_rx, stop, beat);
    })?;
    let rt = runtime()?;
    let limits = http_limits(&c.limits);
    let api = DecodeApi {
        jobs: jobs_tx,
        metrics: metrics.clone(),
        model: engine_id.to_string(),
        limits,
        heartbeat,
        transfer_mode: c.transfer_mode,
    };
    let router = http::decode_router(api);
    let served = serve_http(
        &rt,
        c,
        router,
        &limits,
        &metrics,
        &engine_thread.stop,
        || {
            tracing::info!(
                engine = %engine_id,
                http = %format!("{}:{}", c.host, c.port),
                tp = c.tp_size,
                max_running = args.max_running,
                "decode agent ready"
            );
        },
    );
    engine_thread.stop(rt);
    drop(side);
    drop(probe);
    served
}

/// `--allowed-prefill-hosts`, or by default loopback and this host's attached networks
/// ([`crate::config::local_networks`]), logged so that an operator sees what D allows.
fn allowed_prefill_hosts(args: &DecodeArgs) -> Vec<crate::config::Cidr> {
    if !args.allowed_prefill_hosts.is_empty() {
        return args.allowed_prefill_hosts.clone();
    }
    let nets = crate::config::local_networks();
    let list: Vec<String> = nets.iter().map(ToString::to_string).collect();
    tracing::info!(
        networks = %list.join(","),
        "--allowed-prefill-hosts not set: D connects only to P agents on loopback and this host's attached networks"
    );
    nets
}

/// A running engine thread and the flag that stops it.
struct EngineThread {
    handle: JoinHandle<()>,
    stop: Arc<AtomicBool>,
}

impl EngineThread {
    /// Stops the engine thread and the runtime after the HTTP server returned.
    fn stop(self, rt: tokio::runtime::Runtime) {
        self.stop.store(true, Ordering::Relaxed);
        rt.shutdown_timeout(Duration::from_secs(2));
        let _ = self.handle.join();
    }
}

/// Spawns an agent's engine thread `name` running `run(stop, heartbeat)` (after the
/// test stall, `KVLEASE_TEST_STALL_ENGINE_MS`, when set); returns it and its heartbeat.
fn spawn_engine(
    name: &str,
    run: impl FnOnce(Arc<AtomicBool>, Arc<EngineHeartbeat>) + Send + 'static,
) -> Result<(EngineThread, Arc<EngineHeartbeat>), ServeError> {
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = Arc::clone(&stop);
    let heartbeat = Arc::new(EngineHeartbeat::new());
    let beat = Arc::clone(&heartbeat);
    let stall = test_engine_stall()?;
    let handle = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            if let Some(stall) = stall {
                std::thread::sleep(stall);
            }
            run(stop2, beat);
        })
        .map_err(|source| ServeError::Io {
            what: "engine thread".into(),
            source,
        })?;
    Ok((EngineThread { handle, stop }, heartbeat))
}

/// Serves `router` (behind `--api-key`) on `--host:--port` until a signal or `stop`;
/// `ready` runs once the listener is bound.
fn serve_http(
    rt: &tokio::runtime::Runtime,
    c: &CommonArgs,
    router: axum::Router,
    limits: &HttpLimits,
    metrics: &Metrics,
    stop: &Arc<AtomicBool>,
    ready: impl FnOnce(),
) -> Result<(), ServeError> {
    rt.block_on(async {
        let listener = bind_http(c).await?;
        ready();
        http::serve(
            listener,
            crate::apikey::protect(router, c.api_key.as_ref()),
            limits,
            &http::ConnectionCounters {
                refused: metrics.http_connections_refused.clone(),
                evicted: metrics.http_connections_evicted.clone(),
            },
            shutdown_signal(Arc::clone(stop)),
        )
        .await
        .map_err(|source| ServeError::Io {
            what: "http server".into(),
            source,
        })
    })
}

/// Starts an agent's side channel on `listen_ip:--side-channel-port`, reporting this
/// host's wall clock, bounded by the `--side-channel-*` limits.
fn spawn_side_channel(
    info: kvlease_proto::engine_info::EngineInfo,
    token: Option<String>,
    on_peer: Box<dyn Fn(sidechannel::Hello) -> Result<(), String> + Send + Sync>,
    listen_ip: IpAddr,
    c: &CommonArgs,
    metrics: &Metrics,
) -> Result<sidechannel::ServerHandle, ServeError> {
    let port = c.side_channel_port;
    let epoch = std::time::SystemTime::UNIX_EPOCH;
    sidechannel::Server {
        engine_id: c.engine_id().to_string(),
        info,
        token,
        on_peer,
        clock_ns: Box::new(move || epoch.elapsed().map_or(0, |d| d.as_nanos() as u64)),
        limits: side_channel_limits(&c.limits),
        refused: metrics.side_channel_refused.clone(),
        evicted: metrics.side_channel_evicted.clone(),
    }
    .spawn(SocketAddr::new(listen_ip, port))
    .map_err(|source| ServeError::Io {
        what: format!("--side-channel-port: cannot listen on {port}"),
        source,
    })
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    fn d_lease(args: &[&str]) -> LeaseConfig {
        let d =
            DecodeArgs::try_parse_from(std::iter::once("decode-agent").chain(args.iter().copied()))
                .expect("decode args");
        lease_config(&d.common, AgentRole::Decode).expect("lease config")
    }

    const FIXED: &str = r#"{"kv_connector":"kvlease","kv_role":"kv_consumer","kv_connector_extra_config":{"kv_lease_duration":1,"lease_mode":"fixed","abort_request_timeout":16}}"#;

    /// `lease_mode: fixed` on a push D holds its reservations for `abort_request_timeout`,
    /// heartbeats ignored; a pull D keeps the lease (its heartbeats renew P's leases).
    #[test]
    fn fixed_mode_on_d_applies_to_push_reservations_only() {
        let push = d_lease(&["--transfer-mode", "push", "--kv-transfer-config", FIXED]);
        assert_eq!(push.mode(), LeaseMode::Fixed);
        assert_eq!(push.duration(), Duration::from_secs(16));
        let pull = d_lease(&["--kv-transfer-config", FIXED]);
        assert_eq!(pull.mode(), LeaseMode::Lease);
        assert_eq!(pull.duration(), Duration::from_secs(1));
    }
}
