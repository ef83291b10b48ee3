"""Push mode (``transfer_mode: push``, or ``KvleasePushConnector``): D reserves the blocks
it allocated for a request and P writes its KV into them with fenced one-sided writes.

Three flows, all matched by a transfer id:

- **Both legs at once** (what push is for; ``kvlease-proxy --transfer-mode push``): the
  proxy sends P's leg (``do_remote_decode``, ``max_tokens`` 1, ``transfer_id`` T) and D's
  leg (``do_remote_prefill``, ``transfer_mode`` push, ``transfer_id`` T and P's identity:
  ``remote_engine_id``, ``remote_host``, ``remote_port``, ``tp_size``) together. D
  registers its blocks while P still prefills; P writes the moment its prefill ends.
- **Both legs at once without a transfer id** (vLLM's own push proxy): one
  ``X-Request-Id`` for both legs, which D's leg names as ``remote_request_id``.
- **One after the other** (vLLM's older push proxy): P's leg first; D's leg names P's
  answer (``remote_request_id``, or the ``transfer_id`` P's answer carries).

P admits its leg when the request arrives (``on_new_request``), so a registration that
comes first is matched, and P's heartbeats keep D's reservation while the request waits
and prefills on P.

The transfer id (``p_transfer``, ``d_transfer``) is the leg's ``transfer_id`` when it has
one. Without one (vLLM's push proxies send none) it is vLLM's request id without its
random suffix, as NixlPushConnector matches: on P its own; on D its own when the proxy
sent both legs at once with one ``X-Request-Id`` and named that id as
``remote_request_id``, else P's ``remote_request_id`` (P answered first). A client can
repeat an ``X-Request-Id``, so the id alone could pair one prompt's KV with another
request's blocks: D's registration and P's leg each carry a digest of their prompt's
token ids (``prompt_digest``), and P answers a registration whose digest differs from its
leg's with push-failed, writing nothing (D computes the prompt). An id the frames cannot
carry (the grammar's characters, 256 bytes) is not pushed: D computes the prompt.

The decisions are the Rust push cores': ``kvlease.Reservations`` on D (a reservation per
transfer, under a lease P renews with heartbeats; each ends once: written, failed,
expired or aborted) and ``kvlease.PushCore`` on P (writes only once its prefill is done
and D registered, never after D released or P's leg retired; heartbeats; who is told
what). This module holds the scheduler's side of each (``PushDecode``, ``PushPrefill``)
and the frames (docs/spec.md, "Push mode").

How the frames travel: D's worker 0 sends P's worker 0 ``KVL1:PR:`` (registration) and
``KVL1:RR:`` (released), preceded by ``kvlease-push-peer:`` (an application message:
where D's side channel is, so that P's scheduler fetches D's engine info: its workers'
agents, KV layers and write-fence words); P's worker 0 sends D's worker 0 ``KVL1:PH:``
(heartbeats), ``KVL1:WD:`` (written) and ``KVL1:PF:`` (failed). Every worker forwards
what it receives to its scheduler (``KvleaseWorkerMetadata.notifs``), which feeds the
cores. Each P worker writes the heads it shares with each D worker (``kvlease.tp_pairs``,
the pairing D's pull plan uses: D's worker of its rank when the TP sizes are equal; with
MLA's replicated latent cache, each D worker from one P rank).

The write fence: D's workers publish a reservation's generation in the fence words of
its blocks (``Agent.set_write_fence``, the pull mode's fence memfd, one word per block)
before the registration leaves, and clear them before the request is reported (written,
failed) or its blocks are freed (aborted): once cleared, no write of that generation
lands.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import struct
from dataclasses import dataclass, field
from typing import Any

from .. import _kvlease as native
from ..errors import KvleaseError, NotifError
from .metadata import ReservationEndSpec, ReserveSpec, TransmitSpec, WriteSpec

logger = logging.getLogger("kvlease.vllm")

#: The application message D sends before a registration: its side channel's address.
PEER_PREFIX = b"kvlease-push-peer:"
_PUSH_KINDS = {b"PR": "register", b"PH": "heartbeat", b"WD": "write_done",
               b"PF": "push_failed", b"RR": "released"}


_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def base_request_id(rid: str) -> str:
    """vLLM's request id without the random ``-<8 hex>`` suffix its engine appends to the
    id the API server made (``cmpl-<X-Request-Id>-<index>``)."""
    return _RANDOM_SUFFIX.sub("", rid)


def p_transfer(params: dict, rid: str) -> str:
    """The transfer id of P's leg ``rid``: its ``transfer_id``, else ``rid`` without the
    random suffix."""
    return str(params.get("transfer_id") or base_request_id(rid))


def d_transfer(params: dict, rid: str) -> str:
    """The transfer id of D's leg ``rid``: its ``transfer_id``; else, when D's own id is
    the one vLLM's API server made from ``remote_request_id`` (``cmpl-<it>-<index>``: the
    proxy sent both legs at once with one ``X-Request-Id`` and named it), D's own id
    without the random suffix, which is P's too; else ``remote_request_id`` (P's request
    id, from P's answer) without it."""
    if params.get("transfer_id"):
        return str(params["transfer_id"])
    remote = str(params.get("remote_request_id") or "")
    own = base_request_id(rid)
    if re.fullmatch(rf"[a-z]+-{re.escape(remote)}(-[0-9]+)?", own):
        return own
    return base_request_id(remote)


