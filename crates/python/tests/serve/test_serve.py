"""Real vLLM serving a real model through ``KvleaseConnector``, as users run it: one P
(``kv_producer``) and one D (``kv_consumer``) started with ``vllm serve``, vLLM's own toy
proxy and ``kvlease-proxy`` in front, greedy outputs compared token for token with one
plain vLLM instance (``reference``), and the proof that the KV came over kvlease (D's
prompt tokens by source, ``vllm:kvlease_*`` reads and leases).

Then the faults, in this order (each leaves the fleet serving for the next): D's engine
frozen (SIGSTOP of its engine core and workers; its API server takes the request) past
the lease (P's lease expires, D's late read is fenced, D recomputes); P killed
while D holds its request (D recomputes, no hang; P restarted, D handshakes with the new
instance); D killed (P's lease expires, its KV usage returns to 0).
"""

from __future__ import annotations

import threading
import time

import pytest
from fleet import Fleet, assert_equal, complete, complete_all, kv_config, scrape, wait_for

#: Short, so the fault tests wait seconds: D heartbeats every lease/6.
LEASE = 4.0
KV_EXTRA = {"kv_lease_duration": LEASE}


@pytest.fixture(scope="module")
def pd(work, model, reference):
    with Fleet(work / "pd", model) as fleet:
        p = fleet.engine("p", kv=kv_config("kv_producer", KV_EXTRA))
        d = fleet.engine("d", kv=_d_config())
        fleet.start(p, d)
        toy = fleet.toy_proxy("toy-proxy", [p], [d])
        ours = fleet.kvlease_proxy("kvlease-proxy", [p], [d])
        fleet.start(toy, ours)
        yield fleet, p, d, toy, ours


def _d_config() -> str:
    import json

    cfg = json.loads(kv_config("kv_consumer", KV_EXTRA))
    cfg["kv_load_failure_policy"] = "recompute"
    return json.dumps(cfg)


def p_counts(p) -> dict[str, float]:
    """P's lease counters (scraped alone while D is frozen: a frozen D answers nothing)."""
    pm = scrape(p)
    return {
        "granted": pm.value("vllm:kvlease_leases_granted_total"),
        "completed": pm.value("vllm:kvlease_leases_released_total", reason="completed"),
        "expired": pm.value("vllm:kvlease_leases_released_total", reason="expired"),
        "aborted": pm.value("vllm:kvlease_leases_released_total", reason="aborted"),
    }


def settled(p) -> dict[str, float]:
    """P's lease counters once every lease granted so far is released and reported
    (vLLM publishes stats every few seconds: a count taken too early would let the last
    test's lease pass for this test's)."""
    return wait_for("P's earlier leases all released and reported", lambda: (
        c if (c := p_counts(p))["granted"] == c["completed"] + c["expired"] + c["aborted"]
        else None), timeout=60)


def baseline(p, d) -> dict[str, float]:
    """``counts`` once the earlier tests' stats have all arrived: P's leases settled and
    D's counters unchanged over two seconds."""
    settled(p)
    last = counts(p, d)
    while True:
        time.sleep(2)
        now = counts(p, d)
        if now == last:
            return now
        last = now


def counts(p, d) -> dict[str, float]:
    dm = scrape(d)
    return {
        **p_counts(p),
        "external": dm.value("vllm:prompt_tokens_by_source_total", source="external_kv_transfer"),
        "local": dm.value("vllm:prompt_tokens_by_source_total", source="local_compute"),
        "reads_done": dm.value("vllm:kvlease_reads_total", status="done"),
        "reads_stale": dm.value("vllm:kvlease_reads_total", status="stale"),
        "reads_failed": dm.value("vllm:kvlease_reads_total", status="failed"),
        "read_bytes": dm.value("vllm:kvlease_read_bytes_total"),
    }


def delta(before, after):
    return {k: after[k] - before[k] for k in before}


def test_one_at_a_time_through_vllms_toy_proxy_equals_a_plain_instance(pd, model, prompts,
                                                                       reference):
    _, p, d, toy, _ = pd
    before = baseline(p, d)
    answers = complete_all(toy.url, model, prompts)
    assert_equal(answers, prompts, reference)
    # vLLM reports stats every few seconds: wait for the last request's.
    after = wait_for("every lease released and counted", lambda: (
        c if (c := counts(p, d))["completed"] - before["completed"] >= len(prompts) else None))
    got = delta(before, after)
    assert got["granted"] == len(prompts)
    assert got["completed"] == len(prompts) and got["expired"] == got["aborted"] == 0
    # D took the prompts from P over kvlease, computing at most each prompt's last token.
    assert got["reads_done"] == len(prompts) and got["read_bytes"] > 0
    assert got["reads_stale"] == got["reads_failed"] == 0
    assert got["external"] > 0 and got["local"] <= len(prompts)
    # vLLM's CPU cache is plain heap memory, not a memfd: the shared-memory link reads
    # it with cross-memory attach (or TCP where the kernel refuses that), and the
    # metric names what moved the bytes.
    dm = scrape(d)
    assert dm.value("vllm:kvlease_reads_total", backend="shm") == 0
    assert dm.value("vllm:kvlease_reads_total", backend="cma") + dm.value(
        "vllm:kvlease_reads_total", backend="tcp") == after["reads_done"]
    wait_for("P's KV cache usage back to 0", lambda: scrape(p).value("vllm:kv_cache_usage_perc") == 0)


