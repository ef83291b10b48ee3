"""The exceptions of kvlease: one class per error family, all under :class:`KvleaseError`.

The native module raises these classes (it imports this module), so ``except
kvlease.TransferError`` catches a failed read whichever layer noticed it. Every
instance carries the message of the Rust error chain as ``str(e)``; some carry
attributes (listed per class).
"""

from __future__ import annotations

from .kinds import HandshakeKind

__all__ = [
    "KvleaseError",
    "InvalidArgument",
    "ConfigError",
    "RegisterError",
    "ConnectError",
    "HandshakeError",
    "AuthError",
    "TransferError",
    "StaleFenceError",
    "TransferTimeout",
    "NotifError",
    "PrefillError",
    "AdmitError",
    "LoadError",
    "SideChannelError",
    "ClosedError",
]


class KvleaseError(Exception):
    """The base of every error kvlease raises on purpose."""


class InvalidArgument(KvleaseError, ValueError):
    """An argument has the right type but an unusable value (a negative length, an id
    with a forbidden byte, a range outside a registered region, ...).

    Attributes (set by :class:`KvTransferParams`, else ``None``): ``field``, the full path
    of the key at fault (``"kv_transfer_params.remote_port"``), and ``reason``.
    """

    field: str | None = None
    reason: str | None = None


class ConfigError(KvleaseError):
    """A configuration cannot be used (agent limits, lease duration, connector extra
    config)."""


class RegisterError(KvleaseError):
    """Memory could not be registered or deregistered with a transport agent."""


class ConnectError(KvleaseError):
    """Connecting to a peer failed (unreachable, bad metadata, handshake refused)."""


class HandshakeError(KvleaseError):
    """A handshake with a peer engine failed.

    Attributes: ``kind``, a :class:`~kvlease.kinds.HandshakeKind` saying why (the engine's
    kind of handshake failure, which decides whether a retry may succeed). Each subclass
    has its own default; ``HandshakeError(message, kind=...)`` names another.
    """

    kind: HandshakeKind = HandshakeKind.OTHER

    def __init__(self, *args: object, kind: HandshakeKind | str | None = None) -> None:
        super().__init__(*args)
        if kind is not None:
            self.kind = HandshakeKind(kind)


class AuthError(ConnectError, HandshakeError):
    """The cluster token did not match: the peer refused our proof, or could not prove
    it holds the token itself. ``kind`` is always ``HandshakeKind.AUTH``."""

    kind: HandshakeKind = HandshakeKind.AUTH


class TransferError(KvleaseError):
    """A read batch failed (the peer refused a read, disconnected, or a local range was
    unusable). The destination bytes are unspecified."""


class StaleFenceError(TransferError):
    """The fence word read after the data did not hold the generation the reader was
    given: P released the lease (and may have reused the blocks) while D read. Nothing
    read may be used; recompute. Also a write (``Agent.post_write``) the peer's write
    fence refused: nothing of it landed (``found`` is ``None`` then).

    Attributes: ``expected`` (the generation) and ``found`` (the word read).
    """

    expected: int | None = None
    found: int | None = None


class TransferTimeout(TransferError, TimeoutError):
    """A read batch did not complete within its timeout."""


class NotifError(KvleaseError):
    """A notification could not be sent (too large, unknown peer, disconnected) or
    decoded."""


class PrefillError(KvleaseError):
    """The prefill core refused a request or a grant.

    Attributes: ``retryable`` (whether the same request may succeed later).
    """

    retryable: bool = False


class AdmitError(KvleaseError):
    """The decode core refused a request on arrival (its ``kv_transfer_params`` do not
    fit this engine, or D is full). Nothing is tracked for it.

    Attributes: ``field`` (the ``kv_transfer_params`` key at fault, or ``None``) and
    ``retryable``.
    """

    field: str | None = None
    retryable: bool = False


class LoadError(KvleaseError):
    """A KV load failed (lease expired, stale fence, read or handshake failure); the
    request produced no output from the remote KV.

    Attributes: ``retryable``, and ``handshake``: the :class:`HandshakeError` (an
    :class:`AuthError` for a token mismatch) when the handshake with P failed, else
    ``None``.
    """

    retryable: bool = True
    handshake: HandshakeError | None = None


class SideChannelError(HandshakeError):
    """The handshake side channel failed: fetching a peer's handshake (``kind`` says how:
    ``not_found`` when it did not answer or its answer is malformed, ``connect`` when it
    was busy or broke off), or serving one (``other``). ``AuthError`` is raised for token
    mismatches."""

    kind: HandshakeKind = HandshakeKind.NOT_FOUND


class ClosedError(KvleaseError):
    """The object was closed (an agent after ``close()``, a side-channel server after
    ``close()``)."""
