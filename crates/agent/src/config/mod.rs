//! Configuration of the agents: the `--kv-transfer-config` JSON in vLLM's shape and the
//! command-line flags both agents share.
//!
//! Parsing is strict where a typo would silently change behaviour: unknown keys inside
//! `kv_connector_extra_config`, wrong types and out-of-range values are rejected with a
//! message that names the key (`kv_connector_extra_config.kv_lease_duration: must be > 0
//! seconds, got -1`). vLLM's other top-level keys (`kv_rank`, `kv_ip`, ...) are accepted and
//! ignored, with a debug log, so that a config copied from a vLLM deployment works.
//!
//! This module does no IO beyond that debug log; binaries turn a [`ConfigError`] or an
//! [`ArgsError`] into a non-zero exit with the message.

use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;
use std::time::Duration;

use clap::{Args, Parser, ValueEnum};
use kvlease_lease::EngineId;
use serde_json::{Map, Value};

/// `kv_connector` values accepted: ours and vLLM's NIXL connector (an alias, so that
/// configs copied from vLLM work).
pub const CONNECTOR_NAMES: [&str; 2] = ["kvlease", "NixlConnector"];

/// vLLM `KVTransferConfig` keys that are accepted and ignored (logged at debug level).
pub const IGNORED_TOP_LEVEL_KEYS: [&str; 8] = [
    "kv_rank",
    "kv_parallel_size",
    "kv_buffer_device",
    "kv_buffer_size",
    "kv_ip",
    "kv_port",
    "kv_connector_module_path",
    "enable_permute_local_kv",
];

/// The keys `kv_connector_extra_config` may hold.
pub const EXTRA_CONFIG_KEYS: [&str; 9] = [
    "kv_lease_duration",
    "decoder_kv_blocks_ttl",
    "bidirectional_kv_xfer",
    "kv_load_failure_policy",
    "lease_mode",
    "abort_request_timeout",
    "kv_recompute_threshold",
    "pull_safety_margin",
    "symmetric_decoder_lease",
];

/// Default `kv_lease_duration`.
pub const DEFAULT_LEASE_DURATION: Duration = Duration::from_secs(30);
/// Default `decoder_kv_blocks_ttl`.
pub const DEFAULT_DECODER_KV_BLOCKS_TTL: Duration = Duration::from_secs(480);
/// Default `abort_request_timeout` (the single timeout of `lease_mode: "fixed"`).
pub const DEFAULT_ABORT_REQUEST_TIMEOUT: Duration = Duration::from_secs(480);
/// Default `kv_recompute_threshold`, in tokens.
pub const DEFAULT_RECOMPUTE_THRESHOLD: u32 = 64;
/// Default `pull_safety_margin`.
pub const DEFAULT_PULL_SAFETY_MARGIN: Duration = Duration::from_secs(5);

/// Shortest duration accepted for any of the second-valued keys that must be positive.
/// Below this the heartbeat interval (duration / 6) is shorter than a forward-loop step.
pub const MIN_DURATION: Duration = Duration::from_millis(10);
/// Longest `kv_lease_duration` / `abort_request_timeout` accepted: one day.
pub const MAX_LEASE_DURATION: Duration = Duration::from_secs(86_400);
/// Longest `decoder_kv_blocks_ttl` accepted: one day (the lease crate's limit too).
pub const MAX_DECODER_KV_BLOCKS_TTL: Duration = Duration::from_secs(86_400);

