"""Push mode served as users run it: P (``kv_producer``, ``transfer_mode: push``) and D
(``kv_consumer``, ``KvleasePushConnector``) started with ``vllm serve``, a proxy with
vLLM's push proxy's flow in front (``push_proxy.py``: P's leg first, then D's naming P and
no blocks; D reserves its blocks, P writes into them), greedy outputs compared token for
token with one plain vLLM instance (``reference``), and the proof that D's prompts came
from P's writes (D's prompt tokens by source).

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
from fleet import Fleet, assert_equal, complete_all, kv_config, scrape, wait_for
from push_proxy import decode_leg, prefill_leg

#: Short, so the fault test waits seconds.
LEASE = 4.0
P_EXTRA = {"kv_lease_duration": LEASE, "transfer_mode": "push"}
D_EXTRA = {"kv_lease_duration": LEASE}


def _d_config() -> str:
    cfg = json.loads(kv_config("kv_consumer", D_EXTRA, connector="KvleasePushConnector"))
    cfg["kv_load_failure_policy"] = "recompute"
    return json.dumps(cfg)


@pytest.fixture(scope="module")
def push(work, model, reference):
    with Fleet(work / "push", model) as fleet:
        p = fleet.engine("p", kv=kv_config("kv_producer", P_EXTRA))
        d = fleet.engine("d", kv=_d_config())
        fleet.start(p, d)
        proxy = fleet.push_proxy("push-proxy", [p], [d])
        fleet.start(proxy)
        yield fleet, p, d, proxy


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


def test_through_the_push_proxy_equals_a_plain_instance(push, model, prompts, reference):
    _, p, d, proxy = push
    before = stable(d)
    answers = complete_all(proxy.url, model, prompts, concurrency=2)
    assert_equal(answers, prompts, reference)
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
