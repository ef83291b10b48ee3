"""A minimal out-of-tree KV connector that proves the scheduler harness on its own.

It plans like a P/D connector but moves nothing: P (``do_remote_decode``) keeps a finished
request's blocks and returns its block ids; D (``do_remote_prefill``) loads the whole prompt
but the last token asynchronously. The worker methods are inert. Loaded by vLLM's factory
from ``kv_connector_module_path="toy_connector"`` (this directory is on ``sys.path`` under
pytest).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class ToyMetadata(KVConnectorMetadata):
    def __init__(self, loads: dict[str, list[int]]):
        self.loads = loads


class ToyConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        self.calls: list[tuple[str, str]] = []
        self._pending: dict[str, list[int]] = {}

    # Scheduler side.
    def on_new_request(self, request) -> None:
        self.calls.append(("on_new_request", request.request_id))

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill"):
            return len(request.prompt_token_ids) - 1 - num_computed_tokens, True
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.calls.append(("update_state_after_alloc", request.request_id))
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill") and num_external_tokens > 0:
            self._pending[request.request_id] = list(blocks.get_block_ids()[0])
            params["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = ToyMetadata(self._pending)
        self._pending = {}
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self.calls.append(("request_finished", request.request_id))
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_decode"):
            return False, None
        return True, {"do_remote_prefill": True, "remote_block_ids": list(block_ids)}

    # Worker side: nothing moves.
    def start_load_kv(self, forward_context, **kwargs) -> None:
        pass

    def wait_for_layer_load(self, layer_name) -> None:
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        pass

    def wait_for_save(self) -> None:
        pass
