"""KvleaseConnector with real bytes: P and D engines, each vLLM's real Scheduler here and
the connector's worker half in its own process over CPU KV tensors in vLLM 0.33's layout
(engines.py). Everything between P and D goes over the network as in a deployment: D's
scheduler fetches P's engine info from P's side channel (cluster token), D's worker reads
P's worker's KV blocks with fenced reads over TCP, heartbeats and read-completions travel
from D's worker to P's worker, which forwards them to P's scheduler.

Clocks are real here (tests/vllm/ checks the timing rules on virtual time); the waits
below have deadlines only so that a broken lease fails the test instead of hanging it.
"""

from __future__ import annotations

import time

import pytest
import sched_harness
from engines import LAYERS, Engine, close_engines
from vllm.v1.request import RequestStatus

TOKEN = "worker-test-token"
STEP_S = 0.05  # pause between engine steps (vLLM steps back to back; CI has 2 cores)


def kvlease_engine(name, role, log_dir, lease, seed, num_blocks=64, **sched):
    config = sched_harness.create_vllm_config(
        kv_connector="KvleaseConnector",
        kv_connector_module_path="kvlease.vllm",
        kv_role=role,
        engine_id=name,
        kv_connector_extra_config={
            "kv_lease_duration": lease,
            "cluster_token": TOKEN,
            "transport": "tcp",
        },
        **sched,
    )
    return Engine(name, config, num_blocks=num_blocks, log_dir=log_dir, seed=seed)


@pytest.fixture
def pd(tmp_path):
    """make(lease, p_layout, d_layout) -> (P, D): both worker processes start together."""
    made = []

    def make(lease: float, p_layout: str = "LBNHC", d_layout: str = "LBNHC"):
        p = kvlease_engine("p0", "kv_producer", tmp_path, lease, seed=7,
                           kv_cache_layout=p_layout)
        # D runs one request at a time, so a local request can hold the remote one back.
        d = kvlease_engine("d0", "kv_consumer", tmp_path, lease, seed=8, max_num_seqs=1,
                           kv_cache_layout=d_layout)
        made.extend([p, d])
        return p.ready(), d.ready()

    yield make
    close_engines(made)


