"""Push mode's pieces from Python: fenced one-sided writes between two real agents over
TCP and same-host shared memory (``Agent.post_write``, ``Agent.set_write_fence``; on
shared memory D pulls each write from P's ``bytearray`` with cross-memory attach), and
the push cores
(``Reservations`` on D, ``PushCore`` on P) driven by hand with explicit times.

The vLLM connector's push mode is built on them (``tests/vllm/test_kvlease_push.py``,
``tests/serve/test_push.py``).
"""

from __future__ import annotations

import mmap
import os
import time

import pytest

import kvlease
from kvlease import errors

TOKEN = b"push-test-token"
# Generous bound on any wait: the tests run on 2 shared cores.
PATIENCE = 60.0


def _wait_notifs(agent: kvlease.Agent, sender: str) -> list[bytes]:
    deadline = time.monotonic() + PATIENCE
    while time.monotonic() < deadline:
        got = agent.get_new_notifs().get(sender)
        if got:
            return got
        time.sleep(0.01)
    raise AssertionError(f"no notification from {sender} within {PATIENCE}s")


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_fenced_write_lands_exactly_and_after_the_fence_is_cleared_a_second_is_refused(
    backend: str,
):
    with (
        kvlease.Agent("engine-d#0", token=TOKEN, backend=backend) as d,
        kvlease.Agent("engine-p#0", token=TOKEN, backend=backend) as p,
    ):
        # D: the destination blocks and a page of write-fence words.
        dest = bytearray(64 * 1024)
        dest_region = d.register(dest)
        fence_map = mmap.mmap(-1, mmap.PAGESIZE)
        fence_region = d.register(fence_map)
        generation = 7
        d.set_write_fence(fence_region, 8, generation)
        assert int.from_bytes(fence_map[8:16], "little") == generation

        # P: the source, connected to D.
        src = bytearray(os.urandom(48 * 1024))
        src_region = p.register(src)
        peer = p.connect(d.metadata())
        assert peer.backend == backend
        remote_dest = peer.region(dest_region.id)
        fence = (peer.region(fence_region.id), 8, generation)

        # Two ranges: src[0:16K] → dest[4K:20K], src[16K:48K] (by id) → dest[32K:64K].
        ops = [
            (src_region, 0, remote_dest, 4096, 16 * 1024),
            (src_region.id, 16 * 1024, remote_dest, 32 * 1024, 32 * 1024),
        ]
        batch = p.post_write(peer, ops, fence=fence, notif=b"written:xfer-1")
        [result] = p.wait([batch])
        assert result is not None and result.ok, result
        assert result.status == kvlease.BatchStatus.DONE
        assert result.bytes == 48 * 1024
        result.raise_for_status()
        expected = bytearray(64 * 1024)
        expected[4096 : 4096 + 16 * 1024] = src[: 16 * 1024]
        expected[32 * 1024 :] = src[16 * 1024 :]
        assert dest == expected
        # The notification comes only after every write landed.
        assert _wait_notifs(d, "engine-p#0") == [b"written:xfer-1"]
        # On shared memory D copied both from P's bytearray itself (cross-memory attach).
        stats = d.stats()
        assert stats["writes_landed"] == 2
        assert stats["bytes_landed"] == 48 * 1024
        assert stats["writes_pulled"] == (2 if backend == "shm" else 0)

        # D ends the reservation: clears the fence. A late write for the old
        # generation is refused and changes no byte.
        d.set_write_fence(fence_region, 8, 0)
        src[:] = os.urandom(len(src))
        batch = p.post_write(peer, ops, fence=fence)
        deadline = time.monotonic() + PATIENCE
        result = None
        while result is None and time.monotonic() < deadline:
            result = p.poll(batch)
            time.sleep(0.01)
        assert result is not None
        assert not result.ok
        assert result.status == kvlease.BatchStatus.STALE
        assert isinstance(result.error, errors.StaleFenceError)
        assert result.error.expected == generation
        with pytest.raises(errors.StaleFenceError):
            result.raise_for_status()
        assert dest == expected
        assert d.stats()["writes_stale"] >= 1
        # Reported once: polling it again is a typed error.
        with pytest.raises(errors.TransferError):
            p.poll(batch)


