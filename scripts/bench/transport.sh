#!/usr/bin/env bash
# Transport benchmark on one host (loopback), every peer measured in the same run:
#   memcpy     single-thread memcpy of 64 x 64 KiB and 64 x 1 MiB between two buffers, warm
#              (crates/transport/examples/memcpy_bench.rs): the limit of a same-host READ.
#   ours TCP   tcp_bench (crates/transport/examples/tcp_bench.rs): READ sweep 16 KiB..4 MiB
#              x 1..256 blocks, READ 64 x 1 MiB and 64 x 64 KiB, notification RTT, and
#              fenced WRITE 64 x 1 MiB and 64 x 64 KiB next to READ (tcp_write_gbps_64x1m,
#              tcp_read_gbps_64x1m, tcp_write_over_read_64x1m, the same for 64x64k).
#   ours shm   tcp_bench --backend shm: the same-host shared-memory backend, keys shm_*; with
#              fenced WRITE 64 x 1 MiB and 64 x 64 KiB next to READ (shm_write_gbps_64x1m,
#              shm_read_gbps_64x1m, shm_write_over_read_64x1m, the same for 64x64k): the
#              writer names its memfd-backed source on the shm link's Unix socket, the
#              target pulls the bytes from it under its fence lock.
#   ours cma   tcp_bench --backend cma: the same link, the target's regions plain heap memory
#              (not memfd-backed, as host tensors registered from Python), read with
#              cross-memory attach (process_vm_readv), keys cma_*; WRITE from and into such
#              memory (cma_write_gbps_64x1m, cma_read_gbps_64x1m, cma_write_over_read_64x1m,
#              the same for 64x64k): the writer names its heap source by address, the
#              target reads it with process_vm_readv under its fence lock.
#   ours TCP, staged memory  tcp_bench --backend tcp --staged: every region but the fence
#              staged (host memory moved as CUDA device memory is): READ through the
#              pipelined stager, fenced WRITE through the writer's host bounce buffer and
#              the receiver's landing copy; keys tcp_staged_* (write and read 64 x 1 MiB and
#              64 x 64 KiB).
#   iperf3     one stream; ucx_perftest -t ucp_get over UCX_TLS=tcp (Debian's UCX 1.13).
#   NIXL 1.5.1 from PyPI (scripts/bench/nixl/nixl_pair.py), twice: UCX's default transports
#              (UCX_TLS unset; on one host READ goes through cma), keys nixl_shm_*; and
#              UCX_TLS=tcp, keys nixl_tcp_*. READ/WRITE 64 x 64 KiB and 64 x 1 MiB, notif RTT.
#   Mooncake   Transfer Engine from PyPI (mooncake-transfer-engine-non-cuda), TCP protocol,
#              P2PHANDSHAKE metadata (no metadata server), batch_transfer_sync_read of
#              64 x 64 KiB and 64 x 1 MiB (scripts/bench/mooncake/mooncake_pair.py).
# Prints one key=value per figure (GB/s = 10^9 bytes/s, RTT in µs), then the ratios:
#   ratio_vs_nixl_shm_read=     ours best same-host backend (max of shm and TCP), READ
#                               64 x 1 MiB, over NIXL with UCX's defaults
#   ratio_vs_nixl_shm_read_64k= the same at 64 x 64 KiB
#   ratio_vs_memcpy=            ours best same-host READ 64 x 1 MiB over memcpy
#   cma_ratio_vs_memcpy=        our cma READ 64 x 1 MiB (non-memfd host memory) over memcpy
#   cma_ratio_vs_nixl_shm_read= the same over NIXL with UCX's defaults (UCX's cma)
#   ratio_vs_mooncake_read=     our TCP READ 64 x 1 MiB over Mooncake's (and _64k=)
#   notif_ratio_vs_nixl=        our TCP notification RTT over NIXL over TCP's
#   shm_notif_ratio_vs_nixl=    our shm notification RTT over NIXL with UCX's defaults
#   ratio_vs_iperf3= ratio_vs_nixl_read= ratio_vs_nixl_write= (our TCP READ 64 x 1 MiB over
#   iperf3 and NIXL over TCP), notif_rtt_us= nixl_notif_rtt_us= (TCP, as before).
#   write_ratio_vs_nixl_write= (and _64k=) our TCP fenced WRITE over NIXL's WRITE over TCP;
#   write_ratio_vs_nixl_shm_write= (and _64k=) the same over NIXL with UCX's defaults.
#   tcp_staged_write_over_host_write= (and _64k=) our TCP fenced WRITE from and into staged
#                               memory over the same from and into host memory (this run)
#   shm_write_ratio_vs_nixl_shm_write= (and _64k=) our same-host fenced WRITE (shm link,
#                               memfd source and destination) over NIXL's WRITE with UCX's
#                               defaults; cma_write_ratio_vs_nixl_shm_write= the same, heap
#                               source and destination (as NIXL's).
# A single run's notification RTTs are noisy: scripts/bench/notif.sh interleaves rounds.
# A peer that fails prints its keys as nan (the reason on stderr) and the run goes on.
# Env: KVLEASE_NIXL_VENV (default /var/tmp/kvlease-nixl-venv), KVLEASE_MOONCAKE_VENV
#      (default /var/tmp/kvlease-mooncake-venv), CARGO_TARGET_DIR, BENCH_SECONDS (per sweep
#      point, default 0.2), PEER_SECONDS (per NIXL / Mooncake / memcpy point, default 1).
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/bench/lib.sh
bash scripts/setup.sh bench >&2

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
echo "building tcp_bench and memcpy_bench (release)" >&2
cargo build -q --release --locked -p kvlease-transport --no-default-features \
  --example tcp_bench --example memcpy_bench >&2
