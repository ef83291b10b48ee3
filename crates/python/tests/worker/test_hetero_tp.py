"""KvleaseConnector between engines of different TP sizes, and for an MLA model, with real
bytes: each engine is vLLM's real Scheduler here and one worker process per TP rank, the
ranks in vLLM's real tensor-parallel group (gloo on CPU), their outputs merged by vLLM's
``KVOutputAggregator`` (engines.py).

A block of the fake OPT holds 4 KV heads over TP 1, 2 per rank over TP 2 (vLLM's
``[heads, tokens, K|V]`` view, ``LBNHC``: tokens outermost, so a rank's heads are a slice
of every token's row). The fake MLA model's block is one latent vector per token
(vLLM's ``MLAAttentionSpec``), on every rank. The harness's "prefill" writes random bytes,
different on each P rank, so a read from the wrong rank or head shows.
"""

from __future__ import annotations

import pytest
import sched_harness
from engines import LAYERS, close_engines
from test_kvlease_worker import kvlease_engine, run_until

LEASE = 30.0


@pytest.fixture
def pd(tmp_path):
    """make(p_tp, d_tp, **config) -> (P, D), every worker process started together."""
    made = []

    def make(p_tp: int, d_tp: int, **config):
        p = kvlease_engine("p0", "kv_producer", tmp_path, LEASE, seed=7, tp_size=p_tp,
                           **config)
        d = kvlease_engine("d0", "kv_consumer", tmp_path, LEASE, seed=8, tp_size=d_tp,
                           **config)
        made.extend([p, d])
        return p.ready(), d.ready()

    yield make
    close_engines(made)


