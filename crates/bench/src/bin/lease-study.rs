//! The lease-versus-fixed-timeout study: real `prefill-agent`, `decode-agent` and
//! `kvlease-proxy` processes on localhost over TCP, driven by `demo_load`, with P's
//! `/metrics` sampled every 100 ms (D's in the push scenario). Writes `report.json` and
//! PNG plots into `--out` and prints `key=value` lines. Run it through
//! `scripts/bench/lease-study.sh`.
//!
//! ```text
//! lease-study --bin DIR --out DIR --font TTF [--quick] [--only crash,overload,heartbeat,push]
//!             [--transfer NAME=FILE]...
//! ```
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvlease_bench::{
    Sample, Series, admit_rate, http_get, mean_rate, parse_metric, plot_lines, reclaim_time,
    recovery_time, step_area, zero_after,
};
use kvlease_lease::{EngineId, HeartbeatTracker, LeaseConfig, LeaseTable, RequestId, Timestamp};
use serde_json::{Value, json};

struct Args {
    quick: bool,
    bin: PathBuf,
    out: PathBuf,
    font: PathBuf,
    transfer: Vec<(String, PathBuf)>,
    /// Scenarios to run (`--only crash,overload,heartbeat,push`); empty: all.
    only: Vec<String>,
}

/// The scenarios `--only` picks from.
const SCENARIOS: [&str; 4] = ["crash", "overload", "heartbeat", "push"];

fn parse_args() -> anyhow::Result<Args> {
    let mut a = Args {
        quick: false,
        bin: PathBuf::from("target/release"),
        out: PathBuf::from("results/lease-study"),
        font: PathBuf::from("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"),
        transfer: Vec::new(),
        only: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--quick" => a.quick = true,
            "--only" => {
                let v = it.next().context("--only SCENARIO[,SCENARIO]...")?;
                for s in v.split(',') {
                    if !SCENARIOS.contains(&s) {
                        bail!("--only: unknown scenario {s:?} (one of {SCENARIOS:?})");
                    }
                    a.only.push(s.to_owned());
                }
            }
            "--bin" => a.bin = it.next().context("--bin DIR")?.into(),
            "--out" => a.out = it.next().context("--out DIR")?.into(),
            "--font" => a.font = it.next().context("--font TTF")?.into(),
            "--transfer" => {
                let v = it.next().context("--transfer NAME=FILE")?;
                let (n, f) = v.split_once('=').context("--transfer NAME=FILE")?;
                a.transfer.push((n.to_owned(), f.into()));
            }
            other => bail!("unknown argument {other:?}; see the header of lease-study.rs"),
        }
    }
    Ok(a)
}

/// Progress on stderr: elapsed and (estimated) remaining seconds of the whole study.
struct Progress {
    start: Instant,
    total_s: f64,
}

impl Progress {
    fn say(&self, what: &str) {
        let e = self.start.elapsed().as_secs_f64();
        eprintln!(
            "[lease-study {e:6.1}s elapsed, ~{:5.0}s remaining] {what}",
            (self.total_s - e).max(0.0)
        );
    }
}

/// A child process killed (SIGKILL) and reaped on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

fn wait_health(port: u16, logs: &Path) -> anyhow::Result<()> {
    let until = Instant::now() + Duration::from_secs(30);
    while Instant::now() < until {
        if http_get(addr(port), "/health", Duration::from_secs(1)).is_ok() {
            return Ok(());
        }
        thread::sleep(Duration::from_millis(50));
    }
    bail!(
        "port {port} did not come up in 30 s; see the logs in {}",
        logs.display()
    )
}

fn scrape(port: u16) -> anyhow::Result<String> {
    http_get(addr(port), "/metrics", Duration::from_secs(2))
}

fn metric(text: &str, name: &str) -> f64 {
    parse_metric(text, name).unwrap_or(0.0)
}

/// The flags P and D share: localhost, TCP, host memory.
const AGENT_ARGS: [&str; 6] = [
    "--host",
    "127.0.0.1",
    "--transport",
    "tcp",
    "--memory",
    "host",
];

const EXPIRED: &str = "kvlease_leases_released_total{reason=\"expired\"}";

/// The lease settings of one side-by-side arm.
#[derive(Clone, Copy)]
struct Mode {
    name: &'static str,
    lease_s: f64,
    /// `abort_request_timeout` for `fixed`.
    fixed_s: f64,
    /// Push mode (`--transfer-mode push` on P, D and the proxy): D reserves blocks and P
    /// writes into them; with `fixed`, D holds each reservation for `fixed_s`.
    push: bool,
}

