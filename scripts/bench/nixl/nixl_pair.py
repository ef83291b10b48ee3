#!/usr/bin/env python3
"""NIXL peer for scripts/bench/transport.sh: two processes on loopback, host memory.

  target:    nixl_pair.py --mode target    --port P
  initiator: nixl_pair.py --mode initiator --port P

The initiator measures READ and WRITE of 64 x 64 KiB and 64 x 1 MiB (each verified) and a
send_notif/get_new_notifs ping-pong, and prints one key=value line per figure:
<prefix>_{read,write}_{64k,1m}_x64_gbps (10^9 bytes/s) and <prefix>_notif_rtt_us (median),
with --prefix (default nixl). UCX picks the transports: run with UCX_TLS=tcp
UCX_NET_DEVICES=lo for TCP, or with UCX_TLS unset for UCX's defaults (on one host, READ
goes through cma, i.e. process_vm_readv, and notifications over tcp/lo; UCX_PROTO_INFO=y
prints the choice). No progress thread (fastest on 2 cores).

With --pair (scripts/bench/pair.sh): READ only, of the pair workloads of
scripts/bench/pair/pairlib.py (64 x 64 KiB, 64 x 1 MiB, 256 x 4 MiB, each verified), from
--memory host (numpy or torch, --alloc) or cuda (torch) buffers (DRAM / VRAM descriptors);
keys <prefix>_read_{64k_x64,1m_x64,4m_x256}_gbps. The nixl package is imported as `nixl`,
else as the wheel's own name (`nixl_cu13`, `nixl_cu12`: an unpacked wheel on PYTHONPATH).
"""
import argparse
import os
import sys
import time

import numpy as np


def _nixl_api():
    for mod in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            api = __import__(mod, fromlist=["nixl_agent", "nixl_agent_config"])
        except ImportError:
            continue
        return api.nixl_agent, api.nixl_agent_config
    raise ImportError("no nixl package (nixl, nixl_cu13, nixl_cu12) imports")


nixl_agent, nixl_agent_config = _nixl_api()

NDESC = 64
SIZES = {"64k": 64 << 10, "1m": 1 << 20}
TOTAL = NDESC * max(SIZES.values())


def pattern(n, salt):
    return ((np.arange(n, dtype=np.uint64) * 2654435761 + salt) >> 7).astype(np.uint8)


_backlog = []


def notifs(agent, peer):
    """Every message from `peer` received so far and not yet consumed, oldest first."""
    _backlog.extend(agent.get_new_notifs().get(peer, []))
    out = list(_backlog)
    _backlog.clear()
    return out


def wait_for(agent, peer, pred, timeout=60.0):
    """Consumes the first message matching `pred`; keeps the others for later calls."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        msgs = notifs(agent, peer)
        for i, m in enumerate(msgs):
            if pred(m):
                _backlog.extend(msgs[i + 1:])
                return m
            _backlog.append(m)
        _backlog[:] = _backlog[-1000:]
    raise TimeoutError("no notification from " + peer)


def descs(agent, base):
    return {k: agent.get_xfer_descs([(base + i * b, b, 0) for i in range(NDESC)], "DRAM")
            for k, b in SIZES.items()}


def publish_descs(agent, d):
    """Target: once the initiator's metadata arrived, sends it each of `d`'s descriptor
    lists, as a notification `D<name>:<serialized>`."""
    while not agent.check_remote_metadata("initiator"):
        time.sleep(0.001)
    for k in d:
        agent.send_notif("initiator", b"D" + k.encode() + b":" + agent.get_serialized_descs(d[k]))


def fetch_remote_descs(agent, port, count):
    """Initiator: sends its metadata to the target on `port`, receives the target's
    `count` descriptor lists (by name) and waits for the target's metadata."""
    agent.send_local_metadata("127.0.0.1", port)
    remote = {}
    while len(remote) < count:
        m = wait_for(agent, "target", lambda m: m.startswith(b"D"))
        k, _, ser = m[1:].partition(b":")
        remote[k.decode()] = agent.deserialize_descs(ser)
    agent.fetch_remote_metadata("target", "127.0.0.1", port)
    while not agent.check_remote_metadata("target"):
        time.sleep(0.001)
    return remote


def transfer(agent, h, op):
    """Posts the prepared transfer `h` and polls it until it is done."""
    st = agent.transfer(h)
    while st != "DONE":
        if st == "ERR":
            raise RuntimeError(op + " failed")
        st = agent.check_xfer_state(h)


def say_bye(agent, reg):
    """Initiator: tells the target it is done, then lets go of its memory."""
    agent.send_notif("target", b"BYE")
    time.sleep(0.2)
    agent.deregister_memory(reg)


def target(a):
    agent = nixl_agent("target", nixl_agent_config(False, True, a.port))
    buf = pattern(TOTAL, 1)
    reg = agent.register_memory([(buf.ctypes.data, TOTAL, 0, "")], "DRAM")
    publish_descs(agent, descs(agent, buf.ctypes.data))
    while True:
        for m in notifs(agent, "initiator"):
            if m.startswith(b"PING"):
                agent.send_notif("initiator", b"PONG" + m[4:])
            elif m == b"BYE":
                agent.deregister_memory(reg)
                return 0


