#!/bin/bash
# Guest side of agents-2vm.sh: runs inside EACH of two qemu guests whose only NIC is a
# private wire to the other guest (qemu -netdev stream over a UNIX socket). Each guest
# brings up its NIC (eth0, MTU $SR_MTU, default 9000 -> rxe active_mtu 4096) with one
# address and one SoftRoCE device rxe0 on it:
#   AG2_ROLE=P  10.77.5.1: prefill-agent (P) only. Serves until the host creates
#               /srout/stop (after D's guest has finished), then SIGTERM: P must exit 0.
#   AG2_ROLE=D  10.77.5.2: decode-agent (D), kvlease-proxy and the load generator; every
#               request and every metric read of P crosses the wire:
#     0. one warm-up request (D's first handshake with P), reported only.
#     1. $AG_REQUESTS requests through the proxy: all ok, every kv_digest equal to the one
#        computed from the prompt; D counts each transfer under backend="verbs" (none
#        over tcp) and names verbs for P; P's held blocks back to 0, one lease per request
#        released "completed" (read-done notifications), none expired. (A load that failed
#        after a verbs queue pair reset, aborted by D and prefilled again by the proxy, is
#        tolerated and reported: d.verbs_qp_resets, d.p_leases_aborted.)
#     2. long requests queue on D (--max-running 1 --step-ms 50, max_tokens 400), kill -9 D
#        with leases outstanding: every lease outstanding at the kill must end within the
#        lease TTL + 1 s, and P must free every block within 60 s.
#     3. D restarted, a few more requests; then SIGTERM to D and the proxy: each exits 0.
# Both agents run with --transport verbs (no TCP fallback) and a cluster token
# (KVLEASE_AUTH_TOKEN): they listen beyond loopback. Prints key=value lines prefixed
# p. / d.; the last line is "agents-2vm P: OK" / "agents-2vm D: OK" or "... FAILED: why".
# Inputs (env, written by agents-2vm.sh): AG2_ROLE, AG_BIN, AG_LOAD, AG_REQUESTS,
# AG_LEASE_S, AG2_P_WAIT_S (longest P waits for the stop file), SR_MTU, AG_KV_HEADS,
# AG_HEAD_DIM.
set -uo pipefail
ROLE=${AG2_ROLE:?}
BIN=${AG_BIN:?}
LOAD=${AG_LOAD:?}
REQUESTS=${AG_REQUESTS:-16}
LEASE_S=${AG_LEASE_S:-3}
MTU=${SR_MTU:-9000}
P_WAIT_S=${AG2_P_WAIT_S:-300}
O=/srout
LOGS=/tmp/kvlease-agents-2vm
mkdir -p "$LOGS"
P_IP=10.77.5.1
D_IP=10.77.5.2
export KVLEASE_AUTH_TOKEN=${AG_AUTH_TOKEN:-softroce-agents-2vm-token}
P_URL="http://$P_IP:8100"
D_URL="http://$D_IP:8200"
X_URL="http://127.0.0.1:8300"
P_ENGINE=agents2-p
# Model shape (P, D and demo_load must agree): 2 KV heads of dimension 16, 1/16 of the
# agents' default KV per token (~60 KB per request instead of ~1 MB). D verifies every
# loaded request on its forward-loop thread, which also sends the heartbeats; in a debug
# build under TCG on a busy host, verifying the default shape takes seconds, longer than
# the 2 s a heartbeat extends a 3 s lease, and P expires the leases of queued requests.
SHAPE=(--num-kv-heads "${AG_KV_HEADS:-2}" --head-dim "${AG_HEAD_DIM:-16}")
T0=$EPOCHREALTIME
PIDS=()
r=${ROLE,,}

