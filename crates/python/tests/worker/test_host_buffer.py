"""KvleaseConnector with a host buffer (``kv_buffer_device: "cpu"``), real bytes between P
and D worker processes (engines.py).

Each worker gets vLLM's ``copy_kv_blocks`` through ``set_host_xfer_buffer_ops``, as vLLM's
model runner gives it; here it is wrapped to log each call with the bytes around it
(``copy_ops="recording"``). A side "without" a host buffer keeps vLLM's default
``kv_buffer_device``. On this CPU-only machine the KV caches are CPU tensors and vLLM's
platform has no block copies (unresolved here; CpuPlatform has none either), so the
connector runs vLLM's copy as CudaPlatform makes it, with torch on CPU tensors
(``_index_copy_blocks``); ``force_host_buffer`` keeps the staging on where vLLM resolves
the CPU platform (which, as NixlConnector, would skip it). Everything else is the code
path a CUDA cache takes.
"""

from __future__ import annotations

import pytest
import sched_harness
from engines import LAYERS, Engine, WorkerError, close_engines
from test_kvlease_worker import TOKEN, run_until

LEASE = 30.0


def engine(name, role, log_dir, seed, host: bool, copy_ops="recording", **sched):
    extra = {"kv_lease_duration": LEASE, "cluster_token": TOKEN, "transport": "tcp"}
    if host:
        extra["force_host_buffer"] = True
        sched["kv_buffer_device"] = "cpu"
    config = sched_harness.create_vllm_config(
        kv_connector="KvleaseConnector",
        kv_connector_module_path="kvlease.vllm",
        kv_role=role,
        engine_id=name,
        kv_connector_extra_config=extra,
        **sched,
    )
    return Engine(name, config, num_blocks=64, log_dir=log_dir, seed=seed, copy_ops=copy_ops)


@pytest.fixture
def make(tmp_path):
    """make(name, role, host, **kw) -> a ready engine; every one is closed at the end."""
    made = []

    def make(name, role, host, seed=7, **kw):
        e = engine(name, role, tmp_path, seed, host, **kw)
        made.append(e)
        return e

    yield make
    close_engines(made)


