#!/usr/bin/env bash
# Runs the real agents over SoftRoCE (verbs) across TWO throw-away qemu guests joined only to
# each other by qemu's `-netdev stream` over a UNIX socket (no host network, no user-mode
# net): P (prefill-agent) in guest P on 10.77.5.1, D (decode-agent), kvlease-proxy and the
# load generator in guest D on 10.77.5.2; each guest has one rxe device (rxe0) on its NIC,
# so every KV block moves by RDMA READ from one kernel's rxe into the other's. The
# binaries are built on the host; each guest runs scripts/softroce/guest-agents-2vm.sh (see
# its header for every check). It fails unless:
#   - every request through the proxy succeeds with the kv_digest computed from the prompt;
#   - D counts every transfer under kvlease_transfers_total{backend="verbs"} (none over tcp);
#   - P's held blocks go back to 0 through read-done notifications (granted == released
#     "completed", none expired);
#   - after kill -9 of D with leases outstanding, P frees every block within the lease
#     TTL + 1 s ($AG_LEASE_S, default 3 s);
#   - D, the proxy and P exit 0 on SIGTERM;
#   - neither guest's console shows "Kernel panic", "BUG:" or "Oops".
# Both guests are always shut down (trap). Prints key=value lines (p.*, d.*, vm_*.*) and a
# last line "agents-2vm: OK" or "agents-2vm: FAILED ...".
#
#   usage: scripts/softroce/agents-2vm.sh
#   env: AG_PROFILE=debug|release (default debug, as agents.sh), AG_REQUESTS (16),
#        AG_LEASE_S (3), AG_KV_HEADS / AG_HEAD_DIM (model shape; 2 / 16, see the guest
#        script), SR_TEST_TIMEOUT (each guest's wall-clock limit, s; default 240),
#        SR_MEM (per guest; 2G), SR_SMP (per guest; 2), SR_MTU (9000), SR_DIR.
# Measured (debug, TCG, 2 host cores shared with other builds): 55-75 s, VMs ~55 s.
# Run it under `flock /tmp/kvlease-vm.lock` where several users share the machine.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HERE=$ROOT/scripts/softroce
cd "$ROOT"
T0=$(date +%s)
SR_DIR=${SR_DIR:-/var/tmp/softroce}

bash "$HERE/setup-host.sh" >/dev/null || { echo "agents-2vm: FAILED: setup-host.sh failed"; exit 1; }

PROFILE=${AG_PROFILE:-debug}
profile_flag=()
[ "$PROFILE" = release ] && profile_flag=(--release)
# --workspace: the features cargo test --workspace resolves, so CI's build is reused.
cargo build "${profile_flag[@]}" --locked -q --workspace --bin prefill-agent --bin decode-agent \
  --bin kvlease-proxy --example demo_load \
  || { echo "agents-2vm: FAILED: build failed"; exit 1; }
target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
AG_BIN="$target_dir/$PROFILE"
AG_LOAD="$AG_BIN/examples/demo_load"
for b in prefill-agent decode-agent kvlease-proxy examples/demo_load; do
  [ -x "$AG_BIN/$b" ] || { echo "agents-2vm: FAILED: $AG_BIN/$b missing"; exit 1; }
done
echo "softroce/agents-2vm.sh: built ($PROFILE) in $(( $(date +%s) - T0 )) s"

PVM= DVM= TAIL= OUT=
cleanup() {
  local g
  for g in $TAIL; do kill "$g" 2>/dev/null; done
  # Each guest runs in its own session (setsid): end the whole group (run-vm.sh, timeout,
  # qemu), first politely, then for good.
  for g in $PVM $DVM; do kill -TERM -- "-$g" 2>/dev/null; done
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    alive=0
    for g in $PVM $DVM; do kill -0 -- "-$g" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.5
  done
  for g in $PVM $DVM; do kill -KILL -- "-$g" 2>/dev/null; done
  [ -n "${OUT:-}" ] && rm -rf "$OUT/bin"
}
trap cleanup EXIT
trap 'echo "agents-2vm: FAILED: interrupted"; exit 130' INT TERM

TMO=${SR_TEST_TIMEOUT:-240}
OUT=$(mktemp -d "$SR_DIR/agents-2vm.XXXXXX")
# The guests run a private copy of the binaries: a cargo build on the host during the run
# (another checkout user, an editor's check) rewrites target/ under the guests' 9p mount,
# and a running program whose executable changes under it crashes.
mkdir -p "$OUT/bin/examples"
for b in prefill-agent decode-agent kvlease-proxy examples/demo_load; do
  cp "$AG_BIN/$b" "$OUT/bin/$b" || { echo "agents-2vm: FAILED: cannot copy $AG_BIN/$b"; rm -rf "$OUT"; exit 1; }
done
AG_BIN=$OUT/bin
AG_LOAD=$AG_BIN/examples/demo_load
SOCK=$OUT/l2.sock

