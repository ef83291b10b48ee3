"""The host buffer (``kv_buffer_device: "cpu"``) as vLLM 0.33.0's real ``Scheduler`` sees
it, on CPU: which step's metadata asks P's workers to copy a request's blocks to the host
buffer (``SaveSpec``), that the lease names exactly those blocks, that no lease is granted
on blocks never copied, and the config's checks. The bytes move in tests/worker/
(``test_host_buffer.py``)."""

from __future__ import annotations

import pytest
from sched_harness import create_request, create_scheduler, create_vllm_config, step
from vllm.v1.request import RequestStatus

from kvlease import ConfigError
from kvlease.vllm import KvleaseConfig, SaveSpec

TOKEN = "host-buffer-test-token"


def config(host: bool, extra=None, **kw):
    if host:
        kw.setdefault("kv_buffer_device", "cpu")
    return create_vllm_config(
        kv_connector="KvleaseConnector",
        kv_connector_module_path="kvlease.vllm",
        kv_role="kv_producer",
        engine_id="p0",
        kv_connector_extra_config={
            "kv_lease_duration": 30,
            "cluster_token": TOKEN,
            "transport": "tcp",
            **({"force_host_buffer": True} if host else {}),
            **(extra or {}),
        },
        **kw,
    )


@pytest.fixture
def producer():
    made = []

    def make(host: bool):
        scheduler = create_scheduler(config(host), num_blocks=64)
        made.append(scheduler)
        return scheduler

    yield make
    for scheduler in made:
        scheduler.connector.shutdown()


@pytest.mark.parametrize("host", [True, False], ids=["host-buffer", "device"])
def test_p_copies_a_request_at_the_step_completing_its_prompt_and_leases_those_blocks(
        producer, host):
    """A 100-token prompt in chunks of 64 (max_num_batched_tokens): the first step's
    metadata asks for no copy (the prompt's blocks are not all computed), the second's
    for every block of the request, which is what the lease then names."""
    p = producer(host)
    assert p.connector.scheduler.use_host_buffer is host
    req = create_request(num_tokens=100, max_tokens=1,
                         kv_transfer_params={"do_remote_decode": True})
    p.add_request(req)
    first, out1 = step(p)
    assert first.num_scheduled_tokens[req.request_id] == 64
    assert first.kv_connector_metadata.saves == []
    assert not any(o.finish_reason for e in out1.values() for o in e.outputs)
    blocks = list(p.kv_cache_manager.get_block_ids(req.request_id)[0])
    second, out2 = step(p)
    (finished,) = [o for e in out2.values() for o in e.outputs]
    assert finished.finish_reason is not None
    blocks = list(p.kv_cache_manager.get_block_ids(req.request_id)[0])
    assert len(blocks) == 7
    params = finished.kv_transfer_params
    assert params["remote_block_ids"] == blocks
    if host:
        assert second.kv_connector_metadata.saves == [
            SaveSpec(request=req.request_id, block_groups=[blocks])
        ]
    else:
        assert second.kv_connector_metadata.saves == []
    assert p.connector.scheduler.prefill.lease(req.request_id)["blocks"] == 7
    # Nothing is copied again once the request is done.
    third, _ = step(p)
    assert third.kv_connector_metadata.saves == []


@pytest.mark.parametrize("host", [True, False], ids=["host-buffer", "device"])
def test_no_lease_is_granted_on_blocks_never_copied_to_the_host_buffer(producer, host):
    """``request_finished`` for a request no step asked to copy (never scheduled here):
    with a host buffer its blocks are not in it, so P grants no lease (vLLM frees them,
    D computes); without one the same call grants it."""
    p = producer(host)
    req = create_request(num_tokens=40, max_tokens=1,
                         kv_transfer_params={"do_remote_decode": True})
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = p.connector.request_finished(req, [5, 6, 7])
    lease = p.connector.scheduler.prefill.lease(req.request_id)
    if host:
        assert (delay, params, lease) == (False, None, None)
    else:
        assert delay is True and params["remote_block_ids"] == [5, 6, 7]
        assert lease is not None and lease["blocks"] == 3


