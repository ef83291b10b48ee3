"""P's block size ≠ D's, with real bytes: P's engine (vLLM's real Scheduler and its
worker processes) keeps its KV in blocks of one size, D's in another; D's workers read
P's blocks as runs of tokens straight into theirs (no post-processing pass), and every
token's every head on D equals P's. With heterogeneous TP too (P TP 2 → D TP 1), each P
rank's heads land at their place in D's blocks.
"""

from __future__ import annotations

import pytest
import sched_harness
from engines import LAYERS, close_engines
from test_hetero_tp import LEASE, heads_of, wait_released
from test_kvlease_worker import kvlease_engine, run_until

NUM_TOKENS = 60  # one prefill step (64 at most); the last blocks are partial


@pytest.fixture
def pd(tmp_path):
    """make(p_tp, d_tp, p_block_size, d_block_size) -> (P, D), all workers started
    together."""
    made = []

    def make(p_tp: int, d_tp: int, p_bs: int, d_bs: int):
        p = kvlease_engine("p0", "kv_producer", tmp_path, LEASE, seed=7, tp_size=p_tp,
                           block_size=p_bs)
        d = kvlease_engine("d0", "kv_consumer", tmp_path, LEASE, seed=8, tp_size=d_tp,
                           block_size=d_bs)
        made.extend([p, d])
        return p.ready(), d.ready()

    yield make
    close_engines(made)


def load(p, d, p_bs: int, d_bs: int, num_tokens: int = NUM_TOKENS):
    """Prefill on P (random bytes in its new blocks), load on D, decode to the end:
    (P's request, P's blocks, the LoadSpec, the load errors D's workers reported)."""
    req = sched_harness.create_request(
        num_tokens=num_tokens, max_tokens=1, block_size=p_bs,
        kv_transfer_params={"do_remote_decode": True},
    )
    p.add_request(req)
    while req.request_id not in p.outputs:
        p.step(fill_new=True)
    params = p.outputs[req.request_id].kv_transfer_params
    d_req = sched_harness.create_request(
        prompt_token_ids=req.prompt_token_ids, max_tokens=3, block_size=d_bs,
        kv_transfer_params=dict(params),
    )
    d.add_request(d_req)
    run_until(lambda: d_req.request_id in d.outputs, [d, p], 90, "D's load and decode")
    (spec,) = [x for h in d.history for x in h["meta"].loads if x.request == d_req.request_id]
    errors = set().union(*(h["kv_out"].invalid_block_ids for h in d.history if h["kv_out"]))
    return req, list(params["remote_block_ids"]), spec, errors


def token(row: bytes, block_size: int, i: int) -> bytes:
    """Token ``i``'s bytes in one head's ``[tokens, K|V]`` row of a block."""
    n = len(row) // block_size
    return row[i * n:(i + 1) * n]


def assert_tokens_equal(p_heads, d_heads, p_blocks, d_blocks, p_bs, d_bs, head_map):
    """Every prompt token's every head on D equals P's: ``head_map`` is D head ->
    (P rank, P head)."""
    for layer in LAYERS:
        for t in range(NUM_TOKENS):
            pb, po = divmod(t, p_bs)
            db, do = divmod(t, d_bs)
            for dh, (rank, ph) in head_map.items():
                mine = token(d_heads[layer][db][dh], d_bs, do)
                theirs = token(p_heads[rank][layer][pb][ph], p_bs, po)
                assert mine == theirs, f"{layer} token {t} head {dh}"


@pytest.mark.parametrize("p_bs,d_bs", [(16, 32), (32, 16)])
def test_p_and_d_with_different_block_sizes_bytes_equal_per_token_and_head(pd, p_bs, d_bs):
    """P TP 1 → D TP 1: D's blocks hold twice (or half) as many tokens as P's."""
    p, d = pd(1, 1, p_bs, d_bs)
    req, p_blocks, spec, errors = load(p, d, p_bs, d_bs)
    assert not errors
    assert (spec.block_size, spec.remote_block_size) == (d_bs, p_bs)
    assert len(p_blocks) == -(-NUM_TOKENS // p_bs)
    assert len(spec.local_blocks) == -(-NUM_TOKENS // d_bs)
    p_heads = heads_of(p, p_blocks)
    (d_heads,) = heads_of(d, spec.local_blocks)
    assert_tokens_equal(p_heads, d_heads, p_blocks, spec.local_blocks, p_bs, d_bs,
                        {h: (0, h) for h in range(4)})
    wait_released(p, req, completed=1)
    sched_harness.assert_scheduler_empty(p.scheduler)


def test_p_tp2_blocks_of_16_to_d_tp1_blocks_of_32(pd):
    """Heterogeneous TP and block sizes at once: D's one worker reads heads 0-1 from P
    rank 0 and 2-3 from P rank 1, each in runs of tokens; P frees after both reads."""
    p, d = pd(2, 1, 16, 32)
    req, p_blocks, spec, errors = load(p, d, 16, 32)
    assert not errors
    assert [(b.d_worker, b.p_rank, b.local_heads, b.remote_heads) for b in spec.batches] \
        == [(0, 0, (0, 2), (0, 2)), (0, 1, (2, 4), (0, 2))]
    p_heads = heads_of(p, p_blocks)
    (d_heads,) = heads_of(d, spec.local_blocks)
    assert_tokens_equal(p_heads, d_heads, p_blocks, spec.local_blocks, 16, 32,
                        {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)})
    wait_released(p, req, completed=1)
