"""``vllm:kvlease_*`` fed by real engines: P and D (vLLM's Scheduler here, the connector's
worker half in its own process, KV read over TCP) run a lease from grant through
heartbeats and the read to its release; every ``SchedulerStats`` their steps returned
(the scheduler's and the workers' connector stats, as vLLM aggregates them) is recorded
by vLLM's own ``PrometheusStatLogger`` (P as engine 0, D as engine 1), and vLLM's registry
is scraped."""

from __future__ import annotations

import sched_harness
from engines import LAYERS
from prometheus_client import REGISTRY
from test_kvlease_worker import d_request, pd, prefill, run_until  # noqa: F401 (pd: fixture)
from vllm.v1.metrics.loggers import PrometheusStatLogger


def test_a_lease_between_real_engines_is_scraped_from_vllms_registry(pd):
    lease = 3.0  # heartbeat interval 0.5 s
    p, d = pd(lease)
    p_req, params = prefill(p)
    table = p.connector.scheduler.prefill

    # D runs a local request first: the remote one waits while D's worker heartbeats.
    local = sched_harness.create_request(num_tokens=16, max_tokens=1000)
    d.add_request(local)
    d.step()
    req = d_request(params, p_req)
    d.add_request(req)
    granted_at = table.lease(p_req.request_id)["granted_at"]
    # A heartbeat renews (extends) the lease once now + 2/3 lease passes its first expiry.
    run_until(lambda: table.lease(p_req.request_id)["expiry"] > granted_at + lease, [d, p],
              30, "a heartbeat renewing P's lease")
    d.step(sample_eos=True)
    run_until(lambda: req.request_id in d.outputs, [d, p], 60, "D's load and decode")
    run_until(lambda: table.lease(p_req.request_id) is None, [p, d], 30, "P's release")

    logger = PrometheusStatLogger(p.vllm_config, engine_indexes=[0, 1])
    for index, engine in enumerate((p, d)):
        assert engine.stats, f"{engine.name}'s steps returned no SchedulerStats"
        for stats in engine.stats:
            logger.record(stats, None, engine_idx=index)
    model = p.vllm_config.model_config.served_model_name

    def value(name, engine, **labels):
        return REGISTRY.get_sample_value(
            name, {"model_name": model, "engine": str(engine), **labels}
        )

    # P (engine 0): one lease, renewed by D's heartbeats, released when D's read completed.
    assert value("vllm:kvlease_leases_granted_total", 0) == 1
    assert value("vllm:kvlease_leases_released_total", 0, reason="completed") == 1
    assert value("vllm:kvlease_leases_released_total", 0, reason="expired") == 0
    assert value("vllm:kvlease_leases_released_total", 0, reason="aborted") == 0
    renewals = value("vllm:kvlease_heartbeat_renewals_total", 0)
    # D (engine 1): the heartbeats, one read batch over TCP of P's 3 blocks in every layer.
    sent = value("vllm:kvlease_heartbeats_sent_total", 1)
    assert 1 <= renewals <= sent
    pages = p.worker.request("blocks", block_ids=list(params["remote_block_ids"]))
    expected_bytes = sum(len(page) for layer in LAYERS for page in pages[layer])
    assert value("vllm:kvlease_reads_total", 1, backend="tcp", status="done") == 1
    assert value("vllm:kvlease_read_bytes_total", 1, backend="tcp") == expected_bytes
    assert value("vllm:kvlease_read_seconds_count", 1, backend="tcp") == 1
    assert 0 < value("vllm:kvlease_read_seconds_sum", 1, backend="tcp") < 60
    assert value("vllm:kvlease_stale_reads_total", 1) == 0
    assert value("vllm:kvlease_handshake_failures_total", 1) == 0
    # Each side's metrics come from its own stats only.
    assert value("vllm:kvlease_leases_granted_total", 1) == 0
    assert value("vllm:kvlease_reads_total", 0, backend="tcp", status="done") is None
