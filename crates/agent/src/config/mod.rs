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

use std::time::Duration;

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
pub const EXTRA_CONFIG_KEYS: [&str; 10] = [
    "kv_lease_duration",
    "kv_lease_max_lifetime",
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
pub enum Connector {
    /// `"kvlease"`.
    Kvlease,
    /// `"NixlConnector"`, accepted as an alias.
    NixlAlias,
}

/// `kv_role`: whether this instance produces KV blocks (P), consumes them (D), or both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
pub struct KvTransferConfig {
    /// `kv_connector`.
    pub connector: Connector,
    /// `kv_role`.
    pub role: KvRole,
    /// vLLM's top-level `engine_id`, if given (the `--engine-id` flag takes precedence).
    pub engine_id: Option<EngineId>,
    /// `kv_lease_duration`: the initial lease; heartbeat interval = d / 6, extension = 2d / 3.
    pub lease_duration: Duration,
    /// `kv_lease_max_lifetime`: the longest P holds a lease from its grant, whatever the
    /// heartbeats say; `None`: the lease crate's default
    /// ([`kvlease_lease::DEFAULT_MAX_LEASE_LIFETIME`], 600 s, or the lease duration when
    /// that is longer).
    pub lease_max_lifetime: Option<Duration>,
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
            lease_max_lifetime: None,
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
                "kv_lease_max_lifetime" => {
                    self.lease_max_lifetime = Some(positive_secs(key, value, MAX_LEASE_DURATION)?)
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

mod cli;
mod local_nets;
pub use local_nets::local_networks;

pub use cli::*;

#[cfg(test)]
mod tests;
