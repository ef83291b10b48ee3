#!/usr/bin/env bash
# kvlease on five "hosts" on one machine: network namespaces joined by a bridge that lives
# in its own namespace, addressed from 198.18.0.0/24 (the benchmarking range). Two P and
# two D agents listen on 0.0.0.0 with a cluster token and an API key; the proxy and the
# load generator (crates/agent/examples/demo_load.rs) run on a fifth host. Then faults:
#
#   1 baseline   2 P x 2 D through the proxy, byte-exact digests, P advertises its 198.18 address
#   2 p-kill     kill -9 of P0 with requests queued on D, restart under the same engine id
#   3 d-kill     kill -9 of D0 with leases outstanding: P reclaims within the bound; restart
#   4 partition  P0 <-> both D dropped (nftables in P0's namespace) for 3 leases, then healed
#   5 d-stall    SIGSTOP of D0 for 2 leases, then SIGCONT
#   6 misconfig  a D with the wrong cluster token (d2), a D that allows only P1's address
#                (d3): P0's params give 403 peer_auth_failed / prefill_host_not_allowed
#   and at the end: no block held on any P or D once the leases ran out (no leak).
#
# and a fault table: outcomes (ok / failed-retryable / failed-other), time to recover,
# wasted prefills (P's leases expired or aborted instead of completed), wrong outputs.
#
#   scripts/netns/hosts.sh                      as root; builds (debug) and runs, ~1-2 minutes
#   NETNS_PROFILE=release scripts/netns/hosts.sh
#   NETNS_BUILD=0 NETNS_LEASE_S=2 NETNS_TIME_LIMIT=300 scripts/netns/hosts.sh
#
# Prints key=value lines and the table on stdout, progress on stderr; the last line is
# `netns: OK` or `netns: FAILED <why>`, and the exit status follows it. Everything it makes
# is named kvl-*, removed on exit and, left over from an earlier run, at start. No
# namespace has a route out: the agents' traffic stays between the five namespaces.
# Logs stay in the directory printed as netns.logs=.
set -euo pipefail
cd "$(dirname "$0")/../.."
STARTED=$(date +%s.%N)

PROFILE=${NETNS_PROFILE:-debug}
LEASE_S=${NETNS_LEASE_S:-2}           # kv_lease_duration: interval = /6, extension = 2/3
BUILD=${NETNS_BUILD:-1}
TIME_LIMIT=${NETNS_TIME_LIMIT:-300}   # the whole run, seconds
STEP_MS=50                            # D forward step; D runs one request at a time, so
MAX_RUNNING=1                         # long requests queue on D (longer than the lease)
LONG_TOKENS=12                        # 12 steps = 0.6 s per long request
NET=198.18.0                          # /24; host numbers below
HOSTS=(p0 p1 d0 d1 d2 d3 x)
declare -A HOSTNUM=([p0]=11 [p1]=12 [d0]=21 [d1]=22 [d2]=23 [d3]=24 [x]=31)
BR_NS=kvl-br
HTTP_PORT=8000
SIDE_PORT=5600
PROXY_PORT=8080

step() { echo "--- $*" >&2; }
fail() { echo "netns: FAILED: $*"; exit 1; }
[ "$(id -u)" = 0 ] || fail "needs root (network namespaces)"

step "setup"
bash scripts/setup.sh >&2
need=""
command -v ip >/dev/null || need="$need iproute2"
command -v nft >/dev/null || need="$need nftables"
if [ -n "$need" ]; then
  echo "hosts.sh: installing$need" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  # shellcheck disable=SC2086
  apt-get install -y -q --no-install-recommends $need >/tmp/kvlease-netns-apt.log 2>&1 \
    || { tail -20 /tmp/kvlease-netns-apt.log >&2; fail "apt-get install$need"; }
fi

profile_flag=()
[ "$PROFILE" = release ] && profile_flag=(--release)
if [ "$BUILD" = 1 ]; then
  step "build ($PROFILE)"
  cargo build "${profile_flag[@]}" --locked -q -p kvlease-agent --bins --example demo_load >&2
fi
target_dir=$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
BIN="$target_dir/$PROFILE"
LOAD="$BIN/examples/demo_load"
for b in prefill-agent decode-agent kvlease-proxy examples/demo_load; do
  [ -x "$BIN/$b" ] || fail "$BIN/$b missing"
