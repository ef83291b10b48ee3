#!/bin/bash
# Guest side of agents.sh (runs inside the VM, after guest-rxe-setup.sh): the real
# prefill-agent (P, 10.77.2.1 -> rxeP), decode-agent (D, 10.77.2.2 -> rxeD) and
# kvlease-proxy, with --transport verbs (no TCP fallback), driven by demo_load.
# Pull mode (AG_MODES contains "pull"), per memory kind in $AG_MEMORIES (e.g. "host staged"):
#   1. $AG_REQUESTS requests through the proxy: all ok, every kv_digest equal to the one
#      computed from the prompt; D's kvlease_peer_backend names verbs for P and every
#      transfer counted under backend="verbs" (staged memory too: verbs serves it through
#      registered host mirrors); P's held blocks back to 0 by read-done
#      notifications (leases released "completed", none "expired").
#   2. (first memory kind only) long requests queue on D, kill -9 D with leases
#      outstanding: every lease outstanding at the kill must end within the lease TTL +
#      1 s (at that time P holds no lease but those granted after the kill, for a
#      prefill already running then), and P must free every block within 60 s.
#   3. D restarted, a few more requests; then SIGTERM to D, proxy, P: each must exit 0.
# Push mode (AG_MODES contains "push"; host memory, when $AG_MEMORIES names it): P, D and
# the proxy with --transfer-mode push (P at $AG_PUSH_US_PER_TOKEN µs per prompt token; P at
# --tp-size 2, D at 1: each of P's workers writes its heads into D's one worker):
#   4. $AG_PUSH_REQUESTS requests (lease $AG_PUSH_LEASE_S s): all ok, every kv_digest checked;
#      D's kvlease_peer_backend names verbs, every transfer counted under
#      backend="verbs", D's log has "backend: verbs" and "connected to P for pushes ...
#      backend=verbs"; D made write grants and every write went as RDMA WRITEs into them
#      (kvlease_push_writes_granted_total on P = requests); every reservation ended
#      written on D and every push written on P; blocks held back to 0 on both.
#   5. a burst with reservations outstanding on D, kill -9 P: D must end them (expired)
#      and free every block within the lease + 2 s; then SIGTERM to D and proxy: exit 0.
# Prints key=value lines; the last line is "agents: OK" or "agents: FAILED ...".
# Inputs (env, set by agents.sh): AG_BIN (dir of the agent binaries), AG_LOAD (demo_load),
# AG_REQUESTS, AG_LEASE_S, AG_MEMORIES, AG_MODES ("pull push"), AG_PUSH_US_PER_TOKEN (200),
# AG_PUSH_LEASE_S (10), AG_PUSH_REQUESTS (12), AG_LOGS (log dir).
set -uo pipefail
BIN=${AG_BIN:?}
LOAD=${AG_LOAD:?}
REQUESTS=${AG_REQUESTS:-24}
LEASE_S=${AG_LEASE_S:-3}
MEMORIES=${AG_MEMORIES:-host staged}
MODES=${AG_MODES:-pull push}
PULL_MEMORIES=; PUSH_MEMORIES=
case " $MODES " in *" pull "*) PULL_MEMORIES=$MEMORIES ;; esac
# Push runs with host memory only: P's write sources must be host-addressable.
case " $MODES " in *" push "*) case " $MEMORIES " in *" host "*) PUSH_MEMORIES=host ;; esac ;; esac
LOGS=${AG_LOGS:-/tmp/kvlease-agents}
mkdir -p "$LOGS"
P_IP=10.77.2.1
D_IP=10.77.2.2
# P and D listen beyond loopback: they refuse to start without a cluster token.
export KVLEASE_AUTH_TOKEN=${AG_AUTH_TOKEN:-softroce-agents-token}
P_URL="http://$P_IP:8100"
D_URL="http://$D_IP:8200"
X_URL="http://127.0.0.1:8300"
T0=$(date +%s.%N)
PIDS=()

