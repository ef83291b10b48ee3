#!/usr/bin/env bash
# The lease-versus-fixed-timeout study (issue 7), on one machine, real agent processes
# over TCP on localhost (crates/bench/src/bin/lease-study.rs):
#   1. D crash: steady load, kill -9 of D, D restarted 1 s later; P's held blocks sampled
#      every 100 ms; reclaim time and admitted-throughput recovery, lease vs fixed.
#      Durations scaled: lease 3 s vs fixed 48 s (--quick: 1 s vs 16 s), the 1:16 ratio
#      of the production 30 s lease vs the 480 s abort_request_timeout.
#   2. D overload: queue waits on D of 0.5x..10x a 1 s lease; expired leases and wasted
#      prefills, lease vs a fixed timeout as short as the lease.
#   3. Heartbeat cost: 10^5 tracked requests, 8 P engines, TP 4 (in-process state machines).
#   4. Transfer sweep: scripts/bench/transport.sh and verbs.sh (skipped with --quick
#      and with --only).
#   5. P crash in push mode: P, D and the proxy with --transfer-mode push, steady load,
#      kill -9 of P while D holds reservations for P's writes; D's blocks held sampled
#      every 100 ms until back to 0; lease vs D holding each reservation for the fixed
#      timeout (same scaled durations as 1).
#
#   scripts/bench/lease-study.sh [--quick] [--only crash,overload,heartbeat,push]
#
# Writes report.json and PNG plots into results/lease-study/ (logs in logs/ there),
# prints key=value lines (reclaim_s_lease= reclaim_s_fixed= expired_leases_lease= ...).
# Progress goes to stderr. Env: CARGO_TARGET_DIR, LEASE_STUDY_OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
quick=()
only=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=(--quick) ;;
    --only) [ $# -ge 2 ] || { echo "usage: $0 [--quick] [--only SCENARIO,...]" >&2; exit 2; }
      only=(--only "$2"); shift ;;
    *) echo "usage: $0 [--quick] [--only crash,overload,heartbeat,push]" >&2; exit 2 ;;
  esac
  shift
done
bash scripts/setup.sh study >&2
FONT=/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf
[ -r "$FONT" ] || { echo "lease-study: $FONT missing (apt-get install fonts-dejavu-core)" >&2; exit 1; }

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
echo "building agents, demo_load and lease-study (release)" >&2
cargo build -q --release --locked -p kvlease-agent --bins --example demo_load >&2
cargo build -q --release --locked -p kvlease-bench --bin lease-study >&2
BIN=$CARGO_TARGET_DIR/release

OUT=${LEASE_STUDY_OUT:-$PWD/results/lease-study}
mkdir -p "$OUT"
rm -rf "$OUT/logs"
transfer=()
if [ ${#quick[@]} -eq 0 ] && [ ${#only[@]} -eq 0 ]; then
  echo "transfer sweep: scripts/bench/transport.sh" >&2
  if bash scripts/bench/transport.sh >"$OUT/transport.txt" 2>"$OUT/transport.err"; then
    transfer+=(--transfer "transport=$OUT/transport.txt")
  else
    echo "lease-study: transport.sh failed (see $OUT/transport.err); left out of the report" >&2
  fi
  echo "transfer sweep: scripts/bench/verbs.sh" >&2
  if bash scripts/bench/verbs.sh >"$OUT/verbs.txt" 2>"$OUT/verbs.err"; then
    transfer+=(--transfer "verbs=$OUT/verbs.txt")
  else
    echo "lease-study: verbs.sh failed (see $OUT/verbs.err); left out of the report" >&2
  fi
fi
exec "$BIN/lease-study" --bin "$BIN" --out "$OUT" --font "$FONT" "${quick[@]}" "${only[@]}" "${transfer[@]}"
