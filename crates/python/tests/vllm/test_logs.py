"""kvlease's log lines in vLLM's log (``kvlease.vllm.logs``): the connector's Python
loggers write through vLLM's handlers at vLLM's level, and the native half's events (the
transport's, Rust ``tracing``) reach Python logging with their level and source line.
Each case runs in a fresh interpreter: the native subscriber is per process."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_connectors_loggers_take_vllms_handlers_and_level():
    out = run("""
        import logging
        records = []
        class Keep(logging.Handler):
            def emit(self, record):
                records.append((record.name, record.levelname, record.getMessage()))
        vllm = logging.getLogger("vllm")
        vllm.addHandler(Keep())
        vllm.setLevel(logging.WARNING)
        from kvlease.vllm.logs import attach_to_vllm
        attach_to_vllm()
        log = logging.getLogger("kvlease.vllm")
        log.info("not at vLLM's level")
        log.warning("through vLLM's handler")
        print(records)
    """)
    assert "('kvlease.vllm', 'WARNING', \"through vLLM's handler\")" in out
    assert "not at vLLM's level" not in out


def test_native_events_reach_python_logging_with_level_and_source_line():
    out = run("""
        import logging, kvlease
        records = []
        class Keep(logging.Handler):
            def emit(self, record):
                records.append((record.name, record.levelno, record.filename, record.lineno,
                                record.getMessage()))
        root = logging.getLogger("kvlease")
        root.addHandler(Keep())
        root.setLevel(logging.INFO)
        from kvlease.vllm import logs
        assert logs.forward_native_logs()
        assert not logs.forward_native_logs()  # once per process
        with kvlease.Agent("log-test"):
            pass
        logs.drain()
        for r in records:
            print(r)
    """)
    lines = [eval(line) for line in out.splitlines()]  # noqa: S307 (our own repr output)
    listening = [r for r in lines if "listening" in r[4]]
    assert listening, out
    name, level, filename, lineno, message = listening[0]
    assert name.startswith("kvlease.native.kvlease_transport"), name
    assert level == 20 and filename.endswith(".rs") and lineno > 0
    assert "name=log-test" in message
    # Below the kvlease logger's level: not kept at all.
    assert all(r[1] >= 20 for r in lines)
