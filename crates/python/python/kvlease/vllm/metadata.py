"""The metadata vLLM carries between the connector's halves: scheduler → workers
(``KvleaseConnectorMetadata``: ``LoadSpec`` with its ``BatchSpec``, ``TransmitSpec``, P's
``EngineInfo``, ``SaveSpec``), workers → scheduler (``KvleaseWorkerMetadata``:
``ReceivedNotif``, ``BatchOutcome``) and a worker's registration
(``KvleaseHandshakeMetadata``). Each is a dataclass or named tuple of plain values, so
vLLM can pickle it between processes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from ..kinds import BatchStatus, TransmitKind
from .handshake import EngineInfo


class TransmitSpec(NamedTuple):
    """A notification D's worker 0 sends to P's worker 0 (heartbeats, aborts)."""

    #: P's engine.
    engine: str
    kind: TransmitKind
    #: The encoded notification.
    message: bytes


class ReceivedNotif(NamedTuple):
    """A notification one of P's workers received, for P's scheduler."""

    #: The authenticated sender's agent name (D's engine id, ``#``, rank).
    sender: str
    message: bytes


class BatchOutcome(NamedTuple):
    """How one read batch ended on D's worker, for D's scheduler."""

    status: BatchStatus
    #: Data bytes read (0 unless done).
    nbytes: int
    #: Why it failed or was stale, else ``None``.
    error: str | None


@dataclass(frozen=True)
class BatchSpec:
    """One read batch of a load, as the decode core planned it: D's worker ``d_worker``
    reads heads ``remote_heads`` of P worker ``p_rank``'s blocks into heads
    ``local_heads`` of its own (``(start, end)``, counted within each side's block: a
    worker's block holds only its share of the heads) and, when the fence matched, sends
    P the read completion ``notif``."""

    #: The batch's index in the load's plan (``DecodeCore.handle_batch_done``).
    index: int
    d_worker: int
    p_rank: int
    #: Heads written in D's block (the plan's heads minus D's worker's first head).
    local_heads: tuple[int, int]
    #: Heads read in P's block (the plan's heads minus P's worker's first head).
    remote_heads: tuple[int, int]
    notif: bytes


@dataclass(frozen=True)
class LoadSpec:
    """One request's load, for every D worker: D's ``local_blocks`` receive P's
    ``remote_blocks``, fenced by P's fence word of ``fence_block`` holding
    ``generation``."""

    #: D's id of the request.
    request: str
    #: P's engine.
    engine: str
    #: P's id of the request.
    remote_request: str
    local_blocks: list[int]
    remote_blocks: list[int]
    fence_block: int
    generation: int
    batches: list[BatchSpec]
    #: Tokens per block on D and on P when they differ (``remote_block_size`` 0: the
    #: same, and ``local_blocks[i]`` receives ``remote_blocks[i]`` whole). Otherwise D's
    #: ``local_blocks`` hold the request's tokens from ``first_token`` (a multiple of
    #: ``block_size``), P's ``remote_blocks`` from the start of the P block holding it,
    #: and tokens up to ``num_tokens`` are read.
    block_size: int = 0
    remote_block_size: int = 0
    first_token: int = 0
    num_tokens: int = 0
    #: Hybrid models: how many of the pairs each KV cache group holds, group after group
    #: (a layer reads its group's pairs only); empty: one group, every layer every pair.
    group_sizes: tuple[int, ...] = ()


@dataclass(frozen=True)
class SaveSpec:
    """P with a host buffer (``kv_buffer_device`` ``cpu``): a request's blocks each
    worker copies from its KV caches to its host buffers after this step's forward (the
    step that computes the rest of its prompt), before the step's output reaches the
    scheduler, which grants the lease on them."""

    request: str
    #: The block ids per KV cache group (a sliding window's tail only), as the lease
    #: will name them.
    block_groups: list[list[int]]


@dataclass(frozen=True)
class ReserveSpec:
    """Push mode, D: a reservation made. Every D worker publishes ``generation`` in the
    write-fence words of ``blocks`` (under its agent's write lock); then worker 0 sends
    P's worker 0 ``messages`` (where D's side channel is, and the registration)."""

    request: str
    #: P's engine.
    engine: str
    blocks: list[int]
    generation: int
    messages: list[bytes]


@dataclass(frozen=True)
class ReservationEndSpec:
    """Push mode, D: a reservation ended (``written``, ``failed``, ``expired`` or
    ``aborted``). Every D worker clears the write-fence words of ``blocks`` first (no
    write of the generation lands after that), then reports the request received:
    with its blocks as load errors when failed or expired (vLLM recomputes or fails it);
    aborted, vLLM frees the blocks it held back for it."""

    request: str
    blocks: list[int]
    outcome: str


@dataclass(frozen=True)
class WriteSpec:
    """Push mode, P: write ``local_blocks`` (P's) into ``remote_blocks`` (D's, a
    reservation of ``generation`` fenced by the write-fence word of ``fence_block``), one
    batch per pair of ``pairs``."""

    transfer: str
    #: D's engine.
    engine: str
    generation: int
    local_blocks: list[int]
    remote_blocks: list[int]
    fence_block: int
    #: ``(p_rank, d_rank, p_heads, d_heads)``: P's worker ``p_rank`` writes heads
    #: ``p_heads`` of its blocks into heads ``d_heads`` of D's worker ``d_rank``'s
    #: (``(start, end)`` within each side's block, as ``BatchSpec``'s); ``None`` for both
    #: when the two workers hold the same heads (the whole block). Every P worker has at
    #: least one pair, or none when another P rank writes the replicated KV it holds.
    pairs: list[tuple[int, int, tuple[int, int] | None, tuple[int, int] | None]]


class WriteOutcome(NamedTuple):
    """How one P worker's write of a push ended, for P's scheduler."""

    generation: int
    ok: bool
    error: str | None


@dataclass
class KvleaseConnectorMetadata(KVConnectorMetadata):
    """Scheduler → workers, once per step (plain values and dataclasses of them: vLLM
    pickles it to the worker processes)."""

    loads: list[LoadSpec] = field(default_factory=list)
    transmits: list[TransmitSpec] = field(default_factory=list)
    #: P engine infos learned by handshakes since the last step (a new engine, or a
    #: newer instance of one: the workers connect afresh).
    engines: dict[str, EngineInfo] = field(default_factory=dict)
    #: P engines the decode core dropped (idle, to make room): the workers close their
    #: connections to them.
    dropped_engines: list[str] = field(default_factory=list)
    #: D requests whose load the core refused: reported failed at once, with their blocks.
    failed_loads: dict[str, list[int]] = field(default_factory=dict)
    #: P: leases ended; vLLM may free their blocks.
    finished_sending: list[str] = field(default_factory=list)
    #: P with a host buffer: the blocks to copy to it after this step's forward.
    saves: list[SaveSpec] = field(default_factory=list)
    #: Push mode, D: reservations made and ended since the last step.
    reserves: list[ReserveSpec] = field(default_factory=list)
    reservation_ends: list[ReservationEndSpec] = field(default_factory=list)
    #: Push mode, P: writes to post.
    writes: list[WriteSpec] = field(default_factory=list)


@dataclass
class KvleaseWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers → scheduler, once per step; vLLM aggregates every worker's."""

    notifs: list[ReceivedNotif] = field(default_factory=list)
    #: D request -> batch index -> how the batch ended.
    batches: dict[str, dict[int, BatchOutcome]] = field(default_factory=dict)
    #: Push mode, P: transfer -> how each worker's write ended (one entry per worker).
    writes: dict[str, list[WriteOutcome]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KvleaseWorkerMetadata):
            return self
        merged = KvleaseWorkerMetadata(
            notifs=self.notifs + other.notifs,
            batches={k: dict(v) for k, v in self.batches.items()},
        )
        for req, results in other.batches.items():
            merged.batches.setdefault(req, {}).update(results)
        merged.writes = {k: list(v) for k, v in self.writes.items()}
        for transfer, outcomes in other.writes.items():
            merged.writes.setdefault(transfer, []).extend(outcomes)
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