impl Mode {
    /// `--transfer-mode push` in push mode, nothing (pull, the default) otherwise.
    fn transfer_mode(&self) -> &'static [&'static str] {
        if self.push {
            &["--transfer-mode", "push"]
        } else {
            &[]
        }
    }

    fn kv_config(&self, role: &str) -> String {
        json!({
            "kv_connector": "kvlease",
            "kv_role": role,
            "kv_connector_extra_config": {
                "kv_lease_duration": self.lease_s,
                "lease_mode": self.name,
                "abort_request_timeout": self.fixed_s,
            }
        })
        .to_string()
    }
}

/// P, D and the proxy of one arm, logs under `dir`.
struct Cluster {
    bin: PathBuf,
    dir: PathBuf,
    mode: Mode,
    p_port: u16,
    d_port: u16,
    d_side: u16,
    x_port: u16,
    d_args: Vec<String>,
    p: Option<Proc>,
    d: Option<Proc>,
    _x: Proc,
    d_gen: u32,
}

fn log_file(dir: &Path, name: &str) -> anyhow::Result<std::fs::File> {
    Ok(std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(name))?)
}

impl Cluster {
    fn start(
        bin: &Path,
        dir: &Path,
        mode: Mode,
        p_args: &[&str],
        d_args: &[&str],
    ) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let (p_port, p_side, d_port, d_side, x_port) = (
            free_port()?,
            free_port()?,
            free_port()?,
            free_port()?,
            free_port()?,
        );
        let p = Command::new(bin.join("prefill-agent"))
            .args(AGENT_ARGS)
            .args([
                "--port",
                &p_port.to_string(),
                "--side-channel-port",
                &p_side.to_string(),
            ])
            .args([
                "--engine-id",
                "study-p0",
                "--kv-transfer-config",
                &mode.kv_config("kv_producer"),
            ])
            .args(mode.transfer_mode())
            .args(p_args)
            .stdout(log_file(dir, "prefill.log")?)
            .stderr(log_file(dir, "prefill.log")?)
            .spawn()
            .context("spawn prefill-agent (build it: cargo build --release -p kvlease-agent)")?;
        let p = Proc(p);
        let x = Command::new(bin.join("kvlease-proxy"))
            .args(mode.transfer_mode())
            .args(["--host", "127.0.0.1", "--port", &x_port.to_string()])
            .args(["--prefill", &format!("http://127.0.0.1:{p_port}")])
            .args(["--decode", &format!("http://127.0.0.1:{d_port}")])
            .args(["--timeout-secs", "120"])
            .stdout(log_file(dir, "proxy.log")?)
            .stderr(log_file(dir, "proxy.log")?)
            .spawn()
            .context("spawn kvlease-proxy")?;
        let mut c = Self {
            bin: bin.to_owned(),
            dir: dir.to_owned(),
            mode,
            p_port,
            d_port,
            d_side,
            x_port,
            d_args: d_args.iter().map(|s| s.to_string()).collect(),
            p: Some(p),
            d: None,
            _x: Proc(x),
            d_gen: 0,
        };
        c.start_d()?;
        for port in [p_port, d_port, x_port] {
            wait_health(port, dir)?;
        }
        Ok(c)
    }

    fn start_d(&mut self) -> anyhow::Result<()> {
        let d = Command::new(self.bin.join("decode-agent"))
            .args(AGENT_ARGS)
            .args([
                "--port",
                &self.d_port.to_string(),
                "--side-channel-port",
                &self.d_side.to_string(),
            ])
            .args(["--engine-id", &format!("study-d{}", self.d_gen)])
            .args(["--kv-transfer-config", &self.mode.kv_config("kv_consumer")])
            .args(self.mode.transfer_mode())
            .args(&self.d_args)
            .stdout(log_file(&self.dir, "decode.log")?)
            .stderr(log_file(&self.dir, "decode.log")?)
            .spawn()
            .context("spawn decode-agent")?;
        self.d_gen += 1;
        self.d = Some(Proc(d));
        Ok(())
    }

    /// `demo_load load` against the proxy; stdout to `out`.
    fn load(
        &self,
        label: &str,
        requests: u64,
        conc: u64,
        max_tokens: u64,
        out: &str,
    ) -> anyhow::Result<Proc> {
        let c = Command::new(self.bin.join("examples/demo_load"))
            .args([
                "load",
                "--url",
                &format!("http://127.0.0.1:{}", self.x_port),
            ])
            .args(["--label", label, "--requests", &requests.to_string()])
            .args([
                "--concurrency",
                &conc.to_string(),
                "--max-tokens",
                &max_tokens.to_string(),
            ])
            .args([
                "--stream-every",
                "0",
                "--allow-failures",
                "--timeout-secs",
                "120",
            ])
            .stdout(log_file(&self.dir, out)?)
            .stderr(log_file(&self.dir, "load.err")?)
            .spawn()
            .context(
                "spawn demo_load (cargo build --release -p kvlease-agent --example demo_load)",
            )?;
        Ok(Proc(c))
    }
}

