"""2 P × 2 D behind ``vllm-router`` (vLLM's router, PyPI ``vllm-router``, in its NIXL
P/D mode: it forwards P's ``kv_transfer_params`` to D as vLLM's proxies do), and behind
``kvlease-proxy``: every answer equals a plain instance's, every P granted leases and
every D read (round robin spreads the requests), nothing expired."""

from __future__ import annotations

import pytest
from fleet import Fleet, assert_equal, complete_all, kv_config, scrape, wait_for

KV_EXTRA = {"kv_lease_duration": 30}


@pytest.fixture(scope="module")
def two_by_two(work, model, reference):
    with Fleet(work / "two-by-two", model) as fleet:
        ps = [fleet.engine(f"p{i}", kv=kv_config("kv_producer", KV_EXTRA)) for i in range(2)]
        ds = [fleet.engine(f"d{i}", kv=kv_config("kv_consumer", KV_EXTRA)) for i in range(2)]
        fleet.start(*ps, *ds)
        router = fleet.router("vllm-router", ps, ds)
        ours = fleet.kvlease_proxy("kvlease-proxy", ps, ds)
        fleet.start(router, ours)
        yield ps, ds, router, ours


@pytest.mark.parametrize("front", ["vllm-router", "kvlease-proxy"])
def test_two_p_two_d_equal_a_plain_instance(two_by_two, front, model, prompts, reference):
    ps, ds, router, ours = two_by_two
    url = router.url if front == "vllm-router" else ours.url
    before = [scrape(p).value("vllm:kvlease_leases_released_total", reason="completed")
              for p in ps]
    answers = complete_all(url, model, prompts, concurrency=4)
    assert_equal(answers, prompts, reference)
    done = wait_for("every lease released", lambda: (
        c if sum(c := [scrape(p).value("vllm:kvlease_leases_released_total",
                                       reason="completed") for p in ps]) - sum(before)
        >= len(prompts) else None))
    assert all(now > was for now, was in zip(done, before)), "a P served no request"
    for p in ps:
        assert scrape(p).value("vllm:kvlease_leases_released_total", reason="expired") == 0
    for d in ds:
        assert scrape(d).value("vllm:kvlease_reads_total", status="done") > 0, "a D read nothing"
