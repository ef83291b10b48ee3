"""Hybrid models: ``KvleaseConnector`` is ``SupportsHMA``; a request's
full-attention and sliding-window KV cache groups are one lease, and a sliding window's
out-of-window blocks are neither held on P nor read on D. In vLLM 0.33.0's real
``Scheduler``, on CPU.

What vLLM 0.33's CPU path cannot build: it turns the hybrid KV cache manager off on any
platform without ``support_hybrid_kv_cache()`` (CPU included), whatever the connector, so
a tiny Gemma-2 (``HYBRID_MODEL``: sliding-window and full layers) resolves
``disable_hybrid_kv_cache_manager=True`` here. We check one level down that vLLM's own
connector gate (``KVConnectorFactory.supports_hma_config``, the check that would turn it
off on a GPU) passes for KvleaseConnector, and run the schedulers with the model's two
groups as the hybrid manager makes them (one full-attention group, one sliding-window
group of the model's window): vLLM's ``Scheduler`` then runs its
``HybridKVCacheCoordinator`` and calls ``request_finished_all_groups``.
"""

from __future__ import annotations

import pytest
import torch
from sched_harness import HYBRID_MODEL, create_request, create_vllm_config
from test_kvlease_scheduler import (
    D_WORKER,
    feed,
    request_from,
    step,
    wait_for_handshake,
    worker_output,
)
from vllm.v1.request import RequestStatus

from kvlease import ConfigError
from kvlease import _kvlease as native
from kvlease.vllm import KvleaseConnector
from kvlease.vllm.hybrid import _clip_groups, _group_pairs, _group_windows, _pair_groups

BLOCK = 16
WINDOW = 32  # the tiny Gemma-2's sliding_window, in tokens
KEEP = WINDOW // BLOCK + 1  # blocks a window needs at most (it need not start on a block)
PROMPT = 100  # 7 blocks: the window's 3 are the last


