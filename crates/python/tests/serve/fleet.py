"""Real serving processes for the serving tests: ``vllm serve`` engines (plain, P and D
with ``KvleaseConnector``), the proxies in front of them (vLLM's toy proxy,
``kvlease-proxy``, ``vllm-router``), and what a client sees of them (completions,
Prometheus metrics).

Every process runs in its own session (process group): vLLM's API server, engine core
and workers are stopped, frozen (SIGSTOP), thawed and killed together, and a test that
fails leaves nothing behind (``Fleet.close``). Each process logs to its own file under
the run's work directory; a process that dies or never answers fails the test with the
tail of its log.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Settings that keep several CPU engines within a 2-core, 24 GiB machine: 1 GiB of KV
#: cache each, one OpenMP thread, no pinning, and offline (nothing from a model hub).
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_LOGGING_LEVEL": "INFO",
    "PYTHONUNBUFFERED": "1",
}

#: ``vllm serve`` arguments every engine gets: a short context, a few sequences at once,
#: float32, no graph capture (CPU), a fixed seed.
ENGINE_ARGS = [
    "--max-model-len", "256",
    "--max-num-seqs", "8",
    "--dtype", "float32",
    "--enforce-eager",
    "--seed", "0",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, lines: int = 60) -> str:
    """The first error in a log (vLLM's API server ends with "See root cause above", and
    the cause is the engine core's or a worker's first ERROR, far above), then its tail."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    first = next((i for i, line in enumerate(text)
                  if " ERROR " in line or "Traceback" in line or "Killed" in line), None)
    tail = text[-lines:]
    if first is None or first >= len(text) - lines:
        return "\n".join(tail)
    cause = text[first:first + 40]
    return "\n".join(["[first error]", *cause, "[...]", "[tail]", *tail])


@dataclass
class Process:
    """One server process group: started by ``start``, ready when ``ready_path``
    answers 200 on ``port``."""

    name: str
    argv: list[str]
    port: int
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    ready_path: str = "/health"
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Process":
        env = dict(os.environ, **self.env)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log, "ab")
        self.proc = subprocess.Popen(
            self.argv, stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )
        out.close()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float = 300.0) -> "Process":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(
                    f"{self.name} exited ({self.proc.returncode if self.proc else None}) "
                    f"before it answered; its log:\n{_tail(self.log)}"
                )
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} did not answer in {timeout}s; its log:\n{_tail(self.log)}")

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def freeze(self) -> None:
        """Stops every process of the group (SIGSTOP): nothing answers, not even
        ``/health``."""
        self.signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.signal(signal.SIGCONT)

    def freeze_engine(self) -> None:
        """Stops the engine behind ``vllm serve``'s API server (its engine core and
        workers: the scheduler, the connector, the transport), as a stalled engine
        would: the API server still takes requests and hands them on, and they wait."""
        self._frozen = self._tree()[1:]
        for child in self._frozen:
            child.suspend()

    def thaw_engine(self) -> None:
        for child in getattr(self, "_frozen", []):
            try:
                child.resume()
            except Exception:  # gone meanwhile
                pass
        self._frozen = []

    def _tree(self) -> list:
        """The process and every descendant (vLLM's engine core may start its own
        process group: a group signal alone can miss it)."""
        import psutil

        if self.proc is None:
            return []
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill(self) -> None:
        """SIGKILL to every process of the server at once (a crash: nothing is cleaned
        up, and nothing stopped runs again first), then reaped."""
        for p in self._tree():
            try:
                p.kill()
            except Exception:  # gone meanwhile
                pass
        self.signal(signal.SIGKILL)
        self._frozen = []
        if self.proc is not None:
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.thaw_engine()
        self.thaw()
        tree = self._tree()
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        for p in tree:  # whatever did not exit with the server
            try:
                p.kill()
            except Exception:
                pass
        self.signal(signal.SIGKILL)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def kv_config(role: str, extra: dict[str, Any] | None = None, connector: str = "KvleaseConnector",
              module: str | None = "kvlease.vllm") -> str:
    cfg: dict[str, Any] = {"kv_connector": connector, "kv_role": role}
    if module:
        cfg["kv_connector_module_path"] = module
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return json.dumps(cfg)


