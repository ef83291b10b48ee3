//! The proxy's command line and its validated configuration.

use std::time::Duration;

use clap::{Parser, ValueEnum};
use reqwest::Url;

use crate::config::{LogFormat, default_per_source};
use crate::http::HttpLimits;

/// Why the proxy could not be configured.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// An upstream URL does not parse or is not `http://`.
    #[error("{flag}: {url:?}: {reason}")]
    BadUrl {
        /// `--prefill` or `--decode`.
        flag: &'static str,
        /// The URL given.
        url: String,
        /// What is wrong.
        reason: String,
    },
    /// No upstream of a kind was given.
    #[error("{flag}: at least one URL is required")]
    NoUpstream {
        /// `--prefill` or `--decode`.
        flag: &'static str,
    },
    /// A timeout or limit flag is zero or absurd.
    #[error("{flag}: {reason}")]
    BadTimeout {
        /// The flag.
        flag: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The HTTP client could not be built.
    #[error("building the HTTP client: {source}")]
    Client {
        /// reqwest's error.
        #[source]
        source: reqwest::Error,
    },
}

/// `kvlease-proxy`'s command line.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "kvlease-proxy",
    version,
    about = "kvlease routing proxy: prefill on P, then decode on D with P's kv_transfer_params \
             (--transfer-mode push: both at once, tied by a transfer id)"
)]
pub struct ProxyArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on.
    #[arg(long, allow_negative_numbers = true, default_value_t = 8080)]
    pub port: u16,
    /// Prefill agents' base URLs (http://host:port), used round-robin.
    #[arg(long, required = true, num_args = 1..)]
    pub prefill: Vec<String>,
    /// Decode agents' base URLs (http://host:port), used round-robin.
    #[arg(long, required = true, num_args = 1..)]
    pub decode: Vec<String>,
    /// Time limit for one upstream request, in seconds: for P the whole answer, for D the
    /// whole answer (or, when streaming, the first byte and every gap between chunks).
    #[arg(long, allow_negative_numbers = true, default_value_t = 600.0)]
    pub timeout_secs: f64,
    /// Time limit for connecting to an upstream, in milliseconds.
    #[arg(long, allow_negative_numbers = true, default_value_t = 3000)]
    pub connect_timeout_ms: u64,
    /// Idle upstream connections are closed after this, in milliseconds. Keep it below the
    /// agents' `--http-header-timeout-ms` (default 10000), their idle keep-alive limit:
    /// otherwise an agent may close a pooled connection just as the proxy sends on it.
    #[arg(long, allow_negative_numbers = true, default_value_t = 4000)]
    pub upstream_idle_timeout_ms: u64,
    /// Largest upstream answer the proxy reads whole, in bytes: P's answer (parsed for its
    /// kv_transfer_params) and D's non-streamed answer. A larger one (announced or sent)
    /// is a 502 naming this flag; D's streamed answers are passed through unbuffered.
    #[arg(long, default_value_t = DEFAULT_MAX_UPSTREAM_BODY_BYTES)]
    pub max_upstream_body_bytes: usize,
    /// Bytes the proxy holds in bodies at once, in all (client requests, P's answers, D's
    /// non-streamed answers): a body that does not fit what is left gets a retryable 503
    /// (`Retry-After`) instead of memory. At least --max-upstream-body-bytes.
    #[arg(long, default_value_t = DEFAULT_MAX_BUFFERED_BODY_BYTES)]
    pub max_buffered_body_bytes: usize,
    /// Client connections open at once; more are closed at accept and counted in
    /// kvlease_proxy_http_connections_refused_total.
    #[arg(long, default_value_t = 256)]
    pub http_max_connections: usize,
    /// Client connections one address may hold at once, at most --http-max-connections;
    /// more are closed at accept and counted with the others. Default: seven eighths of
    /// --http-max-connections (at least 1). Behind a load balancer every client is its
    /// address: raise this to --http-max-connections there.
    #[arg(long)]
    pub http_max_connections_per_source: Option<usize>,
    /// A client request's headers must arrive within this, in milliseconds (from accept
    /// for a connection's first request), and an idle keep-alive connection is closed
    /// after it.
    #[arg(long, allow_negative_numbers = true, default_value_t = 10_000)]
    pub http_header_timeout_ms: u64,
    /// Log line format (the level comes from RUST_LOG, default info).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// How the KV cache moves from P to D. `pull`: P prefills first, then D gets P's
    /// returned kv_transfer_params verbatim and reads P's blocks. `push` (vLLM's push
    /// proxy's flow): both legs carry a transfer id the proxy makes; D's leg names P
    /// (remote_engine_id, remote_host, remote_port, tp_size, learned from P's earlier
    /// answers) and goes out at the same time as P's, once P's identity is known (the
    /// first request to a P waits for P's answer); P writes into the blocks D reserves.
    /// Every P and D behind the proxy must run the chosen mode.
    #[arg(long, value_enum, default_value_t = TransferMode::Pull)]
    pub transfer_mode: TransferMode,
}

