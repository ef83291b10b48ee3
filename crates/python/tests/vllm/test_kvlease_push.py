"""Push mode (``KvleasePushConnector``) inside vLLM 0.33.0's real ``Scheduler``: P and D
schedulers in this process, the workers' part played by the test (as in
``test_kvlease_scheduler.py``): what D's scheduler asks its workers to send P (the peer
message and the registration) is handed to P's scheduler verbatim as its workers would
forward it, and back. Both handshakes are real (D fetches P's engine info, P fetches D's,
over the side channels with the cluster token). Virtual clocks."""

from __future__ import annotations

import time

import pytest
from sched_harness import (
    assert_scheduler_empty,
    create_request,
    create_scheduler,
    create_vllm_config,
    step,
)
from test_kvlease_scheduler import FakeClock, feed, prefill_on_p, wait_for_handshake
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from kvlease import ConfigError
from kvlease.vllm.metadata import KvleaseWorkerMetadata, WriteOutcome
from kvlease.vllm.push import parse

TOKEN = "push-scheduler-test-token"
LEASE = 6.0  # heartbeats every 1 s
P_WORKER, D_WORKER = "p0#0", "d0#0"


def push_scheduler(role: str, engine_id: str, connector: str = "KvleasePushConnector",
                   **extra):
    config = create_vllm_config(
        kv_connector=connector, kv_connector_module_path="kvlease.vllm", kv_role=role,
        engine_id=engine_id,
        kv_connector_extra_config={"kv_lease_duration": LEASE, "cluster_token": TOKEN,
                                   **extra},
    )
    scheduler = create_scheduler(config, num_blocks=64)
    clock = FakeClock()
    scheduler.connector.scheduler.clock = clock
    return scheduler, clock


@pytest.fixture
def pd():
    made = []

    def make():
        p, p_clock = push_scheduler("kv_producer", "p0", connector="KvleaseConnector",
                                    transfer_mode="push")
        d, d_clock = push_scheduler("kv_consumer", "d0")
        made.extend([p, d])
        return p, p_clock, d, d_clock

    yield make
    for s in made:
        s.connector.shutdown()


def proxy_leg(params: dict, prompt_of) -> object:
    """D's leg as vLLM's push proxy sends it: P's coordinates, no block ids."""
    keys = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size")
    return create_request(
        prompt_token_ids=prompt_of.prompt_token_ids, max_tokens=3,
        kv_transfer_params={"do_remote_prefill": True, "do_remote_decode": False,
                            **{k: params[k] for k in keys}},
    )


def out(notifs=(), writes=None, **kwargs) -> KVConnectorOutput:
    return KVConnectorOutput(
        kv_connector_worker_meta=KvleaseWorkerMetadata(notifs=list(notifs),
                                                       writes=writes or {}),
        **kwargs)


def reserved(d, req):
    """Steps D until its request waits for P's write; its ``ReserveSpec``."""
    metas = wait_for_handshake(d, req)
    metas.append(step(d, output_for=[])[0].kv_connector_metadata)
    specs = [r for m in metas for r in m.reserves]
    assert len(specs) == 1, specs
    return specs[0]


def until(scheduler, what, limit_s: float = 30.0):
    """Steps ``scheduler`` (nothing runs) until ``what(meta)`` is true; returns it."""
    deadline = time.monotonic() + limit_s
    while True:
        meta = feed(scheduler, out()).kv_connector_metadata
        got = what(meta)
        if got:
            return got
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def test_push_is_selected_by_class_or_extra_config_and_pull_stays_the_default():
    for connector, extra, mode in [("KvleaseConnector", {}, "pull"),
                                   ("KvleasePushConnector", {}, "push"),
                                   ("KvleaseConnector", {"transfer_mode": "push"}, "push")]:
        s, _ = push_scheduler("kv_both", "e0", connector=connector, **extra)
        try:
            assert s.connector.config.transfer_mode == mode
            assert (s.connector.scheduler.push_d is not None) == (mode == "push")
        finally:
            s.connector.shutdown()
    for extra in ({"transfer_mode": "pull"}, {"transport": "verbs"}, {"transfer_mode": "x"}):
        with pytest.raises(ConfigError):
            push_scheduler("kv_both", "e1", **extra)