def test_write_apis_raise_typed_exceptions_on_bad_input():
    with (
        kvlease.Agent("engine-d#0", token=TOKEN, backend="tcp") as d,
        kvlease.Agent("engine-p#0", token=TOKEN, backend="tcp") as p,
    ):
        dest_region = d.register(bytearray(4096))
        fence_map = mmap.mmap(-1, mmap.PAGESIZE)
        fence_region = d.register(fence_map)
        src_region = p.register(bytearray(4096))
        peer = p.connect(d.metadata())
        remote = peer.region(dest_region.id)
        fence = (peer.region(fence_region.id), 0, 1)

        with pytest.raises(errors.RegisterError):
            d.set_write_fence(12345, 0, 1)  # not registered
        with pytest.raises(errors.RegisterError):
            d.set_write_fence(fence_region, 4, 1)  # misaligned
        with pytest.raises(errors.RegisterError):
            d.set_write_fence(fence_region, mmap.PAGESIZE, 1)  # outside
        with pytest.raises(errors.InvalidArgument):
            d.set_write_fence("fence", 0, 1)
        with pytest.raises(errors.TransferError):
            p.post_write(peer, [], fence=fence)  # no ops
        with pytest.raises(errors.TransferError):
            p.post_write(peer, [(src_region, 0, remote, 0, 0)], fence=fence)  # zero bytes
        with pytest.raises(errors.TransferError):
            p.post_write(peer, [(src_region, 0, remote, 0, 8192)], fence=fence)  # past source
        with pytest.raises(errors.TransferError):
            p.post_write(peer, [(999, 0, remote, 0, 8)], fence=fence)  # unknown source
        with pytest.raises(errors.InvalidArgument):
            p.post_write(peer, [("src", 0, remote, 0, 8)], fence=fence)
        with pytest.raises(errors.InvalidArgument):
            p.post_write(peer, [(src_region, 0, remote, 0, 8)], fence=fence, timeout=-1.0)
        with pytest.raises(TypeError):
            p.post_write(peer, [(src_region, 0, remote, 0, 8)])  # the fence is required
        # A destination range outside D's region is refused by D: the batch fails.
        batch = p.post_write(peer, [(src_region, 0, remote, 4090, 8)], fence=fence)
        [result] = p.wait([batch], timeout=PATIENCE)
        assert result is not None and result.status == kvlease.BatchStatus.FAILED
        assert isinstance(result.error, errors.TransferError)
        p.close()
        with pytest.raises(errors.ClosedError):
            p.post_write(peer, [(src_region, 0, remote, 0, 8)], fence=fence)
        with pytest.raises(errors.ClosedError):
            p.set_write_fence(src_region, 0, 1)


def _drain(core: kvlease.PushCore) -> list:
    out = []
    while (action := core.poll_action()) is not None:
        out.append(action)
    return out


def _heartbeat(push: kvlease.PushCore, res: kvlease.Reservations, now: float) -> int:
    """P sends every heartbeat due at `now`; D takes it. Returns the ids renewed."""
    held = 0
    while (hb := push.poll_heartbeat(now)) is not None:
        decode, transfers = hb
        assert decode == "engine-d"
        held += res.handle_heartbeat(now, "engine-p", transfers)["held"]
    return held


