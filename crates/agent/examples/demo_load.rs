//! The client side of `scripts/demo.sh`: sends completion requests through `kvlease-proxy`
//! and checks every answer's `kv_digest` against the digest computed here from the prompt
//! alone (`kvlease_agent::kv::expected_digest`), and waits on agents' `/metrics`.
//!
//! ```text
//! demo_load load --url http://127.0.0.1:8080 --requests 100 --concurrency 4 --label warmup
//! demo_load wait-health --url http://127.0.0.1:8100
//! demo_load wait-metric --url http://127.0.0.1:8100 --name kvlease_blocks_held --at-most 0
//! demo_load metric --url http://127.0.0.1:8100 --name kvlease_leases_granted_total
//! ```
//!
//! Output is `key=value` lines on stdout (prefixed with `--label`); the exit status is
//! non-zero when a check fails.

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use clap::{Args, Parser, Subcommand};
use kvlease_agent::kv::{KvShape, expected_digest, tokenize};
use serde_json::{Value, json};
use tokio::sync::Mutex;

#[derive(Debug, Parser)]
#[command(
    name = "demo_load",
    about = "load generator and metric waiter for scripts/demo.sh"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Sends requests and checks the answers.
    Load(LoadArgs),
    /// Waits until `GET {url}/health` answers 200.
    WaitHealth {
        /// Base URL.
        #[arg(long)]
        url: String,
        /// Give up after this many seconds.
        #[arg(long, default_value_t = 60.0)]
        timeout_secs: f64,
    },
    /// Waits until a sample of `GET {url}/metrics` crosses a threshold; prints the wait.
    WaitMetric {
        /// Base URL.
        #[arg(long)]
        url: String,
        /// Sample name, labels included (`kvlease_leases_released_total{reason="expired"}`).
        #[arg(long)]
        name: String,
        /// Done when the value is at least this.
        #[arg(long, allow_negative_numbers = true)]
        at_least: Option<f64>,
        /// Done when the value is at most this.
        #[arg(long, allow_negative_numbers = true)]
        at_most: Option<f64>,
        /// Give up after this many seconds.
        #[arg(long, default_value_t = 60.0)]
        timeout_secs: f64,
        /// Prefix of the printed keys.
        #[arg(long, default_value = "wait")]
        label: String,
    },
    /// Prints samples of one `GET {url}/metrics`, one line each in the order named (0
    /// when absent).
    Metric {
        /// Base URL.
        #[arg(long)]
        url: String,
        /// Sample name, labels included; repeat it for several samples of one scrape.
        #[arg(long, required = true)]
        name: Vec<String>,
    },
}

#[derive(Debug, Clone, Args)]
struct LoadArgs {
    /// The proxy's base URL.
    #[arg(long)]
    url: String,
    /// Requests to send.
    #[arg(long, default_value_t = 100)]
    requests: u64,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 4)]
    concurrency: u64,
    /// Tokens to decode per request.
    #[arg(long, default_value_t = 8)]
    max_tokens: u32,
    /// Every n-th request streams (server-sent events); 0 = none.
    #[arg(long, default_value_t = 5)]
    stream_every: u64,
    /// Distinguishes the prompts of different runs.
    #[arg(long, default_value = "demo")]
    label: String,
    /// Count failed requests instead of failing the run (the kill phase).
    #[arg(long)]
    allow_failures: bool,
    /// Per-request time limit, seconds.
    #[arg(long, default_value_t = 60.0)]
    timeout_secs: f64,
    /// Sends `Authorization: Bearer <key>` (the agents' and the proxy's `--api-key`).
    #[arg(long, env = "KVLEASE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Appends one line per request to this file: `<start> <end> <outcome>`, the times in
    /// seconds since the Unix epoch; the outcome is `ok`, `digest_mismatch`, `bad_answer`
    /// or `failed <class> retryable=<true|false>` (the error body's `retryable`).
    #[arg(long)]
    timeline: Option<std::path::PathBuf>,
    /// Model shape the agents run with (must match their flags).
    #[arg(long, default_value_t = 2)]
    num_layers: u32,
    /// See `--num-layers`.
    #[arg(long, default_value_t = 8)]
    num_kv_heads: u32,
    /// See `--num-layers`.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// See `--num-layers`.
    #[arg(long, default_value_t = 64)]
    head_dim: u32,
}