def test_d_reserves_registers_p_writes_into_its_blocks_and_d_decodes(pd):
    p, p_clock, d, d_clock = pd()
    p_req, params = prefill_on_p(p, num_tokens=40)
    assert params["transfer_mode"] == "push" and params["remote_request_id"] == p_req.request_id
    # P keeps its blocks (vLLM delays freeing them) until the push ends.
    assert p_req.request_id in p.requests
    req = proxy_leg(params, p_req)
    d.add_request(req)
    spec = reserved(d, req)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert spec.engine == "p0" and len(spec.blocks) == 3  # 40 tokens, blocks of 16
    peer, register = (parse(m) for m in spec.messages)
    assert peer.kind == "peer" and peer.peer[0] == "d0"
    assert (register.kind, register.transfer, register.blocks) == (
        "register", p_req.request_id, tuple(spec.blocks))
    assert register.generation == spec.generation and register.lease_ms == LEASE * 1000

    # P takes the registration, fetches D's engine info and plans the write.
    feed(p, out(notifs=[(D_WORKER, m) for m in spec.messages]))
    (write,) = until(p, lambda m: m.writes)
    assert write.engine == "d0" and write.generation == spec.generation
    assert write.remote_blocks == spec.blocks and len(write.local_blocks) == 3
    assert write.fence_block == spec.blocks[-1]
    # While the write is in flight, P heartbeats D's reservation.
    p_clock.advance(LEASE / 6 + 0.01)
    beats = until(p, lambda m: [t for t in m.transmits if t.kind == "push_heartbeat"])
    assert parse(beats[0].message).transfers == (p_req.request_id,)
    # The write landed: write-done to D, and P frees its blocks.
    meta = feed(p, out(writes={write.transfer: [WriteOutcome(write.generation, True, None)]}))
    meta = feed(p, out()).kv_connector_metadata
    done = [t for t in meta.transmits if t.kind == "write_done"]
    assert done and done[0].engine == "d0"
    assert p_req.request_id in meta.finished_sending
    feed(p, KVConnectorOutput(finished_sending={p_req.request_id}))
    assert_scheduler_empty(p)

    # D takes the heartbeat and the write-done: the reservation ends written; its workers
    # clear the fence and report the request received; it decodes.
    d_clock.advance(1.0)
    feed(d, out(notifs=[(P_WORKER, beats[0].message), (P_WORKER, done[0].message)]))
    meta = feed(d, out()).kv_connector_metadata
    (end,) = meta.reservation_ends
    assert (end.request, end.outcome, end.blocks) == (req.request_id, "written", spec.blocks)
    assert not meta.transmits  # nothing to tell P
    feed(d, KVConnectorOutput(finished_recving={req.request_id}))
    for _ in range(6):
        step(d)
    assert req.is_finished()
    assert_scheduler_empty(d)


def test_no_heartbeat_within_the_lease_expires_the_reservation_and_d_recomputes(pd):
    p, _, d, d_clock = pd()
    p_req, params = prefill_on_p(p, num_tokens=40)
    req = proxy_leg(params, p_req)
    d.add_request(req)
    spec = reserved(d, req)
    # P died: no heartbeat, no write. Just before the lease nothing happens ...
    d_clock.advance(LEASE - 0.1)
    assert not feed(d, out()).kv_connector_metadata.reservation_ends
    # ... then the reaper ends the reservation, tells P, and the load fails.
    d_clock.advance(0.2)
    meta = feed(d, out()).kv_connector_metadata
    (end,) = meta.reservation_ends
    assert (end.request, end.outcome) == (req.request_id, "expired")
    (rr,) = [t for t in meta.transmits if t.kind == "release"]
    assert parse(rr.message).kind == "released" and parse(rr.message).generation == spec.generation
    feed(d, KVConnectorOutput(finished_recving={req.request_id},
                              invalid_block_ids=set(end.blocks)))
    for _ in range(8):
        step(d)
    assert req.is_finished(), "D did not recompute the prompt"
    assert_scheduler_empty(d)


