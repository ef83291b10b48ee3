#!/usr/bin/env bash
# scripts/gpu-check.sh: the tier-2 (GPU) checks of kvlease, for a machine with an NVIDIA GPU
# and a CUDA driver, e.g. one H200 with a CUDA 13 driver, 16 cores, no RDMA device and NO
# network access. It never downloads anything and finishes within 8 minutes.
#
#   scripts/gpu-check.sh stage DIR   on a build machine (x86-64 Linux, the repo's usual
#                                    toolchain and crates): build the release binaries the
#                                    check needs, stripped, into DIR (about 40 MiB). Carry
#                                    DIR to the GPU host in an ignored folder.
#   scripts/gpu-check.sh             on the GPU host: run the checks, with binaries from
#                                    $GPU_CHECK_BIN_DIR when it is set, else built here
#                                    from source, offline (needs cargo and vendored crates).
#
# Environment (GPU host):
#   GPU_CHECK_BIN_DIR   binaries made by `stage` (skips the build)
#   KVLEASE_VENDOR_DIR  crates vendored with `cargo vendor --locked DIR` (for a source build;
#                       without it, CARGO_HOME must already hold every crate in its cache)
#   CARGO_HOME, CARGO   the cargo home and binary to use (default: cargo on PATH)
#   CARGO_TARGET_DIR    build dir (default: target/gpu-check)
#   GPU_CHECK_OUT       logs (default: $CARGO_TARGET_DIR/gpu-check-logs, or $OUT when set)
#   GPU_CHECK_BYTES     staging benchmark size in bytes (default 1 GiB)
#   GPU_CHECK_REQUESTS  requests per end-to-end run (default 8)
#   GPU_CHECK_TOKENS    prompt tokens per request (default 2048 = 256 MiB of KV per request)
#   GPU_CHECK_BLOCKS    KV blocks per pool (default 1024 = 2 GiB per agent)
#   GPU_CHECK_HOST_ONLY=1  dry run of this script's plumbing on a machine without a GPU:
#                       only the host-memory steps run (the GPU tests stay ignored; host and staged
#                       end-to-end runs), nothing is claimed about CUDA
#
# Steps: (1) preflight, (2) build, (3) CUDA tests (gpu-mem's, and the CUDA IPC tests of the
# shm transport) with KV_TEST_CUDA=1 and --include-ignored
# (the tests that need a GPU are #[ignore]d, so that a plain `cargo test` lists them as
# ignored instead of passing having done nothing; the host-only dry run leaves them
# ignored and says how many), (4) staging
# benchmark (CUDA copier, host copier), (5) P and D with --memory cuda over TCP on
# localhost, byte-exact digests, (6) the same with --memory host, (7) and with
# --memory staged (host memory through the device code paths: staged fill, pipelined TCP
# staging, copy-back verify).
# Results are printed as key=value lines; the first failure stops the script with a
# message saying what is missing or what broke, and exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
step() { echo "=== [$(($(date +%s) - T0))s] $*" >&2; }
die() { echo "gpu-check: FAILED: $*" >&2; exit 1; }
kv() { echo "$1=$2"; }

BINS=(prefill-agent decode-agent staging_bench gpu-mem-cuda-tests gpu-mem-unit-tests transport-shm-tests)

