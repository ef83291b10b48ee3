#!/usr/bin/env bash
# The Python half of the tests: the `kvlease` package (PyO3, crates/python) and its vLLM
# connector, inside vLLM's real scheduler and with real bytes between P and D processes.
#
#   scripts/python-test.sh                  as root on Debian: installs what is missing, runs all
#   scripts/python-test.sh -k heartbeat     extra arguments go to pytest
#   KVLEASE_VLLM_VENV=/path                 the virtual environment (default /var/tmp/kvlease-vllm-venv)
#   KVLEASE_PYTHON=python3.11               the interpreter that makes the venv (default python3)
#   KVLEASE_PYTHON_TEST_TIMEOUT=1800        the whole pytest run, seconds
#
# Idempotent: the venv is made, and vllm==$VLLM_VERSION, pytest and maturin installed into it
# (about 2.5 minutes, 9.5 GB on disk), only when it does not already import them at those
# versions. Our package is rebuilt and reinstalled on every run (`pip install ./crates/python`;
# cargo keeps its build, so an unchanged tree rebuilds in seconds). The tests run offline:
# HF_HOME points at a temporary fake hub cache entry (a tiny OPT config, no weights), which
# is removed at the end with every process the run started. No GPU is needed.
# The last line is `python-test: OK` or `python-test: FAILED <why>`.
set -euo pipefail
cd "$(dirname "$0")/.."
STARTED=$(date +%s)

VLLM_VERSION=0.33.0
VENV=${KVLEASE_VLLM_VENV:-/var/tmp/kvlease-vllm-venv}
PYTHON=${KVLEASE_PYTHON:-python3}
TIME_LIMIT=${KVLEASE_PYTHON_TEST_TIMEOUT:-1800}
log() { echo "python-test: $*" >&2; }
fail() { echo "python-test: FAILED $*"; exit 1; }
. scripts/lib/pyenv.sh

# --- the virtual environment -----------------------------------------------------------
venv_ready() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$VLLM_VERSION" <<'EOF' >/dev/null 2>&1
import importlib.metadata as md, sys
assert md.version("vllm") == sys.argv[1]
import pytest, maturin  # noqa: F401
EOF
}
if ! venv_ready; then
  need_venv_module "$PYTHON"
  log "making $VENV with vllm==$VLLM_VERSION, pytest, maturin (a few minutes, ~9.5 GB)"
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip >&2
  "$VENV/bin/pip" install -q "vllm==$VLLM_VERSION" pytest "maturin>=1.9,<2" >&2 \
    || fail "pip install vllm==$VLLM_VERSION"
  venv_ready || fail "$VENV does not import vllm==$VLLM_VERSION, pytest and maturin after installing them"
fi
PY="$VENV/bin/python"

# --- our package -------------------------------------------------------------------------
t=$(date +%s)
install_kvlease "$VENV"
echo "python_test.install_s=$(( $(date +%s) - t ))"

# --- run ------------------------------------------------------------------------------------
WORK=$(mktemp -d /tmp/kvlease-pytest.XXXXXX)
cleanup() {
  # Every process of the run is in pytest's session: the workers it spawned too.
  kill_pytest
  rm -rf "$WORK"
}
trap cleanup EXIT
export KVLEASE_TEST_HF_HOME="$WORK/hf-home"
export PYTHONDONTWRITEBYTECODE=1
log "pytest crates/python/tests (limit ${TIME_LIMIT}s)"
t=$(date +%s)
# The serving tests need another vLLM build: scripts/serve-test.sh runs them.
run_pytest "$TIME_LIMIT" "$PY" crates/python/tests --ignore=crates/python/tests/serve "$@"
echo "python_test.pytest_s=$(( $(date +%s) - t ))"
echo "python_test.total_s=$(( $(date +%s) - STARTED ))"
[ "$PYTEST_RC" = 124 ] && fail "pytest ran past ${TIME_LIMIT}s"
[ "$PYTEST_RC" = 0 ] || fail "pytest exit status $PYTEST_RC"
echo "python-test: OK"