def test_an_abort_on_d_clears_the_reservation_and_tells_p_which_frees_at_once(pd):
    p, _, d, _ = pd()
    p_req, params = prefill_on_p(p, num_tokens=40)
    req = proxy_leg(params, p_req)
    d.add_request(req)
    spec = reserved(d, req)
    feed(p, out(notifs=[(D_WORKER, spec.messages[0])]))  # the peer message only

    d.finish_requests([req.request_id], RequestStatus.FINISHED_ABORTED)
    meta = feed(d, out()).kv_connector_metadata
    (end,) = meta.reservation_ends
    assert end.outcome == "aborted"
    (rr,) = [t for t in meta.transmits if t.kind == "release"]
    # vLLM keeps D's blocks until the workers report the request (fence cleared).
    assert req.request_id in d.requests
    feed(d, KVConnectorOutput(finished_recving={req.request_id}))
    assert_scheduler_empty(d)
    # P: the registration and then D's release. A write P planned before it took the
    # release is refused by D's cleared fence (stale); then P frees its blocks.
    feed(p, out(notifs=[(D_WORKER, spec.messages[1]), (D_WORKER, rr.message)]))
    deadline = time.monotonic() + 30
    while True:
        meta = feed(p, out()).kv_connector_metadata
        if p_req.request_id in meta.finished_sending:
            break
        for w in meta.writes:
            assert w.generation == spec.generation
            feed(p, out(writes={w.transfer: [WriteOutcome(w.generation, False, "stale")]}))
        assert time.monotonic() < deadline, "P never freed its blocks"
        time.sleep(0.01)
    assert not [t for t in meta.transmits if t.kind == "write_done"]
    assert p.connector.scheduler.push_p.core.pushing == 0


def both_legs(p, transfer: str, num_tokens: int = 40):
    """P's and D's legs as ``kvlease-proxy --transfer-mode push`` sends them, at once: one
    ``transfer_id``; D's names P's identity (its engine id and side channel), nothing P
    computed."""
    p_req = create_request(num_tokens=num_tokens, max_tokens=1,
                           kv_transfer_params={"do_remote_decode": True,
                                               "transfer_id": transfer})
    sched = p.connector.scheduler
    d_req = create_request(
        prompt_token_ids=p_req.prompt_token_ids, max_tokens=3,
        kv_transfer_params={"do_remote_prefill": True, "do_remote_decode": False,
                            "transfer_mode": "push", "transfer_id": transfer,
                            "remote_engine_id": "p0",
                            "remote_host": sched.config.side_channel_host,
                            "remote_port": sched.side_channel_port, "tp_size": 1},
    )
    return p_req, d_req


def test_both_legs_at_once_d_registers_first_p_heartbeats_while_prefilling_then_writes(pd):
    p, p_clock, d, d_clock = pd()
    # 320 tokens: P prefills them in 5 steps (64 tokens a step), 20 blocks.
    p_req, req = both_legs(p, "tx-1", num_tokens=320)
    # D's leg first: D reserves and registers under the proxy's transfer id before P
    # even has its leg; P holds the lone registration.
    d.add_request(req)
    spec = reserved(d, req)
    register = parse(spec.messages[1])
    assert (register.kind, register.transfer, len(register.blocks)) == ("register", "tx-1", 20)
    feed(p, out(notifs=[(D_WORKER, m) for m in spec.messages]))
    assert not feed(p, out()).kv_connector_metadata.writes  # no leg, no prefill yet
    # P fetches D's engine info (the peer message named D's side channel).
    until(p, lambda m: "d0" in p.connector.scheduler.engines)

    # P's leg arrives; while it prefills (4 steps, 3.9 s apart: 15.6 s, past D's 6 s
    # lease), P renews D's reservation by the transfer id, and D keeps it.
    p.add_request(p_req)
    for _ in range(4):
        p_clock.advance(3.9)
        d_clock.advance(3.9)
        sched_out, _ = step(p)
        beats = [t for t in sched_out.kv_connector_metadata.transmits
                 if t.kind == "push_heartbeat"]
        assert [parse(b.message).transfers for b in beats] == [("tx-1",)]
        assert not p_req.is_finished() and not sched_out.kv_connector_metadata.writes
        meta = feed(d, out(notifs=[(P_WORKER, b.message) for b in beats])).kv_connector_metadata
        assert not meta.reservation_ends, "D's reservation ended while P heartbeated it"

    # The prefill ends: P writes at once into D's blocks (the registration was there).
    step(p)
    assert p_req.is_finished()
    (write,) = until(p, lambda m: m.writes)
    assert (write.transfer, write.engine, write.generation) == ("tx-1", "d0", spec.generation)
    assert write.remote_blocks == spec.blocks and len(write.local_blocks) == 20
    feed(p, out(writes={write.transfer: [WriteOutcome(write.generation, True, None)]}))
    meta = feed(p, out()).kv_connector_metadata
    (done,) = [t for t in meta.transmits if t.kind == "write_done"]
    assert p_req.request_id in meta.finished_sending
    feed(p, KVConnectorOutput(finished_sending={p_req.request_id}))
    assert_scheduler_empty(p)
    feed(d, out(notifs=[(P_WORKER, done.message)]))
    (end,) = feed(d, out()).kv_connector_metadata.reservation_ends
    assert (end.request, end.outcome) == (req.request_id, "written")