/// P's metrics as the crash scenario samples them.
fn p_sample(t: f64, text: &str) -> Sample {
    Sample {
        t,
        held: metric(text, "kvlease_blocks_held"),
        leases: metric(text, "kvlease_leases_active"),
        granted: metric(text, "kvlease_leases_granted_total"),
        expired: metric(text, EXPIRED),
    }
}

/// Samples one agent's metrics every 100 ms (`read` turns a scrape at `t` seconds into a
/// sample) until finished.
struct Sampler<T> {
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Vec<T>>>,
    handle: Option<thread::JoinHandle<()>>,
}

impl<T: Clone + Send + 'static> Sampler<T> {
    fn start(port: u16, t0: Instant, read: fn(f64, &str) -> T) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let samples = Arc::new(Mutex::new(Vec::new()));
        let (s2, v2) = (stop.clone(), samples.clone());
        let handle = thread::spawn(move || {
            while !s2.load(Ordering::Relaxed) {
                let next = Instant::now() + Duration::from_millis(100);
                if let Ok(text) = scrape(port) {
                    let s = read(t0.elapsed().as_secs_f64(), &text);
                    if let Ok(mut v) = v2.lock() {
                        v.push(s);
                    }
                }
                thread::sleep(next.saturating_duration_since(Instant::now()));
            }
        });
        Self {
            stop,
            samples,
            handle: Some(handle),
        }
    }

    fn finish(mut self) -> Vec<T> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
        self.samples.lock().map(|v| v.clone()).unwrap_or_default()
    }
}

struct CrashResult {
    json: Value,
    held: Vec<(f64, f64)>,
    rate: Vec<(f64, f64)>,
}

/// Scenario 1: steady load, `kill -9` of D, D restarted 1 s later, load kept on.
fn crash(
    a: &Args,
    mode: Mode,
    warm_s: f64,
    post_s: f64,
    prog: &Progress,
) -> anyhow::Result<CrashResult> {
    prog.say(&format!("crash/{}: start P, D, proxy", mode.name));
    let dir = a.out.join(format!("logs/crash-{}", mode.name));
    let mut c = Cluster::start(
        &a.bin,
        &dir,
        mode,
        &["--num-blocks", "160", "--pool-wait-ms", "300"],
        &[
            "--max-running",
            "2",
            "--step-ms",
            "10",
            "--max-waiting",
            "64",
        ],
    )?;
    let t0 = Instant::now();
    let sampler = Sampler::start(c.p_port, t0, p_sample);
    let load = c.load(
        &format!("crash-{}", mode.name),
        1_000_000,
        8,
        32,
        "load.out",
    )?;
    thread::sleep(Duration::from_secs_f64(warm_s));
    let before = scrape(c.p_port)?;
    let orphans = metric(&before, "kvlease_leases_active");
    let held_at_kill = metric(&before, "kvlease_blocks_held");
    if let Some(mut d) = c.d.take() {
        d.0.kill().context("kill -9 D")?;
        let _ = d.0.wait();
    }
    let kill_t = t0.elapsed().as_secs_f64();
    prog.say(&format!(
        "crash/{}: killed D with {orphans} leases ({held_at_kill} blocks) outstanding; restart in 1 s, watch {post_s:.0} s",
        mode.name
    ));
    thread::sleep(Duration::from_secs(1));
    c.start_d()?;
    let until = Instant::now() + Duration::from_secs_f64(post_s);
    while Instant::now() < until {
        thread::sleep(Duration::from_secs(5).min(until.saturating_duration_since(Instant::now())));
        prog.say(&format!(
            "crash/{}: {:.0} s after the kill",
            mode.name,
            t0.elapsed().as_secs_f64() - kill_t
        ));
    }
    let samples = sampler.finish();
    drop(load);
    let after = scrape(c.p_port)?;
    let r_sum = metric(&after, "kvlease_lease_reclaim_seconds_sum");
    let r_cnt = metric(&after, "kvlease_lease_reclaim_seconds_count");
    drop(c);

    let baseline = mean_rate(&samples, 1.0, kill_t).unwrap_or(0.0);
    let reclaim = reclaim_time(&samples, kill_t, orphans);
    let recovery = recovery_time(&samples, kill_t, baseline, 0.8, 1.0);
    let min_rate = admit_rate(&samples)
        .iter()
        .filter(|(t, _)| *t > kill_t + 1.5)
        .map(|&(_, r)| r)
        .fold(f64::INFINITY, f64::min);
    let json = json!({
        "lease_mode": mode.name,
        "kv_lease_duration_s": mode.lease_s,
        "abort_request_timeout_s": mode.fixed_s,
        "kill_t_s": kill_t,
        "leases_at_kill": orphans,
        "blocks_held_at_kill": held_at_kill,
        "reclaim_s": reclaim,
        "reclaim_mean_s_after_last_heartbeat": if r_cnt > 0.0 { Some(r_sum / r_cnt) } else { None },
        "admit_rate_before_per_s": baseline,
        "admit_recovery_s": recovery,
        "admit_rate_min_after_restart_per_s": if min_rate.is_finite() { Some(min_rate) } else { None },
        "samples": samples.iter().map(|s| json!([s.t, s.held, s.leases, s.granted, s.expired])).collect::<Vec<_>>(),
    });
    let shift = |v: Vec<(f64, f64)>| v.into_iter().map(|(t, y)| (t - kill_t, y)).collect();
    Ok(CrashResult {
        json,
        held: shift(samples.iter().map(|s| (s.t, s.held)).collect()),
        rate: shift(admit_rate(&samples)),
    })
}