emit() { echo "$r.$1=$2"; }
# GET url/metrics into a file, with bash's /dev/tcp (no client tool in the guest needed).
dump_metrics() { # host port file
  timeout 10 bash -c 'exec 3<>"/dev/tcp/$1/$2" && printf "GET /metrics HTTP/1.0\r\nHost: $1\r\n\r\n" >&3 && cat <&3' \
    _ "$1" "$2" >"$3" 2>&1
}
# Logs and metrics of this guest's agents, kept under the host's output dir.
save_logs() {
  if [ "$ROLE" = P ]; then dump_metrics "$P_IP" 8100 "$LOGS/p.metrics"
  else dump_metrics "$D_IP" 8200 "$LOGS/d.metrics"; dump_metrics "$P_IP" 8100 "$LOGS/p-seen-from-d.metrics"
  fi
  mkdir -p "$O/logs" && cp "$LOGS"/* "$O/logs/" 2>/dev/null
}
# The kernel's log (the console shows only errors and worse: loglevel=4), for the host to
# scan and count warnings in.
# Also rxe0's counters (retransmissions, sequence errors, ...) and the NIC's drops: the
# non-zero ones as key=value lines.
save_dmesg() {
  local f v
  dmesg >"$O/dmesg.txt" 2>&1
  for f in /sys/class/infiniband/rxe0/ports/1/hw_counters/* /sys/class/net/"$NIC"/statistics/{rx,tx}_{dropped,errors}; do
    [ -r "$f" ] || continue
    read -r v <"$f" || continue
    case ${f##*/} in lifespan) continue ;; esac
    [ "$v" != 0 ] && emit "counter.${f##*/}" "$v"
  done
}
fail() {
  echo "agents-2vm $ROLE: FAILED: $*"
  for f in "$LOGS"/*.log; do
    [ -f "$f" ] || continue
    echo "----- $ROLE: tail of $f"
    tail -n 25 "$f"
  done
  save_logs
  for pid in "${PIDS[@]}"; do kill -9 "$pid" 2>/dev/null; done
  save_dmesg
  exit 1
}
# One sample of url/metrics (0 when absent), as `demo_load metric` reads it, but without
# starting a process: bash's /dev/tcp (a fork+exec of the load generator costs tenths of a
# second under TCG, and the checks read ~20 samples). Prints nothing on an HTTP failure.
metric() { # url name
  local hp=${1#http://} status line v=0
  exec 3<>"/dev/tcp/${hp%:*}/${hp##*:}" || return 1
  printf 'GET /metrics HTTP/1.0\r\nHost: %s\r\n\r\n' "$hp" >&3
  IFS= read -r -t 10 status <&3 || { exec 3<&-; return 1; }
  case $status in "HTTP/1."?" 200"*) ;; *) exec 3<&-; return 1 ;; esac
  while IFS= read -r -t 10 line <&3; do
    case $line in "$2 "*) v=${line#"$2 "}; v=${v%$'\r'}; break ;; esac
  done
  exec 3<&-
  echo "$v"
}
# The same from a saved /metrics answer.
metric_in() { # file name
  local line
  while IFS= read -r line; do
    case $line in "$2 "*) line=${line#"$2 "}; echo "${line%$'\r'}"; return ;; esac
  done <"$1"
  echo 0
}
# Times come from $EPOCHREALTIME (a bash builtin): under TCG a fork+exec of date costs
# tenths of a second, which would count against the reclaim bound.
since() { awk -v a="$1" -v b="${2:-$EPOCHREALTIME}" 'BEGIN { printf "%.3f", b - a }'; }
num_eq() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a + 0 == b + 0) }'; }
key() { sed -n "s/^$2=//p" "$1" | tail -1; }
kv_config() { # role
  printf '{"kv_connector":"kvlease","kv_role":"%s","kv_connector_extra_config":{"kv_lease_duration":%s}}' \
    "$1" "$LEASE_S"
}
wait_up() { # url what seconds
  timeout $(( $3 + 10 )) "$LOAD" wait-health --url "$1" --timeout-secs "$3" >/dev/null \
    || fail "$2 ($1) did not answer /health within $3 s"
}
# SIGTERM, then wait (bounded) and require exit status 0.
stop_clean() { # pid what key
  local t rc
  kill -TERM "$1" 2>/dev/null || fail "$2 was not running at shutdown"
  t=$EPOCHREALTIME
  for _ in $(seq 200); do
    kill -0 "$1" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$1" 2>/dev/null; then
    kill -9 "$1"
    fail "$2 did not exit within 20 s of SIGTERM"
  fi
  wait "$1"
  rc=$?
  emit "$3.exit_code" "$rc"
  emit "$3.exit_s" "$(since "$t")"
  [ "$rc" = 0 ] || fail "$2 exited with status $rc after SIGTERM"
}

# --- the wire: eth0 (no udev, so the kernel's name), one address, rxe0 on it ----------
ME=$P_IP; [ "$ROLE" = D ] && ME=$D_IP
modprobe -a virtio_net rdma_rxe || fail "modprobe virtio_net rdma_rxe"
NIC=
for _ in $(seq 50); do
  for n in /sys/class/net/*; do
    n=${n##*/}
    [ "$n" != lo ] && { NIC=$n; break; }
  done
  [ -n "$NIC" ] && break
  sleep 0.1
