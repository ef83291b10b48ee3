"""kvlease's log lines in vLLM's log.

- The ``kvlease`` logger (the connector's modules log under it) takes the handlers and
  level vLLM gave its own ``vllm`` logger, so its lines come out in vLLM's format, at
  vLLM's level (``VLLM_LOGGING_LEVEL``), on vLLM's stream.
- The native half's events (the transport, the side channel: Rust ``tracing``) are kept
  in a bounded buffer (``kvlease._kvlease.install_log_bridge``) that a daemon thread
  drains every second into ``kvlease.native.<module>`` loggers, children of ``kvlease``:
  the same handlers and level. ``RUST_LOG`` still selects them when it is set.
"""

from __future__ import annotations

import logging
import threading

from .. import _kvlease as native

#: Seconds between two drains of the native buffer.
DRAIN_INTERVAL = 1.0

_lock = threading.Lock()
_bridged = False


def attach_to_vllm() -> None:
    """Makes the ``kvlease`` logger write through vLLM's handlers at vLLM's level, and
    forwards the native half's events to it, once per process. The handlers are left
    alone when the operator configured ``kvlease`` themselves (it has handlers: a
    logging config file names it) or vLLM configured no logging of its own
    (``VLLM_CONFIGURE_LOGGING=0``: the root logger's configuration applies, as to every
    library); the native events are forwarded either way."""
    ours = logging.getLogger("kvlease")
    theirs = logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(theirs.level)
        ours.propagate = False
    forward_native_logs()


def forward_native_logs() -> bool:
    """Starts forwarding the native half's log events to ``kvlease.native.*`` at the
    ``kvlease`` logger's level (once per process). Returns whether this call started
    it; ``False`` also when the process already has a ``tracing`` subscriber of its own."""
    global _bridged
    with _lock:
        if _bridged:
            return False
        _bridged = True
        level = logging.getLogger("kvlease").getEffectiveLevel()
        if not native.install_log_bridge(level):
            return False
        threading.Thread(target=_drain_forever, name="kvlease-logs", daemon=True).start()
        return True


def drain() -> int:
    """Logs the native lines buffered since the last drain; returns how many."""
    lines, dropped = native.drain_logs()
    for level, target, message, path, line in lines:
        logger = logging.getLogger("kvlease.native." + target.replace("::", "."))
        if logger.isEnabledFor(level):
            # The record names the Rust source line (vLLM's format prints file:line).
            logger.handle(logger.makeRecord(logger.name, level, path, line, message, (), None))
    if dropped:
        logging.getLogger("kvlease.native").warning(
            "%d native log lines were dropped (more than the buffer holds between drains)",
            dropped,
        )
    return len(lines)


def _drain_forever() -> None:
    stop = threading.Event()
    while not stop.wait(DRAIN_INTERVAL):
        try:
            drain()
        except Exception:  # logging must never take the process down
            pass