# Builds every binary of BINS into $1 (release, no debug info, stripped). Extra cargo
# arguments (offline, vendored source) come from CARGO_ARGS; BUILD_TIMEOUT (seconds)
# bounds each cargo command.
build_into() {
  local dir=$1
  local cargo=${CARGO:-cargo}
  command -v "$cargo" >/dev/null || die "cargo not found (set CARGO or PATH; or run 'stage' elsewhere and set GPU_CHECK_BIN_DIR)"
  local limit=()
  [ -z "${BUILD_TIMEOUT:-}" ] || limit=(timeout "$BUILD_TIMEOUT")
  mkdir -p "$dir"
  export CARGO_PROFILE_RELEASE_DEBUG=0
  local target=${CARGO_TARGET_DIR:-target/gpu-check}
  export CARGO_TARGET_DIR=$target
  step "build: agents (TCP + CUDA, no verbs), staging_bench, CUDA tests (release)"
  "${limit[@]}" "$cargo" build "${CARGO_ARGS[@]}" --release --locked -p kvlease-agent \
    --no-default-features --features cuda --bin prefill-agent --bin decode-agent \
    || die "building the agents failed or took over ${BUILD_TIMEOUT:-?} s"
  "${limit[@]}" "$cargo" build "${CARGO_ARGS[@]}" --release --locked -p kvlease-gpu-mem --example staging_bench \
    || die "building staging_bench failed"
  "${limit[@]}" "$cargo" test "${CARGO_ARGS[@]}" --release --locked -p kvlease-gpu-mem --lib --test cuda \
    --no-run --message-format=json >"$dir/.cargo-test.json" \
    || die "building the CUDA tests failed"
  "${limit[@]}" "$cargo" test "${CARGO_ARGS[@]}" --release --locked -p kvlease-transport \
    --no-default-features --features cuda --test shm \
    --no-run --message-format=json >>"$dir/.cargo-test.json" \
    || die "building the shm transport tests failed"
  cp "$target/release/prefill-agent" "$target/release/decode-agent" \
    "$target/release/examples/staging_bench" "$dir/"
  # The test executables' names carry a hash: take them from cargo's JSON messages.
  python3 - "$dir" <<'EOF' || die "could not find the test executables in cargo's output"
import json, shutil, sys
dest = sys.argv[1]
found = {}
for line in open(f"{dest}/.cargo-test.json"):
    try:
        msg = json.loads(line)
    except ValueError:
        continue
    if msg.get("reason") != "compiler-artifact" or not msg.get("executable"):
        continue
    t = msg["target"]
    if t["name"] == "cuda" and "test" in t["kind"]:
        found["gpu-mem-cuda-tests"] = msg["executable"]
    elif t["name"] == "kvlease_gpu_mem" and msg["profile"]["test"]:
        found["gpu-mem-unit-tests"] = msg["executable"]
    elif t["name"] == "shm" and "test" in t["kind"]:
        found["transport-shm-tests"] = msg["executable"]
for name in ("gpu-mem-cuda-tests", "gpu-mem-unit-tests", "transport-shm-tests"):
    shutil.copy(found[name], f"{dest}/{name}")
EOF
  rm -f "$dir/.cargo-test.json"
  if command -v strip >/dev/null; then
    for b in "${BINS[@]}"; do strip "$dir/$b" || true; done
  fi
}

if [ "${1:-}" = stage ]; then
  [ -n "${2:-}" ] || die "usage: scripts/gpu-check.sh stage DIR"
  CARGO_ARGS=()
  build_into "$2"
  du -sh "$2" >&2
  step "staged: carry $2 and run GPU_CHECK_BIN_DIR=$2 scripts/gpu-check.sh on the GPU host"
  exit 0
fi
[ $# -eq 0 ] || die "unknown arguments: $* (usage: scripts/gpu-check.sh [stage DIR])"

LOGS=${GPU_CHECK_OUT:-${OUT:-${CARGO_TARGET_DIR:-target/gpu-check}/gpu-check-logs}}
mkdir -p "$LOGS"
BYTES=${GPU_CHECK_BYTES:-$((1 << 30))}
REQUESTS=${GPU_CHECK_REQUESTS:-8}
TOKENS=${GPU_CHECK_TOKENS:-2048}
HOST_ONLY=${GPU_CHECK_HOST_ONLY:-0}

step "preflight"
[ "$(uname -m)" = x86_64 ] || echo "gpu-check: note: $(uname -m), staged binaries must be built for it" >&2
command -v python3 >/dev/null || die "python3 is needed (HTTP client and JSON parsing of the end-to-end check)"
command -v timeout >/dev/null || die "coreutils 'timeout' is needed"
if [ "$HOST_ONLY" = 1 ]; then
  echo "gpu-check: GPU_CHECK_HOST_ONLY=1: dry run, host memory only" >&2
  kv host_only 1 # the GPU tests stay ignored (counted below): no CUDA claim
elif ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so'; then
  ls /usr/local/nvidia/lib64/libcuda.so* /usr/lib/x86_64-linux-gnu/libcuda.so* >/dev/null 2>&1 \
    || die "no libcuda.so found (ldconfig, /usr/local/nvidia/lib64, /usr/lib/x86_64-linux-gnu): this is not a CUDA host"
fi
if command -v nvidia-smi >/dev/null; then
  gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1) \
    || die "nvidia-smi failed: the driver does not answer"
  kv gpu "\"$gpu\""