def test_kv_buffer_device_is_checked():
    with pytest.raises(ConfigError, match=r"kv_buffer_device must be one of cuda, cpu.*'tpu'"):
        KvleaseConfig.from_vllm(config(False, kv_buffer_device="tpu"))
    with pytest.raises(ConfigError, match="force_host_buffer needs kv_buffer_device 'cpu'"):
        KvleaseConfig.from_vllm(config(False, {"force_host_buffer": True},
                                       kv_buffer_device="cuda"))
    with pytest.raises(ConfigError, match="force_host_buffer must be true or false"):
        KvleaseConfig.from_vllm(config(False, {"force_host_buffer": "yes"},
                                       kv_buffer_device="cpu"))
    forced = KvleaseConfig.from_vllm(config(True))
    assert (forced.kv_buffer_device, forced.use_host_buffer) == ("cpu", True)
    direct = KvleaseConfig.from_vllm(config(False, kv_buffer_device="cuda"))
    assert (direct.kv_buffer_device, direct.use_host_buffer) == ("cuda", False)
    # vLLM's default (the platform's device type): the KV caches as they are.
    assert KvleaseConfig.from_vllm(config(False)).use_host_buffer is False


def test_hybrid_groups_copy_each_layers_own_blocks_only():
    """A hybrid model's host copies, one level down (no hybrid model runs in the worker
    harness): each KV cache group's blocks are copied in its own layers only, both ways,
    and the host buffers keep the caches' layout (a layer sharing another's memory shares
    it in the host buffer too)."""
    import torch

    from kvlease.vllm import KvleaseWorker
    from kvlease.vllm.worker import _index_copy_blocks, _Load

    cfg = config(True)
    worker = KvleaseWorker(cfg, KvleaseConfig.from_vllm(cfg))
    try:
        backing = torch.zeros(2 * 8 * 64, dtype=torch.uint8)
        caches = {
            # Block-outer: both layers in one storage, their blocks interleaved.
            "full": backing.view(torch.float16).view(8, 2, 32)[:, 0],
            "window": backing.view(torch.float16).view(8, 2, 32)[:, 1],
        }
        worker.layer_groups = {"full": 0, "window": 1}
        worker.register_kv_caches(caches)
        host = worker.host_xfer_buffers
        assert {n: (t.shape, t.stride()) for n, t in host.items()} == \
            {n: (t.shape, t.stride()) for n, t in caches.items()}
        assert host["full"].untyped_storage().data_ptr() == \
            host["window"].untyped_storage().data_ptr()
        assert len(worker._regions) == 1  # one registered region, the host storage
        calls = []

        def op(src, dst, src_ids, dst_ids, direction):
            calls.append((sorted(src), list(src_ids), direction))
            _index_copy_blocks(src, dst, src_ids, dst_ids, direction)

        worker.set_host_xfer_buffer_ops(op)
        for name, t in caches.items():
            t.copy_(torch.randn(t.shape).to(t.dtype))
        worker.save_kv_to_host([SaveSpec(request="r", block_groups=[[1, 2], [5]])])
        assert calls == [(["full"], [1, 2], "d2h"), (["window"], [5], "d2h")]
        for name, copied in (("full", [1, 2]), ("window", [5])):
            for b in range(8):
                same = torch.equal(host[name][b], caches[name][b])
                assert same == (b in copied), (name, b)

        # D: blocks read into the host buffer go to the caches, per group, at the end.
        calls.clear()
        for t in host.values():
            t.copy_(torch.randn(t.shape).to(t.dtype))
        record = _Load(blocks=[3, 4, 6], pending=set(), host_groups=[[3, 4], [6]])
        worker.sync_recved_kv_to_device("r", record)
        assert calls == [(["full"], [3, 4], "h2d"), (["window"], [6], "h2d")]
        for name, copied in (("full", [3, 4]), ("window", [6])):
            for b in range(8):
                assert torch.equal(host[name][b], caches[name][b]) == (b in copied)
    finally:
        worker.shutdown()
