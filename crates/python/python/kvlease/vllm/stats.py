"""The connector's counters: ``KvleaseConnectorStats`` (what vLLM aggregates and logs)
and ``_Counters`` (what each half counts between two reports)."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

@dataclass
class KvleaseConnectorStats(KVConnectorStats):
    """Counters since the last interval (summed over workers and the scheduler)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in (other.data or {}).items():
            if isinstance(v, (int, float)):
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in sorted(self.data.items()) if isinstance(v, (int, float))}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class _Counters:
    """Counters a side reports as deltas at each ``get_kv_connector_stats``."""

    def __init__(self) -> None:
        self._now: dict[str, int] = {}

    def add(self, name: str, n: int = 1) -> None:
        self._now[name] = self._now.get(name, 0) + n

    def take(self) -> KvleaseConnectorStats | None:
        if not any(self._now.values()):
            return None
        stats = KvleaseConnectorStats(data=dict(self._now))
        self._now = {}
        return stats
