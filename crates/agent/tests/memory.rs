//! `--memory`: the memory kinds of the KV pool, run for real in `prefill-agent` and
//! `decode-agent` processes over TCP on loopback.
//!
//! - Without a GPU, `--memory cuda` and `--memory pinned` exit non-zero naming the cause;
//!   `--memory auto` logs that it picked host memory and why. (Push mode with staged
//!   pools runs in `tests/push.rs`.)
//! - `--memory staged` is host memory moved as if it were device memory: P fills it with
//!   a staged copy, the TCP server sends it through the pipelined stager, D's reader fills
//!   it through the stager and D verifies it by copying it back. The digests must be the
//!   ones the generator makes, whatever the kinds on either side. On a machine with a GPU
//!   the same runs with `--memory cuda`.

mod common;

use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use common::{SHAPE, agent_command, free_port, log_path, post_completion, run_to_exit, shape_args};
use kvlease_agent::kv;
use serde_json::{Value, json};

const PREFILL: &str = env!("CARGO_BIN_EXE_prefill-agent");
const DECODE: &str = env!("CARGO_BIN_EXE_decode-agent");

/// Whether this machine has a usable CUDA GPU (the probe checks for libcuda first).
fn gpu_present() -> bool {
    #[cfg(feature = "cuda")]
    {
        matches!(
            kvlease_gpu_mem::cuda::probe(),
            kvlease_gpu_mem::cuda::CudaAvailability::Available { .. }
        )
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

#[test]
fn cuda_and_pinned_without_a_gpu_fail_naming_the_cause() -> Result<()> {
    if gpu_present() {
        eprintln!("skipped: this machine has a CUDA GPU, so --memory cuda/pinned succeed");
        return Ok(());
    }
    for bin in [PREFILL, DECODE] {
        for memory in ["cuda", "pinned"] {
            let port = free_port().to_string();
            let side = free_port().to_string();
            let mut args = vec!["--host", "127.0.0.1", "--port", &port];
            args.extend(["--side-channel-port", &side, "--memory", memory]);
            args.extend(shape_args());
            let out = run_to_exit(bin, &args)?;
            let stderr = String::from_utf8_lossy(&out.stderr);
            ensure!(
                !out.status.success(),
                "{bin} --memory {memory} started without a GPU: {stderr}"
            );
            // The pool setup names the CUDA allocation and the driver's state.
            ensure!(
                stderr.contains("block pool") && stderr.contains("CUDA allocation"),
                "{bin} --memory {memory}: {stderr}"
            );
            ensure!(
                stderr.contains("no CUDA driver")
                    || stderr.contains("unusable")
                    || stderr.contains("without CUDA support"),
                "{bin} --memory {memory}: the cause is not named: {stderr}"
            );
        }
    }
    Ok(())
}

/// A child killed (SIGKILL) on drop; its stderr goes to a log file.
struct Proc {
    child: Child,
    log: std::path::PathBuf,
    url: String,
}

impl Proc {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- {} ---\n{}", self.log.display(), self.log());
        }
    }
}

fn spawn(bin: &str, name: &str, memory: &str) -> Result<Proc> {
    let port = free_port();
    let side = free_port();
    let log = log_path("memory", name);
    let file = std::fs::File::create(&log)?;
    let child = agent_command(bin, name, port, side, memory, file)
        .args(["--num-blocks", "128"])
        .spawn()
        .with_context(|| format!("spawn {bin}"))?;
    Ok(Proc {
        child,
        log,
        url: format!("http://127.0.0.1:{port}"),
    })
}

async fn wait_healthy(c: &reqwest::Client, p: &mut Proc) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(r) = c.get(format!("{}/health", p.url)).send().await
            && r.status().is_success()
        {
            return Ok(());
        }
        if let Ok(Some(status)) = p.child.try_wait() {
            bail!("exited with {status}: {}", p.log());
        }
        ensure!(
            Instant::now() < deadline,
            "not healthy in 20 s: {}",
            p.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn post(c: &reqwest::Client, url: &str, body: &Value) -> Result<Value> {
    let (status, text) = post_completion(c, url, body).await?;
    ensure!(status == 200, "{url}: {status} {text}");
    serde_json::from_str(&text).with_context(|| format!("not JSON: {text}"))
}

/// One P (memory `p_mem`) and one D (`d_mem`); prefill then decode three prompts and
/// check both digests against the generator and the bytes moved.
async fn round_trip(p_mem: &str, d_mem: &str) -> Result<()> {
    let c = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()?;
    let tag = format!("{p_mem}-{d_mem}");
    let mut p = spawn(PREFILL, &format!("p-{tag}"), p_mem)?;
    let mut d = spawn(DECODE, &format!("d-{tag}"), d_mem)?;
    wait_healthy(&c, &mut p).await?;
    wait_healthy(&c, &mut d).await?;
    for i in 0..3 {
        let prompt = format!("memory kinds {tag} {i}: {}", "kv ".repeat(20 + 17 * i));
        let want = kv::expected_digest(&SHAPE, &kv::tokenize(&prompt)).to_string();
        let pa = post(
            &c,
            &p.url,
            &json!({"prompt": prompt, "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": true}}),
        )
        .await?;
        ensure!(
            pa["kv_digest"] == want,
            "P ({p_mem}) digest {} != {want}",
            pa["kv_digest"]
        );
        let da = post(
            &c,
            &d.url,
            &json!({"prompt": prompt, "max_tokens": 2,
                "kv_transfer_params": pa["kv_transfer_params"]}),
        )
        .await?;
        ensure!(
            da["kv_digest"] == want,
            "D ({d_mem}) digest {} != {want}",
            da["kv_digest"]
        );
        let blocks = SHAPE.blocks_for(kv::tokenize(&prompt).len()) as u64;
        let full = blocks * 2 * 2 * 4 * 16 * 64 * 2;
        let bytes = da["kv_transfer_stats"]["bytes"].as_u64().unwrap_or(0);
        ensure!(bytes == full, "moved {bytes} bytes, expected {full}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn digests_are_identical_across_memory_kinds() -> Result<()> {
    round_trip("staged", "host").await?;
    round_trip("host", "staged").await?;
    round_trip("staged", "staged").await?;
    if gpu_present() {
        round_trip("cuda", "cuda").await?;
        round_trip("cuda", "host").await?;
    } else {
        eprintln!("--memory cuda round trips skipped: no CUDA GPU on this machine");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_logs_the_memory_it_picked_and_why() -> Result<()> {
    let c = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()?;
    let mut p = spawn(PREFILL, "p-auto", "auto")?;
    wait_healthy(&c, &mut p).await?;
    let log = p.log();
    if gpu_present() {
        ensure!(
            log.contains("--memory auto") && log.contains("cuda:"),
            "{log}"
        );
    } else {
        ensure!(log.contains("falling back to host memory"), "{log}");
        ensure!(
            log.contains("no CUDA driver")
                || log.contains("unusable")
                || log.contains("without CUDA support"),
            "the reason is not logged: {log}"
        );
    }
    Ok(())
}
