#!/usr/bin/env bash
# kvlease's push mode against its pull on real CPU vLLM engines: `vllm bench serve` at
# --max-concurrency 1, 16 and 64 (64 prompts each, every point its own prompts) through
# P/D with KvleaseConnector behind kvlease-proxy (pull), P/D in push mode
# (`transfer_mode: push` on P, KvleasePushConnector on D) behind `kvlease-proxy
# --transfer-mode push` (both legs at once) and behind push_proxy.py (P's leg first, then
# D's); TTFT p50/p99 and answers per point, and the ratios, as key=value:
# `pull_ttft_p50_ms_c16=`, `push_at_once_ttft_p50_ms_c16=`,
# `push_at_once_over_pull_ttft_p50_c16=`, `push_at_once_over_push_one_by_one_...`
#
#   scripts/bench/vllm-push.sh                                    ~12 min on 2 cores
#   scripts/bench/vllm-push.sh --concurrency 1,8 --prompts 32
#   scripts/bench/vllm-push.sh --configs pull-proxy,push-at-once,kvlease,nixl,nixl-push
#
# The environment and results directory are scripts/bench/vllm-serve.sh's (this runs it
# with `--compare push`; arguments go to vllm_serve.py).
set -euo pipefail
exec bash "$(dirname "$0")/vllm-serve.sh" --compare push "$@"