fail() {
  echo "agents: FAILED: $*"
  for f in "$LOGS"/*.log; do
    [ -f "$f" ] || continue
    echo "----- tail of $f"
    tail -n 25 "$f"
  done
  # rxe's own counters (retries, sequence errors, ...), the non-zero ones.
  for d in rxeP rxeD; do
    echo "----- $d hw_counters: $(cd /sys/class/infiniband/$d/ports/1/hw_counters 2>/dev/null \
      && grep -H -v '^0$' -- * 2>/dev/null | tr '\n' ' ')"
  done
  for pid in "${PIDS[@]}"; do kill -9 "$pid" 2>/dev/null; done
  exit 1
}
emit() { echo "$1=$2"; }
metric() { timeout 20 "$LOAD" metric --url "$1" --name "$2"; }
since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.3f", b - a }'; }
num_eq() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a + 0 == b + 0) }'; }
key() { sed -n "s/^$2=//p" "$1" | tail -1; }

kv_config() { # role
  printf '{"kv_connector":"kvlease","kv_role":"%s","engine_id":null,"kv_connector_extra_config":{"kv_lease_duration":%s}}' \
    "$1" "$LEASE_S"
}

start_p() { # memory [extra flags]
  local mem=$1
  shift
  "$BIN/prefill-agent" --host "$P_IP" --port 8100 --side-channel-port 5600 \
    --transport verbs --memory "$mem" --engine-id agents-p "$@" \
    --kv-transfer-config "$(kv_config kv_producer)" >>"$LOGS/prefill.log" 2>&1 &
  P_PID=$!; PIDS+=("$P_PID")
}
start_d() { # memory generation [extra flags]
  local mem=$1 gen=$2
  shift 2
  "$BIN/decode-agent" --host "$D_IP" --port 8200 --side-channel-port 5700 \
    --transport verbs --memory "$mem" --engine-id "agents-d$gen" --max-running 2 --step-ms 10 "$@" \
    --kv-transfer-config "$(kv_config kv_consumer)" >>"$LOGS/decode.log" 2>&1 &
  D_PID=$!; PIDS+=("$D_PID")
}
start_proxy() { # [extra flags]
  "$BIN/kvlease-proxy" --host 127.0.0.1 --port 8300 --prefill "$P_URL" --decode "$D_URL" \
    --timeout-secs 60 "$@" >>"$LOGS/proxy.log" 2>&1 &
  X_PID=$!; PIDS+=("$X_PID")
}
wait_up() { # url what
  timeout 100 "$LOAD" wait-health --url "$1" --timeout-secs 90 >/dev/null \
    || fail "$2 ($1) did not answer /health within 90 s"
}
# SIGTERM, then wait (bounded) and require exit status 0.
stop_clean() { # pid what
  local t
  kill -TERM "$1" 2>/dev/null || fail "$2 was not running at shutdown"
  t=$(date +%s.%N)
  for _ in $(seq 200); do
    kill -0 "$1" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$1" 2>/dev/null; then
    kill -9 "$1"
    fail "$2 did not exit within 20 s of SIGTERM"
  fi
  wait "$1"
  local rc=$?
  emit "$3.exit_code" "$rc"
  emit "$3.exit_s" "$(since "$t")"
  [ "$rc" = 0 ] || fail "$2 exited with status $rc after SIGTERM"
}
# demo_load load; checks that all ok, no digest mismatch, and prints its key=value lines.
load_ok() { # label requests concurrency [extra args]
  local label=$1 n=$2 c=$3 out="$LOGS/$1.txt"
  shift 3
  timeout 300 "$LOAD" load --url "$X_URL" --label "$label" --requests "$n" --concurrency "$c" \
    --timeout-secs 120 "$@" >"$out" 2>"$LOGS/$label.err"
  local rc=$?
  cat "$out"
  [ "$rc" = 0 ] || { cat "$LOGS/$label.err"; fail "$label: load exited $rc"; }
  [ "$(key "$out" "$label.ok")" = "$n" ] || fail "$label: $(key "$out" "$label.ok") of $n requests ok"
  [ "$(key "$out" "$label.digest_mismatch")" = 0 ] || fail "$label: kv_digest mismatches"
  [ "$(key "$out" "$label.bad_answer")" = 0 ] || fail "$label: bad answers"
}
# P's lease state after a batch of completed requests: no held blocks, nothing expired.
check_released() { # label
  timeout 40 "$LOAD" wait-metric --url "$P_URL" --name kvlease_blocks_held --at-most 0 \
    --timeout-secs 30 --label "$1.p_blocks_held_zero" || fail "$1: P still holds blocks 30 s after the requests"
  local granted completed expired active
  granted=$(metric "$P_URL" kvlease_leases_granted_total)
  completed=$(metric "$P_URL" 'kvlease_leases_released_total{reason="completed"}')
  expired=$(metric "$P_URL" 'kvlease_leases_released_total{reason="expired"}')
  active=$(metric "$P_URL" kvlease_leases_active)
  emit "$1.p_leases_granted" "$granted"
  emit "$1.p_leases_completed" "$completed"
  emit "$1.p_leases_expired" "$expired"
  emit "$1.p_leases_active" "$active"
  num_eq "$active" 0 || fail "$1: P has $active active leases"
  num_eq "$granted" "$completed" || fail "$1: $granted leases granted but $completed released by read-done"
  num_eq "$expired" 0 || fail "$1: $expired leases expired with D alive"
}
# D's view of the backend: P's engine on verbs; host memory and staged memory (standing
# for device memory without dmabuf, served through host mirrors) move over the queue pair.
check_verbs() { # label expected_verbs_transfers expected_tcp_transfers
  local gauge tcp_gauge verbs tcp
  gauge=$(metric "$D_URL" 'kvlease_peer_backend{peer="agents-p",backend="verbs"}')
  tcp_gauge=$(metric "$D_URL" 'kvlease_peer_backend{peer="agents-p",backend="tcp"}')
  verbs=$(metric "$D_URL" 'kvlease_transfers_total{backend="verbs"}')
  tcp=$(metric "$D_URL" 'kvlease_transfers_total{backend="tcp"}')
  emit "$1.d_peer_backend_verbs" "$gauge"
  emit "$1.d_transfers_verbs" "$verbs"
  emit "$1.d_transfers_tcp" "$tcp"
  # Queue pairs D reset because they completed nothing with reads outstanding (the
  # reads were posted again): reported, not failed on (rxe under load may need it).
  emit "$1.d_verbs_stall_resets" "$(metric "$D_URL" kvlease_verbs_stall_resets_total)"
  num_eq "$gauge" 1 && num_eq "$tcp_gauge" 0 || fail "$1: D's kvlease_peer_backend for agents-p is not verbs"
  num_eq "$verbs" "$2" || fail "$1: $verbs verbs transfers on D, expected $2"
  num_eq "$tcp" "$3" || fail "$1: $tcp transfers over TCP on D, expected $3"
  grep -q 'backend: verbs' "$LOGS/decode.log" || fail "$1: D's log has no 'backend: verbs' line"
}

for mem in $PULL_MEMORIES; do
  rm -f "$LOGS"/*.log
  T=$(date +%s.%N)
  emit run.memory "$mem"
  start_p "$mem"
  start_d "$mem" 0
  start_proxy
  wait_up "$P_URL" P; wait_up "$D_URL" D; wait_up "$X_URL" proxy
  emit "$mem.startup_s" "$(since "$T")"
  grep -q 'verbs backend ready' "$LOGS/prefill.log" || fail "P did not start the verbs backend"
  grep 'verbs backend ready' "$LOGS/prefill.log" | sed -n 's/.*device=\([^ ]*\).*/p.rdma_device=\1/p' | head -1
  grep 'verbs backend ready' "$LOGS/decode.log" | sed -n 's/.*device=\([^ ]*\).*/d.rdma_device=\1/p' | head -1

  load_ok "$mem.requests" "$REQUESTS" 4
  check_verbs "$mem" "$REQUESTS" 0
  check_released "$mem"

  if [ "$mem" = "${MEMORIES%% *}" ]; then
    # Long requests: D runs 2 at a time, the rest wait with their leases held on P.
    BURST=8
    timeout 300 "$LOAD" load --url "$X_URL" --label kill --requests "$BURST" --concurrency "$BURST" \
      --max-tokens 400 --stream-every 0 --allow-failures --timeout-secs 120 \
      >"$LOGS/kill.txt" 2>"$LOGS/kill.err" &
    BURST_PID=$!; PIDS+=("$BURST_PID")
    timeout 70 "$LOAD" wait-metric --url "$P_URL" --name kvlease_leases_active --at-least 3 \
      --timeout-secs 60 --label kill.leases_wait >/dev/null || fail "no leases outstanding on P before the kill"
    HELD=$(metric "$P_URL" kvlease_blocks_held)
    ACTIVE=$(metric "$P_URL" kvlease_leases_active)
    EXP0=$(metric "$P_URL" 'kvlease_leases_released_total{reason="expired"}')
    GRANTED0=$(metric "$P_URL" kvlease_leases_granted_total)
    kill -9 "$D_PID"
    KILL_T=$(date +%s.%N)
    { wait "$D_PID"; } 2>/dev/null
    emit kill.d_exit_code "$?"
    emit kill.leases_outstanding "$ACTIVE"
    emit kill.blocks_held "$HELD"
    BOUND=$(awk -v d="$LEASE_S" 'BEGIN { printf "%.3f", d + 1 }')
    # Every lease outstanding at the kill ends within the bound (lease TTL + 1 s): at the
    # kill + the bound, P holds no lease but those it granted after the kill (a prefill
    # already running then, a proxy retry under load, grants one that lives its TTL from
    # its grant; one of those that already ended by then loosens the check by one). Both
    # counts come from one scrape, taken once the bound has passed, in the background
    # while the reclaim is timed.
    (
      sleep "$(awk -v b="$BOUND" -v e="$(since "$KILL_T")" 'BEGIN { d = b - e; printf "%.3f", (d > 0 ? d : 0) }')"
      timeout 20 "$LOAD" metric --url "$P_URL" --name kvlease_leases_active \
        --name kvlease_leases_granted_total >"$LOGS/kill.at_bound" || true
      since "$KILL_T" >"$LOGS/kill.sampled_at"
    ) &
    SAMPLER=$!; PIDS+=("$SAMPLER")
    timeout 70 "$LOAD" wait-metric --url "$P_URL" --name kvlease_blocks_held --at-most 0 \
      --timeout-secs 60 --label kill.reclaim >/dev/null || fail "P did not free D's blocks within 60 s of kill -9"
    RECLAIM=$(since "$KILL_T")
    wait "$SAMPLER"
    SAMPLED=$(cat "$LOGS/kill.sampled_at")
    ACTIVE_B=$(sed -n 1p "$LOGS/kill.at_bound")
    [ -n "$ACTIVE_B" ] || fail "P's metrics unreadable after the kill"
    AFTER=$(awk -v a="$(sed -n 2p "$LOGS/kill.at_bound")" -v b="$GRANTED0" 'BEGIN { print a - b }')
    emit kill.reclaim_bound_s "$BOUND"
    emit kill.sampled_at_s "$SAMPLED"
    emit kill.leases_active_at_bound "$ACTIVE_B"
    emit kill.leases_granted_after_kill "$AFTER"
    awk -v s="$SAMPLED" -v b="$BOUND" 'BEGIN { exit !(s >= b) }' || fail "P's leases sampled ${SAMPLED}s after the kill, before the bound ${BOUND}s"
    awk -v a="$ACTIVE_B" -v g="$AFTER" 'BEGIN { exit !(a <= g) }' \
      || fail "P still held $ACTIVE_B lease(s) ${SAMPLED}s after the kill, $AFTER granted since: a lease outstanding at the kill outlived the bound ${BOUND}s (lease TTL ${LEASE_S}s + 1 s)"
    EXP1=$(metric "$P_URL" 'kvlease_leases_released_total{reason="expired"}')
    emit kill.reclaim_s "$RECLAIM"
    emit kill.leases_expired "$(awk -v a="$EXP1" -v b="$EXP0" 'BEGIN { print a - b }')"
    num_eq "$(metric "$P_URL" kvlease_leases_active)" 0 || fail "P still has active leases after the reclaim"
    awk -v a="$EXP1" -v b="$EXP0" 'BEGIN { exit !(a - b > 0) }' || fail "no lease expired after kill -9 D"
    wait "$BURST_PID"
    sed -n 's/^\(kill\.\(ok\|failed\|digest_mismatch\)\)=/\1=/p' "$LOGS/kill.txt"
    [ "$(key "$LOGS/kill.txt" kill.digest_mismatch)" = 0 ] || fail "kill: kv_digest mismatch on a request that succeeded"

    start_d "$mem" 1
    wait_up "$D_URL" "restarted D"
    load_ok "$mem.after" 8 4
  fi

  stop_clean "$D_PID" D "$mem.d"
  stop_clean "$X_PID" proxy "$mem.proxy"
  stop_clean "$P_PID" P "$mem.p"
  PIDS=()
  p50=$(key "$LOGS/$mem.requests.txt" "$mem.requests.p50_ms")
  emit "$mem.result" "ok requests=$REQUESTS backend=verbs p50_ms=$p50 wall_s=$(since "$T")"
done

# Push mode (--transfer-mode push on P, D and the proxy; host memory, the one P pushes
# from): D reserves blocks, publishes the reservation's generation in their fence words,
# grants P remote-write access to them and P writes them with RDMA WRITEs.
# P prefills at $PUSH_US_PER_TOKEN µs per prompt token, so that reservations are
# outstanding long enough to kill P under them.
PUSH_US_PER_TOKEN=${AG_PUSH_US_PER_TOKEN:-200}
# The push phase's lease (P's and D's kv_lease_duration) and request count: under TCG a
# push (D's grants registered, P's WRITEs, D's verification in a debug build) took a p50
# of 10 s at 4 in flight, and a 3 s lease expired reservations that P was still writing.
PUSH_LEASE_S=${AG_PUSH_LEASE_S:-10}
PUSH_REQUESTS=${AG_PUSH_REQUESTS:-12}
# A push's checks after its requests: all written on both sides, nothing held.
check_pushed() { # label requests
  local n=$2 reservations written ended_p granted grants verbs tcp gauge
  timeout 40 "$LOAD" wait-metric --url "$D_URL" --name kvlease_blocks_held --at-most 0 \
    --timeout-secs 30 --label "$1.d_blocks_held_zero" || fail "$1: D still holds blocks 30 s after the requests"
  timeout 40 "$LOAD" wait-metric --url "$P_URL" --name kvlease_blocks_held --at-most 0 \
    --timeout-secs 30 --label "$1.p_blocks_held_zero" || fail "$1: P still holds blocks 30 s after the requests"
  reservations=$(metric "$D_URL" kvlease_push_reservations_total)
  written=$(metric "$D_URL" 'kvlease_push_reservations_ended_total{outcome="written"}')
  ended_p=$(metric "$P_URL" 'kvlease_pushes_ended_total{outcome="written"}')
  granted=$(metric "$P_URL" kvlease_push_writes_granted_total)
  grants=$(metric "$D_URL" kvlease_push_write_grants_total)
  gauge=$(metric "$D_URL" 'kvlease_peer_backend{peer="agents-p",backend="verbs"}')
  verbs=$(metric "$D_URL" 'kvlease_transfers_total{backend="verbs"}')
  tcp=$(metric "$D_URL" 'kvlease_transfers_total{backend="tcp"}')
  emit "$1.d_reservations" "$reservations"
  emit "$1.d_reservations_written" "$written"
  emit "$1.d_reservations_active" "$(metric "$D_URL" kvlease_push_reservations_active)"
  emit "$1.d_write_grants" "$grants"
  emit "$1.d_peer_backend_verbs" "$gauge"
  emit "$1.d_transfers_verbs" "$verbs"
  emit "$1.d_transfers_tcp" "$tcp"
  emit "$1.p_pushes_written" "$ended_p"
  emit "$1.p_writes_posted" "$(metric "$P_URL" kvlease_push_writes_posted_total)"
  emit "$1.p_writes_granted" "$granted"
  emit "$1.p_writes_failed" "$(metric "$P_URL" kvlease_push_writes_failed_total)"
  num_eq "$reservations" "$n" || fail "$1: $reservations reservations on D for $n requests"
  num_eq "$written" "$n" || fail "$1: $written of $n reservations ended written on D"
  num_eq "$ended_p" "$n" || fail "$1: $ended_p of $n pushes ended written on P"
  num_eq "$gauge" 1 || fail "$1: D's kvlease_peer_backend for agents-p is not verbs"
  num_eq "$verbs" "$n" || fail "$1: $verbs verbs transfers on D, expected $n"
  num_eq "$tcp" 0 || fail "$1: $tcp transfers over TCP on D"
  grep -q 'backend: verbs' "$LOGS/decode.log" || fail "$1: D's log has no 'backend: verbs' line"
  grep 'connected to P for pushes' "$LOGS/decode.log" | grep -q 'backend=verbs' \
    || fail "$1: D's log has no 'connected to P for pushes ... backend=verbs' line"
  num_eq "$granted" "$n" || fail "$1: $granted of $n writes went as RDMA WRITEs into D's grants"
  awk -v g="$grants" -v n="$n" 'BEGIN { exit !(g >= n) }' || fail "$1: $grants write grants on D for $n reservations"
}

LEASE_S=$PUSH_LEASE_S
for mem in $PUSH_MEMORIES; do
  rm -f "$LOGS"/*.log
  T=$(date +%s.%N)
  emit push.memory "$mem"
  # P's TP size differs from D's: P's 2 workers write their heads into D's 1 worker, both
  # into D's grants for its rank 0.
  start_p "$mem" --transfer-mode push --prefill-us-per-token "$PUSH_US_PER_TOKEN" --tp-size 2
  start_d "$mem" 2 --transfer-mode push
  start_proxy --transfer-mode push
  wait_up "$P_URL" P; wait_up "$D_URL" D; wait_up "$X_URL" proxy
  emit "push.$mem.startup_s" "$(since "$T")"
  n=$PUSH_REQUESTS
  load_ok "push.$mem.requests" "$n" 4
  check_pushed "push.$mem" "$n"

  # P killed with reservations outstanding: no heartbeat renews them, D must end them
  # and free their blocks within about one lease.
  BURST=8
  timeout 300 "$LOAD" load --url "$X_URL" --label pkill --requests "$BURST" --concurrency "$BURST" \
    --stream-every 0 --allow-failures --timeout-secs 120 \
    >"$LOGS/pkill.txt" 2>"$LOGS/pkill.err" &
  BURST_PID=$!; PIDS+=("$BURST_PID")
  timeout 70 "$LOAD" wait-metric --url "$D_URL" --name kvlease_push_reservations_active --at-least 2 \
    --timeout-secs 60 --label pkill.reservations_wait >/dev/null || fail "no reservations outstanding on D before the kill"
  ACTIVE=$(metric "$D_URL" kvlease_push_reservations_active)
  HELD=$(metric "$D_URL" kvlease_blocks_held)
  kill -9 "$P_PID"
  KILL_T=$(date +%s.%N)
  { wait "$P_PID"; } 2>/dev/null
  emit pkill.p_exit_code "$?"
  emit pkill.d_reservations_outstanding "$ACTIVE"
  emit pkill.d_blocks_held "$HELD"
  timeout 70 "$LOAD" wait-metric --url "$D_URL" --name kvlease_blocks_held --at-most 0 \
    --timeout-secs 60 --label pkill.free >/dev/null || fail "D did not free its blocks within 60 s of kill -9 P"
  FREED=$(since "$KILL_T")
  BOUND=$(awk -v d="$LEASE_S" 'BEGIN { printf "%.3f", d + 2 }')
  emit pkill.d_free_s "$FREED"
  emit pkill.d_free_bound_s "$BOUND"
  emit pkill.d_reservations_expired "$(metric "$D_URL" 'kvlease_push_reservations_ended_total{outcome="expired"}')"
  emit pkill.d_reservations_failed "$(metric "$D_URL" 'kvlease_push_reservations_ended_total{outcome="failed"}')"
  num_eq "$(metric "$D_URL" kvlease_push_reservations_active)" 0 || fail "D still has reservations after the kill"
  ENDED=$(metric "$D_URL" 'kvlease_push_reservations_ended_total{outcome="expired"}')
  awk -v e="$ENDED" 'BEGIN { exit !(e > 0) }' || fail "no reservation expired on D after kill -9 P"
  awk -v w="$FREED" -v b="$BOUND" 'BEGIN { exit !(w <= b) }' \
    || fail "D freed ${FREED}s after the kill, bound ${BOUND}s (lease ${LEASE_S}s + 2 s)"
  wait "$BURST_PID"
  sed -n 's/^\(pkill\.\(ok\|failed\|digest_mismatch\)\)=/\1=/p' "$LOGS/pkill.txt"
  [ "$(key "$LOGS/pkill.txt" pkill.digest_mismatch)" = 0 ] || fail "pkill: kv_digest mismatch on a request that succeeded"
  stop_clean "$D_PID" D "push.$mem.d"
  stop_clean "$X_PID" proxy "push.$mem.proxy"
  PIDS=()
  p50=$(key "$LOGS/push.$mem.requests.txt" "push.$mem.requests.p50_ms")
  emit "push.$mem.result" "ok requests=$n backend=verbs granted=yes p50_ms=$p50 wall_s=$(since "$T")"
done
emit agents.wall_s "$(since "$T0")"
echo "agents: OK"
