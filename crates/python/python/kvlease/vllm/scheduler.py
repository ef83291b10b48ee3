"""The scheduler half: both engine cores, P's side channel and fence words, D's
handshakes and load plans (``KvleaseScheduler``)."""

from __future__ import annotations

import dataclasses
import json
import logging
import mmap
import os
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from .. import _kvlease as native
from ..errors import ConfigError, HandshakeError, InvalidArgument, KvleaseError
from ..kinds import HandshakeKind, NotifKind, Outcome
from .compat import _kv_descriptor, _kv_incompatibility
from .config import KvleaseConfig, _engine_of, _listen_addr
from .handshake import EngineInfo, _engine_info
from .hybrid import _clip_groups, _group_windows, _pair_groups
from .push import (
    PEER_PREFIX,
    PushDecode,
    PushFrame,
    PushPrefill,
    is_push_frame,
    p_transfer,
    parse,
    prompt_digest,
)
from .metadata import (
    BatchSpec,
    KvleaseConnectorMetadata,
    KvleaseHandshakeMetadata,
    KvleaseWorkerMetadata,
    LoadSpec,
    ReceivedNotif,
    SaveSpec,
    TransmitSpec,
)
from .stats import _Counters

#: Seconds a holder's measured clock offset is used before it is probed again.
CLOCK_PROBE_EVERY = 300.0
#: Probes per measurement (the lowest round trip is kept).
CLOCK_PROBE_SAMPLES = 8

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvlease.vllm")


