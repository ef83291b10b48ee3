//! The command line: the flags of `prefill-agent` and `decode-agent` (shared
//! [`CommonArgs`], role flags, [`LimitArgs`]), their value types and their checks.

use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;
use std::time::Duration;

use clap::{Args, Parser, ValueEnum};
use kvlease_lease::EngineId;

use super::{AgentRole, ConfigError, KvTransferConfig};

/// `--transport`: which data path to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum TransportChoice {
    /// Per peer: shared memory on the same host, else RDMA verbs where a device is
    /// usable, else TCP.
    #[default]
    Auto,
    /// RDMA verbs only (fails without a usable device).
    Verbs,
    /// The TCP fallback only.
    Tcp,
    /// Shared memory only (fails for a peer on another host).
    Shm,
}

/// `--transfer-mode`: how D gets P's KV. Every P and D of a deployment runs the same mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum TransferMode {
    /// P grants a lease on its blocks, D reads them (fenced READs).
    #[default]
    Pull,
    /// D reserves blocks and registers them with P, P writes the KV into them when its
    /// prefill ends (fenced WRITEs; docs/spec.md, "Push mode").
    Push,
}

/// `--memory`: where the KV block pool lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum MemoryChoice {
    /// CUDA device memory where a driver and GPU exist, page-aligned host memory otherwise.
    #[default]
    Auto,
    /// CUDA device memory (fails without a GPU).
    Cuda,
    /// CUDA pinned host memory (fails without a CUDA driver).
    Pinned,
    /// Page-aligned host memory.
    Host,
    /// Host memory moved as if it were device memory (staged fill, pipelined TCP staging,
    /// copy-back verify): the CUDA paths without a GPU, for tests and comparisons.
    Staged,
}

/// `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// A cluster token; its `Debug` does not print it.
#[derive(Clone, PartialEq, Eq)]
pub struct AuthToken(String);

impl AuthToken {
    /// The token's bytes, for the handshake proof.
    pub fn as_bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

impl fmt::Debug for AuthToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AuthToken(<redacted>)")
    }
}

impl std::str::FromStr for AuthToken {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.is_empty() {
            return Err("must not be empty (omit the flag to run without a token)".to_owned());
        }
        if s.len() > 4096 {
            return Err(format!("must be at most 4096 bytes, got {}", s.len()));
        }
        Ok(Self(s.to_owned()))
    }
}

/// An IP network, `address/prefix` (a bare address is a single host).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cidr {
    addr: std::net::IpAddr,
    prefix: u8,
}

impl Cidr {
    /// The network of `addr` with `prefix` bits (at most the address's width).
    pub(crate) fn new(addr: std::net::IpAddr, prefix: u8) -> Self {
        let max = if addr.is_ipv4() { 32 } else { 128 };
        Self {
            addr,
            prefix: prefix.min(max),
        }
    }

    /// Whether `ip` is in this network (an IPv4-mapped IPv6 address counts as IPv4).
    pub fn contains(&self, ip: std::net::IpAddr) -> bool {
        use std::net::IpAddr;
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// Why a CIDR did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{input:?}: expected an IP network such as 10.0.0.0/8 or fd00::/8")]
pub struct CidrError {
    input: String,
}

impl std::str::FromStr for Cidr {
    type Err = CidrError;
    fn from_str(s: &str) -> Result<Self, CidrError> {
        let err = || CidrError {
            input: s.to_owned(),
        };
        let (addr, prefix) = match s.trim().split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s.trim(), None),
        };
        let addr: std::net::IpAddr = addr.parse().map_err(|_| err())?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            Some(p) => p.parse::<u8>().ok().filter(|&p| p <= max).ok_or_else(err)?,
            None => max,
        };
        Ok(Self { addr, prefix })
    }
}