/// `--transfer-mode`: how the KV cache moves from P to D.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum TransferMode {
    /// D reads P's blocks: P's leg first, then D's leg with P's kv_transfer_params.
    #[default]
    Pull,
    /// P writes into blocks D reserved: both legs at once, tied by a transfer id.
    Push,
}

/// Default of `--max-upstream-body-bytes`: 64 MiB.
const DEFAULT_MAX_UPSTREAM_BODY_BYTES: usize = 64 << 20;

/// Most `--max-upstream-body-bytes` accepts: 1 GiB.
const MAX_UPSTREAM_BODY_LIMIT: usize = 1 << 30;

/// Default of `--max-buffered-body-bytes`: 256 MiB.
const DEFAULT_MAX_BUFFERED_BODY_BYTES: usize = 256 << 20;

/// Most `--max-buffered-body-bytes` accepts: 64 GiB.
const MAX_BUFFERED_BODY_LIMIT: usize = 64 << 30;

/// A validated proxy configuration.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// P base URLs.
    pub prefill: Vec<Url>,
    /// D base URLs.
    pub decode: Vec<Url>,
    /// See [`ProxyArgs::timeout_secs`].
    pub timeout: Duration,
    /// See [`ProxyArgs::connect_timeout_ms`].
    pub connect_timeout: Duration,
    /// See [`ProxyArgs::upstream_idle_timeout_ms`].
    pub upstream_idle_timeout: Duration,
    /// See [`ProxyArgs::max_upstream_body_bytes`].
    pub max_upstream_body_bytes: usize,
    /// See [`ProxyArgs::max_buffered_body_bytes`].
    pub max_buffered_body_bytes: usize,
    /// The client listener's limits: [`ProxyArgs::http_max_connections`],
    /// [`ProxyArgs::http_max_connections_per_source`] and
    /// [`ProxyArgs::http_header_timeout_ms`]; the rest are [`HttpLimits`]' defaults.
    pub http: HttpLimits,
    /// See [`ProxyArgs::transfer_mode`].
    pub transfer_mode: TransferMode,
}

fn parse_upstreams(flag: &'static str, urls: &[String]) -> Result<Vec<Url>, ProxyError> {
    if urls.is_empty() {
        return Err(ProxyError::NoUpstream { flag });
    }
    urls.iter()
        .map(|raw| {
            let bad = |reason: &str| ProxyError::BadUrl {
                flag,
                url: raw.clone(),
                reason: reason.to_owned(),
            };
            let url = Url::parse(raw).map_err(|e| bad(&e.to_string()))?;
            if url.scheme() != "http" {
                return Err(bad("only http:// is supported"));
            }
            if url.host_str().is_none_or(str::is_empty) {
                return Err(bad("has no host"));
            }
            if url.query().is_some() || url.fragment().is_some() {
                return Err(bad("must be a base URL without query or fragment"));
            }
            Ok(url)
        })
        .collect()
}

