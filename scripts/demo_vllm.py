"""Real vLLM serving P/D through kvlease, watched: a tiny model made here, one P and one D
(``vllm serve`` with KvleaseConnector) behind ``kvlease-proxy``, and one plain vLLM
instance for comparison. Run by ``scripts/demo-vllm.sh`` (which makes the environment).

1. A few prompts through the proxy and through the plain instance: the answers side by
   side, equal token for token, and where the KV came from (P's leases, D's reads).
2. D's engine frozen with a request in flight: P's lease expires (nobody heartbeats it),
   D is thawed, its late read is refused by the fence, D computes the prompt itself, and
   the answer is still the plain instance's.

Prints ``demo.*=`` key=value lines and exits non-zero when an answer differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "crates/python/tests/serve"))

from fleet import Fleet, complete, kv_config, scrape, wait_for  # noqa: E402
from make_model import make  # noqa: E402

PROMPTS = [
    "the lease is renewed by heartbeats while the request waits on the decode instance",
    "a fence word tells a late reader that the block was reused for another request",
    "one sided reads move the key and value cache from one host to another",
    "when the decoder dies the lease expires and the blocks return to the pool",
]
LEASE = 4.0


def say(text: str) -> None:
    print(f"--- {text}", file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("work", type=Path)
    args = ap.parse_args()
    model = args.work / "model"
    if not (model / "model.safetensors").exists():
        say("making a tiny Llama with random weights and a tokenizer (nothing downloaded)")
        make(model)
    ok = True
    with Fleet(args.work, str(model)) as fleet:
        extra = {"kv_lease_duration": LEASE}
        d_cfg = json.loads(kv_config("kv_consumer", extra))
        d_cfg["kv_load_failure_policy"] = "recompute"
        p = fleet.engine("p", kv=kv_config("kv_producer", extra))
        d = fleet.engine("d", kv=json.dumps(d_cfg))
        plain = fleet.engine("plain")
        say("starting P, D and a plain instance (vllm serve, about a minute on 2 cores)")
        fleet.start(p, d, plain)
        proxy = fleet.kvlease_proxy("kvlease-proxy", [p], [d])
        fleet.start(proxy)
        print(f"demo.proxy={proxy.url}\ndemo.logs={args.work}")

        say("phase 1: the same prompts through P/D and through the plain instance")
        for prompt in PROMPTS:
            ours, theirs = complete(proxy.url, str(model), prompt), complete(plain.url, str(model), prompt)
            equal = ours.status == 200 and ours.token_ids == theirs.token_ids
            ok &= equal
            print(f"  {'EQUAL ' if equal else 'DIFFER'} {prompt[:50]!r}\n"
                  f"         P/D:   {ours.text!r}\n         plain: {theirs.text!r}", file=sys.stderr)
        pm = wait_for("P's leases released", lambda: (
            m if (m := scrape(p)).value("vllm:kvlease_leases_released_total", reason="completed")
            >= len(PROMPTS) else None))
        dm = scrape(d)
        print(f"demo.p_leases_granted={pm.value('vllm:kvlease_leases_granted_total'):g}")
        print(f"demo.p_leases_completed={pm.value('vllm:kvlease_leases_released_total', reason='completed'):g}")
        print(f"demo.d_reads_done={dm.value('vllm:kvlease_reads_total', status='done'):g}")
        print(f"demo.d_read_bytes={dm.value('vllm:kvlease_read_bytes_total'):g}")
        print(f"demo.d_prompt_tokens_from_p={dm.value('vllm:prompt_tokens_by_source_total', source='external_kv_transfer'):g}")

        say(f"phase 2: D's engine frozen with a request in flight; P's {LEASE:g} s lease runs out")
        prompt = "quick brown foxes jump over lazy dogs near the river bank in the morning light"
        reference = complete(plain.url, str(model), prompt)
        expired = pm.value("vllm:kvlease_leases_released_total", reason="expired")
        d.freeze_engine()
        out: list = []
        t = threading.Thread(target=lambda: out.append(complete(proxy.url, str(model), prompt)))
        t.start()
        started = time.monotonic()
        try:
            wait_for("P's lease expired", lambda: scrape(p).value(
                "vllm:kvlease_leases_released_total", reason="expired") > expired, timeout=60)
            print(f"demo.p_reclaimed_after_s={time.monotonic() - started:.1f}")
        finally:
            d.thaw_engine()
        t.join(300)
        answer = out[0] if out else None
        equal = answer is not None and answer.status == 200 and answer.token_ids == reference.token_ids
        ok &= equal
        dm = wait_for("D's late read counted", lambda: (
            m if (m := scrape(d)).value("vllm:kvlease_reads_total", status="stale") > 0 else None))
        print(f"demo.d_stale_reads={dm.value('vllm:kvlease_reads_total', status='stale'):g}")
        print(f"demo.frozen_answer_equal={int(equal)}", flush=True)
        say("D's late read was refused by the fence; D computed the prompt: "
            + ("the answer equals the plain instance's" if equal else "the answer DIFFERS"))
    print(f"demo.ok={int(ok)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
