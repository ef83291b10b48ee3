"""``KvleaseConnector``: vLLM's connector interface, each hook delegated to the
scheduler half (``scheduler.KvleaseScheduler``) or the worker half
(``worker.KvleaseWorker``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from .config import KvleaseConfig
from .hybrid import _layer_groups
from .logs import attach_to_vllm
from .metadata import KvleaseConnectorMetadata
from .scheduler import KvleaseScheduler
from .stats import KvleaseConnectorStats, KvleasePromMetrics
from .worker import KvleaseWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import CopyBlocksOp
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KvleaseConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's connector interface, delegating to the scheduler or the worker half.

    The scheduler half owns the engine cores; the worker half owns the transport agent
    and the registered KV caches. See the package docstring (``kvlease.vllm``) for the
    design. ``SupportsHMA``: hybrid models (full-attention and sliding-window KV cache
    groups) keep vLLM's hybrid KV cache manager (``kvlease.vllm.hybrid``).
    """

    #: The transfer mode the class fixes (``KvleasePushConnector``: push); ``None``:
    #: ``kv_connector_extra_config`` ``transfer_mode``, pull by default.
    TRANSFER_MODE: str | None = None

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "KVCacheConfig | None" = None,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        attach_to_vllm()
        self.config = KvleaseConfig.from_vllm(vllm_config, self.TRANSFER_MODE)
        self.scheduler: KvleaseScheduler | None = None
        self.worker: KvleaseWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = KvleaseScheduler(vllm_config, self.config, kv_cache_config)
        else:
            self.worker = KvleaseWorker(vllm_config, self.config)
            self.worker.layer_groups = _layer_groups(kv_cache_config)

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

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished_all_groups(request, block_ids)

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self._sched().set_xfer_handshake_metadata(metadata)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KvleaseConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: "VllmConfig",
        metric_types: "dict[type[PromMetric], type[PromMetricT]]",
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        """``vllm:kvlease_*`` (``KvleasePromMetrics``), fed with the stats of
        ``get_kv_connector_stats``."""
        return KvleasePromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.scheduler is not None:
            return self.scheduler.counters.take()
        return self._work().counters.take()

    # ----------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        self._work().register_kv_caches(kv_caches)

    def set_host_xfer_buffer_ops(self, copy_operation: "CopyBlocksOp") -> None:
        """vLLM's copy between the KV caches and host memory (its model runners call
        this after ``register_kv_caches``): used with ``kv_buffer_device`` ``cpu``."""
        self._work().set_host_xfer_buffer_ops(copy_operation)

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
        # D pulls from P's own KV blocks (or their host copies, made in wait_for_save).
        return None

    def wait_for_save(self) -> None:
        """After the step's forward: with a host buffer, P copies the blocks of the
        requests whose prompt this step completed to it (``SaveSpec``), before the step's
        output lets the scheduler grant their leases."""
        worker = self._work()
        if not worker.use_host_buffer or not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvleaseConnectorMetadata)
        if meta.saves:
            worker.save_kv_to_host(meta.saves)
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


class KvleasePushConnector(KvleaseConnector):
    """``KvleaseConnector`` in push mode (as vLLM's ``NixlPushConnector`` is
    NixlConnector's): D reserves the blocks it allocated for a request and P writes its
    KV into them (``kvlease.vllm.push``). The same as ``KvleaseConnector`` with
    ``kv_connector_extra_config`` ``{"transfer_mode": "push"}``."""

    TRANSFER_MODE = "push"