/// D's push metrics at `t` seconds: (t, blocks held, reservations active, reservations
/// made, reservations expired).
#[derive(Clone, Copy)]
struct PushSample {
    t: f64,
    held: f64,
    reservations: f64,
    made: f64,
    expired: f64,
}

const RES_EXPIRED: &str = "kvlease_push_reservations_ended_total{outcome=\"expired\"}";

fn d_push_sample(t: f64, text: &str) -> PushSample {
    PushSample {
        t,
        held: metric(text, "kvlease_blocks_held"),
        reservations: metric(text, "kvlease_push_reservations_active"),
        made: metric(text, "kvlease_push_reservations_total"),
        expired: metric(text, RES_EXPIRED),
    }
}

/// Scenario 4: push mode (P, D and the proxy with `--transfer-mode push`) under a steady
/// load, then `kill -9` of P while D holds reservations waiting for P's writes; D's
/// blocks held are sampled until they are back to 0 (and 2 s more), at most `post_s`.
/// P is not restarted: what is measured is what the dead P's reservations cost D.
fn push_crash(
    a: &Args,
    mode: Mode,
    warm_s: f64,
    post_s: f64,
    prog: &Progress,
) -> anyhow::Result<CrashResult> {
    prog.say(&format!(
        "push/{}: start P, D, proxy (push mode)",
        mode.name
    ));
    let dir = a.out.join(format!("logs/push-{}", mode.name));
    let mut c = Cluster::start(
        &a.bin,
        &dir,
        mode,
        // 0.3 ms per prompt token: prefills of 7-180 ms, one at a time, so that most of
        // the 8 requests in flight wait on P with their blocks reserved on D.
        &["--prefill-us-per-token", "300"],
        &[
            "--max-running",
            "8",
            "--step-ms",
            "10",
            "--max-waiting",
            "64",
        ],
    )?;
    let t0 = Instant::now();
    let sampler = Sampler::start(c.d_port, t0, d_push_sample);
    let load = c.load(&format!("push-{}", mode.name), 1_000_000, 8, 4, "load.out")?;
    thread::sleep(Duration::from_secs_f64(warm_s));
    let before = scrape(c.d_port)?;
    let at_kill = d_push_sample(0.0, &before);
    if let Some(mut p) = c.p.take() {
        p.0.kill().context("kill -9 P")?;
        let _ = p.0.wait();
    }
    let kill_t = t0.elapsed().as_secs_f64();
    prog.say(&format!(
        "push/{}: killed P with {} reservations ({} blocks held on D) outstanding; watch up to {post_s:.0} s",
        mode.name, at_kill.reservations, at_kill.held
    ));
    let until = Instant::now() + Duration::from_secs_f64(post_s);
    let mut zero_since: Option<Instant> = None;
    let mut said = Instant::now();
    while Instant::now() < until {
        thread::sleep(Duration::from_millis(100));
        let now = scrape(c.d_port).map(|t| d_push_sample(0.0, &t));
        if now.is_ok_and(|s| s.held <= 0.0 && s.reservations <= 0.0) {
            let since = *zero_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= Duration::from_secs(2) {
                break;
            }
        } else {
            zero_since = None;
        }
        if said.elapsed() >= Duration::from_secs(5) {
            said = Instant::now();
            prog.say(&format!(
                "push/{}: {:.0} s after the kill",
                mode.name,
                t0.elapsed().as_secs_f64() - kill_t
            ));
        }
    }
    let samples = sampler.finish();
    drop(load);
    let held: Vec<(f64, f64)> = samples.iter().map(|s| (s.t, s.held)).collect();
    let reclaim = zero_after(&held, kill_t);
    let end = reclaim.map_or_else(|| samples.last().map_or(kill_t, |s| s.t), |r| kill_t + r);
    let block_s = step_area(&held, kill_t, end);
    let last = samples.last().copied().unwrap_or(at_kill);
    let expired_before = samples
        .iter()
        .rev()
        .find(|s| s.t <= kill_t)
        .map_or(0.0, |s| s.expired);
    let json = json!({
        "lease_mode": mode.name,
        "transfer_mode": "push",
        "kv_lease_duration_s": mode.lease_s,
        "abort_request_timeout_s": mode.fixed_s,
        "reservation_hold_s": if mode.name == "fixed" { mode.fixed_s } else { mode.lease_s },
        "kill_t_s": kill_t,
        "reservations_at_kill": at_kill.reservations,
        "blocks_held_at_kill": at_kill.held,
        "reservations_made_before_kill": at_kill.made,
        "reservations_expired_before_kill": expired_before,
        "reservations_expired_after_kill": last.expired - expired_before,
        "reclaim_s": reclaim,
        "dead_block_s": block_s,
        "samples": samples.iter().map(|s| json!([s.t, s.held, s.reservations, s.made, s.expired])).collect::<Vec<_>>(),
        "sample_columns": ["t_s", "kvlease_blocks_held", "kvlease_push_reservations_active", "kvlease_push_reservations_total", RES_EXPIRED],
    });
    Ok(CrashResult {
        json,
        held: held.into_iter().map(|(t, y)| (t - kill_t, y)).collect(),
        rate: Vec::new(),
    })
}

