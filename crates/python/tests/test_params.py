"""``kvlease.KvTransferParams``: the one codec of ``kv_transfer_params`` (``kvlease-proto``),
shared with the agents. It reads what both kinds of P answer (the agents' ``kvlease_lease_ms``
and the connector's older ``kvlease_lease_duration`` in seconds), writes the canonical keys,
and names the field at fault in :class:`kvlease.InvalidArgument`.
"""

from __future__ import annotations

import pytest

import kvlease
from kvlease import InvalidArgument, KvTransferParams


def agent_answer() -> dict:
    """What the agents' P answers."""
    return {
        "do_remote_prefill": True, "do_remote_decode": False,
        "remote_engine_id": "p0", "remote_block_ids": [3, 1],
        "remote_host": "127.0.0.1", "remote_port": 5600,
        "remote_request_id": "r1", "tp_size": 2,
        "kvlease_generation": 9, "kvlease_num_tokens": 20, "kvlease_lease_ms": 3000,
        "kv_digest": "kvd-00000000000000ff", "kvlease_instance": 5,
    }


def connector_answer() -> dict:
    """What the vLLM connector's P answered before the codec: vLLM's keys and the old
    lease key, in seconds."""
    return {
        "do_remote_prefill": True, "do_remote_decode": False,
        "remote_block_ids": [4, 5, 6], "remote_engine_id": "p0",
        "remote_request_id": "cmpl-1", "remote_host": "10.0.0.11", "remote_port": 5601,
        "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 40,
        "transfer_mode": "pull", "kvlease_generation": 7, "kvlease_instance": 123,
        "kvlease_num_tokens": 40, "kvlease_lease_duration": 30.0,
    }


def test_the_agents_answer_reads_and_writes_back_unchanged():
    p = KvTransferParams.from_dict(agent_answer())
    assert p.to_dict() == agent_answer()
    assert (p.remote_engine_id, p.remote_request_id) == ("p0", "r1")
    assert p.remote_block_ids == [3, 1]
    assert (p.remote_host, p.remote_port, p.tp_size) == ("127.0.0.1", 5600, 2)
    assert (p.kvlease_generation, p.kvlease_num_tokens) == (9, 20)
    assert (p.kvlease_lease_ms, p.kvlease_instance) == (3000, 5)
    assert p.kv_digest == "kvd-00000000000000ff"
    assert (p.dcp_size, p.pp_size, p.remote_num_tokens, p.transfer_mode) == (None,) * 4
    assert KvTransferParams.from_dict(p.to_dict()) == p


def test_the_old_lease_key_is_read_in_seconds_and_written_in_ms():
    p = KvTransferParams.from_dict(connector_answer())
    assert p.kvlease_lease_ms == 30_000
    assert (p.dcp_size, p.pp_size, p.remote_num_tokens, p.transfer_mode) == (1, 1, 40, "pull")
    assert p.kv_digest is None
    out = p.to_dict()
    assert out["kvlease_lease_ms"] == 30_000 and "kvlease_lease_duration" not in out
    assert out["do_remote_prefill"] is True and out["do_remote_decode"] is False
    # The canonical key wins when both are sent.
    both = connector_answer() | {"kvlease_lease_ms": 1500}
    assert KvTransferParams.from_dict(both).kvlease_lease_ms == 1500
    # Neither: the lease is not announced.
    neither = {k: v for k, v in connector_answer().items() if k != "kvlease_lease_duration"}
    assert KvTransferParams.from_dict(neither).kvlease_lease_ms is None


def test_p_builds_its_answer_with_keywords():
    p = KvTransferParams(
        remote_engine_id="p0", remote_request_id="cmpl-1", remote_block_ids=(4, 5, 6),
        remote_host="10.0.0.11", remote_port=5601, tp_size=1, dcp_size=1, pp_size=1,
        remote_num_tokens=40, transfer_mode="pull", kvlease_generation=7,
        kvlease_instance=123, kvlease_num_tokens=40, kvlease_lease_ms=30_000,
    )
    assert p == KvTransferParams.from_dict(connector_answer())
    assert p.to_dict() == {k: v for k, v in connector_answer().items()
                           if k != "kvlease_lease_duration"} | {"kvlease_lease_ms": 30_000}
    # Optional keys left out are not written.
    q = KvTransferParams(
        remote_engine_id="p0", remote_request_id="r", remote_block_ids=[],
        remote_host="h", remote_port=1, tp_size=1, kvlease_generation=1, kvlease_num_tokens=0,
    )
    assert set(q.to_dict()) == {
        "do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_request_id",
        "remote_block_ids", "remote_host", "remote_port", "tp_size", "kvlease_generation",
        "kvlease_num_tokens", "kvlease_instance",
    }
    assert q.kvlease_instance == 0
    with pytest.raises(InvalidArgument) as e:
        KvTransferParams(
            remote_engine_id="p0", remote_request_id="r", remote_block_ids=[1],
            remote_host="h", remote_port=0, tp_size=1, kvlease_generation=1,
            kvlease_num_tokens=1,
        )
    assert e.value.field == "kv_transfer_params.remote_port"


