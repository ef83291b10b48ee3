"""The connector's counters: ``KvleaseConnectorStats`` (what vLLM aggregates and logs),
``_Counters`` (what each half counts between two reports) and ``KvleasePromMetrics``
(the same counters as vLLM's Prometheus metrics, ``vllm:kvlease_*``).

A stats payload (``KvleaseConnectorStats.data``) maps a name to a count, or (a name
ending in ``_seconds``) to the list of values observed. A name may end in
``.<backend>`` (``reads_done.tcp``): the transport the read went over."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from ..kinds import BatchStatus, ReleaseReason

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        PromMetric,
        PromMetricT,
    )

#: The read latency histogram's buckets, in seconds (a batch's post to the step that
#: saw it end).
READ_SECONDS_BUCKETS = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
]  # fmt: skip


@dataclass
class KvleaseConnectorStats(KVConnectorStats):
    """Counters (and observed values) since the last interval, summed over workers and
    the scheduler."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in (other.data or {}).items():
            if isinstance(v, list):
                # A new list: the payloads being summed may be shared with vLLM's logger.
                self.data[k] = list(self.data.get(k) or []) + v
            elif isinstance(v, (int, float)):
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        """Counts as they are; observed values as their mean (``<name>_mean``)."""
        out: dict[str, int | float] = {}
        for k, v in sorted(self.data.items()):
            if isinstance(v, list):
                if v:
                    out[f"{k}_mean"] = round(sum(v) / len(v), 6)
            elif isinstance(v, (int, float)):
                out[k] = v
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


#: The workers' host-buffer counters and the ``direction`` label each is exported under.
HOST_BUFFER_DIRECTIONS = {"host_blocks_saved": "d2h", "host_blocks_synced": "h2d"}


class _Counters:
    """Counters a side reports as deltas at each ``get_kv_connector_stats``."""

    def __init__(self) -> None:
        self._now: dict[str, Any] = {}

    def add(self, name: str, n: int = 1) -> None:
        self._now[name] = self._now.get(name, 0) + n

    def observe(self, name: str, value: float) -> None:
        """One value of a histogram (``name`` ends in ``_seconds``)."""
        self._now.setdefault(name, []).append(value)

    def take(self) -> KvleaseConnectorStats | None:
        if not any(self._now.values()):
            return None
        stats = KvleaseConnectorStats(data=dict(self._now))
        self._now = {}
        return stats