/// Reads `key=value` lines of a `demo_load` output file.
fn kv_file(path: &Path) -> Vec<(String, String)> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            l.split_once('=')
                .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        })
        .collect()
}

/// Scenario 2: per wait multiple, a blocker request holds D (`--max-running 1`) for the
/// wait, and 4 probe requests queue behind it with their KV leased on P.
fn overload(
    a: &Args,
    mode: Mode,
    multiples: &[f64],
    prog: &Progress,
) -> anyhow::Result<Vec<Value>> {
    prog.say(&format!("overload/{}: start P, D, proxy", mode.name));
    let dir = a.out.join(format!("logs/overload-{}", mode.name));
    let c = Cluster::start(
        &a.bin,
        &dir,
        mode,
        &[],
        &[
            "--max-running",
            "1",
            "--step-ms",
            "10",
            "--max-waiting",
            "64",
        ],
    )?;
    let mut out = Vec::new();
    let d_wasted = |t: &str| {
        ["kv_load_failed", "recomputed", "failed"]
            .iter()
            .map(|o| metric(t, &format!("kvlease_requests_total{{outcome=\"{o}\"}}")))
            .sum::<f64>()
    };
    for (i, &m) in multiples.iter().enumerate() {
        let wait_s = m * mode.lease_s;
        prog.say(&format!(
            "overload/{}: queue wait {m}x the lease ({wait_s:.1} s)",
            mode.name
        ));
        let (p0, d0) = (scrape(c.p_port)?, scrape(c.d_port)?);
        let tokens = ((wait_s / 0.010).round() as u64).max(1);
        let mut blocker = c.load(
            &format!("blk{i}-{}", mode.name),
            1,
            1,
            tokens,
            &format!("blocker{i}.out"),
        )?;
        thread::sleep(Duration::from_millis(300));
        let probe_out = format!("probe{i}.out");
        let mut probe = c.load(&format!("prb{i}-{}", mode.name), 4, 4, 1, &probe_out)?;
        probe.0.wait()?;
        blocker.0.wait()?;
        thread::sleep(Duration::from_millis(200));
        let (p1, d1) = (scrape(c.p_port)?, scrape(c.d_port)?);
        let kv = kv_file(&dir.join(&probe_out));
        let get = |k: &str| {
            kv.iter()
                .find(|(kk, _)| kk.ends_with(k))
                .and_then(|(_, v)| v.parse::<f64>().ok())
        };
        out.push(json!({
            "wait_multiple": m,
            "target_wait_s": wait_s,
            "probe_max_queue_ms": get(".max_queue_ms"),
            "probe_ok": get(".ok"),
            "probe_failed": get(".failed"),
            "expired_leases": metric(&p1, EXPIRED) - metric(&p0, EXPIRED),
            "wasted_prefills": d_wasted(&d1) - d_wasted(&d0),
            "prefills": metric(&p1, "kvlease_leases_granted_total") - metric(&p0, "kvlease_leases_granted_total"),
        }));
    }
    Ok(out)
}

