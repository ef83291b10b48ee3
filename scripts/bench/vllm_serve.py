"""``vllm bench serve`` (vLLM's own load generator: random dataset, offline) against one
plain vLLM instance, P/D through KvleaseConnector and P/D through vLLM's NixlConnector,
the P/D pairs behind vLLM's toy proxy, one configuration at a time on this machine, the
same prompts (a fixed seed) at each request rate. Prints ``key=value`` lines: TTFT and ITL
p50/p99 per configuration and rate, and kvlease's ratios to NIXL and to the plain
instance. Run by ``scripts/bench/vllm-serve.sh`` (which makes the environment).

    python vllm_serve.py WORKDIR [--rates 2,8,32] [--prompts 64] [--input-len 128]
                                 [--output-len 32] [--configs plain,kvlease,nixl]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "crates/python/tests/serve"))

from fleet import Fleet, kv_config  # noqa: E402
from make_model import make  # noqa: E402

METRICS = ("ttft", "itl")
PERCENTILES = ("50", "99")


def bench(url: str, model: str, rate: float, args, out: Path) -> dict:
    """One ``vllm bench serve`` run; its saved result."""
    cmd = [
        str(Path(sys.executable).with_name("vllm")), "bench", "serve",
        "--backend", "vllm", "--base-url", url, "--model", model, "--tokenizer", model,
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(args.prompts),
        "--request-rate", str(rate), "--ignore-eos", "--seed", "0",
        "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", ",".join(PERCENTILES),
        "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
        "--disable-tqdm",
    ]
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"), timeout=1800).returncode
    if rc != 0 or not out.exists():
        print(f"vllm bench serve failed ({rc}); {log}:\n{log.read_text()[-2000:]}", file=sys.stderr)
        return {}
    return json.loads(out.read_text())


def start(fleet: Fleet, config: str):
    """The URL to load for ``config``, its processes started."""
    if config == "plain":
        plain = fleet.engine("plain")
        fleet.start(plain)
        return plain.url
    if config == "kvlease":
        p = fleet.engine("p", kv=kv_config("kv_producer"))
        d = fleet.engine("d", kv=kv_config("kv_consumer"))
    elif config == "nixl":
        # NixlConnector's side channels: one port per engine on this host.
        p = fleet.engine("p", kv=kv_config("kv_producer", connector="NixlConnector", module=None),
                         env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "5611"})
        d = fleet.engine("d", kv=kv_config("kv_consumer", connector="NixlConnector", module=None),
                         env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "5622"})
    else:
        raise SystemExit(f"unknown configuration {config!r}")
    fleet.start(p, d)
    proxy = fleet.toy_proxy("proxy", [p], [d])
    fleet.start(proxy)
    return proxy.url


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("work", type=Path)
    ap.add_argument("--rates", default="2,8,32")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--configs", default="plain,kvlease,nixl")
    args = ap.parse_args()
    model = args.work / "model"
    if not (model / "model.safetensors").exists():
        make(model)
    rates = [float(r) for r in args.rates.split(",")]
    configs = args.configs.split(",")
    print(f"vllm_serve.prompts={args.prompts}")
    print(f"vllm_serve.input_len={args.input_len}")
    print(f"vllm_serve.output_len={args.output_len}")
    got: dict[tuple[str, float], dict] = {}
    for config in configs:
        with Fleet(args.work / config, str(model)) as fleet:
            url = start(fleet, config)
            bench(url, str(model), rates[0], argparse.Namespace(**{**vars(args), "prompts": 8}),
                  args.work / config / "warmup.json")
            for rate in rates:
                r = bench(url, str(model), rate, args, args.work / config / f"rate{rate:g}.json")
                got[(config, rate)] = r
                key = f"vllm_serve.{config}.rate{rate:g}"
                print(f"{key}.completed={r.get('completed', 'nan')}")
                print(f"{key}.failed={r.get('failed', 'nan')}")
                for m in METRICS:
                    for q in PERCENTILES:
                        print(f"{key}.{m}_p{q}_ms={r.get(f'p{q}_{m}_ms', float('nan')):.2f}")
                sys.stdout.flush()
    for rate in rates:
        for m in METRICS:
            for q in PERCENTILES:
                k = f"p{q}_{m}_ms"
                ours = got.get(("kvlease", rate), {}).get(k)
                for peer in ("nixl", "plain"):
                    theirs = got.get((peer, rate), {}).get(k)
                    ratio = ours / theirs if ours and theirs else float("nan")
                    print(f"vllm_serve.rate{rate:g}.{m}_p{q}_kvlease_over_{peer}={ratio:.2f}")


if __name__ == "__main__":
    main()