@dataclass
class Metrics:
    """One scrape of ``/metrics``: ``value(name, **labels)`` sums every series of
    ``name`` whose labels include ``labels``."""

    series: list[tuple[str, dict[str, str], float]]

    _LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
    _LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

    @classmethod
    def parse(cls, text: str) -> "Metrics":
        series = []
        for line in text.splitlines():
            m = cls._LINE.match(line)
            if m is None:
                continue
            labels = dict(cls._LABEL.findall(m.group(2) or ""))
            series.append((m.group(1), labels, float(m.group(3))))
        return cls(series)

    def value(self, name: str, **labels: str) -> float:
        return sum(
            v for n, ls, v in self.series
            if n == name and all(ls.get(k) == w for k, w in labels.items())
        )


def scrape(server: Process) -> Metrics:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        return Metrics.parse(r.read().decode())


@dataclass(frozen=True)
class Completion:
    status: int
    text: str
    token_ids: tuple[int, ...]
    body: dict


def complete(url: str, model: str, prompt: str | list[int], max_tokens: int = 16,
             timeout: float = 180.0, **extra: Any) -> Completion:
    """One greedy completion (``ignore_eos``: always ``max_tokens`` tokens); an HTTP
    error is returned, not raised, with its body; a connection that breaks is status 0."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True, **extra,
    }
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            data = json.loads(r.read())
            status = r.status
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            data = json.loads(raw)
        except ValueError:
            data = {"raw": raw.decode(errors="replace")}
        return Completion(e.code, "", (), data)
    except (OSError, http.client.HTTPException, ValueError) as e:
        # Refused, reset, or an answer cut short (a proxy whose upstream died mid-stream).
        return Completion(0, "", (), {"error": repr(e)})
    choice = data["choices"][0]
    return Completion(status, choice["text"], tuple(choice.get("token_ids") or ()), data)


def complete_all(url: str, model: str, prompts: list[str], concurrency: int = 1,
                 **extra: Any) -> list[Completion]:
    if concurrency <= 1:
        return [complete(url, model, p, **extra) for p in prompts]
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda p: complete(url, model, p, **extra), prompts))


def assert_equal(answers: list[Completion], prompts: list[str], reference: dict) -> None:
    """Every answer is a 200 whose tokens are the plain instance's (``reference``)."""
    wrong = [
        (i, a.status, a.text, reference[p].text) + ((a.body,) if a.status != 200 else ())
        for i, (p, a) in enumerate(zip(prompts, answers))
        if a.status != 200 or a.token_ids != reference[p].token_ids
    ]
    assert not wrong, f"{len(wrong)} of {len(prompts)} differ from a plain instance: {wrong[:3]}"