done

WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvlease-netns.XXXXXX")
OUT="$WORK/result.txt"
WAITS="$WORK/waits.txt"
: >"$OUT"
emit() { echo "$1=$2" | tee -a "$OUT"; }

# --- namespaces -------------------------------------------------------------------------
NAMESPACES=("$BR_NS")
for h in "${HOSTS[@]}"; do NAMESPACES+=("kvl-$h"); done

# Ends every process still in our namespaces (ours, or an earlier run's), then deletes
# them; the veths, the bridge and the nftables rules go with them. Silent and bounded.
teardown() {
  local ns pid pids try present
  present=" $(ip netns list 2>/dev/null | awk '{print $1}' | tr '\n' ' ') "
  for ns in "${NAMESPACES[@]}"; do
    case "$present" in *" $ns "*) ;; *) continue ;; esac
    for try in 1 2 3 4 5; do
      pids=$(ip netns pids "$ns" 2>/dev/null || true)
      [ -z "$pids" ] && break
      for pid in $pids; do
        if [ "$try" = 1 ]; then kill -CONT "$pid" 2>/dev/null || true; kill "$pid" 2>/dev/null || true
        else kill -9 "$pid" 2>/dev/null || true; fi
      done
      sleep 0.2
    done
    ip netns del "$ns" 2>/dev/null || true
  done
}

PIDS=()
WATCHDOG=""
cleanup() {
  trap - ERR
  set +e
  local pid
  # shellcheck disable=SC2046
  [ -n "$WATCHDOG" ] && kill $(ps -o pid= --ppid "$WATCHDOG") "$WATCHDOG" 2>/dev/null
  for pid in "${PIDS[@]}"; do kill -CONT "$pid" 2>/dev/null; kill "$pid" 2>/dev/null; done
  teardown
  wait 2>/dev/null
  return 0
}
trap cleanup EXIT
trap 'echo "netns: FAILED: line $LINENO exited $? (logs in ${WORK:-?})"' ERR
set -E
trap 'echo "netns: FAILED: interrupted or over the ${TIME_LIMIT}s limit (logs in $WORK)"; exit 1' INT TERM
( sleep "$TIME_LIMIT"; kill -TERM $$ ) 2>/dev/null &
WATCHDOG=$!

step "network: $BR_NS (bridge) + ${HOSTS[*]} on $NET.0/24 (logs in $WORK)"
teardown
ip netns add "$BR_NS"
ip -n "$BR_NS" link set lo up
ip -n "$BR_NS" link add name br0 type bridge
ip -n "$BR_NS" link set br0 up
for h in "${HOSTS[@]}"; do
  ns="kvl-$h"
  ip netns add "$ns"
  ip -n "$ns" link set lo up
  ip -n "$BR_NS" link add name "v$h" type veth peer name eth0 netns "$ns"
  ip -n "$BR_NS" link set "v$h" master br0 up
  ip -n "$ns" addr add "$NET.${HOSTNUM[$h]}/24" dev eth0
  ip -n "$ns" link set eth0 up
done
# Our namespaces have a connected /24 and no default route: nothing leaves them.
for h in "${HOSTS[@]}"; do
  if ip -n "kvl-$h" route show default | grep -q .; then fail "kvl-$h has a default route"; fi
done

nsx() { local h=$1; shift; ip netns exec "kvl-$h" "$@"; }
addr() { echo "$NET.${HOSTNUM[$1]}"; }
url() { echo "http://$(addr "$1"):$HTTP_PORT"; }
X_URL="http://$(addr x):$PROXY_PORT"

# The same cluster token on every P and D; an API key on every agent (the proxy passes
# the client's Authorization header on). Through the environment, never the command line.
KVLEASE_AUTH_TOKEN=$(od -An -tx1 -N24 /dev/urandom | tr -d ' \n')
KVLEASE_API_KEY=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
export KVLEASE_AUTH_TOKEN KVLEASE_API_KEY