#[derive(Debug, Default)]
struct Tally {
    ok: u64,
    failed: u64,
    digest_mismatch: u64,
    bad_answer: u64,
    streamed: u64,
    bytes: u64,
    max_queue_ms: f64,
    latencies_ms: Vec<f64>,
    failures: std::collections::BTreeMap<String, u64>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("demo_load: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli.command)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("demo_load: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn client(timeout: Duration) -> Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .no_proxy()
        .connect_timeout(Duration::from_secs(3))
        // Below the agents' and the proxy's 10 s idle keep-alive limit: a pooled connection
        // the server is closing must not be picked for a request.
        .pool_idle_timeout(Duration::from_secs(4))
        .timeout(timeout)
        .build()?)
}

async fn run(command: Command) -> Result<bool> {
    match command {
        Command::Load(args) => load(args).await,
        Command::WaitHealth { url, timeout_secs } => {
            let http = client(Duration::from_secs(2))?;
            let deadline = Instant::now() + Duration::from_secs_f64(timeout_secs);
            loop {
                if let Ok(r) = http.get(format!("{url}/health")).send().await
                    && r.status().is_success()
                {
                    return Ok(true);
                }
                if Instant::now() > deadline {
                    bail!("{url}/health did not answer 200 within {timeout_secs} s");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Command::WaitMetric {
            url,
            name,
            at_least,
            at_most,
            timeout_secs,
            label,
        } => {
            let http = client(Duration::from_secs(2))?;
            let start = Instant::now();
            let deadline = start + Duration::from_secs_f64(timeout_secs);
            loop {
                let value = scrape(&http, &url, &name).await.ok();
                if let Some(v) = value
                    && at_least.is_none_or(|min| v >= min)
                    && at_most.is_none_or(|max| v <= max)
                {
                    println!("{label}.waited_s={:.3}", start.elapsed().as_secs_f64());
                    println!("{label}.value={v}");
                    return Ok(true);
                }
                if Instant::now() > deadline {
                    println!("{label}.waited_s=timeout");
                    println!(
                        "{label}.value={}",
                        value.map_or_else(|| "unreadable".to_owned(), |v| v.to_string())
                    );
                    return Ok(false);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Command::Metric { url, name } => {
            let http = client(Duration::from_secs(5))?;
            let text = metrics_text(&http, &url).await?;
            for n in &name {
                println!("{}", sample(&text, n));
            }
            Ok(true)
        }
    }
}

/// The value of sample `name` on `{url}/metrics`; 0 when the agent does not expose it.
async fn scrape(http: &reqwest::Client, url: &str, name: &str) -> Result<f64> {
    Ok(sample(&metrics_text(http, url).await?, name))
}

/// `GET {url}/metrics`.
async fn metrics_text(http: &reqwest::Client, url: &str) -> Result<String> {
    Ok(http
        .get(format!("{url}/metrics"))
        .send()
        .await?
        .error_for_status()?
        .text()
        .await?)
}

/// The value of sample `name` in an exposition; 0 when absent.
fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Prompt `i` of a run: 24 to ~600 bytes (= tokens), different for every request.
fn prompt(label: &str, i: u64) -> String {
    let mut p = format!("kvlease demo {label} request {i}: ");
    let filler = "the quick brown fox jumps over the lazy dog; ";
    let repeats = (i * 7919) % 13;
    for _ in 0..repeats {
        p.push_str(filler);
    }
    p
}

async fn load(args: LoadArgs) -> Result<bool> {
    let shape = KvShape {
        num_layers: args.num_layers,
        num_kv_heads: args.num_kv_heads,
        block_size: args.block_size,
        head_dim: args.head_dim,
    };
    let http = client(Duration::from_secs_f64(args.timeout_secs))?;
    let timeline = match &args.timeline {
        Some(path) => Some(Arc::new(std::sync::Mutex::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .with_context(|| format!("opening {}", path.display()))?,
        ))),
        None => None,
    };
    let next = Arc::new(AtomicU64::new(0));
    let tally = Arc::new(Mutex::new(Tally::default()));
    let start = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..args.concurrency.max(1) {
        let (http, next, tally, args) = (http.clone(), next.clone(), tally.clone(), args.clone());
        let timeline = timeline.clone();
        workers.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= args.requests {
                    break;
                }
                let stream =
                    args.stream_every > 0 && i % args.stream_every == args.stream_every - 1;
                let text = prompt(&args.label, i);
                let expected = expected_digest(&shape, &tokenize(&text)).to_string();
                let began = Instant::now();
                let began_unix = unix_now();
                let result = one(&http, &args, &text, stream).await;
                let elapsed_ms = began.elapsed().as_secs_f64() * 1e3;
                if let Some(file) = &timeline {
                    let outcome = match &result {
                        Ok(a) if a.digest != expected => "digest_mismatch".to_owned(),
                        Ok(a) if a.completion_tokens != u64::from(args.max_tokens) => {
                            "bad_answer".to_owned()
                        }
                        Ok(_) => "ok".to_owned(),
                        Err(e) => format!(
                            "failed {} retryable={}",
                            short(e),
                            format!("{e:#}").contains("\"retryable\":true")
                        ),
                    };
                    let line = format!("{began_unix:.3} {:.3} {outcome}\n", unix_now());
                    if let Ok(mut f) = file.lock() {
                        // A lost timeline line shows as a count mismatch in the caller.
                        let _ = std::io::Write::write_all(&mut *f, line.as_bytes());
                    }
                }
                let mut t = tally.lock().await;
                match result {
                    Ok(answer) => {
                        t.latencies_ms.push(elapsed_ms);
                        t.streamed += u64::from(stream);
                        t.bytes += answer.bytes;
                        t.max_queue_ms = t.max_queue_ms.max(answer.queue_ms);
                        if answer.digest != expected {
                            t.digest_mismatch += 1;
                            eprintln!(
                                "request {i}: kv_digest {} != expected {expected}",
                                answer.digest
                            );
                        } else if answer.completion_tokens != u64::from(args.max_tokens) {
                            t.bad_answer += 1;
                            eprintln!(
                                "request {i}: {} completion tokens, asked {}",
                                answer.completion_tokens, args.max_tokens
                            );
                        } else {
                            t.ok += 1;
                        }
                    }
                    Err(e) => {
                        t.failed += 1;
                        *t.failures.entry(short(&e)).or_default() += 1;
                        if !args.allow_failures {
                            eprintln!("request {i}: {e:#}");
                        }
                    }
                }
            }
        }));
    }
    for w in workers {
        w.await.context("worker panicked")?;
    }
    let wall = start.elapsed().as_secs_f64();
    let t = tally.lock().await;
    Ok(report(&args, &t, wall))
}

/// Prints the run's counts and latencies as `label.key=value` lines; returns whether the
/// run was clean (no wrong answer, and no failure unless failures are allowed).
fn report(args: &LoadArgs, t: &Tally, wall: f64) -> bool {
    let mut lat = t.latencies_ms.clone();
    lat.sort_by(f64::total_cmp);
    let pct = |q: f64| -> f64 {
        if lat.is_empty() {
            return 0.0;
        }
        let idx = ((lat.len() as f64 - 1.0) * q).round() as usize;
        lat[idx.min(lat.len() - 1)]
    };
    let l = &args.label;
    println!("{l}.sent={}", args.requests);
    println!("{l}.ok={}", t.ok);
    println!("{l}.failed={}", t.failed);
    for (why, n) in &t.failures {
        println!("{l}.failed.{why}={n}");
    }
    println!("{l}.digest_mismatch={}", t.digest_mismatch);
    println!("{l}.bad_answer={}", t.bad_answer);
    println!("{l}.streamed={}", t.streamed);
    println!("{l}.bytes={}", t.bytes);
    println!("{l}.max_queue_ms={:.1}", t.max_queue_ms);
    println!("{l}.wall_s={wall:.3}");
    println!("{l}.req_per_s={:.1}", t.ok as f64 / wall.max(1e-9));
    println!("{l}.p50_ms={:.1}", pct(0.5));
    println!("{l}.p99_ms={:.1}", pct(0.99));
    let clean = t.digest_mismatch == 0 && t.bad_answer == 0;
    clean && (args.allow_failures || t.failed == 0)
}

/// Seconds since the Unix epoch (the timeline's clock, comparable with `date +%s.%N`).
fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A failure's class, for the `failed.<class>` keys.
fn short(e: &anyhow::Error) -> String {
    let text = format!("{e:#}");
    if let Some(status) = text.strip_prefix("HTTP ") {
        let code: String = status.chars().take(3).collect();
        let kind = text
            .split("type=")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .unwrap_or("");
        return if kind.is_empty() {
            format!("http_{code}")
        } else {
            format!("http_{code}_{kind}")
        };
    }
    "transport".to_owned()
}

struct Answer {
    digest: String,
    completion_tokens: u64,
    bytes: u64,
    /// D's arrival-to-scheduling time for the request.
    queue_ms: f64,
}

async fn one(
    http: &reqwest::Client,
    args: &LoadArgs,
    prompt: &str,
    stream: bool,
) -> Result<Answer> {
    let body = json!({
        "model": "kvlease-demo",
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "stream": stream,
    });
    let mut request = http
        .post(format!("{}/v1/completions", args.url))
        .json(&body);
    if let Some(key) = &args.api_key {
        request = request.bearer_auth(key);
    }
    let response = request.send().await?;
    let status = response.status();
    if !status.is_success() {
        let text = response.text().await.unwrap_or_default();
        let kind = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v["error"]["type"].as_str().map(str::to_owned))
            .unwrap_or_default();
        bail!("HTTP {} type={kind} {text}", status.as_u16());
    }
    if !stream {
        let v: Value = response.json().await?;
        return Ok(Answer {
            digest: v["kv_digest"].as_str().unwrap_or("").to_owned(),
            completion_tokens: v["usage"]["completion_tokens"].as_u64().unwrap_or(0),
            bytes: v["kv_transfer_stats"]["bytes"].as_u64().unwrap_or(0),
            queue_ms: v["kv_transfer_stats"]["queue_time_ms"]
                .as_f64()
                .unwrap_or(0.0),
        });
    }
    // Server-sent events: `data: {chunk}` lines, the last chunk carrying usage and the
    // digest, then `data: [DONE]`.
    let text = response.text().await?;
    let mut answer = Answer {
        digest: String::new(),
        completion_tokens: 0,
        bytes: 0,
        queue_ms: 0.0,
    };
    let mut done = false;
    let mut text_tokens = 0u64;
    for line in text.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let chunk: Value =
            serde_json::from_str(data).with_context(|| format!("bad SSE chunk {data}"))?;
        // A request that failed after the stream began (its KV load failed) ends with an
        // error chunk: a failed request, not a wrong answer.
        if let Some(error) = chunk.get("error") {
            let kind = error["type"].as_str().unwrap_or_default();
            bail!("stream ended in an error type={kind} {error}");
        }
        text_tokens += chunk["choices"][0]["text"]
            .as_str()
            .map_or(0, |s| s.len() as u64);
        if let Some(d) = chunk["kv_digest"].as_str() {
            answer.digest = d.to_owned();
        }
        if let Some(n) = chunk["usage"]["completion_tokens"].as_u64() {
            answer.completion_tokens = n;
        }
        if let Some(b) = chunk["kv_transfer_stats"]["bytes"].as_u64() {
            answer.bytes = b;
        }
        if let Some(q) = chunk["kv_transfer_stats"]["queue_time_ms"].as_f64() {
            answer.queue_ms = q;
        }
    }
    if !done {
        bail!("stream ended without data: [DONE]");
    }
    if text_tokens != answer.completion_tokens {
        bail!(
            "stream carried {text_tokens} tokens of text, usage says {}",
            answer.completion_tokens
        );
    }
    Ok(answer)
}