def wait_for(what: str, check, timeout: float = 60.0, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


class Fleet:
    """The processes of one test module: made by ``engine`` / ``toy_proxy`` /
    ``push_proxy`` / ``vllm_push_proxy`` / ``kvlease_proxy`` / ``router``, all stopped by
    ``close``."""

    def __init__(self, work: Path, model: str):
        self.work = work
        self.model = model
        self.procs: list[Process] = []

    def _add(self, p: Process) -> Process:
        self.procs.append(p)
        return p

    def engine(self, name: str, *, block_size: int = 32, kv: str | None = None,
               extra_args: list[str] | None = None, env: dict[str, str] | None = None) -> Process:
        port = free_port()
        argv = [
            str(Path(sys.executable).with_name("vllm")), "serve", self.model,
            "--port", str(port), "--block-size", str(block_size), *ENGINE_ARGS,
        ]
        if kv is not None:
            argv += ["--kv-transfer-config", kv]
        argv += extra_args or []
        return self._add(Process(name, argv, port, self.work / f"{name}.log",
                                 dict(ENGINE_ENV, **(env or {}))))

    def toy_proxy(self, name: str, prefill: list[Process], decode: list[Process]) -> Process:
        port = free_port()
        argv = [
            sys.executable, os.environ["KVLEASE_SERVE_TOY_PROXY"], "--port", str(port),
            "--prefiller-hosts", *["127.0.0.1"] * len(prefill),
            "--prefiller-ports", *[str(p.port) for p in prefill],
            "--decoder-hosts", *["127.0.0.1"] * len(decode),
            "--decoder-ports", *[str(d.port) for d in decode],
        ]
        # The toy proxy has no /health; its /healthcheck answers once it is up.
        return self._add(Process(name, argv, port, self.work / f"{name}.log",
                                 ready_path="/healthcheck"))

    def push_proxy(self, name: str, prefill: list[Process], decode: list[Process]) -> Process:
        """A push-mode proxy (``push_proxy.py``: vLLM's push proxy's flow)."""
        port = free_port()
        argv = [
            sys.executable, str(Path(__file__).with_name("push_proxy.py")), "--port", str(port),
            "--prefill", *[p.url for p in prefill], "--decode", *[d.url for d in decode],
        ]
        return self._add(Process(name, argv, port, self.work / f"{name}.log",
                                 ready_path="/healthcheck"))

    def vllm_push_proxy(self, name: str, prefill: Process, decode: list[Process], *,
                        engine_id: str, side_channel_port: int, tp_size: int = 1) -> Process:
        """vLLM's own push proxy, unchanged (``disagg_proxy_pushconnector_demo.py`` from
        vLLM's sources): both legs at once, one ``X-Request-Id`` for both, D's naming P by
        the engine id and side channel given here. One P."""
        port = free_port()
        argv = [
            sys.executable, os.environ["KVLEASE_SERVE_VLLM_PUSH_PROXY"], "--model", self.model,
            "--port", str(port), "--prefill", f"127.0.0.1:{prefill.port}",
            "--decode", *[f"127.0.0.1:{d.port}" for d in decode],
            "--prefill-engine-id", engine_id, "--prefill-kv-host", "127.0.0.1",
            "--prefill-side-channel-port", str(side_channel_port),
            "--prefill-tp-size", str(tp_size),
        ]
        return self._add(Process(name, argv, port, self.work / f"{name}.log",
                                 ready_path="/status"))

    def kvlease_proxy(self, name: str, prefill: list[Process], decode: list[Process],
                      args: tuple[str, ...] = ()) -> Process:
        """``kvlease-proxy`` (``args``: more of its flags, e.g. ``--transfer-mode push``).

        Its connect limit is 30 s here, not the default 3 s: these tests run two TP-2 vLLM
        servers on two cores, where the whole machine was seen to stall for more than 3 s,
        and a loopback connect to P and D timed out at the same instant (a 504 that says
        nothing about the tokens these tests compare)."""
        port = free_port()
        argv = [
            os.environ["KVLEASE_SERVE_PROXY_BIN"], "--host", "127.0.0.1", "--port", str(port),
            "--prefill", *[p.url for p in prefill], "--decode", *[d.url for d in decode],
            "--connect-timeout-ms", "30000", *args,
        ]
        return self._add(Process(name, argv, port, self.work / f"{name}.log",
                                 env={"RUST_LOG": "info"}))

    def router(self, name: str, prefill: list[Process], decode: list[Process]) -> Process:
        port = free_port()
        argv = [os.environ["KVLEASE_SERVE_ROUTER"], "--vllm-pd-disaggregation",
                "--kv-connector", "nixl", "--host", "127.0.0.1", "--port", str(port),
                "--policy", "round_robin"]
        for p in prefill:
            argv += ["--prefill", p.url]
        for d in decode:
            argv += ["--decode", d.url]
        return self._add(Process(name, argv, port, self.work / f"{name}.log"))

    def start(self, *procs: Process, timeout: float = 400.0) -> None:
        """Starts ``procs`` together and waits until every one answers."""
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready(timeout)

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