def test_push_cores_reserve_register_heartbeat_write_and_expire():
    res = kvlease.Reservations(lease_duration=6.0)
    push = kvlease.PushCore(lease_duration=6.0)
    assert push.heartbeat_interval == pytest.approx(1.0)

    # D reserves, P admits its leg and takes the registration.
    push.admit(0.0, "xfer-1", "req-p-1")
    r = res.reserve(0.0, "xfer-1", "engine-p", [10, 11])
    assert r.transfer == "xfer-1" and r.blocks == [10, 11] and r.lease == pytest.approx(6.0)
    assert res.get("xfer-1") == (r.generation, [10, 11])
    assert res.blocks_held == 2 and len(res) == 1
    outcome = push.handle_registration(0.1, "engine-d", "xfer-1", r.generation, r.lease, r.blocks)
    assert outcome == kvlease.RegistrationOutcome.ACCEPTED
    assert push.handle_registration(0.1, "engine-d", "xfer-1", r.generation, r.lease, r.blocks) == (
        kvlease.RegistrationOutcome.DUPLICATE
    )

    # Heartbeats renew the reservation well past its first expiry (6 s).
    renewed = 0
    for step in range(1, 41):
        now = step * 0.5
        renewed += _heartbeat(push, res, now)
        assert res.handle_timeout(now) == 0
        assert res.get("xfer-1") is not None
    assert renewed >= 10
    assert res.expiry("xfer-1") > 20.0

    # P's prefill ends: it writes its last blocks into D's (paired from the end).
    push.handle_prefill_done(20.2, "xfer-1", [0, 1, 2])
    [write] = _drain(push)
    assert isinstance(write, kvlease.PushWrite)
    assert (write.transfer, write.decode, write.generation) == ("xfer-1", "engine-d", r.generation)
    assert write.pairs == [(1, 10), (2, 11)]
    assert push.is_writing("xfer-1")
    assert res.admits_write("engine-p", "xfer-1", r.generation) == kvlease.FenceVerdict.ACCEPTED
    assert push.handle_write_result(20.4, "xfer-1", r.generation, True)
    send, ended = _drain(push)
    assert isinstance(send, kvlease.PushSend)
    assert (send.to, send.kind, send.transfer, send.generation) == (
        "engine-d",
        "write_done",
        "xfer-1",
        r.generation,
    )
    assert isinstance(ended, kvlease.PushEnded)
    assert ended.outcome == kvlease.PushOutcome.WRITTEN and ended.blocks == [0, 1, 2]
    assert ended.request == "req-p-1" and ended.decode == "engine-d"

    # D takes the write-done: the reservation ends written.
    verdict = res.handle_write_done(20.5, "engine-p", "xfer-1", r.generation)
    assert verdict == kvlease.FenceVerdict.ACCEPTED
    event = res.poll_event()
    assert event.outcome == kvlease.ReservationOutcome.WRITTEN
    assert (event.transfer, event.prefill, event.blocks) == ("xfer-1", "engine-p", [10, 11])
    assert not event.needs_recompute and not event.tells_prefill
    assert res.poll_event() is None and len(res) == 0 and res.blocks_held == 0
    # A second write-done for it changes nothing.
    assert res.handle_write_done(20.6, "engine-p", "xfer-1", r.generation) == "unknown"
    assert res.poll_event() is None

    # A second reservation whose P stops heartbeating: the reaper frees it.
    push.admit(30.0, "xfer-2", "req-p-2")
    r2 = res.reserve(30.0, "xfer-2", "engine-p", [3, 4, 5])
    assert r2.generation > r.generation
    push.handle_registration(30.0, "engine-d", "xfer-2", r2.generation, r2.lease, r2.blocks)
    for step in range(1, 5):
        _heartbeat(push, res, 30.0 + step * 0.5)
    # ... and then none arrives.
    deadline = res.poll_timeout()
    assert deadline is not None and deadline == pytest.approx(res.expiry("xfer-2"))
    assert res.handle_timeout(deadline - 0.01) == 0
    assert res.get("xfer-2") is not None
    assert res.handle_timeout(deadline + 0.01) == 1
    event = res.poll_event()
    assert event.outcome == kvlease.ReservationOutcome.EXPIRED
    assert event.blocks == [3, 4, 5] and event.generation == r2.generation
    assert event.tells_prefill and event.needs_recompute
    assert len(res) == 0 and res.blocks_held == 0 and res.poll_timeout() is None
    # D tells P (`KVL1:RR:`): P's push ends without a write.
    assert push.handle_reservation_released(deadline + 0.1, "engine-d", "xfer-2", r2.generation)
    [ended] = _drain(push)
    assert ended.outcome == kvlease.PushOutcome.RESERVATION_GONE
    # A late write-done for it changes nothing.
    assert res.handle_write_done(deadline + 0.2, "engine-p", "xfer-2", r2.generation) == "unknown"

    # A write-done for an old generation, or from another P, changes nothing.
    r3 = res.reserve(50.0, "xfer-3", "engine-p", [7])
    assert res.handle_write_done(50.1, "engine-p", "xfer-3", r2.generation) == (
        kvlease.FenceVerdict.STALE
    )
    assert res.handle_write_done(50.1, "engine-q", "xfer-3", r3.generation) == (
        kvlease.FenceVerdict.FOREIGN
    )
    assert res.handle_push_failed(50.1, "engine-p", "xfer-3", r2.generation) == "stale"
    assert res.get("xfer-3") == (r3.generation, [7]) and res.poll_event() is None
    # A heartbeat from another P does not renew it.
    assert res.handle_heartbeat(50.2, "engine-q", ["xfer-3"]) == {
        "held": 0,
        "extended": 0,
        "unknown": 1,
        "late": 0,
    }
    assert res.abort(50.3, "xfer-3")
    assert res.poll_event().outcome == kvlease.ReservationOutcome.ABORTED
    stats = res.stats()
    assert stats["reserved"] == 3 and stats["written"] == 1 and stats["expired"] == 1
    assert stats["aborted"] == 1 and stats["refused"] >= 3 and stats["foreign_ids"] == 1
    assert push.stats()["ended"] == 2 and push.pushing == 0