# Per-guest environment and boot payload (the guest sees the host fs read-only at the same
# paths, and $OUT/<role> read-write as /srout).
for role in P D; do
  mkdir -p "$OUT/$role"
  {
    printf 'export AG2_ROLE=%q AG_BIN=%q AG_LOAD=%q AG_REQUESTS=%q AG_LEASE_S=%q\n' \
      "$role" "$AG_BIN" "$AG_LOAD" "${AG_REQUESTS:-16}" "${AG_LEASE_S:-3}"
    printf 'export AG2_P_WAIT_S=%q SR_MTU=%q RUST_BACKTRACE=1\n' "$TMO" "${SR_MTU:-9000}"
    [ -n "${AG_KV_HEADS:-}" ] && printf 'export AG_KV_HEADS=%q\n' "$AG_KV_HEADS"
    [ -n "${AG_HEAD_DIM:-}" ] && printf 'export AG_HEAD_DIM=%q\n' "$AG_HEAD_DIM"
    [ -n "${AG_AUTH_TOKEN:-}" ] && printf 'export AG_AUTH_TOKEN=%q\n' "$AG_AUTH_TOKEN"
    printf 'cd %q || exit 126\n' "$ROOT"
    printf 'bash %q\n' "$HERE/guest-agents-2vm.sh"
    printf 'echo $? > /srout/rc\n'
  } > "$OUT/$role/boot.sh"
  chmod +x "$OUT/$role/boot.sh"
done

vm() { # role mac netdev
  SR_ACCEL=tcg SR_MEM=${SR_MEM:-2G} SR_SMP=${SR_SMP:-2} SR_TIMEOUT=$TMO SR_NETDEV=$3 SR_MAC=$2 \
    setsid bash "$HERE/run-vm.sh" "$OUT/$1/boot.sh" "$OUT/$1" </dev/null >"$OUT/$1.console" 2>&1 &
}
# Console text: no CRs, no terminal escapes, none of the boot/marker lines.
clean() {
  tr -d '\r' | sed -u -e 's/\x1b\[[0-9;?]*[a-zA-Z]//g' -e 's/\x1bc//g' \
    | grep -avE '^(SeaBIOS|Booting from ROM|SR-GUEST-UP|SR-EXIT=|\[ *[0-9.]+\] (sysrq|reboot):|$)'
}

T1=$(date +%s)
vm P 52:54:00:77:05:01 "stream,id=n0,server=on,addr.type=unix,addr.path=$SOCK"
PVM=$!
for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.1; done
if [ ! -S "$SOCK" ]; then
  cat "$OUT/P.console"
  echo "agents-2vm: FAILED: guest P's qemu did not open $SOCK within 10 s"
  exit 1
fi
vm D 52:54:00:77:05:02 "stream,id=n0,server=off,addr.type=unix,addr.path=$SOCK"
DVM=$!
# D's guest drives the test: show its console as it runs.
tail -n +1 -F --pid="$DVM" "$OUT/D.console" 2>/dev/null | clean &
TAIL=$!

# qemu itself is limited to $TMO s (run-vm.sh); this bound covers the rest.
deadline=$(( $(date +%s) + TMO + 30 ))
while kill -0 "$DVM" 2>/dev/null && [ "$(date +%s)" -lt "$deadline" ]; do sleep 1; done
kill -0 "$DVM" 2>/dev/null && echo "agents-2vm: guest D still running after $(( TMO + 30 )) s"
# D's guest is done (or gone): tell P's guest to stop P and power off.
touch "$OUT/P/stop"
deadline=$(( $(date +%s) + 60 ))
while kill -0 "$PVM" 2>/dev/null && [ "$(date +%s)" -lt "$deadline" ]; do sleep 1; done
kill -0 "$PVM" 2>/dev/null && echo "agents-2vm: guest P still running 60 s after the stop file"
cleanup
wait "$TAIL" 2>/dev/null
TAIL=
vm_s=$(( $(date +%s) - T1 ))
echo "----- guest P's console"
clean < "$OUT/P.console"
echo "-----"

why=()
for role in P D; do
  r=${role,,}
  rc=$(cat "$OUT/$role/rc" 2>/dev/null || echo none)
  echo "vm_$r.rc=$rc"
  [ "$rc" = 0 ] || why+=("guest $role's script rc=$rc")
  clean < "$OUT/$role.console" | grep -aqx "agents-2vm $role: OK" || why+=("guest $role did not report OK")
  # A kernel panic, BUG or Oops on the console (oops=panic makes an oops a panic, and
  # -no-reboot ends qemu) or in the kernel log the guest saved at its end.
  bad=$(cat "$OUT/$role.console" "$OUT/$role/dmesg.txt" 2>/dev/null | grep -acE 'Kernel panic|BUG:|Oops')
  echo "vm_$r.kernel_panic_lines=$bad"
  warn=no_kernel_log
  [ -f "$OUT/$role/dmesg.txt" ] && warn=$(grep -ac 'WARNING:' "$OUT/$role/dmesg.txt")
  echo "vm_$r.kernel_warnings=$warn"
  if [ "$bad" != 0 ]; then
    cat "$OUT/$role.console" "$OUT/$role/dmesg.txt" 2>/dev/null | grep -aE 'Kernel panic|BUG:|Oops' | clean | head -5
    why+=("kernel panic/BUG/Oops in guest $role's console or kernel log")
  fi
done
echo "softroce/agents-2vm.sh: vm_wall_s=$vm_s wall_s=$(( $(date +%s) - T0 ))"
if [ ${#why[@]} = 0 ]; then
  rm -rf "$OUT"
  echo "agents-2vm: OK"
  exit 0
fi
echo "agents-2vm: FAILED: $(IFS=';'; echo "${why[*]}") (consoles and logs kept in $OUT)"
exit 1
