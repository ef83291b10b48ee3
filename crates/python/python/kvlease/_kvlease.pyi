"""Type stubs of the native module ``kvlease._kvlease`` (see ``crates/python/src``)."""

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from .errors import HandshakeError, KvleaseError
from .kinds import (
    BatchStatus,
    FenceVerdict,
    NotifKind,
    Outcome,
    PushOutcome,
    ReadCompleteOutcome,
    RegistrationOutcome,
    ReleaseReason,
    ReservationOutcome,
    TransmitKind,
)

__version__: str

# ------------------------------------------------------------------------- transport

class Region:
    """A registered local region."""

    @property
    def id(self) -> int: ...
    @property
    def length(self) -> int: ...
    @property
    def key(self) -> int: ...
    @property
    def base(self) -> int: ...
    @property
    def kind(self) -> str:
        """``"host"`` or ``"cuda:<ordinal>"``."""

class RemoteRegion:
    """A peer's region, from its metadata."""

    def __init__(self, id: int, key: int, length: int) -> None: ...
    @property
    def id(self) -> int: ...
    @property
    def key(self) -> int: ...
    @property
    def length(self) -> int: ...
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...

class Peer:
    """A connected peer."""

    @property
    def name(self) -> str: ...
    @property
    def backend(self) -> Literal["tcp", "shm", "verbs"]: ...
    @property
    def backend_reason(self) -> str: ...
    @property
    def regions(self) -> list[RemoteRegion]: ...
    def region(self, id: int) -> RemoteRegion:
        """The peer's region ``id``; raises ``InvalidArgument`` if it has none."""

class Batch:
    """A posted read or write batch."""

    @property
    def peer(self) -> str: ...

class BatchResult:
    """How a batch ended."""

    @property
    def status(self) -> BatchStatus: ...
    @property
    def ok(self) -> bool: ...
    @property
    def bytes(self) -> int: ...
    @property
    def fence_word(self) -> int | None: ...
    @property
    def backend(self) -> Literal["tcp", "shm", "cma", "verbs"] | None:
        """The backend that moved the bytes (``None`` unless done): ``"cma"`` when any
        of them was read with cross-memory attach (host memory of a same-host peer that
        is not a memfd: buffers and tensors registered from Python)."""
    @property
    def error(self) -> KvleaseError | None: ...
    def raise_for_status(self) -> None: ...

ReadOp = tuple[Region | int, int, RemoteRegion, int, int]
Fence = tuple[RemoteRegion, int, int]
#: ``(local source, local_offset, remote destination, remote_offset, length)``
WriteOp = tuple[Region | int, int, RemoteRegion, int, int]
#: ``(remote_region, offset, generation)``: the peer's write-fence word
WriteFence = tuple[RemoteRegion, int, int]