def test_push_cores_raise_typed_exceptions_on_bad_input():
    res = kvlease.Reservations(lease_duration=6.0)
    push = kvlease.PushCore(lease_duration=6.0)
    with pytest.raises(errors.ConfigError):
        kvlease.Reservations(lease_duration=-1.0)  # as PrefillCore's lease terms
    with pytest.raises(errors.InvalidArgument):
        kvlease.Reservations(first_generation=0)
    with pytest.raises(errors.InvalidArgument):
        kvlease.PushCore(registration_wait=float("nan"))
    with pytest.raises(errors.InvalidArgument):
        kvlease.PushCore(remember_ended=1e18)
    with pytest.raises(errors.InvalidArgument):
        # 2**64 - 2048 s: an hour's deadline from it would overflow the clock.
        kvlease.PushCore(remember_ended=3600.0).admit(1.844674407370955e19, "xfer-9", "req-9")
    with pytest.raises(errors.InvalidArgument):
        res.reserve(-1.0, "xfer-1", "engine-p", [1])
    with pytest.raises(errors.InvalidArgument):
        res.reserve(0.0, "", "engine-p", [1])
    r = res.reserve(0.0, "xfer-1", "engine-p", [1])
    with pytest.raises(errors.AdmitError):
        res.reserve(0.0, "xfer-1", "engine-p", [2])  # held already
    with pytest.raises(errors.InvalidArgument):
        res.handle_write_done(0.0, "engine-p", "xfer-1", 0)  # no generation is 0
    with pytest.raises(OverflowError):
        res.handle_write_done(0.0, "engine-p", "xfer-1", -1)
    assert res.get("xfer-1") == (r.generation, [1])

    push.admit(0.0, "xfer-1", "req-1")
    with pytest.raises(errors.PrefillError):
        push.admit(0.0, "xfer-1", "req-1")  # admitted already
    with pytest.raises(errors.PrefillError):
        push.handle_prefill_done(0.0, "xfer-9", [1])  # never admitted
    push.handle_prefill_done(0.0, "xfer-1", [1])
    with pytest.raises(errors.PrefillError):
        push.handle_prefill_done(0.0, "xfer-1", [1])  # reported already
    with pytest.raises(errors.InvalidArgument):
        push.handle_registration(0.0, "engine-d", "xfer-1", 1, float("inf"), [1])
    # A lease too short for P's heartbeat interval: P answers push-failed at once.
    push.admit(0.0, "xfer-2", "req-2")
    assert push.handle_registration(0.0, "engine-d", "xfer-2", 5, 0.5, [1]) == (
        kvlease.RegistrationOutcome.LEASE_TOO_SHORT
    )
    kinds = [a.kind for a in _drain(push) if isinstance(a, kvlease.PushSend)]
    assert kinds == ["push_failed"]


