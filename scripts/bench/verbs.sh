#!/usr/bin/env bash
# Verbs backend throughput vs perftest's ib_read_bw and ib_write_bw, in ONE SoftRoCE VM
# and one run, on the same device pair (rxeP on vP <-veth-> vD on rxeD; D reads P's
# memory, and in push mode P writes into D's), at 64 KiB and 1 MiB. Prints key=value
# lines (retries_*_rN: rxe's completer retries of the requester during that measurement),
# ending with ratio_vs_ib_read_bw= (1 MiB, means of the rounds) and its _best variant
# (best round against best round), and the same for writes (ratio_write_vs_ib_write_bw=).
# Emulated (TCG) figures mean something only as ratios.
#   env: BENCH_MB (MiB moved per measurement, default 128), SR_TIMEOUT (VM limit, 900)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SR=$ROOT/scripts/softroce
cd "$ROOT"
bash "$SR/setup-host.sh" >/dev/null || { echo "bench/verbs.sh: setup-host.sh failed" >&2; exit 1; }
json=$(cargo build --release --locked -p kvlease-transport --features verbs \
  --example verbs_read_bw --message-format=json) || { echo "bench/verbs.sh: build failed" >&2; exit 1; }
BIN=$(printf '%s\n' "$json" | python3 -c '
import json, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") \
            and m.get("target", {}).get("name") == "verbs_read_bw":
        print(m["executable"])')
[ -x "$BIN" ] || { echo "bench/verbs.sh: example binary not found" >&2; exit 1; }
MB=${BENCH_MB:-128}
G=$(mktemp -d /tmp/kvlease-bench.XXXXXX)
cat > "$G/guest.sh" <<GUEST
#!/bin/bash
# inside the VM
. $SR/guest-rxe-setup.sh > /tmp/setup.log 2>&1 || { cat /tmp/setup.log; exit 1; }
ulimit -l unlimited
pt() { # size iters port
  timeout 300 ib_read_bw -d rxeP -x 1 -s \$1 -n \$2 -p \$3 -F --report_gbits > /tmp/pt_s.log 2>&1 &
  local sp=\$!
  sleep 1.5
  timeout 300 ib_read_bw -d rxeD -x 1 -s \$1 -n \$2 -p \$3 -F --report_gbits 10.77.2.1 > /tmp/pt_c.log 2>&1
  wait \$sp
  awk -v s=\$1 '\$1==s && NF>=4 {print \$4}' /tmp/pt_c.log | tail -1
}
ptw() { # size iters port: P (the client) writes into D
  timeout 300 ib_write_bw -d rxeD -x 1 -s \$1 -n \$2 -p \$3 -F --report_gbits > /tmp/pw_s.log 2>&1 &
  local sp=\$!
  sleep 1.5
  timeout 300 ib_write_bw -d rxeP -x 1 -s \$1 -n \$2 -p \$3 -F --report_gbits 10.77.2.2 > /tmp/pw_c.log 2>&1
  wait \$sp
  awk -v s=\$1 '\$1==s && NF>=4 {print \$4}' /tmp/pw_c.log | tail -1
}
n64=\$(( $MB * 16 )); n1m=$MB
# rxe's retries (rxeD's completer_retry_err) during each measurement: a round with
# retries runs at a fraction of a clean one's speed, for perftest as for us.
R=/sys/class/infiniband/rxeD/ports/1/hw_counters/completer_retry_err
retries() { local v; read -r v < \$R 2>/dev/null || v=0; echo "retries_\$1_r\$round=\$((v - r0))"; }
# Writes: P is the requester.
RP=/sys/class/infiniband/rxeP/ports/1/hw_counters/completer_retry_err
wretries() { local v; read -r v < \$RP 2>/dev/null || v=0; echo "retries_\$1_r\$round=\$((v - r0))"; }
# Interleave ours and perftest's, twice each, so both see the same machine load.
for round in 1 2; do
  read -r r0 < \$R 2>/dev/null || r0=0
  echo "ib_read_bw_64k_gbit_s_r\$round=\$(pt 65536 \$n64 18600)"; retries ib_read_bw_64k
  read -r r0 < \$R 2>/dev/null || r0=0
  $BIN rxeP rxeD 65536 \$n64 64 | sed "s/=/_r\$round=/"; retries verbs_64k
  read -r r0 < \$R 2>/dev/null || r0=0
  echo "ib_read_bw_1m_gbit_s_r\$round=\$(pt 1048576 \$n1m 18601)"; retries ib_read_bw_1m
  read -r r0 < \$R 2>/dev/null || r0=0
  $BIN rxeP rxeD 1048576 \$n1m 64 | sed "s/=/_r\$round=/"; retries verbs_1m
  read -r r0 < \$RP 2>/dev/null || r0=0
  echo "ib_write_bw_64k_gbit_s_r\$round=\$(ptw 65536 \$n64 18602)"; wretries ib_write_bw_64k
  read -r r0 < \$RP 2>/dev/null || r0=0
  KV_BENCH_OP=write $BIN rxeP rxeD 65536 \$n64 64 | sed "s/=/_r\$round=/"; wretries verbs_write_64k
  read -r r0 < \$RP 2>/dev/null || r0=0
  echo "ib_write_bw_1m_gbit_s_r\$round=\$(ptw 1048576 \$n1m 18603)"; wretries ib_write_bw_1m
  read -r r0 < \$RP 2>/dev/null || r0=0
  KV_BENCH_OP=write $BIN rxeP rxeD 1048576 \$n1m 64 | sed "s/=/_r\$round=/"; wretries verbs_write_1m
done
GUEST
chmod +x "$G/guest.sh"
OUT=$(SR_TIMEOUT=${SR_TIMEOUT:-900} SR_ACCEL=${SR_ACCEL:-tcg} bash "$SR/run-vm.sh" "$G/guest.sh" "$G" 2>&1 | tr -d '\r')
rm -rf "$G"
kv=$(printf '%s\n' "$OUT" | grep -aE '^[a-z0-9_]+=[0-9.]*$')
if [ -z "$kv" ]; then printf '%s\n' "$OUT" | tail -30; echo "bench/verbs.sh: no figures" >&2; exit 1; fi
printf '%s\n' "$kv"
printf '%s\n' "$kv" | python3 -c '
import sys
kv = dict(l.strip().split("=", 1) for l in sys.stdin if "=" in l)
def vals(prefix):
    return [float(x) for k, x in kv.items() if k.startswith(prefix) and x]
def mean(prefix):
    v = vals(prefix)
    return sum(v) / len(v) if v else float("nan")
def best(prefix):
    v = vals(prefix)
    return max(v) if v else float("nan")
for size in ("64k", "1m"):
    ours, ref = mean(f"verbs_read_{size}_gbit_s_r"), mean(f"ib_read_bw_{size}_gbit_s_r")
    print(f"verbs_read_{size}_gbit_s={ours:.3f}")
    print(f"ib_read_bw_{size}_gbit_s={ref:.3f}")
    key = "ratio_64k_vs_ib_read_bw" if size == "64k" else "ratio_vs_ib_read_bw"
    print(f"{key}={ours / ref:.3f}")
    # Best round against best round: one round with retries (either side) moves the mean.
    b = best(f"verbs_read_{size}_gbit_s_r") / best(f"ib_read_bw_{size}_gbit_s_r")
    print(f"{key}_best={b:.3f}")
for size in ("64k", "1m"):
    ours, ref = mean(f"verbs_write_{size}_gbit_s_r"), mean(f"ib_write_bw_{size}_gbit_s_r")
    print(f"verbs_write_{size}_gbit_s={ours:.3f}")
    print(f"ib_write_bw_{size}_gbit_s={ref:.3f}")
    key = "ratio_write_64k_vs_ib_write_bw" if size == "64k" else "ratio_write_vs_ib_write_bw"
    print(f"{key}={ours / ref:.3f}")
    b = best(f"verbs_write_{size}_gbit_s_r") / best(f"ib_write_bw_{size}_gbit_s_r")
    print(f"{key}_best={b:.3f}")
'