kv_config() {
  printf '{"kv_connector":"kvlease","kv_role":"%s","kv_connector_extra_config":{"kv_lease_duration":%s}}' "$1" "$LEASE_S"
}
COMMON=(--host 0.0.0.0 --port "$HTTP_PORT" --side-channel-port "$SIDE_PORT" --transport tcp --memory host)
declare -A PID
# Not through nsx: `ip netns exec` execs the agent, so $! is the agent's pid (a function
# run with & would be a subshell's).
start_p() {
  ip netns exec "kvl-$1" "$BIN/prefill-agent" "${COMMON[@]}" --engine-id "netns-$1" \
    --kv-transfer-config "$(kv_config kv_producer)" >>"$WORK/$1.log" 2>&1 &
  PID[$1]=$!; PIDS+=("$!")
}
start_d() { # host [allowed CIDRs]
  ip netns exec "kvl-$1" "$BIN/decode-agent" "${COMMON[@]}" --engine-id "netns-$1" \
    --max-running "$MAX_RUNNING" --step-ms "$STEP_MS" --allowed-prefill-hosts "${2:-$NET.0/24}" \
    --kv-transfer-config "$(kv_config kv_consumer)" >>"$WORK/$1.log" 2>&1 &
  PID[$1]=$!; PIDS+=("$!")
}
health() { nsx x "$LOAD" wait-health --url "$1" --timeout-secs "${2:-30}" 2>>"$WORK/load.err"; }

step "start P (p0, p1), D (d0, d1) on 0.0.0.0, the proxy on x"
for h in p0 p1; do start_p "$h"; done
for h in d0 d1; do start_d "$h"; done
# Scenario 6's misconfigured D: d2 with another cluster token, d3 allowing only P1.
KVLEASE_AUTH_TOKEN=$(od -An -tx1 -N24 /dev/urandom | tr -d ' \n') start_d d2
start_d d3 "$(addr p1)/32"
ip netns exec kvl-x "$BIN/kvlease-proxy" --host 0.0.0.0 --port "$PROXY_PORT" \
  --prefill "$(url p0)" "$(url p1)" --decode "$(url d0)" "$(url d1)" \
  --timeout-secs 30 >"$WORK/proxy.log" 2>&1 &
PIDS+=("$!")
for h in p0 p1 d0 d1 d2 d3; do health "$(url "$h")" || fail "$h did not come up (see $WORK/$h.log)"; done
for h in p0 p1 d0 d1; do
  [ "$(readlink "/proc/${PID[$h]}/exe")" = "$(readlink -f "$BIN/$([ "${h:0:1}" = p ] && echo prefill || echo decode)-agent")" ] \
    || fail "pid ${PID[$h]} is not $h's agent"
done
health "$X_URL" || fail "the proxy did not come up (see $WORK/proxy.log)"
emit netns.logs "$WORK"
emit netns.lease_s "$LEASE_S"
BOUND=$(awk -v d="$LEASE_S" 'BEGIN { printf "%.3f", d + d / 6 + 1 }')
emit netns.reclaim_bound_s "$BOUND"

# --- measuring ----------------------------------------------------------------------------
# One sample of an agent's /metrics, read from the proxy's host; "nan" when unreachable.
metric() { nsx x "$LOAD" metric --url "$(url "$1")" --name "$2" 2>/dev/null || echo nan; }
xmetric() { nsx x "$LOAD" metric --url "$X_URL" --name "$1" 2>/dev/null || echo nan; }
wait_metric() { # host name at-most|at-least value timeout label
  nsx x "$LOAD" wait-metric --url "$(url "$1")" --name "$2" "--$3" "$4" --timeout-secs "$5" \
    --label "$6" 2>>"$WORK/load.err"
}
EXPIRED='kvlease_leases_released_total{reason="expired"}'
ABORTED='kvlease_leases_released_total{reason="aborted"}'
COMPLETED='kvlease_leases_released_total{reason="completed"}'
declare -A SNAP
snapshot() { # tag: P's release counters, D's failure counters, the proxy's retries
  local h
  for h in p0 p1; do
    SNAP[$1.$h.expired]=$(metric "$h" "$EXPIRED")
    SNAP[$1.$h.aborted]=$(metric "$h" "$ABORTED")
    SNAP[$1.$h.completed]=$(metric "$h" "$COMPLETED")
    SNAP[$1.$h.granted]=$(metric "$h" kvlease_leases_granted_total)
  done
  for h in d0 d1; do
    SNAP[$1.$h.failures]=$(metric "$h" kvlease_kv_load_failures_total)
    SNAP[$1.$h.stale]=$(metric "$h" kvlease_stale_reads_total)
  done
  SNAP[$1.x.retries]=$(xmetric kvlease_proxy_retries_total)
}
# Sum over hosts of (after - before) of one snapshot key; a restarted agent's counters
# start again at 0, so its "before" is passed as 0 by the caller (see restarted).
declare -A RESTARTED
delta() { # before-tag after-tag key hosts...
  local b=$1 a=$2 k=$3 h sum=0 vb va
  shift 3
  for h in "$@"; do
    vb=${SNAP[$b.$h.$k]}; va=${SNAP[$a.$h.$k]}
    [ -n "${RESTARTED[$b.$h]:-}" ] && vb=0
    sum=$(awk -v s="$sum" -v a="$va" -v b="$vb" 'BEGIN { print s + a - b }')
  done
  echo "$sum"
}
add() { awk -v a="$1" -v b="$2" 'BEGIN { print a + b }'; }