def test_four_at_a_time_through_kvlease_proxy_equals_a_plain_instance(pd, model, prompts,
                                                                      reference):
    _, p, d, _, ours = pd
    before = baseline(p, d)
    answers = complete_all(ours.url, model, prompts, concurrency=4)
    assert_equal(answers, prompts, reference)
    after = wait_for("every lease released", lambda: (
        c if (c := counts(p, d))["completed"] - before["completed"] >= len(prompts) else None))
    got = delta(before, after)
    assert got["granted"] == got["completed"] == len(prompts)
    assert got["reads_done"] == len(prompts) and got["reads_stale"] == got["reads_failed"] == 0


class Held:
    """A request that reached D while D's engine is frozen, after P granted its lease:
    ``answer()`` thaws D's engine (if still frozen) and waits for what the client got."""

    def __init__(self, p, d, url: str, model: str, prompt: str, granted_before: float):
        self.d = d
        self._out: list = []
        d.freeze_engine()
        try:
            self._thread = threading.Thread(
                target=lambda: self._out.append(complete(url, model, prompt, timeout=300)))
            self._thread.start()
            wait_for("P's lease granted", lambda: p_counts(p)["granted"] > granted_before,
                     timeout=120)
        except BaseException:
            d.thaw_engine()
            raise

    def answer(self, what: str):
        self.d.thaw_engine()
        self._thread.join(300)
        assert not self._thread.is_alive(), what
        return self._out[0] if self._out else None


def test_d_frozen_past_the_lease_p_reclaims_and_d_recomputes(pd, model, fault_prompts,
                                                           reference):
    _, p, d, toy, _ = pd
    prompt = fault_prompts[0]
    before = baseline(p, d)
    held = Held(p, d, toy.url, model, prompt, before["granted"])
    try:
        # Nobody heartbeats the lease: P's reaper takes it back after the lease.
        wait_for("P's lease expired", lambda: p_counts(p)["expired"] > before["expired"],
                 timeout=10 * LEASE)
    finally:
        answer = held.answer("D never answered after it was thawed")
    assert answer is not None and answer.status == 200 and answer.token_ids == reference[prompt].token_ids
    after = wait_for("D's late read counted", lambda: (
        c if (c := counts(p, d))["reads_stale"] + c["reads_failed"] > before["reads_stale"]
        + before["reads_failed"] or c["local"] > before["local"] else None))
    got = delta(before, after)
    assert got["reads_done"] == 0, "a read of a reclaimed lease was taken as done"
    assert got["local"] > 0, "D did not recompute the prompt"
    wait_for("P's KV cache usage back to 0", lambda: scrape(p).value("vllm:kv_cache_usage_perc") == 0)


def test_p_killed_while_d_holds_its_request_d_recomputes_then_p_restarts(
        pd, model, fault_prompts, reference):
    fleet, p, d, toy, _ = pd
    prompt = fault_prompts[1]
    before = baseline(p, d)
    held = Held(p, d, toy.url, model, prompt, before["granted"])
    try:
        p.kill()
    finally:
        answer = held.answer("D hung on a dead P")
    # kv_load_failure_policy recompute: D computes the prompt P can no longer serve.
    assert answer is not None and answer.status == 200 and answer.token_ids == reference[prompt].token_ids
    assert scrape(d).value("vllm:kvlease_reads_total", status="done") == before["reads_done"]
    # P comes back (a new instance on the same port): D handshakes with it again and
    # loads from it.
    p.start()
    p.wait_ready()
    after_restart = counts(p, d)
    nxt = fault_prompts[2]
    answer = complete(toy.url, model, nxt)
    assert answer.status == 200 and answer.token_ids == reference[nxt].token_ids
    got = delta(after_restart, wait_for("the new P's lease released", lambda: (
        c if (c := counts(p, d))["completed"] >= 1 else None)))
    assert got["reads_done"] == 1 and got["external"] > 0


def test_d_killed_p_reclaims_its_lease(pd, model, fault_prompts):
    _, p, d, toy, _ = pd
    prompt = fault_prompts[3]
    before = settled(p)
    held = Held(p, d, toy.url, model, prompt, before["granted"])
    d.kill()
    answer = held.answer("the client hung on a dead D")
    assert answer is not None and answer.status != 200, "a dead D answered"
    wait_for("P's lease expired", lambda: p_counts(p)["expired"] > before["expired"],
             timeout=10 * LEASE)
    after = p_counts(p)
    assert after["completed"] == before["completed"], "a dead D's read completed a lease"
    wait_for("P's KV cache usage back to 0", lambda: scrape(p).value("vllm:kv_cache_usage_perc") == 0)
