"""kvlease: leased KV-cache transfers for disaggregated prefill (P) / decode (D) serving.

- :class:`Agent`: the transport agent (register memory, metadata, connect, batched
  fenced reads, notifications); blocking calls release the GIL.
- :class:`FenceWords`: a lease's generation words over shared memory.
- :mod:`kvlease.errors`: the exceptions, all under :class:`KvleaseError`.
- :mod:`kvlease.vllm`: ``KvleaseConnector``, a vLLM KV connector built on the engine cores.

See ``crates/python/README.md`` for the API and ``docs/python.md`` for vLLM launch lines.
"""

from __future__ import annotations

from ._kvlease import (
    Agent,
    Batch,
    BatchResult,
    FenceWords,
    Peer,
    Region,
    RemoteRegion,
    __version__,
)
from .errors import (
    AdmitError,
    AuthError,
    ClosedError,
    ConfigError,
    ConnectError,
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

__all__ = [
    "__version__",
    "Agent",
    "Batch",
    "BatchResult",
    "FenceWords",
    "Peer",
    "Region",
    "RemoteRegion",
    "KvleaseError",
    "InvalidArgument",
    "ConfigError",
    "RegisterError",
    "ConnectError",
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
