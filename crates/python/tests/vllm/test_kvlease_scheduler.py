"""KvleaseConnector's scheduler half inside vLLM 0.33.0's real ``Scheduler``, on CPU.

P and D are two vLLM schedulers in this process, each with ``kv_connector_module_path=
"kvlease.vllm"``. No worker runs here (tests/worker/ moves real bytes): we play the
workers' part by feeding each scheduler what its workers would report. The D worker's
messages to P (heartbeats, read-completions, aborts) are taken verbatim from the metadata
D's scheduler builds and handed to P's scheduler as ``KvleaseWorkerMetadata.notifs``, as
P's workers forward them. D's handshake is real: D's scheduler fetches P's engine info from
the side channel P's scheduler serves (with the cluster token).

Time: each scheduler's ``clock`` is replaced by a ``FakeClock`` the test advances, so the
heartbeat interval and the lease are checked on virtual time, not measured.
"""

from __future__ import annotations

import base64
import json
import time

import pytest
from sched_harness import (
    MLA_MODEL,
    assert_scheduler_empty,
    create_request,
    create_scheduler,
    create_vllm_config,
    step,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from kvlease import ConfigError, KvleaseError, SideChannelError
from kvlease import _kvlease as native
from kvlease.vllm import (
    BatchSpec,
    KvleaseConfig,
    KvleaseConnectorMetadata,
    KvleaseWorker,
    KvleaseWorkerMetadata,
    LoadSpec,
    _block_format,
    _engine_info,
    _kv_incompatibility,
)
from kvlease.vllm.layout import layer_format

TOKEN = "scheduler-test-token"
LEASE = 6.0  # seconds: heartbeat interval 1 s, extension 4 s
INTERVAL = LEASE / 6
D_WORKER = "d0#0"  # the agent name of D's worker 0 (engine id "#" rank)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def kvlease_scheduler(role: str, engine_id: str, num_blocks: int = 64, lease: float = LEASE,
                      tp_size: int = 1, **sched):
    config = create_vllm_config(
        kv_connector="KvleaseConnector",
        kv_connector_module_path="kvlease.vllm",
        kv_role=role,
        engine_id=engine_id,
        kv_connector_extra_config={
            "kv_lease_duration": lease,
            "cluster_token": TOKEN,
            "transport": "tcp",
        },
        **sched,
    )
    # The scheduler only plans for its workers: no worker runs here, whatever the TP size.
    config.parallel_config.tensor_parallel_size = tp_size
    scheduler = create_scheduler(config, num_blocks=num_blocks)
    clock = FakeClock()
    scheduler.connector.scheduler.clock = clock
    return scheduler, clock


@pytest.fixture
def engines():
    made = []

    def make(*args, **kwargs):
        scheduler, clock = kvlease_scheduler(*args, **kwargs)
        made.append(scheduler)
        return scheduler, clock

    yield make
    for scheduler in made:
        scheduler.connector.shutdown()


def worker_output(notifs=(), batches=None, **kwargs) -> KVConnectorOutput:
    return KVConnectorOutput(
        kv_connector_worker_meta=KvleaseWorkerMetadata(notifs=list(notifs), batches=batches or {}),
        **kwargs,
    )


def feed(scheduler, connector_output: KVConnectorOutput):
    """A step in which the model ran nothing but the workers reported ``connector_output``."""
    sched_out = scheduler.schedule()
    runner = step_output(scheduler, sched_out)
    runner.kv_connector_output = connector_output
    scheduler.update_from_output(sched_out, runner)
    return sched_out


def step_output(scheduler, sched_out):
    from sched_harness import create_model_runner_output

    return create_model_runner_output(
        [scheduler.requests[rid] for rid in sched_out.num_scheduled_tokens]
    )


def prefill_on_p(p, num_tokens: int = 40, block_size: int = 16):
    """A ``do_remote_decode`` request prefilled on P: returns (request, its kv_transfer_params).
    ``block_size``: P's tokens per block (the request's block hashes are of that size)."""
    req = create_request(num_tokens=num_tokens, max_tokens=1, block_size=block_size,
                         kv_transfer_params={"do_remote_decode": True})
    p.add_request(req)
    _, engine_out = step(p)
    (out,) = engine_out[0].outputs
    assert out.request_id == req.request_id and out.finish_reason is not None
    return req, out.kv_transfer_params


def request_from(params: dict, prompt_of) -> object:
    """D's copy of the request: the same prompt, P's params verbatim (what a proxy sends)."""
    return create_request(prompt_token_ids=prompt_of.prompt_token_ids, max_tokens=3,
                          kv_transfer_params=dict(params))


def heartbeats(meta: KvleaseConnectorMetadata, engine: str) -> list[bytes]:
    return [m for e, kind, m in meta.transmits if kind == "heartbeat" and e == engine]


def wait_for_handshake(d, req, limit_s: float = 30.0):
    """Step D until its handshake with P is done and the request waits for its KV."""
    deadline = time.monotonic() + limit_s
    metas = []
    while req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
        assert time.monotonic() < deadline, "D never finished its handshake with P"
        sched_out, _ = step(d, output_for=[])
        metas.append(sched_out.kv_connector_metadata)
        time.sleep(0.01)
    return metas


def test_p_request_finishes_with_lease_params(engines):
    p, _ = engines("kv_producer", "p0")
    pool = p.kv_cache_manager.block_pool
    req, params = prefill_on_p(p)
    blocks = p.kv_cache_manager.get_block_ids(req.request_id)[0]

    # vLLM's keys (what its proxies and router pass along) plus the lease's.
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "p0"
    assert params["remote_request_id"] == req.request_id
    assert params["remote_block_ids"] == list(blocks) and len(blocks) == 3
    assert params["remote_port"] == p.connector.scheduler.side_channel_port
    assert params["tp_size"] == 1 and params["kvlease_lease_ms"] == round(LEASE * 1000)
    assert "kvlease_lease_duration" not in params
    assert isinstance(params["kvlease_generation"], int) and params["kvlease_generation"] != 0

    # The lease holds the blocks: vLLM did not free them.
    lease = p.connector.scheduler.prefill.lease(req.request_id)
    assert lease is not None and lease["blocks"] == len(blocks)
    assert lease["generation"] == params["kvlease_generation"]
    assert pool.free_block_queue.num_free_blocks == 64 - 1 - 3
    assert req.request_id in p.requests