def test_p_leg_aborted_before_its_prefill_ends_tells_d_at_once_and_writes_nothing(pd):
    p, _, d, _ = pd()
    p_req, req = both_legs(p, "tx-2", num_tokens=320)
    p.add_request(p_req)
    step(p)  # the first 64 of 320 tokens
    d.add_request(req)
    spec = reserved(d, req)
    feed(p, out(notifs=[(D_WORKER, m) for m in spec.messages]))
    # The client went away on P's side: its leg is aborted before the prefill ended.
    assert not p_req.is_finished()
    p.finish_requests([p_req.request_id], RequestStatus.FINISHED_ABORTED)
    (failed,) = until(p, lambda m: [t for t in m.transmits if t.kind == "push_failed"])
    assert failed.engine == "d0"
    assert (parse(failed.message).transfer, parse(failed.message).generation) == (
        "tx-2", spec.generation)
    assert p.connector.scheduler.push_p.core.pushing == 0
    assert_scheduler_empty(p)
    # D frees the reservation at once (not after its lease) and recomputes.
    feed(d, out(notifs=[(P_WORKER, failed.message)]))
    meta = feed(d, out()).kv_connector_metadata
    (end,) = meta.reservation_ends
    assert (end.request, end.outcome) == (req.request_id, "failed")
    feed(d, KVConnectorOutput(finished_recving={req.request_id},
                              invalid_block_ids=set(end.blocks)))
    for _ in range(12):
        step(d)
    assert req.is_finished(), "D did not recompute the prompt"
    assert_scheduler_empty(d)


def test_a_registration_whose_p_leg_never_comes_is_dropped_and_d_told(pd):
    p, p_clock, d, _ = pd()
    _, req = both_legs(p, "tx-3")
    d.add_request(req)
    spec = reserved(d, req)
    feed(p, out(notifs=[(D_WORKER, m) for m in spec.messages]))
    p_clock.advance(LEASE - 0.1)  # the registration wait: one lease duration
    assert not [t for t in feed(p, out()).kv_connector_metadata.transmits
                if t.kind == "push_failed"]
    p_clock.advance(0.2)
    (failed,) = until(p, lambda m: [t for t in m.transmits if t.kind == "push_failed"])
    assert parse(failed.message).transfer == "tx-3" and failed.engine == "d0"


def test_p_defers_heartbeats_to_a_d_whose_engine_info_it_is_still_fetching():
    """A heartbeat the workers could not send (no link to D yet) is not handed to them;
    once D's engine info is known, the next interval's goes out."""
    from kvlease.vllm.push import PushPrefill

    class Counters(dict):
        def add(self, name, n=1):
            self[name] = self.get(name, 0) + n

    counters = Counters()
    push = PushPrefill(lease_duration=LEASE, tp_size=1, counters=counters)
    assert push.admit(0.0, "p-req", "tx-9")
    push.handle(0.0, "d0", parse(b"KVL1:PR:tx-9;5;6000;1,2"))
    push.step(LEASE / 6 + 0.01, engines={}, failed={})
    assert not push.transmits and counters["push_heartbeats_deferred"] == 1
    push.step(2 * LEASE / 6 + 0.02, engines={"d0": object()}, failed={})
    (beat,) = push.transmits
    assert (beat.engine, beat.kind, parse(beat.message).transfers) == (
        "d0", "push_heartbeat", ("tx-9",))


def vllm_proxy_legs(p, x_request_id: str, p_tokens: list[int], d_tokens: list[int]):
    """P's and D's legs as vLLM's own push proxy sends them, at once: no transfer id; one
    ``X-Request-Id`` for both, from which vLLM's API server makes each engine's request
    id (``cmpl-<it>-0`` and a random suffix); D's names P by its engine id and side
    channel and names the proxy's id as ``remote_request_id``."""
    sched = p.connector.scheduler
    p_req = create_request(request_id=f"cmpl-{x_request_id}-0-1a2b3c4d",
                           prompt_token_ids=p_tokens, max_tokens=1,
                           kv_transfer_params={"do_remote_decode": True,
                                               "do_remote_prefill": False,
                                               "remote_engine_id": None,
                                               "remote_block_ids": None})
    d_req = create_request(
        request_id=f"cmpl-{x_request_id}-0-9f8e7d6c", prompt_token_ids=d_tokens, max_tokens=3,
        kv_transfer_params={"do_remote_decode": False, "do_remote_prefill": True,
                            "remote_engine_id": "p0",
                            "remote_host": sched.config.side_channel_host,
                            "remote_port": sched.side_channel_port, "tp_size": 1,
                            "pp_size": 1, "remote_request_id": x_request_id},
    )
    return p_req, d_req