done
[ -n "$NIC" ] || fail "no NIC in this guest (qemu -netdev stream missing?)"
ip -batch - <<IP || fail "ip setup of $NIC"
link set lo up
link set $NIC mtu $MTU
addr add $ME/24 dev $NIC
link set $NIC up
IP
rdma link add rxe0 type rxe netdev "$NIC" || fail "rdma link add rxe0 netdev $NIC"
# The IPv4-mapped RoCE v2 GID appears asynchronously after the address: wait (5 s at most).
for _ in $(seq 50); do
  read -r g < /sys/class/infiniband/rxe0/ports/1/gids/1 || g=
  case $g in 0000:0000:0000:0000:0000:ffff:*) break ;; esac
  sleep 0.1
done
case $g in 0000:0000:0000:0000:0000:ffff:*) ;; *) fail "rxe0 has no IPv4 RoCE v2 GID after 5 s" ;; esac
ulimit -l unlimited
emit boot_s "$(cut -d' ' -f1 /proc/uptime)"
emit nic "$NIC"
emit addr "$ME"
emit rxe_active_mtu "$(ibv_devinfo -d rxe0 | awk '/active_mtu/ { print $2; exit }')"

# --- P's guest -------------------------------------------------------------------------
if [ "$ROLE" = P ]; then
  "$BIN/prefill-agent" --host "$P_IP" --port 8100 --side-channel-port 5600 \
    --transport verbs --memory host --engine-id "$P_ENGINE" "${SHAPE[@]}" \
    --kv-transfer-config "$(kv_config kv_producer)" >>"$LOGS/prefill.log" 2>&1 &
  P_PID=$!; PIDS+=("$P_PID")
  T=$EPOCHREALTIME
  wait_up "$P_URL" P 90
  emit startup_s "$(since "$T")"
  grep 'verbs backend ready' "$LOGS/prefill.log" | sed -n 's/.*device="\{0,1\}\([^" ]*\).*/p.rdma_device=\1/p' | head -1
  grep -qE 'verbs backend ready.*device="?rxe0"? ' "$LOGS/prefill.log" || fail "P did not start the verbs backend on rxe0"
  echo "agents-2vm P: serving on $P_URL"
  # Serve until D's guest is done (the host creates the stop file), or P dies.
  waited=0
  until [ -e "$O/stop" ]; do
    kill -0 "$P_PID" 2>/dev/null || fail "P exited while D's guest was using it"
    [ "$waited" -ge $(( P_WAIT_S * 2 )) ] && fail "no stop file from the host after $P_WAIT_S s"
    sleep 0.5
    waited=$(( waited + 1 ))
  done
  emit served_s "$(since "$T")"
  save_logs
  emit blocks_held "$(metric_in "$LOGS/p.metrics" kvlease_blocks_held)"
  emit leases_granted "$(metric_in "$LOGS/p.metrics" kvlease_leases_granted_total)"
  emit leases_completed "$(metric_in "$LOGS/p.metrics" 'kvlease_leases_released_total{reason="completed"}')"
  emit leases_expired "$(metric_in "$LOGS/p.metrics" 'kvlease_leases_released_total{reason="expired"}')"
  stop_clean "$P_PID" P p
  save_dmesg
  emit wall_s "$(since "$T0")"
  echo "agents-2vm P: OK"
  exit 0
fi

