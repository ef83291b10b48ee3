#!/usr/bin/env bash
# Transport benchmark on loopback, every peer measured in the same run:
#   ours (TCP backend, crates/transport/examples/tcp_bench.rs: READ sweep 16 KiB..4 MiB x
#   1..256 blocks, notification RTT), iperf3 (one stream), ucx_perftest -t ucp_get over
#   UCX_TLS=tcp (Debian's UCX), and NIXL 1.5.1 from PyPI (READ/WRITE 64 x 64 KiB and
#   64 x 1 MiB, notification RTT; scripts/bench/nixl/nixl_pair.py).
# Prints one key=value per figure (GB/s = 10^9 bytes/s), ending with
#   ratio_vs_iperf3= ratio_vs_nixl_read= ratio_vs_nixl_write= (ours: READ 64 x 1 MiB)
#   notif_rtt_us= nixl_notif_rtt_us=
# Env: KVLEASE_NIXL_VENV (default /var/tmp/kvlease-nixl-venv), CARGO_TARGET_DIR,
#      BENCH_SECONDS (per sweep point, default 0.2).
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup.sh bench >&2

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
echo "building tcp_bench (release)" >&2
cargo build -q --release --locked -p kvlease-transport --no-default-features --example tcp_bench >&2
BENCH=$CARGO_TARGET_DIR/release/examples/tcp_bench

VENV=${KVLEASE_NIXL_VENV:-/var/tmp/kvlease-nixl-venv}
if ! "$VENV/bin/python" -c 'import nixl._api, numpy' >/dev/null 2>&1; then
  echo "making NIXL venv in $VENV" >&2
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1 numpy >&2
fi

out=$(mktemp -d)
trap 'rm -rf "$out"; jobs -p | xargs -r kill 2>/dev/null || true' EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
get() { sed -n "s/^$1=//p" "$out/all" | tail -1; }

# --- ours ---
timeout 150 "$BENCH" --sweep --seconds "${BENCH_SECONDS:-0.2}" | tee -a "$out/all"

# --- iperf3, one stream ---
port=$(free_port)
iperf3 -s -1 -p "$port" >/dev/null 2>&1 &
sleep 0.5
timeout 30 iperf3 -c 127.0.0.1 -p "$port" -t 3 -J >"$out/iperf.json"
python3 - "$out/iperf.json" <<'EOF' | tee -a "$out/all"
import json, sys
d = json.load(open(sys.argv[1]))
bps = d["end"]["sum_received"]["bits_per_second"]
print(f"iperf3_gbit={bps / 1e9:.2f}")
print(f"iperf3_gbps={bps / 8e9:.3f}")
EOF

# --- UCX 1.13 ucp_get over TCP ---
export UCX_TLS=tcp UCX_NET_DEVICES=lo
port=$(free_port)
timeout 60 ucx_perftest -p "$port" >/dev/null 2>&1 &
sleep 1
if timeout 50 ucx_perftest 127.0.0.1 -p "$port" -t ucp_get -s 1048576 -n 200 >"$out/ucx.txt" 2>&1; then
  # "Final:" row: iterations, 3 latencies, bandwidth average, bandwidth overall (MB/s = 2^20).
  awk '/^Final:/ { printf "ucx_ucp_get_1m_gbps=%.3f\n", $7 * 1048576 / 1e9 }' "$out/ucx.txt" | tee -a "$out/all"
else
  echo "ucx_ucp_get_1m_gbps=nan" | tee -a "$out/all"
fi

# --- NIXL 1.5.1 ---
port=$(free_port)
timeout 120 "$VENV/bin/python" scripts/bench/nixl/nixl_pair.py --mode target --port "$port" >"$out/nixl-target.log" 2>&1 &
sleep 2
if ! timeout 110 "$VENV/bin/python" scripts/bench/nixl/nixl_pair.py --mode initiator --port "$port" --seconds 1 2>"$out/nixl.err" \
  | grep -E '^[a-z0-9_]+=' | tee -a "$out/all"; then
  echo "nixl run failed:" >&2
  tail -5 "$out/nixl.err" "$out/nixl-target.log" >&2
fi

# --- ratios ---
ours=$(get read_1m_x64_gbps)
ratio() { python3 -c "import sys; a, b = sys.argv[1:]; print(f'{float(a) / float(b):.2f}' if a and b and float(b) > 0 else 'nan')" "$1" "$2"; }
echo "ratio_vs_iperf3=$(ratio "$ours" "$(get iperf3_gbps)")"
echo "ratio_vs_nixl_read=$(ratio "$ours" "$(get nixl_read_1m_x64_gbps)")"
echo "ratio_vs_nixl_write=$(ratio "$ours" "$(get nixl_write_1m_x64_gbps)")"
echo "notif_rtt_us=$(get notif_rtt_us)"
echo "nixl_notif_rtt_us=$(get nixl_notif_rtt_us)"
