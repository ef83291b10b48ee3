"""P's engine info: the handshake payload D fetches from P's side channel, validated and
normalised (``_engine_info``) before anything else on D uses it."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..errors import SideChannelError

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


_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1


def _engine_info(raw: bytes) -> EngineInfo:
    """P's handshake payload (``KvleaseScheduler._payload``) validated and normalised to
    what D uses (``EngineInfo``), each value of the type it is used as. P is a peer: anything else raises ``SideChannelError``, so a
    malformed payload fails the handshake and never reaches a scheduler or worker hook.
    """

    def bad(what: str) -> SideChannelError:
        return SideChannelError(f"P's handshake payload is malformed: {what}")

    def integer(
        obj: dict[str, Any], key: str, lo: int = 0, hi: int = _U64, default: int | None = None
    ) -> int:
        value = obj.get(key, default)
        if type(value) is not int or not lo <= value <= hi:
            raise bad(f"{key} must be an integer in [{lo}, {hi}], not {value!r}")
        return value

    def formats(value: Any, what: str) -> dict[str, list[Any]]:
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, list) for k, v in value.items()
        ):
            raise bad(f"{what} must map layer names to [dtype, shape, order] lists")
        return {k: list(v) for k, v in value.items()}

    try:
        info = json.loads(raw)
    except ValueError as e:  # UnicodeDecodeError is a ValueError too
        raise bad(f"not JSON ({e})") from None
    if not isinstance(info, dict):
        raise bad("not a JSON object")
    engine_id = info.get("engine_id")
    if not isinstance(engine_id, str):
        raise bad(f"engine_id must be a string, not {engine_id!r}")
    tp_size = integer(info, "tp_size", 1, _U32)
    kv = info.get("kv")
    if kv is not None:
        if not isinstance(kv, dict):
            raise bad("kv must be an object")
        kv = dict(kv)
        if kv.get("layers") is not None:
            kv["layers"] = formats(kv["layers"], "kv.layers")
    if not isinstance(info.get("workers"), list):
        raise bad("workers must be a list")
    workers: list[WorkerInfo] = []
    for w in info["workers"]:
        if not isinstance(w, dict):
            raise bad("a worker must be an object")
        rank = integer(w, "rank", 0, tp_size - 1)
        if any(other.rank == rank for other in workers):
            raise bad(f"two workers of rank {rank}")
        try:
            metadata = base64.b64decode(w.get("agent_metadata"), validate=True)
        except (TypeError, ValueError) as e:  # binascii.Error is a ValueError
            raise bad(f"worker {rank}'s agent_metadata is not base64 ({e})") from None
        if not isinstance(w.get("layers"), list):
            raise bad(f"worker {rank}'s layers must be a list")
        layers: list[RemoteLayer] = []
        for layer in w["layers"]:
            if not (
                isinstance(layer, list)
                and len(layer) == 6
                and isinstance(layer[0], str)
                and all(type(x) is int and 0 <= x <= _U64 for x in layer[1:])
            ):
                raise bad(
                    f"worker {rank}'s layer {layer!r} is not [name, region, offset, "
                    "block stride, block bytes, num blocks]"
                )
            _, _, offset, stride, _, n = layer
            if offset + n * stride > _U64:
                raise bad(f"worker {rank}'s layer {layer[0]} reaches past 2^64 bytes")
            layers.append(RemoteLayer(*layer))
        kv_format = w.get("kv_format")
        workers.append(
            WorkerInfo(
                rank=rank,
                agent_metadata=metadata,
                layers=layers,
                fence_region=integer(w, "fence_region"),
                # None: P names no block format (an older kvlease); its reads are refused.
                kv_format=None
                if kv_format is None
                else formats(kv_format, f"worker {rank}'s kv_format"),
            )
        )
    return EngineInfo(
        engine_id=engine_id,
        instance=integer(info, "instance", default=0),
        tp_size=tp_size,
        num_blocks=integer(info, "num_blocks", 1, _U32),
        kv=kv,
        workers=workers,
    )
