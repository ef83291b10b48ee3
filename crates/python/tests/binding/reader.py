"""D for the binding tests: a separate process that tracks a lease with kvlease's decode
core, heartbeats it, and reads P's blocks with a fenced batch.

Reads one JSON object from stdin (P's agent metadata in hex, the lease's coordinates,
timing) and writes one JSON line per event to stdout: ``connected``, ``heartbeat`` (each
one sent), ``loaded`` (with the bytes read, hex) or ``failed``. With ``"read_after": null``
it only heartbeats, until it is killed.
"""

from __future__ import annotations

import json
import sys
import time

import kvlease


def emit(**event) -> None:
    print(json.dumps(event), flush=True)


def main() -> None:
    spec = json.loads(sys.stdin.readline())
    token = bytes.fromhex(spec["token"])
    agent = kvlease.Agent("engine-d#0", token=token, backend=spec.get("backend", "auto"))
    block = spec["block_bytes"]
    blocks = spec["blocks"]
    dst = bytearray(block * len(blocks))
    local = agent.register(dst)
    core = kvlease.DecodeCore(
        "engine-d",
        tp_size=1,
        num_kv_heads=1,
        block_size=spec["block_tokens"],
        num_blocks=len(blocks),
        lease_duration=spec["lease_duration"],
        external_blocks=True,
    )
    remote = kvlease.RemoteKv(
        engine="engine-p",
        request=spec["request"],
        blocks=blocks,
        generation=spec["generation"],
        tp_size=1,
        num_tokens=spec["block_tokens"] * len(blocks),
        host="127.0.0.1",
        port=1,
    )
    start = time.monotonic()
    core.on_new_request(start, "d-" + spec["request"], remote.num_tokens, remote)
    hs = core.poll_handshake()
    peer = agent.connect(bytes.fromhex(spec["p_metadata"]))
    core.handle_handshake(time.monotonic(), hs.engine, tp_size=1, num_blocks=spec["p_num_blocks"])
    emit(event="connected", backend=peer.backend)
    read_after = spec.get("read_after")
    while True:
        now = time.monotonic()
        while (t := core.poll_transmit(now)) is not None:
            agent.send_notif(peer, t.message)
            emit(event=t.kind, at=now - start)
        if read_after is not None and now - start >= read_after:
            break
        time.sleep(0.02)
    plan = core.start_load("d-" + spec["request"], list(range(len(blocks))))
    ops = [
        (local, i * block, peer.region(spec["kv_region"]), b * block, block)
        for i, b in enumerate(blocks)
    ]
    batch = plan.batches[0]
    fence = (peer.region(spec["fence_region"]), blocks[-1] * 8, plan.fence_generation)
    result = agent.wait([agent.post_read(peer, ops, notif=batch.notif, fence=fence)])[0]
    core.handle_batch_done(plan.request, 0, result.status, bytes=result.bytes)
    events = []
    while (e := core.poll_event()) is not None:
        events.append(type(e).__name__)
    if result.ok:
        emit(event="loaded", data=bytes(dst).hex(), core_events=events)
    else:
        emit(event="failed", status=result.status, error=str(result.error), core_events=events)
    agent.close()


if __name__ == "__main__":
    main()
