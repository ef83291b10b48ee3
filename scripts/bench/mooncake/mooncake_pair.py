#!/usr/bin/env python3
"""Mooncake Transfer Engine peer for scripts/bench/transport.sh: two processes on loopback.

  mooncake_pair.py [--seconds S]

The initiator starts this file again as the target (`--serve`), which registers a 64 MiB
host buffer filled with a pattern and prints `READY <rpc port> <buffer address>`. Both
engines use the TCP protocol with `P2PHANDSHAKE` metadata (no metadata server: each
engine listens on an RPC port it picks and peers are named `host:rpc_port`). The
initiator measures batch_transfer_sync_read of 64 x 64 KiB and 64 x 1 MiB, checking the
bytes of one batch before and one after the timed loop, and prints
mooncake_read_{64k,1m}_x64_gbps= (10^9 bytes/s). The target exits when its stdin closes.
"""
import argparse
import os
import subprocess
import sys
import time

import numpy as np
from mooncake.engine import TransferEngine

NDESC = 64
SIZES = {"64k": 64 << 10, "1m": 1 << 20}
TOTAL = NDESC * max(SIZES.values())
HOST = "127.0.0.1"


def pattern(n, salt):
    return ((np.arange(n, dtype=np.uint64) * 2654435761 + salt) >> 7).astype(np.uint8)


def engine():
    e = TransferEngine()
    rc = e.initialize(HOST, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize returned {rc}")
    return e


def register(e, buf):
    rc = e.register_memory(buf.ctypes.data, buf.nbytes)
    if rc != 0:
        raise RuntimeError(f"register_memory returned {rc}")


def serve():
    e = engine()
    buf = pattern(TOTAL, 1)
    register(e, buf)
    print(f"READY {e.get_rpc_port()} {buf.ctypes.data}", flush=True)
    sys.stdin.read()  # until the initiator closes our stdin (or dies)
    return 0


def initiator(a):
    child = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--serve"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline().split()
        if len(line) != 3 or line[0] != "READY":
            raise RuntimeError(f"target did not start (said {line!r})")
        peer = f"{HOST}:{line[1]}"
        remote = int(line[2])
        e = engine()
        buf = np.zeros(TOTAL, dtype=np.uint8)
        register(e, buf)
        expect = pattern(TOTAL, 1)
        for k, block in SIZES.items():
            n = NDESC * block
            local = [buf.ctypes.data + i * block for i in range(NDESC)]
            peer_addrs = [remote + i * block for i in range(NDESC)]
            lengths = [block] * NDESC

            def one():
                rc = e.batch_transfer_sync_read(peer, local, peer_addrs, lengths)
                if rc != 0:
                    raise RuntimeError(f"batch_transfer_sync_read returned {rc}")

            def checked():
                buf[:n] = 0
                one()
                if not np.array_equal(buf[:n], expect[:n]):
                    raise RuntimeError(f"READ {k} data mismatch")

            checked()
            t0 = time.perf_counter()
            iters = 0
            while time.perf_counter() - t0 < a.seconds or iters < 3:
                one()
                iters += 1
            gbps = n * iters / (time.perf_counter() - t0) / 1e9
            checked()
            print(f"mooncake_read_{k}_x{NDESC}_gbps={gbps:.3f}", flush=True)
        return 0
    finally:
        child.stdin.close()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--serve", action="store_true")
    p.add_argument("--seconds", type=float, default=1.0)
    a = p.parse_args()
    return serve() if a.serve else initiator(a)


if __name__ == "__main__":
    try:
        rc = main()
    except Exception as e:
        print(f"mooncake_pair: {e}", file=sys.stderr)
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the engine's teardown at interpreter exit (its threads may still hold sockets);
    # the exit status is what the caller reads.
    os._exit(rc)
