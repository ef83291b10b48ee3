"""``KvleaseConnector``: a vLLM (0.33.0) KV connector on kvlease's engine cores.

Load it by module path on both engines::

    --kv-transfer-config '{"kv_connector": "KvleaseConnector",
                           "kv_connector_module_path": "kvlease.vllm",
                           "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"kv_lease_duration": 30,
                                                         "cluster_token": "..."}}'

P (``do_remote_decode`` requests) keeps a finished prompt's KV blocks under a **lease**
and answers with ``kv_transfer_params``; D (``do_remote_prefill`` requests) heartbeats
the lease from the moment the request arrives, reads the blocks with **fenced** one-sided
reads, and reports a stale read as a load error, so vLLM recomputes (or fails the
request) instead of decoding from reused blocks. Every lease and request decision is made
by ``kvlease.PrefillCore`` / ``kvlease.DecodeCore`` (the Rust ``kvlease-engine`` cores,
built with external blocks: vLLM's KV cache manager allocates); this module only moves
their inputs and outputs between vLLM's hooks, the transport and the side channel.

Where the state lives
---------------------
**P's lease table lives in P's scheduler** (the scheduler-side connector owns the
``PrefillCore``), because that is where ``request_finished`` must return the lease's
``kv_transfer_params`` synchronously. Notifications, however, arrive at the **workers**
(D connects to P's workers to read, and notifications ride those connections), so:

- P's workers drain their transport agent every step and forward each notification,
  with its authenticated sender, to the scheduler through
  ``build_connector_worker_meta`` (``KvleaseWorkerMetadata.notifs``); the scheduler feeds
  them to the core in ``update_connector_output``. P keeps stepping while it holds
  delay-freed blocks (vLLM's ``has_finished_requests``), so heartbeats and the reaper
  run without a heartbeat thread.
- The **fence words** (one 8-byte generation word per block, per worker) live in a
  ``memfd`` each worker creates, registers with its agent (D's fenced reads read them)
  and names in its handshake metadata; the scheduler maps every worker's memfd
  (``/proc/<pid>/fd/<fd>``; P's scheduler and workers share a host) and writes the
  words itself: the generation **before** ``request_finished`` returns the params, the
  free word **before** it lets vLLM free the blocks. So neither a D that is faster than
  P's next step nor a step that never comes can make a read look valid.
- A lease released (every reader reported, D aborted, or expired) is cleared, then
  listed in the next metadata's ``finished_sending``; every worker reports it from
  ``get_finished`` and vLLM frees the blocks.

**D's tracking lives in D's scheduler** (the ``DecodeCore``): tracking starts in
``on_new_request``; the handshake with P's side channel runs on a background thread
(``get_num_new_matched_tokens`` answers ``None``, "ask again", until it is done); the
heartbeats due (throttled to ``kv_lease_duration / 6``), aborts, the read plans and P's
engine info go to the workers in ``KvleaseConnectorMetadata``; D's worker 0 sends the
heartbeats and aborts to P's worker 0, every worker posts its fenced batches, with the
read-completion as the batch's notification (sent only when the fence matched). Each
batch's result comes back through ``KvleaseWorkerMetadata.batches`` in the step it ended
and goes to the core at once (with TP > 1, vLLM reports the request ``finished_recving``
only when every worker is done, maybe steps later); a worker reports the request
``finished_recving`` when its batches are done (with its blocks in
``get_block_ids_with_load_errors`` when one failed or was stale).

**KV compatibility.** P's handshake payload (format 2) carries ``kv``, a descriptor of
what its blocks mean (``_kv_descriptor``: model, model and KV cache dtypes, total KV
heads, head size, layers, block size, the order inside a block from
``kv_cache_layout``, MLA) with each worker's per-layer block format (``_block_format``:
tensor dtype, block shape, dim order by stride). D compares it with its own
(``_kv_incompatibility``) at the handshake; an incompatible P's requests are refused at
``get_num_new_matched_tokens`` (logged with every difference; aborted, so P frees the
lease; vLLM computes the prompt on D), and D's workers check each P worker's layer formats
again before posting a read (a mismatch fails the batch: load errors, vLLM recomputes).

**Roles.** ``kv_producer`` builds only the ``PrefillCore`` and the side channel,
``kv_consumer`` only the ``DecodeCore`` (no side channel), ``kv_both`` all of them.

Metadata
--------
``KvleaseConnectorMetadata`` (scheduler → workers, plain Python values):
``loads`` (one dict per request: D's ``local_blocks``, P's ``remote_blocks`` to read,
``fence_block``, ``generation``, P ``engine``, and its ``batches`` with ``index``,
``d_worker``, ``p_rank``, ``whole`` and the read-completion ``notif``), ``transmits``
(``(p_engine, kind, message)``: heartbeats ``HB:<ids>`` and aborts), ``engines`` (P
engine infos learned by handshakes since the last step, as ``_engine_info`` validated
them: a malformed payload from P fails the handshake), ``failed_loads`` (requests
vLLM parked for a load the core refused: reported failed at once) and
``finished_sending`` (P: leases ended; vLLM may free their blocks).

``KvleaseWorkerMetadata`` (workers → scheduler): ``notifs`` (``(sender, message)``
received by P's workers) and ``batches`` (``{request: {batch index: (status, bytes,
error)}}``).

``kv_transfer_params`` returned by P: vLLM's keys (``do_remote_prefill``,
``do_remote_decode``, ``remote_block_ids``, ``remote_engine_id``, ``remote_request_id``,
``remote_host``, ``remote_port``, ``tp_size``, ``dcp_size``, ``pp_size``,
``remote_num_tokens``, ``transfer_mode``), which vLLM's proxies pass along unchanged,
plus ``kvlease_generation`` (the lease's fence token), ``kvlease_instance`` (P's start
time in µs: a restarted P is detected), ``kvlease_num_tokens`` (the prompt length P
prefilled) and ``kvlease_lease_duration``.

Configuration (``kv_connector_extra_config``)
---------------------------------------------
``kv_lease_duration`` (seconds, default 30), ``decoder_kv_blocks_ttl`` (accepted and
validated for configs shared with NixlConnector; bidirectional transfer is not
implemented, so it is unused), ``cluster_token`` (or env ``KVLEASE_CLUSTER_TOKEN``;
authenticates the side channel and every transport connection), ``transport``
(``auto`` | ``tcp`` | ``shm`` | ``verbs``), ``side_channel_host`` (the address P's side
channel listens on, only that one, and D reaches P at; default env
``VLLM_NIXL_SIDE_CHANNEL_HOST`` or ``127.0.0.1``),
``side_channel_port`` (default 0: any free port, published in the params),
``transport_host`` (address of the workers' agents; default the side-channel host),
``read_timeout`` (seconds per read batch, default the lease duration),
``handshake_timeout`` (seconds, default 5).

Not supported (yet): heterogeneous TP between P and D (refused by the compatibility
check: a worker's block shape differs; a load whose batches do not read whole blocks
fails, and vLLM recomputes), KV layouts whose layer block is not dense (``BHLNC``:
``register_kv_caches`` refuses it), hybrid KV cache groups (vLLM turns its hybrid
manager off for this connector), pipeline parallelism, P engines spread over several
hosts (the scheduler maps the workers' fence memfds), expiry notices from P to D (D's
fenced read catches a reclaimed lease instead).
"""

