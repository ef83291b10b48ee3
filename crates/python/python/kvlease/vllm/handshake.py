"""P's engine info: the handshake payload D fetches from P's side channel, validated and
normalised (``_engine_info``) before anything else on D uses it."""

from __future__ import annotations

import base64
import json
from typing import Any

from ..errors import SideChannelError

_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1


def _engine_info(raw: bytes) -> dict[str, Any]:
    """P's handshake payload (``KvleaseScheduler._payload``) validated and normalised to
    what D uses, each value of the type it is used as: ``engine_id``, ``instance``,
    ``tp_size``, ``num_blocks``, ``kv`` (the descriptor, ``None`` when P sent none) and
    ``workers``, each with ``rank``, ``agent_metadata`` (bytes), ``layers`` (``[name,
    region, offset, block stride, block bytes, num blocks]``), ``fence_region`` and
    ``kv_format``. P is a peer: anything else raises ``SideChannelError``, so a
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
    workers: list[dict[str, Any]] = []
    for w in info["workers"]:
        if not isinstance(w, dict):
            raise bad("a worker must be an object")
        rank = integer(w, "rank", 0, tp_size - 1)
        if any(other["rank"] == rank for other in workers):
            raise bad(f"two workers of rank {rank}")
        try:
            metadata = base64.b64decode(w.get("agent_metadata"), validate=True)
        except (TypeError, ValueError) as e:  # binascii.Error is a ValueError
            raise bad(f"worker {rank}'s agent_metadata is not base64 ({e})") from None
        if not isinstance(w.get("layers"), list):
            raise bad(f"worker {rank}'s layers must be a list")
        layers = []
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
            layers.append(list(layer))
        kv_format = w.get("kv_format")
        workers.append(
            {
                "rank": rank,
                "agent_metadata": metadata,
                "layers": layers,
                "fence_region": integer(w, "fence_region"),
                # None: P names no block format (an older kvlease); its reads are refused.
                "kv_format": None
                if kv_format is None
                else formats(kv_format, f"worker {rank}'s kv_format"),
            }
        )
    return {
        "engine_id": engine_id,
        "instance": integer(info, "instance", default=0),
        "tp_size": tp_size,
        "num_blocks": integer(info, "num_blocks", 1, _U32),
        "kv": kv,
        "workers": workers,
    }