def hybrid_kv_cache_config(num_blocks: int = 64):
    """The tiny Gemma-2's groups as vLLM's hybrid manager makes them: its full-attention
    layer, its sliding-window layer (the scheduler counts blocks, allocates nothing)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    kw = dict(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["model.layers.1.self_attn.attn"], FullAttentionSpec(**kw)),
            KVCacheGroupSpec(
                ["model.layers.0.self_attn.attn"],
                SlidingWindowSpec(sliding_window=WINDOW, **kw),
            ),
        ],
    )


def hybrid_scheduler(role: str, engine_id: str, num_blocks: int = 64, one_group=False):
    from sched_harness import create_scheduler
    from test_kvlease_scheduler import TOKEN, FakeClock

    config = create_vllm_config(
        kv_connector="KvleaseConnector",
        kv_connector_module_path="kvlease.vllm",
        kv_role=role,
        engine_id=engine_id,
        kv_connector_extra_config={"kv_lease_duration": 6.0, "cluster_token": TOKEN,
                                   "transport": "tcp"},
        model=HYBRID_MODEL,
        dtype="bfloat16",
    )
    # What a GPU platform resolves (the CPU platform turns the manager off, see above).
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    kcc = None if one_group else hybrid_kv_cache_config(num_blocks)
    scheduler = create_scheduler(config, num_blocks=num_blocks, kv_cache_config=kcc)
    scheduler.connector.scheduler.clock = FakeClock()
    return scheduler


@pytest.fixture
def hybrid():
    made = []

    def make(*args, **kwargs):
        scheduler = hybrid_scheduler(*args, **kwargs)
        made.append(scheduler)
        return scheduler

    yield make
    for scheduler in made:
        scheduler.connector.shutdown()


def test_vllm_keeps_the_hybrid_manager_for_kvlease_but_not_for_a_connector_without_hma():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    assert supports_hma(KvleaseConnector)
    config = create_vllm_config(
        kv_connector="KvleaseConnector", kv_connector_module_path="kvlease.vllm",
        kv_role="kv_both", model=HYBRID_MODEL, dtype="bfloat16")
    assert config.model_config.hf_config.sliding_window == WINDOW
    assert config.model_config.hf_config.layer_types == [
        "sliding_attention", "full_attention"]
    assert KVConnectorFactory.supports_hma_config(config.kv_transfer_config)
    toy = create_vllm_config(
        kv_connector="ToyConnector", kv_connector_module_path="toy_connector",
        kv_role="kv_both", model=HYBRID_MODEL, dtype="bfloat16")
    assert not KVConnectorFactory.supports_hma_config(toy.kv_transfer_config)
    # vLLM 0.33 on CPU: off whatever the connector (the platform's rule, not ours).
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is True


def test_groups_clip_to_the_window_and_pair_from_the_end():
    kcc = hybrid_kv_cache_config()
    assert _group_windows(kcc) == (0, KEEP)
    assert _group_windows(None) == (0,)
    # vLLM's null block (0) stands for a sliding window's freed blocks.
    assert _clip_groups([[1, 2, 3, 4, 5], [0, 0, 7, 8, 9, 10]], (0, KEEP)) == [
        [1, 2, 3, 4, 5], [8, 9, 10]]
    with pytest.raises(ConfigError):
        _clip_groups([[1]], (0, KEEP))
    # D's first full-attention block is a local prefix hit: pairs from the end.
    local, remote, sizes = _pair_groups([[21, 22], [31, 32, 33]], [[1, 2, 3], [7, 8, 9]])
    assert (local, remote, sizes) == ([21, 22, 31, 32, 33], [2, 3, 7, 8, 9], (2, 3))
    assert _group_pairs(local, remote, sizes, 1) == ([31, 32, 33], [7, 8, 9])
    assert _group_pairs(local, remote, sizes, 0) == ([21, 22], [2, 3])
    assert _group_pairs(local, remote, (), None) == (local, remote)
    with pytest.raises(ConfigError, match="1 KV cache group"):
        _pair_groups([[1], [2]], [[1]])


def prefill_hybrid(p):
    req = create_request(num_tokens=PROMPT, max_tokens=1,
                         kv_transfer_params={"do_remote_decode": True})
    p.add_request(req)
    params = None
    for _ in range(4):
        _, engine_out = step(p)
        outs = [o for e in engine_out.values() for o in e.outputs]
        if outs and outs[0].finish_reason is not None:
            params = outs[0].kv_transfer_params
            break
    assert params is not None, "P never finished the prefill"
    return req, params


def test_p_leases_every_group_as_one_and_holds_only_the_window(hybrid):
    p = hybrid("kv_producer", "p0")
    assert type(p.kv_cache_manager.coordinator).__name__ == "HybridKVCacheCoordinator"
    req, params = prefill_hybrid(p)
    full, window = params["remote_block_ids"]
    held = p.kv_cache_manager.get_block_ids(req.request_id)
    # Every full-attention block; the window's last blocks only, no null placeholder.
    assert full == list(held[0]) and len(full) == -(-PROMPT // BLOCK)
    assert window == [b for b in held[1] if b != 0][-KEEP:] and len(window) == KEEP
    assert not set(full) & set(window)
    # One lease over both groups, one generation; vLLM keeps nothing else.
    lease = p.connector.scheduler.prefill.lease(req.request_id)
    assert lease["blocks"] == len(full) + len(window)
    assert lease["generation"] == params["kvlease_generation"]
    pool = p.kv_cache_manager.block_pool
    assert pool.free_block_queue.num_free_blocks == 64 - 1 - len(full) - len(window)
    # The codec reads the groups back as the one lease's block list.
    back = native.KvTransferParams.from_dict(params)
    assert back.remote_block_ids == full + window
    assert back.remote_block_groups == [full, window]


def test_d_reads_each_groups_window_under_one_lease_and_one_fence(hybrid):
    p = hybrid("kv_producer", "p0")
    d = hybrid("kv_consumer", "d0")
    p_req, params = prefill_hybrid(p)
    full, window = params["remote_block_ids"]
    req = request_from(params, p_req)
    d.add_request(req)
    metas = wait_for_handshake(d, req)
    (load,) = [load for meta in metas for load in meta.loads]
    mine = d.kv_cache_manager.get_block_ids(req.request_id)
    # Each group paired from its end: every full-attention block, the window's last
    # KEEP blocks on both sides (D's older sliding-window blocks are never read into).
    assert load.group_sizes == (len(full), KEEP)
    assert load.remote_blocks == full + window
    d_window = [b for b in mine[1] if b != 0][-KEEP:]
    assert load.local_blocks == list(mine[0]) + d_window
    # One fence for the whole request: a block of the lease, its one generation.
    assert load.fence_block in full + window
    assert load.generation == params["kvlease_generation"]
    (batch,) = load.batches

    # The read completes: P's one lease (both groups) ends, vLLM frees every block.
    feed(p, worker_output(notifs=[(D_WORKER, batch.notif)]))
    assert p.connector.scheduler.prefill.lease(p_req.request_id) is None
    sched_out = feed(p, worker_output())
    assert p_req.request_id in sched_out.kv_connector_metadata.finished_sending
    feed(d, worker_output(batches={req.request_id: {0: ("done", 1024, None)}},
                          finished_recving={req.request_id}))
    sched_out, _ = step(d)
    assert req.status == RequestStatus.RUNNING
    assert sched_out.num_scheduled_tokens[req.request_id] <= 1


def test_d_with_one_group_recomputes_a_hybrid_ps_lease_and_frees_it(hybrid):
    """P and D that group the model differently (P hybrid, D one group: the hybrid
    manager off) never pair blocks across groups: D recomputes, its abort frees P's
    lease."""
    p = hybrid("kv_producer", "p0")
    d = hybrid("kv_consumer", "d0", one_group=True)
    p_req, params = prefill_hybrid(p)
    req = request_from(params, p_req)
    d.add_request(req)
    metas = wait_for_handshake(d, req)
    metas.append(step(d, output_for=[])[0].kv_connector_metadata)
    assert not [load for meta in metas for load in meta.loads]
    assert req.request_id in {r for meta in metas for r in meta.failed_loads}
    aborts = [m for meta in metas for e, kind, m in meta.transmits if kind == "abort"]
    assert aborts
    feed(p, worker_output(notifs=[(D_WORKER, m) for m in aborts]))
    assert p.connector.scheduler.prefill.lease(p_req.request_id) is None


def test_a_d_worker_reads_each_layers_group_only_real_bytes():
    """One level down from the worker harness (whose worker processes build one KV cache
    group): D's real ``KvleaseWorker`` reads from a real P agent over TCP, fenced. The
    full-attention layer reads its group's pairs, the sliding-window layer only the
    window's pair; no layer reads another group's blocks, and nothing else is written."""
    import base64
    import time

    from test_kvlease_scheduler import TOKEN, p_payload, raw

    from kvlease.vllm import BatchSpec, KvleaseConfig, KvleaseWorker, LoadSpec, _engine_info

    config = create_vllm_config(
        kv_connector="KvleaseConnector", kv_connector_module_path="kvlease.vllm",
        kv_role="kv_consumer", engine_id="d0",
        kv_connector_extra_config={"cluster_token": TOKEN, "transport": "tcp"},
    )
    worker = KvleaseWorker(config, KvleaseConfig.from_vllm(config))
    worker.layer_groups = {"full": 0, "window": 1}
    agent = native.Agent("p0#0", token=TOKEN.encode(), backend="tcp")
    page, n = 16 * 2, 4
    try:
        caches = {
            "full": torch.zeros(n, 16, dtype=torch.float16),
            "window": torch.zeros(n, 16, dtype=torch.float16),
        }
        worker.register_kv_caches(caches)
        # P's blocks: each byte is 1 + block (full) or 17 + block (window).
        p_full = bytearray(b"".join(bytes([1 + b]) * page for b in range(n)))
        p_window = bytearray(b"".join(bytes([17 + b]) * page for b in range(n)))
        fence = bytearray(n * 8)
        r_full, r_window = agent.register(p_full), agent.register(p_window)
        r_fence = agent.register(fence)
        native.FenceWords(fence, n).publish([1, 2, 3], 5)
        payload = p_payload(workers=[{
            "rank": 0, "agent_name": "p0#0",
            "agent_metadata": base64.b64encode(bytes(agent.metadata())).decode(),
            "layers": [["full", r_full.id, 0, page, page, n],
                       ["window", r_window.id, 0, page, page, n]],
            "fence_region": r_fence.id, "num_blocks": n, "device": "cpu",
            "kv_format": worker.kv_format,
        }])
        worker.engines["p0"] = _engine_info(raw(payload))
        # Full attention: D 0 <- P 1, D 1 <- P 2; the window: D 2 <- P 3.
        worker._post(LoadSpec(
            request="r", engine="p0", remote_request="r", local_blocks=[0, 1, 2],
            remote_blocks=[1, 2, 3], fence_block=3, generation=5,
            batches=[BatchSpec(index=0, d_worker=0, p_rank=0, local_heads=(0, 16),
                               remote_heads=(0, 16), notif=b"read")],
            group_sizes=(2, 1),
        ))
        deadline = time.monotonic() + 30
        while True:
            worker.get_finished()
            meta = worker.build_worker_meta()
            if meta is not None and "r" in meta.batches:
                status, nbytes, error = meta.batches["r"][0]
                break
            assert time.monotonic() < deadline, "the load never ended"
            time.sleep(0.01)
        assert (status, error) == ("done", None)
        assert nbytes == 3 * page  # three block reads, not six
        d = {name: bytes(t.view(torch.uint8).flatten().tolist())
             for name, t in caches.items()}
        blocks = {name: [d[name][b * page:(b + 1) * page] for b in range(n)] for name in d}
        assert blocks["full"] == [bytes([2]) * page, bytes([3]) * page,
                                  bytes(page), bytes(page)]
        assert blocks["window"] == [bytes(page), bytes(page), bytes([20]) * page,
                                    bytes(page)]
    finally:
        worker.shutdown()
        agent.close()