from __future__ import annotations

import base64
import json
import logging
import mmap
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from math import prod
from typing import TYPE_CHECKING, Any, Callable

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from . import _kvlease as native
from .errors import (
    AuthError,
    ConfigError,
    KvleaseError,
    NotifError,
    SideChannelError,
    TransferError,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    import torch

__all__ = [
    "KvleaseConnector",
    "KvleaseConnectorMetadata",
    "KvleaseWorkerMetadata",
    "KvleaseHandshakeMetadata",
    "KvleaseConnectorStats",
    "KvleaseConfig",
]

logger = logging.getLogger("kvlease.vllm")

#: The vLLM version this connector is written and tested against.
VLLM_VERSION = "0.33.0"

#: Separates an engine id from a worker rank in agent names (a byte no engine id holds).
_RANK_SEP = "#"


def _agent_name(engine_id: str, rank: int) -> str:
    return f"{engine_id}{_RANK_SEP}{rank}"


def _engine_of(agent_name: str) -> str:
    return agent_name.rpartition(_RANK_SEP)[0] or agent_name


# ------------------------------------------------------------------------ configuration


@dataclass(frozen=True)
class KvleaseConfig:
    """The connector's settings, read from ``kv_connector_extra_config``."""

    engine_id: str
    lease_duration: float = 30.0
    decoder_kv_blocks_ttl: float = 480.0
    token: bytes | None = None
    transport: str = "auto"
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    transport_host: str = "127.0.0.1"
    read_timeout: float = 30.0
    handshake_timeout: float = 5.0

    @classmethod
    def from_vllm(cls, vllm_config: "VllmConfig") -> "KvleaseConfig":
        ktc = vllm_config.kv_transfer_config
        if ktc is None:
            raise ConfigError("kv_transfer_config must be set")
        extra = dict(ktc.kv_connector_extra_config or {})

        def number(key: str, default: float) -> float:
            value = extra.get(key, default)
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise ConfigError(f"{key} must be a number of seconds, not {value!r}") from None
            if not value > 0 or value != value or value == float("inf"):
                raise ConfigError(f"{key} must be a positive number of seconds, not {value}")
            return value

        lease = number("kv_lease_duration", 30.0)
        ttl = number("decoder_kv_blocks_ttl", 480.0)
        if extra.get("bidirectional_kv_xfer"):
            raise ConfigError("bidirectional_kv_xfer is not supported by KvleaseConnector")
        token: str | bytes | None = extra.get("cluster_token") or os.environ.get(
            "KVLEASE_CLUSTER_TOKEN"
        )
        token_file = extra.get("cluster_token_file")
        if token is None and token_file:
            with open(token_file, "rb") as f:
                token = f.read().strip()
        if isinstance(token, str):
            token = token.encode()
        if token is not None and len(token) == 0:
            raise ConfigError("cluster_token must not be empty")
        transport = str(extra.get("transport", "auto"))
        if transport not in ("auto", "tcp", "shm", "verbs"):
            raise ConfigError(f"transport must be auto, tcp, shm or verbs, not {transport!r}")
        host = str(
            extra.get("side_channel_host")
            or os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST")
            or "127.0.0.1"
        )
        port = extra.get("side_channel_port", 0)
        try:
            port = int(port)
        except (TypeError, ValueError):
            raise ConfigError(f"side_channel_port must be a port number, not {port!r}") from None
        if not 0 <= port < 65536:
            raise ConfigError(f"side_channel_port must be a port number, not {port}")
        transport_host = str(extra.get("transport_host") or host)
        engine_id = ktc.engine_id
        if not engine_id:
            raise ConfigError("kv_transfer_config.engine_id is not set")
        return cls(
            engine_id=str(engine_id),
            lease_duration=lease,
            decoder_kv_blocks_ttl=ttl,
            token=token,
            transport=transport,
            side_channel_host=host,
            side_channel_port=port,
            transport_host=transport_host,
            read_timeout=number("read_timeout", lease),
            handshake_timeout=number("handshake_timeout", 5.0),
        )


def _ip_of(host: str) -> str:
    """An IP literal for ``host`` (the transport's addresses are IP:port)."""
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError as e:
        raise ConfigError(f"cannot resolve {host!r}: {e}") from None


def _listen_addr(host: str, port: int) -> str:
    """``ip:port`` (``[ip]:port`` for IPv6) for a listener on ``host``."""
    ip = _ip_of(host)
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


# ------------------------------------------------------------- KV compatibility

#: The descriptor keys P and D must agree on for P's block bytes to mean the same KV on
#: D (compared by ``_kv_incompatibility``; ``kv_cache_layout`` is carried for the logs:
#: a layer-outer and a block-outer layout with the same order inside a block are
#: compatible, ``block_order`` says that order).
_KV_KEYS = (
    "model",
    "dtype",
    "cache_dtype",
    "num_kv_heads",
    "head_size",
    "num_layers",
    "block_size",
    "block_order",
    "use_mla",
)


def _kv_descriptor(vllm_config: "VllmConfig") -> dict[str, Any]:
    """What makes a KV block's bytes mean the same on two engines, from the config
    (like NixlConnector's ``compute_nixl_compatibility_hash``, plus what NIXL checks at
    its handshake: block size and layout). Plain JSON values."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    try:
        layout: str | None = cache.get_resolved_kv_cache_layout().name
    except (ValueError, KeyError, AttributeError):
        layout = None  # not resolved here: the workers' block formats still decide
    return {
        "model": str(model.model),
        "dtype": str(model.dtype),
        "cache_dtype": str(cache.cache_dtype),
        "num_kv_heads": int(model.get_total_num_kv_heads()),
        "head_size": int(model.get_head_size()),
        "num_layers": int(model.get_total_num_hidden_layers()),
        "block_size": int(cache.block_size),
        "kv_cache_layout": layout,
        # The order of heads (H), tokens (N) and K|V content (C) inside one layer's
        # block: the layout's name without its layer (L) and block (B) axes.
        "block_order": None if layout is None else layout.replace("L", "").replace("B", ""),
        "use_mla": bool(getattr(model, "use_mla", False)),
        "layers": {},
    }


def _block_format(t: "torch.Tensor") -> list[Any]:
    """``[dtype, logical block shape, physical order]`` of one layer's KV cache view:
    the order lists the block's logical dims (1-based, size-1 dims left out: they do not
    move bytes) from the largest stride to the smallest. Two layers whose formats are
    equal store a block's elements at the same byte offsets."""
    dims = [(i, int(t.shape[i]), int(t.stride(i))) for i in range(1, t.dim())]
    order = [i for i, size, stride in sorted(dims, key=lambda d: (-d[2], d[0])) if size != 1]
    return [str(t.dtype).removeprefix("torch."), [size for _, size, _ in dims], order]