/// Why a `--kv-transfer-config` value was rejected. The message always names the key.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The value is not JSON.
    #[error("kv-transfer-config is not valid JSON: {source}")]
    Json {
        /// The parser's error (with line and column).
        #[source]
        source: serde_json::Error,
    },
    /// A required key is absent.
    #[error("{key}: required key is missing")]
    Missing {
        /// The dotted path of the key.
        key: String,
    },
    /// A key this connector does not know.
    #[error("{key}: unknown key (known keys: {known})")]
    UnknownKey {
        /// The dotted path of the key.
        key: String,
        /// The keys allowed at that level, comma separated.
        known: String,
    },
    /// The value has the wrong JSON type.
    #[error("{key}: expected {expected}, got {got}")]
    WrongType {
        /// The dotted path of the key.
        key: String,
        /// What was expected.
        expected: &'static str,
        /// What was found, as compact JSON.
        got: String,
    },
    /// The value has the right type but is out of range or not one of the choices.
    #[error("{key}: {reason}, got {got}")]
    Invalid {
        /// The dotted path of the key.
        key: String,
        /// What the value must be.
        reason: String,
        /// What was found, as compact JSON.
        got: String,
    },
}

impl ConfigError {
    /// The dotted path of the offending key, or `None` for a JSON syntax error.
    pub fn key(&self) -> Option<&str> {
        match self {
            Self::Json { .. } => None,
            Self::Missing { key }
            | Self::UnknownKey { key, .. }
            | Self::WrongType { key, .. }
            | Self::Invalid { key, .. } => Some(key),
        }
    }
}

/// Which connector name the config used (both select kvlease).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Connector {
    /// `"kvlease"`.
    Kvlease,
    /// `"NixlConnector"`, accepted as an alias.
    NixlAlias,
}

/// `kv_role`: whether this instance produces KV blocks (P), consumes them (D), or both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KvRole {
    /// `"kv_producer"`.
    Producer,
    /// `"kv_consumer"`.
    Consumer,
    /// `"kv_both"`.
    Both,
}

impl KvRole {
    /// The name used in the JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Producer => "kv_producer",
            Self::Consumer => "kv_consumer",
            Self::Both => "kv_both",
        }
    }

    /// Whether an agent of `role` may run with this `kv_role`.
    pub fn allows(self, role: AgentRole) -> bool {
        matches!(
            (self, role),
            (Self::Both, _)
                | (Self::Producer, AgentRole::Prefill)
                | (Self::Consumer, AgentRole::Decode)
        )
    }
}

/// `kv_load_failure_policy`: what D does when it cannot load a request's KV blocks (P
/// gone, lease expired, fenced read detected a stale generation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum LoadFailurePolicy {
    /// `"recompute"` (default): answer with a retryable error so that the request is
    /// prefilled again (the proxy retries once from P).
    #[default]
    Recompute,
    /// `"fail"`: fail the request.
    Fail,
}

impl LoadFailurePolicy {
    /// The name used in the JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Recompute => "recompute",
            Self::Fail => "fail",
        }
    }
}

/// `lease_mode`: leases renewed by heartbeats, or the single fixed timeout of the system
/// this replaces (kept as a baseline for comparison).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum LeaseModeSetting {
    /// `"lease"` (default): initial lease `kv_lease_duration`, renewed by `HB:` heartbeats.
    #[default]
    Lease,
    /// `"fixed"`: blocks are held for `abort_request_timeout`; heartbeats do not extend.
    Fixed,
}

impl LeaseModeSetting {
    /// The name used in the JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Lease => "lease",
            Self::Fixed => "fixed",
        }
    }
}

/// Which agent is being configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AgentRole {
    /// `prefill-agent` (P).
    Prefill,
    /// `decode-agent` (D).
    Decode,
}

impl AgentRole {
    /// The binary's name.
    pub fn binary(self) -> &'static str {
        match self {
            Self::Prefill => "prefill-agent",
            Self::Decode => "decode-agent",
        }
    }

    /// The `kv_role` used when no `--kv-transfer-config` is given.
    pub fn default_kv_role(self) -> KvRole {
        match self {
            Self::Prefill => KvRole::Producer,
            Self::Decode => KvRole::Consumer,
        }
    }
}