/// Why the command-line flags were rejected. The message names the flag.
#[derive(Debug, thiserror::Error)]
pub enum ArgsError {
    /// A flag's value is out of range or inconsistent with another flag.
    #[error("{flag}: {reason}")]
    Invalid {
        /// The flag, e.g. `--tp-size`.
        flag: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// `--kv-transfer-config` does not fit this agent.
    #[error("--kv-transfer-config: {source}")]
    KvTransferConfig {
        /// The config error, naming the key.
        #[source]
        source: ConfigError,
    },
}

fn bad(flag: &'static str, reason: impl Into<String>) -> ArgsError {
    ArgsError::Invalid {
        flag,
        reason: reason.into(),
    }
}

/// Largest KV pool one rank may ask for (1 TiB): a larger product of the layout flags is
/// a typo, not a machine.
pub const MAX_POOL_BYTES_PER_RANK: u64 = 1 << 40;

/// Bytes per KV element (bf16).
pub const DTYPE_BYTES: u64 = 2;

/// The flags both agents share. Defaults describe a small model so that the demo runs on
/// two cores: 2 layers, 8 KV heads of dimension 64, 16-token blocks, 512 blocks.
#[derive(Debug, Clone, Args)]
pub struct CommonArgs {
    /// Address the HTTP API and the side channel listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port of the HTTP API (OpenAI-style completions, /health, /metrics).
    #[arg(long, allow_negative_numbers = true, default_value_t = 8000)]
    pub port: u16,
    /// Port of the handshake side channel (like VLLM_NIXL_SIDE_CHANNEL_PORT): one per
    /// engine, serving every TP rank.
    #[arg(long, allow_negative_numbers = true, default_value_t = 5600)]
    pub side_channel_port: u16,
    /// This engine's id (default: generated, unique per start).
    #[arg(long)]
    pub engine_id: Option<EngineId>,
    /// Tensor-parallel workers; each holds num_kv_heads / tp_size heads.
    #[arg(long, allow_negative_numbers = true, default_value_t = 1)]
    pub tp_size: u32,
    /// KV blocks in each rank's pool.
    #[arg(long, allow_negative_numbers = true, default_value_t = 512)]
    pub num_blocks: u32,
    /// Tokens per KV block.
    #[arg(long, allow_negative_numbers = true, default_value_t = 16)]
    pub block_size: u32,
    /// Model layers.
    #[arg(long, allow_negative_numbers = true, default_value_t = 2)]
    pub num_layers: u32,
    /// KV heads of the whole model (split across TP ranks).
    #[arg(long, allow_negative_numbers = true, default_value_t = 8)]
    pub num_kv_heads: u32,
    /// Head dimension, in elements (bf16).
    #[arg(long, allow_negative_numbers = true, default_value_t = 64)]
    pub head_dim: u32,
    /// Data path for KV reads.
    #[arg(long, value_enum, default_value_t = TransportChoice::Auto)]
    pub transport: TransportChoice,
    /// How D gets P's KV: `pull` (D reads under P's lease) or `push` (P writes into
    /// blocks D reserved). Every P and D of a deployment must use the same mode: a leg of
    /// the other mode is refused with a 400. Push runs on every transport: over verbs P
    /// writes with RDMA WRITEs into ranges D granted for the reservation. Any `--memory`
    /// works: writes out of or into memory the CPU cannot address (staged, CUDA) go
    /// through host bounce buffers, on the TCP or shared-memory socket.
    #[arg(long, value_enum, default_value_t = TransferMode::Pull)]
    pub transfer_mode: TransferMode,
    /// Memory holding the KV pool.
    #[arg(long, value_enum, default_value_t = MemoryChoice::Auto)]
    pub memory: MemoryChoice,
    /// KV transfer config in vLLM's JSON shape, e.g.
    /// '{"kv_connector":"kvlease","kv_role":"kv_producer","kv_connector_extra_config":{"kv_lease_duration":30}}'.
    #[arg(long, value_name = "JSON", value_parser = parse_kv_transfer_config)]
    pub kv_transfer_config: Option<KvTransferConfig>,
    /// Cluster token: peers must prove it in the handshake before they may read or notify.
    /// Required when --host is not a loopback address (see --allow-unauthenticated).
    #[arg(long, env = "KVLEASE_AUTH_TOKEN", hide_env_values = true)]
    pub auth_token: Option<AuthToken>,
    /// Serve peers without a cluster token on a non-loopback --host (logged as a warning).
    /// Without it such an agent refuses to start: anyone who reaches it could read the
    /// whole KV pool and forge lease messages.
    #[arg(long)]
    pub allow_unauthenticated: bool,
    /// Address peers are told to reach this agent at (its side channel, transport and
    /// clock probe): a host name or an IP (IPv6 too). Default: --host, or, when --host is
    /// an unspecified address (0.0.0.0, ::), this host's primary non-loopback address.
    #[arg(long, env = "KVLEASE_ADVERTISE_HOST")]
    pub advertise_host: Option<String>,
    /// API key for the HTTP API, as vLLM's --api-key: requests must send
    /// `Authorization: Bearer <key>`; /health and /metrics stay open.
    #[arg(long, env = "KVLEASE_API_KEY", hide_env_values = true)]
    pub api_key: Option<AuthToken>,
    /// Log line format (the level comes from RUST_LOG, default info).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Bounds on what peers and clients can make the agent spend.
    #[command(flatten)]
    pub limits: LimitArgs,
    /// The generated engine id, created once on first use.
    #[arg(skip)]
    generated_engine_id: OnceLock<EngineId>,
}

fn parse_kv_transfer_config(s: &str) -> Result<KvTransferConfig, ConfigError> {
    KvTransferConfig::parse(s)
}

/// A fresh engine id, `kvlease-<16 hex digits>`, from the OS-seeded hasher keys, the
/// process id and the time.
fn generate_engine_id() -> EngineId {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    if let Ok(since) = std::time::SystemTime::UNIX_EPOCH.elapsed() {
        hasher.write_u128(since.as_nanos());
    }
    let id = format!("kvlease-{:016x}", hasher.finish());
    // `kvlease-` and hex digits are all in the id alphabet and far below the length limit.
    EngineId::new(&id).expect("generated engine id uses only allowed bytes")
}

impl CommonArgs {
    /// Checks the flags for `role`: non-zero sizes, `--tp-size` dividing
    /// `--num-kv-heads`, ports that do not collide, a pool of sane size, and a
    /// `--kv-transfer-config` whose `kv_role` fits the agent.
    ///
    /// # Errors
    /// [`ArgsError`] naming the first offending flag.
    pub fn validate(&self, role: AgentRole) -> Result<(), ArgsError> {
        if self.host.trim().is_empty() {
            return Err(bad("--host", "must not be empty"));
        }
        let ip: std::net::IpAddr = self.host.parse().map_err(|e| {
            bad(
                "--host",
                format!("{}: {e} (an IP address to listen on)", self.host),
            )
        })?;
        if !ip.is_loopback() && self.auth_token.is_none() && !self.allow_unauthenticated {
            return Err(bad(
                "--host",
                format!(
                    "{ip} is reachable from other hosts, and without a cluster token anyone \
                     who reaches it can read the KV pool and forge lease messages: set the \
                     same token on every P and D with --auth-token or KVLEASE_AUTH_TOKEN, or \
                     pass --allow-unauthenticated"
                ),
            ));
        }
        if let Some(h) = &self.advertise_host {
            let h = h.trim_start_matches('[').trim_end_matches(']');
            if h.is_empty()
                || h.parse::<std::net::IpAddr>()
                    .is_ok_and(|a| a.is_unspecified())
                || (h.parse::<std::net::IpAddr>().is_err()
                    && !h
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.'))
            {
                return Err(bad(
                    "--advertise-host",
                    format!("{h:?}: a host name or a specific IP address that peers can reach"),
                ));
            }
        }
        if self.port == 0 {
            return Err(bad(
                "--port",
                "must be 1..=65535 (0 would pick a port no client can find)",
            ));
        }
        if self.side_channel_port == 0 {
            return Err(bad("--side-channel-port", "must be 1..=65535"));
        }
        if self.tp_size == 0 || self.tp_size > 256 {
            return Err(bad(
                "--tp-size",
                format!("must be 1..=256, got {}", self.tp_size),
            ));
        }
        if self.port == self.side_channel_port {
            return Err(bad(
                "--port",
                format!("{} is also --side-channel-port", self.port),
            ));
        }
        for (flag, value, max) in [
            ("--num-blocks", self.num_blocks, u32::MAX),
            ("--block-size", self.block_size, 4096),
            ("--num-layers", self.num_layers, 4096),
            ("--num-kv-heads", self.num_kv_heads, 4096),
            ("--head-dim", self.head_dim, 4096),
        ] {
            if value == 0 || value > max {
                return Err(bad(flag, format!("must be 1..={max}, got {value}")));
            }
        }
        if !self.num_kv_heads.is_multiple_of(self.tp_size) {
            return Err(bad(
                "--tp-size",
                format!(
                    "{} does not divide --num-kv-heads {}",
                    self.tp_size, self.num_kv_heads
                ),
            ));
        }
        let bytes = self.pool_bytes_per_rank();
        if bytes > MAX_POOL_BYTES_PER_RANK {
            return Err(bad(
                "--num-blocks",
                format!(
                    "a pool of {bytes} bytes per rank (num_layers × num_blocks × 2 × heads per rank × \
                     block_size × head_dim × 2 bytes) exceeds {MAX_POOL_BYTES_PER_RANK}"
                ),
            ));
        }
        if let Some(config) = &self.kv_transfer_config {
            config
                .check_role(role)
                .map_err(|source| ArgsError::KvTransferConfig { source })?;
        }
        if self.transfer_mode == TransferMode::Push && self.kv_config(role).bidirectional_kv_xfer {
            return Err(bad(
                "--transfer-mode",
                "push does not combine with bidirectional_kv_xfer (bidirectional mode pulls)",
            ));
        }
        self.limits.validate()
    }

    /// KV heads held by each TP rank. Meaningful after [`CommonArgs::validate`].
    pub fn kv_heads_per_rank(&self) -> u32 {
        self.num_kv_heads / self.tp_size.max(1)
    }

    /// Bytes of one rank's KV pool: layers × blocks × (K, V) × heads per rank × block
    /// size × head dim × 2 bytes (bf16). Saturates instead of overflowing.
    pub fn pool_bytes_per_rank(&self) -> u64 {
        [
            u64::from(self.num_layers),
            u64::from(self.num_blocks),
            2,
            u64::from(self.kv_heads_per_rank()),
            u64::from(self.block_size),
            u64::from(self.head_dim),
            DTYPE_BYTES,
        ]
        .into_iter()
        .fold(1u64, u64::saturating_mul)
    }

    /// The KV transfer config: the parsed flag, or the defaults for `role`.
    pub fn kv_config(&self, role: AgentRole) -> KvTransferConfig {
        self.kv_transfer_config
            .clone()
            .unwrap_or_else(|| KvTransferConfig::default_for(role))
    }

    /// This engine's id: `--engine-id`, else the config's `engine_id`, else one generated
    /// on the first call (the same on every later call).
    pub fn engine_id(&self) -> EngineId {
        if let Some(id) = &self.engine_id {
            return id.clone();
        }
        if let Some(id) = self
            .kv_transfer_config
            .as_ref()
            .and_then(|c| c.engine_id.as_ref())
        {
            return id.clone();
        }
        self.generated_engine_id
            .get_or_init(generate_engine_id)
            .clone()
    }
}

/// `prefill-agent`'s command line.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "prefill-agent",
    version,
    about = "kvlease prefill agent (P): prefills, grants leases, serves KV reads"
)]
pub struct PrefillArgs {
    /// Flags shared with decode-agent.
    #[command(flatten)]
    pub common: CommonArgs,
    /// Simulated prefill cost per prompt token, in microseconds (stands in for the model).
    #[arg(long, allow_negative_numbers = true, default_value_t = 20)]
    pub prefill_us_per_token: u64,
    /// How long a request waits for free KV blocks before it gets a 503, in milliseconds.
    #[arg(long, allow_negative_numbers = true, default_value_t = 5000)]
    pub pool_wait_ms: u64,
    /// Connect back (for expiry notices) to a D worker whatever address its metadata
    /// names. By default P connects back only to D workers on the address D's
    /// side-channel handshake came from (loopback counts as one address).
    #[arg(long)]
    pub connect_back_any_host: bool,
}