class Agent:
    """A transfer agent: registered memory, metadata, peers, fenced batched reads and
    notifications. Blocking calls release the GIL."""

    def __init__(
        self,
        name: str,
        *,
        listen: str = "127.0.0.1:0",
        advertise: str | None = None,
        token: bytes | None = None,
        backend: Literal["auto", "tcp", "shm", "verbs"] = "auto",
        num_connections: int = 2,
        handshake_timeout: float = 5.0,
        allow_unauthenticated: bool = False,
    ) -> None:
        """Without ``token``, a ``listen`` address beyond loopback raises
        ``InvalidArgument`` unless ``allow_unauthenticated=True``."""
    @property
    def name(self) -> str: ...
    @property
    def address(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    def register(self, obj: Any) -> Region:
        """Registers the memory of a buffer, array or (CPU/CUDA) tensor; keeps ``obj`` alive."""
    def register_memory(
        self, ptr: int, length: int, *, owner: Any = None, device: int | None = None
    ) -> Region:
        """Registers raw memory; the caller keeps it valid (or passes its ``owner``)."""
    def deregister(self, region: Region) -> None: ...
    def metadata(self) -> bytes: ...
    def connect(self, metadata: bytes) -> Peer: ...
    def disconnect(self, peer: Peer) -> None: ...
    def post_read(
        self,
        peer: Peer,
        ops: Iterable[ReadOp],
        *,
        notif: bytes | None = None,
        fence: Fence | None = None,
        timeout: float = 30.0,
    ) -> Batch: ...
    def post_write(
        self,
        peer: Peer,
        ops: Iterable[WriteOp],
        *,
        fence: WriteFence,
        notif: bytes | None = None,
        timeout: float = 30.0,
    ) -> Batch:
        """Fenced one-sided writes (push mode, TCP peers); poll as a read batch. A write
        the peer's fence refused ends the batch ``stale`` (``StaleFenceError``)."""
    def set_write_fence(self, region: Region | int, offset: int, value: int) -> None:
        """Stores ``value`` in the write-fence word at ``offset`` of ``region`` under the
        lock peers' writes land under; raises ``RegisterError`` for a bad word."""
    def poll(self, batch: Batch) -> BatchResult | None: ...
    def wait(self, batches: Sequence[Batch], timeout: float | None = None) -> list[BatchResult | None]: ...
    def read(
        self,
        peer: Peer,
        ops: Iterable[ReadOp],
        *,
        notif: bytes | None = None,
        fence: Fence | None = None,
        timeout: float = 30.0,
    ) -> BatchResult: ...
    def send_notif(self, peer: Peer, message: bytes) -> None: ...
    def get_new_notifs(self) -> dict[str, list[bytes]]: ...
    def stats(self) -> dict[str, int]: ...
    def close(self) -> None: ...
    def __enter__(self) -> Agent: ...
    def __exit__(self, *args: object) -> None: ...

class FenceWords:
    """One 8-byte generation word per block over host memory (e.g. a shared mmap)."""

    def __init__(self, buffer: Any, num_blocks: int) -> None: ...
    def __len__(self) -> int: ...
    def publish(self, blocks: Sequence[int], word: int) -> None: ...
    def word(self, block: int) -> int: ...
    def offset(self, block: int) -> int: ...

# ---------------------------------------------------------------------- prefill core

class PrefillStart:
    request: str
    blocks: list[int]
    waited: float

class Granted:
    request: str
    blocks: list[int]
    generation: int
    superseded: bool

class Released:
    request: str
    blocks: list[int]
    generation: int
    reason: ReleaseReason
    granted_at: float
    expiry: float
    at_max_lifetime: bool
    hold: bool
    last_heartbeat: float | None
    released_at: float

class ClearFences:
    """Publish the free word (0) for ``released.blocks`` now."""

    released: Released

class SendNotif:
    to: str
    message: bytes

class PrefillNotifOutcome:
    """What ``PrefillCore.handle_notif`` did: ``kind`` and the fields of that kind (the
    others are ``None``)."""

    kind: NotifKind
    #: heartbeat: ids named; held, extended, unknown, late and foreign ids
    ids: int | None
    #: heartbeat: ids of live leases; abort: 1 when it released a lease, else 0
    held: int | None
    extended: int | None
    unknown: int | None
    late: int | None
    foreign: int | None
    #: read_complete, abort, foreign
    request: str | None
    #: read_complete
    outcome: ReadCompleteOutcome | None
    remaining: int | None
    #: malformed
    error: str | None

class Refused:
    request: str
    error: KvleaseError

class PrefillCore:
    """Every lease decision of a prefill engine (P)."""

    def __init__(
        self,
        engine_id: str,
        *,
        tp_size: int,
        num_blocks: int,
        block_size: int,
        lease_duration: float = 30.0,
        external_blocks: bool = False,
        pool_wait: float = 0.0,
        first_generation: int | None = None,
        max_consumers: int | None = None,
        max_lease_lifetime: float | None = None,
        hold_duration: float | None = None,
        hold_renewable: bool = True,
    ) -> None: ...
    @property
    def engine_id(self) -> str: ...
    @property
    def lease_duration(self) -> float: ...
    @property
    def heartbeat_interval(self) -> float: ...
    @property
    def leases(self) -> int: ...
    @property
    def blocks_leased(self) -> int: ...
    @property
    def blocks_allocated(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    def is_idle(self) -> bool: ...
    def owner(self, request: str) -> str | None: ...
    def lease(self, request: str) -> dict[str, Any] | None: ...
    def hold(self, request: str) -> dict[str, Any] | None: ...
    def stats(self) -> dict[str, int]: ...
    def handle_job(self, now: float, request: str, num_tokens: int) -> None: ...
    def poll_prefill(self, now: float) -> PrefillStart | None: ...
    def handle_prefill_done(self, now: float, request: str) -> Granted: ...
    def handle_prefill_done_in(self, now: float, request: str, blocks: Sequence[int]) -> Granted: ...
    def hold_in(self, now: float, request: str, blocks: Sequence[int]) -> Granted: ...
    def handle_prefill_failed(self, request: str) -> bool: ...
    def abort(self, now: float, request: str) -> bool: ...
    def shutdown(self) -> None: ...
    def handle_notif(
        self, now: float, sender_engine: str, sender: str, message: bytes
    ) -> PrefillNotifOutcome: ...
    def handle_timeout(self, now: float) -> None: ...
    def poll_timeout(self) -> float | None: ...
    def poll_action(self) -> ClearFences | SendNotif | None: ...
    def poll_event(self) -> Released | Refused | None: ...

# ----------------------------------------------------------------------- decode core

class RemoteKv:
    """Where a request's KV lives on P (the typed core of ``kv_transfer_params``)."""

    def __init__(
        self,
        *,
        engine: str,
        request: str,
        blocks: Sequence[int],
        generation: int,
        tp_size: int,
        num_tokens: int,
        host: str,
        port: int,
        instance: int = 0,
    ) -> None: ...
    engine: str
    request: str
    blocks: list[int]
    generation: int
    tp_size: int
    num_tokens: int
    host: str
    port: int
    instance: int

# ------------------------------------------------------------------------- push mode

class Reservation:
    transfer: str
    blocks: list[int]
    generation: int
    lease: float
    #: the digest of D's prompt (32 lowercase hex digits) the registration carries
    prompt: str | None

class ReservationEnded:
    transfer: str
    prefill: str
    blocks: list[int]
    generation: int
    outcome: ReservationOutcome
    at: float
    tells_prefill: bool
    needs_recompute: bool

class Reservations:
    """D's push-mode reservations: reserved blocks, their leases and the write fence."""

    def __init__(
        self,
        *,
        lease_duration: float = 30.0,
        max_lease_lifetime: float | None = None,
        first_generation: int = 1,
    ) -> None: ...
    @property
    def lease_duration(self) -> float: ...
    @property
    def blocks_held(self) -> int: ...
    def __len__(self) -> int: ...
    def get(self, transfer: str) -> tuple[int, list[int]] | None: ...
    def expiry(self, transfer: str) -> float | None: ...
    def reserve(
        self, now: float, transfer: str, prefill: str, blocks: Sequence[int], prompt: str | None = None
    ) -> Reservation: ...
    def handle_heartbeat(self, now: float, prefill: str, transfers: Sequence[str]) -> dict[str, int]: ...
    def admits_write(self, prefill: str, transfer: str, generation: int) -> FenceVerdict: ...
    def handle_write_done(self, now: float, prefill: str, transfer: str, generation: int) -> FenceVerdict: ...
    def handle_push_failed(self, now: float, prefill: str, transfer: str, generation: int) -> FenceVerdict: ...
    def abort(self, now: float, transfer: str) -> bool: ...
    def handle_timeout(self, now: float) -> int: ...
    def poll_timeout(self) -> float | None: ...
    def poll_event(self) -> ReservationEnded | None: ...
    def stats(self) -> dict[str, int]: ...

class PushWrite:
    transfer: str
    decode: str
    generation: int
    pairs: list[tuple[int, int]]

class PushSend:
    to: str
    kind: Literal["write_done", "push_failed"]
    transfer: str
    generation: int

class PushEnded:
    transfer: str
    request: str
    decode: str | None
    blocks: list[int]
    outcome: PushOutcome

class PushCore:
    """P's push-mode core: when P writes, which registrations it heartbeats, who is told."""

    def __init__(
        self,
        *,
        lease_duration: float = 30.0,
        registration_wait: float | None = None,
        remember_ended: float | None = None,
    ) -> None: ...
    @property
    def heartbeat_interval(self) -> float: ...
    @property
    def pushing(self) -> int: ...
    def is_idle(self) -> bool: ...
    def is_writing(self, transfer: str) -> bool: ...
    def admit(self, now: float, transfer: str, request: str, prompt: str | None = None) -> None: ...
    def handle_registration(
        self,
        now: float,
        decode: str,
        transfer: str,
        generation: int,
        lease: float,
        blocks: Sequence[int],
        prompt: str | None = None,
    ) -> RegistrationOutcome: ...
    def handle_prefill_done(self, now: float, transfer: str, blocks: Sequence[int]) -> None: ...
    def handle_write_result(self, now: float, transfer: str, generation: int, ok: bool) -> bool: ...
    def handle_reservation_released(self, now: float, decode: str, transfer: str, generation: int) -> bool: ...
    def retire(self, now: float, transfer: str) -> bool: ...
    def handle_timeout(self, now: float) -> None: ...
    def poll_timeout(self) -> float | None: ...
    def poll_heartbeat(self, now: float) -> tuple[str, list[str]] | None: ...
    def poll_action(self) -> PushWrite | PushSend | PushEnded | None: ...
    def stats(self) -> dict[str, int]: ...

# ----------------------------------------------------------------- kv_transfer_params

class PullPlan:
    """What :meth:`KvTransferParams.plan_pull` decided."""

    pull: bool
    reason: str | None
    blocks: list[int]
    tokens: int
    diverged: bool

def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]: ...
def kv_mismatches(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """Every key of kvlease-proto's KV compatibility check on which P's descriptor
    ``theirs`` differs from D's ``ours``: ``(key, P's value, D's value)``, in key order."""

class KvTransferParams:
    """``kv_transfer_params`` as P answers them and D takes them: vLLM's keys and
    kvlease's, read and checked by the same codec as the agents' (``kvlease-proto``).

    Every check raises :class:`~kvlease.errors.InvalidArgument` with ``field`` (the full
    path, ``"kv_transfer_params.remote_port"``) and ``reason``.
    """

    def __init__(
        self,
        *,
        remote_engine_id: str,
        remote_request_id: str,
        remote_block_ids: Sequence[int],
        remote_host: str,
        remote_port: int,
        tp_size: int,
        kvlease_generation: int,
        kvlease_num_tokens: int,
        kvlease_lease_ms: int | None = None,
        kvlease_instance: int | None = None,
        kv_digest: str | None = None,
        dcp_size: int | None = None,
        pp_size: int | None = None,
        remote_num_tokens: int | None = None,
        transfer_mode: str | None = None,
    ) -> None:
        """P's answer, checked as D will read it."""
    @staticmethod
    def from_dict(params: Mapping[str, Any]) -> KvTransferParams:
        """Reads D's ``kv_transfer_params`` (``do_remote_prefill`` must be true). Also
        reads the old ``kvlease_lease_duration`` (seconds) and one KV cache group's
        ``[[...]]`` block list."""
    def to_dict(self) -> dict[str, Any]:
        """The dict P answers with: canonical keys, ``do_remote_prefill: True``,
        ``do_remote_decode: False``, optional keys only when set."""
    def to_remote_kv(self) -> RemoteKv:
        """The typed coordinates :meth:`DecodeCore.on_new_request` takes."""
    @staticmethod
    def turn(
        *,
        remote_engine_id: str,
        remote_request_id: str,
        remote_block_ids: Sequence[int],
        remote_host: str,
        remote_port: int,
        tp_size: int,
        kvlease_generation: int,
        kvlease_num_tokens: int,
        kvlease_block_size: int,
        kvlease_block_hashes: Sequence[int],
        kvlease_deadline_ns: int,
        kvlease_ttl_remaining_ms: int,
        kvlease_renew_extension_ms: int | None = None,
        kvlease_lease_ms: int | None = None,
        kvlease_instance: int | None = None,
        remote_num_tokens: int | None = None,
        remote_blocks_expiry_time: float | None = None,
        conversation_id: str | None = None,
    ) -> KvTransferParams:
        """A turn (bidirectional mode): the holding engine's lease keys and the turn's,
        checked as the next turn's P reads them."""
    @staticmethod
    def from_turn_dict(params: Mapping[str, Any]) -> KvTransferParams:
        """Reads a turn (``kvlease_bidir`` true) as the next turn's P gets it."""
    @property
    def is_turn(self) -> bool: ...
    @property
    def kvlease_block_size(self) -> int | None: ...
    @property
    def kvlease_block_hashes(self) -> list[int] | None: ...
    @property
    def kvlease_deadline_ns(self) -> int | None: ...
    @property
    def kvlease_ttl_remaining_ms(self) -> int | None: ...
    @property
    def kvlease_renew_extension_ms(self) -> int | None: ...
    def plan_pull(
        self,
        prompt: Sequence[int],
        block_size: int,
        now: float,
        *,
        threshold_tokens: int,
        safety_margin: float,
        received_at: float,
        expected_transfer: float = 0.0,
    ) -> PullPlan:
        """P's decision for the next turn's prompt: pull the turn's whole blocks whose
        prefix hashes equal the prompt's, or recompute (the engine's ``plan_pull``)."""
    @property
    def remote_engine_id(self) -> str: ...
    @property
    def remote_request_id(self) -> str: ...
    @property
    def remote_block_ids(self) -> list[int]: ...
    @property
    def remote_host(self) -> str: ...
    @property
    def remote_port(self) -> int: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def dcp_size(self) -> int | None: ...
    @property
    def pp_size(self) -> int | None: ...
    @property
    def remote_num_tokens(self) -> int | None: ...
    @property
    def transfer_mode(self) -> str | None: ...
    @property
    def kvlease_generation(self) -> int: ...
    @property
    def kvlease_num_tokens(self) -> int: ...
    @property
    def kvlease_lease_ms(self) -> int | None: ...
    @property
    def kvlease_instance(self) -> int: ...
    @property
    def kv_digest(self) -> str | None: ...
    def __eq__(self, other: object) -> bool: ...

class WorkerInfo:
    """One P worker of an :class:`EngineInfo` (read only)."""

    @property
    def rank(self) -> int: ...
    @property
    def agent_metadata(self) -> bytes:
        """Its transport agent's metadata (:meth:`Agent.connect`)."""
    @property
    def fence_region(self) -> int:
        """The id of its fence-words region."""
    @property
    def agent_name(self) -> str | None: ...
    @property
    def device(self) -> str | None: ...
    @property
    def num_blocks(self) -> int | None: ...
    @property
    def layers(self) -> list[tuple[str, int, int, int, int, int]]:
        """The connector's: ``(name, region, offset, block stride, block bytes, num
        blocks)`` per KV cache layer (empty for an agent)."""
    @property
    def kv_format(self) -> dict[str, list[Any]] | None:
        """The connector's: layer name -> ``[dtype, block shape, order]``; ``None`` when
        P names none."""
    @property
    def pool(self) -> dict[str, int] | None:
        """The agents': the pool region (``id``, ``base``, ``len``, ``key``)."""
    @property
    def fence(self) -> dict[str, int] | None:
        """The agents': the fence region (``id``, ``base``, ``len``, ``key``)."""

class EngineInfo:
    """The engine-info handshake payload a P serves on its side channel: one type for the
    agents' P and the connector's, built and read by the same codec as the agents'
    (``kvlease-proto``). The connector's part is ``block_size``, ``num_kv_heads``, ``kv``
    and the workers' ``layers``/``kv_format``; the agents' is ``shape`` and the workers'
    ``pool``/``fence``.

    Every check raises :class:`~kvlease.errors.InvalidArgument` with ``field`` (the path,
    ``"engine_info.workers[0].agent_metadata"``) and ``reason``.
    """

    def __init__(
        self,
        *,
        engine_id: str,
        tp_size: int,
        num_blocks: int,
        instance: int | None = None,
        block_size: int | None = None,
        num_kv_heads: int | None = None,
        kv: Mapping[str, Any] | None = None,
        workers: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        """P's engine info, checked as D will read it; each worker a dict with the keys of
        :class:`WorkerInfo` (``agent_metadata`` as bytes)."""
    @staticmethod
    def from_bytes(raw: bytes) -> EngineInfo:
        """Reads a payload P served."""
    def to_bytes(self) -> bytes:
        """The payload's bytes (what :class:`SideChannelServer` serves)."""
    def to_dict(self) -> dict[str, Any]:
        """The payload as JSON values (``agent_metadata`` base64)."""
    def worker(self, rank: int) -> WorkerInfo | None:
        """P's worker ``rank``, or ``None`` when it lists none."""
    @property
    def engine_id(self) -> str: ...
    @property
    def instance(self) -> int:
        """P's start time in µs (0: not sent)."""
    @property
    def tp_size(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int | None: ...
    @property
    def num_kv_heads(self) -> int | None: ...
    @property
    def kv(self) -> dict[str, Any] | None:
        """The connector's KV compatibility descriptor; ``None`` when P sent none."""
    @property
    def shape(self) -> dict[str, int] | None:
        """The agents' model shape (``num_layers``, ``num_kv_heads``, ``block_size``,
        ``head_dim``)."""
    @property
    def workers(self) -> list[WorkerInfo]: ...

class HandshakeStart:
    engine: str
    host: str
    port: int
    check_instance: int | None

class Transmit:
    engine: str
    workers: int
    message: bytes
    kind: TransmitKind
    ids: int

class BatchPlan:
    d_worker: int
    p_rank: int
    heads: tuple[int, int]
    p_first_head: int
    d_first_head: int
    notif: bytes

class LoadPlan:
    request: str
    blocks: list[int]
    remote: RemoteKv
    skip_blocks: int
    fence_generation: int
    batches: list[BatchPlan]

class Loaded:
    request: str
    blocks: list[int]
    bytes: int

class HandshakeDone:
    engine: str

class EngineDropped:
    engine: str

class Finished:
    request: str
    outcome: Outcome
    error: KvleaseError | None
    retryable: bool

class DecodeNotifOutcome:
    """What ``DecodeCore.handle_notif`` did: ``kind`` and the fields of that kind (the
    others are ``None``)."""

    kind: NotifKind
    #: expired: leases named, waiting requests failed
    leases: int | None
    failed: int | None
    #: malformed
    error: str | None

class DecodeCore:
    """Every tracking and load decision of a decode engine (D)."""

    def __init__(
        self,
        engine_id: str,
        *,
        tp_size: int,
        num_kv_heads: int,
        block_size: int,
        num_blocks: int,
        lease_duration: float = 30.0,
        external_blocks: bool = False,
        max_running: int = 64,
        max_waiting: int = 1024,
        retry: float = 0.005,
        replicated_kv: bool = False,
    ) -> None: ...
    @property
    def engine_id(self) -> str: ...
    @property
    def heartbeat_interval(self) -> float: ...
    @property
    def tracked(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    @property
    def running(self) -> int: ...
    @property
    def blocks_allocated(self) -> int: ...
    def is_idle(self) -> bool: ...
    def is_ready(self, engine: str) -> bool: ...
    def is_waiting(self, request: str) -> bool: ...
    def remote_of(self, request: str) -> RemoteKv | None: ...
    def local_id(self, remote: str) -> str | None: ...
    def stats(self) -> dict[str, int]: ...
    def on_new_request(self, now: float, request: str, num_tokens: int, remote: RemoteKv) -> None: ...
    def poll_handshake(self) -> HandshakeStart | None: ...
    def handle_handshake(
        self, now: float, engine: str, *, tp_size: int, num_blocks: int, instance: int = 0
    ) -> None: ...
    def handle_handshake_failed(self, now: float, engine: str, error: HandshakeError) -> None:
        """The handshake with ``engine`` failed with ``error`` (its ``kind`` decides what
        the core does; ``HandshakeKind.INCOMPATIBLE`` is the core's own and is refused):
        every request waiting for it fails."""
    def forget_engine(self, engine: str) -> None: ...
    def handle_notif(self, engine: str, message: bytes) -> DecodeNotifOutcome: ...
    def abort(self, request: str) -> bool: ...
    def handle_batch_done(
        self,
        request: str,
        batch: int,
        status: BatchStatus | Literal["done", "stale", "failed"],
        *,
        bytes: int = 0,
        error: str | None = None,
    ) -> None: ...
    def handle_verified(self, request: str, error: str | None = None) -> None: ...
    def request_finished(self, request: str) -> bool: ...
    def shutdown(self) -> None: ...
    def poll_transmit(self, now: float) -> Transmit | None: ...
    def poll_load(self) -> LoadPlan | None: ...
    def start_load(self, request: str, blocks: Sequence[int], skip_blocks: int = 0) -> LoadPlan: ...
    def blocks_short(self) -> int | None: ...
    def poll_timeout(self) -> float | None: ...
    def poll_event(self) -> Loaded | HandshakeDone | EngineDropped | Finished | None: ...

class DecodedNotif:
    """What a notification says: ``kind`` and the fields of that kind (the others are
    ``None``)."""

    kind: NotifKind
    #: heartbeat
    ids: list[str] | None
    #: read_complete, abort
    request: str | None
    engine: str | None
    rank: int | None
    #: read_complete
    consumers_total: int | None
    #: expired: (request, generation) of each lease
    leases: list[tuple[str, int]] | None
    #: push registration: the digest of D's prompt (32 lowercase hex digits), if given
    prompt: str | None

def decode_notif(message: bytes) -> DecodedNotif: ...
def encode_heartbeats(requests: Sequence[str], max_len: int = ...) -> list[bytes]: ...
def tp_pairs(
    num_kv_heads: int, src_tp: int, dst_tp: int, replicated: bool = ...
) -> list[tuple[int, int, tuple[int, int]]]: ...
def install_log_bridge(level: int) -> bool: ...
def drain_logs() -> tuple[list[tuple[int, str, str, str, int]], int]: ...

# ---------------------------------------------------------------------- side channel

class SideChannelServer:
    """Serves ``payload`` to peers that prove the cluster token."""

    def __init__(
        self,
        payload: bytes,
        *,
        token: bytes | None = None,
        listen: str = "127.0.0.1:0",
        max_connections: int = 64,
        handshake_timeout: float = 10.0,
        engine_id: str = "kvlease-python",
        allow_unauthenticated: bool = False,
        max_connections_per_address: int | None = None,
    ) -> None: ...
    @property
    def port(self) -> int: ...
    @property
    def address(self) -> str: ...
    def set_payload(self, payload: bytes) -> None: ...
    def stats(self) -> dict[str, int]: ...
    def close(self) -> None: ...

def side_channel_fetch(
    host: str,
    port: int,
    *,
    token: bytes | None = None,
    timeout: float = 5.0,
    engine_id: str = "kvlease-python",
) -> bytes:
    """P's handshake payload. Raises :class:`~kvlease.errors.AuthError` for a token
    mismatch, else :class:`~kvlease.errors.SideChannelError` whose ``kind`` is
    ``connect`` (P was busy or broke off: a retry may succeed) or ``not_found``."""