def prefill(p: Engine, num_tokens: int = 40):
    req = sched_harness.create_request(
        num_tokens=num_tokens, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    p.add_request(req)
    p.step(fill_new=True)
    out = p.outputs[req.request_id]
    return req, out.kv_transfer_params


def d_request(params, p_req, max_tokens=3):
    return sched_harness.create_request(
        prompt_token_ids=p_req.prompt_token_ids, max_tokens=max_tokens,
        kv_transfer_params=dict(params),
    )


def run_until(cond, engines, limit_s, what, **step_kwargs):
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {limit_s} s"
        for engine in engines:
            engine.step(**step_kwargs.get(engine.name, {}))
        time.sleep(STEP_S)


def test_load_is_byte_exact_after_the_lease_was_renewed_past_its_duration(pd):
    lease = 3.0  # interval 0.5 s, extension 2 s: room for slow steps on 2 shared cores
    p, d = pd(lease)
    p_req, params = prefill(p)
    table = p.connector.scheduler.prefill
    granted_at = table.lease(p_req.request_id)["granted_at"]
    p_blocks = list(params["remote_block_ids"])
    fences = p.connector.scheduler.fences[0]
    assert all(fences.word(b) == params["kvlease_generation"] for b in p_blocks)

    # D is busy with a local request (max_num_seqs=1): the remote one waits, tracked
    # from its arrival, while D's worker heartbeats P's lease.
    local = sched_harness.create_request(num_tokens=16, max_tokens=1000)
    d.add_request(local)
    d.step()
    req = d_request(params, p_req)
    d.add_request(req)
    run_until(lambda: time.monotonic() - granted_at > 2.5 * lease, [d, p], 60,
              "waiting 2.5 lease durations")
    assert req.status == RequestStatus.WAITING
    held = table.lease(p_req.request_id)
    assert held is not None, "the lease expired while D was heartbeating it"
    assert held["last_heartbeat"] is not None and held["last_heartbeat"] > granted_at + lease
    assert held["expiry"] > granted_at + lease
    assert table.stats()["released_expired"] == 0

    # The local request ends; the remote one loads (fenced reads of P's blocks) and runs.
    d.step(sample_eos=True)
    run_until(lambda: req.request_id in d.outputs, [d, p], 60, "D's load and decode")
    assert d.outputs[req.request_id].finish_reason is not None
    loaded = [h for h in d.history if h["meta"].loads]
    (load,) = [x for h in loaded for x in h["meta"].loads]
    d_blocks = load.local_blocks
    assert load.remote_blocks == p_blocks and len(d_blocks) == len(p_blocks) == 3
    recv = [h["kv_out"] for h in d.history if h["kv_out"] and h["kv_out"].finished_recving]
    assert any(req.request_id in o.finished_recving for o in recv)
    assert not any(o.invalid_block_ids for o in recv), "the load reported errors"
    # vLLM computed only what was not loaded (the prompt's last token, at most).
    (first,) = [h["scheduled"][req.request_id] for h in d.history
                if req.request_id in h["scheduled"]][:1]
    assert first <= 1

    p_pages = p.worker.request("blocks", block_ids=p_blocks)
    d_pages = d.worker.request("blocks", block_ids=d_blocks)
    for layer in LAYERS:
        assert all(any(page) for page in p_pages[layer])  # the "prefill" wrote them
        assert d_pages[layer] == p_pages[layer], f"{layer}: D's blocks differ from P's"

    # D's read-completion released the lease; P's vLLM freed the blocks.
    run_until(lambda: p_req.request_id not in p.requests, [p], 30, "P freeing the blocks")
    assert table.stats()["released_completed"] == 1
    assert all(fences.word(b) == 0 for b in p_blocks)
    p.step()
    sched_harness.assert_scheduler_empty(p.scheduler)


def test_lease_is_reclaimed_after_d_is_killed(pd):
    lease = 3.0  # interval 0.5 s, extension 2 s: room for slow steps on 2 shared cores
    p, d = pd(lease)
    p_req, params = prefill(p)
    table = p.connector.scheduler.prefill
    granted_at = table.lease(p_req.request_id)["granted_at"]
    local = sched_harness.create_request(num_tokens=16, max_tokens=1000)
    d.add_request(local)
    d.step()
    d.add_request(d_request(params, p_req))
    run_until(lambda: time.monotonic() - granted_at > 1.5 * lease, [d, p], 60,
              "heartbeats for 1.5 lease durations")
    alive = table.lease(p_req.request_id)
    assert alive is not None and alive["last_heartbeat"] is not None

    d.kill_worker()  # SIGKILL: no abort, no goodbye; D's scheduler is never stepped again
    p_blocks = list(params["remote_block_ids"])
    free_before = p.free_blocks()
    freed_at = []

    def freed():
        if p_req.request_id in p.requests:
            return False
        freed_at.append(time.monotonic())
        return True

    # Bound: the last heartbeat P got + the extension (2/3 of the lease), plus steps.
    run_until(freed, [p], 4 * lease + 10, "P reclaiming a dead D's lease")
    assert table.stats()["released_expired"] == 1
    assert table.lease(p_req.request_id) is None
    # Never before a heartbeat P had (at least this one) plus the extension ran out.
    assert freed_at[0] >= alive["last_heartbeat"] + 2 * lease / 3, "freed too early"
    assert p.free_blocks() == free_before + len(p_blocks)
    fences = p.connector.scheduler.fences[0]
    assert all(fences.word(b) == 0 for b in p_blocks)
    p.step()
    sched_harness.assert_scheduler_empty(p.scheduler)


def test_read_after_the_lease_expired_is_stale_and_vllm_recomputes(pd):
    """A late read must not be served as KV: the fence word was cleared when P reclaimed
    the lease, the read is stale, the connector names the blocks as load errors and vLLM
    (kv_load_failure_policy=recompute) computes the prompt itself."""
    lease = 1.0
    p, d = pd(lease)
    p_req, params = prefill(p)
    run_until(lambda: p_req.request_id not in p.requests, [p], 30, "P reclaiming the lease")
    assert p.connector.scheduler.prefill.stats()["released_expired"] == 1

    req = d_request(params, p_req)
    d.add_request(req)
    run_until(lambda: any(h["kv_out"] and h["kv_out"].invalid_block_ids for h in d.history),
              [d, p], 60, "D's stale read")
    bad = set().union(*(h["kv_out"].invalid_block_ids for h in d.history if h["kv_out"]))
    (load,) = [x for h in d.history for x in h["meta"].loads]
    assert bad == set(load.local_blocks)
    assert d.connector.scheduler.decode.stats()["stale_reads"] == 1
    run_until(lambda: req.request_id in d.outputs, [d, p], 60, "D recomputing")
    # Recomputed: the whole prompt was scheduled for computation after the failed load.
    computed = sum(h["scheduled"].get(req.request_id, 0) for h in d.history)
    assert computed >= len(req.prompt_token_ids)


def load_once(p: Engine, d: Engine):
    """Prefill on P, load on D, decode to the end: (P's blocks, D's blocks, D's request,
    the load errors D's worker reported)."""
    p_req, params = prefill(p)
    req = d_request(params, p_req)
    d.add_request(req)
    run_until(lambda: req.request_id in d.outputs, [d, p], 60, "D's load and decode")
    (load,) = [x for h in d.history for x in h["meta"].loads]
    errors = set().union(*(h["kv_out"].invalid_block_ids for h in d.history if h["kv_out"]))
    return list(params["remote_block_ids"]), list(load.local_blocks), req, errors


def test_load_is_byte_exact_from_a_layer_outer_to_a_block_outer_layout(pd):
    """P's KV cache is layer-outer (LBNHC: each layer one region, blocks one page apart);
    D's is block-outer (BLNHC: a block holds every layer's page, so one layer's blocks are
    two pages apart). A block's page has the same byte order in both (tokens, heads,
    K|V), so the reads must land every page at D's own offsets."""
    p, d = pd(30.0, p_layout="LBNHC", d_layout="BLNHC")
    assert p.worker.request("layout")[LAYERS[0]][1][0] * 2 == \
        d.worker.request("layout")[LAYERS[0]][1][0]  # D's block stride is twice P's
    p_blocks, d_blocks, _, errors = load_once(p, d)
    assert not errors
    p_pages = p.worker.request("blocks", block_ids=p_blocks)
    d_pages = d.worker.request("blocks", block_ids=d_blocks)
    for layer in LAYERS:
        assert d_pages[layer] == p_pages[layer], f"{layer}: D's blocks differ from P's"


def test_a_block_layout_mismatch_is_never_loaded_as_kv(pd):
    """P stores a block as [tokens, heads, K|V] (LBNHC), D as [heads, tokens, K|V]
    (LBHNC): same page size, different meaning. D's handshake with P finds the KV
    incompatible (the block order differs), so D never reads P's blocks: the request is
    computed on D from its prompt, and D's abort frees P's lease at once."""
    p, d = pd(30.0, p_layout="LBNHC", d_layout="LBHNC")
    p_req, params = prefill(p)
    req = d_request(params, p_req)
    d.add_request(req)
    run_until(lambda: req.request_id in d.outputs, [d, p], 60, "D computing the prompt")
    assert d.outputs[req.request_id].finish_reason is not None

    # Refused at the handshake: no read was ever planned or posted, no block was loaded.
    reason = d.connector.scheduler.incompatibility("p0")
    assert reason is not None and "block_order" in reason
    assert "LBNHC" in reason and "LBHNC" in reason
    assert not [x for h in d.history for x in h["meta"].loads], "D planned a read"
    assert not any(h["kv_out"] and h["kv_out"].finished_recving for h in d.history)
    stats = d.connector.scheduler.decode.stats()
    assert stats["stale_reads"] == 0
    # vLLM computed the whole prompt itself.
    computed = sum(h["scheduled"].get(req.request_id, 0) for h in d.history)
    assert computed >= len(req.prompt_token_ids)

    # The abort reached P (D's worker 0 → P's worker 0 → P's scheduler): freed long
    # before the 30 s lease would have expired.
    table = p.connector.scheduler.prefill
    run_until(lambda: p_req.request_id not in p.requests, [d, p], 20, "P freeing the blocks")
    assert table.stats()["released_aborted"] == 1
    assert table.stats()["released_expired"] == 0


def test_a_layout_mismatch_behind_a_compatible_handshake_fails_the_read(pd):
    """Defence in depth: even if D's scheduler planned a read (here its descriptor is
    made to match P's, as a stale handshake would), D's worker compares each layer's
    block format with P's worker's and fails the batch instead of posting it: the
    blocks are load errors and vLLM recomputes (kv_load_failure_policy=recompute)."""
    p, d = pd(30.0, p_layout="LBNHC", d_layout="LBHNC")
    d.connector.scheduler.kv_descriptor = dict(p.connector.scheduler.kv_descriptor)
    p_req, params = prefill(p)
    req = d_request(params, p_req)
    d.add_request(req)
    run_until(lambda: req.request_id in d.outputs, [d, p], 60, "D recomputing")
    assert d.connector.scheduler.incompatibility("p0") is None
    (load,) = [x for h in d.history for x in h["meta"].loads]
    bad = set().union(*(h["kv_out"].invalid_block_ids for h in d.history if h["kv_out"]))
    assert bad == set(load.local_blocks), "the read was not refused"
    results = [h["kv_out"].kv_connector_worker_meta.batches.get(req.request_id)
               for h in d.history if h["kv_out"] and h["kv_out"].kv_connector_worker_meta]
    ((status, nbytes, error),) = [r[0] for r in results if r]
    assert status == "failed" and nbytes == 0 and "not KV-compatible" in error, error
    assert d.connector.scheduler.decode.stats()["failed"] == 1
    computed = sum(h["scheduled"].get(req.request_id, 0) for h in d.history)
    assert computed >= len(req.prompt_token_ids)
    # Nothing was read into D's blocks: they still hold the zeros vLLM allocated (the
    # harness's "model" writes KV only on P), while P's hold its prefill.
    p_pages = p.worker.request("blocks", block_ids=list(params["remote_block_ids"]))
    d_pages = d.worker.request("blocks", block_ids=list(load.local_blocks))
    for layer in LAYERS:
        assert all(any(page) for page in p_pages[layer])
        assert not any(any(page) for page in d_pages[layer]), f"{layer}: D read P's bytes"
