#!/usr/bin/env python3
"""kvlease's Python binding, two processes on one host (scripts/bench/pair.sh runs it).

  kvlease_pair.py read --memory host|cuda --alloc numpy|torch --backend auto|tcp
      D (this process) starts P (a child: kvlease_pair.py target ...), connects to it and
      READs the pair workloads (scripts/bench/pair/pairlib.py) from P's buffer into its own:
      each verified byte for byte, then timed.
  kvlease_pair.py copy --memory host|cuda --alloc ...
      the same chunks copied inside one process (the reference a same-host READ is held to).

Prints key=value lines, <prefix> from --prefix (default kvlease_<backend>):
  <prefix>_link=            the backend the connection chose (tcp, shm, verbs)
  <prefix>_backend_<w>=     the backend the workload's batch result reported (tcp, shm, cma)
  <prefix>_read_<w>_gbps=   10^9 B/s, w in 64k_x64, 1m_x64, 4m_x256
  <prefix>_verified=1       every workload's bytes were equal
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pairlib  # noqa: E402

TOKEN = b"kvlease-pair-bench"


def target(a, bufs):
    import kvlease

    n = pairlib.total_bytes(a.scale)
    src = bufs.pattern(n)
    bufs.sync()
    agent = kvlease.Agent("pair-p#0", token=TOKEN, backend=a.backend)
    region = agent.register(src)
    print(json.dumps({"meta": agent.metadata().hex(), "region": region.id, "kind": region.kind}),
          flush=True)
    sys.stdin.readline()  # until D is done
    agent.close()


def read(a, bufs):
    import kvlease

    child = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "target", "--memory", a.memory, "--alloc",
         bufs.alloc, "--backend", a.backend, "--scale", str(a.scale)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        if not line:
            raise RuntimeError("P exited before it printed its metadata")
        info = json.loads(line)
        n = pairlib.total_bytes(a.scale)
        expect = bufs.pattern(n)
        dst = bufs.zeros(n)
        agent = kvlease.Agent("pair-d#0", token=TOKEN, backend=a.backend)
        local = agent.register(dst)
        peer = agent.connect(bytes.fromhex(info["meta"]))
        remote = peer.region(info["region"])
        p = a.prefix
        print(f"{p}_link={peer.backend}", flush=True)
        print(f"{p}_kinds={info['kind']},{local.kind}", flush=True)
        if peer.backend_reason:
            print(f"# {p}: link reason: {peer.backend_reason}", file=sys.stderr, flush=True)
        for nd, sz, name in pairlib.workloads(a.scale):
            ops = [(local, i * sz, remote, i * sz, sz) for i in range(nd)]
            bufs.zero(dst, nd * sz)
            result = agent.read(peer, ops)
            bufs.sync()
            if not bufs.equal(dst, expect, nd * sz):
                raise RuntimeError(f"{name}: READ data mismatch")
            print(f"{p}_backend_{name}={result.backend}", flush=True)
            per_call = pairlib.timed(lambda: agent.read(peer, ops), a.seconds, bufs.sync)
            print(f"{p}_read_{name}_gbps={pairlib.gbps(nd * sz, per_call)}", flush=True)
        print(f"{p}_verified=1", flush=True)
        agent.close()
    finally:
        try:
            child.stdin.write("done\n")
            child.stdin.flush()
        except OSError:
            pass
        child.wait(timeout=60)


def copy(a, bufs):
    n = pairlib.total_bytes(a.scale)
    src = bufs.pattern(n)
    dst = bufs.zeros(n)
    for nd, sz, name in pairlib.workloads(a.scale):
        def one():
            for i in range(nd):
                bufs.copy(dst, src, i * sz, (i + 1) * sz)

        bufs.zero(dst, nd * sz)
        one()
        bufs.sync()
        if not bufs.equal(dst, src, nd * sz):
            raise RuntimeError(f"{name}: copy mismatch")
        per_call = pairlib.timed(one, a.seconds, bufs.sync)
        print(f"{a.prefix}_read_{name}_gbps={pairlib.gbps(nd * sz, per_call)}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["read", "target", "copy"])
    p.add_argument("--memory", choices=["host", "cuda"], default="host")
    p.add_argument("--alloc", choices=["numpy", "torch"], default="numpy")
    p.add_argument("--backend", default="auto")
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--scale", type=int, default=1, help="divides every block size")
    p.add_argument("--prefix", default=None)
    a = p.parse_args()
    a.prefix = a.prefix or (f"kvlease_{a.backend}" if a.mode != "copy" else "copy")
    bufs = pairlib.Buffers(a.memory, a.alloc)
    {"read": read, "target": target, "copy": copy}[a.mode](a, bufs)


if __name__ == "__main__":
    try:
        main()
        rc = 0
    except Exception as e:  # report on stderr; the key lines say what was measured
        print(f"kvlease_pair: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        rc = 1
    sys.stdout.flush()
    sys.exit(rc)