def prefill(p, num_tokens=40):
    req = sched_harness.create_request(
        num_tokens=num_tokens, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    p.add_request(req)
    p.step(fill_new=True)
    return req, p.outputs[req.request_id].kv_transfer_params


def load(d, p, p_req, params):
    d_req = sched_harness.create_request(
        prompt_token_ids=p_req.prompt_token_ids, max_tokens=3, kv_transfer_params=dict(params)
    )
    d.add_request(d_req)
    run_until(lambda: d_req.request_id in d.outputs, [d, p], 90, "D's load and decode")
    (spec,) = [x for h in d.history for x in h["meta"].loads if x.request == d_req.request_id]
    errors = set().union(*(h["kv_out"].invalid_block_ids for h in d.history if h["kv_out"]))
    return d_req, spec, errors


@pytest.mark.parametrize(
    "p_host,d_host", [(True, True), (True, False), (False, True)],
    ids=["both-host", "p-host-only", "d-host-only"],
)
def test_host_buffer_bytes_equal_and_copies_are_where_and_when_they_must_be(
        make, p_host, d_host):
    p = make("p0", "kv_producer", p_host, seed=7).ready()
    d = make("d0", "kv_consumer", d_host, seed=8).ready()
    assert p.connector.scheduler.use_host_buffer is p_host
    p_req, params = prefill(p)
    p_blocks = list(params["remote_block_ids"])
    p_device = p.worker.request("blocks", block_ids=p_blocks)

    # P: one copy to the host, of exactly the lease's blocks, in the step whose output
    # granted the lease (the worker's step 1, the prefill), host bytes = device bytes.
    p_copies = p.worker.request("copies")
    if p_host:
        (c,) = p_copies
        assert (c["step"], c["direction"]) == (1, "d2h")
        assert c["src_ids"] == c["dst_ids"] == p_blocks
        assert c["dst_after"] == c["src"] == p_device
        assert p.worker.request("host_blocks", block_ids=p_blocks) == p_device
    else:
        assert p_copies == []

    d_before = d.worker.request("blocks", block_ids=list(range(64)))
    d_req, spec, errors = load(d, p, p_req, params)
    assert not errors
    assert spec.local_blocks and len(spec.local_blocks) == len(p_blocks)
    d_device = d.worker.request("blocks", block_ids=spec.local_blocks)
    for layer in LAYERS:
        for i, (pb, db) in enumerate(zip(p_device[layer], d_device[layer])):
            assert pb == db, f"{layer} block {i}: D's KV cache differs from P's"

    d_copies = d.worker.request("copies")
    if d_host:
        # D: one copy from the host, of exactly the blocks read, after the read: the
        # host buffer held P's bytes, D's KV cache still what it held before the load.
        (c,) = d_copies
        assert c["direction"] == "h2d"
        assert c["src_ids"] == c["dst_ids"] == list(spec.local_blocks)
        assert c["src"] == p_device
        for layer in LAYERS:
            before = [d_before[layer][b] for b in spec.local_blocks]
            assert c["dst_before"][layer] == before, f"{layer}: written before the sync"
            assert before != p_device[layer]
        assert c["dst_after"] == p_device
        assert d.worker.request("host_blocks", block_ids=spec.local_blocks) == p_device
    else:
        assert d_copies == []
    run_until(lambda: p_req.request_id not in p.requests, [p], 30, "P freeing the blocks")
    assert p.connector.scheduler.prefill.stats()["released_completed"] == 1


@pytest.mark.parametrize("p_host", [True, False], ids=["host-buffer", "device"])
def test_d_reads_the_copy_taken_before_the_grant(make, p_host):
    """P's KV cache changes after the lease was granted (here by hand; on a GPU, nothing
    should write a leased block, but the host buffer is what D reads): with a host buffer
    D gets the bytes of the copy made before the grant, without one the changed bytes."""
    p = make("p0", "kv_producer", p_host, seed=7).ready()
    d = make("d0", "kv_consumer", False, seed=8).ready()
    p_req, params = prefill(p)
    p_blocks = list(params["remote_block_ids"])
    at_grant = p.worker.request("blocks", block_ids=p_blocks)
    p.worker.request("scribble", block_ids=p_blocks)
    changed = p.worker.request("blocks", block_ids=p_blocks)
    assert all(changed[layer] != at_grant[layer] for layer in LAYERS)
    d_req, spec, errors = load(d, p, p_req, params)
    assert not errors
    d_device = d.worker.request("blocks", block_ids=spec.local_blocks)
    assert d_device == (at_grant if p_host else changed)


def test_a_missing_copy_op_fails_the_step_with_a_clear_error(make):
    """vLLM's model runner gives the copy op; a worker without it cannot stage the KV:
    P's step fails at once, naming the hook (no lease on blocks never copied), and so
    does D's when it would post a read into its host buffer."""
    p = make("p0", "kv_producer", True, seed=7, copy_ops="none").ready()
    with pytest.raises(WorkerError, match="set_host_xfer_buffer_ops"):
        prefill(p)

    p2 = make("p1", "kv_producer", True, seed=9).ready()
    d = make("d0", "kv_consumer", True, seed=8, copy_ops="none").ready()
    p_req, params = prefill(p2)
    d_req = sched_harness.create_request(
        prompt_token_ids=p_req.prompt_token_ids, max_tokens=3, kv_transfer_params=dict(params)
    )
    d.add_request(d_req)
    with pytest.raises(WorkerError, match="set_host_xfer_buffer_ops"):
        run_until(lambda: False, [d, p2], 60, "D's failure")


def test_host_buffer_with_p_tp2_to_d_tp1_bytes_equal_per_head(make):
    """Heterogeneous TP through host buffers on both sides: each P rank copies its heads'
    blocks before the grant, D's worker reads both ranks' heads into its host buffer and
    copies the blocks to its KV cache once both reads ended."""
    p = make("p0", "kv_producer", True, seed=7, tp_size=2).ready()
    d = make("d0", "kv_consumer", True, seed=8, tp_size=1).ready()
    p_req, params = prefill(p)
    p_blocks = list(params["remote_block_ids"])
    d_req, spec, errors = load(d, p, p_req, params)
    assert not errors
    (p0, p1) = [w.request("heads", block_ids=p_blocks) for w in p.workers]
    (d0,) = [w.request("heads", block_ids=spec.local_blocks) for w in d.workers]
    for layer in LAYERS:
        for i in range(len(p_blocks)):
            assert d0[layer][i][:2] == p0[layer][i], f"{layer} block {i}: heads 0-1"
            assert d0[layer][i][2:] == p1[layer][i], f"{layer} block {i}: heads 2-3"
            assert p0[layer][i] != p1[layer][i]
    assert [c["direction"] for w in p.workers for c in w.request("copies")] == ["d2h"] * 2
    assert [c["direction"] for c in d.worker.request("copies")] == ["h2d"]


def test_host_buffer_with_p_blocks_of_16_to_d_blocks_of_32(make):
    """Block sizes P ≠ D through host buffers on both sides: D reads runs of tokens into
    its host buffer, then copies the blocks it read to its KV cache."""
    import test_block_size as bs

    p = make("p0", "kv_producer", True, seed=7, block_size=16).ready()
    d = make("d0", "kv_consumer", True, seed=8, block_size=32).ready()
    req, p_blocks, spec, errors = bs.load(p, d, 16, 32)
    assert not errors and (spec.block_size, spec.remote_block_size) == (32, 16)
    p_heads = [w.request("heads", block_ids=p_blocks) for w in p.workers]
    (d_heads,) = [w.request("heads", block_ids=spec.local_blocks) for w in d.workers]
    bs.assert_tokens_equal(p_heads, d_heads, p_blocks, spec.local_blocks, 16, 32,
                           {h: (0, h) for h in range(4)})
    (c,) = d.worker.request("copies")
    assert c["direction"] == "h2d" and c["dst_ids"] == list(spec.local_blocks)


def test_host_buffer_with_an_mla_model_p_tp2_to_d_tp1(make):
    """MLA through host buffers: D's worker reads the latent cache once, from P rank 0's
    host buffer, and copies it to its KV cache."""
    import test_hetero_tp as hetero

    p = make("p0", "kv_producer", True, seed=7, tp_size=2,
             model=sched_harness.MLA_MODEL).ready()
    d = make("d0", "kv_consumer", True, seed=8, tp_size=1,
             model=sched_harness.MLA_MODEL).ready()
    req, d_req, p_blocks, spec, errors = hetero.load(p, d)
    assert not errors and len(spec.batches) == 1
    (p0, p1) = [w.request("blocks", block_ids=p_blocks) for w in p.workers]
    d0 = d.worker.request("blocks", block_ids=spec.local_blocks)
    assert d0 == p0 and d0 != p1
    (c,) = d.worker.request("copies")
    assert c["direction"] == "h2d" and c["dst_ids"] == list(spec.local_blocks)
