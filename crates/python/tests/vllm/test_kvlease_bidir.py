"""Bidirectional multi-turn (``bidirectional_kv_xfer``) in vLLM's real ``Scheduler``: the
engine that decoded a turn holds its blocks (``decoder_kv_blocks_ttl``) and answers with
a turn's ``kv_transfer_params``; the next turn's P reads back the prefix whose hashes
match its prompt, heartbeating the hold while it waits (the symmetric lease), and the
holder frees the blocks at P's read completion, abort, or the hold's end. Both engines
are ``kv_both``; no worker runs here (batches are reported as the workers would)."""

from __future__ import annotations

import logging
import time

import pytest
from sched_harness import (
    assert_scheduler_empty,
    create_request,
    create_scheduler,
    create_vllm_config,
    step,
)
from test_kvlease_scheduler import (
    TOKEN,
    FakeClock,
    feed,
    heartbeats,
    prefill_on_p,
    request_from,
    wait_for_handshake,
    worker_output,
)
from vllm.v1.request import RequestStatus

from kvlease import ConfigError, ConnectError, InvalidArgument
from kvlease import _kvlease as native

LEASE = 6.0
TTL = 60.0  # decoder_kv_blocks_ttl: heartbeats every TTL/6, each extending by 2/3 TTL
P_WORKER, D_WORKER = "p0#0", "d0#0"


def bidir_scheduler(engine_id: str, *, threshold: int = 16, symmetric: bool = True,
                    role: str = "kv_both"):
    config = create_vllm_config(
        kv_connector="KvleaseConnector", kv_connector_module_path="kvlease.vllm",
        kv_role=role, engine_id=engine_id,
        kv_connector_extra_config={
            "kv_lease_duration": LEASE, "cluster_token": TOKEN, "transport": "tcp",
            "bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": TTL,
            "kv_recompute_threshold": threshold, "symmetric_decoder_lease": symmetric,
            "pull_safety_margin": 1.0,
        },
    )
    scheduler = create_scheduler(config, num_blocks=64)
    clock = FakeClock()
    scheduler.connector.scheduler.clock = clock
    return scheduler, clock


@pytest.fixture
def pair():
    made = []

    def make(**kwargs):
        p, p_clock = bidir_scheduler("p0", **kwargs)
        d, d_clock = bidir_scheduler("d0", **kwargs)
        made.extend([p, d])
        return p, p_clock, d, d_clock

    yield make
    for s in made:
        s.connector.shutdown()


#: Turn 1: P prefills a 40-token prompt, D decodes this many tokens: the turn holds 69
#: tokens (4 whole blocks of 16), of which P's own prefix cache has the first 2 blocks
#: (the prompt it prefilled): the next turn reads blocks 2 and 3 back from D.
ANSWER = 30
TURN_TOKENS = 40 + ANSWER - 1


def turn_one(p, d):
    """Turn 1: P prefills 40 tokens, D loads them and decodes ``ANSWER`` tokens. Returns
    D's request and the turn's params D answered with (its hold)."""
    p_req, params = prefill_on_p(p)
    req = create_request(prompt_token_ids=p_req.prompt_token_ids, max_tokens=ANSWER,
                         kv_transfer_params=dict(params))
    d.add_request(req)
    (load,) = [x for meta in wait_for_handshake(d, req) for x in meta.loads]
    feed(d, worker_output(batches={req.request_id: {0: ("done", 1024, None)}},
                          finished_recving={req.request_id}))
    # P learns of the read: its lease ends.
    feed(p, worker_output(notifs=[(D_WORKER, load.batches[0].notif)]))
    turn = None
    for _ in range(ANSWER + 5):
        _, out = step(d)
        for o in (out.get(0).outputs if out else []):
            if o.request_id == req.request_id and o.finish_reason is not None:
                turn = o.kv_transfer_params
        if turn is not None:
            break
    assert turn is not None, "D's turn ended without params"
    return req, turn


def next_prompt(req, extra: int = 20) -> list[int]:
    """The conversation's next prompt: everything of the turn, then the user's new tokens."""
    return list(req.all_token_ids) + [40000 + i for i in range(extra)]