def test_vllm_push_proxy_legs_match_by_request_id_and_p_writes(pd):
    """vLLM's push proxy gives no transfer id: the legs match by vLLM's request id without
    its random suffix (as NixlPushConnector matches), and the prompt digests agree."""
    from kvlease.vllm.push import d_transfer, p_transfer

    p, _, d, _ = pd()
    tokens = [(7000 + i) % 50000 + 3 for i in range(40)]
    p_req, req = vllm_proxy_legs(p, "8c1f5e2a-4b7d-4f0e-9a3c-2d6b8e1f0a57", tokens, tokens)
    key = "cmpl-8c1f5e2a-4b7d-4f0e-9a3c-2d6b8e1f0a57-0"
    assert p_transfer(p_req.kv_transfer_params, p_req.request_id) == key
    assert d_transfer(req.kv_transfer_params, req.request_id) == key
    p.add_request(p_req)
    d.add_request(req)
    spec = reserved(d, req)
    register = parse(spec.messages[1])
    assert register.transfer == key and register.prompt and len(register.prompt) == 32
    feed(p, out(notifs=[(D_WORKER, m) for m in spec.messages]))
    # P prefills (each step schedules it) and writes once it knows D's engine info.
    writes = []

    def written(meta):
        writes.extend(meta.writes)
        return writes if p_req.is_finished() else None

    (write,) = until(p, written)
    assert (write.transfer, write.engine, write.generation) == (key, "d0", spec.generation)
    assert write.remote_blocks == spec.blocks
    feed(p, out(writes={write.transfer: [WriteOutcome(write.generation, True, None)]}))
    (done,) = [t for t in feed(p, out()).kv_connector_metadata.transmits
               if t.kind == "write_done"]
    feed(d, out(notifs=[(P_WORKER, done.message)]))
    (end,) = feed(d, out()).kv_connector_metadata.reservation_ends
    assert (end.request, end.outcome) == (req.request_id, "written")


@pytest.mark.parametrize("d_first", [True, False], ids=["d-registers-first", "p-leg-first"])
def test_a_repeated_request_id_with_another_prompt_is_never_written(pd, d_first):
    """A client can repeat an ``X-Request-Id``: two requests with one id but different
    prompts match by id, and P would write one prompt's KV into the other's blocks (a
    wrong token). Their prompt digests differ: P answers push-failed and writes nothing,
    in either order, and D computes the prompt."""
    p, _, d, _ = pd()
    p_tokens = [(8000 + i) % 50000 + 3 for i in range(40)]
    d_tokens = [(9000 + i) % 50000 + 3 for i in range(40)]
    p_req, req = vllm_proxy_legs(p, "repeated-id", p_tokens, d_tokens)
    if not d_first:
        p.add_request(p_req)
        step(p)
    d.add_request(req)
    spec = reserved(d, req)
    feed(p, out(notifs=[(D_WORKER, m) for m in spec.messages]))
    if d_first:
        until(p, lambda m: "d0" in p.connector.scheduler.engines)
        p.add_request(p_req)
    (failed,) = until(p, lambda m: [t for t in m.transmits if t.kind == "push_failed"])
    assert failed.engine == "d0"
    assert (parse(failed.message).transfer, parse(failed.message).generation) == (
        "cmpl-repeated-id-0", spec.generation)
    # P's own request goes on (it is P's client's), and nothing is ever written to D.
    for _ in range(5):
        assert not step(p)[0].kv_connector_metadata.writes
    feed(d, out(notifs=[(P_WORKER, failed.message)]))
    (end,) = feed(d, out()).kv_connector_metadata.reservation_ends
    assert (end.request, end.outcome) == (req.request_id, "failed")
    feed(d, KVConnectorOutput(finished_recving={req.request_id},
                              invalid_block_ids=set(end.blocks)))
    for _ in range(12):
        step(d)
    assert req.is_finished(), "D did not compute the prompt"
    assert_scheduler_empty(d)
