"""The harness itself, on a toy connector: vLLM's real Scheduler drives an out-of-tree
connector loaded by module path, on CPU, with no model download."""

from sched_harness import (
    assert_scheduler_empty,
    create_request,
    create_scheduler,
    create_vllm_config,
    step,
)
from vllm.v1.request import RequestStatus


def toy_scheduler(role: str):
    config = create_vllm_config(
        kv_connector="ToyConnector",
        kv_connector_module_path="toy_connector",
        kv_role=role,
    )
    return create_scheduler(config, num_blocks=64)


def test_p_side_request_keeps_blocks_until_sent():
    scheduler = toy_scheduler("kv_producer")
    req = create_request(num_tokens=40, max_tokens=1,
                         kv_transfer_params={"do_remote_decode": True})
    scheduler.add_request(req)
    connector = scheduler.connector
    assert ("on_new_request", req.request_id) in connector.calls

    _, engine_out = step(scheduler)
    # Prefill of 40 tokens at 64 per step finishes in one step; max_tokens=1 ends it.
    outputs = engine_out[0].outputs
    assert [o.request_id for o in outputs] == [req.request_id]
    params = outputs[0].kv_transfer_params
    assert params["do_remote_prefill"] is True
    assert len(params["remote_block_ids"]) == 3  # ceil(40 / 16)
    # The connector owns the blocks: they stay allocated until the worker says sent.
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.free_block_queue.num_free_blocks == 64 - 1 - 3

    step(scheduler, output_for=[], finished_sending={req.request_id})
    assert_scheduler_empty(scheduler)


def test_d_side_request_waits_for_remote_kvs_then_runs():
    scheduler = toy_scheduler("kv_consumer")
    req = create_request(num_tokens=40, max_tokens=2,
                         kv_transfer_params={"do_remote_prefill": True})
    scheduler.add_request(req)

    sched_out, _ = step(scheduler, output_for=[])
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert not sched_out.num_scheduled_tokens
    loads = sched_out.kv_connector_metadata.loads
    assert list(loads) == [req.request_id] and len(loads[req.request_id]) == 3

    # Still waiting while nothing is reported.
    step(scheduler, output_for=[])
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    # The worker reports the load; the next step schedules only the last prompt token.
    step(scheduler, output_for=[], finished_recving={req.request_id})
    sched_out, _ = step(scheduler)
    assert sched_out.num_scheduled_tokens == {req.request_id: 1}
    step(scheduler, use_eos=True)
    step(scheduler, output_for=[])  # the step after a finish forgets its id
    assert_scheduler_empty(scheduler)
