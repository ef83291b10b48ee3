"""``vllm bench serve`` (vLLM's own load generator: random dataset, offline) against one
plain vLLM instance, P/D through KvleaseConnector and P/D through vLLM's NixlConnector,
the P/D pairs behind vLLM's toy proxy, one configuration at a time on this machine, the
same prompts (a fixed seed) at each request rate. Prints ``key=value`` lines: TTFT and ITL
p50/p99 per configuration and rate, and kvlease's ratios to NIXL and to the plain
instance. Run by ``scripts/bench/vllm-serve.sh`` (which makes the environment).

    python vllm_serve.py WORKDIR [--rates 2,8,32] [--prompts 64] [--input-len 128]
                                 [--output-len 32] [--configs plain,kvlease,nixl]

Push against pull (``--compare push``, run by ``scripts/bench/vllm-push.sh``), the same
engines' settings in each: kvlease's pull behind ``kvlease-proxy`` (``pull-proxy``), its
push mode (``transfer_mode: push`` on P, KvleasePushConnector on D) behind ``kvlease-proxy
--transfer-mode push`` (``push-at-once``: both legs at once) and behind ``push_proxy.py``
(``push``: P's leg first, then D's, vLLM's older push flow); ``kvlease`` (pull behind
vLLM's toy proxy) and ``nixl-push`` (NixlPushConnector behind ``push_proxy.py``) can be
added to ``--configs``. At each ``--concurrency`` (``vllm bench serve --max-concurrency
N``, every prompt sent at once); each point its own prompts (seed 1, 2, ...: no point
finds the last one's prompts in a prefix cache), the same for every configuration.
Prints each configuration's TTFT p50/p99 and answers per point, and the ratios
``push_at_once_over_pull_ttft_p50_c16=`` (both behind kvlease-proxy),
``push_at_once_over_push_one_by_one_...`` and the rest.

    python vllm_serve.py WORKDIR --compare push [--concurrency 1,16,64] [--prompts 64]
                                 [--configs pull-proxy,push-at-once,push,kvlease,nixl-push]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "crates/python/tests/serve"))

from fleet import Fleet, kv_config  # noqa: E402
from make_model import make  # noqa: E402

METRICS = ("ttft", "itl")
PERCENTILES = ("50", "99")


#: What ``--compare push`` calls each configuration in its keys.
LABELS = {"kvlease": "pull_toy_proxy", "pull-proxy": "pull", "push": "push_one_by_one",
          "push-at-once": "push_at_once", "nixl": "nixl_pull", "nixl-push": "nixl_push"}
#: The ratios ``--compare push`` prints: (numerator, denominator) configurations.
RATIOS = (("push-at-once", "pull-proxy"), ("push-at-once", "push"), ("push", "kvlease"),
          ("nixl-push", "nixl"), ("push-at-once", "nixl-push"))


@dataclass(frozen=True)
class Point:
    """One load point: a request rate (``inf``: every prompt at once), at most
    ``concurrency`` requests in flight (None: no limit), prompts made with ``seed``."""

    name: str
    rate: float
    concurrency: int | None = None
    seed: int = 0


def bench(url: str, model: str, point: Point, args, out: Path) -> dict:
    """One ``vllm bench serve`` run; its saved result."""
    cmd = [
        str(Path(sys.executable).with_name("vllm")), "bench", "serve",
        "--backend", "vllm", "--base-url", url, "--model", model, "--tokenizer", model,
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(args.prompts),
        "--request-rate", str(point.rate), "--ignore-eos", "--seed", str(point.seed),
        "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", ",".join(PERCENTILES),
        "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
        "--disable-tqdm",
    ]
    if point.concurrency is not None:
        cmd += ["--max-concurrency", str(point.concurrency)]
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
    if config in ("kvlease", "pull-proxy"):
        p = fleet.engine("p", kv=kv_config("kv_producer"))
        d = fleet.engine("d", kv=kv_config("kv_consumer"))
    elif config == "nixl":
        # NixlConnector's side channels: one port per engine on this host.
        p = fleet.engine("p", kv=kv_config("kv_producer", connector="NixlConnector", module=None),
                         env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "5611"})
        d = fleet.engine("d", kv=kv_config("kv_consumer", connector="NixlConnector", module=None),
                         env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "5622"})
    elif config in ("push", "push-at-once"):
        p = fleet.engine("p", kv=kv_config("kv_producer", {"transfer_mode": "push"}))
        d = fleet.engine("d", kv=kv_config("kv_consumer", connector="KvleasePushConnector"))
    elif config == "nixl-push":
        p = fleet.engine("p", kv=kv_config("kv_producer", connector="NixlPushConnector",
                                           module=None),
                         env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "5611"})
        d = fleet.engine("d", kv=kv_config("kv_consumer", connector="NixlPushConnector",
                                           module=None),
                         env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "5622"})
    else:
        raise SystemExit(f"unknown configuration {config!r}")
    fleet.start(p, d)
    if config in ("push", "nixl-push"):
        proxy = fleet.push_proxy("proxy", [p], [d])
    elif config == "pull-proxy":
        proxy = fleet.kvlease_proxy("proxy", [p], [d])
    elif config == "push-at-once":
        proxy = fleet.kvlease_proxy("proxy", [p], [d], args=("--transfer-mode", "push"))
    else:
        proxy = fleet.toy_proxy("proxy", [p], [d])
    fleet.start(proxy)
    return proxy.url


def points(args) -> list[Point]:
    """The load points: ``--concurrency`` (each its own seed) or ``--rates`` (seed 0)."""
    if args.concurrency:
        return [Point(f"c{int(c)}", float("inf"), int(c), seed=i + 1)
                for i, c in enumerate(args.concurrency.split(","))]
    return [Point(f"rate{float(r):g}", float(r)) for r in args.rates.split(",")]


def compare_push(got: dict, configs: list[str], pts: list[Point]) -> None:
    """``--compare push``'s keys: each configuration's TTFT and answers per point, and
    the ratios of ``RATIOS`` whose two configurations ran."""
    for pt in pts:
        for config in configs:
            r = got.get((config, pt.name), {})
            label = LABELS.get(config, config.replace("-", "_"))
            print(f"{label}_completed_{pt.name}={r.get('completed', 'nan')}")
            print(f"{label}_failed_{pt.name}={r.get('failed', 'nan')}")
            for q in PERCENTILES:
                print(f"{label}_ttft_p{q}_ms_{pt.name}={r.get(f'p{q}_ttft_ms', float('nan')):.2f}")
        for num, den in RATIOS:
            if num not in configs or den not in configs:
                continue
            for q in PERCENTILES:
                a = got.get((num, pt.name), {}).get(f"p{q}_ttft_ms")
                b = got.get((den, pt.name), {}).get(f"p{q}_ttft_ms")
                ratio = a / b if a and b else float("nan")
                print(f"{LABELS[num]}_over_{LABELS[den]}_ttft_p{q}_{pt.name}={ratio:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("work", type=Path)
    ap.add_argument("--rates", default="2,8,32")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", default=None,
                    help="load points by --max-concurrency (e.g. 1,16,64) instead of rates")
    ap.add_argument("--configs", default=None,
                    help="default plain,kvlease,nixl; pull-proxy,push-at-once,push with "
                    "--compare push")
    ap.add_argument("--compare", choices=("push",), default=None,
                    help="push: kvlease's push against its pull, at --concurrency 1,16,64 "
                    "unless given")
    args = ap.parse_args()
    if args.compare == "push" and args.concurrency is None:
        args.concurrency = "1,16,64"
    if args.configs is None:
        args.configs = ("pull-proxy,push-at-once,push" if args.compare == "push"
                        else "plain,kvlease,nixl")
    model = args.work / "model"
    if not (model / "model.safetensors").exists():
        make(model)
    pts = points(args)
    configs = args.configs.split(",")
    print(f"vllm_serve.prompts={args.prompts}")
    print(f"vllm_serve.input_len={args.input_len}")
    print(f"vllm_serve.output_len={args.output_len}")
    got: dict[tuple[str, str], dict] = {}
    for config in configs:
        with Fleet(args.work / config, str(model)) as fleet:
            url = start(fleet, config)
            # 8 prompts at the first point's load, seed 0.
            warm = Point("warmup", pts[0].rate, pts[0].concurrency, seed=0)
            bench(url, str(model), warm, argparse.Namespace(**{**vars(args), "prompts": 8}),
                  args.work / config / "warmup.json")
            for pt in pts:
                r = bench(url, str(model), pt, args, args.work / config / f"{pt.name}.json")
                got[(config, pt.name)] = r
                key = f"vllm_serve.{config}.{pt.name}"
                print(f"{key}.completed={r.get('completed', 'nan')}")
                print(f"{key}.failed={r.get('failed', 'nan')}")
                for m in METRICS:
                    for q in PERCENTILES:
                        print(f"{key}.{m}_p{q}_ms={r.get(f'p{q}_{m}_ms', float('nan')):.2f}")
                sys.stdout.flush()
    if args.compare == "push":
        compare_push(got, configs, pts)
        return
    for pt in pts:
        for m in METRICS:
            for q in PERCENTILES:
                k = f"p{q}_{m}_ms"
                ours = got.get(("kvlease", pt.name), {}).get(k)
                for peer in ("nixl", "plain"):
                    theirs = got.get((peer, pt.name), {}).get(k)
                    ratio = ours / theirs if ours and theirs else float("nan")
                    print(f"vllm_serve.{pt.name}.{m}_p{q}_kvlease_over_{peer}={ratio:.2f}")


if __name__ == "__main__":
    main()
