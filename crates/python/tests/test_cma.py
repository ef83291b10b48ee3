"""Host memory registered from Python (a bytearray, an anonymous mmap, a numpy array) is
not a memfd: a reader on the same host reads it with cross-memory attach
(``process_vm_readv``), and the batch says so (``BatchResult.backend == "cma"``).

P is this test process; D is a child Python process (cross-memory attach reads another
process's memory; the kernel checks D's permission on each read).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import subprocess
import sys
import textwrap

import pytest

import kvlease

TOKEN = b"cma-test-token"
BLOCK = 64 * 1024
BLOCKS = 16
# Generous bound on any wait: the tests run on 2 shared cores.
PATIENCE = 60.0

# D: connects to P, reads every block of each region in one fenced batch, prints what the
# batch reported and the bytes (hex).
READER = textwrap.dedent(
    """
    import json, sys
    import kvlease
    spec = json.loads(sys.stdin.readline())
    agent = kvlease.Agent("cma-d#0", token=bytes.fromhex(spec["token"]))
    peer = agent.connect(bytes.fromhex(spec["meta"]))
    out = {"link": peer.backend, "reads": []}
    fence = (peer.region(spec["fence"]), 8, spec["generation"])
    for region, length in spec["regions"]:
        dst = bytearray(length)
        local = agent.register(dst)
        ops = [(local, 0, peer.region(region), 0, length)]
        result = agent.read(peer, ops, fence=fence)
        out["reads"].append(
            {"backend": result.backend, "bytes": result.bytes, "fence": result.fence_word,
             "data": bytes(dst).hex()})
    print(json.dumps(out), flush=True)
    agent.close()
    """
)


def read_from_child(p_agent: kvlease.Agent, regions: list[tuple[int, int]], fence: int,
                    generation: int) -> dict:
    spec = {
        "token": TOKEN.hex(),
        "meta": p_agent.metadata().hex(),
        "regions": regions,
        "fence": fence,
        "generation": generation,
    }
    done = subprocess.run(
        [sys.executable, "-c", READER],
        input=json.dumps(spec) + "\n",
        capture_output=True,
        text=True,
        timeout=PATIENCE,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_host_buffers_registered_from_python_are_read_through_cma():
    p_agent = kvlease.Agent("cma-p#0", token=TOKEN)
    kv = bytearray(os.urandom(BLOCK * BLOCKS))
    anon = mmap.mmap(-1, BLOCK * 4)
    anon.write(os.urandom(BLOCK * 4))
    buffers: list = [kv, anon]
    try:
        import numpy as np

        buffers.append(np.frombuffer(os.urandom(BLOCK * 2), dtype=np.uint8).copy())
    except ImportError:
        pass
    regions = [p_agent.register(b) for b in buffers]
    fence_map = mmap.mmap(-1, mmap.PAGESIZE)
    fence_map[8:16] = struct.pack("<Q", 7)
    fence_region = p_agent.register(fence_map)
    try:
        got = read_from_child(
            p_agent, [(r.id, len(memoryview(b).cast("B"))) for r, b in zip(regions, buffers)],
            fence_region.id, 7)
    finally:
        p_agent.close()
    assert got["link"] == "shm"
    for read, buf in zip(got["reads"], buffers):
        want = bytes(memoryview(buf).cast("B"))
        assert read["backend"] == "cma", read["backend"]
        assert read["bytes"] == len(want) and read["fence"] == 7
        assert bytes.fromhex(read["data"]) == want


def test_a_tcp_link_reports_tcp():
    p_agent = kvlease.Agent("tcp-p#0", token=TOKEN, backend="tcp")
    d_agent = kvlease.Agent("tcp-d#0", token=TOKEN, backend="tcp")
    try:
        src = bytearray(os.urandom(BLOCK))
        region = p_agent.register(src)
        dst = bytearray(BLOCK)
        local = d_agent.register(dst)
        peer = d_agent.connect(p_agent.metadata())
        result = d_agent.read(peer, [(local, 0, peer.region(region.id), 0, BLOCK)])
        assert (peer.backend, result.backend) == ("tcp", "tcp")
        assert dst == src
    finally:
        d_agent.close()
        p_agent.close()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
