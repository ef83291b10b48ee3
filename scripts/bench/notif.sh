#!/usr/bin/env bash
# Notification round trip only, ours and NIXL 1.5.1 interleaved in the same run (the
# machine is shared and noisy): REPS rounds (default 5) of
#   tcp_bench (4-byte notif ping-pong D -> P -> D, 2000 samples, both sides busy-poll
#   get_new_notifs with yield) then nixl_pair.py (PING<n>/PONG<n> ping-pong, 1000 samples,
#   both sides busy-poll get_new_notifs, UCX over TCP on loopback).
# Each tool prints its median; this prints every round, then the median of the rounds
# and ratio= (ours / NIXL). Both tools also run a short READ phase first (not reported).
# Env: KVLEASE_NIXL_VENV (default /var/tmp/kvlease-nixl-venv), CARGO_TARGET_DIR, REPS.
set -euo pipefail
cd "$(dirname "$0")/../.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
cargo build -q --release --locked -p kvlease-transport --no-default-features --example tcp_bench >&2
BENCH=$CARGO_TARGET_DIR/release/examples/tcp_bench
VENV=${KVLEASE_NIXL_VENV:-/var/tmp/kvlease-nixl-venv}
"$VENV/bin/python" -c 'import nixl._api, numpy' || { echo "no NIXL venv in $VENV: run scripts/bench/transport.sh once" >&2; exit 1; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
trap 'jobs -p | xargs -r kill 2>/dev/null || true' EXIT
ours=() nixl=()
for r in $(seq "${REPS:-5}"); do
  o=$(timeout 60 "$BENCH" --seconds 0.05 | sed -n 's/^notif_rtt_us=//p')
  port=$(free_port)
  timeout 60 "$VENV/bin/python" scripts/bench/nixl/nixl_pair.py --mode target --port "$port" >/dev/null 2>&1 &
  sleep 2
  n=$(timeout 55 "$VENV/bin/python" scripts/bench/nixl/nixl_pair.py --mode initiator --port "$port" --seconds 0.1 2>/dev/null \
    | sed -n 's/^nixl_notif_rtt_us=//p')
  wait || true
  echo "round=$r notif_rtt_us=${o:-nan} nixl_notif_rtt_us=${n:-nan}"
  ours+=("${o:-nan}") nixl+=("${n:-nan}")
done
python3 - "${ours[*]}" "${nixl[*]}" <<'PY'
import statistics, sys
o = [float(x) for x in sys.argv[1].split()]
n = [float(x) for x in sys.argv[2].split()]
mo, mn = statistics.median(o), statistics.median(n)
print(f"median_notif_rtt_us={mo:.1f}")
print(f"median_nixl_notif_rtt_us={mn:.1f}")
print(f"ratio={mo / mn:.2f}")
PY
