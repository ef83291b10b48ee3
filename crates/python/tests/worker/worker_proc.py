"""One vLLM worker in its own process: a KV connector's worker half over CPU KV tensors.

Started by ``engines.WorkerProcess``. The test process runs vLLM's real ``Scheduler`` (with
the connector's scheduler half); this process gets what a vLLM worker gets from it: the
``VllmConfig`` and ``KVCacheConfig`` at start, then each step's ``SchedulerOutput``
(pickled, as vLLM's multiprocess executor sends it). It

- builds the connector with vLLM's factory (role WORKER) and makes it vLLM's global KV
  transfer group, as ``ensure_kv_transfer_initialized`` does;
- allocates the KV cache with vLLM's own ``allocate_kv_cache`` (one int8 backing buffer,
  per-layer strided views in the configured layout; on CPU, or on the device named by
  ``KVLEASE_TEST_KV_DEVICE``, e.g. ``cuda:0``) and registers it with ``register_kv_caches``,
  then gives it vLLM's ``copy_kv_blocks`` with ``set_host_xfer_buffer_ops``, as vLLM's GPU
  (and CPU) model runner does (``copy_ops``: ``"vllm"``; ``"none"``: not given;
  ``"recording"``: the same copy, each call logged with the bytes around it, ``copies``);
- runs each step through vLLM's own ``KVConnectorModelRunnerMixin.kv_connector_no_forward``
  (bind metadata, start_load_kv, wait_for_save, get_finished / get_transfer_results,
  get_block_ids_with_load_errors, clear metadata) and returns the ``KVConnectorOutput``.

The model forward is replaced by ``fill``: before a step, the blocks named there get
random bytes in every layer, which is what a prefill writes into them.

Protocol: length-prefixed pickles over two inherited pipe fds (vLLM logs to stdout/stderr,
which go to a log file). Requests are ``(name, kwargs)``; replies ``("ok", value)`` or
``("err", traceback text)``.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import traceback

_HEADER = struct.Struct("<Q")


def read_msg(fd: int):
    header = _read_exact(fd, _HEADER.size)
    if header is None:
        return None
    (length,) = _HEADER.unpack(header)
    body = _read_exact(fd, length)
    if body is None:
        raise EOFError("pipe closed inside a message")
    return pickle.loads(body)


def write_msg(fd: int, obj) -> None:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    data = _HEADER.pack(len(body)) + body
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _join_tp_group(vllm_config, rank: int, dist: str) -> None:
    """Makes this process rank ``rank`` of vLLM's tensor-parallel group (gloo: the CPU
    path), as vLLM's workers do before they build the connector; the connector reads its
    rank from it (``get_tensor_model_parallel_rank``)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=tp, rank=rank, distributed_init_method=dist, local_rank=rank,
            backend="gloo",
        )
        ensure_model_parallel_initialized(tp, 1)