# load tag label [demo_load load args...]: one load through the proxy; its requests go
# to the tag's timeline, its key=value lines to $WORK/<label>.txt.
load() {
  local tag=$1 label=$2
  shift 2
  timeout 120 ip netns exec kvl-x "$LOAD" load --url "$X_URL" --label "$label" \
    --timeout-secs 40 --timeline "$WORK/$tag.timeline" --allow-failures "$@" \
    >"$WORK/$label.txt" 2>>"$WORK/load.err" || true
}
key() { sed -n "s/^$1=//p" "$WORK/$2.txt" 2>/dev/null | tail -1; }  # key file-label

# Outcome counts of a scenario from its timeline; recovery: from $2 (epoch seconds) to
# the first ok answer of a request sent at or after it.
declare -A ROW
outcomes() { # tag recover-from|-
  local tag=$1 from=$2 line
  line=$(awk -v t="$from" '
    { n++ }
    $3 == "ok" { ok++; if (t != "-" && $1 >= t && (first == "" || $2 < first)) first = $2 }
    $3 == "digest_mismatch" || $3 == "bad_answer" { wrong++ }
    $3 == "failed" && $5 == "retryable=true" { fr++ }
    $3 == "failed" && $5 != "retryable=true" { fo++ }
    END {
      rec = (t == "-") ? "-" : (first == "" ? "never" : sprintf("%.2f", first - t))
      printf "%d %d %d %d %d %s\n", n, ok, fr, fo, wrong, rec
    }' "$WORK/$tag.timeline" 2>/dev/null || echo "0 0 0 0 0 never")
  read -r "ROW[$tag.sent]" "ROW[$tag.ok]" "ROW[$tag.fr]" "ROW[$tag.fo]" "ROW[$tag.wrong]" "ROW[$tag.recover]" <<<"$line"
  local k
  for k in sent ok fr fo wrong recover; do
    emit "$tag.$(case $k in fr) echo failed_retryable ;; fo) echo failed_other ;; recover) echo recover_s ;; *) echo "$k" ;; esac)" "${ROW[$tag.$k]}"
  done
}
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.3f", b - a }'; }
le() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a + 0 <= b + 0 && a != "nan") }'; }

FAILURES=()
check() { # tag condition-description command...
  local tag=$1 what=$2
  shift 2
  if "$@"; then return 0; fi
  FAILURES+=("$tag: $what")
  emit "$tag.check_failed" "\"$what\""
}
is() { [ "$1" = "$2" ]; }
ge() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a != "nan" && a + 0 >= b + 0) }'; }