def initiator(a):
    agent = nixl_agent("initiator", nixl_agent_config(False, True, 0))
    buf = np.zeros(TOTAL, dtype=np.uint8)
    reg = agent.register_memory([(buf.ctypes.data, TOTAL, 0, "")], "DRAM")
    local = descs(agent, buf.ctypes.data)
    remote = fetch_remote_descs(agent, a.port, len(SIZES))
    expect = pattern(TOTAL, 1)
    for op in ("READ", "WRITE"):
        for k, block in SIZES.items():
            n = NDESC * block
            if op == "WRITE":
                buf[:n] = expect[:n]
            else:
                buf[:n] = 0
            h = agent.initialize_xfer(op, local[k], remote[k], "target", b"")

            def one():
                transfer(agent, h, op)

            one()
            if op == "READ" and not np.array_equal(buf[:n], expect[:n]):
                raise RuntimeError("READ data mismatch")
            t0 = time.perf_counter()
            iters = 0
            while time.perf_counter() - t0 < a.seconds or iters < 3:
                one()
                iters += 1
            gbps = n * iters / (time.perf_counter() - t0) / 1e9
            print(f"{a.prefix}_{op.lower()}_{k}_x{NDESC}_gbps={gbps:.3f}", flush=True)
            agent.release_xfer_handle(h)
    lat = []
    for i in range(a.notif_iters + 100):
        tag = str(i).encode()
        t0 = time.perf_counter()
        agent.send_notif("target", b"PING" + tag)
        wait_for(agent, "target", lambda m: m == b"PONG" + tag)
        if i >= 100:
            lat.append(time.perf_counter() - t0)
    print(f"{a.prefix}_notif_rtt_us={np.median(lat) * 1e6:.1f}", flush=True)
    say_bye(agent, reg)
    return 0


# --------------------------------------------------------------------------- --pair
def _pairlib():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pair"))
    import pairlib

    return pairlib


def pair_descs(agent, pairlib, base, mem):
    return {name: agent.get_xfer_descs([(base + i * sz, sz, 0) for i in range(nd)], mem)
            for nd, sz, name in pairlib.workloads()}


def pair_target(a):
    pairlib = _pairlib()
    bufs = pairlib.Buffers(a.memory, a.alloc)
    mem = "VRAM" if a.memory == "cuda" else "DRAM"
    n = pairlib.total_bytes()
    src = bufs.pattern(n)
    bufs.sync()
    agent = nixl_agent("target", nixl_agent_config(False, True, a.port))
    reg = agent.register_memory([(bufs.ptr(src), n, 0, "")], mem)
    publish_descs(agent, pair_descs(agent, pairlib, bufs.ptr(src), mem))
    # Idle, not spinning, until the initiator is done: a READ needs nothing of the target
    # (UCX's cma and cuda_ipc are one-sided), and a spinning target would take a core from
    # the initiator on a small host (kvlease's P sleeps meanwhile too).
    t0 = time.monotonic()
    while b"BYE" not in notifs(agent, "initiator"):
        if time.monotonic() - t0 > 600:
            raise TimeoutError("no BYE from the initiator")
        time.sleep(0.01)
    agent.deregister_memory(reg)
    return 0


def pair_initiator(a):
    pairlib = _pairlib()
    bufs = pairlib.Buffers(a.memory, a.alloc)
    mem = "VRAM" if a.memory == "cuda" else "DRAM"
    n = pairlib.total_bytes()
    expect = bufs.pattern(n)
    buf = bufs.zeros(n)
    agent = nixl_agent("initiator", nixl_agent_config(False, True, 0))
    reg = agent.register_memory([(bufs.ptr(buf), n, 0, "")], mem)
    local = pair_descs(agent, pairlib, bufs.ptr(buf), mem)
    remote = fetch_remote_descs(agent, a.port, len(local))
    for nd, sz, name in pairlib.workloads():
        h = agent.initialize_xfer("READ", local[name], remote[name], "target", b"")

        def one():
            transfer(agent, h, "READ")

        bufs.zero(buf, nd * sz)
        one()
        bufs.sync()
        if not bufs.equal(buf, expect, nd * sz):
            raise RuntimeError(f"{name}: READ data mismatch")
        per_call = pairlib.timed(one, a.seconds, bufs.sync)
        print(f"{a.prefix}_read_{name}_gbps={pairlib.gbps(nd * sz, per_call)}", flush=True)
        agent.release_xfer_handle(h)
    print(f"{a.prefix}_verified=1", flush=True)
    say_bye(agent, reg)
    return 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["target", "initiator"], required=True)
    p.add_argument("--port", type=int, default=5555)
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--notif-iters", type=int, default=1000)
    p.add_argument("--prefix", default="nixl", help="key prefix of the printed figures")
    p.add_argument("--pair", action="store_true", help="the pair workloads (READ only)")
    p.add_argument("--memory", choices=["host", "cuda"], default="host", help="with --pair")
    p.add_argument("--alloc", choices=["numpy", "torch"], default="numpy", help="with --pair")
    a = p.parse_args()
    if a.pair:
        return pair_target(a) if a.mode == "target" else pair_initiator(a)
    return target(a) if a.mode == "target" else initiator(a)


if __name__ == "__main__":
    try:
        rc = main()
    except Exception as e:  # report, then skip the wheel's crashing teardown
        print(f"nixl_pair: {e}", file=sys.stderr)
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # The nixl 1.5.1 wheel segfaults at interpreter exit; skip teardown so rc means something.
    os._exit(rc)
