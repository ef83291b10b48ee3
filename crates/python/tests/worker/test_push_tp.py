"""Push mode (``KvleasePushConnector`` on D, ``transfer_mode: push`` on P) between engines
of different TP sizes, and for an MLA model, with real bytes: vLLM's real Scheduler and one
worker process per TP rank on each side (engines.py), everything between them over TCP as
in a deployment (D's registration to P, P's writes into D's blocks, fenced by D's
reservation).

Both legs go at once, as ``kvlease-proxy --transfer-mode push`` sends them. The harness's
"prefill" writes random bytes, different on each P rank, so a write from the wrong rank or
into the wrong heads shows: D's blocks are compared head by head with P's.
"""

from __future__ import annotations

import pytest
import sched_harness
from engines import LAYERS, Engine, close_engines
from test_hetero_tp import assert_gathered, assert_scattered, heads_of
from test_kvlease_worker import TOKEN, run_until

LEASE = 30.0


def push_engine(name, role, log_dir, seed, tp_size, **sched):
    extra = {"kv_lease_duration": LEASE, "cluster_token": TOKEN, "transport": "tcp"}
    if role == "kv_producer":
        connector, extra = "KvleaseConnector", {**extra, "transfer_mode": "push"}
    else:
        connector = "KvleasePushConnector"
    config = sched_harness.create_vllm_config(
        kv_connector=connector,
        kv_connector_module_path="kvlease.vllm",
        kv_role=role,
        engine_id=name,
        kv_connector_extra_config=extra,
        tp_size=tp_size,
        **sched,
    )
    return Engine(name, config, num_blocks=64, log_dir=log_dir, seed=seed)


@pytest.fixture
def pd(tmp_path):
    """make(p_tp, d_tp, **config) -> (P, D), every worker process started together."""
    made = []

    def make(p_tp: int, d_tp: int, **config):
        p = push_engine("p0", "kv_producer", tmp_path, seed=7, tp_size=p_tp, **config)
        d = push_engine("d0", "kv_consumer", tmp_path, seed=8, tp_size=d_tp, **config)
        made.extend([p, d])
        return p.ready(), d.ready()

    yield make
    close_engines(made)


def push(p, d, transfer: str, num_tokens: int = 40):
    """Both legs at once; runs until D answered. Returns (P's blocks written, D's
    reserved blocks, the write as P's scheduler planned it)."""
    p_req = sched_harness.create_request(
        num_tokens=num_tokens, max_tokens=1,
        kv_transfer_params={"do_remote_decode": True, "transfer_id": transfer},
    )
    sched = p.connector.scheduler
    d_req = sched_harness.create_request(
        prompt_token_ids=p_req.prompt_token_ids, max_tokens=3,
        kv_transfer_params={"do_remote_prefill": True, "do_remote_decode": False,
                            "transfer_mode": "push", "transfer_id": transfer,
                            "remote_engine_id": "p0",
                            "remote_host": sched.config.side_channel_host,
                            "remote_port": sched.side_channel_port, "tp_size": p.tp_size},
    )
    d.add_request(d_req)
    p.add_request(p_req)
    run_until(lambda: d_req.request_id in d.outputs, [d, p], 90, "D's push and decode",
              p0={"fill_new": True})
    (write,) = [w for h in p.history if h["meta"] for w in h["meta"].writes]
    (reserve,) = [r for h in d.history if h["meta"] for r in h["meta"].reserves]
    ends = [e for h in d.history if h["meta"] for e in h["meta"].reservation_ends]
    assert [(e.request, e.outcome) for e in ends] == [(d_req.request_id, "written")], ends
    assert list(write.remote_blocks) == list(reserve.blocks)
    # D decoded from the written KV: it computed none of the prompt.
    computed = sum(h["scheduled"].get(d_req.request_id, 0) for h in d.history)
    assert computed < len(d_req.prompt_token_ids), computed
    return list(write.local_blocks), list(reserve.blocks), write


def test_p_tp2_pushes_into_d_tp1_each_p_rank_its_heads(pd):
    p, d = pd(2, 1)
    p_blocks, d_blocks, write = push(p, d, "tx-2to1")
    assert sorted(write.pairs) == [(0, 0, (0, 2), (0, 2)), (1, 0, (0, 2), (2, 4))]
    assert_gathered(heads_of(p, p_blocks), heads_of(d, d_blocks))


def test_p_tp1_pushes_into_d_tp2_each_d_rank_its_heads(pd):
    p, d = pd(1, 2)
    p_blocks, d_blocks, write = push(p, d, "tx-1to2")
    assert sorted(write.pairs) == [(0, 0, (0, 2), (0, 2)), (0, 1, (2, 4), (0, 2))]
    assert_scattered(heads_of(p, p_blocks), heads_of(d, d_blocks))


def test_mla_latent_cache_is_pushed_once_per_d_rank(pd):
    """P TP 2 → D TP 1 for an MLA model: P rank 0 writes the latent cache into D's one
    worker, P rank 1 writes nothing (its bytes, different in this harness, are not D's)."""
    p, d = pd(2, 1, model=sched_harness.MLA_MODEL)
    p_blocks, d_blocks, write = push(p, d, "tx-mla")
    assert write.pairs == [(0, 0, None, None)]
    (p0, p1), (d0,) = heads_of(p, p_blocks), heads_of(d, d_blocks)
    for layer in LAYERS:
        assert d0[layer] == p0[layer], f"{layer}: D's latent cache differs from P rank 0's"
        assert d0[layer] != p1[layer]