# A burst of long requests that queue on both D (one runs, the others wait for their KV
# while D heartbeats their leases), in the background.
BURST=8
burst() { load "$1" "$1.burst" --requests "$BURST" --concurrency "$BURST" --max-tokens "$LONG_TOKENS" --stream-every 0 & BURST_PID=$!; }
# Waits (bounded) until P0 and P1 have granted $1 more leases than at snapshot $2: every
# request of the burst is past P and on its way to D.
wait_granted() {
  local want=$(( $1 + ${SNAP[$2.p0.granted]%.*} + ${SNAP[$2.p1.granted]%.*} )) got i
  for i in $(seq 1 100); do
    got=$(add "$(metric p0 kvlease_leases_granted_total)" "$(metric p1 kvlease_leases_granted_total)")
    ge "$got" "$want" && { sleep 0.2; return 0; }
    sleep 0.1
  done
  return 1
}
after() { load "$1" "$1.after" --requests 12 --concurrency 2 --max-tokens 2; }
wasted() { # tag before after [extra]: P's leases expired or aborted
  local w
  w=$(add "$(delta "$2" "$3" expired p0 p1)" "$(delta "$2" "$3" aborted p0 p1)")
  ROW[$1.wasted]=$(add "$w" "${4:-0}")
  emit "$1.wasted_prefills" "${ROW[$1.wasted]}"
  ROW[$1.retried]=$(delta "$2" "$3" retries x)
  emit "$1.proxy_retries" "${ROW[$1.retried]}"
  emit "$1.d_kv_load_failures" "$(delta "$2" "$3" failures d0 d1)"
  emit "$1.d_stale_reads" "$(delta "$2" "$3" stale d0 d1)"
}

# --- 1: baseline ---------------------------------------------------------------------------
step "1 baseline: 2 P x 2 D through the proxy"
for h in p0 p1 d0 d1; do
  adv=$(grep -m1 "advertising this address to peers" "$WORK/$h.log" | grep -o 'ip=[0-9.]*' | cut -d= -f2 || true)
  emit "baseline.$h.advertised" "${adv:-none}"
  check baseline "$h advertises $(addr "$h") (log: ${adv:-none})" is "$adv" "$(addr "$h")"
done
# P's kv_transfer_params name its own address; the lease of this unclaimed prefill runs out.
params=$(nsx x curl -s -m 10 -H "Authorization: Bearer $KVLEASE_API_KEY" -H 'Content-Type: application/json' \
  -d '{"model":"m","prompt":"netns probe","max_tokens":1,"kv_transfer_params":{"do_remote_decode":true}}' \
  "$(url p0)/v1/completions" || true)
remote_host=$(echo "$params" | jq -r '.kv_transfer_params.remote_host // "none"' 2>/dev/null || echo none)
emit baseline.p0.remote_host "$remote_host"
check baseline "P0's kv_transfer_params.remote_host is $(addr p0)" is "$remote_host" "$(addr p0)"
no_key=$(nsx x curl -s -m 10 -o /dev/null -w '%{http_code}' -H 'Content-Type: application/json' \
  -d '{"model":"m","prompt":"x","max_tokens":1}' "$X_URL/v1/completions" || true)
emit baseline.status_without_api_key "$no_key"
check baseline "a request without the API key is 401" is "$no_key" 401
wait_metric p0 "$EXPIRED" at-least 1 10 baseline.probe_lease_expiry | tee -a "$OUT" >/dev/null \
  || check baseline "the probe's unclaimed lease expired" false
snapshot s1a
load baseline baseline --requests 40 --concurrency 4 --max-tokens 2
snapshot s1b
outcomes baseline -
wasted baseline s1a s1b
for h in d0 d1; do
  emit "baseline.$h.transfers_tcp" "$(metric "$h" 'kvlease_transfers_total{backend="tcp"}')"
  emit "baseline.$h.handshakes_ok" "$(metric "$h" 'kvlease_handshakes_total{outcome="ok"}')"
done
check baseline "every request ok (${ROW[baseline.ok]}/40)" is "${ROW[baseline.ok]}" 40
check baseline "no wrong output" is "${ROW[baseline.wrong]}" 0
check baseline "both D handshook with both P" ge "$(metric d0 'kvlease_handshakes_total{outcome="ok"}')" 2

# --- 2: P killed and restarted ------------------------------------------------------------
step "2 p-kill: kill -9 P0 with requests queued on D, restart it as netns-p0"
snapshot s2a
burst pkill
# The kill hits requests queued on D, not ones P0 is still prefilling (those would end in
# the proxy's 502: it does not retry a prefill whose P went away).
wait_granted "$BURST" s2a || check pkill "the burst was prefilled before the kill" false
wait_metric p0 kvlease_leases_active at-least 1 5 pkill.queued_wait >>"$WAITS" \
  || check pkill "P0 held leases of queued requests before the kill" false