/// A parsed and range-checked `--kv-transfer-config`.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct KvTransferConfig {
    /// `kv_connector`.
    pub connector: Connector,
    /// `kv_role`.
    pub role: KvRole,
    /// vLLM's top-level `engine_id`, if given (the `--engine-id` flag takes precedence).
    pub engine_id: Option<EngineId>,
    /// `kv_lease_duration`: the initial lease; heartbeat interval = d / 6, extension = 2d / 3.
    pub lease_duration: Duration,
    /// `decoder_kv_blocks_ttl`: how long D holds blocks for the next turn in bidirectional mode.
    pub decoder_kv_blocks_ttl: Duration,
    /// `bidirectional_kv_xfer`.
    pub bidirectional_kv_xfer: bool,
    /// `symmetric_decoder_lease` (default false): in bidirectional mode, P's heartbeats
    /// extend D's cached blocks while a next-turn request waits on P, instead of the
    /// fixed `decoder_kv_blocks_ttl` alone.
    pub symmetric_decoder_lease: bool,
    /// `kv_load_failure_policy` (inside `kv_connector_extra_config`, or vLLM's top-level key).
    pub load_failure_policy: LoadFailurePolicy,
    /// `lease_mode`.
    pub lease_mode: LeaseModeSetting,
    /// `abort_request_timeout`: the single timeout of `lease_mode: "fixed"`.
    pub abort_request_timeout: Duration,
    /// `kv_recompute_threshold`: prompts of at most this many tokens are recomputed on D
    /// rather than pulled.
    pub recompute_threshold_tokens: u32,
    /// `pull_safety_margin`: in bidirectional mode, P declines a pull that would finish
    /// within this margin of D's deadline.
    pub pull_safety_margin: Duration,
    /// Top-level keys that were accepted and ignored.
    pub ignored_keys: Vec<String>,
}

impl KvTransferConfig {
    /// The configuration used when `--kv-transfer-config` is absent: every default, with
    /// the `kv_role` that fits `role`.
    pub fn default_for(role: AgentRole) -> Self {
        Self {
            connector: Connector::Kvlease,
            role: role.default_kv_role(),
            engine_id: None,
            lease_duration: DEFAULT_LEASE_DURATION,
            decoder_kv_blocks_ttl: DEFAULT_DECODER_KV_BLOCKS_TTL,
            bidirectional_kv_xfer: false,
            symmetric_decoder_lease: false,
            load_failure_policy: LoadFailurePolicy::Recompute,
            lease_mode: LeaseModeSetting::Lease,
            abort_request_timeout: DEFAULT_ABORT_REQUEST_TIMEOUT,
            recompute_threshold_tokens: DEFAULT_RECOMPUTE_THRESHOLD,
            pull_safety_margin: DEFAULT_PULL_SAFETY_MARGIN,
            ignored_keys: Vec::new(),
        }
    }

