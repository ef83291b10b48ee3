#!/usr/bin/env bash
# kvlease's push mode against its pull on real CPU vLLM engines: `vllm bench serve` at
# --max-concurrency 1, 16 and 64 (64 prompts each, every point its own prompts) through
# P/D with KvleaseConnector behind vLLM's toy proxy (pull) and P/D in push mode
# (`transfer_mode: push` on P, KvleasePushConnector on D) behind push_proxy.py (vLLM's push
# proxy's flow); TTFT p50/p99 and answers per point, and push/pull ratios, as key=value:
# `pull_ttft_p50_ms_c16=`, `push_ttft_p50_ms_c16=`, `push_over_pull_ttft_p50_c16=`, ...
#
#   scripts/bench/vllm-push.sh                                    ~8 min on 2 cores
#   scripts/bench/vllm-push.sh --concurrency 1,8 --prompts 32
#   scripts/bench/vllm-push.sh --configs kvlease,push,nixl,nixl-push   NIXL's pull and push too
#
# The environment and results directory are scripts/bench/vllm-serve.sh's (this runs it
# with `--compare push`; arguments go to vllm_serve.py).
set -euo pipefail
exec bash "$(dirname "$0")/vllm-serve.sh" --compare push "$@"