at_kill=$(metric p0 kvlease_leases_active)
emit pkill.p0_leases_at_kill "$at_kill"
kill -9 "${PID[p0]}"; wait "${PID[p0]}" 2>/dev/null || true
T=$(now)
start_p p0
RESTARTED[s2a.p0]=1
health "$(url p0)" || fail "P0 did not restart (see $WORK/p0.log)"
emit pkill.p0_up_s "$(since "$T")"
after pkill
wait "$BURST_PID" || true
snapshot s2b
outcomes pkill "$T"
wasted pkill s2a s2b "$at_kill"
check pkill "no failure but retryable ones (${ROW[pkill.fo]} other)" is "${ROW[pkill.fo]}" 0
check pkill "no wrong output" is "${ROW[pkill.wrong]}" 0
check pkill "every request after the restart ok" is "$(key pkill.after.ok pkill.after)" 12

# --- 3: D killed and restarted ------------------------------------------------------------
step "3 d-kill: kill -9 D0 with leases outstanding, P reclaims, restart it as netns-d0"
snapshot s3a
burst dkill
wait_granted "$BURST" s3a || check dkill "the burst was prefilled before the kill" false
wait_metric d0 kvlease_requests_tracked at-least 1 5 dkill.queued_wait >>"$WAITS" \
  || check dkill "D0 tracked queued requests before the kill" false
emit dkill.blocks_held_at_kill "$(add "$(metric p0 kvlease_blocks_held)" "$(metric p1 kvlease_blocks_held)")"
in_flight=$(add "$(metric d0 kvlease_requests_tracked)" "$(metric d0 kvlease_requests_running)")
emit dkill.d0_requests_at_kill "$in_flight"
kill -9 "${PID[d0]}"; wait "${PID[d0]}" 2>/dev/null || true
K=$(now)
for h in p0 p1; do wait_metric "$h" kvlease_blocks_held at-most 0 20 "dkill.$h.reclaim" >>"$WAITS" || true; done
reclaim=$(since "$K")
emit dkill.reclaim_s "$reclaim"
check dkill "P freed every block within ${BOUND}s of the kill (${reclaim}s)" le "$reclaim" "$BOUND"
T=$(now)
start_d d0
RESTARTED[s3a.d0]=1
health "$(url d0)" || fail "D0 did not restart (see $WORK/d0.log)"
after dkill
wait "$BURST_PID" || true
snapshot s3b
outcomes dkill "$T"
wasted dkill s3a s3b
check dkill "a lease expired on P after the kill" ge "$(delta s3a s3b expired p0 p1)" 1
check dkill "no wrong output" is "${ROW[dkill.wrong]}" 0
# The requests D0 held when it died lose their connection: the proxy answers 502 (it
# retries only D's retryable kv_load_failed); nothing else may fail.
check dkill "failures only among the $in_flight requests on D0 (${ROW[dkill.fo]} other)" ge "$in_flight" "${ROW[dkill.fo]}"
check dkill "every request after the restart ok" is "$(key dkill.after.ok dkill.after)" 12

# --- 4: partition P0 <-> D ----------------------------------------------------------------
CUT_S=$(( LEASE_S * 3 ))
step "4 partition: P0 <-> d0, d1 dropped for ${CUT_S}s (the proxy still reaches everyone)"
snapshot s4a
burst partition
wait_metric p0 kvlease_leases_active at-least 1 8 partition.queued_wait >>"$WAITS" \
  || check partition "P0 held a lease of a queued request before the cut" false