def load(p, d, num_tokens: int = 40, granted=None):
    """Prefill on P, load on D, decode to the end: (P's request, D's request, P's
    blocks, the LoadSpec, the load errors D's workers reported). ``granted(blocks)``
    runs after P granted the lease, before D learns of it."""
    req = sched_harness.create_request(
        num_tokens=num_tokens, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    p.add_request(req)
    p.step(fill_new=True)
    params = p.outputs[req.request_id].kv_transfer_params
    if granted is not None:
        granted(list(params["remote_block_ids"]))
    d_req = sched_harness.create_request(
        prompt_token_ids=req.prompt_token_ids, max_tokens=3, kv_transfer_params=dict(params)
    )
    d.add_request(d_req)
    run_until(lambda: d_req.request_id in d.outputs, [d, p], 90, "D's load and decode")
    (spec,) = [x for h in d.history for x in h["meta"].loads if x.request == d_req.request_id]
    errors = set().union(*(h["kv_out"].invalid_block_ids for h in d.history if h["kv_out"]))
    return req, d_req, list(params["remote_block_ids"]), spec, errors


def heads_of(engine, blocks):
    """Per worker rank: layer -> [block][head] bytes."""
    return [w.request("heads", block_ids=blocks) for w in engine.workers]


def assert_gathered(p_heads, d_heads) -> None:
    """P TP 2 → D TP 1 (4 heads): D's block holds P rank 0's heads, then P rank 1's."""
    (p0, p1), (d0,) = p_heads, d_heads
    for layer in LAYERS:
        for i in range(len(p0[layer])):
            assert len(d0[layer][i]) == 4 and len(p0[layer][i]) == 2
            assert d0[layer][i][:2] == p0[layer][i], f"{layer} block {i}: heads 0-1"
            assert d0[layer][i][2:] == p1[layer][i], f"{layer} block {i}: heads 2-3"
            assert p0[layer][i] != p1[layer][i]  # the ranks' KV differ: no false match


def assert_scattered(p_heads, d_heads) -> None:
    """P TP 1 → D TP 2 (4 heads): each D rank's block holds its half of P's heads."""
    (p0,), (d0, d1) = p_heads, d_heads
    for layer in LAYERS:
        for i in range(len(p0[layer])):
            assert len(p0[layer][i]) == 4 and len(d0[layer][i]) == 2
            assert d0[layer][i] == p0[layer][i][:2], f"{layer} block {i}: D rank 0"
            assert d1[layer][i] == p0[layer][i][2:], f"{layer} block {i}: D rank 1"


def wait_released(p, req, completed: int):
    table = p.connector.scheduler.prefill
    run_until(lambda: req.request_id not in p.requests, [p], 30, "P freeing the blocks")
    stats = table.stats()
    assert stats["released_completed"] == completed, stats
    assert stats["released_expired"] == 0 and stats["released_aborted"] == 0, stats


def test_p_tp2_to_d_tp1_bytes_equal_per_head_and_each_p_rank_is_fenced(pd):
    p, d = pd(2, 1)
    req, d_req, p_blocks, spec, errors = load(p, d)
    assert not errors
    assert [(b.d_worker, b.p_rank, b.local_heads, b.remote_heads) for b in spec.batches] \
        == [(0, 0, (0, 2), (0, 2)), (0, 1, (2, 4), (0, 2))]
    assert_gathered(heads_of(p, p_blocks), heads_of(d, spec.local_blocks))
    # Both readers reported (each through its own P worker): P frees at the second.
    wait_released(p, req, completed=1)

    # Each P rank's fence is checked: P rank 1's words for the next lease are cleared
    # (as if rank 1 had reused the blocks), rank 0's hold the generation. The batch from
    # rank 1 is stale, the one from rank 0 fine; the load fails and vLLM recomputes.
    fences = p.connector.scheduler.fences

    def clear_rank1(blocks):
        assert all(fences[1].word(b) == fences[0].word(b) != 0 for b in blocks)
        fences[1].publish(blocks, 0)

    req2, d_req2, p_blocks2, spec2, errors2 = load(p, d, granted=clear_rank1)
    assert errors2 == set(spec2.local_blocks)
    results = {}
    for h in d.history:
        meta = h["kv_out"] and h["kv_out"].kv_connector_worker_meta
        if meta:
            results.update(meta.batches.get(d_req2.request_id, {}))
    by_rank = {b.p_rank: results[b.index][0] for b in spec2.batches}
    assert by_rank == {0: "done", 1: "stale"}, by_rank
    assert d.connector.scheduler.decode.stats()["stale_reads"] == 1
    computed = sum(h["scheduled"].get(d_req2.request_id, 0) for h in d.history)
    assert computed >= len(d_req2.prompt_token_ids)


def test_p_tp1_to_d_tp2_bytes_equal_per_head(pd):
    p, d = pd(1, 2)
    req, d_req, p_blocks, spec, errors = load(p, d)
    assert not errors
    assert [(b.d_worker, b.p_rank, b.local_heads, b.remote_heads) for b in spec.batches] \
        == [(0, 0, (0, 2), (0, 2)), (1, 0, (0, 2), (2, 4))]
    assert_scattered(heads_of(p, p_blocks), heads_of(d, spec.local_blocks))
    wait_released(p, req, completed=1)
    sched_harness.assert_scheduler_empty(p.scheduler)


def test_mla_latent_cache_is_read_once_from_one_p_rank(pd):
    """P TP 2 → D TP 1 for an MLA model: D's worker reads the latent cache once, from P
    rank 0 (P rank 1 is never read: its bytes, different in this harness, are not D's),
    and P's lease, granted expecting its 2 ranks, frees at that one read's completion."""
    p, d = pd(2, 1, model=sched_harness.MLA_MODEL)
    assert d.vllm_config.model_config.use_mla
    req, d_req, p_blocks, spec, errors = load(p, d)
    assert not errors
    assert [(b.d_worker, b.p_rank, b.local_heads, b.remote_heads) for b in spec.batches] \
        == [(0, 0, (0, 1), (0, 1))]
    (p0, p1), (d0,) = heads_of(p, p_blocks), heads_of(d, spec.local_blocks)
    for layer in LAYERS:
        assert [len(x) for x in d0[layer]] == [1] * len(p_blocks)
        assert d0[layer] == p0[layer], f"{layer}: D's latent cache differs from P rank 0's"
        assert d0[layer] != p1[layer]
    # One batch posted and ended, on D's one worker, for the whole load.
    ended = [i for h in d.history for o in h["worker_outs"] if o and o.kv_connector_worker_meta
             for i in o.kv_connector_worker_meta.batches.get(d_req.request_id, {})]
    assert ended == [0], ended
    wait_released(p, req, completed=1)
    sched_harness.assert_scheduler_empty(p.scheduler)
