#!/usr/bin/env bash
# Installs what building and testing kvlease needs on Debian bookworm (root, apt).
# Idempotent: installs only what is missing.
#   scripts/setup.sh          build deps (cmake + libclang for the verbs backend's bindings)
#   scripts/setup.sh rdma     + SoftRoCE harness deps (qemu, rdma-core, perftest, ...)
#   scripts/setup.sh bench    + benchmark peers (iperf3, ucx-utils, python3-venv; libibverbs1,
#                               libnuma1 and libcurl4, which the Mooncake wheel links)
#   scripts/setup.sh study    + the lease study's plot font (fonts-dejavu-core)
set -euo pipefail
pkgs="cmake libclang1-14 libclang-common-14-dev pkg-config"
for want in "$@"; do
  case "$want" in
    rdma) pkgs="$pkgs qemu-system-x86 kmod cpio iproute2 rdma-core ibverbs-utils ibverbs-providers libibverbs-dev perftest iperf3 busybox-static" ;;
    bench) pkgs="$pkgs iperf3 ucx-utils python3-venv python3-pip libibverbs1 libnuma1 libcurl4" ;;
    study) pkgs="$pkgs fonts-dejavu-core" ;;
    *) echo "setup.sh: unknown group '$want' (known: rdma, bench, study)" >&2; exit 2 ;;
  esac
done
missing=""
for p in $pkgs; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  if [ "$(id -u)" != 0 ]; then echo "setup.sh: need root to install:$missing" >&2; exit 1; fi
  echo "setup.sh: installing$missing" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends $missing >/tmp/kvlease-apt.log 2>&1 \
    || { tail -20 /tmp/kvlease-apt.log >&2; exit 1; }
fi
command -v cargo >/dev/null || { echo "setup.sh: cargo not found (Rust 1.95 stable is required)" >&2; exit 1; }
