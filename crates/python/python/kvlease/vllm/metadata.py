"""The metadata vLLM carries between the connector's halves: scheduler → workers
(``KvleaseConnectorMetadata``), workers → scheduler (``KvleaseWorkerMetadata``) and a
worker's registration (``KvleaseHandshakeMetadata``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class KvleaseConnectorMetadata(KVConnectorMetadata):
    """Scheduler → workers, once per step (plain values: it crosses processes)."""

    loads: list[dict[str, Any]] = field(default_factory=list)
    transmits: list[tuple[str, str, bytes]] = field(default_factory=list)
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)
    failed_loads: dict[str, list[int]] = field(default_factory=dict)
    finished_sending: list[str] = field(default_factory=list)


@dataclass
class KvleaseWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers → scheduler, once per step; vLLM aggregates every worker's."""

    notifs: list[tuple[str, bytes]] = field(default_factory=list)
    batches: dict[str, dict[int, tuple[str, int, str | None]]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KvleaseWorkerMetadata):
            return self
        merged = KvleaseWorkerMetadata(
            notifs=self.notifs + other.notifs,
            batches={k: dict(v) for k, v in self.batches.items()},
        )
        for req, results in other.batches.items():
            merged.batches.setdefault(req, {}).update(results)
        return merged


@dataclass
class KvleaseHandshakeMetadata(KVConnectorHandshakeMetadata):
    """What a worker tells its scheduler after registering its KV caches."""

    rank: int
    agent_name: str
    agent_metadata: bytes
    #: (layer name, region id, byte offset, block stride, block bytes, num blocks)
    layers: list[tuple[str, int, int, int, int, int]]
    fence_region: int
    fence_pid: int
    fence_fd: int
    num_blocks: int
    device: str
    #: layer name -> [dtype, logical block shape, physical order of the block's dims]
    #: (``_block_format``): what D compares before it reads P's blocks as its own.
    kv_format: dict[str, list[Any]] = field(default_factory=dict)