def test_push_core_refuses_a_registration_for_another_prompt():
    """P's leg and D's registration carry digests of their prompts: a registration whose
    digest differs is refused in either order (push-failed to its D, nothing written), and
    the leg keeps waiting for its own."""
    mine, other = "0123456789abcdef" * 2, "fedcba9876543210" * 2
    push = kvlease.PushCore(lease_duration=6.0)
    res = kvlease.Reservations(lease_duration=6.0)

    # The leg first, then another prompt's registration.
    push.admit(0.0, "xfer-1", "req-p-1", prompt=mine)
    r_other = res.reserve(0.0, "xfer-1", "engine-p", [10], prompt=other)
    assert r_other.prompt == other
    outcome = push.handle_registration(
        0.1, "engine-d2", "xfer-1", r_other.generation, r_other.lease, r_other.blocks, r_other.prompt
    )
    assert outcome == kvlease.RegistrationOutcome.PROMPT_MISMATCH == "prompt_mismatch"
    [send] = _drain(push)
    assert (send.to, send.kind, send.transfer, send.generation) == (
        "engine-d2",
        "push_failed",
        "xfer-1",
        r_other.generation,
    )
    assert push.pushing == 1 and push.stats()["prompt_mismatches"] == 1
    # The leg's own registration is accepted and written.
    push.handle_prefill_done(0.2, "xfer-1", [5])
    assert _drain(push) == []
    ok = push.handle_registration(0.3, "engine-d", "xfer-1", 7, 6.0, [11], prompt=mine)
    assert ok == kvlease.RegistrationOutcome.ACCEPTED
    [write] = _drain(push)
    assert isinstance(write, kvlease.PushWrite) and write.pairs == [(5, 11)]

    # The registration first, then a leg with another digest: dropped at admission.
    assert push.handle_registration(1.0, "engine-d2", "xfer-2", 9, 6.0, [12], other) == "accepted"
    push.admit(1.1, "xfer-2", "req-p-2", other.replace("f", "e"))
    [send] = _drain(push)
    assert (send.to, send.kind, send.generation) == ("engine-d2", "push_failed", 9)
    assert push.stats()["prompt_mismatches"] == 2

    # No digest on either side: nothing is checked.
    push.admit(2.0, "xfer-3", "req-p-3")
    assert push.handle_registration(2.0, "engine-d", "xfer-3", 11, 6.0, [13], mine) == "accepted"
    r = res.reserve(2.0, "xfer-4", "engine-p", [14])
    assert r.prompt is None

    # The registration frame carries the digest; decode_notif shows it.
    frame = f"KVL1:PR:xfer-1;7;6000;11;{mine}".encode()
    decoded = kvlease.decode_notif(frame)
    assert decoded.kind == "push" and decoded.prompt == mine
    assert kvlease.decode_notif(b"KVL1:PR:xfer-1;7;6000;11").prompt is None
    for bad in (mine.upper(), mine[:31], mine + "0", ""):
        with pytest.raises(errors.NotifError):
            kvlease.decode_notif(f"KVL1:PR:xfer-1;7;6000;11;{bad}".encode())

    # A malformed digest is refused before anything changes.
    for bad in (mine.upper(), mine[:31], mine + "0", "", "0x" + mine[2:]):
        with pytest.raises(errors.InvalidArgument):
            push.admit(3.0, "xfer-5", "req-p-5", bad)
        with pytest.raises(errors.InvalidArgument):
            push.handle_registration(3.0, "engine-d", "xfer-5", 1, 6.0, [1], prompt=bad)
        with pytest.raises(errors.InvalidArgument):
            res.reserve(3.0, "xfer-5", "engine-p", [15], prompt=bad)
    assert res.get("xfer-5") is None and not push.is_writing("xfer-5")
    assert push.stats()["admitted"] == 3


def test_tp_pairs_pair_the_workers_that_share_heads_and_refuse_a_size_that_splits_none():
    assert kvlease.tp_pairs(4, 2, 2) == [(0, 0, (0, 2)), (1, 1, (2, 4))]
    assert kvlease.tp_pairs(4, 2, 1) == [(0, 0, (0, 2)), (1, 0, (2, 4))]
    assert kvlease.tp_pairs(4, 1, 2) == [(0, 0, (0, 2)), (0, 1, (2, 4))]
    # Replicated (MLA): each destination once, every head.
    assert kvlease.tp_pairs(1, 4, 2, replicated=True) == [(0, 0, (0, 1)), (2, 1, (0, 1))]
    for bad in [(4, 3, 1), (4, 2, 0), (0, 1, 1)]:
        with pytest.raises(errors.InvalidArgument, match="do not both split"):
            kvlease.tp_pairs(*bad)