# --- D's guest: D, the proxy and the load generator ------------------------------------
start_d() { # generation
  "$BIN/decode-agent" --host "$D_IP" --port 8200 --side-channel-port 5700 \
    --transport verbs --memory host --engine-id "agents2-d$1" "${SHAPE[@]}" \
    --max-running 1 --step-ms 50 \
    --allowed-prefill-hosts "$P_IP/32" \
    --kv-transfer-config "$(kv_config kv_consumer)" >>"$LOGS/decode.log" 2>&1 &
  D_PID=$!; PIDS+=("$D_PID")
}
# demo_load load; all ok, no digest mismatch; prints its key=value lines.
load_ok() { # label requests concurrency
  local label=$1 n=$2 c=$3 out="$LOGS/$1.txt" rc
  timeout 300 "$LOAD" load --url "$X_URL" --label "$label" --requests "$n" --concurrency "$c" \
    --timeout-secs 120 "${SHAPE[@]}" >"$out" 2>"$LOGS/$label.err"
  rc=$?
  sed 's/^/d./' "$out"
  [ "$rc" = 0 ] || { cat "$LOGS/$label.err"; fail "$label: load exited $rc"; }
  [ "$(key "$out" "$label.ok")" = "$n" ] || fail "$label: $(key "$out" "$label.ok") of $n requests ok"
  [ "$(key "$out" "$label.digest_mismatch")" = 0 ] || fail "$label: kv_digest mismatches"
  [ "$(key "$out" "$label.bad_answer")" = 0 ] || fail "$label: bad answers"
}

# P boots in the other guest at the same time: wait for it across the wire.
T=$EPOCHREALTIME
wait_up "$P_URL" "P (other VM)" 150
emit p_reachable_s "$(since "$T")"
T=$EPOCHREALTIME
start_d 0
"$BIN/kvlease-proxy" --host 127.0.0.1 --port 8300 --prefill "$P_URL" --decode "$D_URL" \
  --timeout-secs 60 >>"$LOGS/proxy.log" 2>&1 &
X_PID=$!; PIDS+=("$X_PID")
wait_up "$D_URL" D 90
wait_up "$X_URL" proxy 90
emit startup_s "$(since "$T")"
grep 'verbs backend ready' "$LOGS/decode.log" | sed -n 's/.*device="\{0,1\}\([^" ]*\).*/d.rdma_device=\1/p' | head -1
grep -qE 'verbs backend ready.*device="?rxe0"? ' "$LOGS/decode.log" || fail "D did not start the verbs backend on rxe0"

# 0. one request alone first: D's first request to P waits for the handshake (side
#    channel, token proof, queue pair), during which D has no connection to heartbeat on.
#    Reported, not checked; the checks below count from here on.
timeout 200 "$LOAD" load --url "$X_URL" --label warmup --requests 1 --concurrency 1 \
  --allow-failures --timeout-secs 120 "${SHAPE[@]}" >"$LOGS/warmup.txt" 2>"$LOGS/warmup.err"
sed -n 's/^\(warmup\.\(ok\|failed\|digest_mismatch\|p50_ms\)\)=/d.\1=/p' "$LOGS/warmup.txt"
V0=$(metric "$D_URL" 'kvlease_transfers_total{backend="verbs"}')
G0=$(metric "$P_URL" kvlease_leases_granted_total)
C0=$(metric "$P_URL" 'kvlease_leases_released_total{reason="completed"}')
E0=$(metric "$P_URL" 'kvlease_leases_released_total{reason="expired"}')
A0=$(metric "$P_URL" 'kvlease_leases_released_total{reason="aborted"}')
F0=$(metric "$D_URL" kvlease_kv_load_failures_total)
minus() { awk -v a="$1" -v b="$2" 'BEGIN { print a - b }'; }

# 1. requests, read by RDMA READ from P's kernel into D's.
load_ok requests "$REQUESTS" 4
gauge=$(metric "$D_URL" "kvlease_peer_backend{peer=\"$P_ENGINE\",backend=\"verbs\"}")
tcp_gauge=$(metric "$D_URL" "kvlease_peer_backend{peer=\"$P_ENGINE\",backend=\"tcp\"}")
verbs=$(minus "$(metric "$D_URL" 'kvlease_transfers_total{backend="verbs"}')" "$V0")
tcp=$(metric "$D_URL" 'kvlease_transfers_total{backend="tcp"}')
emit peer_backend_verbs "$gauge"
emit transfers_verbs "$verbs"
emit transfers_tcp "$tcp"
num_eq "$gauge" 1 && num_eq "$tcp_gauge" 0 || fail "D's kvlease_peer_backend for $P_ENGINE is not verbs"
num_eq "$verbs" "$REQUESTS" || fail "$verbs verbs transfers on D, expected $REQUESTS"
num_eq "$tcp" 0 || fail "$tcp transfers over TCP on D, expected 0"
grep -q 'backend: verbs' "$LOGS/decode.log" || fail "D's log has no 'backend: verbs' line"
timeout 40 "$LOAD" wait-metric --url "$P_URL" --name kvlease_blocks_held --at-most 0 \
  --timeout-secs 30 --label d.p_blocks_held_zero || fail "P still holds blocks 30 s after the requests"
