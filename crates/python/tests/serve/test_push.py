"""Push mode served as users run it: P (``kv_producer``, ``transfer_mode: push``) and D
(``kv_consumer``, ``KvleasePushConnector``) started with ``vllm serve``, greedy outputs
compared token for token with one plain vLLM instance (``reference``), and the proof that
D's prompts came from P's writes (D's prompt tokens by source). Two fronts:

- ``kvlease-proxy --transfer-mode push``: both legs at once, one transfer id; D registers
  its blocks while P prefills, P writes when its prefill ends (the proxy learns P's
  identity from P's first answer, so at least one request per P goes one leg after the
  other; its metrics show how many went at once);
- ``push_proxy.py``: vLLM's older push proxy's flow, P's leg first, then D's naming P and
  no blocks;
- vLLM's own push proxy, unchanged (``disagg_proxy_pushconnector_demo.py``, from vLLM
  0.34's sources): both legs at once with no transfer id, one ``X-Request-Id`` for both
  (the legs are matched by vLLM's request id, and by the digest of the prompt).

Then P killed after D registered a reservation (P's engine frozen first, so its write
never comes): D's reservation expires about a lease after it was made (no heartbeats),
its fence is cleared and the load fails; with ``kv_load_failure_policy`` recompute D
computes the prompt and answers what a plain instance answers, never a wrong token.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid

import pytest
from fleet import Fleet, assert_equal, complete_all, free_port, kv_config, scrape, wait_for
from push_proxy import decode_leg, prefill_leg

#: Short, so the fault test waits seconds.
LEASE = 4.0
P_EXTRA = {"kv_lease_duration": LEASE, "transfer_mode": "push"}
D_EXTRA = {"kv_lease_duration": LEASE}


def _d_config(extra: dict | None = None) -> str:
    cfg = json.loads(kv_config("kv_consumer", {**D_EXTRA, **(extra or {})},
                               connector="KvleasePushConnector"))
    cfg["kv_load_failure_policy"] = "recompute"
    return json.dumps(cfg)


@pytest.fixture(scope="module")
def push(work, model, reference):
    with Fleet(work / "push", model) as fleet:
        # vLLM's push proxy names P by the engine id and side channel it is given.
        engine_id, side_channel = "kvlease-push-p", free_port()
        p_cfg = json.loads(kv_config("kv_producer",
                                     {**P_EXTRA, "side_channel_port": side_channel}))
        p = fleet.engine("p", kv=json.dumps({**p_cfg, "engine_id": engine_id}))
        d = fleet.engine("d", kv=_d_config())
        fleet.start(p, d)
        proxy = fleet.push_proxy("push-proxy", [p], [d])
        ours = fleet.kvlease_proxy("kvlease-proxy", [p], [d], args=("--transfer-mode", "push"))
        vllms = fleet.vllm_push_proxy("vllm-push-proxy", p, [d], engine_id=engine_id,
                                      side_channel_port=side_channel)
        fleet.start(proxy, ours, vllms)
        yield fleet, p, d, {"push-proxy": proxy, "kvlease-proxy": ours,
                            "vllm-push-proxy": vllms}


def by_source(d) -> dict[str, float]:
    dm = scrape(d)
    return {
        "external": dm.value("vllm:prompt_tokens_by_source_total", source="external_kv_transfer"),
        "local": dm.value("vllm:prompt_tokens_by_source_total", source="local_compute"),
    }


def stable(d) -> dict[str, float]:
    """D's counts once unchanged over two seconds (vLLM publishes stats every few)."""
    last = by_source(d)
    while True:
        time.sleep(2)
        now = by_source(d)
        if now == last:
            return now
        last = now


@pytest.mark.parametrize("front", ["kvlease-proxy", "push-proxy", "vllm-push-proxy"])
def test_through_a_push_proxy_equals_a_plain_instance(push, front, model, prompts, reference):
    _, p, d, fronts = push
    proxy = fronts[front]
    before = stable(d)
    answers = complete_all(proxy.url, model, prompts, concurrency=2)
    assert_equal(answers, prompts, reference)
    if front == "kvlease-proxy":
        legs = scrape(proxy)
        at_once = legs.value("kvlease_proxy_push_legs_total", dispatch="concurrent")
        one_by_one = legs.value("kvlease_proxy_push_legs_total", dispatch="sequential")
        assert at_once + one_by_one == len(prompts)
        # Until P's first answer the proxy does not know P's identity: the first two
        # requests (two at a time) wait for P's answer; every later one goes at once.
        assert at_once >= len(prompts) - 2, "kvlease-proxy did not send both legs at once"
        assert legs.value("kvlease_proxy_push_prefill_failures_total") == 0
    after = wait_for("D's prompt tokens counted", lambda: (
        c if (c := by_source(d))["external"] > before["external"] else None))
    after = stable(d)
    # D took the prompts from P's writes, computing at most each prompt's last token.
    assert after["external"] - before["external"] > 0
    assert after["local"] - before["local"] <= len(prompts)
    written = len(re.findall(r"blocks reserved for P", d.log_text()))
    assert written >= len(prompts)
    # Every push ended: P freed the blocks it held for them.
    wait_for("P's KV cache usage back to 0",
             lambda: scrape(p).value("vllm:kv_cache_usage_perc") == 0)


