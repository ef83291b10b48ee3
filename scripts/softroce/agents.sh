#!/usr/bin/env bash
# Runs the real agents over SoftRoCE (verbs) inside ONE throw-away qemu guest: P
# (prefill-agent on 10.77.2.1, whose address selects rdma device rxeP), D (decode-agent on
# 10.77.2.2 -> rxeD) and kvlease-proxy, all with --transport verbs (a verbs failure is an
# error, never a silent TCP fallback). The binaries are built on the host; the guest runs
# scripts/softroce/guest-agents.sh (see its header for every check). It fails unless:
#   - every request through the proxy succeeds with the kv_digest computed from the prompt;
#   - D's /metrics name verbs for P (kvlease_peer_backend) and count every transfer under
#     kvlease_transfers_total{backend="verbs"}, none under tcp; D's log says "backend: verbs";
#   - P's held blocks go back to 0 through read-done notifications (granted == released
#     "completed", none expired);
#   - after kill -9 of D with leases outstanding, P frees every block within the lease
#     TTL + 1 s ($AG_LEASE_S, default 3 s);
#   - P, D and the proxy exit 0 on SIGTERM.
# Then push mode (--transfer-mode push on P, D and kvlease-proxy, still --transport verbs,
# host memory): D grants P remote-write access to each reservation's blocks and P writes
# them with RDMA WRITEs. It fails unless:
#   - every request succeeds with the kv_digest computed from the prompt;
#   - D's /metrics name verbs for P and count every transfer under backend="verbs"; D's
#     log says "backend: verbs" and "connected to P for pushes ... backend=verbs"; D made
#     write grants (kvlease_push_write_grants_total) and P posted every write into them
#     (kvlease_push_writes_granted_total = requests);
#   - every reservation ends written on D and every push written on P; blocks held 0 on both;
#   - after kill -9 of P with reservations outstanding, D expires them and frees every
#     block within the lease + 2 s ($AG_PUSH_LEASE_S, default 10 s); D and the proxy exit 0
#     on SIGTERM.
# Prints key=value lines and a last line "agents.sh: rc=... wall_s=...".
#
#   usage: scripts/softroce/agents.sh
#   env: AG_PROFILE=debug|release (default debug: `cargo test --workspace` in CI has built
#          these binaries already, with the same workspace feature set; measured under TCG:
#          debug VM run 69 s for the pull phases, p50 3.0 s per request, about 205 s with the
#          push phase; release 28 s (pull), p50 0.35 s, but a release build from clean costs
#          minutes), AG_REQUESTS (24), AG_LEASE_S (3),
#        AG_MEMORIES (default "host staged": a run with host memory, then one with --memory staged
#        on P and D, whose batches go over verbs through registered host mirrors),
#        AG_MODES (default "pull push"), AG_PUSH_US_PER_TOKEN (P's prefill cost in push mode,
#        default 200 µs per token: reservations outstanding long enough to kill P under them),
#        AG_PUSH_LEASE_S (10), AG_PUSH_REQUESTS (12),
#        SR_TEST_TIMEOUT (VM wall-clock limit, s; default 420: the pull phases and the push phase took 188-205 s on a quiet machine), SR_DIR, SR_ACCEL (tcg).
# Run it under `flock /tmp/kvlease-vm.lock` where several users share the machine.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HERE=$ROOT/scripts/softroce
cd "$ROOT"
T0=$(date +%s)

bash "$HERE/setup-host.sh" >/dev/null || { echo "softroce/agents.sh: setup-host.sh failed" >&2; exit 1; }

PROFILE=${AG_PROFILE:-debug}
profile_flag=()
[ "$PROFILE" = release ] && profile_flag=(--release)
# --workspace: the features cargo test --workspace resolves, so CI's build is reused.
cargo build "${profile_flag[@]}" --locked -q --workspace --bin prefill-agent --bin decode-agent \
  --bin kvlease-proxy --example demo_load \
  || { echo "softroce/agents.sh: build failed" >&2; exit 1; }
target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
export AG_BIN="$target_dir/$PROFILE"
export AG_LOAD="$AG_BIN/examples/demo_load"
for b in prefill-agent decode-agent kvlease-proxy; do
  [ -x "$AG_BIN/$b" ] || { echo "softroce/agents.sh: $AG_BIN/$b missing" >&2; exit 1; }
done
[ -x "$AG_LOAD" ] || { echo "softroce/agents.sh: $AG_LOAD missing" >&2; exit 1; }
echo "softroce/agents.sh: built ($PROFILE) in $(( $(date +%s) - T0 )) s"

export AG_REQUESTS=${AG_REQUESTS:-24} AG_LEASE_S=${AG_LEASE_S:-3} AG_MEMORIES=${AG_MEMORIES:-host staged}
export AG_MODES=${AG_MODES:-pull push} AG_PUSH_US_PER_TOKEN=${AG_PUSH_US_PER_TOKEN:-200}
export AG_PUSH_LEASE_S=${AG_PUSH_LEASE_S:-10} AG_PUSH_REQUESTS=${AG_PUSH_REQUESTS:-12}
export AG_LOGS=/tmp/kvlease-agents RUST_BACKTRACE=1
export SR_TIMEOUT=${SR_TEST_TIMEOUT:-420}
LOG=$(mktemp /tmp/kvlease-agents.XXXXXX.log)
T1=$(date +%s)
timeout -k 10 $(( SR_TIMEOUT + 30 )) bash "$HERE/rxe-vm-exec.sh" bash "$HERE/guest-agents.sh" 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
vm_s=$(( $(date +%s) - T1 ))
if [ "$rc" = 0 ] && ! grep -aqx 'agents: OK' "$LOG"; then rc=1; fi
echo "softroce/agents.sh: rc=$rc vm_wall_s=$vm_s wall_s=$(( $(date +%s) - T0 ))"
# The guest must end without a kernel oops, BUG or panic (run-vm.sh boots with oops=panic).
if grep -aqE 'Kernel panic|BUG:|Oops' "$LOG"; then
  echo "softroce/agents.sh: the VM's console shows a kernel panic, BUG or Oops:"
  grep -aE 'Kernel panic|BUG:|Oops' "$LOG" | head -5
  rc=1
fi
rm -f "$LOG"
exit "$rc"
