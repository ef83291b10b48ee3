"""A P or D engine for the worker tests: vLLM's real ``Scheduler`` in the test process and
one worker process per TP rank (``worker_proc.py``) holding the connector's worker half and
CPU KV tensors. With TP > 1 the workers form vLLM's real tensor-parallel group (gloo, on
CPU) and their outputs are merged by vLLM's own ``KVOutputAggregator``, as vLLM's
multiprocess executor does.

This is the split vLLM itself makes (engine core with the scheduler; workers with the KV
cache), minus the model: ``Engine.step()`` schedules, sends the ``SchedulerOutput`` to the
worker, turns the worker's ``KVConnectorOutput`` into a ``ModelRunnerOutput`` (one sampled
token per scheduled request, as the model would) and feeds it back with
``update_from_output``. At start the worker's handshake metadata goes to the scheduler's
connector (``set_xfer_handshake_metadata_pp_aware``), as ``EngineCore`` does after KV cache
registration. The scheduler and the worker are given the same ``KVCacheConfig`` (made by
vLLM's own planner), so block ids mean the same bytes on both sides.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import sched_harness
from worker_proc import read_msg, write_msg

HERE = Path(__file__).resolve().parent
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
# Where the workers allocate their KV caches: "cpu" (CI), or a CUDA device ("cuda:0") on a
# machine with a GPU and a kvlease wheel built with the `cuda` feature (the default).
KV_DEVICE = os.environ.get("KVLEASE_TEST_KV_DEVICE", "cpu")


class WorkerError(RuntimeError):
    """The worker process raised; the message carries its traceback."""


class WorkerProcess:
    def __init__(self, name: str, log_dir: Path, init: dict):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(HERE / "worker_proc.py"), str(to_child_r), str(from_child_w)],
                pass_fds=(to_child_r, from_child_w),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            )
        os.close(to_child_r)
        os.close(from_child_w)
        write_msg(self._to_child, init)
        self._ready = False

    def wait_ready(self) -> None:
        """The worker built its connector and registered its KV caches."""
        if not self._ready:
            self._reply()
            self._ready = True

    def request(self, name: str, **kwargs):
        self.send(name, **kwargs)
        return self._reply()

    def send(self, name: str, **kwargs) -> None:
        """A request whose reply ``receive`` waits for (one in flight at a time)."""
        self.wait_ready()
        write_msg(self._to_child, (name, kwargs))

    def receive(self):
        return self._reply()

    def _reply(self):
        msg = read_msg(self._from_child)
        if msg is None:
            raise WorkerError(f"{self.name} exited (status {self.proc.wait()}):\n{self.log_tail()}")
        status, value = msg
        if status != "ok":
            raise WorkerError(f"{self.name}: {value}")
        return value

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL: no shutdown, no goodbye on any socket."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self._close_pipes()

    def close(self) -> None:
        """The connector's orderly ``shutdown`` (its agent closes its connections), then
        the process goes without waiting for the interpreter's slow teardown."""
        if self.proc.poll() is None:
            try:
                self.request("shutdown")
            except (WorkerError, OSError):
                pass
            try:
                self.proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close_pipes()

    def _close_pipes(self) -> None:
        for fd in (self._to_child, self._from_child):
            try:
                os.close(fd)
            except OSError:
                pass
        self._to_child = self._from_child = -1


def plan_kv_cache_config(vllm_config, num_blocks: int):
    """The KVCacheConfig vLLM's planner makes for one worker of the model's attention
    layers (the fake OPT: 2 layers, 4 KV heads of 16, split over the TP ranks; the fake
    MLA model: 2 layers of one latent vector of 24 per token, vLLM's
    ``MLAAttentionSpec``, the same on every rank), ``num_blocks`` blocks
    (``num_gpu_blocks_override``), in the config's resolved layout."""
    import torch

    model = vllm_config.model_config
    num_kv_heads = model.get_num_kv_heads(vllm_config.parallel_config)
    head_size = model.get_head_size()
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheGroupSpec,
        MLAAttentionSpec,
    )

    kind = MLAAttentionSpec if model.use_mla else FullAttentionSpec
    spec = kind(
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=torch.float16,
    )
    vllm_config.cache_config.num_gpu_blocks_override = num_blocks
    groups = [KVCacheGroupSpec(list(LAYERS), spec)]
    config = get_kv_cache_config_from_groups(vllm_config, groups, 1 << 40)
    assert config.num_blocks == num_blocks
    return config