def test_p_killed_after_d_registered_d_reclaims_its_reservation_and_recomputes(
        push, model, fault_prompts, reference):
    fleet, p, d, _ = push
    prompt = fault_prompts[0]
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    rid = str(uuid.uuid4())
    status, raw, params = prefill_leg(p.url, body, "/v1/completions", rid)
    assert status == 200 and params.get("transfer_mode") == "push", raw
    # P's engine stops (no heartbeat, no write from here on); D's leg reaches D, which
    # reserves its blocks and registers them with P.
    p.freeze_engine()
    reserved = len(re.findall(r"blocks reserved for P", d.log_text()))
    out: list = []
    thread = threading.Thread(target=lambda: out.append(
        decode_leg(d.url, body, "/v1/completions", rid, params, timeout=300)))
    thread.start()
    wait_for("D's reservation", lambda: len(
        re.findall(r"blocks reserved for P", d.log_text())) > reserved, timeout=60, every=0.05)
    seen = time.monotonic()
    time.sleep(0.5)  # the registration leaves with D's next step
    killed = time.monotonic()
    p.kill()
    thread.join(300)
    answered = time.monotonic()
    reclaimed = answered - seen
    assert out, "D never answered after P died"
    status, raw = out[0]
    assert status == 200, raw
    got = json.loads(raw)["choices"][0]
    assert tuple(got["token_ids"]) == reference[prompt].token_ids
    log = d.log_text()
    assert "did not come (expired)" in log, "D's reservation did not end by expiry"
    # About a lease after the reservation (no heartbeat ever came), plus D's recompute.
    print(f"push reservation made -> D's recomputed answer: {reclaimed:.2f}s; P killed -> "
          f"answer: {answered - killed:.2f}s (lease {LEASE}s)")
    assert LEASE - 1 < reclaimed < LEASE + 20
    wait_for("D's KV cache usage back to 0",
             lambda: scrape(d).value("vllm:kv_cache_usage_perc") == 0)


@pytest.fixture(scope="module")
def push_tp2(work, model, reference):
    """P and D at TP 2 in push mode: each P worker writes into the D worker of its rank."""
    tp2 = ["--tensor-parallel-size", "2"]
    # Leases are not what this is about (the module's first test has them short): four
    # workers on a small machine can take seconds a step.
    long = {"kv_lease_duration": 60}
    with Fleet(work / "push-tp2", model) as fleet:
        p = fleet.engine("p", kv=kv_config("kv_producer", {**P_EXTRA, **long}),
                         extra_args=tp2)
        d = fleet.engine("d", kv=_d_config(long), extra_args=tp2)
        fleet.start(p, d)
        proxy = fleet.push_proxy("push-proxy", [p], [d])
        ours = fleet.kvlease_proxy("kvlease-proxy", [p], [d], args=("--transfer-mode", "push"))
        fleet.start(proxy, ours)
        yield p, d, {"push-proxy": proxy, "kvlease-proxy": ours}


def pushed_and_equal(p, d, url: str, model, some, reference, what: str) -> None:
    """``some`` through ``url``, two at a time: outputs equal a plain instance's, D's
    prompt tokens came from P's writes, P's KV usage back to 0."""
    before = stable(d)
    answers = complete_all(url, model, some, concurrency=2)
    assert_equal(answers, some, reference)
    after = wait_for("D's prompt tokens counted", lambda: (
        c if (c := by_source(d))["external"] > before["external"] else None))
    after = stable(d)
    # Under heavy load a push may still fall back to computing on D (a handshake past its
    # timeout, a lease run out): never a wrong token, but say why when none was pushed.
    why = [line for line in (p.log_text() + d.log_text()).splitlines()
           if "not written" in line or "did not come" in line or "not pushed" in line
           or "not KV-compatible" in line or "handshake" in line and "failed" in line]
    assert after["external"] > before["external"], f"nothing pushed {what}: {why[:10]}"
    wait_for("P's KV cache usage back to 0",
             lambda: scrape(p).value("vllm:kv_cache_usage_perc") == 0)


@pytest.mark.parametrize("front", ["kvlease-proxy", "push-proxy"])
def test_tp2_each_p_rank_writes_its_heads_into_ds_rank(push_tp2, front, model, prompts,
                                                       reference):
    p, d, fronts = push_tp2
    some = prompts[:8] if front == "kvlease-proxy" else prompts[8:16]
    # Equal outputs with KV written rank to rank is what this shows: a P rank writing into
    # the wrong D rank (or the wrong heads) would change the tokens.
    pushed_and_equal(p, d, fronts[front].url, model, some, reference, "at TP 2")


@pytest.fixture(scope="module")
def push_tp_2to1(work, model, reference):
    """P at TP 2, D at TP 1 in push mode: each P worker writes its heads into D's one
    worker (half of each block's heads from each P rank)."""
    long = {"kv_lease_duration": 60}
    with Fleet(work / "push-tp2to1", model) as fleet:
        p = fleet.engine("p", kv=kv_config("kv_producer", {**P_EXTRA, **long}),
                         extra_args=["--tensor-parallel-size", "2"])
        d = fleet.engine("d", kv=_d_config(long))
        fleet.start(p, d)
        ours = fleet.kvlease_proxy("kvlease-proxy", [p], [d], args=("--transfer-mode", "push"))
        fleet.start(ours)
        yield p, d, ours


def test_p_tp2_pushes_its_heads_into_d_tp1(push_tp_2to1, model, prompts, reference):
    p, d, front = push_tp_2to1
    # Equal outputs with KV that came from P's two workers into D's one: a P rank writing
    # the wrong heads (or into the wrong half of D's block) would change the tokens.
    pushed_and_equal(p, d, front.url, model, prompts[:8], reference, "from TP 2 to 1")
