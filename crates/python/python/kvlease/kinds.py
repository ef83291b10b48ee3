"""The enums of ``kvlease``: every kind, status, reason and outcome the native module
(``kvlease._kvlease``) returns, and the connector passes between its halves.

Each is a ``str`` enum (like ``enum.StrEnum``, which Python 3.10 lacks): a member is
equal to, hashes like and formats as its value (``BatchStatus.DONE == "done"``,
``f"batches_{status}"``), so it pickles by name, encodes to JSON as its value, and the
native methods that take a status accept either. The native module builds the members
by value from here (like the exceptions of ``kvlease.errors``).
"""

from __future__ import annotations

from enum import Enum

__all__ = [
    "BatchStatus",
    "FenceVerdict",
    "HandshakeKind",
    "NotifKind",
    "Outcome",
    "PushOutcome",
    "ReadCompleteOutcome",
    "RegistrationOutcome",
    "ReleaseReason",
    "ReservationOutcome",
    "TransmitKind",
]


class _StrEnum(str, Enum):
    """A ``str`` enum whose members format and print as their values."""

    __str__ = str.__str__
    __format__ = str.__format__


class BatchStatus(_StrEnum):
    """How a read (or write) batch ended (``BatchResult.status``,
    ``DecodeCore.handle_batch_done``)."""

    #: Every read completed and the fence matched.
    DONE = "done"
    #: The fence word did not match: nothing read may be used (a write: the peer's write
    #: fence refused it, and nothing of it landed).
    STALE = "stale"
    #: The read failed (connection, timeout, refused).
    FAILED = "failed"


class ReleaseReason(_StrEnum):
    """Why a lease ended (``Released.reason``)."""

    #: Every reader reported.
    COMPLETED = "completed"
    #: The reaper found it past its expiry.
    EXPIRED = "expired"
    #: D (or P) aborted it.
    ABORTED = "aborted"


class Outcome(_StrEnum):
    """How a request ended on D (``Finished.outcome``)."""

    DONE = "done"
    #: The load failed (``Finished.error`` is a ``LoadError``).
    FAILED = "failed"
    ABORTED = "aborted"
    SHUTDOWN = "shutdown"


class TransmitKind(_StrEnum):
    """What a notification for P is (``Transmit.kind``)."""

    HEARTBEAT = "heartbeat"
    ABORT = "abort"


class NotifKind(_StrEnum):
    """What a notification was (``decode_notif``) or what a core did with it
    (``PrefillCore.handle_notif``, ``DecodeCore.handle_notif``)."""

    HEARTBEAT = "heartbeat"
    READ_COMPLETE = "read_complete"
    ABORT = "abort"
    EXPIRED = "expired"
    #: Names a request of another engine (P), or comes from another P (D).
    FOREIGN = "foreign"
    #: Not a valid notification: nothing changed.
    MALFORMED = "malformed"
    #: Valid, but nothing this core acts on.
    IGNORED = "ignored"
    #: An application notification (``decode_notif``).
    APP = "app"
    #: A push-mode frame (``decode_notif``): registration, reservation heartbeat,
    #: write-done, push-failed or reservation-released.
    PUSH = "push"


class ReadCompleteOutcome(_StrEnum):
    """What P's core did with a read completion (``PrefillNotifResult.outcome``)."""

    #: The last reader reported: the lease is released.
    RELEASED = "released"
    #: More readers are to report.
    WAITING = "waiting"
    #: This reader had reported already.
    DUPLICATE = "duplicate"
    #: No such lease.
    UNKNOWN = "unknown"
    #: The reader count disagrees with the lease's.
    INVALID_TOTAL = "invalid_total"
    #: An outcome this binding does not name.
    OTHER = "other"


class FenceVerdict(_StrEnum):
    """Whether D's reservations admit a write or a push message
    (``Reservations.admits_write``, ``handle_write_done``, ``handle_push_failed``)."""

    #: The transfer holds a reservation of that generation, registered with that P.
    ACCEPTED = "accepted"
    #: The transfer holds a reservation of another generation: nothing changed.
    STALE = "stale"
    #: No reservation is held for the transfer: nothing changed.
    UNKNOWN = "unknown"
    #: The reservation was registered with another P engine: nothing changed.
    FOREIGN = "foreign"


class HandshakeKind(_StrEnum):
    """Why a handshake with a P engine failed (``HandshakeError.kind``): the engine's
    ``HandshakeError`` variants, one member each. The shell reports every kind but
    ``INCOMPATIBLE`` (``DecodeCore.handle_handshake_failed``); the core decides that one
    from P's answer."""

    #: A proof was refused, ours or P's (the cluster tokens differ): retrying cannot help.
    AUTH = "auth"
    #: This engine's policy refuses P's address.
    NOT_ALLOWED = "not_allowed"
    #: The engine is not there as named: its side channel did not answer, or answered as
    #: another engine, or with engine info that does not parse.
    NOT_FOUND = "not_found"
    #: P answered but was busy, or the connection broke after it was accepted: a retry
    #: may succeed.
    CONNECT = "connect"
    #: P's engine cannot serve this one's KV: its TP size does not divide the model's KV
    #: heads (the core's check of P's answer), or, on a D worker, a P worker's KV block
    #: format differs from ours.
    INCOMPATIBLE = "incompatible"
    #: Any other failure.
    OTHER = "other"


class ReservationOutcome(_StrEnum):
    """How a reservation ended on D (``ReservationEnded.outcome``)."""

    #: P's write-done for the generation D held: decode from the blocks.
    WRITTEN = "written"
    #: The request ended on D (``Reservations.abort``).
    ABORTED = "aborted"
    #: No heartbeat renewed it in time.
    EXPIRED = "expired"
    #: P's push-failed for the generation D held.
    FAILED = "failed"


class PushOutcome(_StrEnum):
    """How a push ended on P (``PushEnded.outcome``)."""

    #: The write completed and D was told (write-done).
    WRITTEN = "written"
    #: The write failed to post or complete; D was told (push-failed).
    WRITE_FAILED = "write_failed"
    #: D reported the reservation released; nothing more is written.
    RESERVATION_GONE = "reservation_gone"
    #: The request retired on P before its write; D was told if it had registered.
    RETIRED = "retired"
    #: P's prefill ended but no registration came in time.
    NO_REGISTRATION = "no_registration"
    #: D's registration named a lease P cannot keep; D was told (push-failed).
    LEASE_TOO_SHORT = "lease_too_short"


class RegistrationOutcome(_StrEnum):
    """What ``PushCore.handle_registration`` did with D's registration."""

    #: Recorded (and, when P's prefill is done, the write was planned).
    ACCEPTED = "accepted"
    #: The same registration again: nothing changed.
    DUPLICATE = "duplicate"
    #: The transfer holds another registration: ignored.
    CONFLICT = "conflict"
    #: The transfer's push ended: ignored.
    ENDED = "ended"
    #: The lease is too short for P's heartbeat interval: P answers push-failed.
    LEASE_TOO_SHORT = "lease_too_short"
    #: P's leg carries another prompt digest: P answers push-failed, writes nothing, and
    #: the leg keeps waiting for a matching registration.
    PROMPT_MISMATCH = "prompt_mismatch"
