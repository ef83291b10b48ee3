#!/usr/bin/env bash
# Runs the project's SoftRoCE tests (crates/transport/tests/rxe.rs) inside ONE throw-away
# qemu guest that has two rxe devices (rxeP on vP 10.77.2.1, rxeD on vD 10.77.2.2; see
# guest-rxe-setup.sh). The test binary is built on the host; the guest runs it from the
# shared root file system with --include-ignored (the device tests are #[ignore]d so that a
# host without RDMA lists them as ignored) and KVLEASE_REQUIRE_RDMA=1, so a broken harness
# fails instead of skipping. Exits non-zero on any failure or when a test stayed ignored;
# prints cargo's test summary line.
#   env: SR_TEST_ARGS (extra libtest args, e.g. --nocapture), SR_TEST_TIMEOUT (VM wall-clock limit, s; default 240), SR_DIR, SR_ACCEL (tcg)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HERE=$ROOT/scripts/softroce
cd "$ROOT"
T0=$(date +%s)

bash "$HERE/setup-host.sh" >/dev/null || { echo "softroce/test.sh: setup-host.sh failed" >&2; exit 1; }

# Build on the host (cargo under TCG is 10-15x slower); find the binary from cargo's JSON.
json=$(cargo test -p kvlease-transport --features verbs --test rxe --no-run --locked \
  --message-format=json) || { echo "softroce/test.sh: build failed" >&2; exit 1; }
bin=$(printf '%s\n' "$json" | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == "rxe" \
            and m.get("executable"):
        print(m["executable"])
')
[ -x "$bin" ] || { echo "softroce/test.sh: rxe test binary not found" >&2; exit 1; }
echo "softroce/test.sh: built $bin in $(( $(date +%s) - T0 )) s"

LOG=$(mktemp /tmp/kvlease-rxe.XXXXXX.log)
export KVLEASE_REQUIRE_RDMA=1 KV_TEST_RDMA_DEV=rxeP KV_TEST_RDMA_PEER_DEV=rxeD \
  KV_TEST_RDMA_ADDR=10.77.2.1 KV_TEST_RDMA_PEER_ADDR=10.77.2.2 RUST_BACKTRACE=1
export SR_TIMEOUT=${SR_TEST_TIMEOUT:-240}
# Hard limit on the whole VM run (qemu is also limited by SR_TIMEOUT inside run-vm.sh).
timeout -k 10 $(( SR_TIMEOUT + 30 )) bash "$HERE/rxe-vm-exec.sh" "$bin" --include-ignored --test-threads=1 ${SR_TEST_ARGS:-} 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
summary=$(grep -a '^test result:' "$LOG" | tail -1)
echo "softroce/test.sh: rc=$rc wall_s=$(( $(date +%s) - T0 )) ${summary:-no test summary (VM or binary failed)}"
if [ "$rc" = 0 ] && [ -z "$summary" ]; then rc=1; fi
if [ "$rc" = 0 ] && ! printf '%s' "$summary" | grep -q ' 0 failed'; then rc=1; fi
# --include-ignored runs every test: one still ignored means the selection went wrong.
if [ "$rc" = 0 ] && ! printf '%s' "$summary" | grep -q ' 0 ignored'; then rc=1; fi
# The guest must end without a kernel oops, BUG or panic (run-vm.sh boots with oops=panic).
if grep -aqE 'Kernel panic|BUG:|Oops' "$LOG"; then
  echo "softroce/test.sh: the VM's console shows a kernel panic, BUG or Oops:"
  grep -aE 'Kernel panic|BUG:|Oops' "$LOG" | head -5
  rc=1
fi
rm -f "$LOG"
exit "$rc"