BENCH=$CARGO_TARGET_DIR/release/examples/tcp_bench
MEMCPY=$CARGO_TARGET_DIR/release/examples/memcpy_bench
PS=${PEER_SECONDS:-1}

nixl_ok=0 mooncake_ok=0
nixl_venv && nixl_ok=1
mooncake_venv && mooncake_ok=1

bench_tmp
# tcp_bench with --backend $1, whose figures only count when it printed backend=$1: for
# shm, the link landed on shm; for cma, every measured batch said cma (tcp_bench checks it).
ours_backend() {
  local o
  o=$(timeout 120 "$BENCH" --backend "$1" --seconds 0.25) || return 1
  grep -qx "backend=$1" <<<"$o" \
    || { echo "tcp_bench printed no backend=$1 (built without --backend $1?)" >&2; return 1; }
  # Its write keys carry the backend already; `peer --prefix` adds it back.
  sed "s/^$1_//" <<<"$o"
}
ours_shm() { ours_backend shm; }
ours_cma() { ours_backend cma; }
# Staged memory: only its write/read pair keys (its READ headline keys would shadow TCP's).
ours_tcp_staged() {
  local o
  o=$(timeout 120 "$BENCH" --backend tcp --staged --seconds 0.25) || return 1
  grep -qx "staged=true" <<<"$o" || { echo "tcp_bench printed no staged=true" >&2; return 1; }
  grep '^tcp_staged_' <<<"$o"
}
# The TCP run's 64 x 64 KiB figure: its own longer point, else the sweep's.
ours_tcp() {
  local o
  o=$(timeout 200 "$BENCH" --backend tcp --sweep --seconds "${BENCH_SECONDS:-0.2}") || return 1
  printf '%s\n' "$o"
  grep -q '^read_64k_x64_gbps=' <<<"$o" || sed -n 's/^read_gbps_64k_x64=/read_64k_x64_gbps=/p' <<<"$o"
}
nixl() { # MODE(shm|tcp) ENV...
  nixl_run "$1" "$PS" "${@:2}"
}
mooncake() {
  [ "$mooncake_ok" = 1 ] || { echo "no Mooncake venv" >&2; return 1; }
  timeout 120 "$MOONCAKE_VENV/bin/python" scripts/bench/mooncake/mooncake_pair.py --seconds "$PS"
}
iperf() {
  local port
  port=$(free_port)
  timeout 40 iperf3 -s -1 -p "$port" >/dev/null 2>&1 &
  wait_listen "$port" 10 || { echo "iperf3 server did not listen" >&2; return 1; }
  timeout 30 iperf3 -c 127.0.0.1 -p "$port" -t 3 -J >"$BENCH_TMP/iperf.json"
  python3 - "$BENCH_TMP/iperf.json" <<'EOF'
import json, sys
bps = json.load(open(sys.argv[1]))["end"]["sum_received"]["bits_per_second"]
print(f"iperf3_gbit={bps / 1e9:.2f}")
print(f"iperf3_gbps={bps / 8e9:.3f}")
EOF
}
ucx() { # UCX 1.13 ucp_get over TCP; "Final:" row: iterations, 3 latencies, bandwidth
  # average, bandwidth overall (MB/s = 2^20).
  local port
  port=$(free_port)
  UCX_TLS=tcp UCX_NET_DEVICES=lo timeout 60 ucx_perftest -p "$port" >/dev/null 2>&1 &
  wait_listen "$port" 10 || { echo "ucx_perftest server did not listen" >&2; return 1; }
  UCX_TLS=tcp UCX_NET_DEVICES=lo timeout 50 ucx_perftest 127.0.0.1 -p "$port" -t ucp_get \
    -s 1048576 -n 200 >"$BENCH_TMP/ucx.txt" 2>&1
  awk '/^Final:/ { printf "ucx_ucp_get_1m_gbps=%.3f\n", $7 * 1048576 / 1e9 }' "$BENCH_TMP/ucx.txt"
}