def nixl_shaped(params: dict) -> dict:
    """P's params as NixlConnector's pull scheduler shapes them: one list of block ids per
    KV cache group, its expiry and registration keys, vLLM's parallel sizes."""
    shaped = dict(params)
    shaped["remote_block_ids"] = (list(params["remote_block_ids"]),)
    shaped.update(remote_blocks_expiry_time=None, remote_registration_generation=0,
                  dcp_size=1, pp_size=1, transfer_mode="pull")
    return shaped


def old_lease_key(params: dict) -> dict:
    """P's params as the connector wrote them before the one codec: the lease in seconds."""
    old = {k: v for k, v in params.items() if k != "kvlease_lease_ms"}
    old["kvlease_lease_duration"] = params["kvlease_lease_ms"] / 1000
    return old


@pytest.mark.parametrize("shape", [nixl_shaped, old_lease_key])
def test_d_reads_nixl_shaped_params_and_the_old_lease_key(engines, shape):
    """The codec reads what vLLM's proxies may forward: NixlConnector's shape of the keys
    and the lease in seconds; D plans the same load as from P's own answer."""
    p, _ = engines("kv_producer", "p0")
    d, _ = engines("kv_consumer", "d0")
    p_req, params = prefill_on_p(p)
    req = request_from(shape(params), p_req)
    d.add_request(req)
    metas = wait_for_handshake(d, req)
    (load,) = [load for meta in metas for load in meta.loads]
    assert load.engine == "p0" and load.remote_request == params["remote_request_id"]
    assert load.remote_blocks == params["remote_block_ids"]
    assert load.generation == params["kvlease_generation"]


INVALID_PARAMS = {
    # The codec is stricter than the connector's hand parsing was: no defaults for
    # tp_size or kvlease_num_tokens, no string-to-int coercion.
    "tp_size missing": ("tp_size", lambda p: {k: v for k, v in p.items() if k != "tp_size"}),
    "kvlease_num_tokens missing": (
        "kvlease_num_tokens",
        lambda p: {k: v for k, v in p.items() if k != "kvlease_num_tokens"},
    ),
    "remote_port a string": ("remote_port", lambda p: {**p, "remote_port": str(p["remote_port"])}),
    "generation 0": ("kvlease_generation", lambda p: {**p, "kvlease_generation": 0}),
    # Several groups are a hybrid model's lease (test_kvlease_hybrid.py); a group that is
    # no list of block ids is none.
    "a KV cache group that is no list": (
        "remote_block_ids",
        lambda p: {**p, "remote_block_ids": [p["remote_block_ids"], 5]},
    ),
}


@pytest.mark.parametrize("case", sorted(INVALID_PARAMS))
def test_d_computes_params_that_are_no_lease_with_a_warning_naming_the_field(
    engines, case, caplog
):
    field, mangle = INVALID_PARAMS[case]
    p, _ = engines("kv_producer", "p0")
    d, _ = engines("kv_consumer", "d0")
    p_req, params = prefill_on_p(p)
    req = request_from(mangle(params), p_req)
    with caplog.at_level("WARNING", logger="kvlease.vllm"):
        d.add_request(req)
    assert f"kv_transfer_params.{field}" in caplog.text and "computing locally" in caplog.text
    assert not d.connector.scheduler.decode.is_waiting(req.request_id)
    sched_out, _ = step(d)
    assert not sched_out.kv_connector_metadata.loads
    assert req.num_computed_tokens == len(req.prompt_token_ids)
    step(d, use_eos=True)
    step(d, output_for=[])
    assert_scheduler_empty(d)


def test_d_waits_heartbeats_at_the_interval_loads_and_runs(engines):
    p, p_clock = engines("kv_producer", "p0")
    d, d_clock = engines("kv_consumer", "d0")
    p_req, params = prefill_on_p(p)
    lease_id = params["remote_request_id"]

    req = request_from(params, p_req)
    d.add_request(req)
    metas = wait_for_handshake(d, req)
    assert d.connector.scheduler.decode.is_ready("p0")
    (load,) = [load for meta in metas for load in meta.loads]
    assert load.request == req.request_id and load.engine == "p0"
    assert load.remote_blocks == params["remote_block_ids"]
    assert load.local_blocks == list(d.kv_cache_manager.get_block_ids(req.request_id)[0])
    assert load.generation == params["kvlease_generation"]
    (batch,) = load.batches
    read_complete = batch.notif

    # D waits for its KV for 2.5 lease durations of virtual time. Every step carries the
    # heartbeats that came due; P gets them as its worker would forward them.
    sent_at = []
    for meta in metas:
        for hb in heartbeats(meta, "p0"):
            sent_at.append(d_clock())
            assert hb.startswith(b"HB:") and lease_id.encode() in hb
    steps = int(2.5 * LEASE / 0.25)
    for _ in range(steps):
        d_clock.advance(0.25)
        p_clock.advance(0.25)
        sched_out, _ = step(d, output_for=[])
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert not sched_out.num_scheduled_tokens
        beats = heartbeats(sched_out.kv_connector_metadata, "p0")
        for hb in beats:
            assert hb.startswith(b"HB:") and lease_id.encode() in hb
            sent_at.append(d_clock())
        feed(p, worker_output(notifs=[(D_WORKER, hb) for hb in beats]))

    # Throttled: never two within an interval, never a gap longer than interval + step.
    gaps = [b - a for a, b in zip(sent_at, sent_at[1:])]
    assert len(sent_at) >= steps * 0.25 / INTERVAL - 1
    assert all(INTERVAL - 1e-9 <= g <= INTERVAL + 0.25 + 1e-9 for g in gaps), gaps
    # P renewed the lease: alive 2.5 durations after the grant, expiry ahead of P's now.
    lease = p.connector.scheduler.prefill.lease(p_req.request_id)
    assert lease is not None and lease["expiry"] > p_clock()
    assert lease["last_heartbeat"] is not None
    assert p.connector.scheduler.prefill.stats()["released_expired"] == 0

    # The workers read the blocks (fence matched): D's request runs from the loaded KV.
    feed(d, worker_output(batches={req.request_id: {0: ("done", 3 * 1024, None)}},
                          finished_recving={req.request_id}))
    sched_out, _ = step(d)
    # Only what was not loaded is computed: the prompt's last token at most.
    assert 0 < sched_out.num_scheduled_tokens[req.request_id] <= 1
    assert req.num_computed_tokens >= len(req.prompt_token_ids)
    assert not d.connector.scheduler.decode.is_waiting(req.request_id)
    # P learns of the read from the batch's read-completion: the lease ends, vLLM frees.
    feed(p, worker_output(notifs=[(D_WORKER, read_complete)]))
    assert p.connector.scheduler.prefill.lease(p_req.request_id) is None
    sched_out = feed(p, worker_output())
    assert p_req.request_id in sched_out.kv_connector_metadata.finished_sending
    feed(p, KVConnectorOutput(finished_sending={p_req.request_id}))
    feed(p, KVConnectorOutput())
    assert_scheduler_empty(p)

    step(d, use_eos=True)
    sched_out, _ = step(d, output_for=[])
    d_clock.advance(3 * INTERVAL)
    sched_out, _ = step(d, output_for=[])
    # Finished on D: no more heartbeats for it.
    assert not heartbeats(sched_out.kv_connector_metadata, "p0")
    assert d.connector.scheduler.decode.stats()["done"] == 1
    assert d.connector.scheduler.decode.tracked == 0
    assert_scheduler_empty(d)