emit partition.p0_leases_at_cut "$(metric p0 kvlease_leases_active)"
nsx p0 nft -f - <<EOF
table inet kvl_partition {
  chain out { type filter hook output priority 0; ip daddr { $(addr d0), $(addr d1) } drop; }
  chain in { type filter hook input priority 0; ip saddr { $(addr d0), $(addr d1) } drop; }
}
EOF
C=$(now)
if nsx d0 timeout 1 bash -c "exec 3<>/dev/tcp/$(addr p0)/$HTTP_PORT" 2>/dev/null; then cut=0; else cut=1; fi
emit partition.d0_cannot_reach_p0 "$cut"
check partition "the cut holds (d0 cannot reach p0)" is "$cut" 1
wait_metric p0 kvlease_blocks_held at-most 0 "$CUT_S" partition.reclaim >>"$WAITS" || true
reclaim=$(since "$C")
emit partition.p0_reclaim_s "$reclaim"
check partition "P0 freed every block within ${BOUND}s of the cut (${reclaim}s)" le "$reclaim" "$BOUND"
# Requests sent into the partition: those prefilled on P0 wait on D for reads that cannot
# go through; whatever happens, none may answer with wrong KV.
load partition partition.during --requests 4 --concurrency 2 --max-tokens 2 & DURING_PID=$!
rest=$(awk -v c="$CUT_S" -v e="$(since "$C")" 'BEGIN { r = c - e; printf "%.3f", (r > 0 ? r : 0) }')
sleep "$rest"
nsx p0 nft delete table inet kvl_partition
T=$(now)
emit partition.cut_s "$(awk -v a="$C" -v b="$T" 'BEGIN { printf "%.3f", b - a }')"
after partition
wait "$BURST_PID" "$DURING_PID" || true
snapshot s4b
outcomes partition "$T"
wasted partition s4a s4b
check partition "a lease of P0 expired during the cut" ge "$(delta s4a s4b expired p0)" 1
check partition "no wrong output" is "${ROW[partition.wrong]}" 0
check partition "a request after the heal answered ok" ge "$(key partition.after.ok partition.after)" 1

# --- 5: D stalled -------------------------------------------------------------------------
STOP_S=$(( LEASE_S * 2 ))
step "5 d-stall: SIGSTOP D0 for ${STOP_S}s with leases outstanding, then SIGCONT"
snapshot s5a
burst dstall
wait_granted "$BURST" s5a || check dstall "the burst was prefilled before the stop" false
wait_metric d0 kvlease_requests_tracked at-least 1 5 dstall.queued_wait >>"$WAITS" \
  || check dstall "D0 tracked queued requests before the stop" false
kill -STOP "${PID[d0]}"
S=$(now)
for h in p0 p1; do wait_metric "$h" kvlease_blocks_held at-most 0 "$STOP_S" "dstall.$h.reclaim" >>"$WAITS" || true; done
reclaim=$(since "$S")
emit dstall.reclaim_s "$reclaim"
check dstall "P freed D0's blocks within ${BOUND}s of the stop (${reclaim}s)" le "$reclaim" "$BOUND"
rest=$(awk -v c="$STOP_S" -v e="$(since "$S")" 'BEGIN { r = c - e; printf "%.3f", (r > 0 ? r : 0) }')
sleep "$rest"
kill -CONT "${PID[d0]}"
T=$(now)
after dstall
wait "$BURST_PID" || true
snapshot s5b
outcomes dstall "$T"
wasted dstall s5a s5b
check dstall "a lease expired on P while D0 was stopped" ge "$(delta s5a s5b expired p0 p1)" 1
check dstall "no failure but retryable ones (${ROW[dstall.fo]} other)" is "${ROW[dstall.fo]}" 0
check dstall "no wrong output" is "${ROW[dstall.wrong]}" 0
check dstall "every request after SIGCONT ok" is "$(key dstall.after.ok dstall.after)" 12

# --- 6: misconfiguration -----------------------------------------------------------------
step "6 misconfig: P0's params sent to d2 (wrong cluster token) and d3 (allows only $(addr p1))"
# prefill_then_decode d-host label: one request prefilled on P0, its decode sent straight
# to the D named (not through the proxy); prints the HTTP status and error type.
prefill_then_decode() {
  local prompt="netns misconfig $2" params answer
  params=$(nsx x curl -s -m 10 -H "Authorization: Bearer $KVLEASE_API_KEY" -H 'Content-Type: application/json' \
    -d "{\"model\":\"m\",\"prompt\":\"$prompt\",\"max_tokens\":1,\"kv_transfer_params\":{\"do_remote_decode\":true}}" \
    "$(url p0)/v1/completions" | jq -c '.kv_transfer_params' 2>/dev/null || echo null)
  answer=$(nsx x curl -s -m 20 -w '\n%{http_code}' -H "Authorization: Bearer $KVLEASE_API_KEY" \
    -H 'Content-Type: application/json' \
    -d "{\"model\":\"m\",\"prompt\":\"$prompt\",\"max_tokens\":2,\"kv_transfer_params\":$params}" \
    "$(url "$1")/v1/completions" || true)
  emit "misconfig.$2.status" "$(echo "$answer" | tail -1)"
  emit "misconfig.$2.error_type" "$(echo "$answer" | head -n -1 | jq -r '.error.type // "none"' 2>/dev/null || echo none)"
}
prefill_then_decode d2 wrong_token
emit misconfig.wrong_token.d2_handshakes_auth_failed "$(metric d2 'kvlease_handshakes_total{outcome="auth_failed"}')"
check misconfig "wrong token: 403 peer_auth_failed" is \
  "$(key misconfig.wrong_token.status result)/$(key misconfig.wrong_token.error_type result)" 403/peer_auth_failed