impl ProxyArgs {
    /// Checks the flags and builds the configuration.
    ///
    /// # Errors
    /// [`ProxyError`] naming the flag: a URL that is not `http://host:port`, no URL, a
    /// timeout that is zero, not finite or over a day (over 10 minutes for the
    /// millisecond ones), a body limit that is zero or over 1 GiB, or a connection cap
    /// that is zero (or, per address, over the global one).
    pub fn config(&self) -> Result<ProxyConfig, ProxyError> {
        if self.port == 0 {
            return Err(ProxyError::BadTimeout {
                flag: "--port",
                reason: "must be 1..=65535".to_owned(),
            });
        }
        let timeout = Duration::try_from_secs_f64(self.timeout_secs)
            .ok()
            .filter(|t| !t.is_zero() && *t <= Duration::from_secs(86_400))
            .ok_or_else(|| ProxyError::BadTimeout {
                flag: "--timeout-secs",
                reason: format!(
                    "must be > 0 and at most 86400 seconds, got {}",
                    self.timeout_secs
                ),
            })?;
        if self.connect_timeout_ms == 0 || self.connect_timeout_ms > 600_000 {
            return Err(ProxyError::BadTimeout {
                flag: "--connect-timeout-ms",
                reason: format!("must be 1..=600000, got {}", self.connect_timeout_ms),
            });
        }
        if self.upstream_idle_timeout_ms == 0 || self.upstream_idle_timeout_ms > 600_000 {
            return Err(ProxyError::BadTimeout {
                flag: "--upstream-idle-timeout-ms",
                reason: format!("must be 1..=600000, got {}", self.upstream_idle_timeout_ms),
            });
        }
        if self.max_upstream_body_bytes == 0
            || self.max_upstream_body_bytes > MAX_UPSTREAM_BODY_LIMIT
        {
            return Err(ProxyError::BadTimeout {
                flag: "--max-upstream-body-bytes",
                reason: format!(
                    "must be 1..={MAX_UPSTREAM_BODY_LIMIT}, got {}",
                    self.max_upstream_body_bytes
                ),
            });
        }
        let floor = self.max_upstream_body_bytes.max(super::MAX_BODY_BYTES);
        if !(floor..=MAX_BUFFERED_BODY_LIMIT).contains(&self.max_buffered_body_bytes) {
            return Err(ProxyError::BadTimeout {
                flag: "--max-buffered-body-bytes",
                reason: format!(
                    "must be {floor}..={MAX_BUFFERED_BODY_LIMIT} (at least \
                     --max-upstream-body-bytes and the {} bytes of a client body), got {}",
                    super::MAX_BODY_BYTES,
                    self.max_buffered_body_bytes
                ),
            });
        }
        let http = self.http_limits()?;
        Ok(ProxyConfig {
            prefill: parse_upstreams("--prefill", &self.prefill)?,
            decode: parse_upstreams("--decode", &self.decode)?,
            timeout,
            connect_timeout: Duration::from_millis(self.connect_timeout_ms),
            upstream_idle_timeout: Duration::from_millis(self.upstream_idle_timeout_ms),
            max_upstream_body_bytes: self.max_upstream_body_bytes,
            max_buffered_body_bytes: self.max_buffered_body_bytes,
            http,
            transfer_mode: self.transfer_mode,
        })
    }

    fn http_limits(&self) -> Result<HttpLimits, ProxyError> {
        let bad = |flag, reason| Err(ProxyError::BadTimeout { flag, reason });
        let max = self.http_max_connections;
        if max == 0 {
            return bad("--http-max-connections", "must be at least 1".to_owned());
        }
        let per_source = self
            .http_max_connections_per_source
            .unwrap_or_else(|| default_per_source(max));
        if per_source == 0 || per_source > max {
            return bad(
                "--http-max-connections-per-source",
                format!("must be 1..=--http-max-connections ({max}), got {per_source}"),
            );
        }
        let header_ms = self.http_header_timeout_ms;
        if header_ms == 0 || header_ms > 600_000 {
            return bad(
                "--http-header-timeout-ms",
                format!("must be 1..=600000, got {header_ms}"),
            );
        }
        Ok(HttpLimits {
            max_connections: max,
            max_connections_per_source: per_source,
            header_timeout: Duration::from_millis(header_ms),
            ..HttpLimits::default()
        })
    }
}