fi

if [ -n "${GPU_CHECK_BIN_DIR:-}" ]; then
  BIN=$GPU_CHECK_BIN_DIR
  for b in "${BINS[@]}"; do
    [ -x "$BIN/$b" ] || die "$BIN/$b is missing: run 'scripts/gpu-check.sh stage DIR' on a build machine"
  done
else
  CARGO_ARGS=(--offline)
  if [ -n "${KVLEASE_VENDOR_DIR:-}" ]; then
    [ -d "$KVLEASE_VENDOR_DIR" ] || die "KVLEASE_VENDOR_DIR=$KVLEASE_VENDOR_DIR is not a directory"
    VENDOR=$(cd "$KVLEASE_VENDOR_DIR" && pwd)
    CARGO_ARGS+=(--config 'source.crates-io.replace-with="vendored-sources"'
      --config "source.vendored-sources.directory=\"$VENDOR\"")
  fi
  BIN=${CARGO_TARGET_DIR:-target/gpu-check}/gpu-check-bin
  BUILD_TIMEOUT=200
  build_into "$BIN" 2> >(tee "$LOGS/build.log" >&2)
fi
kv build_s $(($(date +%s) - T0))

step "CUDA tests (KV_TEST_CUDA=1 and --include-ignored: a missing driver fails)"
TEST_ARGS=(--test-threads=4)
if [ "$HOST_ONLY" != 1 ]; then
  export KV_TEST_CUDA=1
  TEST_ARGS+=(--include-ignored)
fi
for t in gpu-mem-unit-tests gpu-mem-cuda-tests transport-shm-tests; do
  # Of the shm transport tests, those of CUDA IPC (P's device memory read by D in another
  # process); the others run in every `cargo test`.
  filter=()
  [ "$t" != transport-shm-tests ] || filter=(cuda_)
  timeout 120 "$BIN/$t" "${filter[@]}" "${TEST_ARGS[@]}" >"$LOGS/$t.log" 2>&1 \
    || { tail -40 "$LOGS/$t.log" >&2; die "$t failed (log: $LOGS/$t.log)"; }
  summary=$(grep -a '^test result:' "$LOGS/$t.log" | tail -1)
  ignored=$(printf '%s' "$summary" | grep -Eo '[0-9]+ ignored' | cut -d' ' -f1)
  # On a GPU host every test runs: one still ignored means the selection went wrong.
  [ "$HOST_ONLY" = 1 ] || [ "${ignored:-0}" = 0 ] || die "$t: $ignored tests stayed ignored ($summary)"
  kv "${t//-/_}_passed" "$(printf '%s' "$summary" | grep -Eo '[0-9]+ passed' | cut -d' ' -f1)"
  kv "${t//-/_}_ignored" "${ignored:-0}"
done

step "staging benchmark: CUDA copier (device memory) and host copier"
bench() { # label memory
  timeout 120 "$BIN/staging_bench" --memory "$2" --bytes "$BYTES" --iters 5 >"$LOGS/bench-$1.log" 2>&1 \
    || { cat "$LOGS/bench-$1.log" >&2; die "staging_bench --memory $2 failed"; }
  grep -q '^verified=1$' "$LOGS/bench-$1.log" || die "staging_bench --memory $2 did not verify"
  sed -n "s/^staging_/${1}staging_/p" "$LOGS/bench-$1.log"
}
[ "$HOST_ONLY" = 1 ] || bench "" cuda
bench "host_" host

AGENT_PIDS=()
cleanup() {
  for pid in "${AGENT_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${AGENT_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  AGENT_PIDS=()
}
trap cleanup EXIT