impl PrefillArgs {
    /// Checks every flag.
    ///
    /// # Errors
    /// [`ArgsError`] naming the first offending flag.
    pub fn validate(&self) -> Result<(), ArgsError> {
        self.common.validate(AgentRole::Prefill)?;
        if self.prefill_us_per_token > 1_000_000 {
            return Err(bad(
                "--prefill-us-per-token",
                format!(
                    "must be at most 1000000 (one second per token), got {}",
                    self.prefill_us_per_token
                ),
            ));
        }
        if self.pool_wait_ms > 600_000 {
            return Err(bad(
                "--pool-wait-ms",
                format!(
                    "must be at most 600000 (10 minutes), got {}",
                    self.pool_wait_ms
                ),
            ));
        }
        Ok(())
    }

    /// `--pool-wait-ms` as a duration.
    pub fn pool_wait(&self) -> Duration {
        Duration::from_millis(self.pool_wait_ms)
    }

    /// `--prefill-us-per-token` as a duration.
    pub fn prefill_cost_per_token(&self) -> Duration {
        Duration::from_micros(self.prefill_us_per_token)
    }
}

/// `decode-agent`'s command line.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "decode-agent",
    version,
    about = "kvlease decode agent (D): heartbeats leases, reads KV blocks, decodes"
)]
pub struct DecodeArgs {
    /// Flags shared with prefill-agent.
    #[command(flatten)]
    pub common: CommonArgs,
    /// Requests decoding at once; the rest wait in the queue.
    #[arg(long, allow_negative_numbers = true, default_value_t = 8)]
    pub max_running: u32,
    /// Duration of one forward step (one token for every running request), in milliseconds.
    #[arg(long, allow_negative_numbers = true, default_value_t = 10)]
    pub step_ms: u64,
    /// Longest waiting queue; a request arriving to a full queue gets a 503.
    #[arg(long, allow_negative_numbers = true, default_value_t = 1024)]
    pub max_waiting: u32,
    /// Networks (CIDRs, comma-separated, e.g. 10.0.0.0/8,fd00::/8) whose P agents this D
    /// may connect to; a request naming a P elsewhere gets a 403. Default: loopback and
    /// the networks this host's interfaces are attached to; `0.0.0.0/0,::/0` allows any.
    #[arg(long, value_delimiter = ',')]
    pub allowed_prefill_hosts: Vec<Cidr>,
    /// P engines kept at once (handshaking or connected, each with its connections and
    /// threads). A request naming another one drops the least recently used idle one (no
    /// request here names it); when every one is in use it gets a retryable 503.
    #[arg(long, allow_negative_numbers = true, default_value_t = kvlease_engine::DEFAULT_MAX_ENGINES)]
    pub max_prefill_engines: usize,
}

