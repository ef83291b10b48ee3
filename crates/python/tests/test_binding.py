"""The kvlease binding: real buffers moved between two Python processes under leases,
heartbeats and fences; a killed reader whose lease P reclaims; typed exceptions for bad
arguments.

P is this test process (a transport agent serving a KV buffer and fence words, and the
prefill core); D is ``binding/reader.py`` in a child process (its own agent and decode
core). Timing only bounds how long a test may wait, never what it asserts: each lease
outlives every pause its assertions depend on by seconds.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvlease
from kvlease import errors

READER = Path(__file__).parent / "binding" / "reader.py"
TOKEN = b"binding-test-token"
BLOCK_TOKENS = 16
BLOCK_BYTES = 4096
NUM_BLOCKS = 8
# Generous bound on any wait: the tests run on 2 shared cores.
PATIENCE = 60.0


class P:
    """A prefill engine in this process: KV blocks and fence words registered with an
    agent, the prefill core deciding the leases."""

    def __init__(self, lease_duration: float):
        self.agent = kvlease.Agent("engine-p#0", token=TOKEN)
        self.kv = bytearray(os.urandom(BLOCK_BYTES * NUM_BLOCKS))
        self.kv_region = self.agent.register(self.kv)
        self.fence_map = mmap.mmap(-1, mmap.PAGESIZE)
        self.fence_region = self.agent.register(self.fence_map)
        self.fences = kvlease.FenceWords(self.fence_map, NUM_BLOCKS)
        self.core = kvlease.PrefillCore(
            "engine-p",
            tp_size=1,
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK_TOKENS,
            lease_duration=lease_duration,
            external_blocks=True,
        )
        self.released: list[kvlease.Released] = []
        self.notifs: list[dict] = []

    def grant(self, request: str, blocks: list[int]) -> kvlease.Granted:
        granted = self.core.handle_prefill_done_in(time.monotonic(), request, blocks)
        self.fences.publish(blocks, granted.generation)
        return granted

    def step(self) -> None:
        """One forward-loop step: notifications, the reaper, then every action."""
        now = time.monotonic()
        for sender, messages in self.agent.get_new_notifs().items():
            for m in messages:
                self.notifs.append(self.core.handle_notif(now, sender.partition("#")[0], sender, m))
        self.core.handle_timeout(now)
        while (action := self.core.poll_action()) is not None:
            if isinstance(action, kvlease.ClearFences):
                self.fences.publish(action.released.blocks, 0)
                self.released.append(action.released)
        while self.core.poll_event() is not None:
            pass

    def block_bytes(self, blocks: list[int]) -> bytes:
        return b"".join(bytes(self.kv[b * BLOCK_BYTES : (b + 1) * BLOCK_BYTES]) for b in blocks)

    def close(self) -> None:
        self.agent.close()


def spawn_reader(p: P, request: str, granted: kvlease.Granted, **extra) -> subprocess.Popen:
    spec = {
        "token": TOKEN.hex(),
        "p_metadata": p.agent.metadata().hex(),
        "p_num_blocks": NUM_BLOCKS,
        "kv_region": p.kv_region.id,
        "fence_region": p.fence_region.id,
        "request": request,
        "blocks": granted.blocks,
        "generation": granted.generation,
        "block_tokens": BLOCK_TOKENS,
        "block_bytes": BLOCK_BYTES,
        "lease_duration": p.core.lease_duration,
        **extra,
    }
    child = subprocess.Popen(
        [sys.executable, str(READER)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None
    child.stdin.write(json.dumps(spec) + "\n")
    child.stdin.flush()
    return child


def next_event(child: subprocess.Popen, p: P) -> dict:
    """The reader's next event, stepping P meanwhile (it serves and hears the reader)."""
    import selectors

    assert child.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(child.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + PATIENCE
    while time.monotonic() < deadline:
        p.step()
        if sel.select(timeout=0.02):
            line = child.stdout.readline()
            assert line, f"the reader exited ({child.wait()}) without a word"
            return json.loads(line)
    raise AssertionError("the reader said nothing in time")


def test_a_reader_in_another_process_heartbeats_past_the_lease_then_reads_under_its_fence():
    p = P(lease_duration=3.0)
    try:
        blocks = [6, 2, 5]
        granted = p.grant("req-1", blocks)
        assert p.fences.word(6) == granted.generation
        # The reader heartbeats for 5 s, well past the 3 s the lease was granted for,
        # then reads: only the heartbeats can have kept the lease alive that long.
        child = spawn_reader(p, "req-1", granted, read_after=5.0)
        assert next_event(child, p)["event"] == "connected"
        heartbeats = 0
        while (event := next_event(child, p))["event"] == "heartbeat":
            heartbeats += 1
        assert event["event"] == "loaded", event
        assert bytes.fromhex(event["data"]) == p.block_bytes(blocks)
        assert event["core_events"][-1] == "Loaded"
        assert child.wait(timeout=PATIENCE) == 0
        assert heartbeats >= 2
        renewed = [n for n in p.notifs if n.kind == "heartbeat"]
        assert renewed and all(n.held == 1 for n in renewed)
        # The read completion releases the lease: completed, not expired.
        deadline = time.monotonic() + PATIENCE
        while not p.released and time.monotonic() < deadline:
            p.step()
        assert [(r.request, r.reason) for r in p.released] == [("req-1", "completed")]
        assert p.released[0].last_heartbeat is not None
        assert all(p.fences.word(b) == 0 for b in blocks)
        assert p.core.is_idle()
        assert p.core.stats()["released_completed"] == 1
    finally:
        p.close()


def test_a_killed_reader_lets_p_reclaim_and_a_late_read_sees_a_stale_fence():
    p = P(lease_duration=1.0)
    try:
        blocks = [1, 3]
        granted = p.grant("req-2", blocks)
        child = spawn_reader(p, "req-2", granted, read_after=None)
        assert next_event(child, p)["event"] == "connected"
        assert next_event(child, p)["event"] == "heartbeat"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=PATIENCE)
        # Without heartbeats the reaper ends the lease; P clears the fences and may reuse
        # the blocks.
        deadline = time.monotonic() + PATIENCE
        while not p.released and time.monotonic() < deadline:
            p.step()
            time.sleep(0.02)
        assert [(r.request, r.reason) for r in p.released] == [("req-2", "expired")]
        assert p.core.is_idle()
        for b in blocks:
            p.kv[b * BLOCK_BYTES : (b + 1) * BLOCK_BYTES] = b"\xee" * BLOCK_BYTES
        # A reader that still holds the old generation gets no bytes it may use.
        with kvlease.Agent("engine-late#0", token=TOKEN) as late:
            dst = bytearray(BLOCK_BYTES * len(blocks))
            local = late.register(dst)
            peer = late.connect(p.agent.metadata())
            ops = [
                (local, i * BLOCK_BYTES, peer.region(p.kv_region.id), b * BLOCK_BYTES, BLOCK_BYTES)
                for i, b in enumerate(blocks)
            ]
            fence = (peer.region(p.fence_region.id), blocks[-1] * 8, granted.generation)
            with pytest.raises(kvlease.StaleFenceError) as stale:
                late.read(peer, ops, fence=fence)
            assert stale.value.expected == granted.generation
            assert stale.value.found == 0
            assert isinstance(stale.value, kvlease.TransferError)
            # A heartbeat for the reclaimed lease changes nothing.
            hb = kvlease.encode_heartbeats(["req-2"])[0]
            out = p.core.handle_notif(time.monotonic(), "engine-late", "engine-late#0", hb)
            assert out.held == 0
    finally:
        p.close()