class Worker:
    def __init__(self, vllm_config, kv_cache_config, seed: int, device: str = "cpu",
                 rank: int = 0, dist: str | None = None, copy_ops: str = "vllm"):
        import torch
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.worker.utils import allocate_kv_cache

        if dist is not None:
            _join_tp_group(vllm_config, rank, dist)
        self.rank = rank
        self.torch = torch
        self.vllm_config = vllm_config
        self.generator = torch.Generator().manual_seed(seed)
        self.connector = KVConnectorFactory.create_connector(
            vllm_config, KVConnectorRole.WORKER, kv_cache_config
        )
        kv_transfer_state._KV_CONNECTOR_AGENT = self.connector
        layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
        self.kv_caches = allocate_kv_cache(kv_cache_config, torch.device(device), layout)
        self.connector.register_kv_caches(self.kv_caches)
        self.steps = 0
        self._copies: list[dict] = []
        if copy_ops != "none":
            from vllm.distributed.kv_transfer.kv_connector.utils import copy_kv_blocks

            op = copy_kv_blocks if copy_ops == "vllm" else self._recording(copy_kv_blocks)
            self.connector.set_host_xfer_buffer_ops(op)

    def _recording(self, copy_kv_blocks):
        """vLLM's copy (as the connector would run it on this platform), each call
        logged: the step, the direction, the block ids, and per layer the bytes of the
        source blocks and of the destination blocks before and after the copy."""
        from kvlease.vllm.worker import _copy_op_for_platform

        op = _copy_op_for_platform(copy_kv_blocks)

        def pages(caches, ids):
            return {name: [_bytes(t[b]) for b in ids] for name, t in caches.items()}

        def recording(src, dst, src_ids, dst_ids, direction):
            entry = dict(step=self.steps, direction=direction, src_ids=list(src_ids),
                         dst_ids=list(dst_ids), src=pages(src, src_ids),
                         dst_before=pages(dst, dst_ids))
            op(src, dst, src_ids, dst_ids, direction)
            entry["dst_after"] = pages(dst, dst_ids)
            self._copies.append(entry)

        return recording

    def copies(self) -> list[dict]:
        """The recorded copies since the last call."""
        out, self._copies = self._copies, []
        return out

    def host_blocks(self, block_ids: list[int]) -> dict[str, list[bytes]]:
        """``blocks`` of the connector's host buffers."""
        buffers = self.connector.worker.host_xfer_buffers
        return {name: [_bytes(t[b]) for b in block_ids] for name, t in buffers.items()}

    def scribble(self, block_ids: list[int]) -> None:
        """New random bytes in these blocks of the KV caches (not the host buffers)."""
        self._fill(block_ids)

    # Requests.
    def handshake_metadata(self):
        """What the worker reports to the engine core (keyed by (pp_rank, tp_rank))."""
        meta = self.connector.get_handshake_metadata()
        return None if meta is None else {(0, self.rank): meta}

    def layout(self):
        return {
            name: (tuple(t.shape), tuple(t.stride()), str(t.dtype), t.data_ptr())
            for name, t in self.kv_caches.items()
        }

    def step(self, scheduler_output, fill: list[int] | None = None):
        from vllm.v1.worker.kv_connector_model_runner_mixin import (
            KVConnectorModelRunnerMixin,
        )

        self.steps += 1
        if fill:
            self._fill(fill)
        out = KVConnectorModelRunnerMixin.kv_connector_no_forward(
            scheduler_output, self.vllm_config
        )
        return out.kv_connector_output

    def blocks(self, block_ids: list[int]) -> dict[str, list[bytes]]:
        """The bytes of each block in each layer (logical order, so any layout compares)."""
        return {
            name: [
                t[b].contiguous().view(self.torch.uint8).cpu().numpy().tobytes()
                for b in block_ids
            ]
            for name, t in self.kv_caches.items()
        }

    def heads(self, block_ids: list[int]) -> dict[str, list[list[bytes]]]:
        """The bytes of each head of each block in each layer (``[block][head]``; a
        layer's block is vLLM's view ``[heads, tokens, K|V]``, its latent cache for MLA)."""
        return {
            name: [
                [t[b][h].contiguous().view(self.torch.uint8).cpu().numpy().tobytes()
                 for h in range(t.shape[1])]
                for b in block_ids
            ]
            for name, t in self.kv_caches.items()
        }

    def call(self, method: str, args=(), kwargs=None):
        """Any connector method by name (what it returns must pickle)."""
        return getattr(self.connector, method)(*args, **(kwargs or {}))

    def shutdown(self):
        self.connector.shutdown()
        return True

    def _fill(self, block_ids: list[int]) -> None:
        torch = self.torch
        for t in self.kv_caches.values():
            for b in block_ids:
                page = t[b]
                noise = torch.randint(
                    -128, 128, page.shape + (page.element_size(),),
                    dtype=torch.int8, generator=self.generator,
                )
                page.copy_(noise.view(page.dtype).reshape(page.shape))  # to the device


def _bytes(page) -> bytes:
    import torch

    return page.contiguous().view(torch.uint8).cpu().numpy().tobytes()


def main() -> None:
    rfd, wfd = int(sys.argv[1]), int(sys.argv[2])
    init = read_msg(rfd)
    try:
        worker = Worker(**init)
        write_msg(wfd, ("ok", None))
    except BaseException:
        write_msg(wfd, ("err", traceback.format_exc()))
        return
    while True:
        msg = read_msg(rfd)
        if msg is None:
            break
        name, kwargs = msg
        try:
            reply = ("ok", getattr(worker, name)(**kwargs))
        except BaseException:
            reply = ("err", traceback.format_exc())
        write_msg(wfd, reply)
        if name == "shutdown":
            break


if __name__ == "__main__":
    main()