def _kv_incompatibility(ours: dict[str, Any], theirs: Any) -> str | None:
    """Why P's KV (descriptor ``theirs``, from its handshake) cannot be loaded as ours,
    or ``None`` when it can. ``layers`` (layer name -> ``_block_format``) is compared
    when both sides know their workers' formats."""
    if not isinstance(theirs, dict):
        return "P's handshake carries no KV compatibility descriptor (an older kvlease?)"
    diffs = []
    for key in _KV_KEYS:
        if key == "block_order" and None in (theirs.get(key), ours.get(key)):
            continue  # a layout not resolved at the scheduler: the layer formats decide
        if theirs.get(key) != ours.get(key):
            what = f"{key}: P {theirs.get(key)!r}, D {ours.get(key)!r}"
            if key == "block_order":
                what += (
                    f" (kv_cache_layout P {theirs.get('kv_cache_layout')!r}, "
                    f"D {ours.get('kv_cache_layout')!r})"
                )
            diffs.append(what)
    mine, p_layers = ours.get("layers") or {}, theirs.get("layers") or {}
    if mine and p_layers:
        diff = _layer_format_diff(mine, p_layers)
        if diff is not None:
            diffs.append(diff)
    return "; ".join(diffs) or None


def _layer_format_diff(mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """How P's per-layer block formats (layer name -> ``_block_format``) differ from
    ours, or ``None`` when P holds the same layers, each in the same format."""
    if set(mine) != set(theirs):
        only_p = sorted(set(theirs) - set(mine))[:3]
        only_d = sorted(set(mine) - set(theirs))[:3]
        return f"KV cache layers differ (only P: {only_p}, only D: {only_d})"
    bad = [n for n in sorted(mine) if list(theirs[n]) != list(mine[n])]
    if not bad:
        return None
    return (
        f"{len(bad)} layer(s) store a block differently, e.g. {bad[0]}: "
        f"P [dtype, shape, order] {list(theirs[bad[0]])}, D {list(mine[bad[0]])}"
    )


# ------------------------------------------------------------------ P's engine info

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


# -------------------------------------------------------------------------- metadata


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


# ------------------------------------------------------------------------ the connector


class KvleaseConnector(KVConnectorBase_V1):
    """vLLM's connector interface, delegating to the scheduler or the worker half.

    The scheduler half owns the engine cores; the worker half owns the transport agent
    and the registered KV caches. See the module docstring for the design.
    """

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "KVCacheConfig | None" = None,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = KvleaseConfig.from_vllm(vllm_config)
        self.scheduler: KvleaseScheduler | None = None
        self.worker: KvleaseWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = KvleaseScheduler(vllm_config, self.config, kv_cache_config)
        else:
            self.worker = KvleaseWorker(vllm_config, self.config)

    # -------------------------------------------------------------- scheduler side

    def _sched(self) -> "KvleaseScheduler":
        assert self.scheduler is not None, "a scheduler-side hook on the worker half"
        return self.scheduler

    def _work(self) -> "KvleaseWorker":
        assert self.worker is not None, "a worker-side hook on the scheduler half"
        return self.worker

    def on_new_request(self, request: "Request") -> None:
        self._sched().on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished(
        self, request: "Request", block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self._sched().set_xfer_handshake_metadata(metadata)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KvleaseConnectorStats(data=dict(data or {}))

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.scheduler is not None:
            return self.scheduler.counters.take()
        return self._work().counters.take()

    # ----------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        self._work().register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._work().handshake_metadata()

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvleaseConnectorMetadata)
        self._work().start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are whole-request and asynchronous (WAITING_FOR_REMOTE_KVS): nothing to
        # wait for inside a forward pass.
        return None

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: "torch.Tensor",
        attn_metadata: "AttentionMetadata",
        **kwargs: Any,
    ) -> None:
        # D pulls from P's own KV blocks: P saves nothing.
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._work().get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._work().build_worker_meta()

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.shutdown()
        if self.worker is not None:
            self.worker.shutdown()


# ------------------------------------------------------------------- scheduler half


def _params_block_ids(value: Any) -> list[int] | None:
    """``remote_block_ids`` as vLLM's proxies forward it: a list, or (from NixlConnector
    style producers) a list per KV cache group."""
    if not isinstance(value, (list, tuple)):
        return None
    if value and isinstance(value[0], (list, tuple)):
        if len(value) != 1:
            return None
        value = value[0]
    try:
        return [int(b) for b in value]
    except (TypeError, ValueError):
        return None


