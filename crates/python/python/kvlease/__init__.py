"""kvlease: leased KV-cache transfers for disaggregated prefill (P) / decode (D) serving.

- :class:`Agent`: the transport agent (register memory, metadata, connect, batched
  fenced reads, notifications); blocking calls release the GIL.
- :class:`FenceWords`: a lease's generation words over shared memory.
- :class:`PrefillCore`, :class:`DecodeCore`: the engine cores (every lease decision of P
  and D; time is an argument, ``now`` in seconds of ``time.monotonic()``).
- :class:`Reservations`, :class:`PushCore`: push mode's cores (D's reservations, P's
  pushes); with ``Agent.post_write`` / ``Agent.set_write_fence`` the pieces of push mode
  (the vLLM connector does not use them yet).
- :class:`KvTransferParams`: ``kv_transfer_params``, read and written by one codec (the
  agents' too); bad keys raise :class:`InvalidArgument` naming the field.
- :class:`EngineInfo`: the engine-info handshake payload P serves on the side channel,
  built and read by one codec (the agents' too).
- :class:`SideChannelServer`, :func:`side_channel_fetch`: the handshake side channel,
  authenticated with the cluster token.
- :mod:`kvlease.errors`: the exceptions, all under :class:`KvleaseError`.
- :mod:`kvlease.kinds`: the enums every kind, status, reason and outcome is returned as
  (``str`` enums: each member equals its value).
- :mod:`kvlease.vllm`: ``KvleaseConnector``, a vLLM KV connector built on the engine cores.

See ``crates/python/README.md`` for the API and ``docs/python.md`` for vLLM launch lines.
"""

from __future__ import annotations

from ._kvlease import (
    Agent,
    Batch,
    BatchPlan,
    BatchResult,
    ClearFences,
    DecodeCore,
    DecodedNotif,
    DecodeNotifOutcome,
    EngineDropped,
    EngineInfo,
    FenceWords,
    Finished,
    Granted,
    HandshakeDone,
    HandshakeStart,
    KvTransferParams,
    Loaded,
    LoadPlan,
    Peer,
    PrefillCore,
    PrefillNotifOutcome,
    PrefillStart,
    PushCore,
    PushEnded,
    PushSend,
    PushWrite,
    Refused,
    Region,
    Released,
    RemoteKv,
    RemoteRegion,
    Reservation,
    ReservationEnded,
    Reservations,
    SendNotif,
    SideChannelServer,
    Transmit,
    WorkerInfo,
    __version__,
    decode_notif,
    encode_heartbeats,
    side_channel_fetch,
    tp_pairs,
)
from . import errors, kinds
from .errors import (
    AdmitError,
    AuthError,
    ClosedError,
    ConfigError,
    ConnectError,
    HandshakeError,
    InvalidArgument,
    KvleaseError,
    LoadError,
    NotifError,
    PrefillError,
    RegisterError,
    SideChannelError,
    StaleFenceError,
    TransferError,
    TransferTimeout,
)
from .kinds import (
    BatchStatus,
    FenceVerdict,
    HandshakeKind,
    NotifKind,
    Outcome,
    PushOutcome,
    ReadCompleteOutcome,
    RegistrationOutcome,
    ReleaseReason,
    ReservationOutcome,
    TransmitKind,
)

__all__ = [
    "__version__",
    "Agent",
    "Batch",
    "BatchResult",
    "FenceWords",
    "Peer",
    "Region",
    "RemoteRegion",
    "PrefillCore",
    "PrefillStart",
    "Granted",
    "Released",
    "ClearFences",
    "SendNotif",
    "Refused",
    "PrefillNotifOutcome",
    "DecodeCore",
    "RemoteKv",
    "HandshakeStart",
    "Transmit",
    "BatchPlan",
    "LoadPlan",
    "Loaded",
    "HandshakeDone",
    "EngineDropped",
    "Finished",
    "Reservations",
    "Reservation",
    "ReservationEnded",
    "PushCore",
    "PushWrite",
    "PushSend",
    "PushEnded",
    "KvTransferParams",
    "EngineInfo",
    "WorkerInfo",
    "DecodeNotifOutcome",
    "DecodedNotif",
    "SideChannelServer",
    "side_channel_fetch",
    "decode_notif",
    "encode_heartbeats",
    "tp_pairs",
]
__all__ += errors.__all__
__all__ += kinds.__all__