    /// Parses vLLM's `--kv-transfer-config` JSON shape.
    ///
    /// `kv_connector` and `kv_role` are required; every key of `kv_connector_extra_config`
    /// is optional and defaults as documented on the fields.
    ///
    /// # Errors
    /// [`ConfigError`] naming the key for invalid JSON, a missing required key, an unknown
    /// key, a value of the wrong type, or a value out of range (zero, negative, NaN or
    /// absurdly large durations; a safety margin not below the TTL; two disagreeing
    /// `kv_load_failure_policy` keys).
    pub fn parse(json: &str) -> Result<Self, ConfigError> {
        let value: Value =
            serde_json::from_str(json).map_err(|source| ConfigError::Json { source })?;
        let Value::Object(top) = value else {
            return Err(wrong_type("kv-transfer-config", "a JSON object", &value));
        };
        let mut config = Self::default_for(AgentRole::Prefill);
        let mut top_policy = None;
        let mut saw_connector = false;
        let mut saw_role = false;
        for (key, value) in &top {
            match key.as_str() {
                "kv_connector" => {
                    saw_connector = true;
                    config.connector = match expect_str(key, value)? {
                        "kvlease" => Connector::Kvlease,
                        "NixlConnector" => Connector::NixlAlias,
                        _ => {
                            return Err(invalid(
                                key,
                                "must be \"kvlease\" (or the alias \"NixlConnector\")",
                                value,
                            ));
                        }
                    };
                }
                "kv_role" => {
                    saw_role = true;
                    config.role = match expect_str(key, value)? {
                        "kv_producer" => KvRole::Producer,
                        "kv_consumer" => KvRole::Consumer,
                        "kv_both" => KvRole::Both,
                        _ => {
                            return Err(invalid(
                                key,
                                "must be \"kv_producer\", \"kv_consumer\" or \"kv_both\"",
                                value,
                            ));
                        }
                    };
                }
                "engine_id" => match value {
                    Value::Null => {}
                    Value::String(s) => {
                        config.engine_id = Some(
                            EngineId::new(s).map_err(|e| invalid(key, &e.to_string(), value))?,
                        );
                    }
                    _ => return Err(wrong_type(key, "a string", value)),
                },
                "kv_load_failure_policy" => top_policy = Some(parse_policy(key, value)?),
                "kv_connector_extra_config" => match value {
                    Value::Null => {}
                    Value::Object(extra) => config.parse_extra(extra)?,
                    _ => return Err(wrong_type(key, "a JSON object", value)),
                },
                other if IGNORED_TOP_LEVEL_KEYS.contains(&other) => {
                    tracing::debug!(
                        key = other,
                        "kv-transfer-config: ignoring vLLM key that kvlease does not use"
                    );
                    config.ignored_keys.push(other.to_owned());
                }
                other => {
                    let mut known = vec![
                        "kv_connector",
                        "kv_role",
                        "engine_id",
                        "kv_load_failure_policy",
                        "kv_connector_extra_config",
                    ];
                    known.extend(IGNORED_TOP_LEVEL_KEYS);
                    return Err(ConfigError::UnknownKey {
                        key: other.to_owned(),
                        known: known.join(", "),
                    });
                }
            }
        }
        if !saw_connector {
            return Err(ConfigError::Missing {
                key: "kv_connector".to_owned(),
            });
        }
        if !saw_role {
            return Err(ConfigError::Missing {
                key: "kv_role".to_owned(),
            });
        }
        if let Some(policy) = top_policy {
            let inner_given = top
                .get("kv_connector_extra_config")
                .and_then(Value::as_object)
                .is_some_and(|extra| extra.contains_key("kv_load_failure_policy"));
            if inner_given && policy != config.load_failure_policy {
                return Err(ConfigError::Invalid {
                    key: "kv_load_failure_policy".to_owned(),
                    reason: format!(
                        "disagrees with kv_connector_extra_config.kv_load_failure_policy (\"{}\"); give it once",
                        config.load_failure_policy.as_str()
                    ),
                    got: format!("\"{}\"", policy.as_str()),
                });
            }
            config.load_failure_policy = policy;
        }
        Ok(config)
    }

