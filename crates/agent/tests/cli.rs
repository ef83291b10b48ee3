//! The binaries, run for real: bad flags and bad `--kv-transfer-config` exit non-zero with
//! a message that names the flag or the key; good flags start a server.

mod common;

use std::io::Read as _;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use common::run_to_exit;

const PROXY: &str = env!("CARGO_BIN_EXE_kvlease-proxy");
const PREFILL: &str = env!("CARGO_BIN_EXE_prefill-agent");
const DECODE: &str = env!("CARGO_BIN_EXE_decode-agent");

fn kv_config(role: &str, extra: &str) -> String {
    format!(
        r#"{{"kv_connector":"kvlease","kv_role":"{role}","kv_connector_extra_config":{{{extra}}}}}"#
    )
}

/// Asserts that `bin args` fails and that its stderr holds every one of `needles`.
fn assert_rejected(bin: &str, args: &[&str], needles: &[&str]) -> Result<()> {
    let out = run_to_exit(bin, args)?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "{bin} {args:?} succeeded; stderr: {stderr}"
    );
    for needle in needles {
        assert!(
            stderr.contains(needle),
            "{bin} {args:?}: stderr lacks {needle:?}:\n{stderr}"
        );
    }
    Ok(())
}

/// Kills the child on drop, so a failing test leaves no process behind.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Polls `GET http://127.0.0.1:port/health` until it answers 200 (raw HTTP/1.1, no client
/// library needed), or the child exits, or 20 s pass.
fn wait_healthy(child: &mut Running, port: u16) -> Result<()> {
    use std::io::Write as _;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = child.0.try_wait()? {
            let mut stderr = String::new();
            if let Some(mut pipe) = child.0.stderr.take() {
                pipe.read_to_string(&mut stderr)?;
            }
            bail!("exited with {status} before serving: {stderr}");
        }
        if let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            stream.set_read_timeout(Some(Duration::from_secs(2)))?;
            stream.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")?;
            let mut answer = String::new();
            let _ = stream.read_to_string(&mut answer);
            if answer.starts_with("HTTP/1.1 200") {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            bail!("no healthy answer on port {port} within 20 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn proxy_rejects_bad_flags_naming_them() -> Result<()> {
    assert_rejected(PROXY, &[], &["--prefill"])?;
    assert_rejected(PROXY, &["--prefill", "http://127.0.0.1:1"], &["--decode"])?;
    let base = ["--prefill", "http://127.0.0.1:1", "--decode"];
    let with = |extra: &[&'static str]| -> Vec<&'static str> {
        base.iter().chain(extra).copied().collect()
    };
    assert_rejected(
        PROXY,
        &with(&["https://127.0.0.1:2"]),
        &["--decode", "only http://"],
    )?;
    assert_rejected(PROXY, &with(&["127.0.0.1:2"]), &["--decode"])?;
    assert_rejected(
        PROXY,
        &with(&["http://127.0.0.1:2", "--timeout-secs", "-1"]),
        &["--timeout-secs"],
    )?;
    assert_rejected(
        PROXY,
        &with(&["http://127.0.0.1:2", "--port", "notaport"]),
        &["--port"],
    )?;
    assert_rejected(
        PROXY,
        &with(&["http://127.0.0.1:2", "--log-format", "xml"]),
        &["--log-format"],
    )?;
    assert_rejected(
        PROXY,
        &with(&["http://127.0.0.1:2", "--transfer-mode", "bogus"]),
        &["--transfer-mode", "bogus", "pull", "push"],
    )?;
    Ok(())
}

#[test]
fn proxy_starts_serves_health_and_reports_a_taken_port() -> Result<()> {
    let port = common::free_port();
    let port_text = port.to_string();
    let args = [
        "--port",
        port_text.as_str(),
        "--prefill",
        "http://127.0.0.1:1",
        "--decode",
        "http://127.0.0.1:2",
    ];
    let child = Command::new(PROXY)
        .args(args)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut running = Running(child);
    wait_healthy(&mut running, port)?;
    // A second proxy on the same port fails, naming the flag.
    assert_rejected(PROXY, &args, &["--port", "cannot listen"])?;
    Ok(())
}

#[test]
fn agents_reject_bad_kv_transfer_config_naming_the_key() -> Result<()> {
    let flag = "--kv-transfer-config";
    for (bin, role) in [(PREFILL, "kv_producer"), (DECODE, "kv_consumer")] {
        assert_rejected(
            bin,
            &[flag, &kv_config(role, r#""kv_lease_duration":-1"#)],
            &[
                flag,
                "kv_connector_extra_config.kv_lease_duration: must be > 0 seconds, got -1",
            ],
        )?;
        assert_rejected(
            bin,
            &[flag, &kv_config(role, r#""kv_lease_duration":"30""#)],
            &["kv_connector_extra_config.kv_lease_duration: expected a number"],
        )?;
        assert_rejected(
            bin,
            &[
                flag,
                &kv_config(role, r#""kv_lease_duration":5,"kv_lease_max_lifetime":2"#),
            ],
            &["lease max lifetime of 2 s is shorter than the lease duration of 5 s"],
        )?;
        assert_rejected(
            bin,
            &[flag, &kv_config(role, r#""lease_ttl":3"#)],
            &["kv_connector_extra_config.lease_ttl: unknown key"],
        )?;
        assert_rejected(
            bin,
            &[flag, &kv_config(role, r#""lease_mode":"renew""#)],
            &["kv_connector_extra_config.lease_mode"],
        )?;
        assert_rejected(bin, &[flag, "{"], &[flag, "not valid JSON"])?;
        assert_rejected(
            bin,
            &[
                flag,
                r#"{"kv_connector":"MooncakeConnector","kv_role":"kv_both"}"#,
            ],
            &["kv_connector: must be"],
        )?;
    }
    assert_rejected(
        PREFILL,
        &[flag, &kv_config("kv_consumer", "")],
        &["kv_role", "prefill-agent needs kv_producer or kv_both"],
    )?;
    assert_rejected(
        DECODE,
        &[flag, &kv_config("kv_producer", "")],
        &["kv_role", "decode-agent needs kv_consumer or kv_both"],
    )?;
    Ok(())
}

#[test]
fn agents_reject_bad_flags_naming_them() -> Result<()> {
    for bin in [PREFILL, DECODE] {
        assert_rejected(bin, &["--tp-size", "3"], &["--tp-size", "--num-kv-heads 8"])?;
        assert_rejected(bin, &["--tp-size", "-1"], &["--tp-size"])?;
        assert_rejected(bin, &["--num-blocks", "0"], &["--num-blocks"])?;
        assert_rejected(bin, &["--port", "0"], &["--port"])?;
        assert_rejected(bin, &["--transport", "rdma"], &["--transport"])?;
        assert_rejected(bin, &["--memory", "disk"], &["--memory"])?;
        assert_rejected(bin, &["--engine-id", "has space"], &["--engine-id"])?;
        assert_rejected(bin, &["--auth-token", ""], &["--auth-token"])?;
        assert_rejected(bin, &["--no-such-flag"], &["--no-such-flag"])?;
        assert_rejected(bin, &["--transfer-mode", "fetch"], &["--transfer-mode"])?;
    }
    assert_rejected(DECODE, &["--max-running", "0"], &["--max-running"])?;
    assert_rejected(DECODE, &["--step-ms", "0"], &["--step-ms"])?;
    assert_rejected(DECODE, &["--max-waiting", "0"], &["--max-waiting"])?;
    assert_rejected(
        PREFILL,
        &["--pool-wait-ms", "99999999"],
        &["--pool-wait-ms"],
    )?;
    assert_rejected(
        PREFILL,
        &["--prefill-us-per-token", "x"],
        &["--prefill-us-per-token"],
    )?;
    Ok(())
}