def test_a_request_naming_another_instance_never_makes_d_reconnect(engines):
    """A client's ``kvlease_instance`` is only a claim: D checks it with P's side channel
    and keeps its connections when P answers with the instance D knows (the workers get
    no new engine info, so they keep their links). The request that named the made-up
    instance is computed on D; the next real request loads as before."""
    p, _ = engines("kv_producer", "p0")
    d, _ = engines("kv_consumer", "d0")
    p_req, params = prefill_on_p(p)
    first = request_from(params, p_req)
    d.add_request(first)
    metas = wait_for_handshake(d, first)
    assert [e for meta in metas for e in meta.engines] == ["p0"]
    known = d.connector.scheduler.engines["p0"].instance

    p_req2, params2 = prefill_on_p(p)
    forged = request_from(dict(params2, kvlease_instance=known + 1), p_req2)
    d.add_request(forged)
    metas = []
    deadline = time.monotonic() + 30
    while forged.request_id not in (sched_out := step(d)[0]).num_scheduled_tokens:
        metas.append(sched_out.kv_connector_metadata)
        # Never parked for a load: no read is planned while P's answer is awaited.
        assert forged.status != RequestStatus.WAITING_FOR_REMOTE_KVS
        assert time.monotonic() < deadline, "D never settled the forged request"
        time.sleep(0.01)
    metas.append(sched_out.kv_connector_metadata)
    # Computed here, from its first token.
    assert sched_out.num_scheduled_tokens[forged.request_id] == len(forged.prompt_token_ids)
    assert not [e for meta in metas for e in meta.engines], "D reconnected on a request's word"
    assert not [load for meta in metas for load in meta.loads if load.request == forged.request_id]
    assert d.connector.scheduler.engines["p0"].instance == known
    assert d.connector.scheduler.decode.is_ready("p0")
    assert d.connector.scheduler.decode.stats()["instance_checks"] >= 1


def test_request_aborted_on_d_frees_on_p(engines):
    p, p_clock = engines("kv_producer", "p0")
    d, d_clock = engines("kv_consumer", "d0")
    p_req, params = prefill_on_p(p)
    req = request_from(params, p_req)
    d.add_request(req)
    wait_for_handshake(d, req)

    d.finish_requests([req.request_id], RequestStatus.FINISHED_ABORTED)
    sched_out, _ = step(d, output_for=[])
    aborts = [m for e, kind, m in sched_out.kv_connector_metadata.transmits
              if kind == "abort" and e == "p0"]
    assert aborts, sched_out.kv_connector_metadata.transmits
    # D's worker reports the aborted load done (nothing to wait for); D forgets it.
    feed(d, KVConnectorOutput(finished_recving={req.request_id}))
    step(d, output_for=[])
    assert_scheduler_empty(d)

    # P frees at once, long before the lease would expire.
    feed(p, worker_output(notifs=[(D_WORKER, m) for m in aborts]))
    assert p.connector.scheduler.prefill.stats()["released_aborted"] == 1
    sched_out = feed(p, worker_output())
    assert p_req.request_id in sched_out.kv_connector_metadata.finished_sending
    feed(p, KVConnectorOutput(finished_sending={p_req.request_id}))
    feed(p, KVConnectorOutput())
    assert_scheduler_empty(p)


