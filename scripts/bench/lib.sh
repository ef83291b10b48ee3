# Helpers for scripts/bench/transport.sh and notif.sh (sourced, not run).
#   bench_tmp                 temp dir in $BENCH_TMP; on exit: background jobs killed, dir removed
#   free_port                 a TCP port free on 127.0.0.1 now
#   wait_listen PORT SECS     waits until something listens on PORT (fails after SECS)
#   peer LABEL "KEYS" [--prefix P] CMD...
#                             runs CMD, prints its key=value lines (keys prefixed with P) and
#                             appends them to $BENCH_TMP/all; each key of KEYS it did not print
#                             becomes KEY=nan, with CMD's exit status and stderr tail on stderr
#   get KEY                   the last value printed for KEY
#   ratio A B / fmax A B      A / B (2 decimals) / the larger; nan where an input is missing
#   nixl_venv / mooncake_venv make the peer's venv unless it already imports the peer
#                             ($NIXL_VENV, $MOONCAKE_VENV); fail (reason on stderr) if that fails
#   nixl_run MODE SECS ENV... one nixl_pair.py target and initiator under `env ENV...`; prints
#                             the initiator's lines (keys nixl_MODE_*); needs nixl_ok=1.
#                             NIXL_PYTHON (default the venv's python), NIXL_ARGS (an array of
#                             more arguments for both sides), NIXL_TIMEOUT (s, default 110)

NIXL_VENV=${KVLEASE_NIXL_VENV:-/var/tmp/kvlease-nixl-venv}
MOONCAKE_VENV=${KVLEASE_MOONCAKE_VENV:-/var/tmp/kvlease-mooncake-venv}

bench_tmp() {
  BENCH_TMP=$(mktemp -d)
  : >"$BENCH_TMP/all"
  trap 'jobs -p | xargs -r kill 2>/dev/null || true; rm -rf "$BENCH_TMP"' EXIT
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

wait_listen() {
  python3 - "$1" "$2" <<'EOF'
import sys, time

port, secs = int(sys.argv[1]), float(sys.argv[2])


def listening():
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(f).read().splitlines()[1:]
        except OSError:
            continue
        for r in rows:
            c = r.split()
            if c[3] == "0A" and int(c[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False


t0 = time.monotonic()
while not listening():
    if time.monotonic() - t0 > secs:
        sys.exit(1)
    time.sleep(0.05)
EOF
}

peer() {
  local label=$1 keys=$2 prefix="" rc=0 k missing=""
  shift 2
  if [ "${1:-}" = --prefix ]; then
    prefix=$2
    shift 2
  fi
  echo "--- $label" >&2
  "$@" >"$BENCH_TMP/$label.out" 2>"$BENCH_TMP/$label.err" || rc=$?
  sed -nE "s/^([a-z0-9_]+=)/${prefix}\1/p" "$BENCH_TMP/$label.out" >"$BENCH_TMP/$label.kv"
  for k in $keys; do
    grep -q "^$k=" "$BENCH_TMP/$label.kv" || {
      echo "$k=nan" >>"$BENCH_TMP/$label.kv"
      missing="$missing $k"
    }
  done
  tee -a "$BENCH_TMP/all" <"$BENCH_TMP/$label.kv"
  if [ "$rc" != 0 ] || [ -n "$missing" ]; then
    echo "$label failed (exit $rc)${missing:+; nan:$missing}. Its stderr ends:" >&2
    grep -v '^I[0-9]' "$BENCH_TMP/$label.err" | tail -n 6 | sed "s/^/  $label: /" >&2
  fi
}

get() { sed -n "s/^$1=//p" "$BENCH_TMP/all" | tail -n 1; }

ratio() {
  python3 -c '
import math, sys
try:
    a, b = (float(x) for x in sys.argv[1:3])
except ValueError:
    a = b = math.nan
print(f"{a / b:.2f}" if math.isfinite(a) and math.isfinite(b) and b > 0 else "nan")' "$1" "$2"
}

fmax() {
  python3 -c '
import math, sys
v = []
for x in sys.argv[1:]:
    try:
        v.append(float(x))
    except ValueError:
        pass
v = [x for x in v if math.isfinite(x)]
print(f"{max(v):.3f}" if v else "nan")' "$@"
}

# make_venv DIR IMPORTS PIP-ARGS...: idempotent; a venv that does not import IMPORTS is
# made again from scratch (--clear), so a half-finished install is not left behind.
make_venv() {
  local dir=$1 imports=$2
  shift 2
  "$dir/bin/python" -c "import $imports" >/dev/null 2>&1 && return 0
  echo "making venv $dir: pip install $*" >&2
  python3 -m venv --clear "$dir" >&2 \
    && timeout 900 "$dir/bin/pip" install -q --disable-pip-version-check "$@" >&2 \
    && "$dir/bin/python" -c "import $imports" >&2 \
    || { echo "venv $dir: could not make it (see above)" >&2; return 1; }
}
nixl_venv() { make_venv "$NIXL_VENV" "nixl._api, numpy" --no-deps nixl==1.5.1 nixl-cu12==1.5.1 numpy; }
mooncake_venv() {
  make_venv "$MOONCAKE_VENV" "mooncake.engine, numpy" mooncake-transfer-engine-non-cuda==0.3.13.post1 numpy
}

nixl_run() {
  local mode=$1 seconds=$2 port target rc=0
  shift 2
  [ "${nixl_ok:-0}" = 1 ] || { echo "no NIXL venv" >&2; return 1; }
  local py=${NIXL_PYTHON:-$NIXL_VENV/bin/python} limit=${NIXL_TIMEOUT:-110}
  port=$(free_port)
  env "$@" timeout $((limit + 10)) "$py" scripts/bench/nixl/nixl_pair.py \
    --mode target --port "$port" ${NIXL_ARGS[@]+"${NIXL_ARGS[@]}"} \
    >"$BENCH_TMP/nixl-$mode-target.log" 2>&1 &
  target=$!
  wait_listen "$port" 60 || { echo "NIXL target did not listen on $port" >&2; kill "$target" 2>/dev/null; return 1; }
  env "$@" timeout "$limit" "$py" scripts/bench/nixl/nixl_pair.py --mode initiator \
    --port "$port" --seconds "$seconds" --prefix "nixl_$mode" ${NIXL_ARGS[@]+"${NIXL_ARGS[@]}"} || rc=$?
  [ "$rc" = 0 ] || kill "$target" 2>/dev/null
  wait "$target" || { echo "NIXL target:" >&2; tail -n 3 "$BENCH_TMP/nixl-$mode-target.log" >&2; }
  return "$rc"
}
