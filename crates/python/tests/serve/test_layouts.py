"""P and D that lay their KV out differently, served for real and compared with a plain
instance token for token: never a wrong token.

- Block sizes P ≠ D (32 → 64 and 64 → 32): the CPU attention backend's kernel stores a
  head's K and V in an order of its own (``vec``: K with the head's elements outer and
  the tokens inner), so a run of tokens is not a run of bytes. D refuses P's KV at the
  handshake (the block formats name the backend and what its dims hold) and computes the
  prompt: outputs equal, no read, P's leases aborted at once.
- TP sizes P ≠ D (P TP 2 → D TP 1 and P TP 1 → D TP 2): heads are outermost in every CPU
  kernel's block, so D reads each P rank's heads into its own blocks: outputs equal, D's
  prompt tokens come from the transfer, one read per (D worker, P rank) pair.
"""

from __future__ import annotations

import pytest
from fleet import Fleet, assert_equal, complete_all, kv_config, scrape, wait_for

# The lease is not what these tests are about: P's lease starts when its prefill ends, and
# with four engines (two at TP 2) on a small machine P's answer can take most of 30 s to
# reach D through the proxy; a read after the lease is (rightly) stale and, under vLLM's
# default kv_load_failure_policy "fail", the request fails. Leases and their expiry are
# tested in test_serve.py.
KV_EXTRA = {"kv_lease_duration": 120}


def _pairs(fleet: Fleet, specs: dict) -> dict:
    """P/D pairs started together, each behind its own toy proxy: ``specs`` maps a key to
    ``(P's engine arguments, D's)``; returns key -> (P, D, proxy)."""
    pairs = {
        k: (fleet.engine(f"{i}-p", kv=kv_config("kv_producer", KV_EXTRA), **p_args),
            fleet.engine(f"{i}-d", kv=kv_config("kv_consumer", KV_EXTRA), **d_args))
        for i, (k, (p_args, d_args)) in enumerate(specs.items())
    }
    fleet.start(*[e for pair in pairs.values() for e in pair])
    proxies = {k: fleet.toy_proxy(f"{i}-proxy", [p], [d])
               for i, (k, (p, d)) in enumerate(pairs.items())}
    fleet.start(*proxies.values())
    return {k: (*pairs[k], proxies[k]) for k in pairs}


# Each fleet lives for its class only: two fleets of four engines at once (two of them at
# TP 2) need more memory than a 24 GiB machine has, and vLLM's CPU worker then refuses to
# start ("Available memory ... is less than requested memory for kv").
@pytest.fixture(scope="class")
def block_sizes(work, model, reference):
    """Two P/D pairs at once: P 32 → D 64 and P 64 → D 32."""
    with Fleet(work / "block-sizes", model) as fleet:
        yield _pairs(fleet, {
            (32, 64): ({"block_size": 32}, {"block_size": 64}),
            (64, 32): ({"block_size": 64}, {"block_size": 32}),
        })


class TestBlockSizes:
    @pytest.mark.parametrize("sizes", [(32, 64), (64, 32)], ids=["p32-d64", "p64-d32"])
    def test_block_sizes_that_differ_are_refused_and_computed_never_read(
            self, block_sizes, sizes, model, prompts, reference):
        p, d, proxy = block_sizes[sizes]
        some = prompts[:8]
        answers = complete_all(proxy.url, model, some)
        assert_equal(answers, some, reference)
        dm = wait_for("D's prompts counted", lambda: (
            m if (m := scrape(d)).value("vllm:prompt_tokens_by_source_total",
                                        source="local_compute") > 0 else None))
        assert dm.value("vllm:kvlease_reads_total") == 0, "D read KV it cannot lay out"
        assert dm.value("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
        assert dm.value("vllm:kvlease_incompatible_handshakes_total") >= 1
        # P's leases end at once: D aborts them when it refuses the KV.
        pm = wait_for("P's leases aborted", lambda: (
            m if (m := scrape(p)).value("vllm:kvlease_leases_released_total", reason="aborted")
            >= len(some) else None))
        assert pm.value("vllm:kvlease_leases_released_total", reason="completed") == 0
        text = d.log_text()
        assert "is not KV-compatible" in text and "block size: P" in text


@pytest.fixture(scope="class")
def tp_sizes(work, model, reference):
    """P TP 2 → D TP 1 and P TP 1 → D TP 2."""
    tp2 = {"extra_args": ["--tensor-parallel-size", "2"]}
    with Fleet(work / "tp-sizes", model) as fleet:
        yield _pairs(fleet, {(2, 1): (tp2, {}), (1, 2): ({}, tp2)})


class TestTpSizes:
    @pytest.mark.parametrize("tp", [(2, 1), (1, 2)], ids=["p-tp2-d-tp1", "p-tp1-d-tp2"])
    def test_tp_sizes_that_differ_read_each_ranks_heads(self, tp_sizes, tp, model, prompts,
                                                        reference):
        p, d, proxy = tp_sizes[tp]
        some = prompts[:8]
        answers = complete_all(proxy.url, model, some, concurrency=2)
        assert_equal(answers, some, reference)
        pm = wait_for("P's leases released", lambda: (
            m if (m := scrape(p)).value("vllm:kvlease_leases_released_total", reason="completed")
            >= len(some) else None))
        assert pm.value("vllm:kvlease_leases_released_total", reason="expired") == 0
        dm = wait_for("D's reads counted", lambda: (
            m if (m := scrape(d)).value("vllm:kvlease_reads_total", status="done")
            >= 2 * len(some) else None))
        # One batch per overlapping (D worker, P rank) pair: two per request either way.
        assert dm.value("vllm:kvlease_reads_total", status="done") == 2 * len(some)
        assert dm.value("vllm:kvlease_reads_total", status="stale") == 0
        assert dm.value("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 0