def prompt_digest(token_ids: Any) -> str:
    """32 hex characters: the first 128 bits of SHA-256 over the prompt's token ids
    (little-endian u32). Equal on P and D for the same prompt; different prompts differ."""
    ids = [int(t) for t in token_ids]
    return hashlib.sha256(struct.pack(f"<{len(ids)}I", *ids)).hexdigest()[:32]


def is_push_frame(message: bytes) -> bool:
    return message.startswith(PEER_PREFIX) or (
        message.startswith(b"KVL1:") and message[5:7] in _PUSH_KINDS and message[7:8] == b":"
    )


@dataclass(frozen=True)
class PushFrame:
    """One push-mode message, as ``parse`` read it."""

    kind: str
    transfer: str = ""
    generation: int = 0
    lease_ms: int = 0
    blocks: tuple[int, ...] = ()
    transfers: tuple[str, ...] = ()
    #: ``peer``: D's engine, side channel host and port.
    peer: tuple[str, str, int] | None = None
    #: ``register``: the digest of D's prompt (``prompt_digest``), if it sent one.
    prompt: str | None = None


def parse(message: bytes) -> PushFrame:
    """A push frame, checked first by the one codec (``decode_notif``, strict and
    canonical); raises ``NotifError`` (or ``KvleaseError`` for a bad peer message)."""
    if message.startswith(PEER_PREFIX):
        try:
            body = json.loads(message[len(PEER_PREFIX):])
            peer = (str(body["engine"]), str(body["host"]), int(body["port"]))
        except (ValueError, KeyError, TypeError) as e:
            raise KvleaseError(f"malformed push peer message: {e}") from None
        return PushFrame("peer", peer=peer)
    decoded = native.decode_notif(message)
    kind = _PUSH_KINDS.get(message[5:7])
    if str(decoded.kind) != "push" or kind is None:
        raise NotifError(f"not a push frame: {message[:16]!r}")
    body = message[8:].decode("ascii")
    if kind == "heartbeat":
        return PushFrame(kind, transfers=tuple(decoded.ids or ()))
    if kind == "register":
        transfer, gen, lease_ms, blocks = body.split(";")[:4]
        return PushFrame(kind, transfer, int(gen), int(lease_ms),
                         tuple(int(b) for b in blocks.split(",")), prompt=decoded.prompt)
    transfer, gen = body.split(";")
    return PushFrame(kind, transfer, int(gen))


def encode_register(transfer: str, generation: int, lease_ms: int, blocks: list[int],
                    prompt: str | None = None) -> bytes:
    tail = f";{prompt}" if prompt else ""
    return (f"KVL1:PR:{transfer};{generation};{lease_ms};{','.join(map(str, blocks))}"
            f"{tail}").encode()


def encode_ref(kind: str, transfer: str, generation: int) -> bytes:
    """``KVL1:WD:`` / ``PF:`` / ``RR:`` of ``transfer`` and ``generation``."""
    code = {"write_done": "WD", "push_failed": "PF", "released": "RR"}[kind]
    return f"KVL1:{code}:{transfer};{generation}".encode()


def encode_heartbeats(transfers: list[str], max_len: int = 16 * 1024) -> list[bytes]:
    out, cur = [], b""
    for t in transfers:
        piece = t.encode()
        if cur and len(cur) + 1 + len(piece) > max_len:
            out.append(cur)
            cur = b""
        cur = piece if not cur else cur + b"," + piece
    if cur:
        out.append(cur)
    return [b"KVL1:PH:" + m for m in out]


def check(message: bytes) -> bytes:
    """``message`` as the codec accepts it (an encoder's bug fails here, not at P)."""
    parse(message)
    return message


# ----------------------------------------------------------------------------- D side


