#!/usr/bin/env bash
# The Python-binding pair benchmark (issue 23, item 5): two processes on one host, D READs
# from P through the kvlease Python binding, and NIXL beside it on the same work.
#
#   scripts/bench/pair.sh [--memory host|cuda] [--alloc auto|numpy|torch] [--rounds N]
#                         [--seconds S] [--backends "auto tcp"] [--no-nixl] [--offline]
#
# Work (scripts/bench/pair/pairlib.py): READ of 64 x 64 KiB, 64 x 1 MiB, 256 x 4 MiB (1 GiB)
# from P's buffer into D's at the same offsets, each verified byte for byte, then timed for
# S seconds (default 1). Memory: `host`, numpy arrays or torch CPU tensors (plain heap, not
# memfd: kvlease reads it with cross-memory attach, backend cma), or `cuda`, torch CUDA
# tensors (kvlease: CUDA IPC over the shm link); without torch.cuda, `cuda` prints
# pair_skipped=... and exits 0. --alloc auto: torch where both Pythons import it, else numpy.
# Peers, each round (--rounds N, default 1; the summary takes the median):
#   kvlease_<backend>_<mem>_*  scripts/bench/pair/kvlease_pair.py read, per --backends
#                              (default "auto tcp"); _backend_<w>= is what the batch result
#                              reported (BatchResult.backend), _link= the connection's backend
#   nixl_<mem>_*               scripts/bench/nixl/nixl_pair.py --pair, UCX defaults (UCX_TLS
#                              unset; on one host UCX reads host memory with cma)
#   copy_<mem>_*               the same chunks copied inside one process (the reference)
# Then, on the medians:
#   ratio_<mem>_<w>_vs_nixl=   kvlease auto over NIXL, w in 64k_x64, 1m_x64, 4m_x256
#   ratio_<mem>_<w>_vs_copy=   kvlease auto over the in-process copy
#   ratio_host_1m_x64_vs_nixl_goal=1.5 and ..._met=0|1 (the issue's goal for host memory;
#                              nan without NIXL)
# Keys are key=value, GB/s = 10^9 B/s; a peer that fails prints nan (its reason on stderr).
# Pythons: KVLEASE_PAIR_PYTHON must import kvlease (default: the vLLM venv's, else python3;
# make it with scripts/python-test.sh, or pip install a wheel of crates/python). NIXL runs in
# KVLEASE_PAIR_NIXL_PYTHON if set, else in KVLEASE_PAIR_PYTHON when that imports nixl (e.g.
# an unpacked wheel on PYTHONPATH), else (host memory, not --offline / KVLEASE_PAIR_OFFLINE=1)
# in the venv lib.sh's nixl_venv makes from PyPI (KVLEASE_NIXL_VENV); else it is skipped.
# Nothing is built or installed with --offline: fit for a machine without a network (an
# unpacked nixl-cu13 wheel's UCX needs libcudart.so.13 on LD_LIBRARY_PATH, e.g. torch's
# nvidia/cu13/lib).
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/bench/lib.sh

MEMORY=host ALLOC=auto ROUNDS=1 SECONDS_PER=1 BACKENDS="auto tcp" WITH_NIXL=1
OFFLINE=${KVLEASE_PAIR_OFFLINE:-0}
while [ $# -gt 0 ]; do
  case $1 in
    --memory) MEMORY=$2; shift 2 ;;
    --alloc) ALLOC=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --seconds) SECONDS_PER=$2; shift 2 ;;
    --backends) BACKENDS=$2; shift 2 ;;
    --no-nixl) WITH_NIXL=0; shift ;;
    --offline) OFFLINE=1; shift ;;
    *) echo "pair.sh: unknown argument $1 (see the header)" >&2; exit 2 ;;
  esac
done
case $MEMORY in host | cuda) ;; *) echo "pair.sh: --memory host or cuda" >&2; exit 2 ;; esac

PY=${KVLEASE_PAIR_PYTHON:-}
if [ -z "$PY" ]; then
  PY=python3
  [ -x /var/tmp/kvlease-vllm-venv/bin/python ] && PY=/var/tmp/kvlease-vllm-venv/bin/python
fi
"$PY" -c 'import kvlease, numpy' 2>/dev/null || {
  echo "pair.sh: $PY does not import kvlease and numpy; set KVLEASE_PAIR_PYTHON (a venv with" \
    "our wheel: scripts/python-test.sh makes one)" >&2
  exit 1
}
imports_torch() { "$1" -c 'import torch' >/dev/null 2>&1; }
if [ "$MEMORY" = cuda ]; then
  if ! why=$("$PY" -c 'import torch; assert torch.cuda.is_available(), "torch.cuda is not available"' 2>&1); then
    echo "pair_skipped=cuda ($(tail -n 1 <<<"$why"))"
    exit 0
  fi
fi

# --- NIXL's Python -------------------------------------------------------------------------
NIXL_IMPORT='import importlib, sys
for m in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
    try:
        importlib.import_module(m)
        sys.exit(0)
    except ImportError:
        pass