    fn parse_extra(&mut self, extra: &Map<String, Value>) -> Result<(), ConfigError> {
        for (name, value) in extra {
            let key = format!("kv_connector_extra_config.{name}");
            let key = key.as_str();
            match name.as_str() {
                "kv_lease_duration" => {
                    self.lease_duration = positive_secs(key, value, MAX_LEASE_DURATION)?
                }
                "decoder_kv_blocks_ttl" => {
                    self.decoder_kv_blocks_ttl =
                        positive_secs(key, value, MAX_DECODER_KV_BLOCKS_TTL)?
                }
                "abort_request_timeout" => {
                    self.abort_request_timeout = positive_secs(key, value, MAX_LEASE_DURATION)?
                }
                "pull_safety_margin" => {
                    self.pull_safety_margin =
                        secs(key, value, Duration::ZERO, MAX_DECODER_KV_BLOCKS_TTL)?
                }
                "bidirectional_kv_xfer" => {
                    self.bidirectional_kv_xfer = value
                        .as_bool()
                        .ok_or_else(|| wrong_type(key, "true or false", value))?;
                }
                "symmetric_decoder_lease" => {
                    self.symmetric_decoder_lease = value
                        .as_bool()
                        .ok_or_else(|| wrong_type(key, "true or false", value))?;
                }
                "kv_load_failure_policy" => self.load_failure_policy = parse_policy(key, value)?,
                "lease_mode" => {
                    self.lease_mode = match expect_str(key, value)? {
                        "lease" => LeaseModeSetting::Lease,
                        "fixed" => LeaseModeSetting::Fixed,
                        _ => return Err(invalid(key, "must be \"lease\" or \"fixed\"", value)),
                    };
                }
                "kv_recompute_threshold" => {
                    let tokens = value.as_u64().ok_or_else(|| match value {
                        Value::Number(_) => {
                            invalid(key, "must be a whole number of tokens >= 0", value)
                        }
                        _ => wrong_type(key, "a whole number of tokens", value),
                    })?;
                    self.recompute_threshold_tokens = u32::try_from(tokens).map_err(|_| {
                        invalid(key, &format!("must be at most {} tokens", u32::MAX), value)
                    })?;
                }
                _ => {
                    return Err(ConfigError::UnknownKey {
                        key: key.to_owned(),
                        known: EXTRA_CONFIG_KEYS.join(", "),
                    });
                }
            }
        }
        if self.pull_safety_margin >= self.decoder_kv_blocks_ttl {
            return Err(ConfigError::Invalid {
                key: "kv_connector_extra_config.pull_safety_margin".to_owned(),
                reason: format!(
                    "must be below decoder_kv_blocks_ttl ({} s), or every pull would be declined",
                    self.decoder_kv_blocks_ttl.as_secs_f64()
                ),
                got: self.pull_safety_margin.as_secs_f64().to_string(),
            });
        }
        Ok(())
    }

    /// The heartbeat interval D uses: `kv_lease_duration / 6` (SPEC, "Semantics").
    pub fn heartbeat_interval(&self) -> Duration {
        self.lease_duration / 6
    }

    /// How far a heartbeat pushes a lease's expiry: `kv_lease_duration × 2 / 3`.
    pub fn lease_extension(&self) -> Duration {
        self.lease_duration * 2 / 3
    }

    /// How long P holds a granted request's blocks before the first heartbeat: the lease
    /// in `lease` mode, the single `abort_request_timeout` in `fixed` mode.
    pub fn initial_hold(&self) -> Duration {
        match self.lease_mode {
            LeaseModeSetting::Lease => self.lease_duration,
            LeaseModeSetting::Fixed => self.abort_request_timeout,
        }
    }

    /// Checks that this config fits the agent it is given to.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] on `kv_role` when a prefill agent gets `kv_consumer` or a
    /// decode agent gets `kv_producer`.
    pub fn check_role(&self, role: AgentRole) -> Result<(), ConfigError> {
        if self.role.allows(role) {
            return Ok(());
        }
        let wanted = match role {
            AgentRole::Prefill => "kv_producer or kv_both",
            AgentRole::Decode => "kv_consumer or kv_both",
        };
        Err(ConfigError::Invalid {
            key: "kv_role".to_owned(),
            reason: format!("{} needs {wanted}", role.binary()),
            got: format!("\"{}\"", self.role.as_str()),
        })
    }
}

fn describe(value: &Value) -> String {
    let text = value.to_string();
    if text.len() > 64 {
        let cut = (0..=61)
            .rev()
            .find(|&i| text.is_char_boundary(i))
            .unwrap_or(0);
        format!("{}...", &text[..cut])
    } else {
        text
    }
}

fn wrong_type(key: &str, expected: &'static str, value: &Value) -> ConfigError {
    let kind = match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    };
    ConfigError::WrongType {
        key: key.to_owned(),
        expected,
        got: format!("{kind} {}", describe(value)),
    }
}

