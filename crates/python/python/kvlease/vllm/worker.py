"""The worker half: one transport agent with the worker's KV caches and fence words
registered; posts D's fenced reads and forwards P's notifications (``KvleaseWorker``)."""

from __future__ import annotations

import json
import logging
import mmap
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from .. import _kvlease as native
from ..errors import ConfigError, HandshakeError, KvleaseError, NotifError, TransferError
from ..kinds import BatchStatus, HandshakeKind
from .compat import _layer_format_diff, _rank_heads
from .config import KvleaseConfig, _agent_name, _engine_of, _ip_of, _listen_addr
from .handshake import EngineInfo
from .hybrid import _group_pairs
from .layout import (
    format_parts,
    layer_backends,
    layer_format,
    layer_layout,
    selection,
    sub_block_runs,
    token_segments,
)
from .metadata import (
    BatchOutcome,
    BatchSpec,
    KvleaseConnectorMetadata,
    KvleaseHandshakeMetadata,
    KvleaseWorkerMetadata,
    LoadSpec,
    ReceivedNotif,
    ReservationEndSpec,
    ReserveSpec,
    SaveSpec,
    WriteOutcome,
    WriteSpec,
)

#: The most bytes one write op carries (D's receiver buffers a write whole, up to 16 MiB).
MAX_WRITE_OP = 16 * 1024 * 1024
from .stats import _Counters

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

logger = logging.getLogger("kvlease.vllm")

#: vLLM's ``CopyBlocksOp`` (``set_host_xfer_buffer_ops``): ``(src caches, dst caches, src
#: block ids, dst block ids, "h2d" | "d2h")``, every layer of the dicts.
CopyBlocksOp = Callable[
    [dict[str, "torch.Tensor"], dict[str, "torch.Tensor"], list[int], list[int], str], None
]


def _index_copy_blocks(
    src_kv_caches: dict[str, "torch.Tensor"],
    dst_kv_caches: dict[str, "torch.Tensor"],
    src_block_ids: list[int],
    dst_block_ids: list[int],
    direction: str,
) -> None:
    """vLLM's ``copy_kv_blocks`` with the copy CudaPlatform makes (``dst[ids] =
    src[ids]`` on dim 0, the blocks, moved to the destination's device), for a platform
    that has no block copy of its own: vLLM 0.33's CpuPlatform lacks
    ``swap_out_blocks_to_host`` and ``insert_blocks_to_device``, which vLLM's
    ``copy_kv_blocks`` calls (and so does its UnspecifiedPlatform, a CUDA build of vLLM
    on a machine without a GPU)."""
    import torch

    if not src_block_ids or len(src_block_ids) != len(dst_block_ids):
        return
    for name, src in src_kv_caches.items():
        dst = dst_kv_caches[name]
        s_ids = torch.tensor(src_block_ids, dtype=torch.int64, device=src.device)
        d_ids = torch.tensor(dst_block_ids, dtype=torch.int64, device=dst.device)
        dst[d_ids] = src[s_ids].to(dst.device)