fn thread_cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Scenario 3: heartbeat cost of 10^5 tracked requests over 8 P engines with TP 4, on the
/// real sans-IO state machines (`HeartbeatTracker` on D, `LeaseTable` on one P worker) and
/// the real `HB:` encoding, over `sim_s` simulated seconds of 10 ms steps.
fn heartbeat_cost(sim_s: u64) -> anyhow::Result<Value> {
    const N: usize = 100_000;
    const ENGINES: usize = 8;
    const TP: u32 = 4;
    let cfg = LeaseConfig::default();
    let engines: Vec<EngineId> = (0..ENGINES)
        .map(|e| EngineId::new(&format!("prefill-{e}")))
        .collect::<Result<_, _>>()?;
    let ids: Vec<RequestId> = (0..N as u64)
        .map(|i| {
            RequestId::new(&format!(
                "cmpl-{:016x}{:016x}-0",
                i.wrapping_mul(0x9e37_79b9_7f4a_7c15),
                i
            ))
        })
        .collect::<Result<_, _>>()?;
    let mut tracker = HeartbeatTracker::new(&cfg);
    // One worker of engine 0 holds a lease for each of that engine's requests.
    let mut table = LeaseTable::new(cfg);
    for (i, id) in ids.iter().enumerate() {
        let at = Timestamp::from_millis((i % ENGINES) as u64 * 600);
        tracker.track(at, id.clone(), engines[i % ENGINES].clone(), TP)?;
        if i % ENGINES == 0 {
            table.grant(
                Timestamp::ZERO,
                id.clone(),
                vec![kvlease_lease::BlockId(i as u32)],
                1,
            )?;
        }
    }
    let step_ms = 10u64;
    let steps = sim_s * 1000 / step_ms;
    let (mut d_ns, mut p_ns, mut msgs, mut bytes, mut ids_sent, mut p_msgs) =
        (0u64, 0u64, 0u64, 0u64, 0u64, 0u64);
    for step in 0..steps {
        let now = Timestamp::from_millis(step * step_ms);
        let c0 = thread_cpu_ns();
        let mut wire = Vec::new();
        while let Some(b) = tracker.poll_heartbeat(now) {
            let m = kvlease_notif::encode_heartbeats(&b.requests, kvlease_notif::MAX_NOTIF_LEN)?;
            ids_sent += b.requests.len() as u64 * u64::from(b.workers);
            for msg in &m {
                msgs += u64::from(b.workers);
                bytes += msg.len() as u64 * u64::from(b.workers);
            }
            if b.engine == engines[0] {
                wire.extend(m);
            }
        }
        let c1 = thread_cpu_ns();
        for msg in &wire {
            if let Ok(kvlease_notif::Notif::Heartbeat(h)) = kvlease_notif::decode(msg) {
                std::hint::black_box(table.handle_heartbeat(now, h));
                p_msgs += 1;
            }
        }
        while table.poll_event().is_some() {}
        let c2 = thread_cpu_ns();
        d_ns += c1 - c0;
        p_ns += c2 - c1;
    }
    let secs = sim_s as f64;
    Ok(json!({
        "tracked": N,
        "p_engines": ENGINES,
        "tp": TP,
        "interval_s": cfg.interval().as_secs_f64(),
        "simulated_s": sim_s,
        "step_ms": step_ms,
        "hb_msgs_per_s": msgs as f64 / secs,
        "hb_bytes_per_s": bytes as f64 / secs,
        "hb_ids_per_s": ids_sent as f64 / secs,
        "d_cpu_us_per_step": d_ns as f64 / steps as f64 / 1e3,
        "p_worker_cpu_us_per_step": p_ns as f64 / steps as f64 / 1e3,
        "p_worker_msgs": p_msgs,
        "clock": "thread_cpu_time (/proc/thread-self/schedstat)",
    }))
}

fn opt(v: &Value) -> String {
    match v {
        Value::Null => "none".into(),
        Value::Number(n) => n
            .as_f64()
            .map_or_else(|| n.to_string(), |f| format!("{f:.3}")),
        other => other.to_string(),
    }
}

