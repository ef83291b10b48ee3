#!/usr/bin/env bash
# Notification round trip only, ours and NIXL 1.5.1 interleaved in the same run (the
# machine is shared and noisy): REPS rounds (default 5) of four pairs, one after another:
#   ours TCP   tcp_bench --backend tcp (4-byte notif ping-pong D -> P -> D, 2000 samples,
#              both sides busy-poll get_new_notifs with yield)
#   ours shm   tcp_bench --backend shm (the same over the same-host shared-memory backend)
#   NIXL TCP   nixl_pair.py with UCX_TLS=tcp (PING<n>/PONG<n> ping-pong, 1000 samples, both
#              sides busy-poll get_new_notifs)
#   NIXL UCX defaults  the same with UCX_TLS unset (READ over cma; notifications, UCX
#              active messages, still go over tcp/lo)
# Each tool prints its median; this prints every round, then the median of the rounds per
# pair and notif_ratio_vs_nixl= (ours TCP / NIXL TCP; ratio= is the same figure, its old
# name) and shm_notif_ratio_vs_nixl= (ours shm / NIXL UCX defaults). A pair that fails in
# a round counts as nan there (reason on stderr) and is left out of its median. Both tools
# also run short READ phases first (not reported).
# Env: KVLEASE_NIXL_VENV (default /var/tmp/kvlease-nixl-venv), CARGO_TARGET_DIR, REPS.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/bench/lib.sh
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
cargo build -q --release --locked -p kvlease-transport --no-default-features --example tcp_bench >&2
BENCH=$CARGO_TARGET_DIR/release/examples/tcp_bench
nixl_ok=0
nixl_venv && nixl_ok=1
bench_tmp

ours() { # BACKEND: prints the median RTT, or fails
  local o
  o=$(timeout 90 "$BENCH" --backend "$1" --seconds 0.05 --no-write) || return 1
  grep -qx "backend=$1" <<<"$o" || [ "$1" = tcp ] \
    || { echo "tcp_bench printed no backend=$1 (built without --backend?)" >&2; return 1; }
  sed -n 's/^notif_rtt_us=//p' <<<"$o" | grep .
}
nixl() { # MODE ENV...: prints the median RTT, or fails
  local o
  o=$(nixl_run "$1" 0.1 "${@:2}" 2>"$BENCH_TMP/nixl.err") \
    || { tail -n 3 "$BENCH_TMP/nixl.err" >&2; return 1; }
  sed -n "s/^nixl_$1_notif_rtt_us=//p" <<<"$o" | grep .
}
one() { # LABEL CMD...: the figure, or nan with the reason on stderr
  local v
  if v=$("${@:2}"); then echo "$v"; else echo "round $r: $1 failed" >&2; echo nan; fi
}

tcp=() shm=() ntcp=() nshm=()
for r in $(seq "${REPS:-5}"); do
  a=$(one ours_tcp ours tcp)
  b=$(one ours_shm ours shm)
  c=$(one nixl_tcp nixl tcp UCX_TLS=tcp UCX_NET_DEVICES=lo)
  d=$(one nixl_shm nixl shm -u UCX_TLS -u UCX_NET_DEVICES)
  echo "round=$r notif_rtt_us=$a shm_notif_rtt_us=$b nixl_tcp_notif_rtt_us=$c nixl_shm_notif_rtt_us=$d"
  tcp+=("$a") shm+=("$b") ntcp+=("$c") nshm+=("$d")
done
python3 - "${tcp[*]}" "${shm[*]}" "${ntcp[*]}" "${nshm[*]}" <<'PY'
import math, statistics, sys


def med(s):
    v = [float(x) for x in s.split()]
    v = [x for x in v if math.isfinite(x)]
    return statistics.median(v) if v else math.nan


def ratio(a, b):
    return f"{a / b:.2f}" if math.isfinite(a) and math.isfinite(b) and b > 0 else "nan"


tcp, shm, ntcp, nshm = (med(s) for s in sys.argv[1:5])
print(f"median_notif_rtt_us={tcp:.1f}")
print(f"median_shm_notif_rtt_us={shm:.1f}")
print(f"median_nixl_notif_rtt_us={ntcp:.1f}")
print(f"median_nixl_shm_notif_rtt_us={nshm:.1f}")
print(f"notif_ratio_vs_nixl={ratio(tcp, ntcp)}")
print(f"shm_notif_ratio_vs_nixl={ratio(shm, nshm)}")
print(f"ratio={ratio(tcp, ntcp)}")
PY