def _with_blocks(remote: native.RemoteKv, blocks: list[int]) -> native.RemoteKv:
    """``remote`` with its block ids replaced by ``blocks``, every other field kept."""
    return native.RemoteKv(
        engine=remote.engine,
        request=remote.request,
        blocks=blocks,
        generation=remote.generation,
        tp_size=remote.tp_size,
        num_tokens=remote.num_tokens,
        host=remote.host,
        port=remote.port,
        instance=remote.instance,
    )


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
        # Hybrid models (SupportsHMA): per KV cache group, the blocks a request needs at
        # most (0: all; a sliding window's in-window tail otherwise).
        self.group_windows = _group_windows(kv_cache_config)
        # MLA: one latent vector per token, the same on every TP rank (one "head",
        # replicated); otherwise each rank holds its share of the KV heads.
        self.kv_replicated = bool(getattr(vllm_config.model_config, "use_mla", False))
        per_rank_heads = int(vllm_config.model_config.get_num_kv_heads(parallel))
        self.num_kv_heads = 1 if self.kv_replicated else per_rank_heads * self.tp_size
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
                max_lease_lifetime=config.lease_max_lifetime,
                # Bidirectional mode: this engine also holds the turns it decodes.
                hold_duration=config.decoder_kv_blocks_ttl if config.bidirectional else None,
                hold_renewable=config.symmetric_decoder_lease,
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
                replicated_kv=self.kv_replicated,
            )
        # Push mode (``push``): D's reservations, P's pushes; the handshakes they need
        # (D with P, to send it registrations; P with D, to write): results queued by
        # the handshake threads, engines failed (why), engines asked.
        self.push_d: PushDecode | None = None
        self.push_p: PushPrefill | None = None
        if config.push and self.is_consumer:
            self.push_d = PushDecode(config.lease_duration, self.counters)
        if config.push and self.is_producer:
            self.push_p = PushPrefill(config.lease_duration, self.tp_size, self.counters,
                                      num_kv_heads=self.num_kv_heads,
                                      replicated=self.kv_replicated)
        self._push_hs: queue.Queue[tuple[str, EngineInfo | None, Exception | None]] = (
            queue.Queue()
        )
        self._push_failed: dict[str, str] = {}
        self._push_asked: set[str] = set()
        # P: the workers' fence words, by rank; what the side channel serves.
        self.fences: dict[int, native.FenceWords] = {}
        self._fence_maps: list[mmap.mmap] = []
        self._workers: dict[int, KvleaseHandshakeMetadata] = {}
        # The side channel listens on side_channel_host only: the address it publishes
        # as remote_host (127.0.0.1 unless configured), not every interface.
        self.side_channel: native.SideChannelServer | None = None
        self.side_channel_port = 0
        # Push mode: D serves its engine info too (P writes into its workers' blocks).
        if self.is_producer or self.push_d is not None:
            self.side_channel = native.SideChannelServer(
                self._payload(),
                token=config.token,
                listen=_listen_addr(config.side_channel_host, config.side_channel_port),
                allow_unauthenticated=config.allow_unauthenticated,
            )
            self.side_channel_port = self.side_channel.port
        # Bidirectional mode: the holder serves its wall clock (a turn's deadline is on
        # it); the reader keeps each holder's measured offset, probed in the background.
        self.clock_probe: native.ClockProbeServer | None = None
        if self.is_producer and config.bidirectional:
            self.clock_probe = native.ClockProbeServer(
                _listen_addr(config.side_channel_host, config.clock_probe_port)
            )
        self._offsets: dict[tuple[str, int], tuple[float, native.ClockOffset | None]] = {}
        self._offsets_lock = threading.Lock()
        self._finished_sending: list[str] = []
        # P with a host buffer (kv_buffer_device cpu): the do_remote_decode requests
        # whose blocks the workers copy to it at the step completing their prompt; each
        # one's block table as the steps named it; the blocks of its last copy (its
        # lease may name no other).
        self.use_host_buffer = config.use_host_buffer
        self._to_save: dict[str, "Request"] = {}
        self._tables: dict[str, list[list[int]]] = {}
        self._saved: dict[str, set[int]] = {}
        # D: requests the core admitted, loads planned for the workers, P engines.
        self._remote: set[str] = set()
        # P's block ids per KV cache group of each request the core admitted, as its
        # kv_transfer_params named them (one list: one group).
        self._groups: dict[str, list[list[int]]] = {}
        self._loads: list[LoadSpec] = []
        self._failed_loads: dict[str, list[int]] = {}
        self.engines: dict[str, EngineInfo] = {}
        self._new_engines: dict[str, EngineInfo] = {}
        self._dropped_engines: list[str] = []
        self._handshakes: queue.Queue[
            tuple[str, EngineInfo | None, Exception | None, int | None]
        ] = queue.Queue()
        # D: P engines whose KV this engine must not load, with the reason.
        self._incompatible: dict[str, str] = {}
        # D: P's block ids of requests whose P blocks hold another number of tokens than
        # ours (the decode core holds as many of them as D blocks: ``_in_our_blocks``).
        self._p_blocks: dict[str, list[int]] = {}
        # Bidirectional mode, P: requests reading a held turn back from the engine that
        # decoded it (tracked by the decode core like a D's load), by the tokens they read.
        self._pulls: dict[str, int] = {}
        # D: requests that came to be decoded here (``do_remote_prefill``), loaded or
        # not: in bidirectional mode their turn is held when they end.
        self._decodes: set[str] = set()
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
        """What the side channel serves: P's engine info, built and encoded by the codec
        every kvlease engine shares (``native.EngineInfo``; D reads it with the same)."""
        workers = [
            {
                "rank": rank,
                "agent_name": w.agent_name,
                "agent_metadata": bytes(w.agent_metadata),
                "layers": [list(layer) for layer in w.layers],
                "fence_region": w.fence_region,
                "num_blocks": w.num_blocks,
                "device": w.device,
                "kv_format": w.kv_format,
            }
            for rank, w in sorted(self._workers.items())
        ]
        return native.EngineInfo(
            engine_id=self.engine_id,
            instance=self.instance,
            tp_size=self.tp_size,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            # What D checks before it loads any of P's blocks as its KV.
            kv=self.kv_descriptor,
            workers=workers,
        ).to_bytes()

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

    # ---------------------------------------------------------------- push mode

    def _push_notif(self, now: float, notif: ReceivedNotif) -> bool:
        """A push-mode frame from a peer's worker, fed to the push core it is for;
        ``False`` for any other notification."""
        sender, message = notif
        message = bytes(message)
        if not is_push_frame(message):
            return False
        try:
            frame = parse(message)
        except KvleaseError as e:
            logger.warning("push frame from %r ignored: %s", sender, e)
            self.counters.add("push_frames_invalid")
            return True
        engine = _engine_of(sender)
        if frame.kind in ("peer", "register", "released"):
            if self.push_p is None:
                self.counters.add("push_frames_ignored")
                return True
            if frame.kind == "peer":
                self._push_peer(frame, engine)
            else:
                self.push_p.handle(now, engine, frame)
        elif self.push_d is not None:
            self.push_d.handle(now, engine, frame)
        else:
            self.counters.add("push_frames_ignored")
        return True

    def _push_peer(self, frame: PushFrame, sender: str) -> None:
        """P: where D's side channel is; its engine info is fetched once (again when the
        peer message names another address: D restarted)."""
        assert frame.peer is not None and self.push_p is not None
        engine, host, port = frame.peer
        if engine != sender:
            logger.warning("push peer message from %s names engine %s: ignored", sender, engine)
            self.counters.add("push_frames_invalid")
            return
        if self.push_p.peers.get(engine) == (host, port) and (
            engine in self.engines or engine in self._push_asked
        ):
            return
        self.push_p.peers[engine] = (host, port)
        self._push_handshake(engine, host, port, force=True)

    def _push_handshake(self, engine: str, host: str, port: int, force: bool = False) -> None:
        """Fetches ``engine``'s info from its side channel on a background thread (push
        mode: D learns P's workers, P learns D's)."""
        if not force and (engine in self.engines or engine in self._push_asked):
            return
        self._push_asked.add(engine)
        self._push_failed.pop(engine, None)

        def run() -> None:
            try:
                raw = native.side_channel_fetch(
                    host, port, token=self.config.token, timeout=self.config.handshake_timeout
                )
                info = _engine_info(raw)
                if info.engine_id != engine:
                    raise KvleaseError(
                        f"{host}:{port} serves engine {info.engine_id!r}, not {engine!r}"
                    )
                self._push_hs.put((engine, info, None))
            except Exception as e:  # the engine's pushes fail; its requests recompute
                self._push_hs.put((engine, None, e))

        threading.Thread(target=run, name=f"kvlease-push-handshake-{engine}", daemon=True).start()

    def _push_handshakes(self) -> None:
        while True:
            try:
                engine, info, error = self._push_hs.get_nowait()
            except queue.Empty:
                return
            self._push_asked.discard(engine)
            if info is None:
                logger.warning("push handshake with engine %s failed: %s", engine, error)
                self._push_failed[engine] = str(error)
                self.counters.add("handshakes_failed")
                continue
            # P checks D's KV as D checks P's (the same check, D's descriptor in D's
            # place): a D whose blocks mean something else is never written (its pushes
            # fail; D recomputes).
            if self.push_p is not None and engine in self.push_p.peers:
                if isinstance(info.kv, dict):
                    reason = _kv_incompatibility(
                        info.kv, self.kv_descriptor, d_tp=info.tp_size, p_tp=self.tp_size
                    )
                else:
                    reason = "D's engine info carries no KV compatibility descriptor"
            else:
                reason = _kv_incompatibility(
                    self.kv_descriptor, info.kv, d_tp=self.tp_size, p_tp=info.tp_size
                )
            theirs = None if info.kv is None else info.kv.get("block_size")
            if reason is None and theirs is not None and theirs != self.block_size:
                # Pull reads runs of tokens across block sizes; a push writes whole blocks.
                reason = f"block size {theirs}, ours {self.block_size}: push writes whole blocks"
            if reason is not None:
                logger.error("engine %s is not KV-compatible: %s (push refused)", engine, reason)
                self._push_failed[engine] = f"not KV-compatible: {reason}"
                self.counters.add("handshakes_incompatible")
                continue
            self.engines[engine] = info
            self._new_engines[engine] = info
            self.counters.add("handshakes_done")

    def _push_peer_message(self) -> bytes:
        body = {
            "engine": self.engine_id,
            "host": self.config.side_channel_host,
            "port": self.side_channel_port,
        }
        return PEER_PREFIX + json.dumps(body, separators=(",", ":")).encode()

    def _push_matched(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        """D, ``get_num_new_matched_tokens`` of a push leg: ask again until P's engine
        info is in (D's worker 0 sends the registration to P's worker 0); the prompt is
        computed here when the handshake failed or P cannot push to this engine."""
        assert self.push_d is not None
        rid = request.request_id
        leg = self.push_d.legs[rid]
        if leg.generation:
            return 0, False  # reserved already (a preempted request scheduled again)
        self._push_handshakes()
        why = self._push_failed.get(leg.engine)
        if why is None and len(self.group_windows) > 1:
            why = "a hybrid model's KV cache groups are not pushed"
        if why is not None:
            logger.warning("request %s: not pushed (%s): computing locally", rid, why)
            self.push_d.legs.pop(rid, None)
            self.counters.add("requests_refused")
            return 0, False
        if leg.engine not in self.engines:
            self._push_handshake(leg.engine, leg.host, leg.port)
            return None, False
        count = int(request.num_prompt_tokens) - int(num_computed_tokens)
        if count <= 0:
            self.push_d.legs.pop(rid, None)
            return 0, False
        return count, True

    def _push_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external: int) -> None:
        """D: the blocks vLLM allocated for the pushed tokens are reserved, fenced and
        registered with P (``PushDecode.reserve``)."""
        assert self.push_d is not None
        rid = request.request_id
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one reservation, even after a preemption
        if num_external <= 0:
            self.push_d.legs.pop(rid, None)
            return
        # The blocks that receive the prompt's tokens past D's prefix hits (vLLM may
        # allocate more): P pairs its last blocks with them, from the end.
        unhashed = [int(b) for b in blocks.get_unhashed_block_ids()]
        skip = len(blocks.get_block_ids()[0]) - len(unhashed)
        need = -(-int(request.num_prompt_tokens) // self.block_size) - skip
        local = unhashed[: max(0, need)]
        if not local or not self.push_d.reserve(
            self.clock(), rid, local, self._push_peer_message()
        ):
            self.push_d.legs.pop(rid, None)
            self._failed_loads[rid] = local

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
                kind = "holds" if released.hold else "leases"
                self.counters.add(f"{kind}_released_{released.reason}")
                logger.debug(
                    "lease of %s released (%s)", released.request, released.reason
                )
            elif isinstance(action, native.SendNotif):
                # Expiry notices need a connection from P to D, which this connector
                # does not open: D's fenced read catches the reclaimed lease.
                self.counters.add("expiry_notices_dropped")
        while self.prefill.poll_event() is not None:
            pass

    def _handle_notifs(self, now: float, notifs: list[ReceivedNotif]) -> None:
        if self.push_d is not None or self.push_p is not None:
            notifs = [n for n in notifs if not self._push_notif(now, n)]
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
            self.counters.add(f"notifs_{out.kind}")
            if out.kind == NotifKind.HEARTBEAT and out.extended:
                self.counters.add("leases_renewed", out.extended)
        self._drain_prefill()

    # ------------------------------------------------------------------- D side

    def _kv_params(self, request: "Request") -> native.KvTransferParams | None:
        """The request's ``kv_transfer_params``, read once by the one codec
        (``KvTransferParams``); ``None``, with a warning naming the field at fault, when
        they are not a kvlease lease (the request is computed here)."""
        try:
            params = native.KvTransferParams.from_dict(request.kv_transfer_params or {})
        except InvalidArgument as e:
            logger.warning(
                "request %s: kv_transfer_params are not a kvlease lease (%s: %s): "
                "computing locally",
                request.request_id,
                e.field,
                e.reason,
            )
            return None
        return params

    def _start_handshakes(self) -> None:
        while (hs := self._d().poll_handshake()) is not None:
            thread = threading.Thread(
                target=self._handshake,
                args=(hs.engine, hs.host, hs.port, hs.check_instance),
                name=f"kvlease-handshake-{hs.engine}",
                daemon=True,
            )
            thread.start()

    def _handshake(self, engine: str, host: str, port: int, check: int | None) -> None:
        """Fetches P's engine info (``check``: the instance D is connected to, when a
        request named another one; ``None``: a first handshake). A failure is reported
        as a ``HandshakeError``, whose ``kind`` the core decides by."""
        try:
            raw = native.side_channel_fetch(
                host, port, token=self.config.token, timeout=self.config.handshake_timeout
            )
            # Validated here, off the engine thread: _pump and the workers use it as is.
            info = _engine_info(raw)
            if info.engine_id != engine:
                raise HandshakeError(
                    f"{host}:{port} serves engine {info.engine_id!r}, not {engine!r}",
                    kind=HandshakeKind.NOT_FOUND,
                )
            self._handshakes.put((engine, info, None, check))
        except HandshakeError as e:  # reported to the core, which fails the waiting requests
            self._handshakes.put((engine, None, e, check))
        except Exception as e:
            error = HandshakeError(f"{type(e).__name__}: {e}", kind=HandshakeKind.OTHER)
            error.__cause__ = e
            self._handshakes.put((engine, None, error, check))

    def _pump(self, now: float) -> None:
        """Handshake results, then the decode core's events."""
        if self.decode is None:
            return
        self._start_handshakes()
        while True:
            try:
                engine, info, error, check = self._handshakes.get_nowait()
            except queue.Empty:
                break
            if info is not None:
                if check is None or info.instance > check:
                    # A first handshake, or P restarted: the workers connect to the
                    # instance P's own side channel named. A check that P answers with
                    # the instance D knows changes nothing (a request's word is not
                    # enough to drop working connections); the core ends the requests
                    # that named another instance.
                    self._check_compatibility(engine, info)
                    # Handshaken even when incompatible: D's worker 0 needs P's engine
                    # info to send the aborts that free the leases D will not read.
                    self.engines[engine] = info
                    self._new_engines[engine] = info
                self.decode.handle_handshake(
                    now,
                    engine,
                    tp_size=info.tp_size,
                    num_blocks=info.num_blocks,
                    instance=info.instance,
                )
                self.counters.add("handshakes_done")
            else:
                logger.warning("handshake with engine %s failed: %s", engine, error)
                self.decode.handle_handshake_failed(now, engine, error)
                self.counters.add("handshakes_failed")
        self._drain_decode()

    def _check_compatibility(self, engine: str, info: EngineInfo) -> None:
        """Record whether P engine ``engine``'s KV blocks can be loaded as ours: the
        answer of the latest handshake stands (a restarted P handshakes again)."""
        reason = _kv_incompatibility(
            self.kv_descriptor, info.kv, d_tp=self.tp_size, p_tp=info.tp_size
        )
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
                self._p_blocks.pop(event.request, None)
                self._groups.pop(event.request, None)
                if event.outcome == Outcome.FAILED:
                    self.counters.add("loads_failed")
                    logger.warning("load of %s failed: %s", event.request, event.error)
            elif isinstance(event, native.EngineDropped):
                # Idle, dropped to make room for another P: the workers close their
                # connections to it; a later request handshakes afresh.
                self.engines.pop(event.engine, None)
                self._new_engines.pop(event.engine, None)
                self._incompatible.pop(event.engine, None)
                self._dropped_engines.append(event.engine)
                self.counters.add("engines_dropped")

    # ------------------------------------------------------------------ hooks

    def on_new_request(self, request: "Request") -> None:
        params = request.kv_transfer_params
        if params and params.get("kvlease_bidir") and not params.get("do_remote_prefill"):
            self._on_new_turn(request)
            return
        if self.push_p is not None and params and params.get("do_remote_decode"):
            # P's leg of a push: admitted on arrival, so that D's registration (which,
            # when the proxy sends both legs at once, may come first) is matched and
            # heartbeated while the request waits and prefills here.
            rid = request.request_id
            self.push_p.admit(self.clock(), rid, p_transfer(params, rid),
                              prompt_digest(request.prompt_token_ids or ()))
            return
        if not params or not params.get("do_remote_prefill"):
            return
        if self.push_d is not None and PushDecode.wants(params):
            leg = self.push_d.admit(request.request_id, params,
                                    prompt_digest(request.prompt_token_ids or ()))
            self.counters.add("requests_tracked")
            self._push_handshake(leg.engine, leg.host, leg.port)
            return
        self._decodes.add(request.request_id)
        if self.decode is None:
            logger.warning(
                "request %s asks to load remote KV, but this engine is a kv_producer: "
                "computing locally",
                request.request_id,
            )
            return
        kv = self._kv_params(request)
        if kv is None:
            return
        groups = kv.remote_block_groups
        remote = kv.to_remote_kv()
        if len(groups) > 1:
            remote = self._group_remote_kv(request, remote, groups)
            if remote is None:
                return
        remote = self._in_our_blocks(request.request_id, remote)
        now = self.clock()
        try:
            self.decode.on_new_request(
                now, request.request_id, int(request.num_prompt_tokens), remote
            )
        except KvleaseError as e:
            self._p_blocks.pop(request.request_id, None)
            self.counters.add("requests_refused")
            logger.warning(
                "request %s refused, computing locally: %s", request.request_id, e
            )
            self._drain_decode()
            return
        self._remote.add(request.request_id)
        self._groups[request.request_id] = groups
        self.counters.add("requests_tracked")
        self._pump(now)

    def _clock_offset(self, turn: "native.KvTransferParams") -> "native.ClockOffset | None":
        """The measured offset of the holder's clock, if known and fresh: the turn's
        deadline is read on it (``plan_pull``). Unknown or stale, a probe starts in the
        background (the scheduler never waits on the network) and this turn is planned on
        the time left it announced; each holder is probed at most every
        ``CLOCK_PROBE_EVERY`` seconds."""
        port = int(turn.kvlease_clock_port or 0)
        host = turn.remote_host
        if not port or not host:
            return None
        key = (str(host), port)
        now = time.monotonic()
        with self._offsets_lock:
            at, offset = self._offsets.get(key, (None, None))
            if at is not None and now - at < CLOCK_PROBE_EVERY:
                return offset
            # Marked before the probe ends, so one probe runs per holder at a time.
            self._offsets[key] = (now, offset)

        def probe() -> None:
            try:
                measured = native.probe_clock(key[0], key[1], samples=CLOCK_PROBE_SAMPLES)
            except KvleaseError as e:
                logger.warning("clock probe of %s:%s failed: %s", key[0], key[1], e)
                self.counters.add("clock_probes_failed")
                return
            with self._offsets_lock:
                self._offsets[key] = (time.monotonic(), measured)
            self.counters.add("clock_probes")
            logger.info(
                "clock of %s:%s: %+.3f ms from ours (within %.3f ms)",
                key[0],
                key[1],
                measured.offset_ns / 1e6,
                measured.rtt_ns / 2e6,
            )

        threading.Thread(target=probe, name="kvlease-clock-probe", daemon=True).start()
        return offset

    def _on_new_turn(self, request: "Request") -> None:
        """Bidirectional mode, P: the request carries the previous turn's params (the
        engine that decoded it holds its blocks). Reads back the whole blocks whose prefix
        hashes equal the prompt's (``KvTransferParams.plan_pull``: at least
        ``kv_recompute_threshold`` tokens, the hold's end far enough): tracked by the
        decode core like a D's load, so P heartbeats the hold while the request waits or
        reads (the symmetric lease) and reads it fenced. Otherwise P computes the prompt,
        and an admitted hold is aborted so its engine frees the blocks at once."""
        rid = request.request_id
        if not self.config.bidirectional:
            logger.warning(
                "request %s carries a held turn, but bidirectional_kv_xfer is off here: "
                "computing it",
                rid,
            )
            self.counters.add("turns_ignored")
            return
        decode = self._d()
        try:
            turn = native.KvTransferParams.from_turn_dict(request.kv_transfer_params)
        except InvalidArgument as e:
            logger.warning(
                "request %s: the held turn's params are not a kvlease turn (%s: %s): "
                "computing it",
                rid,
                e.field,
                e.reason,
            )
            self.counters.add("turns_invalid")
            return
        now = self.clock()
        plan = turn.plan_pull(
            list(request.prompt_token_ids or []),
            self.block_size,
            now,
            threshold_tokens=self.config.kv_recompute_threshold,
            safety_margin=self.config.pull_safety_margin,
            received_at=now,
            clock_offset=self._clock_offset(turn),
        )
        remote = turn.to_remote_kv()
        tokens = plan.tokens if plan.pull else int(turn.kvlease_num_tokens)
        blocks = list(plan.blocks) if plan.pull else list(remote.blocks)
        remote = native.RemoteKv(
            engine=remote.engine,
            request=remote.request,
            blocks=blocks,
            generation=remote.generation,
            tp_size=remote.tp_size,
            num_tokens=tokens,
            host=remote.host,
            port=remote.port,
            instance=remote.instance,
        )
        try:
            decode.on_new_request(now, rid, tokens, remote)
        except KvleaseError as e:
            self.counters.add("turns_refused")
            logger.warning("request %s: not reading its held turn (%s): computing it", rid, e)
            self._drain_decode()
            return
        self._remote.add(rid)
        self._groups[rid] = [blocks]
        # Tokens to read: none when P computes the turn. Then the request still waits
        # for the handshake with the holder, so that the abort at its allocation
        # (``update_state_after_alloc``, no external tokens) reaches the holder, which
        # frees the turn at once instead of at its TTL.
        self._pulls[rid] = plan.tokens if plan.pull else 0
        if plan.pull:
            self.counters.add("turns_pulled")
        else:
            self.counters.add(f"turns_recomputed_{plan.reason}")
            logger.info("request %s: computing its held turn (%s)", rid, plan.reason)
        self._pump(now)

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        if self.push_d is not None and rid in self.push_d.legs:
            return self._push_matched(request, num_computed_tokens)
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
        known = self.engines.get(remote.engine)
        if remote.instance and known is not None and remote.instance != known.instance:
            # The request names another instance of P than the one D is connected to:
            # the core checks it with P's side channel; no read is planned until P has
            # answered (then the request either names the instance D connects to, or
            # has ended and is computed here).
            return None, False
        reason = self._incompatible.get(remote.engine)
        if reason is not None:
            # P's blocks would be loaded as KV they are not: never read them. The abort
            # frees P's lease at once; vLLM computes the prompt here whatever its
            # kv_load_failure_policy (no load was attempted).
            logger.warning(
                "request %s: not loading from P engine %s, which is not KV-compatible "
                "(logged at its handshake): computing the prompt locally",
                rid,
                remote.engine,
            )
            decode.abort(rid)
            self._drain_decode()
            self.counters.add("loads_refused_incompatible")
            return 0, False
        # A held turn covers the prompt's first tokens only; a D's load, all of them.
        total = self._pulls.get(rid, int(request.num_prompt_tokens))
        count = min(total, int(request.num_prompt_tokens)) - int(num_computed_tokens)
        if count <= 0:
            return 0, False
        return count, True

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        rid = request.request_id
        params = request.kv_transfer_params
        if (
            self.use_host_buffer
            and self.prefill is not None
            and params
            and params.get("do_remote_decode")
        ):
            # Its blocks go to the host buffer at the step that completes its prompt
            # (again after a preemption): ``_build_saves``.
            self._to_save[rid] = request
        if self.push_d is not None and rid in self.push_d.legs:
            self._push_alloc(request, blocks, num_external_tokens)
            return
        if rid not in self._remote or not params:
            return
        if rid in self._pulls:
            # One read of a held turn per request, even if it is preempted.
            if params.get("_kvlease_turn_read"):
                return
            params["_kvlease_turn_read"] = True
        elif not params.get("do_remote_prefill"):
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
        if len(self.group_windows) > 1 or len(self._groups.get(rid, ())) > 1:
            self._start_group_load(request, blocks)
            return
        # The blocks vLLM found in the local prefix cache hold the prompt's first tokens;
        # the rest (unhashed) receive the remote blocks from there on, as far as those go
        # (a held turn covers the prompt's first tokens only).
        unhashed = list(blocks.get_unhashed_block_ids())
        skip = len(blocks.get_block_ids()[0]) - len(unhashed)
        remote = decode.remote_of(rid)
        n_remote = len(remote.blocks) if remote is not None else 0
        local = unhashed[: max(0, n_remote - skip)]
        try:
            tokens = self._token_map(rid, remote, skip)
            plan = decode.start_load(rid, local, skip)
        except KvleaseError as e:
            logger.warning("request %s: cannot load (%s): recomputing", rid, e)
            self._failed_loads[rid] = local
            decode.abort(rid)
            self._drain_decode()
            return
        spec = self._load_spec(plan)
        self._p_blocks.pop(rid, None)  # planned: the LoadSpec names P's blocks now
        if tokens is not None:
            spec = dataclasses.replace(spec, **tokens)
        self._loads.append(spec)
        self.counters.add("loads_started")

    def _in_our_blocks(self, rid: str, remote: native.RemoteKv) -> native.RemoteKv:
        """``remote`` as the decode core admits it: as many blocks as the prompt fills
        of ours. P's blocks may hold another number of tokens (its block size, known at
        the handshake): then its block ids are kept here for the load
        (``_token_map``) and the core gets as many of them as it counts D blocks (P's
        ids, so its range check still means something); leases, fences and aborts go by
        P's request, never by these ids."""
        need = -(-int(remote.num_tokens) // self.block_size)
        blocks = [int(b) for b in remote.blocks]
        if len(blocks) == need or not blocks:
            return remote
        self._p_blocks[rid] = blocks
        return _with_blocks(remote, (blocks + [blocks[-1]] * need)[:need])

    def _group_remote_kv(
        self, request: "Request", remote: native.RemoteKv, groups: list[list[int]]
    ) -> native.RemoteKv | None:
        """A hybrid lease (several KV cache groups) as the decode core tracks it: one
        lease, heartbeats and one fence, its blocks those of the first group holding a
        block per ``block_size`` tokens of the prompt (a full-attention group; the core
        checks that count). ``None`` (computed here) when no group does."""
        need = -(-int(remote.num_tokens) // self.block_size)
        full = next((g for g in groups if len(g) == need), None)
        if full is None:
            logger.warning(
                "request %s: no KV cache group of P's lease holds the prompt's %d blocks "
                "(groups of %s): computing locally",
                request.request_id,
                need,
                [len(g) for g in groups],
            )
            self.counters.add("requests_refused")
            return None
        return _with_blocks(remote, list(full))

    def _token_map(
        self, rid: str, remote: native.RemoteKv | None, skip: int
    ) -> dict[str, Any] | None:
        """The ``LoadSpec`` fields of a load from a P whose blocks hold another number
        of tokens than ours (``None``: the same block size, block i of P is D's block
        i): P's blocks from the one holding D's first token to load, and the fence
        block. Raises ``KvleaseError`` when P's block ids do not fit its block size."""
        if remote is None:
            return None
        blocks = self._p_blocks.get(rid)
        info = self.engines.get(remote.engine)
        p_bs = None if info is None or info.kv is None else info.kv.get("block_size")
        if type(p_bs) is not int or p_bs <= 0:
            p_bs = self.block_size
        if p_bs == self.block_size:
            if blocks is not None:
                raise KvleaseError(
                    f"P sent {len(blocks)} blocks for {remote.num_tokens} tokens, not "
                    f"{len(remote.blocks)} of its block size {p_bs}"
                )
            return None
        blocks = [int(b) for b in remote.blocks] if blocks is None else blocks
        num_tokens = int(remote.num_tokens)
        if len(blocks) != -(-num_tokens // p_bs):
            raise KvleaseError(
                f"P sent {len(blocks)} blocks for {num_tokens} tokens of its block size "
                f"{p_bs}"
            )
        first = skip * self.block_size
        return {
            "remote_blocks": blocks[first // p_bs :],
            "fence_block": blocks[-1],
            "block_size": self.block_size,
            "remote_block_size": p_bs,
            "first_token": first,
            "num_tokens": num_tokens,
        }

    def _start_group_load(self, request: "Request", blocks: "KVCacheBlocks") -> None:
        """``update_state_after_alloc`` for a hybrid model: each KV cache group's
        blocks, clipped to what it needs (a sliding window's tail), paired from the end
        with P's blocks of the same group. The core plans one load over all the pairs
        (one lease, one fence); the workers read each layer's group's pairs only."""
        rid = request.request_id
        decode = self._d()
        local: list[int] = []
        try:
            remote_groups = self._groups[rid]
            mine = _clip_groups(blocks.get_unhashed_block_ids_all_groups(), self.group_windows)
            local = [b for group in mine for b in group]
            local, remote, sizes = _pair_groups(mine, remote_groups)
            # The core tracks the group it was given (``_group_remote_kv``): its pairs.
            tracked = decode.remote_of(rid)
            core = next(
                i
                for i, g in enumerate(remote_groups)
                if tracked is not None and list(g) == list(tracked.blocks)
            )
            start = sum(sizes[:core])
            plan = decode.start_load(
                rid,
                local[start : start + sizes[core]],
                len(remote_groups[core]) - sizes[core],
            )
        except (KvleaseError, ConfigError, StopIteration) as e:
            logger.warning("request %s: cannot load (%s): recomputing", rid, e)
            self._failed_loads[rid] = local
            decode.abort(rid)
            self._drain_decode()
            return
        spec = self._load_spec(plan)
        # The workers read every group's pairs (the core planned one group's).
        self._loads.append(
            dataclasses.replace(
                spec, local_blocks=local, remote_blocks=remote, group_sizes=sizes
            )
        )
        self.counters.add("loads_started")

    def _load_spec(self, plan: native.LoadPlan) -> LoadSpec:
        remote = plan.remote
        # The core's plan, as it is: which D worker reads which heads from which P rank
        # (split by head, or, for a replicated latent cache, once from one P rank).
        batches = [
            BatchSpec(
                index=index,
                d_worker=int(b.d_worker),
                p_rank=int(b.p_rank),
                local_heads=(b.heads[0] - b.d_first_head, b.heads[1] - b.d_first_head),
                remote_heads=(b.heads[0] - b.p_first_head, b.heads[1] - b.p_first_head),
                notif=bytes(b.notif),
            )
            for index, b in enumerate(plan.batches)
        ]
        return LoadSpec(
            request=plan.request,
            engine=remote.engine,
            remote_request=remote.request,
            local_blocks=list(plan.blocks),
            remote_blocks=list(remote.blocks[plan.skip_blocks :]),
            # The last block is the one least likely shared with another request's lease
            # through P's prefix cache (a shared block's word holds the later grant's
            # generation); every block of a lease carries its generation.
            fence_block=int(remote.blocks[-1]),
            generation=int(plan.fence_generation),
            batches=batches,
        )

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
                meta.transmits.append(TransmitSpec(t.engine, t.kind, bytes(t.message)))
        self._drain_decode()
        meta.loads, self._loads = self._loads, []
        meta.engines, self._new_engines = self._new_engines, {}
        meta.dropped_engines, self._dropped_engines = self._dropped_engines, []
        meta.failed_loads, self._failed_loads = self._failed_loads, {}
        if self.push_d is not None or self.push_p is not None:
            self._push_handshakes()
        if self.push_d is not None:
            self.push_d.handle_timeout(now)
            meta.reserves, self.push_d.reserves = self.push_d.reserves, []
            meta.reservation_ends, self.push_d.ends = self.push_d.ends, []
            meta.transmits.extend(self.push_d.transmits)
            self.push_d.transmits = []
            for engine in self.push_d.lost:
                # P stopped heartbeating a reservation: the next request handshakes
                # afresh (P may have restarted with new agents; the workers replace
                # their links when the new engine info reaches them).
                self.engines.pop(engine, None)
            self.push_d.lost = []
        if self.push_p is not None:
            self.push_p.step(now, self.engines, self._push_failed)
            meta.writes, self.push_p.to_write = self.push_p.to_write, []
            meta.transmits.extend(self.push_p.transmits)
            self.push_p.transmits = []
            self._finished_sending.extend(self.push_p.freed)
            self.push_p.freed = []
        meta.engines.update(self._new_engines)
        self._new_engines = {}
        meta.finished_sending, self._finished_sending = self._finished_sending, []
        if self._to_save:
            meta.saves = self._build_saves(scheduler_output)
        return meta

    def _build_saves(self, scheduler_output: Any) -> list[SaveSpec]:
        """P with a host buffer: the requests whose prompt this step completes, with all
        their blocks (each group's clipped as its lease will be): the workers copy them
        to the host buffer after the step's forward (``wait_for_save``), so before the
        step's output reaches ``request_finished``, which grants the lease on them. A
        request still scheduled after that (it decodes on P) is copied again each step,
        its new blocks too."""
        from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data

        saves = []
        for rid, new_groups, full_table in yield_req_data(scheduler_output):
            request = self._to_save.get(rid)
            if request is None:
                continue
            table = self._tables.get(rid)
            if new_groups is not None:
                if full_table or table is None:
                    table = [list(g) for g in new_groups]
                else:
                    table = [list(a) + list(b) for a, b in zip(table, new_groups)]
                self._tables[rid] = table
            if table is None:
                continue
            scheduled = int(scheduler_output.num_scheduled_tokens.get(rid, 0))
            if int(request.num_computed_tokens) + scheduled < int(request.num_prompt_tokens):
                continue  # a chunk of the prompt: its blocks are not all computed yet
            try:
                groups = _clip_groups(table, self.group_windows)
            except ConfigError as e:
                logger.error("request %s: not copied to the host buffer (%s)", rid, e)
                continue
            saves.append(SaveSpec(request=rid, block_groups=groups))
            self._saved[rid] = {b for g in groups for b in g}
            self.counters.add("host_saves")
        return saves

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        now = self.clock()
        worker_meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(worker_meta, KvleaseWorkerMetadata):
            self._handle_notifs(now, worker_meta.notifs)
            if self.push_p is not None:
                for transfer, outcomes in getattr(worker_meta, "writes", {}).items():
                    self.push_p.write_result(now, transfer, outcomes)
            if self.decode is not None:
                # Each batch as soon as its worker reports it: with TP > 1 a worker
                # reports its batches in the step they end, but vLLM lists the request
                # in finished_recving only once every worker is done, maybe steps
                # later. The core completes the load when every batch is in.
                for rid, results in worker_meta.batches.items():
                    for index, (status, nbytes, error) in sorted(results.items()):
                        # BatchStatus, or its value: the core takes either.
                        self.decode.handle_batch_done(
                            rid, index, status, bytes=nbytes, error=error
                        )
        self._drain_decode()

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``SupportsHMA`` hook: ``request_finished`` with each KV cache group's
        blocks. One group is ``request_finished``; several are one lease over the blocks
        each group still needs (a sliding window's in-window tail: its older blocks are
        not held), answered as vLLM's ``[[...],[...]]``."""
        if len(block_ids) <= 1 and len(self.group_windows) <= 1:
            return self.request_finished(request, list(block_ids[0]) if block_ids else [])
        try:
            groups = _clip_groups(block_ids, self.group_windows)
        except ConfigError as e:
            logger.error("request %s: no lease (%s)", request.request_id, e)
            self.counters.add("grants_refused")
            return False, None
        flat = [b for group in groups for b in group]
        return self.request_finished(request, flat, groups=groups)

    def request_finished(
        self,
        request: "Request",
        block_ids: list[int],
        groups: list[list[int]] | None = None,
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        now = self.clock()
        params = request.kv_transfer_params or {}
        self._to_save.pop(rid, None)
        self._tables.pop(rid, None)
        saved = self._saved.pop(rid, None)
        self._pulls.pop(rid, None)
        if self.push_d is not None and rid in self.push_d.legs:
            # D: ended before P's write came (aborted). vLLM keeps the blocks of a
            # request that waited for remote KV until it is reported received, which
            # the workers do once they cleared the write fences.
            self.push_d.abort(now, rid)
            return False, None
        if rid in self._remote:
            # D: decoded to the end, or aborted before (or while) loading; P: done
            # reading a held turn (or aborted).
            decode = self._d()
            if not decode.request_finished(rid):
                decode.abort(rid)
            self._drain_decode()
        if rid in self._decodes:
            # D, whether its prompt was loaded or computed here.
            self._decodes.discard(rid)
            return self._hold(request, block_ids, now)
        if not params.get("do_remote_decode"):
            return False, None
        blocks = [int(b) for b in block_ids]
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ) or not blocks:
            # Aborted (or failed) on P: nobody will read it; vLLM frees at once. A push
            # ends here, and D, when it registered, is told at once.
            if self.push_p is not None:
                self.push_p.retire(now, rid)
            return False, None
        if self.push_p is not None:
            if groups is not None and len(groups) > 1:
                logger.warning("request %s: a hybrid model's KV is not pushed", rid)
                self.counters.add("pushes_refused")
                self.push_p.retire(now, rid)
                return False, None
            transfer = self.push_p.transfer_of(rid) or rid
            # The prompt's blocks (paired from the end with D's).
            blocks = blocks[: -(-int(request.num_prompt_tokens) // self.block_size)]
            if not self.push_p.finished(now, rid, blocks):
                return False, None
            return True, self._push_answer(request, rid, transfer, blocks)
        if self.prefill is None:
            logger.warning(
                "request %s asks P to keep its KV, but this engine is a kv_consumer: "
                "no lease, its blocks are freed",
                rid,
            )
            self.counters.add("grants_refused")
            return False, None
        if self.use_host_buffer:
            # The lease covers the host copies: D reads nothing the workers did not copy
            # before this (the step that completed the prompt, or a later one).
            missing = sorted(set(blocks) - (saved or set()))
            if missing:
                logger.error(
                    "request %s: no lease: blocks %s were not copied to the host buffer "
                    "(kv_buffer_device cpu)",
                    rid,
                    missing,
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
        try:
            answer = self._answer(request, rid, groups or blocks, granted.generation)
        except InvalidArgument as e:
            # Nothing D could read: free the lease now rather than at its expiry.
            logger.error("request %s: no kv_transfer_params for its lease (%s)", rid, e)
            self._p().abort(now, rid)
            self._drain_prefill()
            self.counters.add("grants_refused")
            return False, None
        return True, answer

    def _hold(
        self, request: "Request", block_ids: list[int], now: float
    ) -> tuple[bool, dict[str, Any] | None]:
        """Bidirectional mode, D: the turn it decoded stays in its blocks for the
        conversation's next turn, held by the prefill core (``hold_in``) for
        ``decoder_kv_blocks_ttl``, renewed by the next P's heartbeats (the symmetric
        lease), released by that P's read or abort; the answer names the hold (a turn's
        ``kv_transfer_params``, as the agents' D answers). Without bidirectional mode, or
        for a request that did not end normally, vLLM frees the blocks at once."""
        from vllm.v1.request import RequestStatus

        if not self.config.bidirectional or self.prefill is None:
            return False, None
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            return False, None
        rid = request.request_id
        # The tokens whose KV the blocks hold (the last sampled one was never computed),
        # and the blocks that hold them.
        tokens = [int(t) for t in request.all_token_ids[: int(request.num_computed_tokens)]]
        blocks = [int(b) for b in block_ids][: -(-len(tokens) // self.block_size)]
        if not tokens or not blocks:
            return False, None
        try:
            granted = self.prefill.hold_in(now, rid, blocks)
        except KvleaseError as e:
            logger.warning("request %s: its turn is not held (%s)", rid, e)
            self.counters.add("holds_refused")
            self._drain_prefill()
            return False, None
        self._drain_prefill()
        self._publish(blocks, granted.generation)
        self.counters.add("holds_granted")
        ttl = self.config.decoder_kv_blocks_ttl
        extension = 2 * ttl / 3 if self.config.symmetric_decoder_lease else 0.0
        try:
            answer = native.KvTransferParams.turn(
                remote_engine_id=self.engine_id,
                remote_request_id=rid,
                remote_block_ids=blocks,
                remote_host=self.config.side_channel_host,
                remote_port=self.side_channel_port,
                tp_size=self.tp_size,
                kvlease_generation=granted.generation,
                kvlease_num_tokens=len(tokens),
                kvlease_block_size=self.block_size,
                kvlease_block_hashes=native.block_hashes(tokens, self.block_size),
                # The end on this engine's wall clock (the agents' D writes the same)
                # and on its perf_counter (NixlConnector's remote_blocks_expiry_time).
                kvlease_deadline_ns=time.time_ns() + round(ttl * 1e9),
                kvlease_clock_port=self.clock_probe.port if self.clock_probe else 0,
                kvlease_ttl_remaining_ms=round(ttl * 1000),
                kvlease_renew_extension_ms=round(extension * 1000),
                kvlease_lease_ms=round(ttl * 1000),
                kvlease_instance=self.instance,
                remote_num_tokens=len(tokens),
                remote_blocks_expiry_time=time.perf_counter() + ttl,
            ).to_dict()
        except InvalidArgument as e:
            logger.error("request %s: no kv_transfer_params for its turn (%s)", rid, e)
            self._p().abort(now, rid)
            self._drain_prefill()
            self.counters.add("holds_refused")
            return False, None
        return True, answer

    def _push_answer(
        self, request: "Request", rid: str, transfer: str, blocks: list[int]
    ) -> dict[str, Any]:
        """P's ``kv_transfer_params`` in push mode: vLLM's keys, as NixlPushConnector
        answers (D reserves its own blocks; P's are named for reference only), and the
        transfer id D's leg must name (``transfer_id``)."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": blocks,
            "remote_engine_id": self.engine_id,
            "remote_request_id": rid,
            "transfer_id": transfer,
            "remote_host": self.config.side_channel_host,
            "remote_port": self.side_channel_port,
            "tp_size": self.tp_size,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": int(request.num_computed_tokens),
            "transfer_mode": "push",
        }

    def _answer(
        self, request: "Request", rid: str, blocks: list[Any], generation: int
    ) -> dict[str, Any]:
        """P's ``kv_transfer_params`` for a granted lease, written by the one codec
        (``KvTransferParams``): vLLM's keys (what its proxies pass along) and the lease's.
        ``blocks``: the block ids, or each KV cache group's (hybrid models)."""
        return native.KvTransferParams(
            remote_engine_id=self.engine_id,
            remote_request_id=rid,
            remote_block_ids=blocks,
            remote_host=self.config.side_channel_host,
            remote_port=self.side_channel_port,
            tp_size=self.tp_size,
            dcp_size=1,
            pp_size=1,
            remote_num_tokens=int(request.num_computed_tokens),
            transfer_mode="pull",
            kvlease_generation=generation,
            kvlease_instance=self.instance,
            kvlease_num_tokens=int(request.num_prompt_tokens),
            kvlease_lease_ms=max(1, round(self.config.lease_duration * 1000)),
        ).to_dict()

    def shutdown(self) -> None:
        if self.side_channel is not None:
            self.side_channel.close()
        if self.clock_probe is not None:
            self.clock_probe.close()
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