# End to end: P and D on localhost with --memory $1 and --transport tcp; requests go to P
# (do_remote_decode), then to D with P's kv_transfer_params, as vLLM's proxy does.
e2e() {
  local memory=$1 base=$2
  local p_port=$((base)) p_side=$((base + 10)) d_port=$((base + 20)) d_side=$((base + 30))
  local layout=(--num-layers 32 --num-kv-heads 8 --head-dim 128 --block-size 16 --num-blocks "${GPU_CHECK_BLOCKS:-1024}"
    --transport tcp --memory "$memory" --host 127.0.0.1)
  step "end to end: --memory $memory over TCP ($REQUESTS requests of $TOKENS tokens)"
  RUST_LOG=${RUST_LOG:-info} "$BIN/prefill-agent" "${layout[@]}" --port $p_port --side-channel-port $p_side \
    --engine-id "gpucheck-p-$memory" --prefill-us-per-token 0 >"$LOGS/p-$memory.log" 2>&1 &
  AGENT_PIDS+=($!)
  RUST_LOG=${RUST_LOG:-info} "$BIN/decode-agent" "${layout[@]}" --port $d_port --side-channel-port $d_side \
    --engine-id "gpucheck-d-$memory" >"$LOGS/d-$memory.log" 2>&1 &
  AGENT_PIDS+=($!)
  timeout 150 python3 - "$memory" "$p_port" "$d_port" "$REQUESTS" "$TOKENS" "${AGENT_PIDS[@]}" <<'EOF' \
    || { tail -20 "$LOGS/p-$memory.log" "$LOGS/d-$memory.log" >&2; die "end-to-end run with --memory $memory failed (logs: $LOGS)"; }
import json, os, sys, time, urllib.error, urllib.request
memory, p_port, d_port, n, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
pids = [int(p) for p in sys.argv[6:]]

def fail(msg):
    print(f"gpu-check: {msg}", file=sys.stderr)
    sys.exit(1)

def alive():
    # The agents are the shell's children: a dead one stays a zombie until the shell reaps
    # it, so read its state instead of probing with a signal.
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        if state in ("Z", "X"):
            return False
    return True

def post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        fail(f"POST :{port} answered {e.code}: {e.read()[:500]!r}")

deadline = time.time() + 60
for port in (p_port, d_port):
    while True:
        if not alive():
            fail(f"an agent exited during start-up (--memory {memory})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.time() > deadline:
            fail(f"agent on :{port} not healthy after 60 s")
        time.sleep(0.2)

total_bytes, read_ms, backends = 0, 0.0, set()
t0 = time.time()
for i in range(n):
    prompt = [(i * 7919 + j * 31) % 50000 + 1 for j in range(tokens)]
    p = post(p_port, {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    params, want = p.get("kv_transfer_params"), p.get("kv_digest")
    if not params or not want:
        fail(f"P's answer lacks kv_transfer_params/kv_digest: {json.dumps(p)[:500]}")
    d = post(d_port, {"prompt": prompt, "max_tokens": 4, "kv_transfer_params": params})
    if d.get("kv_digest") != want:
        fail(f"request {i}: digest mismatch: P {want}, D {d.get('kv_digest')}")
    stats = d.get("kv_transfer_stats") or fail(f"D's answer lacks kv_transfer_stats: {json.dumps(d)[:500]}")
    total_bytes += int(stats["bytes"])
    read_ms += float(stats["read_time_ms"])
    backends.add(stats.get("backend"))
wall = time.time() - t0
if total_bytes == 0 or read_ms <= 0:
    fail(f"no bytes moved ({total_bytes} bytes in {read_ms} ms)")
key = f"e2e_{memory}_tcp"
print(f"{key}_requests={n}")
print(f"{key}_digests_match=1")
print(f"{key}_backend={','.join(sorted(map(str, backends)))}")
print(f"{key}_bytes={total_bytes}")
print(f"{key}_read_gbps={total_bytes / (read_ms / 1e3) / 1e9:.2f}")
print(f"{key}_wall_s={wall:.1f}")
EOF
  grep -Ei -e 'panicked' -e 'memory auto' -e 'falling back to host memory' \
    "$LOGS/p-$memory.log" "$LOGS/d-$memory.log" >&2 || true
  cleanup
}
[ "$HOST_ONLY" = 1 ] || e2e cuda 18100
e2e host 18200
# Host memory moved as if it were device memory: the staged paths (P's staged fill, the
# pipelined TCP stager on both sides, D's copy-back verify) with a host copier.
e2e staged 18300

kv total_s $(($(date +%s) - T0))
step "all GPU checks passed"