def test_numpy_arrays_and_torch_tensors_are_registered_by_their_bytes():
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    with kvlease.Agent("src#0") as src, kvlease.Agent("dst#0") as dst:
        array = np.arange(1024, dtype=np.uint16)
        r_array = src.register(array)
        assert r_array.length == array.nbytes
        tensor = torch.zeros(512, dtype=torch.float32)
        r_tensor = dst.register(tensor)
        assert r_tensor.length == 2048 and r_tensor.kind == "host"
        peer = dst.connect(src.metadata())
        dst.read(peer, [(r_tensor, 0, peer.region(r_array.id), 0, 2048)])
        assert bytes(tensor.numpy().tobytes()) == array.tobytes()
        with pytest.raises(kvlease.InvalidArgument):
            dst.register(torch.zeros(4, 4).t())  # not contiguous


def test_bad_arguments_raise_typed_exceptions():
    with pytest.raises(kvlease.ConfigError):
        kvlease.Agent("")
    with pytest.raises(kvlease.InvalidArgument) as bad_listen:
        kvlease.Agent("a", listen="not an address")
    assert isinstance(bad_listen.value, ValueError)
    with pytest.raises(kvlease.InvalidArgument):
        kvlease.Agent("a", backend="carrier-pigeon")
    with pytest.raises(kvlease.InvalidArgument):
        kvlease.Agent("a", token=b"")

    with kvlease.Agent("p#0", token=TOKEN) as a, kvlease.Agent("d#0", token=TOKEN) as b:
        with pytest.raises(kvlease.InvalidArgument):
            a.register(b"read-only bytes")
        with pytest.raises(kvlease.InvalidArgument):
            a.register(bytearray())
        with pytest.raises(TypeError):
            a.register(object())
        with pytest.raises(kvlease.InvalidArgument):
            a.register_memory(0, 64)
        src = a.register(bytearray(64))
        dst = b.register(bytearray(64))
        with pytest.raises(kvlease.ConnectError):
            b.connect(b"not metadata")
        with kvlease.Agent("x#0", token=b"another token") as stranger:
            with pytest.raises(kvlease.AuthError):
                stranger.connect(a.metadata())
        peer = b.connect(a.metadata())
        with pytest.raises(kvlease.InvalidArgument):
            peer.region(10_000)
        remote = peer.region(src.id)
        # A timeout past what the clock can hold waits without a deadline (no panic).
        (waited,) = b.wait([b.post_read(peer, [(dst, 0, remote, 0, 8)])], timeout=1e19)
        assert waited is not None
        with pytest.raises(kvlease.TransferError):
            b.read(peer, [(dst, 0, remote, 32, 64)])  # past the end of P's region
        with pytest.raises(kvlease.TransferError):
            b.read(peer, [(dst, 60, remote, 0, 8)])  # past the end of ours
        with pytest.raises(kvlease.TransferError):
            b.read(peer, [])
        with pytest.raises(kvlease.InvalidArgument):
            b.read(peer, [(dst, 0, remote, 0, 8)], timeout=-1.0)
        with pytest.raises(kvlease.NotifError):
            b.send_notif(peer, b"x" * (1 << 20))
        with pytest.raises(kvlease.InvalidArgument):
            kvlease.FenceWords(bytearray(16), 4)  # 4 words need 32 bytes
    with pytest.raises(kvlease.ClosedError):
        a.metadata()

    with pytest.raises(kvlease.InvalidArgument):
        kvlease.PrefillCore("a,b", tp_size=1, num_blocks=4, block_size=16)
    with pytest.raises(kvlease.ConfigError):
        kvlease.PrefillCore("p", tp_size=1, num_blocks=4, block_size=16, lease_duration=-1)
    pool = kvlease.PrefillCore("p", tp_size=1, num_blocks=4, block_size=16)
    with pytest.raises(kvlease.PrefillError) as wrong_source:
        pool.handle_prefill_done_in(0.0, "r", [0])
    assert wrong_source.value.retryable is False
    with pytest.raises(kvlease.InvalidArgument):
        pool.handle_job(-1.0, "r", 16)
    external = kvlease.PrefillCore("p", tp_size=1, num_blocks=4, block_size=16, external_blocks=True)
    with pytest.raises(kvlease.PrefillError):
        external.handle_prefill_done_in(0.0, "r", [4])  # outside the pool

    d = kvlease.DecodeCore(
        "d", tp_size=1, num_kv_heads=2, block_size=16, num_blocks=8, external_blocks=True
    )
    wrong_count = kvlease.RemoteKv(
        engine="p", request="r", blocks=[0], generation=1, tp_size=1, num_tokens=40,
        host="127.0.0.1", port=1,
    )
    with pytest.raises(kvlease.AdmitError) as admit:
        d.on_new_request(0.0, "d-r", 40, wrong_count)
    assert admit.value.field == "remote_block_ids"
    ok = kvlease.RemoteKv(
        engine="p", request="r", blocks=[0, 1, 2], generation=1, tp_size=1, num_tokens=40,
        host="127.0.0.1", port=1,
    )
    d.on_new_request(0.0, "d-r", 40, ok)
    with pytest.raises(kvlease.InvalidArgument):
        d.start_load("d-r", [0, 1, 2])  # P is not handshaken yet
    with pytest.raises(kvlease.InvalidArgument):
        d.handle_batch_done("d-r", 0, "maybe")
    with pytest.raises(kvlease.InvalidArgument):
        kvlease.DecodeCore("d", tp_size=3, num_kv_heads=4, block_size=16, num_blocks=8)

    with pytest.raises(kvlease.NotifError):
        kvlease.decode_notif(b"KVL1:RC:\xff")
    server = kvlease.SideChannelServer(b"info", token=TOKEN, listen="127.0.0.1:0")
    try:
        assert kvlease.side_channel_fetch("127.0.0.1", server.port, token=TOKEN) == b"info"
        with pytest.raises(kvlease.AuthError):
            kvlease.side_channel_fetch("127.0.0.1", server.port, token=b"wrong")
        with pytest.raises(kvlease.AuthError):
            kvlease.side_channel_fetch("127.0.0.1", server.port)
        with pytest.raises(kvlease.SideChannelError):
            kvlease.side_channel_fetch("no-such-host.invalid", server.port, token=TOKEN)
        assert server.stats()["served"] == 1
    finally:
        server.close()
    for cls in (
        kvlease.InvalidArgument,
        kvlease.AuthError,
        kvlease.StaleFenceError,
        kvlease.TransferTimeout,
        kvlease.AdmitError,
    ):
        assert issubclass(cls, errors.KvleaseError)