def test_d_gets_the_cores_remote_kv():
    r = KvTransferParams.from_dict(connector_answer()).to_remote_kv()
    assert isinstance(r, kvlease.RemoteKv)
    assert (r.engine, r.request, r.blocks) == ("p0", "cmpl-1", [4, 5, 6])
    assert (r.generation, r.tp_size, r.num_tokens) == (7, 1, 40)
    assert (r.host, r.port, r.instance) == ("10.0.0.11", 5601, 123)


def test_one_kv_cache_group_reads_as_the_list():
    nested = agent_answer() | {"remote_block_ids": [[7, 8, 9]]}
    assert KvTransferParams.from_dict(nested).remote_block_ids == [7, 8, 9]
    assert KvTransferParams.from_dict(nested).remote_block_groups == [[7, 8, 9]]
    # Several groups (a hybrid model): one lease over all their blocks, written back as
    # they came; one group stays a flat list on the wire.
    groups = KvTransferParams.from_dict(agent_answer() | {"remote_block_ids": [[1, 2], [5]]})
    assert groups.remote_block_ids == [1, 2, 5]
    assert groups.remote_block_groups == [[1, 2], [5]]
    assert groups.to_dict()["remote_block_ids"] == [[1, 2], [5]]
    assert KvTransferParams.from_dict(nested).to_dict()["remote_block_ids"] == [7, 8, 9]
    with pytest.raises(InvalidArgument, match="a list of such lists") as e:
        KvTransferParams.from_dict(agent_answer() | {"remote_block_ids": [[1], 2]})
    assert e.value.field == "kv_transfer_params.remote_block_ids"


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        ("remote_block_ids", [1, -1], "a list of block ids"),
        ("remote_block_ids", [1, "2"], "a list of block ids"),
        ("remote_block_ids", None, "missing"),
        ("remote_engine_id", "p 0", None),
        ("remote_engine_id", 7, "a string"),
        ("remote_request_id", "", None),
        ("remote_port", 0, "1..=65535"),
        ("remote_port", 70000, "1..=65535"),
        ("tp_size", 0, "an integer in 1..=1024"),
        ("tp_size", 1025, "an integer in 1..=1024"),
        ("kvlease_lease_ms", 0, "1..=86400000"),
        ("kvlease_lease_ms", 2**63, "1..=86400000"),
        ("kvlease_lease_duration", 0.0, "seconds"),
        ("kvlease_lease_duration", float("nan"), "finite"),
        ("kvlease_lease_duration", 10**6, "seconds"),
        ("kvlease_generation", 0, None),
        ("kvlease_generation", 2**64, None),
        ("kvlease_num_tokens", -1, None),
        ("kv_digest", "x", "kvd-"),
        ("do_remote_prefill", False, "true on D"),
        ("remote_host", object(), "not a JSON value"),
    ],
)
def test_errors_name_the_field(key, value, reason):
    params = agent_answer()
    if key == "kvlease_lease_duration":
        del params["kvlease_lease_ms"]
    params[key] = value
    with pytest.raises(InvalidArgument) as e:
        KvTransferParams.from_dict(params)
    assert e.value.field == f"kv_transfer_params.{key}"
    assert str(e.value).startswith(e.value.field)
    if reason is not None:
        assert reason in e.value.reason
    assert isinstance(e.value, ValueError) and isinstance(e.value, kvlease.KvleaseError)


def test_a_missing_key_or_a_non_dict_is_named():
    params = agent_answer()
    del params["kvlease_generation"]
    with pytest.raises(InvalidArgument) as e:
        KvTransferParams.from_dict(params)
    assert e.value.field == "kv_transfer_params.kvlease_generation"
    assert "missing" in e.value.reason
    for bad in ([1], "x", None):
        with pytest.raises(InvalidArgument) as e:
            KvTransferParams.from_dict(bad)
        assert e.value.field == "kv_transfer_params"
