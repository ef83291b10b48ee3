"""The side channel is one contract: the Python binding and the agents speak it alike.

Real processes on loopback: a ``prefill-agent`` P and a ``decode-agent`` D (built with
cargo unless ``KVLEASE_AGENT_BIN_DIR`` names a directory holding them), with a cluster
token. The binding's client fetches P's engine info from the agent P's side channel; the
binding's server then serves that info, as P, to the agent D, which handshakes with it,
reads the KV blocks from P's transport and decodes: a decode that completes went through
both cross pairs.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import kvlease

REPO = Path(__file__).resolve().parents[3]
TOKEN = b"interop-test-token"
SHAPE = ["--num-layers", "2", "--num-kv-heads", "4", "--head-dim", "64", "--block-size", "16"]


@pytest.fixture(scope="module")
def agent_bins() -> dict[str, Path]:
    """``prefill-agent`` and ``decode-agent``, built by cargo when not given."""
    given = os.environ.get("KVLEASE_AGENT_BIN_DIR")
    if given:
        return {b: Path(given) / b for b in ("prefill-agent", "decode-agent")}
    cargo = shutil.which("cargo")
    if cargo is None:
        pytest.skip("cargo is not on PATH and KVLEASE_AGENT_BIN_DIR is not set")
    build = subprocess.run(
        [cargo, "build", "--locked", "-q", "-p", "kvlease-agent", "--bin", "prefill-agent",
         "--bin", "decode-agent", "--message-format=json"],
        cwd=REPO, capture_output=True, text=True, timeout=1500, check=False,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    bins = {}
    for line in build.stdout.splitlines():
        msg = json.loads(line)
        if msg.get("reason") == "compiler-artifact" and msg.get("executable"):
            bins[Path(msg["executable"]).name] = Path(msg["executable"])
    return bins


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Agent:
    def __init__(self, bin: Path, engine: str, log: Path) -> None:
        self.port = free_port()
        self.side_port = free_port()
        self.log = log
        env = dict(os.environ, RUST_LOG="info", KVLEASE_AUTH_TOKEN=TOKEN.decode())
        env.pop("KVLEASE_API_KEY", None)
        self.proc = subprocess.Popen(
            [str(bin), "--host", "127.0.0.1", "--port", str(self.port), "--side-channel-port",
             str(self.side_port), "--engine-id", engine, *SHAPE, "--transport", "tcp",
             "--memory", "host"],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=log.open("wb"),
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, f"agent exited: {self.log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"not healthy: {self.log.read_text()[-3000:]}"
            time.sleep(0.05)

    def complete(self, body: dict) -> tuple[int, dict]:
        req = urllib.request.Request(
            f"{self.url}/v1/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def test_side_channel_python_and_agents_serve_each_other(agent_bins, tmp_path):
    p = Agent(agent_bins["prefill-agent"], "p-agent", tmp_path / "p.log")
    d = Agent(agent_bins["decode-agent"], "d-agent", tmp_path / "d.log")
    server = None
    try:
        p.wait_healthy()
        d.wait_healthy()
        # The binding's D fetches from the agent P: P's engine info, after both proofs.
        raw = kvlease.side_channel_fetch(
            "127.0.0.1", p.side_port, token=TOKEN, engine_id="d-python"
        )
        info = json.loads(raw)
        assert info["engine_id"] == "p-agent"
        for wrong in (b"another-token", None):
            with pytest.raises(kvlease.AuthError):
                kvlease.side_channel_fetch(
                    "127.0.0.1", p.side_port, token=wrong, engine_id="d-python"
                )

        # The binding's P serves that info, as P, to the agent D.
        server = kvlease.SideChannelServer(raw, token=TOKEN, engine_id="p-agent")
        prompt = "the side channel is one contract " * 4
        status, answer = p.complete(
            {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        )
        assert status == 200, answer
        params = dict(answer["kv_transfer_params"])
        assert params["remote_port"] == p.side_port
        params["remote_port"] = server.port
        status, decoded = d.complete(
            {"prompt": prompt, "max_tokens": 2, "kv_transfer_params": params}
        )
        assert status == 200, (decoded, d.log.read_text()[-3000:])
        stats = server.stats()
        assert stats["served"] == 1 and stats["refused"] == 0, stats
    finally:
        if server is not None:
            server.close()
        p.stop()
        d.stop()