fn main() -> anyhow::Result<()> {
    let a = parse_args()?;
    std::fs::create_dir_all(&a.out)?;
    let run = |s: &str| a.only.is_empty() || a.only.iter().any(|o| o == s);
    // Scaled durations: the 1:16 ratio of a 30 s lease versus the 480 s fixed timeout.
    let (crash_lease, crash_fixed, warm, post) = if a.quick {
        (1.0, 16.0, 4.0, 20.0)
    } else {
        (3.0, 48.0, 8.0, 55.0)
    };
    // Push: the same lease and fixed timeout (vLLM's push watchdog is 480 s too); the
    // watch after the kill ends 2 s after D's blocks are back to 0.
    let (push_warm, push_post) = if a.quick { (3.0, 20.0) } else { (6.0, 55.0) };
    let over_lease = 1.0;
    let multiples: &[f64] = if a.quick {
        &[0.5, 2.0, 5.0, 10.0]
    } else {
        &[0.5, 1.0, 2.0, 5.0, 10.0]
    };
    let over_total: f64 = multiples.iter().map(|m| m * over_lease + 1.0).sum::<f64>() + 2.0;
    let total_s = [
        ("crash", 2.0 * (warm + post + 4.0)),
        ("overload", 2.0 * over_total),
        ("heartbeat", 5.0),
        (
            "push",
            2.0 * (push_warm + 5.0) + crash_lease + crash_fixed + 4.0,
        ),
    ]
    .iter()
    .filter(|(s, _)| run(s))
    .map(|(_, t)| t)
    .sum();
    let prog = Progress {
        start: Instant::now(),
        total_s,
    };
    let mode = |name, l, f, push| Mode {
        name,
        lease_s: l,
        fixed_s: f,
        push,
    };

    let crash_runs = if run("crash") {
        Some((
            crash(
                &a,
                mode("lease", crash_lease, crash_fixed, false),
                warm,
                post,
                &prog,
            )?,
            crash(
                &a,
                mode("fixed", crash_lease, crash_fixed, false),
                warm,
                post,
                &prog,
            )?,
        ))
    } else {
        None
    };
    // Overload: the fixed arm uses a fixed timeout as short as the lease (1 s), the only
    // fixed setting that reclaims as fast as the lease does after a crash.
    let over_runs = if run("overload") {
        Some((
            overload(
                &a,
                mode("lease", over_lease, over_lease, false),
                multiples,
                &prog,
            )?,
            overload(
                &a,
                mode("fixed", over_lease, over_lease, false),
                multiples,
                &prog,
            )?,
        ))
    } else {
        None
    };
    let hb = if run("heartbeat") {
        prog.say("heartbeat cost (in-process state machines)");
        Some(heartbeat_cost(if a.quick { 30 } else { 120 })?)
    } else {
        None
    };
    let push_runs = if run("push") {
        let m = |name| mode(name, crash_lease, crash_fixed, true);
        Some((
            push_crash(&a, m("lease"), push_warm, push_post, &prog)?,
            push_crash(&a, m("fixed"), push_warm, push_post, &prog)?,
        ))
    } else {
        None
    };

    let transfer = transfer_json(&a);

    let mut report = json!({
        "quick": a.quick,
        "scaling": format!(
            "durations scaled 1:10 from production: crash and push lease {crash_lease} s vs fixed {crash_fixed} s (the 1:16 ratio of 30 s vs 480 s); overload lease {over_lease} s vs fixed {over_lease} s"
        ),
        "transfer": transfer,
    });
    if let Some((cl, cf)) = &crash_runs {
        report["crash"] = json!({ "lease": cl.json, "fixed": cf.json });
    }
    if let Some((ol, of)) = &over_runs {
        report["overload"] = json!({ "lease": ol, "fixed": of });
    }
    if let Some(hb) = hb {
        report["heartbeat"] = hb;
    }
    if let Some((pl, pf)) = &push_runs {
        report["push"] = json!({
            "note": "P killed (SIGKILL) in push mode while D holds reservations; fixed: D holds each reservation for the fixed timeout (heartbeats ignored). vLLM's push watchdog (push_registration_timeout, 480 s) frees nothing, so the fixed arm is a lower bound on its cost.",
            "lease": pl.json,
            "fixed": pf.json,
        });
    }
    std::fs::write(
        a.out.join("report.json"),
        serde_json::to_string_pretty(&report)?,
    )?;

    let png = |n: &str| a.out.join(n);
    let two = |l: &[(f64, f64)], f: &[(f64, f64)]| {
        [
            Series {
                label: "lease".into(),
                points: l.to_vec(),
            },
            Series {
                label: "fixed".into(),
                points: f.to_vec(),
            },
        ]
    };
    if let Some((cl, cf)) = &crash_runs {
        plot_lines(
            &png("crash_held_blocks.png"),
            &a.font,
            &format!(
                "P's held blocks; D killed at t=0, restarted at t=1 (lease {crash_lease}s vs fixed {crash_fixed}s)"
            ),
            "seconds since kill -9 of D",
            "kvlease_blocks_held",
            &two(&cl.held, &cf.held),
        )?;
        plot_lines(
            &png("crash_admit_rate.png"),
            &a.font,
            "P's admitted prefills per second around the D crash",
            "seconds since kill -9 of D",
            "leases granted / s",
            &two(&cl.rate, &cf.rate),
        )?;
    }
    if let Some((ol, of)) = &over_runs {
        plot_overload(&a, ol, of)?;
    }
    if let Some((pl, pf)) = &push_runs {
        plot_lines(
            &png("push_reserved_blocks.png"),
            &a.font,
            &format!(
                "D's blocks held in push mode; P killed at t=0 (lease {crash_lease}s vs fixed {crash_fixed}s)"
            ),
            "seconds since kill -9 of P",
            "kvlease_blocks_held on D",
            &two(&pl.held, &pf.held),
        )?;
    }

    print_summary(&report, crash_lease, crash_fixed);
    println!("report={}", a.out.join("report.json").display());
    Ok(())
}