fn invalid(key: &str, reason: &str, value: &Value) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_owned(),
        reason: reason.to_owned(),
        got: describe(value),
    }
}

fn expect_str<'v>(key: &str, value: &'v Value) -> Result<&'v str, ConfigError> {
    value
        .as_str()
        .ok_or_else(|| wrong_type(key, "a string", value))
}

fn parse_policy(key: &str, value: &Value) -> Result<LoadFailurePolicy, ConfigError> {
    match expect_str(key, value)? {
        "recompute" => Ok(LoadFailurePolicy::Recompute),
        "fail" => Ok(LoadFailurePolicy::Fail),
        _ => Err(invalid(key, "must be \"recompute\" or \"fail\"", value)),
    }
}

fn positive_secs(key: &str, value: &Value, max: Duration) -> Result<Duration, ConfigError> {
    if value.as_f64().is_some_and(|s| s <= 0.0) {
        return Err(invalid(key, "must be > 0 seconds", value));
    }
    secs(key, value, MIN_DURATION, max)
}

/// A number of seconds (fractional allowed) in `min..=max`.
fn secs(key: &str, value: &Value, min: Duration, max: Duration) -> Result<Duration, ConfigError> {
    // serde_json never produces NaN or infinities from text, but an integer beyond f64's
    // range does not exist either: as_f64 is total on numbers.
    let seconds = value
        .as_f64()
        .ok_or_else(|| wrong_type(key, "a number of seconds", value))?;
    if !seconds.is_finite() || seconds < 0.0 {
        return Err(invalid(
            key,
            "must be a finite number of seconds >= 0",
            value,
        ));
    }
    let range = || {
        format!(
            "must be between {} and {} seconds",
            min.as_secs_f64(),
            max.as_secs_f64()
        )
    };
    let duration =
        Duration::try_from_secs_f64(seconds).map_err(|_| invalid(key, &range(), value))?;
    if duration < min || duration > max {
        return Err(invalid(key, &range(), value));
    }
    Ok(duration)
}

/// `--transport`: which data path to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
#[non_exhaustive]
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

/// `--memory`: where the KV block pool lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
#[non_exhaustive]
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
#[non_exhaustive]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    addr: std::net::IpAddr,
    prefix: u8,
}

impl Cidr {
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
#[non_exhaustive]
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
    /// First port of the handshake side channel; TP rank r listens on this port + r
    /// (like VLLM_NIXL_SIDE_CHANNEL_PORT).
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
        let last_side_port = u32::from(self.side_channel_port) + self.tp_size - 1;
        if last_side_port > u32::from(u16::MAX) {
            return Err(bad(
                "--side-channel-port",
                format!(
                    "rank {} would listen on port {last_side_port}: use a port <= {}",
                    self.tp_size - 1,
                    u32::from(u16::MAX) + 1 - self.tp_size
                ),
            ));
        }
        if (u32::from(self.side_channel_port)..=last_side_port).contains(&u32::from(self.port)) {
            return Err(bad(
                "--port",
                format!(
                    "{} collides with the side channel ports {}..={last_side_port}",
                    self.port, self.side_channel_port
                ),
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
        Ok(())
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

    /// The side channel port of TP rank `rank`.
    pub fn side_channel_port_of(&self, rank: u32) -> Option<u16> {
        u16::try_from(u32::from(self.side_channel_port) + rank).ok()
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
    /// may connect to; a request naming a P elsewhere gets a 403. Default: any.
    #[arg(long, value_delimiter = ',')]
    pub allowed_prefill_hosts: Vec<Cidr>,
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
        Ok(())
    }

    /// `--step-ms` as a duration.
    pub fn step(&self) -> Duration {
        Duration::from_millis(self.step_ms)
    }
}

#[cfg(test)]
mod tests;