@dataclass
class _Leg:
    """D's request waiting for P's write."""

    request: str
    engine: str
    transfer: str
    host: str
    port: int
    tp_size: int
    #: ``prompt_digest`` of the request's prompt.
    prompt: str | None = None
    blocks: list[int] = field(default_factory=list)
    generation: int = 0


class PushDecode:
    """D's scheduler side of push mode: the requests (legs) that wait for P's write,
    their reservations (``kvlease.Reservations``) and what the workers do about them."""

    def __init__(self, lease_duration: float, counters: Any):
        self.reservations = native.Reservations(lease_duration=lease_duration)
        self.counters = counters
        self.legs: dict[str, _Leg] = {}
        self._by_transfer: dict[str, str] = {}
        self.reserves: list[ReserveSpec] = []
        self.ends: list[ReservationEndSpec] = []
        self.transmits: list[TransmitSpec] = []
        #: P engines a reservation expired on (no heartbeats: P died or stalled).
        self.lost: list[str] = []

    @staticmethod
    def wants(params: dict | None) -> bool:
        """A D leg of vLLM's push flow: a remote prefill naming P, with no P blocks (or
        P's params passed on whole: ``transfer_mode`` push), and the transfer (the
        proxy's ``transfer_id``, or a ``remote_request_id``: ``d_transfer``)."""
        return bool(
            params
            and params.get("do_remote_prefill")
            and (not params.get("remote_block_ids") or params.get("transfer_mode") == "push")
            and params.get("remote_engine_id")
            and (params.get("transfer_id") or params.get("remote_request_id"))
        )

    def admit(self, request: str, params: dict, prompt: str | None = None) -> _Leg:
        leg = _Leg(
            request=request,
            engine=str(params["remote_engine_id"]),
            transfer=d_transfer(params, request),
            prompt=prompt,
            host=str(params.get("remote_host") or "127.0.0.1"),
            port=int(params.get("remote_port") or 0),
            tp_size=int(params.get("tp_size") or 1),
        )
        self.legs[request] = leg
        return leg

    def reserve(self, now: float, rid: str, blocks: list[int], peer: bytes) -> bool:
        """Reserves ``blocks`` for ``rid`` and queues the fence and the registration."""
        leg = self.legs[rid]
        try:
            r = self.reservations.reserve(now, leg.transfer, leg.engine, blocks,
                                          prompt=leg.prompt)
        except KvleaseError as e:
            logger.warning("request %s: no reservation (%s): computing locally", rid, e)
            self.counters.add("reservations_refused")
            return False
        leg.blocks, leg.generation = list(r.blocks), int(r.generation)
        self._by_transfer[leg.transfer] = rid
        lease_ms = max(1, round(r.lease * 1000))
        self.reserves.append(
            ReserveSpec(
                request=rid,
                engine=leg.engine,
                blocks=leg.blocks,
                generation=leg.generation,
                messages=[peer, check(encode_register(leg.transfer, leg.generation,
                                                      lease_ms, leg.blocks, leg.prompt))],
            )
        )
        self.counters.add("reservations_made")
        logger.info(
            "request %s: %d blocks reserved for P %s's push of %s (generation %d)",
            rid, len(leg.blocks), leg.engine, leg.transfer, leg.generation,
        )
        return True

    def handle(self, now: float, prefill: str, frame: PushFrame) -> None:
        res = self.reservations
        if frame.kind == "heartbeat":
            out = res.handle_heartbeat(now, prefill, list(frame.transfers))
            self.counters.add("push_heartbeats_received")
            if out.get("extended"):
                self.counters.add("reservations_renewed", out["extended"])
        elif frame.kind == "write_done":
            verdict = res.handle_write_done(now, prefill, frame.transfer, frame.generation)
            self.counters.add(f"write_done_{verdict}")
        elif frame.kind == "push_failed":
            verdict = res.handle_push_failed(now, prefill, frame.transfer, frame.generation)
            self.counters.add(f"push_failed_{verdict}")
        else:
            self.counters.add("push_frames_ignored")
        self.drain(now)

    def abort(self, now: float, rid: str) -> bool:
        """The request ended on D: ``True`` when its reservation was still held (it
        ends aborted: the workers clear the fence, P is told)."""
        leg = self.legs.get(rid)
        if leg is None:
            return False
        if leg.generation and self.reservations.abort(now, leg.transfer):
            self.drain(now)
            return True
        self.drain(now)
        self.legs.pop(rid, None)
        return False

    def handle_timeout(self, now: float) -> None:
        self.reservations.handle_timeout(now)
        self.drain(now)

    def drain(self, now: float) -> None:
        while (event := self.reservations.poll_event()) is not None:
            rid = self._by_transfer.pop(event.transfer, None)
            outcome = str(event.outcome)
            self.counters.add(f"reservations_{outcome}")
            leg = self.legs.pop(rid, None) if rid is not None else None
            if rid is None or leg is None:
                continue
            if outcome == "expired":
                self.lost.append(leg.engine)
            if outcome not in ("written", "aborted"):
                logger.warning(
                    "request %s: P's push of %s did not come (%s): failing the load",
                    rid, event.transfer, outcome,
                )
            self.ends.append(ReservationEndSpec(rid, list(event.blocks), outcome))
            if event.tells_prefill:
                msg = check(encode_ref("released", event.transfer, int(event.generation)))
                self.transmits.append(TransmitSpec(leg.engine, "release", msg))


