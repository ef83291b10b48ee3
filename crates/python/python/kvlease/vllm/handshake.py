"""P's engine info: the handshake payload D fetches from P's side channel, read by the
codec every kvlease engine shares (``kvlease._kvlease.EngineInfo``, Rust
``kvlease_proto::engine_info``) before anything else on D uses it. The dataclasses here
are plain views of what the codec checked (picklable, for the workers' metadata)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from .. import _kvlease as native
from ..errors import InvalidArgument, SideChannelError
from ..kinds import HandshakeKind


class RemoteLayer(NamedTuple):
    """One KV cache layer of a P worker, as its handshake names it."""

    name: str
    #: The id of P's registered region that holds it.
    region: int
    #: Byte offset of block 0 in the region.
    offset: int
    block_stride: int
    block_bytes: int
    num_blocks: int


@dataclass(frozen=True)
class WorkerInfo:
    """One P worker: how D's worker connects to it and reads its blocks."""

    rank: int
    #: Its transport agent's metadata (``Agent.connect``).
    agent_metadata: bytes
    layers: list[RemoteLayer]
    #: The id of P's region holding its fence words.
    fence_region: int
    #: layer name -> ``[dtype, block shape, order]`` (``_block_format``); ``None``: P
    #: names no block format (an older kvlease), and its reads are refused.
    kv_format: dict[str, list[Any]] | None


@dataclass(frozen=True)
class EngineInfo:
    """P's engine info, as D validated it from P's handshake payload."""

    engine_id: str
    #: P's start time in µs (0: not sent).
    instance: int
    tp_size: int
    num_blocks: int
    #: The KV compatibility descriptor (``_kv_descriptor``), ``None`` when P sent none.
    kv: dict[str, Any] | None
    workers: list[WorkerInfo]

    def worker(self, rank: int) -> WorkerInfo | None:
        """P's worker ``rank``, or ``None`` when it registered no KV."""
        return next((w for w in self.workers if w.rank == rank), None)


def _engine_info(raw: bytes) -> EngineInfo:
    """P's handshake payload (``KvleaseScheduler._payload``) read by the one codec
    (``kvlease._kvlease.EngineInfo``, the agents' too) and viewed as what D uses
    (``EngineInfo``). P is a peer: a payload the codec refuses raises
    ``SideChannelError`` (kind ``not_found``) naming the field, so a malformed payload fails the handshake and
    never reaches a scheduler or worker hook.
    """
    try:
        info = native.EngineInfo.from_bytes(raw)
    except InvalidArgument as e:
        raise SideChannelError(
            f"P's handshake payload is malformed: {e}", kind=HandshakeKind.NOT_FOUND
        ) from None
    return EngineInfo(
        engine_id=info.engine_id,
        instance=info.instance,
        tp_size=info.tp_size,
        num_blocks=info.num_blocks,
        kv=info.kv,
        workers=[
            WorkerInfo(
                rank=w.rank,
                agent_metadata=w.agent_metadata,
                layers=[RemoteLayer(*layer) for layer in w.layers],
                fence_region=w.fence_region,
                kv_format=w.kv_format,
            )
            for w in info.workers
        ],
    )