prefill_then_decode d3 host_not_allowed
check misconfig "P outside --allowed-prefill-hosts: 403 prefill_host_not_allowed" is \
  "$(key misconfig.host_not_allowed.status result)/$(key misconfig.host_not_allowed.error_type result)" 403/prefill_host_not_allowed

# --- no leak ------------------------------------------------------------------------------
step "end: every lease runs out, no block held anywhere"
for h in p0 p1 d0 d1; do
  wait_metric "$h" kvlease_blocks_held at-most 0 "$BOUND" "end.$h.blocks_held" >>"$WAITS" \
    || check end "$h holds no block $BOUND s after the last request" false
  emit "end.$h.blocks_held" "$(metric "$h" kvlease_blocks_held)"
done
for h in d0 d1; do emit "end.$h.requests_tracked" "$(metric "$h" kvlease_requests_tracked)"; done

# --- the fault table ----------------------------------------------------------------------
echo
printf '%-10s %-44s %5s %5s %8s %10s %8s %10s %7s %6s\n' \
  fault what sent ok retried fail-retry fail-oth recover_s wasted wrong
while read -r tag what; do
  printf '%-10s %-44s %5s %5s %8s %10s %8s %10s %7s %6s\n' "$tag" "$what" \
    "${ROW[$tag.sent]}" "${ROW[$tag.ok]}" "${ROW[$tag.retried]}" "${ROW[$tag.fr]}" \
    "${ROW[$tag.fo]}" "${ROW[$tag.recover]}" "${ROW[$tag.wasted]}" "${ROW[$tag.wrong]}"
done <<EOF
baseline none (2 P x 2 D, probe lease left to expire)
pkill kill -9 P0 + restart, requests queued on D
dkill kill -9 D0 + restart, leases outstanding
partition P0<->D dropped ${CUT_S}s (lease ${LEASE_S}s), healed
dstall SIGSTOP D0 ${STOP_S}s, SIGCONT
EOF
echo
echo "(fail-oth in dkill: requests D0 held when killed, answered 502 by the proxy;"
echo " ok counts answers after the proxy's retries; retried = kvlease_proxy_retries_total delta;"
echo " recover_s = fault end (restart / heal / SIGCONT) to the first ok answer of a request sent"
echo " after it; wasted = P leases expired or aborted (+ the killed P's active leases))"
for tag in baseline pkill dkill partition dstall; do
  echo "table.$tag ok=${ROW[$tag.ok]} retried=${ROW[$tag.retried]} failed_retryable=${ROW[$tag.fr]} failed_other=${ROW[$tag.fo]} recover_s=${ROW[$tag.recover]} wasted_prefills=${ROW[$tag.wasted]} wrong_outputs=${ROW[$tag.wrong]}" | tee -a "$OUT"
done
for h in p0 p1 d0 d1 d2 d3; do
  n=$(grep -c -E ' (ERROR|WARN) ' "$WORK/$h.log" || true)
  emit "logs.$h.warn_or_error_lines" "$n"
done

emit netns.wall_s "$(since "$STARTED")"
if [ "${#FAILURES[@]}" = 0 ]; then
  echo "netns: OK"
else
  printf 'failed: %s\n' "${FAILURES[@]}"
  echo "netns: FAILED ${#FAILURES[@]} check(s): $(IFS=';'; echo "${FAILURES[*]}") (logs in $WORK)"
  exit 1
fi