sys.exit(1)'
nixl_ok=0
NIXL_PYTHON=""
if [ "$WITH_NIXL" = 1 ]; then
  if [ -n "${KVLEASE_PAIR_NIXL_PYTHON:-}" ]; then
    NIXL_PYTHON=$KVLEASE_PAIR_NIXL_PYTHON
  elif "$PY" -c "$NIXL_IMPORT" 2>/dev/null; then
    NIXL_PYTHON=$PY
  elif [ "$MEMORY" = host ] && [ "$OFFLINE" != 1 ] && nixl_venv; then
    NIXL_PYTHON=$NIXL_VENV/bin/python
  fi
  if [ -n "$NIXL_PYTHON" ] && "$NIXL_PYTHON" -c "$NIXL_IMPORT" 2>/dev/null; then
    nixl_ok=1
  else
    echo "pair.sh: NIXL skipped (no Python here imports nixl${NIXL_PYTHON:+: $NIXL_PYTHON})" >&2
  fi
fi
if [ "$ALLOC" = auto ]; then
  ALLOC=numpy
  if [ "$MEMORY" = cuda ]; then
    ALLOC=torch
  elif imports_torch "$PY" && { [ "$nixl_ok" = 0 ] || imports_torch "$NIXL_PYTHON"; }; then
    ALLOC=torch
  fi
fi
[ "$MEMORY" = host ] || ALLOC=torch
echo "pair_memory=$MEMORY"
echo "pair_alloc=$ALLOC"
echo "pair_cores=$(nproc)"

bench_tmp
W="64k_x64 1m_x64 4m_x256"
keys() { local k; for k in $W; do printf '%s_read_%s_gbps ' "$1" "$k"; done; }
ARGS=(--memory "$MEMORY" --alloc "$ALLOC" --seconds "$SECONDS_PER")
NIXL_ARGS=(--pair --memory "$MEMORY" --alloc "$ALLOC")
NIXL_PYTHON=${NIXL_PYTHON:-none} NIXL_TIMEOUT=300
nixl_pair() { nixl_run "$MEMORY" "$SECONDS_PER" -u UCX_TLS -u UCX_NET_DEVICES; }

for r in $(seq 1 "$ROUNDS"); do
  echo "# round $r of $ROUNDS"
  for b in $BACKENDS; do
    peer "kvlease-$b-$r" "$(keys "kvlease_${b}_$MEMORY") kvlease_${b}_${MEMORY}_verified" \
      timeout 300 "$PY" scripts/bench/pair/kvlease_pair.py read "${ARGS[@]}" --backend "$b" \
      --prefix "kvlease_${b}_$MEMORY"
  done
  if [ "$nixl_ok" = 1 ]; then
    peer "nixl-$r" "$(keys "nixl_$MEMORY") nixl_${MEMORY}_verified" nixl_pair
  fi
done
[ "$nixl_ok" = 1 ] || echo "nixl_${MEMORY}_skipped=1"
peer copy "$(keys "copy_$MEMORY")" timeout 120 "$PY" scripts/bench/pair/kvlease_pair.py copy \
  "${ARGS[@]}" --prefix "copy_$MEMORY"

# --- summary: medians over the rounds, then the ratios --------------------------------------
echo "# summary ($ROUNDS round(s); medians; _rounds= lists every round)"
python3 - "$BENCH_TMP/all" <<'EOF' >"$BENCH_TMP/summary"
import math, statistics, sys
vals = {}
for line in open(sys.argv[1]):
    k, _, v = line.strip().partition("=")
    if k.endswith("_gbps"):
        try:
            vals.setdefault(k, []).append(float(v))
        except ValueError:
            pass
for k, vs in vals.items():
    ok = [v for v in vs if math.isfinite(v)]
    print(f"{k}={statistics.median(ok):.3f}" if ok else f"{k}=nan")
    if len(vs) > 1:
        print(f"{k}_rounds=" + ",".join(f"{v:.3f}" for v in vs))
EOF
cat "$BENCH_TMP/summary"
cat "$BENCH_TMP/summary" >>"$BENCH_TMP/all"
for k in $W; do
  b=$(get "kvlease_auto_${MEMORY}_backend_$k")
  [ -z "$b" ] || echo "kvlease_auto_${MEMORY}_batch_backend_$k=$b"
  echo "ratio_${MEMORY}_${k}_vs_nixl=$(ratio "$(get "kvlease_auto_${MEMORY}_read_${k}_gbps")" "$(get "nixl_${MEMORY}_read_${k}_gbps")")"
  echo "ratio_${MEMORY}_${k}_vs_copy=$(ratio "$(get "kvlease_auto_${MEMORY}_read_${k}_gbps")" "$(get "copy_${MEMORY}_read_${k}_gbps")")"
done
if [ "$MEMORY" = host ]; then
  r=$(ratio "$(get kvlease_auto_host_read_1m_x64_gbps)" "$(get nixl_host_read_1m_x64_gbps)")
  echo "ratio_host_1m_x64_vs_nixl_goal=1.5"
  echo "ratio_host_1m_x64_vs_nixl_met=$(python3 -c 'import sys; r = sys.argv[1]; print("nan" if r == "nan" else int(float(r) >= 1.5))' "$r")"
  b=$(get kvlease_auto_host_backend_1m_x64)
  [ "$b" = cma ] || [[ " $BACKENDS " != *" auto "* ]] || echo "pair.sh: kvlease auto's 64 x 1 MiB batch reported backend '${b:-none}', not cma" >&2
fi