class Engine:
    """vLLM's scheduler here, the connector's worker half in one child process per TP
    rank (``workers``; ``worker`` is rank 0)."""

    def __init__(self, name: str, vllm_config, num_blocks: int, log_dir: Path, seed: int,
                 copy_ops: str = "vllm"):
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        self.name = name
        self.vllm_config = vllm_config
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.kv_cache_config = plan_kv_cache_config(vllm_config, num_blocks)
        self.scheduler = sched_harness.create_scheduler(
            vllm_config, kv_cache_config=self.kv_cache_config
        )
        self.connector = self.scheduler.connector
        # vLLM's TP group among the workers (gloo on CPU): its rendezvous address.
        dist = f"tcp://127.0.0.1:{_free_port()}" if self.tp_size > 1 else None
        self.workers = [
            WorkerProcess(
                f"{name}-worker{rank}" if self.tp_size > 1 else f"{name}-worker",
                log_dir,
                dict(vllm_config=vllm_config, kv_cache_config=self.kv_cache_config,
                     seed=seed + 1000 * rank, device=KV_DEVICE, rank=rank, dist=dist,
                     copy_ops=copy_ops),
            )
            for rank in range(self.tp_size)
        ]
        self.worker = self.workers[0]
        self.aggregator = KVOutputAggregator(self.tp_size)
        self._handshaken = False
        self.steps = 0
        self.outputs: dict[str, object] = {}  # request id -> its final EngineCoreOutput
        self.history: list[dict] = []  # per step: metadata and the workers' connector output
        self.stats: list[object] = []  # the SchedulerStats the steps returned (log_stats)

    def ready(self) -> "Engine":
        """Wait for the workers; hand their handshake metadata to the scheduler's
        connector (what EngineCore does once the workers registered their KV caches)."""
        if not self._handshaken:
            meta = {}
            for w in self.workers:
                meta.update(w.request("handshake_metadata") or {})
            if meta:
                self.connector.set_xfer_handshake_metadata_pp_aware(meta)
            self._handshaken = True
        return self

    def add_request(self, request) -> None:
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)

    def step(self, fill_new: bool = False, sample_eos: bool = False):
        self.ready()
        return self._step(fill_new, sample_eos)

    def _step(self, fill_new: bool, sample_eos: bool):
        """One engine step. ``fill_new``: the "forward" writes random KV into every block of
        the requests scheduled this step (a prefill). Returns the SchedulerOutput."""
        from vllm.v1.outputs import ModelRunnerOutput

        sched_out = self.scheduler.schedule()
        fill = []
        if fill_new:
            for new in sched_out.scheduled_new_reqs:
                fill.extend(new.block_ids[0])
        # Every worker gets the step before any is waited for, as vLLM broadcasts it.
        for w in self.workers:
            w.send("step", scheduler_output=sched_out, fill=fill)
        outs = [w.receive() for w in self.workers]
        if self.tp_size > 1:
            merged = self.aggregator.aggregate(
                [ModelRunnerOutput.with_kv_conn_output_only(o) for o in outs]
            )
            kv_out = merged.kv_connector_output
        else:
            kv_out = outs[0]
        runner_out = sched_harness.create_model_runner_output(
            [self.scheduler.requests[rid] for rid in sched_out.num_scheduled_tokens],
            use_eos=sample_eos,
        )
        runner_out.kv_connector_output = kv_out
        engine_outs = self.scheduler.update_from_output(sched_out, runner_out)
        self.history.append(
            dict(t=time.monotonic(), meta=sched_out.kv_connector_metadata, kv_out=kv_out,
                 worker_outs=outs, scheduled=dict(sched_out.num_scheduled_tokens))
        )
        for eco in engine_outs.values():
            if eco.scheduler_stats is not None:
                self.stats.append(eco.scheduler_stats)
            for out in eco.outputs:
                if out.finish_reason is not None:
                    self.outputs[out.request_id] = out
        self.steps += 1
        return sched_out

    @property
    def requests(self) -> dict:
        """The scheduler's live requests (a finished P request stays while leased)."""
        return self.scheduler.requests

    def block_ids(self, request_id: str) -> list[int]:
        blocks = self.scheduler.kv_cache_manager.get_block_ids(request_id)
        return list(blocks[0])

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.free_block_queue.num_free_blocks

    def kill_worker(self) -> None:
        for w in self.workers:
            w.kill()

    def close(self) -> None:
        for w in self.workers:
            w.close()
        shutdown = getattr(self.connector, "shutdown", None)
        if shutdown is not None:
            shutdown()


def close_engines(engines) -> None:
    """A fixture's teardown: closes every engine, printing the log of each worker that
    exited with an error (pytest shows it with the failing test)."""
    for engine in engines:
        try:
            engine.close()
        finally:
            for w in engine.workers:
                if w.proc.returncode not in (None, 0, -9):
                    print(f"{w.name} log:\n{w.log_tail()}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