/// The transfer benchmarks' `key=value` files as JSON objects, one per name (numbers
/// where they parse).
fn transfer_json(a: &Args) -> serde_json::Map<String, Value> {
    let mut transfer = serde_json::Map::new();
    for (name, file) in &a.transfer {
        let kv: serde_json::Map<String, Value> = kv_file(file)
            .into_iter()
            .map(|(k, v)| {
                (
                    k,
                    v.parse::<f64>()
                        .map_or_else(|_| Value::String(v.clone()), |f| json!(f)),
                )
            })
            .collect();
        transfer.insert(name.clone(), Value::Object(kv));
    }
    if a.transfer.is_empty() {
        transfer.insert(
            "note".into(),
            json!("skipped (--quick or --only); run without either for transport.sh and verbs.sh"),
        );
    }
    transfer
}

/// The overload plots: expired leases and wasted prefills against the queue wait, lease
/// versus fixed timeout.
fn plot_overload(a: &Args, ol: &[Value], of: &[Value]) -> anyhow::Result<()> {
    let png = |n: &str| a.out.join(n);
    let col = |v: &[Value], k: &str| -> Vec<(f64, f64)> {
        v.iter()
            .map(|r| {
                (
                    r["wait_multiple"].as_f64().unwrap_or(0.0),
                    r[k].as_f64().unwrap_or(0.0),
                )
            })
            .collect()
    };
    for (k, file, title) in [
        (
            "expired_leases",
            "overload_expired.png",
            "Expired leases on P (4 queued requests per point)",
        ),
        (
            "wasted_prefills",
            "overload_wasted.png",
            "Wasted prefills (D could not load the KV)",
        ),
    ] {
        plot_lines(
            &png(file),
            &a.font,
            title,
            "queue wait on D / lease duration",
            k,
            &[
                Series {
                    label: "lease".into(),
                    points: col(ol, k),
                },
                Series {
                    label: "fixed (timeout = lease)".into(),
                    points: col(of, k),
                },
            ],
        )?;
    }
    Ok(())
}

/// Prints the study's headline numbers as `key=value` lines (of the scenarios run).
fn print_summary(report: &Value, crash_lease: f64, crash_fixed: f64) {
    println!("scaling=lease_{crash_lease}s_vs_fixed_{crash_fixed}s_ratio_1:16");
    let c = &report["crash"];
    if c.is_object() {
        for m in ["lease", "fixed"] {
            println!("reclaim_s_{m}={}", opt(&c[m]["reclaim_s"]));
            println!(
                "reclaim_mean_s_after_last_heartbeat_{m}={}",
                opt(&c[m]["reclaim_mean_s_after_last_heartbeat"])
            );
            println!("leases_at_kill_{m}={}", opt(&c[m]["leases_at_kill"]));
            println!(
                "admit_rate_before_per_s_{m}={}",
                opt(&c[m]["admit_rate_before_per_s"])
            );
            println!("admit_recovery_s_{m}={}", opt(&c[m]["admit_recovery_s"]));
        }
    }
    for m in ["lease", "fixed"] {
        let Some(v) = report["overload"][m].as_array() else {
            continue;
        };
        let sum = |k: &str| v.iter().map(|r| r[k].as_f64().unwrap_or(0.0)).sum::<f64>();
        println!("expired_leases_{m}={}", sum("expired_leases"));
        println!("wasted_prefills_{m}={}", sum("wasted_prefills"));
        for r in v {
            println!(
                "overload_{m}_x{}: expired={} wasted={} probe_max_queue_ms={}",
                r["wait_multiple"],
                opt(&r["expired_leases"]),
                opt(&r["wasted_prefills"]),
                opt(&r["probe_max_queue_ms"])
            );
        }
    }
    if report["heartbeat"].is_object() {
        for k in [
            "hb_msgs_per_s",
            "hb_bytes_per_s",
            "hb_ids_per_s",
            "d_cpu_us_per_step",
            "p_worker_cpu_us_per_step",
        ] {
            println!("heartbeat_{k}={}", opt(&report["heartbeat"][k]));
        }
    }
    let p = &report["push"];
    if p.is_object() {
        for m in ["lease", "fixed"] {
            for k in [
                "reclaim_s",
                "reservations_at_kill",
                "blocks_held_at_kill",
                "dead_block_s",
                "reservations_expired_before_kill",
                "reservations_expired_after_kill",
            ] {
                println!("push_{k}_{m}={}", opt(&p[m][k]));
            }
        }
        let ratio = |k: &str| match (p["fixed"][k].as_f64(), p["lease"][k].as_f64()) {
            (Some(f), Some(l)) if l > 0.0 => format!("{:.1}", f / l),
            _ => "none".into(),
        };
        println!("push_reclaim_ratio_fixed_over_lease={}", ratio("reclaim_s"));
        println!(
            "push_dead_block_s_ratio_fixed_over_lease={}",
            ratio("dead_block_s")
        );
    }
}