peer memcpy "memcpy_64k_x64_gbps memcpy_1m_x64_gbps" timeout 60 "$MEMCPY" --seconds "$PS"
peer ours_tcp "read_1m_x64_gbps read_64k_x64_gbps notif_rtt_us notif_rtt_p99_us \
  tcp_write_gbps_64x1m tcp_read_gbps_64x1m tcp_write_over_read_64x1m \
  tcp_write_gbps_64x64k tcp_read_gbps_64x64k tcp_write_over_read_64x64k" ours_tcp
peer ours_shm "shm_read_1m_x64_gbps shm_read_64k_x64_gbps shm_notif_rtt_us shm_notif_rtt_p99_us \
  shm_write_gbps_64x1m shm_read_gbps_64x1m shm_write_over_read_64x1m \
  shm_write_gbps_64x64k shm_read_gbps_64x64k shm_write_over_read_64x64k" --prefix shm_ ours_shm
peer ours_cma "cma_read_1m_x64_gbps cma_read_64k_x64_gbps \
  cma_write_gbps_64x1m cma_read_gbps_64x1m cma_write_over_read_64x1m \
  cma_write_gbps_64x64k cma_read_gbps_64x64k cma_write_over_read_64x64k" --prefix cma_ ours_cma
peer ours_tcp_staged "tcp_staged_write_gbps_64x1m tcp_staged_read_gbps_64x1m \
  tcp_staged_write_gbps_64x64k tcp_staged_read_gbps_64x64k" ours_tcp_staged
peer iperf3 "iperf3_gbps" iperf
peer ucx_perftest "ucx_ucp_get_1m_gbps" ucx
nixl_keys() { for k in read_64k_x64_gbps read_1m_x64_gbps write_64k_x64_gbps write_1m_x64_gbps notif_rtt_us; do printf 'nixl_%s_%s ' "$1" "$k"; done; }
peer nixl_shm "$(nixl_keys shm)" nixl shm -u UCX_TLS -u UCX_NET_DEVICES
peer nixl_tcp "$(nixl_keys tcp)" nixl tcp UCX_TLS=tcp UCX_NET_DEVICES=lo
peer mooncake "mooncake_read_64k_x64_gbps mooncake_read_1m_x64_gbps" mooncake