def _copy_op_for_platform(op: CopyBlocksOp) -> CopyBlocksOp:
    """The copy op to run: ``op`` as vLLM gave it, unless it is vLLM's own
    ``copy_kv_blocks`` on a platform without the block copies it calls (CPU): then the
    same copy made with torch (``_index_copy_blocks``)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import copy_kv_blocks
        from vllm.platforms import current_platform
    except ImportError:
        return op
    if op is copy_kv_blocks and any(
        getattr(current_platform, name, None) is None
        for name in ("swap_out_blocks_to_host", "insert_blocks_to_device")
    ):
        return _index_copy_blocks
    return op


@dataclass
class _PeerLink:
    """D's worker's connection to one P worker, with what it learned from P's engine
    info for it: made whole by ``KvleaseWorker._connect`` or not at all."""

    peer: native.Peer
    #: layer name -> (P's region, offset, block stride, block bytes, num blocks)
    layers: dict[str, tuple[native.RemoteRegion, int, int, int, int]]
    fence: native.RemoteRegion
    #: layer name -> P's ``layout.layer_format`` of it.
    formats: dict[str, list[Any]]
    #: Why P's blocks cannot be read as ours, or None.
    incompatible: str | None


@dataclass
class _Load:
    """One request's load on this worker, from its batches posted to the last one ended
    (then ``_finish_load`` reports it)."""

    #: D's blocks it writes: reported as load errors when a batch failed or was stale.
    blocks: list[int]
    #: Indexes of this worker's batches not ended yet.
    pending: set[int]
    #: Batch index -> (the posted batch, (P's engine, P rank) it reads from).
    inflight: dict[int, tuple[native.Batch, tuple[str, int]]] = field(default_factory=dict)
    #: Whether a batch failed or was stale.
    failed: bool = False
    #: Batch index -> (when it was posted, the backend it reads over), for the stats.
    posted: dict[int, tuple[float, str]] = field(default_factory=dict)
    #: Host buffer: D's blocks read into it, per KV cache group (copied to the device
    #: once every batch ended well); empty when this worker reads nothing of the load.
    host_groups: list[list[int]] = field(default_factory=list)


class KvleaseWorker:
    """The worker half: one transport agent with this worker's KV caches and fence
    words registered; posts D's fenced reads and forwards P's notifications."""

    def __init__(self, vllm_config: "VllmConfig", config: KvleaseConfig):
        self.config = config
        self.counters = _Counters()
        self.rank = self._tp_rank()
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.cache_dtype = str(vllm_config.cache_config.cache_dtype)
        #: Where ``register_kv_caches`` finds each layer's attention backend.
        self.vllm_config = vllm_config
        self.engine_id = config.engine_id
        host = _ip_of(config.transport_host)
        port = 0
        if config.transport_port:
            parallel = vllm_config.parallel_config
            dp = int(getattr(parallel, "data_parallel_rank_local", None) or 0)
            port = config.transport_port + dp * self.tp_size + self.rank
            if port > 65535:
                raise ConfigError(
                    f"transport_port {config.transport_port} + data-parallel rank {dp} x "
                    f"tp_size {self.tp_size} + rank {self.rank} is past 65535"
                )
        # An unspecified address (0.0.0.0 or ::) listens on every IPv4 interface.
        listen = f"0.0.0.0:{port}" if host in ("0.0.0.0", "::") else _listen_addr(host, port)
        backend = config.transport
        self.agent = native.Agent(
            _agent_name(self.engine_id, self.rank),
            listen=listen,
            token=config.token,
            backend=backend,
            handshake_timeout=config.handshake_timeout,
            allow_unauthenticated=config.allow_unauthenticated,
        )
        # name -> (region, offset, block stride, block bytes, num blocks)
        self.layers: dict[str, tuple[native.Region, int, int, int, int]] = {}
        # name -> [dtype, block shape, order, axes, backend] (``layout.layer_format``)
        self.kv_format: dict[str, list[Any]] = {}
        #: Hybrid models: layer name -> KV cache group (``hybrid._layer_groups``), set by
        #: the connector; a layer reads only its group's pairs of a load.
        self.layer_groups: dict[str, int] = {}
        self._regions: dict[int, native.Region] = {}
        # The host buffer (``kv_buffer_device`` ``cpu``), named as NixlConnector names
        # it: the KV caches vLLM computes in, their host copies (what is registered and
        # read), and the copy op vLLM gives (``set_host_xfer_buffer_ops``).
        self.use_host_buffer = config.use_host_buffer
        self.device_kv_caches: dict[str, "torch.Tensor"] = {}
        self.host_xfer_buffers: dict[str, "torch.Tensor"] = {}
        self.copy_blocks: CopyBlocksOp | None = None
        self.num_blocks = 0
        self.device = "cpu"
        self._fence_fd: int | None = None
        self._fence_map: mmap.mmap | None = None
        self._fence_region: native.Region | None = None
        # D: P engines (``_engine_info``), links by (engine, P rank), batches in flight.
        self.engines: dict[str, EngineInfo] = {}
        self._links: dict[tuple[str, int], _PeerLink] = {}
        # A peer that could not be reached is not tried again before this time: a dead or
        # blackholed P must not stall every step of this worker in connect timeouts.
        self._unreachable: dict[tuple[str, int], float] = {}
        self._loads: dict[str, _Load] = {}
        # What the step reports (``get_finished``, ``get_block_ids_with_load_errors``,
        # ``build_connector_worker_meta``), gathered since the last report.
        self._outcomes: dict[str, dict[int, BatchOutcome]] = {}
        self._finished_recving: set[str] = set()
        self._finished_sending: set[str] = set()
        self._load_errors: set[int] = set()
        # Push mode, P: writes in flight (transfer -> generation, its batches with their
        # D link keys, the errors so far) and how they ended, for the scheduler.
        self._writes: dict[str, tuple[int, list[tuple[native.Batch, tuple[str, int]]], list[str]]] = {}
        self._write_outcomes: dict[str, list[WriteOutcome]] = {}

    @staticmethod
    def _tp_rank() -> int:
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            return int(get_tensor_model_parallel_rank())
        except Exception:
            # No distributed state (a single worker, or a test harness): rank 0.
            return 0

    # ------------------------------------------------------------ registration

    def initialize_host_xfer_buffer(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        """Host buffers laid out as the KV caches are: per backing storage of the caches
        one host storage of its size (pinned when the caches are CUDA memory), and per
        layer a view of the same shape, dtype, strides and offset in it. Block ``b`` of
        a layer's buffer holds block ``b`` of its cache, the block formats are the
        caches' (D compares them), and layers sharing memory share it here too."""
        import torch

        pin = torch.cuda.is_available() and any(
            t.device.type == "cuda" for t in kv_caches.values()
        )
        backing: dict[int, "torch.Tensor"] = {}
        buffers: dict[str, "torch.Tensor"] = {}
        for name in sorted(kv_caches):
            t = kv_caches[name]
            storage = t.untyped_storage()
            host = backing.get(storage.data_ptr())
            if host is None:
                # Rounded up so that any element size views it whole.
                nbytes = -(-storage.nbytes() // 16) * 16
                host = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pin)
                backing[storage.data_ptr()] = host
            buffers[name] = host.view(t.dtype).as_strided(
                tuple(t.shape), tuple(t.stride()), t.storage_offset()
            )
        self.host_xfer_buffers = buffers
        logger.info(
            "kvlease worker %s rank %d: host buffer of %d bytes%s for %d layers",
            self.engine_id,
            self.rank,
            sum(h.numel() for h in backing.values()),
            " (pinned)" if pin else "",
            len(buffers),
        )

    def set_host_xfer_buffer_ops(self, copy_operation: CopyBlocksOp) -> None:
        """vLLM's block copy between the KV caches and the host buffers, given by its
        model runners right after ``register_kv_caches``. Without a host buffer it is
        not needed (NixlConnector ignores it too)."""
        if not self.use_host_buffer:
            return
        self.copy_blocks = _copy_op_for_platform(copy_operation)

    def _copy_op(self) -> CopyBlocksOp:
        if self.copy_blocks is None:
            raise ConfigError(
                "kv_buffer_device is 'cpu' (a host buffer), but vLLM gave the connector "
                "no copy op between the KV caches and the host buffer "
                "(set_host_xfer_buffer_ops, which vLLM's model runners call after "
                "register_kv_caches): the KV cannot be staged"
            )
        return self.copy_blocks

    def _host_copy(self, direction: str, block_groups: list[list[int]]) -> int:
        """Copies blocks between the KV caches and the host buffers (``d2h`` or
        ``h2d``), each KV cache group's blocks in its own layers (one group: every layer
        every block). Returns the blocks copied per layer."""
        op = self._copy_op()
        device, host = self.device_kv_caches, self.host_xfer_buffers
        src, dst = (device, host) if direction == "d2h" else (host, device)
        groups = [[int(b) for b in g] for g in block_groups]
        if len(groups) <= 1 or not self.layer_groups:
            blocks = [b for g in groups for b in g]
            if blocks:
                op(src, dst, blocks, blocks, direction)
            return len(blocks)
        for index, blocks in enumerate(groups):
            names = [n for n in src if self.layer_groups.get(n) == index]
            if blocks and names:
                op({n: src[n] for n in names}, {n: dst[n] for n in names}, blocks, blocks,
                   direction)
        # A layer no group names (none in vLLM's hybrid configs) gets every block.
        rest = [n for n in src if n not in self.layer_groups]
        blocks = [b for g in groups for b in g]
        if rest and blocks:
            op({n: src[n] for n in rest}, {n: dst[n] for n in rest}, blocks, blocks,
               direction)
        return len(blocks)

    def save_kv_to_host(self, saves: list[SaveSpec]) -> None:
        """P: after the step's forward (``wait_for_save``), the blocks of the requests
        whose prompt it completed, KV caches to host buffers, synchronously (the copy op
        returns with the bytes in host memory). The scheduler grants their leases only
        after this step's output, so D never reads a block not yet copied."""
        for spec in saves:
            n = self._host_copy("d2h", spec.block_groups)
            self.counters.add("host_blocks_saved", n)

    def sync_recved_kv_to_device(self, rid: str, record: _Load) -> None:
        """D: a load's blocks read into the host buffers, to the KV caches, before the
        request is reported done receiving (only the blocks this worker read)."""
        n = self._host_copy("h2d", record.host_groups)
        self.counters.add("host_blocks_synced", n)
        logger.debug("load of %s: %d blocks copied from the host buffer", rid, n)

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        self.device_kv_caches = dict(kv_caches)
        if self.use_host_buffer:
            # The transport reads and writes the host copies, never the caches.
            self.initialize_host_xfer_buffer(kv_caches)
            kv_caches = self.host_xfer_buffers
        storages: dict[int, native.Region] = {}
        num_blocks = None
        backends = layer_backends(self.vllm_config, sorted(kv_caches))
        for name in sorted(kv_caches):
            t = kv_caches[name]
            offset, stride, page, n = layer_layout(name, t)
            storage = t.untyped_storage()
            base = storage.data_ptr()
            region = storages.get(base)
            if region is None:
                device = t.device
                ordinal = None
                if device.type == "cuda":
                    if self.config.push:
                        # The transport would write through host bounce buffers, but
                        # that path has not run against vLLM's CUDA caches on a GPU, and
                        # vLLM does not verify the KV it gets: refused rather than risk a
                        # wrong token.
                        raise ConfigError(
                            f"KV cache {name} is on {device}: the connector's push mode "
                            "supports KV caches in host memory only (CUDA KV caches are "
                            "not supported with it yet); use pull mode (KvleaseConnector) "
                            "on GPUs"
                        )
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
            self.kv_format[name] = layer_format(t, backends[name], self.cache_dtype)
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
        first = self.kv_format[min(self.kv_format)]
        logger.info(
            "kvlease worker %s rank %d: %d layers, %d blocks on %s%s, agent %s; block "
            "format [dtype, shape, order, axes, backend] %s",
            self.engine_id,
            self.rank,
            len(self.layers),
            self.num_blocks,
            self.device,
            " (host buffer)" if self.use_host_buffer else "",
            self.agent.address,
            first,
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
        w = info.worker(p_rank)
        if w is None:
            raise KvleaseError(f"engine {engine} has no worker {p_rank} with registered KV")
        peer = self.agent.connect(w.agent_metadata)
        try:
            if _engine_of(peer.name) != engine:
                raise HandshakeError(
                    f"worker {p_rank} of {engine} calls itself {peer.name!r}",
                    kind=HandshakeKind.NOT_FOUND,
                )
            layers = {
                name: (peer.region(region), offset, stride, page, n)
                for name, region, offset, stride, page, n in w.layers
            }
            fence = peer.region(w.fence_region)
        except BaseException:
            self._disconnect(peer)
            raise
        # The same check D's scheduler made at the handshake, per P worker: a batch is
        # never posted from a worker whose blocks are laid out differently (with another
        # TP size, only the head count of a block may differ, by the TP ratio).
        theirs = w.kv_format
        heads = None
        if info.kv is not None and info.tp_size != self.tp_size:
            d_heads = _rank_heads(info.kv, self.tp_size)
            p_heads = _rank_heads(info.kv, info.tp_size)
            if d_heads is not None and p_heads is not None:
                heads = (d_heads, p_heads)
        tokens = None
        p_bs = None if info.kv is None else info.kv.get("block_size")
        if type(p_bs) is int and p_bs != self.block_size:
            tokens = (self.block_size, p_bs)
        if not theirs:
            incompatible = (
                f"worker {p_rank} of {engine} names no KV block format (an older kvlease?)"
            )
        else:
            diff = _layer_format_diff(self.kv_format, theirs, heads=heads, tokens=tokens)
            incompatible = (
                None
                if diff is None
                else f"worker {p_rank} of {engine} is not KV-compatible: {diff}"
            )
        link = _PeerLink(
            peer=peer,
            layers=layers,
            fence=fence,
            formats=dict(theirs or {}),
            incompatible=incompatible,
        )
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
        for engine in meta.dropped_engines:
            self._forget_peers(engine)
            self.engines.pop(engine, None)
        self._finished_sending.update(meta.finished_sending)
        for rid, blocks in meta.failed_loads.items():
            self._finished_recving.add(rid)
            self._load_errors.update(blocks)
        for end in meta.reservation_ends:
            self._end_reservation(end)
        for res in meta.reserves:
            self._reserve(res)
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
        for write in meta.writes:
            self._post_write(write)

    # ---------------------------------------------------------------- push mode

    def _fence_words(self, blocks: list[int], value: int) -> None:
        """Push mode, D: ``value`` in the write-fence words of ``blocks``, under the
        agent's write lock (after it returns, no write of another generation lands)."""
        if self._fence_region is None:
            raise ConfigError("register_kv_caches must run before a reservation")
        for b in blocks:
            self.agent.set_write_fence(self._fence_region, int(b) * 8, int(value))

    def _reserve(self, res: ReserveSpec) -> None:
        """Push mode, D: the reservation's generation in the fence words, then (worker 0)
        the registration to P's worker 0. A registration that cannot be sent is not
        retried: no heartbeat comes, and the reservation expires."""
        self._fence_words(res.blocks, res.generation)
        self.counters.add("reservations_fenced")
        if self.rank != 0:
            return
        try:
            peer = self._link(res.engine, 0).peer
            for message in res.messages:
                self.agent.send_notif(peer, bytes(message))
            self.counters.add("registrations_sent")
        except KvleaseError as e:
            if isinstance(e, (TransferError, NotifError)):
                self._forget_link((res.engine, 0))
            self.counters.add("registrations_failed")
            logger.warning("registration of %s to engine %s not sent: %s", res.request,
                           res.engine, e)

    def _end_reservation(self, end: ReservationEndSpec) -> None:
        """Push mode, D: the fence words cleared, then the request reported."""
        self._fence_words(end.blocks, 0)
        # Aborted too: vLLM frees a request's blocks that ended while it waited for
        # remote KV only once it is reported received.
        self._finished_recving.add(end.request)
        if end.outcome not in ("written", "aborted"):
            self._load_errors.update(int(b) for b in end.blocks)
        else:
            self.counters.add("blocks_pushed", len(end.blocks))

    def _post_write(self, spec: WriteSpec) -> None:
        """Push mode, P: this worker's heads of its blocks written into the D workers the
        scheduler paired it with (``spec.pairs``: D's worker of its rank, whole blocks,
        when the TP sizes are equal), one batch each, byte runs by the layout math of the
        read path (``_block_ops``), each fenced by its D worker's word. The worker's
        outcome is one, when every batch ended."""
        generation = int(spec.generation)
        mine = [(d, ph, dh) for p, d, ph, dh in spec.pairs if int(p) == self.rank]
        batches: list[tuple[native.Batch, tuple[str, int]]] = []
        errors: list[str] = []
        local = [int(b) for b in spec.local_blocks]
        remote = [int(b) for b in spec.remote_blocks]
        if not spec.pairs:
            # No worker writes: the push must not be reported written.
            errors.append("the write names no worker pairs")
        for d_rank, p_heads, d_heads in mine:
            key = (spec.engine, int(d_rank))
            try:
                link = self._link(spec.engine, int(d_rank))
                if link.incompatible is not None:
                    raise KvleaseError(link.incompatible)
                if len(local) != len(remote) or not local:
                    raise KvleaseError("the write's block lists differ in length or are empty")
                pair = BatchSpec(0, int(d_rank), self.rank,  # type: ignore[arg-type]
                                 None if p_heads is None else tuple(p_heads),
                                 None if d_heads is None else tuple(d_heads), b"")
                ops = []
                for region, lo, r_region, ro, length in self._block_ops(
                    link, pair, local, remote, (), peer="D"
                ):
                    for at in range(0, length, MAX_WRITE_OP):
                        n = min(MAX_WRITE_OP, length - at)
                        ops.append((region, lo + at, r_region, ro + at, n))
                fence = (link.fence, int(spec.fence_block) * 8, generation)
                batches.append((
                    self.agent.post_write(
                        link.peer, ops, fence=fence, timeout=self.config.read_timeout
                    ),
                    key,
                ))
                self.counters.add("writes_posted")
            except KvleaseError as e:
                logger.warning("push of %s to %s worker %s not posted: %s", spec.transfer,
                               spec.engine, d_rank, e)
                errors.append(str(e))
                break
        self._writes[spec.transfer] = (generation, batches, errors)
        self._poll_writes()

    def _poll_writes(self) -> None:
        for transfer, (generation, batches, errors) in list(self._writes.items()):
            pending = []
            for batch, key in batches:
                result = self.agent.poll(batch)
                if result is None:
                    pending.append((batch, key))
                    continue
                if result.status == BatchStatus.FAILED:
                    self._forget_link(key)
                if result.status == BatchStatus.DONE:
                    self.counters.add("bytes_written", int(result.bytes))
                else:
                    errors.append(f"{result.status}: {result.error}")
            if pending:
                self._writes[transfer] = (generation, pending, errors)
                continue
            del self._writes[transfer]
            self._write_outcomes.setdefault(transfer, []).append(
                WriteOutcome(generation, not errors, "; ".join(errors) or None)
            )

    def _post(self, load: LoadSpec) -> None:
        rid = load.request
        mine = [b for b in load.batches if b.d_worker == self.rank]
        previous = self._loads.get(rid)
        host_groups: list[list[int]] = []
        if self.use_host_buffer and mine:
            self._copy_op()  # no read lands in a host buffer that cannot be synced
            local = [int(x) for x in load.local_blocks]
            sizes = tuple(getattr(load, "group_sizes", ()) or ())
            if sizes:
                starts = [sum(sizes[:i]) for i in range(len(sizes))]
                host_groups = [local[a : a + n] for a, n in zip(starts, sizes)]
            else:
                host_groups = [local]
        # Every batch is pending before any is posted: a batch that fails at once must
        # not finish the load while this worker's other batches are still to post.
        record = _Load(
            blocks=list(load.local_blocks),
            pending={b.index for b in mine},
            failed=previous is not None and previous.failed,
            host_groups=host_groups,
        )
        self._loads[rid] = record
        if not mine:
            self._finish_load(rid)
            return
        for b in mine:
            try:
                batch = self._post_batch(load, b)
            except KvleaseError as e:
                self._batch_done(rid, b.index, BatchStatus.FAILED, 0, str(e))
                continue
            record.inflight[b.index] = (batch, (load.engine, b.p_rank))
            link = self._links.get((load.engine, b.p_rank))
            backend = str(link.peer.backend) if link is not None else "unknown"
            record.posted[b.index] = (time.monotonic(), backend)
        # The last batch to end (here, failed at once, or in _poll) finishes the load.

    def _post_batch(self, load: LoadSpec, b: BatchSpec) -> native.Batch:
        engine, p_rank = load.engine, b.p_rank
        link = self._link(engine, p_rank)
        if link.incompatible is not None:
            raise HandshakeError(link.incompatible, kind=HandshakeKind.INCOMPATIBLE)
        sizes = tuple(getattr(load, "group_sizes", ()) or ())
        if load.remote_block_size and load.remote_block_size != load.block_size:
            if sizes:
                raise KvleaseError(
                    "a hybrid model's KV cache groups between P and D of different block "
                    "sizes are not supported"
                )
            ops = self._token_ops(link, load, b)
        else:
            all_local = [int(x) for x in load.local_blocks]
            all_remote = [int(x) for x in load.remote_blocks]
            if len(all_local) != len(all_remote):
                raise KvleaseError("the plan's block lists differ in length")
            if sizes and sum(sizes) != len(all_local):
                raise KvleaseError("the plan's KV cache groups do not add up to its blocks")
            ops = self._block_ops(link, b, all_local, all_remote, sizes)
        fence = (link.fence, int(load.fence_block) * 8, int(load.generation))
        batch = self.agent.post_read(
            link.peer,
            ops,
            notif=bytes(b.notif),
            fence=fence,
            timeout=self.config.read_timeout,
        )
        self.counters.add("batches_posted")
        return batch

    def _token_ops(self, link: _PeerLink, load: LoadSpec, b: BatchSpec) -> list[Any]:
        """The read ops of batch ``b`` when P's blocks hold another number of tokens
        than ours (``load.remote_block_size``): per layer, the batch's heads of each run
        of tokens within one block on both sides (``layout.token_segments``), as byte
        runs (``layout.sub_block_runs`` over the dims the layer's format names: a run per
        head and K/V plane where tokens are inside them, per token where they are
        outside)."""
        segments = token_segments(
            [int(x) for x in load.local_blocks],
            [int(x) for x in load.remote_blocks],
            (int(load.block_size), int(load.remote_block_size)),
            int(load.first_token),
            int(load.num_tokens),
        )
        ops = []
        for name, (region, offset, stride, page, _n) in sorted(self.layers.items()):
            remote = link.layers.get(name)
            if remote is None or name not in link.formats:
                raise KvleaseError(f"P has no KV cache layer {name}")
            r_region, r_offset, r_stride, r_page, r_n = remote
            d_fmt, p_fmt = self.kv_format[name], link.formats[name]
            d_axes, p_axes = format_parts(d_fmt)[3], format_parts(p_fmt)[3]
            if d_axes is None or d_axes != p_axes or "N" not in d_axes:
                raise KvleaseError(
                    f"layer {name}: blocks of P {p_fmt}, D {d_fmt} do not say where their "
                    "tokens are"
                )
            n_dim = d_axes.index("N")
            sizes = (int(d_fmt[1][n_dim]), int(p_fmt[1][n_dim]))
            if sizes != (load.block_size, load.remote_block_size):
                raise KvleaseError(
                    f"layer {name}: blocks of P {p_fmt[1]}, D {d_fmt[1]} do not hold "
                    f"P {load.remote_block_size}, D {load.block_size} tokens"
                )
            cache: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}
            for lb, lt, rb, rt, count in segments:
                if rb >= r_n:
                    raise KvleaseError(f"layer {name}: P's block {rb} is past its {r_n} blocks")
                runs = cache.get((lt, rt, count))
                if runs is None:
                    runs = cache[(lt, rt, count)] = sub_block_runs(
                        (d_fmt, page),
                        (p_fmt, r_page),
                        selection(d_fmt, heads=b.local_heads, tokens=(lt, lt + count)),
                        selection(p_fmt, heads=b.remote_heads, tokens=(rt, rt + count)),
                    )
                local_at, remote_at = offset + lb * stride, r_offset + rb * r_stride
                for lo, ro, length in runs:
                    ops.append((region, local_at + lo, r_region, remote_at + ro, length))
        return ops

    def _block_ops(
        self,
        link: _PeerLink,
        b: BatchSpec,
        all_local: list[int],
        all_remote: list[int],
        sizes: tuple[int, ...],
        peer: str = "P",
    ) -> list[Any]:
        """The read ops of batch ``b`` when P's blocks and ours hold as many tokens:
        ``all_local[i]`` receives ``all_remote[i]`` (the batch's heads of it); with KV
        cache groups (``sizes``), each layer only its own group's pairs. A push's write
        ops are the same runs the other way (``peer``, the far side, is then D)."""
        ops = []
        for name, (region, offset, stride, page, _n) in sorted(self.layers.items()):
            # A hybrid model's layer reads its own KV cache group's pairs only.
            local_blocks, remote_blocks = _group_pairs(
                all_local, all_remote, sizes, self.layer_groups.get(name)
            )
            if not local_blocks:
                continue
            remote = link.layers.get(name)
            if remote is None or name not in link.formats:
                raise KvleaseError(f"{peer} has no KV cache layer {name}")
            r_region, r_offset, r_stride, r_page, r_n = remote
            if remote_blocks and max(remote_blocks) >= r_n:
                raise KvleaseError(
                    f"layer {name}: {peer}'s block {max(remote_blocks)} is past its {r_n} blocks"
                )
            # The batch's heads within each block: all of it when both sides hold the
            # same heads in the same layout, else a run per head slice (per token in a
            # tokens-outer block, one run in a heads-outer one).
            d_fmt, p_fmt = self.kv_format[name], link.formats[name]
            runs = sub_block_runs(
                (d_fmt, page),
                (p_fmt, r_page),
                selection(d_fmt, heads=b.local_heads),
                selection(p_fmt, heads=b.remote_heads),
            )
            if runs != [(0, 0, page)] or r_page != page:
                for lb, rb in zip(local_blocks, remote_blocks):
                    for lo, ro, length in runs:
                        ops.append(
                            (
                                region,
                                offset + lb * stride + lo,
                                r_region,
                                r_offset + rb * r_stride + ro,
                                length,
                            )
                        )
                continue
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
        return ops

    def _batch_done(
        self,
        rid: str,
        index: int,
        status: BatchStatus,
        nbytes: int,
        error: str | None,
        backend: str | None = None,
    ) -> None:
        """Batch ``index`` of ``rid`` ended; ``backend`` is the one that moved its bytes
        (``BatchResult.backend``: ``cma`` over a ``shm`` link for memory outside a
        memfd), else the link's as posted."""
        self._outcomes.setdefault(rid, {})[index] = BatchOutcome(status, nbytes, error)
        record = self._loads.get(rid)
        if record is not None:
            record.pending.discard(index)
            record.inflight.pop(index, None)
        self.counters.add(f"batches_{status}")
        posted = record.posted.pop(index, None) if record is not None else None
        if posted is not None:
            # Posted reads by backend (vllm:kvlease_reads, _read_bytes, _read_seconds).
            at, link_backend = posted
            backend = backend or link_backend
            self.counters.add(f"reads_{status}.{backend}")
            if status == BatchStatus.DONE:
                self.counters.add(f"read_bytes.{backend}", nbytes)
                self.counters.observe(f"read_seconds.{backend}", time.monotonic() - at)
        if status != BatchStatus.DONE:
            if record is not None:
                record.failed = True
            logger.warning("load of %s, batch %d: %s (%s)", rid, index, status, error)
        else:
            self.counters.add("bytes_read", nbytes)
        if record is None or not record.pending:
            self._finish_load(rid)

    def _finish_load(self, rid: str) -> None:
        record = self._loads.pop(rid, None)
        if record is not None and record.failed:
            self._load_errors.update(record.blocks)
        elif record is not None and record.host_groups:
            # Every batch read into the host buffer: the KV caches get it now, before
            # vLLM learns the load is done (the caches were not written before).
            self.sync_recved_kv_to_device(rid, record)
        self._finished_recving.add(rid)

    def _poll(self) -> None:
        for rid, record in list(self._loads.items()):
            for index, (batch, key) in list(record.inflight.items()):
                result = self.agent.poll(batch)
                if result is None:
                    continue
                error = None if result.error is None else str(result.error)
                status = result.status
                if status == BatchStatus.FAILED:
                    # The connection to this P worker may be what failed: connect afresh
                    # next time. A stale batch is a lease outcome: the link is fine.
                    self._forget_link(key)
                used = None if result.backend is None else str(result.backend)
                self._batch_done(rid, index, status, int(result.bytes), error, used)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        self._poll()
        if self._writes:
            self._poll_writes()
        sending, self._finished_sending = self._finished_sending, set()
        recving, self._finished_recving = self._finished_recving, set()
        return sending or None, recving or None

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_worker_meta(self) -> KvleaseWorkerMetadata | None:
        notifs = [
            ReceivedNotif(sender, bytes(m))
            for sender, messages in self.agent.get_new_notifs().items()
            for m in messages
        ]
        results, self._outcomes = self._outcomes, {}
        writes, self._write_outcomes = self._write_outcomes, {}
        if notifs:
            self.counters.add("notifs_forwarded", len(notifs))
        if not notifs and not results and not writes:
            return None
        return KvleaseWorkerMetadata(notifs=notifs, batches=results, writes=writes)

    def shutdown(self) -> None:
        self.agent.close()
        if self._fence_fd is not None:
            os.close(self._fence_fd)
            self._fence_fd = None
