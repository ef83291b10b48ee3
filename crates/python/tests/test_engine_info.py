"""``kvlease.EngineInfo``: the one engine-info handshake payload (``kvlease-proto``),
shared with the agents. The connector's P builds it, its D reads it, an agents' payload
reads too, and a field at fault is named in :class:`kvlease.InvalidArgument`.
"""

from __future__ import annotations

import json

import pytest

from kvlease import EngineInfo, InvalidArgument


def connector_info(**changes) -> EngineInfo:
    kwargs = dict(
        engine_id="p0", instance=77, tp_size=2, num_blocks=64, block_size=16,
        num_kv_heads=4,
        kv={"model": "m", "use_mla": False, "kv_cache_layout": None,
            "layers": {"l0": ["float16", [2, 16, 32], [2, 1, 3]]}, "future": {"x": 1}},
        workers=[{
            "rank": 1, "agent_name": "p0#1", "agent_metadata": b"\x00md\xff",
            "layers": [["l0", 1, 0, 4096, 4096, 64]], "fence_region": 2,
            "num_blocks": 64, "device": "cpu",
            "kv_format": {"l0": ["float16", [2, 16, 32], [2, 1, 3]]},
        }],
    )
    kwargs.update(changes)
    return EngineInfo(**kwargs)


def test_the_connectors_info_round_trips():
    info = EngineInfo.from_bytes(connector_info().to_bytes())
    assert (info.engine_id, info.instance, info.tp_size, info.num_blocks) == ("p0", 77, 2, 64)
    assert (info.block_size, info.num_kv_heads, info.shape) == (16, 4, None)
    # Unknown descriptor keys travel; a null is an absent key.
    assert info.kv == {"model": "m", "use_mla": False, "future": {"x": 1},
                       "layers": {"l0": ["float16", [2, 16, 32], [2, 1, 3]]}}
    assert info.worker(0) is None
    (w,) = info.workers
    assert info.worker(1).rank == w.rank == 1
    assert w.agent_metadata == b"\x00md\xff" and w.fence_region == 2
    assert w.layers == [("l0", 1, 0, 4096, 4096, 64)]
    assert w.kv_format == {"l0": ["float16", [2, 16, 32], [2, 1, 3]]}
    assert (w.agent_name, w.device, w.num_blocks, w.pool, w.fence) == ("p0#1", "cpu", 64, None, None)
    raw = json.loads(info.to_bytes())
    assert raw["format"] == 2 and raw["workers"][0]["agent_metadata"] == "AG1k/w=="


def test_an_agents_info_reads():
    raw = {
        "engine_id": "p-agent", "tp_size": 1, "num_blocks": 8, "instance": 5,
        "shape": {"num_layers": 2, "num_kv_heads": 4, "block_size": 16, "head_dim": 64},
        "workers": [{"rank": 0, "metadata": "0a0b",
                     "pool": {"id": 1, "base": 0, "len": 4096, "key": 3},
                     "fence": {"id": 2, "base": 0, "len": 64, "key": 4}}],
    }
    info = EngineInfo.from_bytes(json.dumps(raw).encode())
    assert info.shape == raw["shape"] and info.kv is None
    w = info.worker(0)
    assert w.agent_metadata == b"\x0a\x0b" and w.fence_region == 2
    assert w.pool == {"id": 1, "base": 0, "len": 4096, "key": 3} and w.layers == []
    assert w.kv_format is None


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: connector_info(tp_size=0), "engine_info.tp_size"),
        (lambda: connector_info(engine_id="bad id!"), "engine_info.engine_id"),
        (lambda: connector_info(kv={"layers": {"l0": 5}}), "engine_info.kv.layers.l0"),
        (lambda: connector_info(workers=[{"rank": 2, "agent_metadata": b"", "fence_region": 1}]),
         "engine_info.workers[0].rank"),
        (lambda: connector_info(workers=[{"rank": 0, "agent_metadata": b""}]),
         "engine_info.workers[0].fence_region"),
        (lambda: connector_info(workers=[{"rank": 0, "agent_metadata": b"", "fence_region": 1,
                                          "layers": [["l0", 1, -1, 1, 1, 1]]}]),
         "engine_info.workers[0].layers[0]"),
        (lambda: connector_info(kv={"model": object()}), "engine_info.kv"),
        (lambda: EngineInfo.from_bytes(b"{not json"), "engine_info"),
    ],
)
def test_errors_name_the_field(build, field):
    with pytest.raises(InvalidArgument) as e:
        build()
    assert e.value.field == field