def test_a_side_channel_handshake_ends_by_its_deadline_while_a_peer_trickles_bytes():
    server = kvlease.SideChannelServer(
        b"info", token=TOKEN, listen="127.0.0.1:0", handshake_timeout=0.5
    )
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.settimeout(0.05)
            # A side-channel hello header (kind 21, length LE) whose body takes 50 s at this pace.
            s.sendall(struct.pack("<BI", 21, 1000))
            started = time.monotonic()
            closed = False
            while not closed and time.monotonic() - started < 10:
                try:
                    s.sendall(b"K")
                    closed = s.recv(1) == b""
                except socket.timeout:
                    pass
                except OSError:
                    closed = True
            assert closed, "the server kept a trickling handshake open past its deadline"
            assert time.monotonic() - started < 5
        deadline = time.monotonic() + PATIENCE
        while server.stats()["failed"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.stats()["failed"] == 1 and server.stats()["served"] == 0
    finally:
        server.close()


def test_a_side_channel_server_listens_on_loopback_and_beyond_it_only_with_a_token():
    server = kvlease.SideChannelServer(b"info")
    try:
        assert server.address.startswith("127.0.0.1:")
        assert kvlease.side_channel_fetch("127.0.0.1", server.port) == b"info"
    finally:
        server.close()
    # Every interface without a token: refused, unless the caller opts out explicitly.
    with pytest.raises(kvlease.InvalidArgument, match="allow_unauthenticated"):
        kvlease.SideChannelServer(b"info", listen="0.0.0.0:0")
    for kwargs in ({"token": TOKEN}, {"allow_unauthenticated": True}):
        server = kvlease.SideChannelServer(b"info", listen="0.0.0.0:0", **kwargs)
        try:
            assert server.address.startswith("0.0.0.0:")
        finally:
            server.close()


def test_an_agent_listens_beyond_loopback_only_with_a_token():
    # Without a token, every interface would let anyone who reaches the port read the
    # registered memory and send notifications: refused unless the caller opts out.
    with pytest.raises(kvlease.InvalidArgument, match="allow_unauthenticated"):
        kvlease.Agent("open#0", listen="0.0.0.0:0")
    with pytest.raises(kvlease.InvalidArgument, match="allow_unauthenticated"):
        kvlease.Agent("open#0", listen="[::]:0")
    for kwargs in ({"token": TOKEN}, {"allow_unauthenticated": True}):
        with kvlease.Agent("open#0", listen="0.0.0.0:0", **kwargs) as a:
            assert a.address.startswith("0.0.0.0:")
    # Loopback needs neither.
    with kvlease.Agent("local#0", listen="127.0.0.1:0") as a:
        assert a.address.startswith("127.0.0.1:")


def test_one_address_cannot_take_every_side_channel_slot():
    server = kvlease.SideChannelServer(
        b"info", token=TOKEN, max_connections=4, max_connections_per_address=2
    )
    idle = []

    def silent(address):
        s = socket.socket()
        s.bind((address, 0))
        s.connect(("127.0.0.1", server.port))
        idle.append(s)
        return s

    try:
        # Two silent peers from 127.0.0.2 take that address's share; a third from it takes
        # the slot of the oldest, which is cut off.
        first = silent("127.0.0.2")
        silent("127.0.0.2")
        time.sleep(0.2)
        silent("127.0.0.2")
        first.settimeout(PATIENCE)
        assert first.recv(1) == b"", "the oldest handshake of a flooding address was kept"
        # Two addresses holding every slot keep a third address out no more.
        silent("127.0.0.3")
        silent("127.0.0.3")
        time.sleep(0.2)
        assert kvlease.side_channel_fetch("127.0.0.1", server.port, token=TOKEN) == b"info"
        assert server.stats()["evicted"] >= 2, server.stats()
    finally:
        for s in idle:
            s.close()
        server.close()
    with pytest.raises(kvlease.InvalidArgument, match="max_connections_per_address"):
        kvlease.SideChannelServer(b"info", max_connections=4, max_connections_per_address=5)


def _failed_load(d: kvlease.DecodeCore, request: str) -> kvlease.LoadError:
    """The load failure ``d`` ended ``request`` with."""
    while (event := d.poll_event()) is not None:
        if isinstance(event, kvlease.Finished) and event.request == request:
            assert event.outcome == kvlease.Outcome.FAILED
            assert isinstance(event.error, kvlease.LoadError)
            return event.error
    raise AssertionError(f"{request} did not end")


def test_an_auth_failure_and_an_incompatible_engine_are_distinct_typed_handshake_errors():
    d = kvlease.DecodeCore(
        "d", tp_size=1, num_kv_heads=2, block_size=16, num_blocks=8, external_blocks=True
    )
    for engine in ("p-auth", "p-tp"):
        remote = kvlease.RemoteKv(
            engine=engine, request=f"r-{engine}", blocks=[0], generation=1, tp_size=1,
            num_tokens=16, host="127.0.0.1", port=1,
        )
        d.on_new_request(0.0, f"d-{engine}", 16, remote)
    # A real side channel that holds another cluster token: the fetch raises AuthError,
    # which the shell hands to the core as it is.
    server = kvlease.SideChannelServer(b"info", token=TOKEN, listen="127.0.0.1:0")
    try:
        with pytest.raises(kvlease.AuthError) as refused:
            kvlease.side_channel_fetch("127.0.0.1", server.port, token=b"another token")
    finally:
        server.close()
    assert isinstance(refused.value, kvlease.HandshakeError)
    assert refused.value.kind is kvlease.HandshakeKind.AUTH
    d.handle_handshake_failed(1.0, "p-auth", refused.value)
    auth = _failed_load(d, "d-p-auth")
    assert isinstance(auth.handshake, kvlease.AuthError)
    assert auth.handshake.kind is kvlease.HandshakeKind.AUTH
    assert auth.retryable is False

    # P answers with a TP size that does not divide D's 2 KV heads: the core refuses it.
    d.handle_handshake(1.0, "p-tp", tp_size=3, num_blocks=8)
    tp = _failed_load(d, "d-p-tp")
    assert type(tp.handshake) is kvlease.HandshakeError
    assert tp.handshake.kind is kvlease.HandshakeKind.INCOMPATIBLE
    assert "num_kv_heads 2" in str(tp.handshake)
    assert tp.retryable is True


def test_a_failed_handshake_is_reported_as_a_handshake_error_of_a_shell_kind():
    d = kvlease.DecodeCore(
        "d", tp_size=1, num_kv_heads=2, block_size=16, num_blocks=8, external_blocks=True
    )
    remote = kvlease.RemoteKv(
        engine="p", request="r", blocks=[0], generation=1, tp_size=1, num_tokens=16,
        host="127.0.0.1", port=1,
    )
    d.on_new_request(0.0, "d-r", 16, remote)
    with pytest.raises(kvlease.InvalidArgument, match="HandshakeError"):
        d.handle_handshake_failed(1.0, "p", ValueError("not typed"))
    # Incompatibility is the core's own verdict on P's answer, never a shell's.
    incompatible = kvlease.HandshakeError("x", kind=kvlease.HandshakeKind.INCOMPATIBLE)
    with pytest.raises(kvlease.InvalidArgument, match="incompatible"):
        d.handle_handshake_failed(1.0, "p", incompatible)
    # Nothing listens on port 1: the fetch names it not found, and so does the load.
    with pytest.raises(kvlease.SideChannelError) as gone:
        kvlease.side_channel_fetch("127.0.0.1", 1, token=TOKEN, timeout=2.0)
    assert gone.value.kind is kvlease.HandshakeKind.NOT_FOUND
    d.handle_handshake_failed(1.0, "p", gone.value)
    assert _failed_load(d, "d-r").handshake.kind == "not_found"