def test_d_holds_its_turn_and_answers_with_a_turn_any_proxy_passes_along(pair):
    p, _, d, _ = pair()
    req, turn = turn_one(p, d)
    assert turn["kvlease_bidir"] is True and turn["do_remote_decode"] is True
    assert turn["do_remote_prefill"] is False
    assert turn["remote_engine_id"] == "d0" and turn["remote_request_id"] == req.request_id
    # The blocks hold every token D computed: the prompt and all but the last sampled.
    assert turn["kvlease_num_tokens"] == req.num_computed_tokens == TURN_TOKENS
    assert turn["remote_num_tokens"] == turn["kvlease_num_tokens"]
    assert len(turn["kvlease_block_hashes"]) == TURN_TOKENS // 16
    assert len(turn["remote_block_ids"]) == -(-TURN_TOKENS // 16)
    assert turn["kvlease_ttl_remaining_ms"] == TTL * 1000
    assert turn["kvlease_renew_extension_ms"] == round(2 * TTL / 3 * 1000)
    assert turn["remote_blocks_expiry_time"] > time.perf_counter()
    hold = d.connector.scheduler.prefill.hold(req.request_id)
    assert hold is not None and hold["generation"] == turn["kvlease_generation"]
    # The generation is in D's fence words (here: the scheduler's own view) before the
    # answer leaves: D's blocks stay allocated (vLLM frees them at finished_sending).
    assert not [rid for meta in [step(d, output_for=[])[0].kv_connector_metadata]
                for rid in meta.finished_sending]


def test_p_reads_the_turns_prefix_back_heartbeating_the_hold_past_its_ttl(pair):
    p, p_clock, d, d_clock = pair()
    req, turn = turn_one(p, d)
    prompt = next_prompt(req)
    nxt = create_request(prompt_token_ids=prompt, max_tokens=1,
                         kv_transfer_params=dict(turn))
    p.add_request(nxt)
    metas = wait_for_handshake(p, nxt)
    (load,) = [x for meta in metas for x in meta.loads]
    whole = TURN_TOKENS // 16
    assert load.engine == "d0" and load.remote_request == req.request_id
    # P's own prefix cache holds the prompt it prefilled (2 blocks): D's next 2 are read.
    assert load.remote_blocks == turn["remote_block_ids"][2:whole]
    assert len(load.local_blocks) == whole - 2
    assert load.generation == turn["kvlease_generation"]
    # P waits longer than the hold's TTL: its heartbeats to D keep the hold alive.
    sent = [hb for meta in metas for hb in heartbeats(meta, "d0")]
    for _ in range(int(1.5 * TTL / 5)):
        p_clock.advance(5)
        d_clock.advance(5)
        sched_out, _ = step(p, output_for=[])
        assert nxt.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        beats = heartbeats(sched_out.kv_connector_metadata, "d0")
        sent += beats
        feed(d, worker_output(notifs=[(P_WORKER, hb) for hb in beats]))
    assert sent and all(req.request_id.encode() in hb for hb in sent)
    hold = d.connector.scheduler.prefill.hold(req.request_id)
    assert hold is not None and hold["expiry"] > d_clock(), "the hold expired under P's heartbeats"
    # The read ends: P computes only the rest of its prompt.
    feed(p, worker_output(batches={nxt.request_id: {0: ("done", 1024, None)}},
                          finished_recving={nxt.request_id}))
    sched_out, _ = step(p)
    assert sched_out.num_scheduled_tokens[nxt.request_id] == len(prompt) - whole * 16
    # D frees its blocks at P's read completion.
    feed(d, worker_output(notifs=[(P_WORKER, load.batches[0].notif)]))
    assert d.connector.scheduler.prefill.hold(req.request_id) is None
    sched_out = feed(d, worker_output())
    assert req.request_id in sched_out.kv_connector_metadata.finished_sending
    stats = d.connector.scheduler.prefill.stats()
    assert (stats["holds_granted"], stats["holds_released_completed"]) == (1, 1)


def test_a_turn_read_after_the_hold_ended_is_fenced_and_p_recomputes(pair):
    """The client took longer than the TTL and nobody heartbeated: D frees the blocks; P's
    read of them is stale (the fence), never loaded, and P computes the whole prompt."""
    p, p_clock, d, d_clock = pair()
    req, turn = turn_one(p, d)
    d_clock.advance(TTL + 1)
    sched_out = feed(d, worker_output())
    assert req.request_id in sched_out.kv_connector_metadata.finished_sending
    assert d.connector.scheduler.prefill.stats()["holds_released_expired"] == 1
    nxt = create_request(prompt_token_ids=next_prompt(req), max_tokens=1,
                         kv_transfer_params=dict(turn))
    p.add_request(nxt)
    metas = wait_for_handshake(p, nxt)
    (load,) = [x for meta in metas for x in meta.loads]
    (d_block,) = load.local_blocks[:1] or [None]
    feed(p, worker_output(batches={nxt.request_id: {0: ("stale", 0, "fence changed")}},
                          finished_recving={nxt.request_id},
                          invalid_block_ids=set(load.local_blocks)))
    sched_out, _ = step(p)
    assert d_block is not None
    # Recomputed after P's own cached prefix (kv_load_failure_policy recompute): nothing
    # of the stale read is used.
    assert sched_out.num_scheduled_tokens[nxt.request_id] == len(nxt.prompt_token_ids) - 32


def computed_and_aborted(p, nxt):
    """Steps P until it computes ``nxt`` and aborts the hold it named on D: the tokens it
    first scheduled, the aborts it sent, and every load it planned meanwhile."""
    deadline = time.monotonic() + 30
    aborts, loads, scheduled = [], [], 0
    while not (scheduled and aborts):
        assert time.monotonic() < deadline, "P never computed the turn or aborted the hold"
        meta = (sched_out := step(p)[0]).kv_connector_metadata
        scheduled = scheduled or sched_out.num_scheduled_tokens.get(nxt.request_id, 0)
        aborts += [m for e, kind, m in meta.transmits if kind == "abort" and e == "d0"]
        loads += list(meta.loads)
        time.sleep(0.01)
    return scheduled, aborts, loads


@pytest.mark.parametrize("case", ["diverged", "below_threshold"])
def test_a_turn_p_does_not_read_is_aborted_so_d_frees_it_at_once(pair, case, caplog):
    caplog.set_level(logging.INFO, logger="kvlease")
    p, _, d, _ = pair(threshold=32 if case == "below_threshold" else 16)
    req, turn = turn_one(p, d)
    prompt = next_prompt(req)
    if case == "diverged":
        prompt[3] += 1  # the conversation was edited: no whole block matches
    else:
        # One whole block in common: 16 tokens, below the threshold of 32.
        prompt = prompt[:20] + [45000 + i for i in range(30)]
    nxt = create_request(prompt_token_ids=prompt, max_tokens=1,
                         kv_transfer_params=dict(turn))
    p.add_request(nxt)
    scheduled, aborts, _ = computed_and_aborted(p, nxt)
    # P computes the prompt after its own cached prefix (the edit at token 3 leaves none),
    # in chunks of at most 64 tokens; nothing is read.
    cached = 0 if case == "diverged" else 16
    assert scheduled == min(64, len(prompt) - cached)
    feed(d, worker_output(notifs=[(P_WORKER, m) for m in aborts]))
    assert d.connector.scheduler.prefill.hold(req.request_id) is None
    assert d.connector.scheduler.prefill.stats()["holds_released_aborted"] == 1
    reason = "no_common_block" if case == "diverged" else "below_threshold"
    assert f"computing its held turn ({reason})" in caplog.text


def test_bidirectional_mode_needs_kv_both():
    with pytest.raises(ConfigError, match="kv_both"):
        bidir_scheduler("p0", role="kv_producer")


def test_without_bidirectional_mode_d_frees_its_turn_at_once(engines_plain):
    p, d = engines_plain
    p_req, params = prefill_on_p(p)
    req = request_from(params, p_req)
    d.add_request(req)
    wait_for_handshake(d, req)
    feed(d, worker_output(batches={req.request_id: {0: ("done", 1024, None)}},
                          finished_recving={req.request_id}))
    for _ in range(5):
        _, out = step(d)
    step(d, use_eos=True)
    assert d.connector.scheduler.prefill is None or d.connector.scheduler.prefill.hold(
        req.request_id) is None
    step(d, output_for=[])
    assert_scheduler_empty(d)


@pytest.fixture
def engines_plain(engines):  # noqa: F811 (the scheduler tests' fixture)
    p, _ = engines("kv_producer", "p0")
    d, _ = engines("kv_consumer", "d0")
    return p, d


from test_kvlease_scheduler import engines  # noqa: E402,F401 (a fixture)


def wait_for_offset(p, turn) -> object:
    """P's measured offset of the holder's clock (its first turn starts the probe)."""
    sched = p.connector.scheduler
    params = native.KvTransferParams.from_turn_dict(turn)
    deadline = time.monotonic() + 10
    while (offset := sched._clock_offset(params)) is None:
        assert time.monotonic() < deadline, "the clock probe never answered"
        time.sleep(0.01)
    return offset


def test_d_serves_its_clock_and_p_reads_the_deadline_on_it(pair):
    """The turn names D's clock probe; P measures D's clock once (in the background) and
    from then on reads the turn's deadline on D's clock: a turn whose deadline has passed
    there is computed, whatever time left it announced."""
    p, _, d, _ = pair()
    req, turn = turn_one(p, d)
    probe = d.connector.scheduler.clock_probe
    assert probe is not None and turn["kvlease_clock_port"] == probe.port
    offset = wait_for_offset(p, turn)
    # One host, one clock: the offset is within its own error bound of 0.
    assert abs(offset.offset_ns) <= offset.rtt_ns / 2 + 1_000_000
    late = dict(turn, kvlease_deadline_ns=time.time_ns() - 1_000_000_000)
    nxt = create_request(prompt_token_ids=next_prompt(req), max_tokens=1,
                         kv_transfer_params=late)
    p.add_request(nxt)
    _, aborts, loads = computed_and_aborted(p, nxt)
    assert not loads, "P read a turn whose deadline had passed on D's clock"
    feed(d, worker_output(notifs=[(P_WORKER, m) for m in aborts]))
    assert d.connector.scheduler.prefill.stats()["holds_released_aborted"] == 1


def test_a_skewed_clock_is_measured_and_a_deadline_read_on_it():
    """The binding's probe measures an injected skew within the sample's error bound, and
    ``plan_pull`` reads a holder's deadline through the offset: 30 s left on a clock 10 s
    ahead of ours is 30 s left here, and a deadline 10 s ahead of our clock on a clock
    10 s ahead has already passed."""
    for skew_ms in (-10_000, 10_000):
        server = native.ClockProbeServer("127.0.0.1:0", test_skew_ms=skew_ms)
        try:
            offset = native.probe_clock("127.0.0.1", server.port, samples=8)
        finally:
            server.close()
        err = offset.offset_ns - skew_ms * 1_000_000
        assert abs(err) <= offset.rtt_ns / 2 + 1_000_000, (skew_ms, offset)
    server = native.ClockProbeServer("127.0.0.1:0", test_skew_ms=10_000)
    offset = native.probe_clock("127.0.0.1", server.port)
    server.close()
    tokens = list(range(64))
    ahead = time.time_ns() + 10_000_000_000  # our clock + 10 s
    for deadline_ns, pulls in ((ahead + 30_000_000_000, True), (ahead, False)):
        turn = native.KvTransferParams.turn(
            remote_engine_id="d0", remote_request_id="r1", remote_block_ids=[1, 2, 3, 4],
            remote_host="127.0.0.1", remote_port=1, tp_size=1, kvlease_generation=7,
            kvlease_num_tokens=64, kvlease_block_size=16,
            kvlease_block_hashes=native.block_hashes(tokens, 16),
            kvlease_deadline_ns=deadline_ns, kvlease_ttl_remaining_ms=60_000,
            kvlease_clock_port=server.port,
        )
        plan = turn.plan_pull(tokens + [9], 16, time.monotonic(), threshold_tokens=16,
                              safety_margin=1.0, received_at=time.monotonic(),
                              clock_offset=offset)
        assert plan.pull is pulls, (deadline_ns, plan.reason)
        if not pulls:
            assert plan.reason == "deadline_too_close"
        # Without the offset the time left decides (60 s): a pull either way.
        assert turn.plan_pull(tokens + [9], 16, time.monotonic(), threshold_tokens=16,
                              safety_margin=1.0, received_at=time.monotonic()).pull


def test_a_probe_to_nothing_is_a_connect_error():
    with pytest.raises(ConnectError):
        native.probe_clock("127.0.0.1", 1, samples=1)
    with pytest.raises(InvalidArgument):
        native.probe_clock("127.0.0.1", 1, samples=0)