impl DecodeArgs {
    /// Checks every flag.
    ///
    /// # Errors
    /// [`ArgsError`] naming the first offending flag.
    pub fn validate(&self) -> Result<(), ArgsError> {
        self.common.validate(AgentRole::Decode)?;
        if self.max_running == 0 || self.max_running > 65_536 {
            return Err(bad(
                "--max-running",
                format!("must be 1..=65536, got {}", self.max_running),
            ));
        }
        if self.step_ms == 0 || self.step_ms > 60_000 {
            return Err(bad(
                "--step-ms",
                format!("must be 1..=60000, got {}", self.step_ms),
            ));
        }
        if self.max_waiting == 0 || self.max_waiting > 1_000_000 {
            return Err(bad(
                "--max-waiting",
                format!("must be 1..=1000000, got {}", self.max_waiting),
            ));
        }
        if self.max_prefill_engines == 0 || self.max_prefill_engines > 65_536 {
            return Err(bad(
                "--max-prefill-engines",
                format!("must be 1..=65536, got {}", self.max_prefill_engines),
            ));
        }
        if self.common.limits.health_engine_stall_ms <= self.step_ms {
            return Err(bad(
                "--health-engine-stall-ms",
                format!(
                    "must be longer than --step-ms {} (one step is not a stall), got {}",
                    self.step_ms, self.common.limits.health_engine_stall_ms
                ),
            ));
        }
        Ok(())
    }