class KvleasePromMetrics(KVConnectorPromMetrics):
    """``vllm:kvlease_*``: the connector's counters as vLLM's Prometheus metrics, with
    vLLM's per-engine labels (``model_name``, ``engine``) and, where it applies, the
    release ``reason``, the transport ``backend`` and the read ``status``.

    ``observe`` takes one interval's stats (``KvleaseConnectorStats.data``, scheduler and
    workers summed) of engine ``engine_idx``; names it does not export are skipped.
    """

    def __init__(
        self,
        vllm_config: "VllmConfig",
        metric_types: "dict[type[PromMetric], type[PromMetricT]]",
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return self._counter_cls(
                name=f"vllm:kvlease_{name}",
                documentation=doc,
                labelnames=[*labelnames, *extra],
            )

        self.leases_granted = counter(
            "leases_granted", "Leases P granted on finished prompts' KV blocks."
        )
        self.leases_released = counter(
            "leases_released",
            "Leases P released, by reason: completed (every reader reported), aborted "
            "(D or P gave the request up), expired (no heartbeat in time; the reaper).",
            ("reason",),
        )
        self.heartbeats_sent = counter(
            "heartbeats_sent", "Heartbeat notifications D sent to P engines."
        )
        self.heartbeat_renewals = counter(
            "heartbeat_renewals",
            "D's heartbeats that moved a lease's expiry later on P (one early in a lease, "
            "while now + 2/3 of it is before the first expiry, renews nothing).",
        )
        self.reads = counter(
            "reads",
            "Fenced read batches D posted, by transport backend and how they ended "
            "(done, stale, failed).",
            ("backend", "status"),
        )
        self.read_bytes = counter(
            "read_bytes", "Bytes D read from P in completed batches, by backend.", ("backend",)
        )
        self.stale_reads = counter(
            "stale_reads",
            "Read batches whose fence word no longer held the lease's generation (P "
            "reclaimed the blocks): a load error, never used as KV.",
        )
        self.handshake_failures = counter(
            "handshake_failures",
            "D's side-channel handshakes with P engines that failed (unreachable, "
            "authentication, a malformed engine info).",
        )
        self.incompatible_handshakes = counter(
            "incompatible_handshakes",
            "P engines D found not KV-compatible at the handshake (another model, dtype, "
            "or block layout it cannot read into its own): their requests are computed on "
            "D, never loaded; the reason is logged at error.",
        )
        self.holds_granted = counter(
            "holds_granted",
            "Bidirectional mode: finished turns this engine holds for the conversation's "
            "next turn (decoder_kv_blocks_ttl).",
        )
        self.holds_released = counter(
            "holds_released",
            "Holds on finished turns released, by reason: completed (the next turn's P "
            "read them), aborted (it computed instead, or gave up), expired (the TTL, or "
            "its last renewal, passed).",
            ("reason",),
        )
        self.turns = counter(
            "turns",
            "Bidirectional mode, P: requests that came with a held turn, by outcome: "
            "pulled (its common prefix read back) or recomputed (and why).",
            ("outcome",),
        )
        self.host_buffer_blocks = counter(
            "host_buffer_blocks",
            "KV blocks copied through the host buffer (kv_buffer_device cpu): d2h on P "
            "before a lease is granted, h2d on D after a read.",
            ("direction",),
        )
        self.read_seconds = self._histogram_cls(
            name="vllm:kvlease_read_seconds",
            documentation="Time from posting a read batch to the engine step that saw it "
            "complete, by backend.",
            buckets=READ_SECONDS_BUCKETS,
            labelnames=[*labelnames, "backend"],
        )
        # Series known in advance exist from the start, at 0.
        for values in per_engine_labelvalues.values():
            for metric in (
                self.leases_granted,
                self.heartbeats_sent,
                self.heartbeat_renewals,
                self.stale_reads,
                self.handshake_failures,
                self.incompatible_handshakes,
                self.holds_granted,
            ):
                metric.labels(*values)
            for reason in ReleaseReason:
                self.leases_released.labels(*values, reason.value)
                self.holds_released.labels(*values, reason.value)
            for direction in HOST_BUFFER_DIRECTIONS.values():
                self.host_buffer_blocks.labels(*values, direction)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = self.per_engine_labelvalues[engine_idx]
        plain = {
            "leases_granted": self.leases_granted,
            "heartbeats_sent": self.heartbeats_sent,
            "leases_renewed": self.heartbeat_renewals,
            f"batches_{BatchStatus.STALE.value}": self.stale_reads,
            "handshakes_failed": self.handshake_failures,
            "handshakes_incompatible": self.incompatible_handshakes,
            "holds_granted": self.holds_granted,
        }
        released = "leases_released_"
        held = "holds_released_"
        recomputed = "turns_recomputed_"
        statuses = {f"reads_{s.value}": s.value for s in BatchStatus}
        for key, value in transfer_stats_data.items():
            name, _, backend = key.partition(".")
            if isinstance(value, list):
                if name == "read_seconds" and backend:
                    child = self.read_seconds.labels(*engine, backend)
                    for seconds in value:
                        child.observe(seconds)
                continue
            if not isinstance(value, (int, float)) or value <= 0:
                continue
            if not backend and name in plain:
                plain[name].labels(*engine).inc(value)
            elif not backend and name in HOST_BUFFER_DIRECTIONS:
                self.host_buffer_blocks.labels(*engine, HOST_BUFFER_DIRECTIONS[name]).inc(value)
            elif not backend and name.startswith(released):
                self.leases_released.labels(*engine, name[len(released) :]).inc(value)
            elif not backend and name.startswith(held):
                self.holds_released.labels(*engine, name[len(held) :]).inc(value)
            elif not backend and name == "turns_pulled":
                self.turns.labels(*engine, "pulled").inc(value)
            elif not backend and name.startswith(recomputed):
                self.turns.labels(*engine, name[len("turns_") :]).inc(value)
            elif backend and name in statuses:
                self.reads.labels(*engine, backend, statuses[name]).inc(value)
            elif backend and name == "read_bytes":
                self.read_bytes.labels(*engine, backend).inc(value)