def test_request_aborted_on_p_before_it_finishes_frees_at_once(engines):
    p, _ = engines("kv_producer", "p0", max_num_batched_tokens=16)
    req = create_request(num_tokens=40, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    p.add_request(req)
    step(p)  # 16 of 40 prompt tokens
    assert req.status == RequestStatus.RUNNING
    p.finish_requests([req.request_id], RequestStatus.FINISHED_ABORTED)
    assert p.connector.scheduler.prefill.leases == 0
    step(p, output_for=[])
    assert_scheduler_empty(p)


def test_reaper_frees_an_expired_lease_behind_a_live_one(engines):
    """vLLM issue #58222: a reaper that stopped at the first unexpired lease kept every
    lease granted after it. Here the oldest lease stays alive (heartbeats) while a younger
    one gets none: the younger one must expire and be freed all the same."""
    p, clock = engines("kv_producer", "p0")
    old, old_params = prefill_on_p(p)
    clock.advance(0.5)
    young, _ = prefill_on_p(p)
    table = p.connector.scheduler.prefill
    young_expiry = table.lease(young.request_id)["expiry"]

    from kvlease import encode_heartbeats

    freed_at = None
    for _ in range(int(3 * LEASE / 0.25)):
        clock.advance(0.25)
        beats = encode_heartbeats([old_params["remote_request_id"]])
        sched_out = feed(p, worker_output(notifs=[(D_WORKER, hb) for hb in beats]))
        if young.request_id in sched_out.kv_connector_metadata.finished_sending:
            freed_at = clock()
            feed(p, KVConnectorOutput(finished_sending={young.request_id}))
            break
    assert freed_at is not None, "the unheartbeated lease was never reclaimed"
    assert young_expiry <= freed_at <= young_expiry + 0.25
    assert table.lease(old.request_id) is not None
    assert table.stats()["released_expired"] == 1
    assert young.request_id not in p.requests and old.request_id in p.requests


def test_stale_read_is_a_load_error_and_d_recomputes(engines):
    p, _ = engines("kv_producer", "p0")
    d, _ = engines("kv_consumer", "d0")
    p_req, params = prefill_on_p(p)
    req = request_from(params, p_req)
    d.add_request(req)
    wait_for_handshake(d, req)
    blocks = list(d.kv_cache_manager.get_block_ids(req.request_id)[0])

    # The worker's fenced read found another generation: the batch is "stale" and the
    # worker names the request's blocks as load errors (what KvleaseWorker reports).
    feed(d, worker_output(batches={req.request_id: {0: ("stale", 0, "fence mismatch")}},
                          finished_recving={req.request_id}, invalid_block_ids=set(blocks)))
    assert d.connector.scheduler.decode.stats()["stale_reads"] == 1
    # kv_load_failure_policy=recompute: vLLM computes the prompt itself, from token 0.
    sched_out, _ = step(d)
    assert sched_out.num_scheduled_tokens[req.request_id] > 1
    assert req.num_computed_tokens == sched_out.num_scheduled_tokens[req.request_id]


def test_tp2_a_stale_batch_reported_before_the_load_finishes_is_a_load_error(engines):
    """TP=2: each D worker reads its own P rank. A worker reports its batch's result in
    the step the batch ends, but vLLM lists the request in finished_recving only when
    every worker is done. Here D's worker 1 finds its read stale one step before worker 0
    finishes its (good) read: the load must end failed (stale), not done."""
    p, _ = engines("kv_producer", "p0", tp_size=2)
    d, _ = engines("kv_consumer", "d0", tp_size=2)
    p_req, params = prefill_on_p(p)
    assert params["tp_size"] == 2
    req = request_from(params, p_req)
    d.add_request(req)
    metas = wait_for_handshake(d, req)
    (load,) = [load for meta in metas for load in meta.loads]
    by_worker = {b.d_worker: b for b in load.batches}
    assert sorted(by_worker) == [0, 1] and len(load.batches) == 2
    assert all(b.p_rank == b.d_worker and b.local_heads == b.remote_heads == (0, 2)
               for b in load.batches)
    blocks = list(d.kv_cache_manager.get_block_ids(req.request_id)[0])

    # Step k: worker 1's read was stale; it names the request's blocks as load errors and
    # is done with the request, but worker 0 is still reading: not finished_recving yet.
    feed(d, worker_output(batches={req.request_id: {by_worker[1].index: ("stale", 0, "fence")}},
                          invalid_block_ids=set(blocks)))
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # Step k+1: worker 0's read is done; now vLLM reports the request finished_recving.
    feed(d, worker_output(batches={req.request_id: {by_worker[0].index: ("done", 2048, None)}},
                          finished_recving={req.request_id}))
    stats = d.connector.scheduler.decode.stats()
    assert stats["stale_reads"] == 1 and stats["failed"] == 1 and stats["done"] == 0, stats
    assert not d.connector.scheduler.decode.is_waiting(req.request_id)
    # vLLM (kv_load_failure_policy=recompute) computes the prompt itself.
    sched_out, _ = step(d)
    assert sched_out.num_scheduled_tokens[req.request_id] > 1
    step(d, use_eos=True)
    step(d, output_for=[])
    assert d.connector.scheduler.decode.stats()["done"] == 0
    assert d.connector.scheduler.decode.tracked == 0


def test_a_kv_dtype_mismatch_is_refused_at_the_handshake_and_computed_locally(engines):
    """P's KV is float16, D's bfloat16: the same block bytes, different numbers. D's
    handshake finds P incompatible; the request is never loaded (no read planned, never
    WAITING_FOR_REMOTE_KVS), vLLM computes the whole prompt on D, and D's abort frees
    P's lease at once."""
    p, _ = engines("kv_producer", "p0")
    d, _ = engines("kv_consumer", "d0", dtype="bfloat16")
    p_req, params = prefill_on_p(p)
    req = request_from(params, p_req)
    d.add_request(req)
    deadline = time.monotonic() + 30
    metas = []
    while True:
        assert time.monotonic() < deadline, "D never scheduled the request"
        sched_out, _ = step(d)
        metas.append(sched_out.kv_connector_metadata)
        assert req.status != RequestStatus.WAITING_FOR_REMOTE_KVS
        if req.request_id in sched_out.num_scheduled_tokens:
            break
        time.sleep(0.01)
    reason = d.connector.scheduler.incompatibility("p0")
    assert reason is not None and "dtype" in reason and "bfloat16" in reason
    assert not [load for meta in metas for load in meta.loads]
    # The whole prompt is computed on D, from token 0.
    assert sched_out.num_scheduled_tokens[req.request_id] == len(req.prompt_token_ids)
    aborts = [m for meta in metas for e, kind, m in meta.transmits
              if kind == "abort" and e == "p0"]
    assert aborts
    feed(p, worker_output(notifs=[(D_WORKER, m) for m in aborts]))
    assert p.connector.scheduler.prefill.stats()["released_aborted"] == 1


def test_roles_open_only_what_they_use(engines):
    """A kv_consumer serves no side channel and keeps no lease table; a kv_producer has
    no decode core; the side channel listens on side_channel_host (127.0.0.1 here)."""
    p, _ = engines("kv_producer", "p0")
    d, _ = engines("kv_consumer", "d0")
    ps, ds = p.connector.scheduler, d.connector.scheduler
    assert ps.decode is None and ps.side_channel is not None
    assert ds.prefill is None and ds.side_channel is None and ds.side_channel_port == 0
    import psutil

    listening = {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    }
    assert ("127.0.0.1", ps.side_channel_port) in listening
    assert ("0.0.0.0", ps.side_channel_port) not in listening


def test_every_port_kvlease_opens_can_be_set(engines, monkeypatch):
    """A firewalled deployment fixes the ports: P's side channel from
    ``side_channel_port`` (or ``KVLEASE_SIDE_CHANNEL_PORT``), each worker's transport
    from ``transport_port`` + its rank (or ``KVLEASE_TRANSPORT_PORT``); out of range
    is refused naming the key."""
    import socket

    def free_pair() -> int:
        for _ in range(50):
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", 0))
                port = a.getsockname()[1]
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
        raise AssertionError("no two free ports in a row")

    side, transport = free_pair(), free_pair()
    monkeypatch.setenv("KVLEASE_SIDE_CHANNEL_PORT", str(side))
    p, _ = engines("kv_producer", "p0")
    assert p.connector.scheduler.side_channel_port == side
    config = create_vllm_config(
        kv_connector="KvleaseConnector", kv_connector_module_path="kvlease.vllm",
        kv_role="kv_consumer", engine_id="d0",
        kv_connector_extra_config={"cluster_token": TOKEN, "transport_port": transport},
    )
    worker = KvleaseWorker(config, KvleaseConfig.from_vllm(config))
    try:
        assert worker.agent.address == f"127.0.0.1:{transport}"
    finally:
        worker.shutdown()
    for bad in (70000, -1, "x"):
        config.kv_transfer_config.kv_connector_extra_config = {"transport_port": bad}
        with pytest.raises(ConfigError, match="transport_port"):
            KvleaseConfig.from_vllm(config)


def test_the_connector_listens_beyond_loopback_only_with_a_token_or_the_opt_out():
    """A worker's transport on every interface without a cluster token would let anyone
    who reaches it read the KV and send notifications: refused at start, naming the
    opt-out, which lets it listen."""
    config = create_vllm_config(
        kv_connector="KvleaseConnector", kv_connector_module_path="kvlease.vllm",
        kv_role="kv_consumer", engine_id="d0",
        kv_connector_extra_config={"transport_host": "0.0.0.0"},
    )
    with pytest.raises(KvleaseError, match="allow_unauthenticated"):
        KvleaseWorker(config, KvleaseConfig.from_vllm(config))
    config.kv_transfer_config.kv_connector_extra_config = {
        "transport_host": "0.0.0.0", "allow_unauthenticated": True}
    worker = KvleaseWorker(config, KvleaseConfig.from_vllm(config))
    try:
        assert worker.agent.address.startswith("0.0.0.0:")
    finally:
        worker.shutdown()
    config.kv_transfer_config.kv_connector_extra_config = {"allow_unauthenticated": "yes"}
    with pytest.raises(ConfigError, match="allow_unauthenticated"):
        KvleaseConfig.from_vllm(config)


def test_block_formats_tell_layouts_apart():
    """A layer's block format is its dtype, block shape and the physical order of the
    block's dims: LBNHC and BLNHC store a block alike (only the blocks' spacing differs),
    LBHNC does not; the descriptors' comparison names what differs."""
    import torch

    buf = torch.zeros(1 << 16, dtype=torch.float16)
    shape = (8, 4, 16, 32)  # blocks, heads, tokens, 2 * head_size

    def view(stride, dtype=torch.float16):
        return buf.view(dtype).as_strided(shape, stride)

    assert _block_format(view((2048, 32, 128, 1))) == ["float16", [4, 16, 32], [2, 1, 3]]
    assert _block_format(view((2048, 512, 32, 1))) == ["float16", [4, 16, 32], [1, 2, 3]]
    assert _block_format(view((2048, 32, 128, 1), torch.bfloat16))[0] == "bfloat16"
    # What the workers publish: the geometry, what the dims hold, the backend.
    lbnhc = layer_format(view((2048, 32, 128, 1)), "FLASH_ATTN", "auto")
    blnhc = layer_format(view((4096, 32, 128, 1)), "FLASH_ATTN", "auto")
    lbhnc = layer_format(view((2048, 512, 32, 1)), "FLASH_ATTN", "auto")
    assert lbnhc == blnhc == ["float16", [4, 16, 32], [2, 1, 3], "HNC", "FLASH_ATTN"]
    assert lbhnc == ["float16", [4, 16, 32], [1, 2, 3], "HNC", "FLASH_ATTN"]

    base = {"model": "m", "dtype": "torch.float16", "cache_dtype": "auto",
            "num_kv_heads": 4, "head_size": 16, "num_layers": 2, "block_size": 16,
            "block_order": "NHC", "kv_cache_layout": "LBNHC", "use_mla": False,
            "layers": {"l0": lbnhc}}
    assert _kv_incompatibility(base, dict(base, kv_cache_layout="BLNHC",
                                          layers={"l0": blnhc})) is None
    why = _kv_incompatibility(base, dict(base, layers={"l0": lbhnc}))
    assert why is not None and "l0" in why
    why = _kv_incompatibility(base, dict(base, block_order="HNC", kv_cache_layout="LBHNC"))
    assert why is not None and "block_order" in why and "LBHNC" in why
    why = _kv_incompatibility(base, dict(base, block_size=32, head_size=8))
    assert why is not None and "block_size" in why and "head_size" in why
    assert _kv_incompatibility(base, None) is not None  # a P without a descriptor
    # A layout unknown to one scheduler: the workers' layer formats still decide.
    assert _kv_incompatibility(base, dict(base, block_order=None)) is None
    why = _kv_incompatibility(base, dict(base, block_order=None, layers={"l0": lbhnc}))
    assert why is not None and "l0" in why


# ------------------------------------------------------------ malformed handshake payloads


def p_payload(kv=None, **changes) -> dict:
    """What P's side channel serves (KvleaseScheduler._payload), one worker."""
    payload = {
        "format": 2, "engine_id": "p0", "instance": 77, "tp_size": 1, "num_blocks": 64,
        "block_size": 16, "num_kv_heads": 4, "kv": kv,
        "workers": [{
            "rank": 0, "agent_name": "p0#0",
            "agent_metadata": base64.b64encode(b"agent metadata").decode(),
            "layers": [["l0", 1, 0, 4096, 4096, 64]], "fence_region": 2,
            "num_blocks": 64, "device": "cpu",
            "kv_format": {"l0": ["float16", [4, 16, 32], [2, 1, 3]]},
        }],
    }
    payload.update(changes)
    return payload


def with_worker(**changes) -> dict:
    payload = p_payload()
    payload["workers"][0].update(changes)
    return payload


MALFORMED = {
    "not json": b"{not json",
    "a list": b"[1, 2]",
    "no tp_size": {k: v for k, v in p_payload().items() if k != "tp_size"},
    "tp_size a string": p_payload(tp_size="2"),
    "tp_size 0": p_payload(tp_size=0),
    "num_blocks negative": p_payload(num_blocks=-1),
    "instance past u64": p_payload(instance=1 << 70),
    "kv a list": p_payload(kv=[1, 2]),
    "kv layers an int": p_payload(kv={"model": "m", "layers": 5}),
    "kv layer format an int": p_payload(kv={"model": "m", "layers": {"l0": 5}}),
    "workers missing": {k: v for k, v in p_payload().items() if k != "workers"},
    "worker rank past tp_size": with_worker(rank=1),
    "worker rank a string": with_worker(rank="0"),
    "agent_metadata not base64": with_worker(agent_metadata="not base64!"),
    "agent_metadata missing": with_worker(agent_metadata=None),
    "layer too short": with_worker(layers=[["l0", 1, 0, 4096]]),
    "layer offset negative": with_worker(layers=[["l0", 1, -4096, 4096, 4096, 64]]),
    "layer past 2^64": with_worker(layers=[["l0", 1, 0, 1 << 63, 4096, 64]]),
    "fence_region missing": with_worker(fence_region=None),
    "kv_format a list": with_worker(kv_format=[["float16"]]),
}


def raw(payload) -> bytes:
    return payload if isinstance(payload, bytes) else json.dumps(payload).encode()


def test_engine_info_normalises_a_good_payload():
    info = _engine_info(raw(p_payload(kv={"model": "m", "layers": {"l0": ["float16", [1], [1]]}})))
    assert info.engine_id == "p0" and info.tp_size == 1 and info.num_blocks == 64
    assert info.instance == 77 and info.kv["layers"] == {"l0": ["float16", [1], [1]]}
    (w,) = info.workers
    assert w.rank == 0 and w.agent_metadata == b"agent metadata"
    assert w.layers == [("l0", 1, 0, 4096, 4096, 64)] and w.fence_region == 2
    # An older P: no instance, no descriptor, no block formats (refused later, not here).
    old = p_payload()
    del old["instance"], old["kv"], old["workers"][0]["kv_format"]
    info = _engine_info(raw(old))
    assert info.instance == 0 and info.kv is None
    assert info.workers[0].kv_format is None


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_engine_info_refuses_a_malformed_payload(case):
    with pytest.raises(SideChannelError, match="malformed"):
        _engine_info(raw(MALFORMED[case]))


@pytest.mark.parametrize(
    "case", ["no tp_size", "instance past u64", "kv layers an int", "agent_metadata not base64"]
)
def test_a_malformed_handshake_payload_fails_the_load_and_d_computes(engines, case):
    """A P side channel serving a malformed payload: D's handshake fails, the request is
    computed on D from its prompt (no read planned), and D's scheduler keeps running."""
    server = native.SideChannelServer(raw(MALFORMED[case]), token=TOKEN.encode(),
                                      listen="127.0.0.1:0")
    try:
        d, _ = engines("kv_consumer", "d0")
        req = create_request(num_tokens=40, max_tokens=2, kv_transfer_params={
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": [1, 2, 3], "remote_engine_id": "p0",
            "remote_request_id": "p-req", "remote_host": "127.0.0.1",
            "remote_port": server.port, "tp_size": 1, "kvlease_generation": 5,
            "kvlease_num_tokens": 40, "kvlease_lease_duration": LEASE,
        })
        d.add_request(req)
        deadline = time.monotonic() + 30
        metas = []
        while req.request_id not in d.requests or not req.num_computed_tokens:
            assert time.monotonic() < deadline, "D never scheduled the request"
            sched_out, _ = step(d)
            metas.append(sched_out.kv_connector_metadata)
            assert req.status != RequestStatus.WAITING_FOR_REMOTE_KVS
            time.sleep(0.01)
        decode = d.connector.scheduler.decode
        assert decode.stats()["failed"] == 1 and not decode.is_ready("p0")
        assert not [load for meta in metas for load in meta.loads]
        assert not any(meta.engines for meta in metas), "malformed engine info reached workers"
        assert req.num_computed_tokens == len(req.prompt_token_ids)
        step(d, use_eos=True)
        step(d, output_for=[])
        assert_scheduler_empty(d)
    finally:
        server.close()


def test_a_worker_keeps_no_half_made_link(engines):
    """D's worker connects to a P worker whose engine info names a region P's agent does
    not have: the connection is dropped and nothing about it is kept, so no later batch
    uses a half-made link."""
    config = create_vllm_config(
        kv_connector="KvleaseConnector", kv_connector_module_path="kvlease.vllm",
        kv_role="kv_consumer", engine_id="d0",
        kv_connector_extra_config={"cluster_token": TOKEN, "transport": "tcp"},
    )
    p_agent = native.Agent("p0#0", token=TOKEN.encode(), backend="tcp")
    buf = bytearray(4096)
    region = p_agent.register(buf)
    worker = KvleaseWorker(config, KvleaseConfig.from_vllm(config))
    try:
        payload = with_worker(
            agent_metadata=base64.b64encode(bytes(p_agent.metadata())).decode(),
            layers=[["l0", region.id, 0, 4096, 4096, 1]], fence_region=region.id + 99,
        )
        worker.engines["p0"] = _engine_info(raw(payload))
        with pytest.raises(KvleaseError, match="no region"):
            worker._link("p0", 0)
        assert not worker._links
        # Fixed engine info (a new handshake): the link is made whole.
        worker._forget_peers("p0")
        payload["workers"][0]["fence_region"] = region.id
        worker.engines["p0"] = _engine_info(raw(payload))
        link = worker._link("p0", 0)
        assert worker._links[("p0", 0)] is link and link.fence.id == region.id
        assert link.layers["l0"][0].id == region.id
    finally:
        worker.shutdown()
        p_agent.close()


def test_a_failed_batch_drops_only_its_own_link():
    """D's worker reads from P's workers 0 and 1. A batch that fails on worker 1's
    connection drops that link only (the next read connects afresh); the link to worker 0
    and its reads are left alone, and a stale batch (a lease outcome) drops no link."""
    import torch

    config = create_vllm_config(
        kv_connector="KvleaseConnector", kv_connector_module_path="kvlease.vllm",
        kv_role="kv_consumer", engine_id="d0",
        kv_connector_extra_config={"cluster_token": TOKEN, "transport": "tcp"},
    )
    worker = KvleaseWorker(config, KvleaseConfig.from_vllm(config))
    p_agents, keep = [], []
    try:
        worker.register_kv_caches({"l0": torch.zeros(4, 16, dtype=torch.float16)})
        page = 16 * 2
        workers = []
        for rank in range(2):
            agent = native.Agent(f"p0#{rank}", token=TOKEN.encode(), backend="tcp")
            blocks, fence = bytearray(4 * page), bytearray(4 * 8)
            keep += [blocks, fence]
            region, fence_region = agent.register(blocks), agent.register(fence)
            p_agents.append(agent)
            workers.append({
                "rank": rank,
                "agent_metadata": base64.b64encode(bytes(agent.metadata())).decode(),
                "layers": [["l0", region.id, 0, page, page, 4]],
                "fence_region": fence_region.id, "kv_format": worker.kv_format,
            })
        worker.engines["p0"] = _engine_info(raw(p_payload(tp_size=2, workers=workers)))

        def load(rid, p_rank, fence_block):
            # generation 5: P's fence words are all 0, so a read that gets that far is stale.
            worker._post(LoadSpec(
                request=rid, engine="p0", remote_request=rid, local_blocks=[0],
                remote_blocks=[0], fence_block=fence_block, generation=5,
                batches=[BatchSpec(index=0, d_worker=0, p_rank=p_rank, local_heads=(0, 16),
                                   remote_heads=(0, 16), notif=b"read")],
            ))

        def results(rid):
            deadline = time.monotonic() + 30
            while True:
                worker.get_finished()
                meta = worker.build_worker_meta()
                if meta is not None and rid in meta.batches:
                    return meta.batches[rid][0]
                assert time.monotonic() < deadline, f"{rid} never ended"
                time.sleep(0.01)

        load("stale", 0, 0)
        assert results("stale")[0] == "stale"
        link0 = worker._links[("p0", 0)]
        # Worker 1 refuses the read (the fence word is outside its region): failed.
        load("failed", 1, 1000)
        status, _, error = results("failed")
        assert status == "failed" and "refused" in error, error
        assert ("p0", 1) not in worker._links
        assert worker._links[("p0", 0)] is link0
        # Worker 1 is connected afresh for the next read; worker 0's link still reads.
        load("again", 1, 0)
        assert results("again")[0] == "stale" and ("p0", 1) in worker._links
        load("still", 0, 0)
        assert results("still")[0] == "stale" and worker._links[("p0", 0)] is link0
    finally:
        worker.shutdown()
        for agent in p_agents:
            agent.close()


# ------------------------------------------------- heterogeneous TP and MLA (the plans)


def plan_between(engines, p_tp: int, d_tp: int, **sched):
    """P with TP ``p_tp`` prefills, D with TP ``d_tp`` handshakes and plans the load:
    (P, D, P's request, D's request, the LoadSpec D's workers get)."""
    p, _ = engines("kv_producer", "p0", tp_size=p_tp, **sched)
    d, _ = engines("kv_consumer", "d0", tp_size=d_tp, **sched)
    p_req, params = prefill_on_p(p)
    assert params["tp_size"] == p_tp
    req = request_from(params, p_req)
    d.add_request(req)
    metas = wait_for_handshake(d, req)
    (load,) = [load for meta in metas for load in meta.loads]
    assert d.connector.scheduler.incompatibility("p0") is None
    return p, d, p_req, req, load


def rows(load: LoadSpec) -> list[tuple]:
    return [(b.d_worker, b.p_rank, b.local_heads, b.remote_heads) for b in load.batches]


def complete_every_batch(p, d, p_req, req, load):
    """Each batch ends done on its D worker and its read completion reaches P from that
    worker; P's lease must wait for the last of them, and no longer."""
    table = p.connector.scheduler.prefill
    for k, b in enumerate(load.batches):
        assert table.lease(p_req.request_id) is not None, f"released after {k} readers"
        feed(p, worker_output(notifs=[(f"d0#{b.d_worker}", b.notif)]))
        lease = table.lease(p_req.request_id)
        if k + 1 < len(load.batches):
            assert lease["consumers_expected"] == len(load.batches), lease
            assert lease["consumers_reported"] == k + 1, lease
    assert table.lease(p_req.request_id) is None
    assert table.stats()["released_completed"] == 1
    feed(d, worker_output(
        batches={req.request_id: {b.index: ("done", 1024, None) for b in load.batches}},
        finished_recving={req.request_id}))
    stats = d.connector.scheduler.decode.stats()
    assert stats["failed"] == 0 and stats["stale_reads"] == 0, stats
    assert not d.connector.scheduler.decode.is_waiting(req.request_id)
    # Loaded: vLLM runs the request from the loaded KV (the prompt's last token at most).
    sched_out, _ = step(d)
    assert req.status == RequestStatus.RUNNING
    assert sched_out.num_scheduled_tokens[req.request_id] <= 1


def test_p_tp2_to_d_tp1_reads_each_p_ranks_heads_and_p_waits_for_both(engines):
    """P TP 2 → D TP 1 (4 KV heads): D's one worker reads heads 0-1 from P rank 0 and
    2-3 from P rank 1 (each P rank's whole share, landing at its place in D's block);
    P's lease counts both readers and frees after the second."""
    p, d, p_req, req, load = plan_between(engines, 2, 1)
    assert rows(load) == [(0, 0, (0, 2), (0, 2)), (0, 1, (2, 4), (0, 2))]
    assert d.connector.scheduler.engines["p0"].tp_size == 2
    complete_every_batch(p, d, p_req, req, load)


def test_p_tp1_to_d_tp2_reads_half_of_p_rank0_into_each_d_worker(engines):
    """P TP 1 → D TP 2: each D worker reads its half of P rank 0's heads; P's lease
    (granted expecting its own TP size, 1) waits for both D workers."""
    p, d, p_req, req, load = plan_between(engines, 1, 2)
    assert rows(load) == [(0, 0, (0, 2), (0, 2)), (1, 0, (0, 2), (2, 4))]
    complete_every_batch(p, d, p_req, req, load)


def test_mla_is_read_once_per_d_worker_from_one_p_rank(engines):
    """An MLA model (vLLM reports use_mla; the latent cache is one 'head', the same on
    every rank). P TP 2 → D TP 1: one batch, from P rank 0 only, and P's lease (granted
    expecting 2, its TP size) frees at that one reader's completion. P TP 1 → D TP 2:
    each D worker reads P rank 0's latent cache once."""
    p, d, p_req, req, load = plan_between(engines, 2, 1, model=MLA_MODEL)
    assert d.connector.scheduler.kv_replicated and p.connector.scheduler.kv_replicated
    assert d.connector.scheduler.kv_descriptor["use_mla"] is True
    assert rows(load) == [(0, 0, (0, 1), (0, 1))]
    complete_every_batch(p, d, p_req, req, load)

    p, d, p_req, req, load = plan_between(engines, 1, 2, model=MLA_MODEL)
    assert rows(load) == [(0, 0, (0, 1), (0, 1)), (1, 0, (0, 1), (0, 1))]
    complete_every_batch(p, d, p_req, req, load)


def test_a_tp_size_that_does_not_split_the_heads_is_refused(engines):
    """P TP 8 over the model's 4 KV heads: vLLM replicates heads over P's ranks, which
    no plan of head ranges describes. D's core refuses the request on arrival (P's
    params name its TP size; a P whose handshake says so is refused there too, see
    the next test) and vLLM computes the prompt."""
    p, _ = engines("kv_producer", "p0", tp_size=8)
    d, _ = engines("kv_consumer", "d0", tp_size=1)
    p_req, params = prefill_on_p(p)
    req = request_from(params, p_req)
    d.add_request(req)
    deadline = time.monotonic() + 30
    while True:
        assert time.monotonic() < deadline, "D never scheduled the request"
        sched_out, _ = step(d)
        assert not sched_out.kv_connector_metadata.loads
        if req.request_id in sched_out.num_scheduled_tokens:
            break
        time.sleep(0.01)
    assert d.connector.scheduler.decode.stats()["refused"] == 1
    assert sched_out.num_scheduled_tokens[req.request_id] == len(req.prompt_token_ids)


def test_layer_formats_may_differ_only_in_heads_by_the_tp_ratio():
    base = {
        "model": "m", "dtype": "torch.float16", "cache_dtype": "auto", "num_kv_heads": 4,
        "head_size": 16, "num_layers": 1, "block_size": 16, "block_order": "NHC",
        "kv_cache_layout": "LBNHC", "use_mla": False,
    }
    four = ["float16", [4, 16, 32], [2, 1, 3], "HNC", "FLASH_ATTN"]
    two = ["float16", [2, 16, 32], [2, 1, 3], "HNC", "FLASH_ATTN"]
    one = ["float16", [1, 16, 32], [2, 3], "HNC", "FLASH_ATTN"]  # a size-1 dim is left out of the order
    d1, p2 = dict(base, layers={"l0": four}), dict(base, layers={"l0": two})
    assert _kv_incompatibility(d1, p2, d_tp=1, p_tp=2) is None
    assert _kv_incompatibility(p2, d1, d_tp=2, p_tp=1) is None
    assert _kv_incompatibility(d1, dict(base, layers={"l0": one}), d_tp=1, p_tp=4) is None
    # Equal TP sizes: the formats must be equal.
    assert "store a block differently" in _kv_incompatibility(d1, p2)
    # Heads that do not match the ratio, or another order, are refused.
    why = _kv_incompatibility(d1, p2, d_tp=1, p_tp=4)
    assert "heads per worker: P 1, D 4" in why, why
    hnc = dict(base, layers={"l0": ["float16", [2, 16, 32], [1, 2, 3], "HNC", "FLASH_ATTN"]})
    assert "store a block differently" in _kv_incompatibility(d1, hnc, d_tp=1, p_tp=2)
    assert "tp_size: P 8, D 1" in _kv_incompatibility(d1, p2, d_tp=1, p_tp=8)
    # MLA: one latent "head" on every rank, whatever the TP sizes.
    mla = dict(base, use_mla=True, layers={"l0": ["float16", [1, 16, 24], [2, 3], "HNC", "FLASH_ATTN"]})
    assert _kv_incompatibility(mla, mla, d_tp=1, p_tp=8) is None


@pytest.mark.parametrize("layout", ["NHC", "HNC"])
def test_head_runs_copy_exactly_the_planned_heads(layout):
    """The worker's byte runs for a batch's heads, applied to real [B, H, N, C] views in
    both block orders (tokens outermost, NHC: a run per token; heads outermost, HNC: one
    run), land P's heads at D's heads and touch nothing else: P TP 2 → D TP 1 (two P
    ranks into one D block) and P TP 1 → D TP 2 (one P block split over two D ranks)."""
    import torch

    from kvlease.vllm.layout import layer_format, selection, sub_block_runs

    def view(heads, seed):
        data = torch.randn(3, 16, heads, 32, generator=torch.Generator().manual_seed(seed))
        data = data.to(torch.float16)
        return data.permute(0, 2, 1, 3) if layout == "NHC" else data.transpose(1, 2) \
            .contiguous().view(3, heads, 16, 32)

    def storage(t):
        return bytearray(t.untyped_storage())

    def from_storage(buf, like):
        flat = torch.frombuffer(buf, dtype=torch.float16)
        return flat.as_strided(like.shape, like.stride())

    def copy(d, p, local, remote):
        d_buf, p_buf = storage(d), storage(p)
        d_page, p_page = d[0].numel() * 2, p[0].numel() * 2
        d_fmt = layer_format(d, "FLASH_ATTN", "auto")
        p_fmt = layer_format(p, "FLASH_ATTN", "auto")
        runs = sub_block_runs((d_fmt, d_page), (p_fmt, p_page),
                              selection(d_fmt, heads=local), selection(p_fmt, heads=remote))
        assert len(runs) == (16 if layout == "NHC" else 1)
        for block in range(3):
            for lo, ro, n in runs:
                dl, pl = block * d.stride(0) * 2 + lo, block * p.stride(0) * 2 + ro
                d_buf[dl:dl + n] = p_buf[pl:pl + n]
        return from_storage(d_buf, d)

    d = torch.zeros_like(view(4, 0))
    p0, p1 = view(2, 1), view(2, 2)
    d = copy(d, p0, (0, 2), (0, 2))
    d = copy(d, p1, (2, 4), (0, 2))
    assert torch.equal(d[:, :2], p0) and torch.equal(d[:, 2:], p1)

    p = view(4, 3)
    for rank in range(2):
        d = copy(torch.zeros_like(view(2, 0)), p, (0, 2), (2 * rank, 2 * rank + 2))
        assert torch.equal(d, p[:, 2 * rank:2 * rank + 2])