# --- ratios ---
same_1m=$(fmax "$(get shm_read_1m_x64_gbps)" "$(get read_1m_x64_gbps)")
same_64k=$(fmax "$(get shm_read_64k_x64_gbps)" "$(get read_64k_x64_gbps)")
echo "ours_same_host_read_1m_x64_gbps=$same_1m"
echo "ours_same_host_read_64k_x64_gbps=$same_64k"
echo "ratio_vs_nixl_shm_read=$(ratio "$same_1m" "$(get nixl_shm_read_1m_x64_gbps)")"
echo "ratio_vs_nixl_shm_read_64k=$(ratio "$same_64k" "$(get nixl_shm_read_64k_x64_gbps)")"
echo "ratio_vs_memcpy=$(ratio "$same_1m" "$(get memcpy_1m_x64_gbps)")"
echo "cma_ratio_vs_memcpy=$(ratio "$(get cma_read_1m_x64_gbps)" "$(get memcpy_1m_x64_gbps)")"
echo "cma_ratio_vs_nixl_shm_read=$(ratio "$(get cma_read_1m_x64_gbps)" "$(get nixl_shm_read_1m_x64_gbps)")"
echo "ratio_vs_mooncake_read=$(ratio "$(get read_1m_x64_gbps)" "$(get mooncake_read_1m_x64_gbps)")"
echo "ratio_vs_mooncake_read_64k=$(ratio "$(get read_64k_x64_gbps)" "$(get mooncake_read_64k_x64_gbps)")"
echo "notif_ratio_vs_nixl=$(ratio "$(get notif_rtt_us)" "$(get nixl_tcp_notif_rtt_us)")"
echo "shm_notif_ratio_vs_nixl=$(ratio "$(get shm_notif_rtt_us)" "$(get nixl_shm_notif_rtt_us)")"
echo "ratio_vs_iperf3=$(ratio "$(get read_1m_x64_gbps)" "$(get iperf3_gbps)")"
echo "ratio_vs_nixl_read=$(ratio "$(get read_1m_x64_gbps)" "$(get nixl_tcp_read_1m_x64_gbps)")"
echo "ratio_vs_nixl_write=$(ratio "$(get read_1m_x64_gbps)" "$(get nixl_tcp_write_1m_x64_gbps)")"
echo "write_ratio_vs_nixl_write=$(ratio "$(get tcp_write_gbps_64x1m)" "$(get nixl_tcp_write_1m_x64_gbps)")"
echo "write_ratio_vs_nixl_write_64k=$(ratio "$(get tcp_write_gbps_64x64k)" "$(get nixl_tcp_write_64k_x64_gbps)")"
echo "write_ratio_vs_nixl_shm_write=$(ratio "$(get tcp_write_gbps_64x1m)" "$(get nixl_shm_write_1m_x64_gbps)")"
echo "write_ratio_vs_nixl_shm_write_64k=$(ratio "$(get tcp_write_gbps_64x64k)" "$(get nixl_shm_write_64k_x64_gbps)")"
echo "tcp_staged_write_over_host_write=$(ratio "$(get tcp_staged_write_gbps_64x1m)" "$(get tcp_write_gbps_64x1m)")"
echo "tcp_staged_write_over_host_write_64k=$(ratio "$(get tcp_staged_write_gbps_64x64k)" "$(get tcp_write_gbps_64x64k)")"
echo "shm_write_ratio_vs_nixl_shm_write=$(ratio "$(get shm_write_gbps_64x1m)" "$(get nixl_shm_write_1m_x64_gbps)")"
echo "shm_write_ratio_vs_nixl_shm_write_64k=$(ratio "$(get shm_write_gbps_64x64k)" "$(get nixl_shm_write_64k_x64_gbps)")"
echo "cma_write_ratio_vs_nixl_shm_write=$(ratio "$(get cma_write_gbps_64x1m)" "$(get nixl_shm_write_1m_x64_gbps)")"
echo "cma_write_ratio_vs_nixl_shm_write_64k=$(ratio "$(get cma_write_gbps_64x64k)" "$(get nixl_shm_write_64k_x64_gbps)")"
echo "notif_rtt_us=$(get notif_rtt_us)"
echo "nixl_notif_rtt_us=$(get nixl_tcp_notif_rtt_us)"
