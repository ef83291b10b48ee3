"""Bidirectional multi-turn (``bidirectional_kv_xfer``) served for real: P and D both
``kv_both``; after a turn D holds its blocks (``decoder_kv_blocks_ttl``) and answers with
the turn's ``kv_transfer_params``; the conversation's next turn reaches P with them, and P
reads back the part of the turn its own cache does not hold (prefix hashes checked against
its prompt) instead of computing it, heartbeating D's hold while it waits. Every answer
equals a plain instance's, token for token.

The prompts are token ids: the next turn's prompt is the turn's own tokens (prompt and
answer) and new ones, as a chat history is, without the retokenization that can change
a text's tokens at the turn's end (where the hashes would stop matching: P then reads
only what matches). A conversation goes through ``kvlease-proxy`` (it keeps each
conversation's turn, ``conversation_id``, aging the hold's time left), or through the
test itself as a router that passes D's params to P unchanged, as vLLM's multi-turn proxy
does (which, with vLLM 0.32, cannot: it reads them from D's streamed answer, which this
vLLM does not put them in).
"""

from __future__ import annotations

import json
import time

import pytest
from fleet import Fleet, complete, kv_config, scrape, wait_for

TTL = 8.0  # decoder_kv_blocks_ttl: short, so a turn can outlive it within a test
EXTRA = {
    "kv_lease_duration": 4.0, "bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": TTL,
    "kv_recompute_threshold": 32, "pull_safety_margin": 1.0,
}
ANSWER = 48  # tokens per answer: a turn spans blocks beyond the prompt P cached


def _kv_both() -> str:
    cfg = json.loads(kv_config("kv_both", EXTRA))
    cfg["kv_load_failure_policy"] = "recompute"
    return json.dumps(cfg)


@pytest.fixture(scope="module")
def bidir(work, model):
    with Fleet(work / "bidir", model) as fleet:
        p = fleet.engine("p", kv=_kv_both())
        d = fleet.engine("d", kv=_kv_both())
        plain = fleet.engine("plain")
        fleet.start(p, d, plain)
        ours = fleet.kvlease_proxy("kvlease-proxy", [p], [d])
        fleet.start(ours)
        yield p, d, plain, ours


def tokens(model: str, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)(text)["input_ids"]


def routed(p, d, model, prompt, params=None):
    """One turn as a router sends it: P with ``do_remote_decode`` (and the previous turn's
    params, when there is one), then D with P's params. D's answer, with its turn."""
    first = dict(params or {}, do_remote_decode=True, do_remote_prefill=False)
    a = complete(p.url, model, prompt, max_tokens=1, kv_transfer_params=first)
    assert a.status == 200, a.body
    b = complete(d.url, model, prompt, max_tokens=ANSWER,
                 kv_transfer_params=a.body["kv_transfer_params"])
    assert b.status == 200, b.body
    return b


def counters(p, d) -> dict[str, float]:
    pm, dm = scrape(p), scrape(d)
    return {
        "pulled": pm.value("vllm:kvlease_turns_total", outcome="pulled"),
        "p_external": pm.value("vllm:prompt_tokens_by_source_total",
                               source="external_kv_transfer"),
        "held": dm.value("vllm:kvlease_holds_granted_total"),
        "hold_read": dm.value("vllm:kvlease_holds_released_total", reason="completed"),
        "hold_expired": dm.value("vllm:kvlease_holds_released_total", reason="expired"),
        "holds_open": dm.value("vllm:kvlease_holds_granted_total")
        - dm.value("vllm:kvlease_holds_released_total"),
        "p_stale": pm.value("vllm:kvlease_reads_total", status="stale"),
        "p_declined_late": pm.value("vllm:kvlease_turns_total",
                                    outcome="recomputed_deadline_too_close"),
    }


def settle(p, d) -> dict[str, float]:
    """``counters`` once unchanged over two seconds (vLLM publishes stats per interval)."""
    last = counters(p, d)
    while True:
        time.sleep(2)
        now = counters(p, d)
        if now == last:
            return now
        last = now


def test_two_turns_through_kvlease_proxy_read_the_first_back_from_d(bidir, model):
    p, d, plain, ours = bidir
    before = settle(p, d)
    first = tokens(model, "the lease is renewed by heartbeats while the request waits " * 2)
    one = complete(ours.url, model, first, max_tokens=ANSWER, conversation_id="c-1")
    assert one.status == 200, one.body
    assert one.token_ids == complete(plain.url, model, first, max_tokens=ANSWER).token_ids
    # The next turn: the whole conversation so far, then the user's new tokens.
    second = first + list(one.token_ids) + tokens(model, " and then the fence word")
    two = complete(ours.url, model, second, max_tokens=ANSWER, conversation_id="c-1")
    assert two.status == 200, two.body
    assert two.token_ids == complete(plain.url, model, second, max_tokens=ANSWER).token_ids
    after = wait_for("P's read of the turn and D's release counted", lambda: (
        c if (c := counters(p, d))["hold_read"] > before["hold_read"] else None))
    assert after["pulled"] == before["pulled"] + 1
    # P read from D what its own cache did not hold of the turn: whole blocks of 32.
    read = after["p_external"] - before["p_external"]
    assert read > 0 and read % 32 == 0, read
    assert after["held"] >= before["held"] + 2  # both turns held


def test_a_turn_after_d_let_it_go_is_never_loaded_and_p_recomputes(bidir, model):
    """The router passes D's params unchanged (not aged) after D freed the turn at its
    TTL: P, which measured D's clock with its probe at an earlier turn, reads the turn's
    deadline on it and computes the prompt without reading; a P that had not measured it
    yet would read, and the fence would refuse the read. Either way nothing of the freed
    turn is loaded and the answer equals a plain instance's."""
    p, d, plain, _ = bidir
    before = settle(p, d)
    first = tokens(model, "a fence word tells a late reader that the block was reused " * 2)
    one = routed(p, d, model, first)
    turn = one.body["kv_transfer_params"]
    assert turn["kvlease_bidir"] is True and turn["remote_engine_id"]
    # Every hold D keeps (this turn's, and any earlier test's last turn) ends at its TTL.
    wait_for("D's holds ended", lambda: (
        c if (c := counters(p, d))["holds_open"] == 0 and c["held"] > before["held"] else None),
        timeout=3 * TTL)
    second = first + list(one.token_ids) + tokens(model, " then the reader recomputes")
    two = routed(p, d, model, second, params=turn)
    assert two.token_ids == complete(plain.url, model, second, max_tokens=ANSWER).token_ids
    after = wait_for("P's decline or stale read counted", lambda: (
        c if (c := counters(p, d))["p_stale"] + c["p_declined_late"]
        > before["p_stale"] + before["p_declined_late"] else None))
    assert after["hold_read"] == before["hold_read"]