    /// `--step-ms` as a duration.
    pub fn step(&self) -> Duration {
        Duration::from_millis(self.step_ms)
    }
}

// ------------------------------------------------------------------ limits
//
// Every bound on what a peer or an HTTP client can make an agent spend, in one block (the
// "Limits" section of docs/architecture.md lists them).

/// Longest duration any limit flag accepts: one day.
const MAX_LIMIT_MS: u64 = 86_400_000;

/// The default per-address HTTP connection cap for a global cap of `max_connections`:
/// seven eighths of it, at least 1. The last eighth is kept for other addresses (health
/// checks, scrapers, a second proxy) while one source floods; a lower default would cap
/// kvlease-proxy, which is one address to each agent, below the agent's own capacity.
pub fn default_per_source(max_connections: usize) -> usize {
    (max_connections - max_connections / 8).max(1)
}

/// The limit flags both agents share (`--help` shows them under "Limits").
#[derive(Debug, Clone, PartialEq, Eq, Args)]
#[command(next_help_heading = "Limits")]
pub struct LimitArgs {
    /// Side-channel handshakes served at once (one thread each); more connections are
    /// closed at once and counted in kvlease_side_channel_refused_total.
    #[arg(long, default_value_t = 64)]
    pub side_channel_max_connections: usize,
    /// Side-channel handshakes served at once for one peer address (so that one source
    /// cannot take every slot); more from it are closed at once and counted like the
    /// others.
    #[arg(long, default_value_t = 16)]
    pub side_channel_max_connections_per_address: usize,
    /// A whole side-channel handshake must end this long after accept, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    pub side_channel_handshake_timeout_ms: u64,
    /// Largest side-channel frame read from a peer (all of them come before the peer has
    /// proven the token); a longer announced length closes the connection unread.
    #[arg(long, default_value_t = 256 << 10)]
    pub side_channel_max_frame_bytes: usize,
    /// Inbound data-port (transport) connections served at once, per TP worker.
    #[arg(long, default_value_t = 1024)]
    pub transport_max_connections: usize,
    /// Inbound data-port connections held at once from one peer address, per TP worker
    /// (so that one source cannot take every slot).
    #[arg(long, default_value_t = 256)]
    pub transport_max_connections_per_address: usize,
    /// An inbound data-port connection not authenticated this long after accept is
    /// closed, whatever it sends meanwhile, in milliseconds (also the outbound connect
    /// and per-step handshake limit).
    #[arg(long, default_value_t = 5_000)]
    pub transport_handshake_timeout_ms: u64,
    /// Verbs: a queue pair with reads or writes outstanding that completes nothing for
    /// this long is reset and reconnected, and its unconfirmed work posted again (counted
    /// in kvlease_verbs_stall_resets_total), in milliseconds; doubled, up to 8 times,
    /// while resets bring no progress. Keep it below the time a KV transfer may take
    /// (30 s), so that a transfer whose request the device lost still completes.
    #[arg(long, default_value_t = 5_000)]
    pub verbs_stall_timeout_ms: u64,
    /// Bytes of received notifications held per TP worker until the engine takes them
    /// (and the most one poll takes); more wait in the peer's notification connection,
    /// or, when they come over a data connection (older peers), are dropped and counted
    /// in kvlease_notifs_dropped_total.
    #[arg(long, default_value_t = 16 << 20)]
    pub max_pending_notif_bytes: usize,
    /// HTTP connections open at once; more are closed at accept and counted in
    /// kvlease_http_connections_refused_total.
    #[arg(long, default_value_t = 256)]
    pub http_max_connections: usize,
    /// HTTP connections one client address may hold at once, at most
    /// --http-max-connections; more are closed at accept and counted with the others.
    /// Default: seven eighths of --http-max-connections (at least 1). kvlease-proxy is one
    /// address: give it at least its peak number of requests in flight to this agent.
    #[arg(long)]
    pub http_max_connections_per_source: Option<usize>,
    /// Largest HTTP request body, in bytes (larger: 413).
    #[arg(long, default_value_t = 2 << 20)]
    pub http_max_body_bytes: usize,
    /// Longest text prompt (or chat messages together), in bytes, checked before
    /// tokenizing (longer: 400).
    #[arg(long, default_value_t = 256 << 10)]
    pub http_max_prompt_bytes: usize,
    /// A request's whole body must arrive within this, in milliseconds (else 408).
    #[arg(long, default_value_t = 30_000)]
    pub http_body_timeout_ms: u64,
    /// A request's headers must arrive within this, in milliseconds (from accept for a
    /// connection's first request), and an idle keep-alive connection is closed after it.
    #[arg(long, default_value_t = 10_000)]
    pub http_header_timeout_ms: u64,
    /// Longest a request may take to produce its response head, in milliseconds (else
    /// 408; a stream's later chunks are not limited).
    #[arg(long, default_value_t = 600_000)]
    pub http_request_timeout_ms: u64,
    /// /health answers 503 when the engine loop has not completed an iteration for this
    /// long, in milliseconds (a dead or stuck engine).
    #[arg(long, default_value_t = 30_000)]
    pub health_engine_stall_ms: u64,
}