granted=$(minus "$(metric "$P_URL" kvlease_leases_granted_total)" "$G0")
completed=$(minus "$(metric "$P_URL" 'kvlease_leases_released_total{reason="completed"}')" "$C0")
expired=$(minus "$(metric "$P_URL" 'kvlease_leases_released_total{reason="expired"}')" "$E0")
aborted=$(minus "$(metric "$P_URL" 'kvlease_leases_released_total{reason="aborted"}')" "$A0")
load_failed=$(minus "$(metric "$D_URL" kvlease_kv_load_failures_total)" "$F0")
qp_resets=$(grep -c 'verbs queue pair failed' "$LOGS/decode.log")
active=$(metric "$P_URL" kvlease_leases_active)
emit p_leases_granted "$granted"
emit p_leases_completed "$completed"
emit p_leases_expired "$expired"
emit p_leases_aborted "$aborted"
emit p_leases_active "$active"
emit kv_load_failures "$load_failed"
emit verbs_qp_resets "$qp_resets"
emit heartbeats_sent "$(metric "$D_URL" kvlease_heartbeats_sent_total)"
emit p_heartbeats_received "$(metric "$P_URL" kvlease_heartbeats_received_total)"
num_eq "$active" 0 || fail "P has $active active leases"
num_eq "$expired" 0 || fail "$expired leases expired on P with D alive"
# One lease per request released by D's read-done. A read that never completes (rxe treats
# retry_cnt 7 as "retry forever", so a READ whose recovery stalls hangs until D's 30 s read
# timeout) makes D reset the queue pair and fail that load: P gets D's abort and the proxy
# prefills once more. Tolerated only in exactly that shape, and reported above.
num_eq "$completed" "$REQUESTS" || fail "$completed leases released by read-done on P, expected one per request ($REQUESTS)"
num_eq "$granted" "$(( REQUESTS + aborted ))" || fail "$granted leases granted on P: $completed released by read-done, $aborted aborted"
num_eq "$aborted" "$load_failed" || fail "P released $aborted leases by abort, D failed $load_failed loads"
if [ "$aborted" != 0 ]; then
  [ "$qp_resets" != 0 ] || fail "$aborted leases aborted on P without a queue pair reset on D"
  echo "agents-2vm D: note: $load_failed load(s) failed after a verbs queue pair reset; the proxy's retry read them"
fi

# 2. kill -9 D with leases outstanding: D runs one request at a time (50 ms a token,
#    400 tokens), the others wait in its queue with their leases held on P.
BURST=6
timeout 300 "$LOAD" load --url "$X_URL" --label kill --requests "$BURST" --concurrency "$BURST" \
  --max-tokens 400 --stream-every 0 --allow-failures --timeout-secs 120 "${SHAPE[@]}" \
  >"$LOGS/kill.txt" 2>"$LOGS/kill.err" &
BURST_PID=$!; PIDS+=("$BURST_PID")
timeout 70 "$LOAD" wait-metric --url "$P_URL" --name kvlease_leases_active --at-least 3 \
  --timeout-secs 60 --label kill.leases_wait >/dev/null || fail "no leases outstanding on P before the kill"
