"""The connector's settings (``KvleaseConfig``, read from ``kv_connector_extra_config``)
and the names and addresses both halves derive from them."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError
from .layout import PLAIN_CACHE_DTYPES, SIDE_SCALE_CACHE_DTYPES

if TYPE_CHECKING:
    from vllm.config import VllmConfig

VLLM_VERSION = "0.33.0"

#: Separates an engine id from a worker rank in agent names (a byte no engine id holds).
_RANK_SEP = "#"


def _agent_name(engine_id: str, rank: int) -> str:
    return f"{engine_id}{_RANK_SEP}{rank}"


def _engine_of(agent_name: str) -> str:
    return agent_name.rpartition(_RANK_SEP)[0] or agent_name


#: ``kv_transfer_config.kv_buffer_device`` values the connector takes: ``cuda``, the KV
#: caches themselves are registered with the transport (CUDA memory, or host memory on a
#: CPU platform); ``cpu``, the KV is staged through host buffers (``use_host_buffer``).
KV_BUFFER_DEVICES = ("cuda", "cpu")


def _platform_device() -> str:
    """vLLM's current platform's device type (``cuda``, ``cpu``, ``xpu`` ...)."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def _host_buffer(ktc: object, extra: dict) -> tuple[str, bool]:
    """``(kv_buffer_device, use_host_buffer)``. As NixlConnector decides: a host buffer
    when ``kv_buffer_device`` is ``cpu`` and the platform's KV caches are not already
    host memory; ``force_host_buffer`` stages through one on a CPU platform too (the
    path a GPU takes, runnable without one). vLLM's default is the platform's device
    type, empty on a platform vLLM did not resolve (a CUDA build without a GPU): the KV
    caches are registered as they are."""
    device = getattr(ktc, "kv_buffer_device", None) or _platform_device()
    if device and device not in KV_BUFFER_DEVICES:
        raise ConfigError(
            f"kv_buffer_device must be one of {', '.join(KV_BUFFER_DEVICES)} (cuda: the "
            "KV caches are registered as they are; cpu: they are staged through host "
            f"buffers), not {device!r}"
        )
    force = extra.get("force_host_buffer", False)
    if not isinstance(force, bool):
        raise ConfigError(f"force_host_buffer must be true or false, not {force!r}")
    if force and device != "cpu":
        raise ConfigError(
            f"force_host_buffer needs kv_buffer_device 'cpu', not {device!r}"
        )
    return str(device), device == "cpu" and (force or _platform_device() != "cpu")


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
    #: Bidirectional mode: the clock probe's port on ``side_channel_host`` (the next
    #: turn's P reads a held turn's deadline on this engine's clock through it); 0: any.
    clock_probe_port: int = 0
    transport_host: str = "127.0.0.1"
    #: First port of the workers' transport listeners (worker ``r`` of data-parallel
    #: rank ``dp`` listens on ``transport_port + dp * tp_size + r``); 0: any free port.
    transport_port: int = 0
    read_timeout: float = 30.0
    handshake_timeout: float = 5.0
    #: ``kv_transfer_config.kv_buffer_device`` (``KV_BUFFER_DEVICES``, or empty: vLLM's
    #: platform is unresolved).
    kv_buffer_device: str = "cuda"
    #: Whether the KV is staged through registered host buffers (``_host_buffer``).
    use_host_buffer: bool = False
    #: Seconds a lease may live from its grant whatever the heartbeats say (P).
    lease_max_lifetime: float | None = None
    #: Listen beyond loopback without a cluster token (the side channel and the workers'
    #: transports refuse to otherwise).
    allow_unauthenticated: bool = False
    #: Bidirectional multi-turn (``bidirectional_kv_xfer``): D holds a finished turn's
    #: blocks for ``decoder_kv_blocks_ttl`` and the next turn's P reads them back.
    bidirectional: bool = False
    #: P recomputes a cached prefix shorter than this many tokens instead of reading it.
    kv_recompute_threshold: int = 64
    #: P reads a held turn only when its end leaves this many seconds (plus the read).
    pull_safety_margin: float = 5.0
    #: The next turn's P heartbeats the hold while its request waits or reads, and each
    #: heartbeat extends it (the symmetric lease); false: a fixed TTL, as NixlConnector's.
    symmetric_decoder_lease: bool = True
    #: ``pull`` (D reads P's leased blocks) or ``push`` (D reserves its blocks, P writes
    #: them): ``kv_connector_extra_config`` ``transfer_mode``, or ``KvleasePushConnector``.
    transfer_mode: str = "pull"

    @property
    def push(self) -> bool:
        return self.transfer_mode == "push"

    @classmethod
    def from_vllm(
        cls, vllm_config: "VllmConfig", transfer_mode: str | None = None
    ) -> "KvleaseConfig":
        """``transfer_mode``: the mode the connector class names (``KvleasePushConnector``:
        ``push``), which ``kv_connector_extra_config`` must not contradict."""
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
        max_lifetime = (
            number("kv_lease_max_lifetime", 600.0) if "kv_lease_max_lifetime" in extra else None
        )
        allow = _flag(extra, "allow_unauthenticated", False)
        ttl = number("decoder_kv_blocks_ttl", 480.0)
        bidirectional = _flag(extra, "bidirectional_kv_xfer", False)
        role = str(getattr(ktc, "kv_role", None) or "kv_both")
        if bidirectional and role != "kv_both":
            raise ConfigError(
                "bidirectional_kv_xfer needs kv_role kv_both on every engine: the engine "
                f"that decodes a turn holds it and serves it to the next turn's P (not {role!r})"
            )
        threshold = extra.get("kv_recompute_threshold", 64)
        if type(threshold) is not int or threshold < 0:
            raise ConfigError(
                f"kv_recompute_threshold must be a number of tokens >= 0, not {threshold!r}"
            )
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
        port = _port(extra, "side_channel_port", "KVLEASE_SIDE_CHANNEL_PORT")
        clock_port = _port(extra, "clock_probe_port", "KVLEASE_CLOCK_PROBE_PORT")
        transport_port = _port(extra, "transport_port", "KVLEASE_TRANSPORT_PORT")
        transport_host = str(extra.get("transport_host") or host)
        kv_buffer_device, use_host_buffer = _host_buffer(ktc, extra)
        mode = str(extra.get("transfer_mode", transfer_mode or "pull"))
        if mode not in ("pull", "push"):
            raise ConfigError(f"transfer_mode must be pull or push, not {mode!r}")
        if transfer_mode is not None and mode != transfer_mode:
            raise ConfigError(
                f"the connector class pushes, but kv_connector_extra_config says "
                f"transfer_mode {mode!r}"
            )
        if mode == "push" and transport not in ("auto", "tcp", "shm"):
            raise ConfigError(
                f"push mode writes over tcp or shm (the connector does not pass verbs write "
                f"grants yet), not {transport!r}"
            )
        if mode == "push" and bidirectional:
            raise ConfigError("bidirectional_kv_xfer is not supported in push mode")
        if mode == "push" and use_host_buffer:
            raise ConfigError(
                "push mode writes into the KV caches themselves: kv_buffer_device 'cpu' "
                "(a host buffer) is not supported with it"
            )
        cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
        if cache_dtype in SIDE_SCALE_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype {cache_dtype!r} keeps its scales outside the KV cache "
                "blocks, which KvleaseConnector moves alone: D would read P's values "
                "with its own scales. Use a KV cache dtype whose blocks hold their values "
                f"({', '.join(PLAIN_CACHE_DTYPES)})"
            )
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
            clock_probe_port=clock_port,
            transport_host=transport_host,
            transport_port=transport_port,
            read_timeout=number("read_timeout", lease),
            handshake_timeout=number("handshake_timeout", 5.0),
            kv_buffer_device=kv_buffer_device,
            use_host_buffer=use_host_buffer,
            lease_max_lifetime=max_lifetime,
            allow_unauthenticated=allow,
            bidirectional=bidirectional,
            kv_recompute_threshold=threshold,
            pull_safety_margin=number("pull_safety_margin", 5.0),
            symmetric_decoder_lease=_flag(extra, "symmetric_decoder_lease", True),
            transfer_mode=mode,
        )


def _flag(extra: dict, key: str, default: bool) -> bool:
    """A boolean of ``kv_connector_extra_config`` (vLLM's launch lines also write
    ``"True"``/``"False"`` strings, as for ``enable_permute_local_kv``)."""
    value = extra.get(key, default)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, not {value!r}")
    return value


def _port(extra: dict, key: str, env: str) -> int:
    """A port number from ``kv_connector_extra_config[key]``, else the environment
    variable ``env``, else 0 (any free port)."""
    value = extra.get(key, os.environ.get(env) or 0)
    try:
        port = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key} must be a port number, not {value!r}") from None
    if not 0 <= port < 65536:
        raise ConfigError(f"{key} must be a port number, not {port}")
    return port


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