class KvleaseScheduler:
    """The scheduler half: both engine cores, the side channel (P) and the handshakes
    (D). ``clock`` (``time.monotonic``) is the cores' time source; tests may replace it.
    """

    def __init__(
        self,
        vllm_config: "VllmConfig",
        config: KvleaseConfig,
        kv_cache_config: "KVCacheConfig | None",
    ):
        self.config = config
        self.clock: Callable[[], float] = time.monotonic
        self.counters = _Counters()
        self.engine_id = config.engine_id
        parallel = vllm_config.parallel_config
        self.tp_size = int(parallel.tensor_parallel_size)
        if int(getattr(parallel, "pipeline_parallel_size", 1)) != 1:
            raise ConfigError("KvleaseConnector does not support pipeline parallelism")
        self.block_size = int(vllm_config.cache_config.block_size)
        num_blocks = getattr(kv_cache_config, "num_blocks", None) or getattr(
            vllm_config.cache_config, "num_gpu_blocks", None
        )
        if not num_blocks:
            raise ConfigError("the KV cache config names no block count")
        self.num_blocks = int(num_blocks)
        per_rank_heads = int(vllm_config.model_config.get_num_kv_heads(parallel))
        self.num_kv_heads = per_rank_heads * self.tp_size
        self.instance = time.time_ns() // 1000
        # What P's blocks must match to be loaded as this engine's KV (the workers'
        # block formats join it in set_xfer_handshake_metadata).
        self.kv_descriptor = _kv_descriptor(vllm_config)
        # kv_producer: P only (no DecodeCore); kv_consumer: D only (no PrefillCore, no
        # side channel); kv_both: both.
        ktc = vllm_config.kv_transfer_config
        role = str(getattr(ktc, "kv_role", None) or "kv_both")
        self.is_producer = role != "kv_consumer"
        self.is_consumer = role != "kv_producer"
        self.prefill: native.PrefillCore | None = None
        self.decode: native.DecodeCore | None = None
        if self.is_producer:
            self.prefill = native.PrefillCore(
                self.engine_id,
                tp_size=self.tp_size,
                num_blocks=self.num_blocks,
                block_size=self.block_size,
                lease_duration=config.lease_duration,
                external_blocks=True,
                first_generation=self.instance,
            )
        if self.is_consumer:
            self.decode = native.DecodeCore(
                self.engine_id,
                tp_size=self.tp_size,
                num_kv_heads=self.num_kv_heads,
                block_size=self.block_size,
                num_blocks=self.num_blocks,
                lease_duration=config.lease_duration,
                external_blocks=True,
                max_waiting=1 << 20,
            )
        # P: the workers' fence words, by rank; what the side channel serves.
        self.fences: dict[int, native.FenceWords] = {}
        self._fence_maps: list[mmap.mmap] = []
        self._workers: dict[int, KvleaseHandshakeMetadata] = {}
        # The side channel listens on side_channel_host only: the address it publishes
        # as remote_host (127.0.0.1 unless configured), not every interface.
        self.side_channel: native.SideChannelServer | None = None
        self.side_channel_port = 0
        if self.is_producer:
            self.side_channel = native.SideChannelServer(
                self._payload(),
                token=config.token,
                listen=_listen_addr(config.side_channel_host, config.side_channel_port),
            )
            self.side_channel_port = self.side_channel.port
        self._finished_sending: list[str] = []
        # D: requests the core admitted, loads planned for the workers, P engines.
        self._remote: set[str] = set()
        self._loads: list[dict[str, Any]] = []
        self._failed_loads: dict[str, list[int]] = {}
        self.engines: dict[str, dict[str, Any]] = {}
        self._new_engines: dict[str, dict[str, Any]] = {}
        self._handshakes: queue.Queue[tuple[str, dict[str, Any] | None, Exception | None]] = (
            queue.Queue()
        )
        # D: P engines whose KV this engine must not load, with the reason.
        self._incompatible: dict[str, str] = {}
        logger.info(
            "kvlease scheduler %s (%s): lease %.1fs, side channel %s, %s",
            self.engine_id,
            role,
            config.lease_duration,
            f"{config.side_channel_host}:{self.side_channel_port}"
            if self.side_channel is not None
            else "not served (kv_consumer)",
            "token set" if config.token else "NO cluster token",
        )

    def _p(self) -> native.PrefillCore:
        assert self.prefill is not None, "a P hook on a kv_consumer engine"
        return self.prefill

    def _d(self) -> native.DecodeCore:
        assert self.decode is not None, "a D hook on a kv_producer engine"
        return self.decode

    def incompatibility(self, engine: str) -> str | None:
        """Why this engine (D) refuses to load P engine ``engine``'s KV, as found at the
        last handshake with it; ``None`` when compatible or not handshaken."""
        return self._incompatible.get(engine)

    # ------------------------------------------------------------------- P side

    def _payload(self) -> bytes:
        workers = []
        for rank, w in sorted(self._workers.items()):
            workers.append(
                {
                    "rank": rank,
                    "agent_name": w.agent_name,
                    "agent_metadata": base64.b64encode(w.agent_metadata).decode(),
                    "layers": [list(layer) for layer in w.layers],
                    "fence_region": w.fence_region,
                    "num_blocks": w.num_blocks,
                    "device": w.device,
                    "kv_format": w.kv_format,
                }
            )
        return json.dumps(
            {
                "format": 2,
                "engine_id": self.engine_id,
                "instance": self.instance,
                "tp_size": self.tp_size,
                "num_blocks": self.num_blocks,
                "block_size": self.block_size,
                "num_kv_heads": self.num_kv_heads,
                # Format 2: what D checks before it loads any of P's blocks as its KV.
                "kv": self.kv_descriptor,
                "workers": workers,
            }
        ).encode()

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """The workers registered their KV caches: map their fence words and serve their
        transport metadata on the side channel."""
        for rank, meta in sorted(metadata.items()):
            if not isinstance(meta, KvleaseHandshakeMetadata):
                raise ConfigError(
                    f"worker {rank} sent {type(meta).__name__}, not KvleaseHandshakeMetadata"
                )
            self._workers[int(rank)] = meta
            path = f"/proc/{meta.fence_pid}/fd/{meta.fence_fd}"
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError as e:
                raise ConfigError(
                    f"cannot open worker {rank}'s fence words at {path} ({e}): P's "
                    "scheduler and workers must share a host"
                ) from None
            try:
                mapped = mmap.mmap(fd, max(meta.num_blocks * 8, mmap.PAGESIZE))
            finally:
                os.close(fd)
            self._fence_maps.append(mapped)
            self.fences[int(rank)] = native.FenceWords(mapped, meta.num_blocks)
        if self._workers:
            # The lowest rank's block formats stand for the engine's (every rank holds
            # the same layers in the same format; D's worker checks each P rank again).
            first = self._workers[min(self._workers)]
            self.kv_descriptor["layers"] = json.loads(json.dumps(first.kv_format))
        if self.side_channel is not None:
            self.side_channel.set_payload(self._payload())

    def _publish(self, blocks: list[int], word: int) -> None:
        for words in self.fences.values():
            words.publish(blocks, word)

    def _drain_prefill(self) -> None:
        """Fence clears and events after every input to the prefill core."""
        if self.prefill is None:
            return
        while (action := self.prefill.poll_action()) is not None:
            if isinstance(action, native.ClearFences):
                released = action.released
                # The free word first: from here vLLM may reuse the blocks.
                self._publish(released.blocks, 0)
                self._finished_sending.append(released.request)
                self.counters.add(f"leases_released_{released.reason}")
                logger.debug(
                    "lease of %s released (%s)", released.request, released.reason
                )
            elif isinstance(action, native.SendNotif):
                # Expiry notices need a connection from P to D, which this connector
                # does not open: D's fenced read catches the reclaimed lease.
                self.counters.add("expiry_notices_dropped")
        while self.prefill.poll_event() is not None:
            pass

    def _handle_notifs(self, now: float, notifs: list[tuple[str, bytes]]) -> None:
        if self.prefill is None:
            if notifs:
                # Nothing leased here: P engines never send D notifications.
                self.counters.add("notifs_ignored", len(notifs))
            return
        for sender, message in notifs:
            try:
                out = self.prefill.handle_notif(now, _engine_of(sender), sender, message)
            except KvleaseError as e:
                # A sender whose name holds no valid engine id: ignore it.
                logger.warning("notification from %r ignored: %s", sender, e)
                self.counters.add("notifs_invalid_sender")
                continue
            kind = out.get("kind")
            self.counters.add(f"notifs_{kind}")
        self._drain_prefill()

    # ------------------------------------------------------------------- D side

    def _remote_kv(self, request: "Request") -> native.RemoteKv | None:
        params = request.kv_transfer_params or {}
        blocks = _params_block_ids(params.get("remote_block_ids"))
        try:
            return native.RemoteKv(
                engine=str(params["remote_engine_id"]),
                request=str(params["remote_request_id"]),
                blocks=blocks if blocks is not None else [],
                generation=int(params["kvlease_generation"]),
                tp_size=int(params.get("tp_size", 1)),
                num_tokens=int(params.get("kvlease_num_tokens", params.get("remote_num_tokens", 0))),
                host=str(params["remote_host"]),
                port=int(params["remote_port"]),
                instance=int(params.get("kvlease_instance", 0)),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            logger.warning(
                "request %s: kv_transfer_params are not a kvlease lease (%s): computing locally",
                request.request_id,
                e,
            )
            return None

    def _start_handshakes(self) -> None:
        while (hs := self._d().poll_handshake()) is not None:
            thread = threading.Thread(
                target=self._handshake,
                args=(hs.engine, hs.host, hs.port),
                name=f"kvlease-handshake-{hs.engine}",
                daemon=True,
            )
            thread.start()

    def _handshake(self, engine: str, host: str, port: int) -> None:
        try:
            raw = native.side_channel_fetch(
                host, port, token=self.config.token, timeout=self.config.handshake_timeout
            )
            # Validated here, off the engine thread: _pump and the workers use it as is.
            info = _engine_info(raw)
            if info["engine_id"] != engine:
                raise KvleaseError(
                    f"{host}:{port} serves engine {info['engine_id']!r}, not {engine!r}"
                )
            self._handshakes.put((engine, info, None))
        except Exception as e:  # reported to the core, which fails the waiting requests
            self._handshakes.put((engine, None, e))

    def _pump(self, now: float) -> None:
        """Handshake results, then the decode core's events."""
        if self.decode is None:
            return
        self._start_handshakes()
        while True:
            try:
                engine, info, error = self._handshakes.get_nowait()
            except queue.Empty:
                break
            if info is not None:
                self._check_compatibility(engine, info)
                # Handshaken even when incompatible: D's worker 0 needs P's engine info to
                # send the aborts that free the leases D will not read.
                self.engines[engine] = info
                self._new_engines[engine] = info
                self.decode.handle_handshake(
                    now,
                    engine,
                    tp_size=info["tp_size"],
                    num_blocks=info["num_blocks"],
                    instance=info["instance"],
                )
                self.counters.add("handshakes_done")
            else:
                logger.warning("handshake with engine %s failed: %s", engine, error)
                self.decode.handle_handshake_failed(
                    now, engine, str(error), auth=isinstance(error, AuthError)
                )
                self.counters.add("handshakes_failed")
        self._drain_decode()

    def _check_compatibility(self, engine: str, info: dict[str, Any]) -> None:
        """Record whether P engine ``engine``'s KV blocks can be loaded as ours: the
        answer of the latest handshake stands (a restarted P handshakes again)."""
        reason = _kv_incompatibility(self.kv_descriptor, info["kv"])
        if reason is None:
            self._incompatible.pop(engine, None)
            return
        self._incompatible[engine] = reason
        self.counters.add("handshakes_incompatible")
        logger.error(
            "P engine %s is not KV-compatible with engine %s: %s. Its requests are "
            "computed here instead of loaded (their leases are aborted).",
            engine,
            self.engine_id,
            reason,
        )

    def _drain_decode(self) -> None:
        if self.decode is None:
            return
        while (event := self.decode.poll_event()) is not None:
            if isinstance(event, native.Loaded):
                # vLLM checks nothing more: the fence matched for every batch.
                self.decode.handle_verified(event.request)
                self.counters.add("loads_done")
                self.counters.add("bytes_loaded", event.bytes)
            elif isinstance(event, native.Finished):
                self._remote.discard(event.request)
                if event.outcome == "failed":
                    self.counters.add("loads_failed")
                    logger.warning("load of %s failed: %s", event.request, event.error)

    # ------------------------------------------------------------------ hooks

    def on_new_request(self, request: "Request") -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        if self.decode is None:
            logger.warning(
                "request %s asks to load remote KV, but this engine is a kv_producer: "
                "computing locally",
                request.request_id,
            )
            return
        remote = self._remote_kv(request)
        if remote is None:
            return
        now = self.clock()
        try:
            self.decode.on_new_request(
                now, request.request_id, int(request.num_prompt_tokens), remote
            )
        except KvleaseError as e:
            self.counters.add("requests_refused")
            logger.warning(
                "request %s refused, computing locally: %s", request.request_id, e
            )
            self._drain_decode()
            return
        self._remote.add(request.request_id)
        self.counters.add("requests_tracked")
        self._pump(now)

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        if rid not in self._remote:
            return 0, False
        self._pump(self.clock())
        decode = self._d()
        if not decode.is_waiting(rid):
            # Failed (handshake, expiry) or aborted meanwhile: compute locally.
            return 0, False
        remote = decode.remote_of(rid)
        if remote is None or not decode.is_ready(remote.engine):
            return None, False
        reason = self._incompatible.get(remote.engine)
        if reason is not None:
            # P's blocks would be loaded as KV they are not: never read them. The abort
            # frees P's lease at once; vLLM computes the prompt here whatever its
            # kv_load_failure_policy (no load was attempted).
            logger.warning(
                "request %s: not loading from P engine %s, which is not KV-compatible "
                "(%s): computing the prompt locally",
                rid,
                remote.engine,
                reason,
            )
            decode.abort(rid)
            self._drain_decode()
            self.counters.add("loads_refused_incompatible")
            return 0, False
        count = int(request.num_prompt_tokens) - int(num_computed_tokens)
        if count <= 0:
            return 0, False
        return count, True

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        rid = request.request_id
        params = request.kv_transfer_params
        if rid not in self._remote or not params or not params.get("do_remote_prefill"):
            return
        # One transfer per request, even if it is preempted and scheduled again.
        params["do_remote_prefill"] = False
        decode = self._d()
        if num_external_tokens <= 0:
            # A full local prefix hit (or nothing left to load): P may free at once.
            if decode.abort(rid):
                self.counters.add("loads_skipped")
            self._drain_decode()
            return
        local = list(blocks.get_unhashed_block_ids())
        remote = decode.remote_of(rid)
        n_remote = len(remote.blocks) if remote is not None else 0
        if len(local) > n_remote:
            local = local[:n_remote]
        skip = n_remote - len(local)
        try:
            plan = decode.start_load(rid, local, skip)
        except KvleaseError as e:
            logger.warning("request %s: cannot load (%s): recomputing", rid, e)
            self._failed_loads[rid] = local
            decode.abort(rid)
            self._drain_decode()
            return
        self._loads.append(self._load_spec(plan))
        self.counters.add("loads_started")

    def _load_spec(self, plan: native.LoadPlan) -> dict[str, Any]:
        remote = plan.remote
        p_tp = max(1, int(remote.tp_size))
        info = self.engines.get(remote.engine)
        if info is not None:
            p_tp = info["tp_size"]
        d_per = self.num_kv_heads // self.tp_size
        p_per = self.num_kv_heads // p_tp if p_tp and self.num_kv_heads % p_tp == 0 else 0
        batches = []
        for index, b in enumerate(plan.batches):
            start, end = b.heads
            whole = (
                p_per > 0
                and (start, end) == (b.d_worker * d_per, (b.d_worker + 1) * d_per)
                and (start, end) == (b.p_rank * p_per, (b.p_rank + 1) * p_per)
            )
            batches.append(
                {
                    "index": index,
                    "d_worker": b.d_worker,
                    "p_rank": b.p_rank,
                    "whole": whole,
                    "notif": bytes(b.notif),
                }
            )
        return {
            "request": plan.request,
            "engine": remote.engine,
            "remote_request": remote.request,
            "local_blocks": list(plan.blocks),
            "remote_blocks": list(remote.blocks[plan.skip_blocks :]),
            # The last block is the one least likely shared with another request's lease
            # through P's prefix cache (a shared block's word holds the later grant's
            # generation); every block of a lease carries its generation.
            "fence_block": int(remote.blocks[-1]),
            "generation": int(plan.fence_generation),
            "batches": batches,
        }

    def build_connector_meta(self, scheduler_output: Any) -> KvleaseConnectorMetadata:
        now = self.clock()
        self._pump(now)
        # P: the reaper.
        if self.prefill is not None:
            self.prefill.handle_timeout(now)
            self._drain_prefill()
        meta = KvleaseConnectorMetadata()
        if self.decode is not None:
            while (t := self.decode.poll_transmit(now)) is not None:
                # Counted as sent by D's worker 0, which sends them (vLLM sums the
                # scheduler's and the workers' stats).
                meta.transmits.append((t.engine, t.kind, bytes(t.message)))
        self._drain_decode()
        meta.loads, self._loads = self._loads, []
        meta.engines, self._new_engines = self._new_engines, {}
        meta.failed_loads, self._failed_loads = self._failed_loads, {}
        meta.finished_sending, self._finished_sending = self._finished_sending, []
        return meta

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        now = self.clock()
        worker_meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(worker_meta, KvleaseWorkerMetadata):
            self._handle_notifs(now, worker_meta.notifs)
            if self.decode is not None:
                # Each batch as soon as its worker reports it: with TP > 1 a worker
                # reports its batches in the step they end, but vLLM lists the request
                # in finished_recving only once every worker is done, maybe steps
                # later. The core completes the load when every batch is in.
                for rid, results in worker_meta.batches.items():
                    for index, (status, nbytes, error) in sorted(results.items()):
                        self.decode.handle_batch_done(
                            rid, index, status, bytes=nbytes, error=error
                        )
        self._drain_decode()

    def request_finished(
        self, request: "Request", block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        now = self.clock()
        params = request.kv_transfer_params or {}
        if rid in self._remote:
            # D: decoded to the end, or aborted before (or while) loading.
            decode = self._d()
            if not decode.request_finished(rid):
                decode.abort(rid)
            self._drain_decode()
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            # Aborted (or failed) on P: nobody will read it; vLLM frees at once.
            return False, None
        blocks = [int(b) for b in block_ids]
        if not blocks:
            return False, None
        if self.prefill is None:
            logger.warning(
                "request %s asks P to keep its KV, but this engine is a kv_consumer: "
                "no lease, its blocks are freed",
                rid,
            )
            self.counters.add("grants_refused")
            return False, None
        try:
            granted = self.prefill.handle_prefill_done_in(now, rid, blocks)
        except KvleaseError as e:
            logger.warning("request %s: no lease granted (%s)", rid, e)
            self.counters.add("grants_refused")
            self._drain_prefill()
            return False, None
        self._drain_prefill()
        # The generation is in every worker's fence words before anyone learns it.
        self._publish(blocks, granted.generation)
        self.counters.add("leases_granted")
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": blocks,
            "remote_engine_id": self.engine_id,
            "remote_request_id": rid,
            "remote_host": self.config.side_channel_host,
            "remote_port": self.side_channel_port,
            "tp_size": self.tp_size,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": int(request.num_computed_tokens),
            "transfer_mode": "pull",
            "kvlease_generation": granted.generation,
            "kvlease_instance": self.instance,
            "kvlease_num_tokens": int(request.num_prompt_tokens),
            "kvlease_lease_duration": self.config.lease_duration,
        }

    def shutdown(self) -> None:
        if self.side_channel is not None:
            self.side_channel.close()
        if self.prefill is not None:
            self.prefill.shutdown()
        if self.decode is not None:
            self.decode.shutdown()
        self.fences.clear()
        for m in self._fence_maps:
            try:
                m.close()
            except BufferError:
                # Still exported to a FenceWords someone holds: the mapping goes with it.
                pass
        self._fence_maps.clear()


# ---------------------------------------------------------------------- worker half


def _layer_layout(name: str, t: "torch.Tensor") -> tuple[int, int, int, int]:
    """``(byte offset in its storage, block stride, block bytes, num blocks)`` of one
    layer's KV cache: dim 0 counts blocks, and each block's bytes must be dense."""
    if t.dim() < 2:
        raise ConfigError(f"KV cache {name}: expected a blocks dimension and more")
    elem = t.element_size()
    sizes, strides = list(t.shape[1:]), list(t.stride()[1:])
    page = prod(sizes) * elem
    expected = 1
    for size, stride in sorted(zip(sizes, strides), key=lambda p: p[1]):
        if size != 1 and stride != expected:
            raise ConfigError(
                f"KV cache {name}: a block's bytes are not dense (shape {tuple(t.shape)}, "
                f"stride {tuple(t.stride())})"
            )
        expected *= size
    block_stride = t.stride(0) * elem
    if t.shape[0] > 1 and block_stride < page:
        raise ConfigError(f"KV cache {name}: blocks overlap (stride {block_stride} < {page})")
    storage = t.untyped_storage()
    offset = t.data_ptr() - storage.data_ptr()
    return offset, block_stride, page, int(t.shape[0])


@dataclass
class _PeerLink:
    """D's worker's connection to one P worker, with what it learned from P's engine
    info for it: made whole by ``KvleaseWorker._connect`` or not at all."""

    peer: native.Peer
    #: layer name -> (P's region, offset, block stride, block bytes, num blocks)
    layers: dict[str, tuple[native.RemoteRegion, int, int, int, int]]
    fence: native.RemoteRegion
    #: Why P's blocks cannot be read as ours, or None.
    incompatible: str | None


class KvleaseWorker:
    """The worker half: one transport agent with this worker's KV caches and fence
    words registered; posts D's fenced reads and forwards P's notifications."""

    def __init__(self, vllm_config: "VllmConfig", config: KvleaseConfig):
        self.config = config
        self.counters = _Counters()
        self.rank = self._tp_rank()
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.engine_id = config.engine_id
        host = _ip_of(config.transport_host)
        # An unspecified address (0.0.0.0 or ::) listens on every IPv4 interface.
        listen = "0.0.0.0:0" if host in ("0.0.0.0", "::") else _listen_addr(host, 0)
        self.agent = native.Agent(
            _agent_name(self.engine_id, self.rank),
            listen=listen,
            token=config.token,
            backend=config.transport,
            handshake_timeout=config.handshake_timeout,
        )
        # name -> (region, offset, block stride, block bytes, num blocks)
        self.layers: dict[str, tuple[native.Region, int, int, int, int]] = {}
        # name -> [dtype, block shape, order] (``_block_format``)
        self.kv_format: dict[str, list[Any]] = {}
        self._regions: dict[int, native.Region] = {}
        self.num_blocks = 0
        self.device = "cpu"
        self._fence_fd: int | None = None
        self._fence_map: mmap.mmap | None = None
        self._fence_region: native.Region | None = None
        # D: P engines (``_engine_info``), links by (engine, P rank), batches in flight.
        self.engines: dict[str, dict[str, Any]] = {}
        self._links: dict[tuple[str, int], _PeerLink] = {}
        # A peer that could not be reached is not tried again before this time: a dead or
        # blackholed P must not stall every step of this worker in connect timeouts.
        self._unreachable: dict[tuple[str, int], float] = {}
        # D id -> batch index -> (the posted batch, (P's engine, P rank) it reads from).
        self._inflight: dict[str, dict[int, tuple[Any, tuple[str, int]]]] = {}
        self._pending: dict[str, set[int]] = {}
        self._blocks_of: dict[str, list[int]] = {}
        self._failed: set[str] = set()
        self._results: dict[str, dict[int, tuple[str, int, str | None]]] = {}
        self._finished_recving: set[str] = set()
        self._finished_sending: set[str] = set()
        self._load_errors: set[int] = set()

    @staticmethod
    def _tp_rank() -> int:
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            return int(get_tensor_model_parallel_rank())
        except Exception:
            # No distributed state (a single worker, or a test harness): rank 0.
            return 0

    # ------------------------------------------------------------ registration

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        storages: dict[int, native.Region] = {}
        num_blocks = None
        for name in sorted(kv_caches):
            t = kv_caches[name]
            offset, stride, page, n = _layer_layout(name, t)
            storage = t.untyped_storage()
            base = storage.data_ptr()
            region = storages.get(base)
            if region is None:
                device = t.device
                ordinal = None
                if device.type == "cuda":
                    ordinal = device.index if device.index is not None else 0
                    self.device = f"cuda:{ordinal}"
                elif device.type != "cpu":
                    raise ConfigError(f"KV cache {name} is on {device.type}: unsupported")
                region = self.agent.register_memory(
                    base, storage.nbytes(), owner=storage, device=ordinal
                )
                storages[base] = region
                self._regions[region.id] = region
            self.layers[name] = (region, offset, stride, page, n)
            self.kv_format[name] = _block_format(t)
            num_blocks = n if num_blocks is None else min(num_blocks, n)
        self.num_blocks = int(num_blocks or 0)
        if self.num_blocks == 0:
            raise ConfigError("no KV cache blocks to register")
        # The fence words: a memfd this worker's scheduler maps too.
        size = max(self.num_blocks * 8, mmap.PAGESIZE)
        fd = os.memfd_create(f"kvlease-fence-{self.engine_id}-{self.rank}")
        os.ftruncate(fd, size)
        self._fence_fd = fd
        self._fence_map = mmap.mmap(fd, size)
        self._fence_region = self.agent.register(self._fence_map)
        logger.info(
            "kvlease worker %s rank %d: %d layers, %d blocks on %s, agent %s",
            self.engine_id,
            self.rank,
            len(self.layers),
            self.num_blocks,
            self.device,
            self.agent.address,
        )

    def handshake_metadata(self) -> KvleaseHandshakeMetadata:
        if self._fence_region is None or self._fence_fd is None:
            raise ConfigError("register_kv_caches must run before the handshake")
        return KvleaseHandshakeMetadata(
            rank=self.rank,
            agent_name=self.agent.name,
            agent_metadata=bytes(self.agent.metadata()),
            layers=[
                (name, region.id, offset, stride, page, n)
                for name, (region, offset, stride, page, n) in sorted(self.layers.items())
            ],
            fence_region=self._fence_region.id,
            fence_pid=os.getpid(),
            fence_fd=self._fence_fd,
            num_blocks=self.num_blocks,
            device=self.device,
            kv_format=json.loads(json.dumps(self.kv_format)),
        )

    # -------------------------------------------------------------- connecting

    def _disconnect(self, peer: native.Peer) -> None:
        try:
            self.agent.disconnect(peer)
        except KvleaseError:
            pass

    def _forget_peers(self, engine: str) -> None:
        """Every link to ``engine``: a new handshake (P restarted) may name new agents."""
        for key in [k for k in self._links if k[0] == engine]:
            self._disconnect(self._links.pop(key).peer)
        for key in [k for k in self._unreachable if k[0] == engine]:
            del self._unreachable[key]

    def _forget_link(self, key: tuple[str, int]) -> None:
        """The link to one P worker, after a failure on it: made afresh when next used.
        The links to P's other workers, and their reads, are left alone."""
        link = self._links.pop(key, None)
        if link is not None:
            self._disconnect(link.peer)

    def _link(self, engine: str, p_rank: int) -> _PeerLink:
        key = (engine, p_rank)
        link = self._links.get(key)
        if link is not None:
            return link
        retry_at = self._unreachable.get(key)
        if retry_at is not None and time.monotonic() < retry_at:
            raise KvleaseError(f"worker {p_rank} of engine {engine} was unreachable; retrying later")
        try:
            return self._connect(engine, p_rank)
        except KvleaseError:
            self._unreachable[key] = time.monotonic() + self.config.handshake_timeout
            raise

    def _connect(self, engine: str, p_rank: int) -> _PeerLink:
        """Connects to P's worker ``p_rank`` (``self.engines`` holds what D's scheduler
        validated, ``_engine_info``); the link is kept only once all of it is made."""
        key = (engine, p_rank)
        info = self.engines.get(engine)
        if info is None:
            raise KvleaseError(f"engine {engine} is not handshaken")
        w = next((w for w in info["workers"] if w["rank"] == p_rank), None)
        if w is None:
            raise KvleaseError(f"engine {engine} has no worker {p_rank} with registered KV")
        peer = self.agent.connect(w["agent_metadata"])
        try:
            if _engine_of(peer.name) != engine:
                raise KvleaseError(f"worker {p_rank} of {engine} calls itself {peer.name!r}")
            layers = {
                name: (peer.region(region), offset, stride, page, n)
                for name, region, offset, stride, page, n in w["layers"]
            }
            fence = peer.region(w["fence_region"])
        except BaseException:
            self._disconnect(peer)
            raise
        # The same check D's scheduler made at the handshake, per P worker: a batch is
        # never posted from a worker whose blocks are laid out differently.
        theirs = w["kv_format"]
        if not theirs:
            incompatible = (
                f"worker {p_rank} of {engine} names no KV block format (an older kvlease?)"
            )
        else:
            diff = _layer_format_diff(self.kv_format, theirs)
            incompatible = (
                None
                if diff is None
                else f"worker {p_rank} of {engine} is not KV-compatible: {diff}"
            )
        link = _PeerLink(peer=peer, layers=layers, fence=fence, incompatible=incompatible)
        self._links[key] = link
        self._unreachable.pop(key, None)
        self.counters.add("peers_connected")
        return link

    # ------------------------------------------------------------------ loading

    def start_load_kv(self, meta: KvleaseConnectorMetadata) -> None:
        for engine, info in meta.engines.items():
            # A new handshake (P restarted, or re-registered): its agents may be new.
            self._forget_peers(engine)
            self.engines[engine] = info
        self._finished_sending.update(meta.finished_sending)
        for rid, blocks in meta.failed_loads.items():
            self._finished_recving.add(rid)
            self._load_errors.update(blocks)
        if self.rank == 0:
            for engine, kind, message in meta.transmits:
                try:
                    self.agent.send_notif(self._link(engine, 0).peer, message)
                    self.counters.add(f"{kind}s_sent")
                except KvleaseError as e:
                    # A lost heartbeat is renewed by the next one; a lost abort by expiry.
                    # A broken connection (to P's worker 0) is dropped, to be made again.
                    if isinstance(e, (TransferError, NotifError)):
                        self._forget_link((engine, 0))
                    self.counters.add(f"{kind}s_failed")
                    logger.warning("%s to engine %s not sent: %s", kind, engine, e)
        for load in meta.loads:
            self._post(load)

    def _post(self, load: dict[str, Any]) -> None:
        rid = load["request"]
        mine = [b for b in load["batches"] if int(b["d_worker"]) == self.rank]
        self._blocks_of[rid] = list(load["local_blocks"])
        # Every batch is pending before any is posted: a batch that fails at once must
        # not finish the load while this worker's other batches are still to post.
        self._pending[rid] = {int(b["index"]) for b in mine}
        self._inflight[rid] = {}
        if not mine:
            self._finish_load(rid)
            return
        for b in mine:
            index = int(b["index"])
            try:
                batch = self._post_batch(load, b)
            except KvleaseError as e:
                self._batch_done(rid, index, "failed", 0, str(e))
                continue
            self._inflight[rid][index] = (batch, (load["engine"], int(b["p_rank"])))
        # The last batch to end (here, failed at once, or in _poll) finishes the load.

    def _post_batch(self, load: dict[str, Any], b: dict[str, Any]) -> Any:
        if not b["whole"]:
            raise KvleaseError(
                "heterogeneous TP (a batch reading part of a block's heads) is not "
                "supported by KvleaseConnector"
            )
        engine, p_rank = load["engine"], int(b["p_rank"])
        link = self._link(engine, p_rank)
        if link.incompatible is not None:
            raise KvleaseError(link.incompatible)
        local_blocks = [int(x) for x in load["local_blocks"]]
        remote_blocks = [int(x) for x in load["remote_blocks"]]
        if len(local_blocks) != len(remote_blocks):
            raise KvleaseError("the plan's block lists differ in length")
        ops = []
        for name, (region, offset, stride, page, _n) in sorted(self.layers.items()):
            remote = link.layers.get(name)
            if remote is None:
                raise KvleaseError(f"P has no KV cache layer {name}")
            r_region, r_offset, r_stride, r_page, r_n = remote
            if r_page != page:
                raise KvleaseError(f"layer {name}: P's blocks hold {r_page} bytes, ours {page}")
            if remote_blocks and max(remote_blocks) >= r_n:
                raise KvleaseError(
                    f"layer {name}: P's block {max(remote_blocks)} is past its {r_n} blocks"
                )
            # Runs of consecutive blocks on both sides with dense blocks become one op.
            i = 0
            while i < len(local_blocks):
                j = i + 1
                while (
                    j < len(local_blocks)
                    and stride == page
                    and r_stride == r_page
                    and local_blocks[j] == local_blocks[j - 1] + 1
                    and remote_blocks[j] == remote_blocks[j - 1] + 1
                ):
                    j += 1
                ops.append(
                    (
                        region,
                        offset + local_blocks[i] * stride,
                        r_region,
                        r_offset + remote_blocks[i] * r_stride,
                        page * (j - i),
                    )
                )
                i = j
        fence = (link.fence, int(load["fence_block"]) * 8, int(load["generation"]))
        batch = self.agent.post_read(
            link.peer,
            ops,
            notif=bytes(b["notif"]),
            fence=fence,
            timeout=self.config.read_timeout,
        )
        self.counters.add("batches_posted")
        return batch

    def _batch_done(self, rid: str, index: int, status: str, nbytes: int, error: str | None) -> None:
        self._results.setdefault(rid, {})[index] = (status, nbytes, error)
        self._pending.get(rid, set()).discard(index)
        self._inflight.get(rid, {}).pop(index, None)
        self.counters.add(f"batches_{status}")
        if status != "done":
            self._failed.add(rid)
            logger.warning("load of %s, batch %d: %s (%s)", rid, index, status, error)
        else:
            self.counters.add("bytes_read", nbytes)
        if not self._pending.get(rid):
            self._finish_load(rid)

    def _finish_load(self, rid: str) -> None:
        self._finished_recving.add(rid)
        if rid in self._failed:
            self._load_errors.update(self._blocks_of.get(rid, ()))
        self._failed.discard(rid)
        self._pending.pop(rid, None)
        self._inflight.pop(rid, None)
        self._blocks_of.pop(rid, None)

    def _poll(self) -> None:
        for rid, batches in list(self._inflight.items()):
            for index, (batch, key) in list(batches.items()):
                result = self.agent.poll(batch)
                if result is None:
                    continue
                error = None if result.error is None else str(result.error)
                if result.status == "failed":
                    # The connection to this P worker may be what failed: connect afresh
                    # next time. A stale batch is a lease outcome: the link is fine.
                    self._forget_link(key)
                self._batch_done(rid, index, result.status, int(result.bytes), error)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        self._poll()
        sending, self._finished_sending = self._finished_sending, set()
        recving, self._finished_recving = self._finished_recving, set()
        return sending or None, recving or None

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_worker_meta(self) -> KvleaseWorkerMetadata | None:
        notifs = [
            (sender, bytes(m))
            for sender, messages in self.agent.get_new_notifs().items()
            for m in messages
        ]
        results, self._results = self._results, {}
        if notifs:
            self.counters.add("notifs_forwarded", len(notifs))
        if not notifs and not results:
            return None
        return KvleaseWorkerMetadata(notifs=notifs, batches=results)

    def shutdown(self) -> None:
        self.agent.close()
        if self._fence_fd is not None:
            os.close(self._fence_fd)
            self._fence_fd = None