HELD=$(metric "$P_URL" kvlease_blocks_held)
ACTIVE=$(metric "$P_URL" kvlease_leases_active)
EXP0=$(metric "$P_URL" 'kvlease_leases_released_total{reason="expired"}')
GRANTED0=$(metric "$P_URL" kvlease_leases_granted_total)
kill -9 "$D_PID"
KILL_T=$EPOCHREALTIME
{ wait "$D_PID"; } 2>/dev/null
emit kill.d_exit_code "$?"
emit kill.leases_outstanding "$ACTIVE"
emit kill.blocks_held "$HELD"
num_eq "$HELD" 0 && fail "P held no blocks at the kill"
BOUND=$(awk -v d="$LEASE_S" 'BEGIN { printf "%.3f", d + 1 }')
# Every lease outstanding at the kill ends within the bound (lease TTL + 1 s): once it
# passed, P holds no lease but those it granted after the kill (a proxy retry's prefill
# grants one that lives its TTL from its grant; one of those that already ended loosens
# the check by one). Active first, granted second: a grant between the two only loosens.
# Sampled in the background once the bound passed, while the reclaim is timed.
(
  sleep "$(awk -v b="$BOUND" -v e="$(since "$KILL_T")" 'BEGIN { d = b - e; printf "%.3f", (d > 0 ? d : 0) }')"
  a=$(metric "$P_URL" kvlease_leases_active) && g=$(metric "$P_URL" kvlease_leases_granted_total) \
    && printf '%s\n%s\n' "$a" "$g" >"$LOGS/kill.at_bound"
  since "$KILL_T" >"$LOGS/kill.sampled_at"
) &
SAMPLER=$!; PIDS+=("$SAMPLER")
timeout 70 "$LOAD" wait-metric --url "$P_URL" --name kvlease_blocks_held --at-most 0 \
  --timeout-secs 60 --label kill.reclaim >/dev/null || fail "P did not free D's blocks within 60 s of kill -9"
END_T=$EPOCHREALTIME
RECLAIM=$(since "$KILL_T" "$END_T")
wait "$SAMPLER"
SAMPLED=$(cat "$LOGS/kill.sampled_at")
ACTIVE_B=$(sed -n 1p "$LOGS/kill.at_bound" 2>/dev/null)
[ -n "$ACTIVE_B" ] || fail "P's metrics unreadable after the kill"
AFTER=$(awk -v a="$(sed -n 2p "$LOGS/kill.at_bound")" -v b="$GRANTED0" 'BEGIN { print a - b }')
emit kill.sampled_at_s "$SAMPLED"
emit kill.leases_active_at_bound "$ACTIVE_B"
emit kill.leases_granted_after_kill "$AFTER"
awk -v s="$SAMPLED" -v b="$BOUND" 'BEGIN { exit !(s >= b) }' || fail "P's leases sampled ${SAMPLED}s after the kill, before the bound ${BOUND}s"
awk -v a="$ACTIVE_B" -v g="$AFTER" 'BEGIN { exit !(a <= g) }' \
  || fail "P still held $ACTIVE_B lease(s) ${SAMPLED}s after the kill, $AFTER granted since: a lease outstanding at the kill outlived the bound ${BOUND}s (lease TTL ${LEASE_S}s + 1 s)"
EXP1=$(metric "$P_URL" 'kvlease_leases_released_total{reason="expired"}')
emit kill.reclaim_s "$RECLAIM"
emit kill.reclaim_bound_s "$BOUND"
emit kill.leases_expired "$(awk -v a="$EXP1" -v b="$EXP0" 'BEGIN { print a - b }')"
num_eq "$(metric "$P_URL" kvlease_leases_active)" 0 || fail "P still has active leases after the reclaim"
awk -v a="$EXP1" -v b="$EXP0" 'BEGIN { exit !(a - b > 0) }' || fail "no lease expired on P after kill -9 D"
wait "$BURST_PID"
brc=$?
sed -n 's/^\(kill\.\(ok\|failed\|digest_mismatch\)\)=/d.\1=/p' "$LOGS/kill.txt"
# --allow-failures: non-zero only for a wrong answer (or a crash of the load generator).
[ "$brc" = 0 ] || { cat "$LOGS/kill.err"; fail "kill: the load generator exited $brc"; }
[ "$(key "$LOGS/kill.txt" kill.digest_mismatch)" = 0 ] || fail "kill: kv_digest mismatch on a request that succeeded"

# 3. D again (a new engine), a few requests, then clean shutdowns.
start_d 1
wait_up "$D_URL" "restarted D" 90
load_ok after 4 2
save_logs
stop_clean "$D_PID" D d
stop_clean "$X_PID" proxy proxy
save_dmesg
emit wall_s "$(since "$T0")"
echo "agents-2vm D: OK"