impl LimitArgs {
    /// Checks that every limit is non-zero, durations are at most a day, the per-address
    /// HTTP connection cap is at most the global one and the notification buffer holds at
    /// least one notification.
    ///
    /// # Errors
    /// [`ArgsError`] naming the first offending flag.
    pub fn validate(&self) -> Result<(), ArgsError> {
        for (flag, value) in [
            (
                "--side-channel-max-connections",
                self.side_channel_max_connections,
            ),
            (
                "--side-channel-max-frame-bytes",
                self.side_channel_max_frame_bytes,
            ),
            (
                "--side-channel-max-connections-per-address",
                self.side_channel_max_connections_per_address,
            ),
            (
                "--transport-max-connections",
                self.transport_max_connections,
            ),
            (
                "--transport-max-connections-per-address",
                self.transport_max_connections_per_address,
            ),
            ("--http-max-connections", self.http_max_connections),
            (
                "--http-max-connections-per-source",
                self.http_max_connections_per_source(),
            ),
            ("--http-max-body-bytes", self.http_max_body_bytes),
            ("--http-max-prompt-bytes", self.http_max_prompt_bytes),
        ] {
            if value == 0 {
                return Err(bad(flag, "must be at least 1"));
            }
        }
        for (flag, ms) in [
            (
                "--side-channel-handshake-timeout-ms",
                self.side_channel_handshake_timeout_ms,
            ),
            (
                "--transport-handshake-timeout-ms",
                self.transport_handshake_timeout_ms,
            ),
            ("--verbs-stall-timeout-ms", self.verbs_stall_timeout_ms),
            ("--http-body-timeout-ms", self.http_body_timeout_ms),
            ("--http-header-timeout-ms", self.http_header_timeout_ms),
            ("--http-request-timeout-ms", self.http_request_timeout_ms),
            ("--health-engine-stall-ms", self.health_engine_stall_ms),
        ] {
            if ms == 0 || ms > MAX_LIMIT_MS {
                return Err(bad(flag, format!("must be 1..={MAX_LIMIT_MS}, got {ms}")));
            }
        }
        if self.http_max_connections_per_source() > self.http_max_connections {
            return Err(bad(
                "--http-max-connections-per-source",
                format!(
                    "must be at most --http-max-connections ({}), got {}",
                    self.http_max_connections,
                    self.http_max_connections_per_source()
                ),
            ));
        }
        if self.max_pending_notif_bytes < kvlease_notif::MAX_NOTIF_LEN {
            return Err(bad(
                "--max-pending-notif-bytes",
                format!(
                    "must hold at least one notification ({} bytes), got {}",
                    kvlease_notif::MAX_NOTIF_LEN,
                    self.max_pending_notif_bytes
                ),
            ));
        }
        Ok(())
    }

