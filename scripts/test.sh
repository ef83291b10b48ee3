#!/usr/bin/env bash
# The project's test command: installs what it needs, then runs every check CI runs.
#   scripts/test.sh            everything (lint, unit/property/simulation/system tests, docs, hosts in network namespaces, SoftRoCE VMs: rxe tests, agents over verbs in one VM and across two)
#   KVLEASE_SKIP_RDMA=1 scripts/test.sh   everything but the SoftRoCE VM tests
#   KVLEASE_SKIP_NETNS=1 scripts/test.sh  everything but the network-namespace hosts (scripts/netns/hosts.sh)
#   KVLEASE_SKIP_PYTHON=1 scripts/test.sh everything but the Python package and vLLM connector tests (scripts/python-test.sh)
#   KVLEASE_SKIP_SERVE=1 scripts/test.sh  everything but real vLLM serving through the connector (scripts/serve-test.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
step() { echo; echo "=== [$(( $(date +%s) - T0 ))s] $*"; }

step "setup"
if [ "${KVLEASE_SKIP_RDMA:-0}" = 1 ]; then bash scripts/setup.sh; else bash scripts/setup.sh rdma; fi

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy (all targets, -D warnings)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "feature sets"
cargo check --locked -p kvlease-transport --no-default-features
cargo check --locked -p kvlease-gpu-mem --no-default-features
cargo check --locked -p kvlease-agent --no-default-features

step "cargo test (KVLEASE_SIM_SEEDS=${KVLEASE_SIM_SEEDS:=256})"
export KVLEASE_SIM_SEEDS
cargo test --workspace --locked

step "system tests again over shared memory (P and D on one host)"
KVLEASE_TEST_TRANSPORT=shm cargo test --locked -p kvlease-agent --test system

step "cargo doc (-D warnings)"
RUSTDOCFLAGS=-Dwarnings cargo doc --workspace --no-deps --document-private-items --locked -q

if [ "${KVLEASE_SKIP_PYTHON:-0}" != 1 ]; then
  step "Python: the kvlease package and its vLLM connector (vLLM's scheduler on CPU, P and D worker processes)"
  bash scripts/python-test.sh
fi

if [ "${KVLEASE_SKIP_SERVE:-0}" != 1 ]; then
  step "real vLLM serving through the connector (vllm serve on CPU, a tiny model made here, P/D vs a plain instance)"
  bash scripts/serve-test.sh
fi

if [ "${KVLEASE_SKIP_NETNS:-0}" != 1 ]; then
  step "P, D and the proxy on separate hosts (network namespaces), with faults"
  bash scripts/netns/hosts.sh
fi

if [ "${KVLEASE_SKIP_RDMA:-0}" != 1 ]; then
  step "SoftRoCE tests in a qemu VM"
  bash scripts/softroce/test.sh
  step "agents over SoftRoCE (verbs) in a qemu VM"
  bash scripts/softroce/agents.sh
  step "agents over SoftRoCE (verbs) across two qemu VMs"
  bash scripts/softroce/agents-2vm.sh
fi
step "all checks passed"