# ----------------------------------------------------------------------------- P side


@dataclass
class _Write:
    """A write P's workers post: the outcomes so far (one per worker)."""

    generation: int
    outcomes: list[bool] = field(default_factory=list)


class PushPrefill:
    """P's scheduler side of push mode: ``kvlease.PushCore``, the D engines it writes
    to (by their engine info, fetched from D's side channel), the writes in flight."""

    def __init__(self, lease_duration: float, tp_size: int, counters: Any,
                 num_kv_heads: int | None = None, replicated: bool = False):
        self.core = native.PushCore(lease_duration=lease_duration)
        self.tp_size = tp_size
        #: The model's KV heads (all ranks) and whether every rank holds all of them
        #: (MLA); ``None``: unknown, only a D of P's TP size is written.
        self.num_kv_heads = num_kv_heads
        self.replicated = replicated
        self.counters = counters
        #: D engine -> (host, port) of its side channel, as its peer message said.
        self.peers: dict[str, tuple[str, int]] = {}
        #: PushWrite actions waiting for D's engine info.
        self.parked: list[Any] = []
        self.writes: dict[str, _Write] = {}
        self.transmits: list[TransmitSpec] = []
        #: P's requests whose blocks vLLM may free now.
        self.freed: list[str] = []
        self.to_write: list[WriteSpec] = []
        #: P's requests admitted and not yet prefilled -> their transfer ids.
        self.transfers: dict[str, str] = {}

    def admit(self, now: float, rid: str, transfer: str, prompt: str | None = None) -> bool:
        """P's leg ``rid`` of ``transfer`` arrived: from now on a registration of D for
        it is matched (when its prompt digest equals ``prompt``), and P's heartbeats keep
        D's reservation while the request waits and prefills here."""
        if not self._command(rid, self.core.admit, now, transfer, rid, prompt):
            return False
        self.transfers[rid] = transfer
        self.counters.add("pushes_admitted")
        return True

    def transfer_of(self, rid: str) -> str | None:
        return self.transfers.get(rid)

    def finished(self, now: float, rid: str, blocks: list[int]) -> bool:
        """P's leg finished its prefill: its blocks are written once D registered (at
        once when D registered already)."""
        transfer = self.transfers.pop(rid, None)
        if transfer is None:
            return False
        return self._command(rid, self.core.handle_prefill_done, now, transfer, blocks)

    def _command(self, rid: str, command: Any, *args: Any) -> bool:
        """``command(*args)`` of the core; a refusal is logged and counted (not pushed)."""
        try:
            command(*args)
        except KvleaseError as e:
            logger.warning("request %s: not pushed (%s)", rid, e)
            self.counters.add("pushes_refused")
            return False
        return True

    def retire(self, now: float, rid: str) -> None:
        """P's leg ended without a prefill to push (aborted, failed, nothing to write):
        the push ends, and D, when it registered, is told at once."""
        transfer = self.transfers.pop(rid, None)
        if transfer is not None and self.core.retire(now, transfer):
            self.counters.add("pushes_retired")

    def handle(self, now: float, decode: str, frame: PushFrame) -> None:
        if frame.kind == "register":
            outcome = self.core.handle_registration(
                now, decode, frame.transfer, frame.generation, frame.lease_ms / 1000.0,
                list(frame.blocks), frame.prompt,
            )
            self.counters.add(f"registrations_{outcome}")
            if outcome == "prompt_mismatch":
                logger.warning(
                    "push of %s: D %s registered for another prompt than P's leg has "
                    "(a repeated request id?): not written, D computes it",
                    frame.transfer, decode,
                )
        elif frame.kind == "released":
            self.core.handle_reservation_released(now, decode, frame.transfer, frame.generation)
            self.counters.add("reservations_released_by_d")
        else:
            self.counters.add("push_frames_ignored")

    def write_result(self, now: float, transfer: str, outcomes: list[Any]) -> None:
        w = self.writes.get(transfer)
        if w is None:
            return
        for o in outcomes:
            if int(o.generation) == w.generation:
                w.outcomes.append(bool(o.ok))
                if not o.ok:
                    logger.warning("push of %s: write failed: %s", transfer, o.error)
        if len(w.outcomes) >= self.tp_size or not all(w.outcomes):
            del self.writes[transfer]
            ok = all(w.outcomes)
            self.counters.add("writes_done" if ok else "writes_failed")
            self.core.handle_write_result(now, transfer, w.generation, ok)

    def fail_write(self, now: float, transfer: str, generation: int, why: str) -> None:
        logger.warning("push of %s: not written (%s)", transfer, why)
        self.counters.add("writes_failed")
        self.writes.pop(transfer, None)
        self.core.handle_write_result(now, transfer, generation, False)

    def step(self, now: float, engines: dict[str, Any], failed: dict[str, str]) -> None:
        """The reaper, heartbeats due and the core's actions; ``engines``: D engine
        infos known, ``failed``: D engines whose handshake failed (why)."""
        self.core.handle_timeout(now)
        while (hb := self.core.poll_heartbeat(now)) is not None:
            decode, transfers = hb
            if decode not in engines:
                # D's engine info is still being fetched: the workers cannot reach it
                # yet. The next interval's heartbeat renews the reservation (its lease
                # is six intervals).
                self.counters.add("push_heartbeats_deferred")
                continue
            for msg in encode_heartbeats(list(transfers)):
                self.transmits.append(TransmitSpec(decode, "push_heartbeat", check(msg)))
        parked, self.parked = self.parked, []
        for action in parked:
            if self.core.is_writing(action.transfer):  # not ended meanwhile (D released)
                self._act(now, action, engines, failed)
        while (action := self.core.poll_action()) is not None:
            self._act(now, action, engines, failed)

    def _rank_pairs(
        self, d_tp: int
    ) -> list[tuple[int, int, tuple[int, int] | None, tuple[int, int] | None]]:
        """Which P worker writes which heads into which of a ``d_tp``-worker D's
        (``WriteSpec.pairs``)."""
        if d_tp == self.tp_size:
            return [(r, r, None, None) for r in range(self.tp_size)]
        if self.num_kv_heads is None:
            raise KvleaseError(f"D's TP size {d_tp} is not P's {self.tp_size}")
        out = []
        for src, dst, (start, end) in native.tp_pairs(
            self.num_kv_heads, self.tp_size, d_tp, self.replicated
        ):
            if self.replicated:
                out.append((src, dst, None, None))
                continue
            p_first = src * (self.num_kv_heads // self.tp_size)
            d_first = dst * (self.num_kv_heads // d_tp)
            out.append((src, dst, (start - p_first, end - p_first),
                        (start - d_first, end - d_first)))
        return out

    def _act(self, now: float, action: Any, engines: dict[str, Any], failed: dict[str, str]) -> None:
        if isinstance(action, native.PushWrite):
            info = engines.get(action.decode)
            if info is None:
                why = failed.get(action.decode)
                if why is not None or action.decode not in self.peers:
                    self.fail_write(now, action.transfer, int(action.generation),
                                    why or "D named no side channel")
                else:
                    self.parked.append(action)
                return
            try:
                ranks = self._rank_pairs(int(info.tp_size))
            except KvleaseError as e:
                self.fail_write(now, action.transfer, int(action.generation), str(e))
                return
            pairs = [(int(p), int(d)) for p, d in action.pairs]
            self.writes[action.transfer] = _Write(int(action.generation))
            self.to_write.append(
                WriteSpec(
                    transfer=action.transfer,
                    engine=action.decode,
                    generation=int(action.generation),
                    local_blocks=[p for p, _ in pairs],
                    remote_blocks=[d for _, d in pairs],
                    fence_block=pairs[-1][1],
                    pairs=ranks,
                )
            )
            self.counters.add("writes_posted")
        elif isinstance(action, native.PushSend):
            msg = check(encode_ref(str(action.kind), action.transfer, int(action.generation)))
            self.transmits.append(TransmitSpec(action.to, str(action.kind), msg))
        elif isinstance(action, native.PushEnded):
            self.counters.add(f"pushes_ended_{action.outcome}")
            # A push that ended before its prefill did holds no block of P's (vLLM
            # freed the request's blocks when it ended, or frees them when it does).
            self.transfers.pop(action.request, None)
            if action.blocks:
                self.freed.append(action.request)