    /// `--side-channel-handshake-timeout-ms` as a duration.
    pub fn side_channel_handshake_timeout(&self) -> Duration {
        Duration::from_millis(self.side_channel_handshake_timeout_ms)
    }

    /// `--transport-handshake-timeout-ms` as a duration.
    pub fn transport_handshake_timeout(&self) -> Duration {
        Duration::from_millis(self.transport_handshake_timeout_ms)
    }

    /// `--verbs-stall-timeout-ms` as a duration.
    pub fn verbs_stall_timeout(&self) -> Duration {
        Duration::from_millis(self.verbs_stall_timeout_ms)
    }

    /// `--http-max-connections-per-source`, or its default: seven eighths of
    /// `--http-max-connections`, at least 1.
    pub fn http_max_connections_per_source(&self) -> usize {
        self.http_max_connections_per_source
            .unwrap_or_else(|| default_per_source(self.http_max_connections))
    }

    /// `--http-body-timeout-ms` as a duration.
    pub fn http_body_timeout(&self) -> Duration {
        Duration::from_millis(self.http_body_timeout_ms)
    }

    /// `--http-header-timeout-ms` as a duration.
    pub fn http_header_timeout(&self) -> Duration {
        Duration::from_millis(self.http_header_timeout_ms)
    }

    /// `--http-request-timeout-ms` as a duration.
    pub fn http_request_timeout(&self) -> Duration {
        Duration::from_millis(self.http_request_timeout_ms)
    }

    /// `--health-engine-stall-ms` as a duration.
    pub fn health_engine_stall(&self) -> Duration {
        Duration::from_millis(self.health_engine_stall_ms)
    }
}
