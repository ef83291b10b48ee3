"""KvleaseConnector's Prometheus metrics (``vllm:kvlease_*``) through vLLM 0.33.0's own
``PrometheusStatLogger``: vLLM builds them with ``KvleaseConnector.build_prom_metrics``
(its ``KVConnectorProm``), a ``SchedulerStats`` carrying the connector's stats is recorded
as the engine core's frontend records it, and vLLM's registry (prometheus_client's
``REGISTRY``) is scraped: a hand-made interval (every series), then the stats vLLM's
real Schedulers return (workers played by the test). tests/worker/test_worker_prom.py
feeds them from engines whose workers move real bytes.
"""

from __future__ import annotations

import time

import pytest
from prometheus_client import REGISTRY, generate_latest
from sched_harness import create_vllm_config
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.stats import SchedulerStats

from kvlease.vllm import KvleaseConnectorStats, KvleasePromMetrics


def prom_logger(engine_indexes=(0,)) -> tuple[PrometheusStatLogger, str]:
    """vLLM's Prometheus logger of an engine running KvleaseConnector, and its model label."""
    config = create_vllm_config(
        kv_connector="KvleaseConnector",
        kv_connector_module_path="kvlease.vllm",
        kv_role="kv_both",
        engine_id="e0",
    )
    logger = PrometheusStatLogger(config, engine_indexes=list(engine_indexes))
    return logger, config.model_config.served_model_name


def sample(name: str, model: str, engine: int = 0, **labels) -> float | None:
    return REGISTRY.get_sample_value(
        name, {"model_name": model, "engine": str(engine), **labels}
    )


#: One interval's stats as vLLM's scheduler hands them over: the scheduler's counters and
#: the workers' (``KvleaseConnectorStats.data``, summed).
INTERVAL = {
    "leases_granted": 5,
    "leases_released_completed": 3,
    "leases_released_aborted": 1,
    "leases_released_expired": 2,
    "heartbeats_sent": 7,
    "leases_renewed": 6,
    "notifs_heartbeat": 6,
    "batches_posted": 4,
    "batches_done": 3,
    "batches_stale": 1,
    "bytes_read": 3072,
    "reads_done.tcp": 2,
    "reads_done.shm": 1,
    "reads_stale.tcp": 1,
    "read_bytes.tcp": 2048,
    "read_bytes.shm": 1024,
    "read_seconds.tcp": [0.004, 0.2],
    "read_seconds.shm": [0.0005],
    "handshakes_failed": 2,
    "handshakes_done": 1,
    "host_saves": 2,
    "host_blocks_saved": 9,
    "host_blocks_synced": 8,
}


def test_build_prom_metrics_is_kvleases():
    logger, _ = prom_logger()
    assert isinstance(logger.kv_connector_prom.prom_metrics, KvleasePromMetrics)


def test_every_series_is_scraped_with_vllms_engine_labels():
    logger, model = prom_logger(engine_indexes=(0, 1))
    stats = KvleaseConnectorStats(data=dict(INTERVAL))
    logger.record(SchedulerStats(kv_connector_stats=stats.to_dict()), None, engine_idx=0)

    def value(name, **labels):
        return sample(name, model, **labels)

    assert value("vllm:kvlease_leases_granted_total") == 5
    for reason, n in [("completed", 3), ("aborted", 1), ("expired", 2)]:
        assert value("vllm:kvlease_leases_released_total", reason=reason) == n
    assert value("vllm:kvlease_heartbeats_sent_total") == 7
    assert value("vllm:kvlease_heartbeat_renewals_total") == 6
    assert value("vllm:kvlease_reads_total", backend="tcp", status="done") == 2
    assert value("vllm:kvlease_reads_total", backend="tcp", status="stale") == 1
    assert value("vllm:kvlease_reads_total", backend="shm", status="done") == 1
    assert value("vllm:kvlease_read_bytes_total", backend="tcp") == 2048
    assert value("vllm:kvlease_read_bytes_total", backend="shm") == 1024
    assert value("vllm:kvlease_stale_reads_total") == 1
    assert value("vllm:kvlease_handshake_failures_total") == 2
    assert value("vllm:kvlease_host_buffer_blocks_total", direction="d2h") == 9
    assert value("vllm:kvlease_host_buffer_blocks_total", direction="h2d") == 8
    # The histogram: 4 ms and 200 ms over tcp, 0.5 ms over shm.
    assert value("vllm:kvlease_read_seconds_count", backend="tcp") == 2
    assert value("vllm:kvlease_read_seconds_sum", backend="tcp") == pytest.approx(0.204)
    assert value("vllm:kvlease_read_seconds_bucket", backend="tcp", le="0.005") == 1
    assert value("vllm:kvlease_read_seconds_bucket", backend="tcp", le="0.25") == 2
    assert value("vllm:kvlease_read_seconds_bucket", backend="shm", le="0.001") == 1

    # The other engine's series exist, at 0; nothing was recorded under its label.
    other = {"model_name": model, "engine": "1"}
    assert REGISTRY.get_sample_value("vllm:kvlease_leases_granted_total", other) == 0
    assert REGISTRY.get_sample_value(
        "vllm:kvlease_leases_released_total", {**other, "reason": "expired"}
    ) == 0
    assert REGISTRY.get_sample_value(
        "vllm:kvlease_reads_total", {**other, "backend": "tcp", "status": "done"}
    ) is None
    assert REGISTRY.get_sample_value(
        "vllm:kvlease_host_buffer_blocks_total", {**other, "direction": "h2d"}
    ) == 0

    # A second interval adds up; the text exposition names every family.
    logger.record(
        SchedulerStats(kv_connector_stats={"leases_granted": 1, "read_seconds.tcp": [0.01]}),
        None,
        engine_idx=0,
    )
    assert value("vllm:kvlease_leases_granted_total") == 6
    assert value("vllm:kvlease_read_seconds_count", backend="tcp") == 3
    text = generate_latest(REGISTRY).decode()
    for family in [
        "leases_granted", "leases_released", "heartbeats_sent", "heartbeat_renewals",
        "reads", "read_bytes", "stale_reads", "handshake_failures", "host_buffer_blocks",
    ]:
        assert f"# TYPE vllm:kvlease_{family}_total counter" in text or (
            f"# TYPE vllm:kvlease_{family} counter" in text
        ), family
    assert "# TYPE vllm:kvlease_read_seconds histogram" in text
    assert f'vllm:kvlease_leases_granted_total{{engine="0",model_name="{model}"}} 6.0' in text


def test_stats_aggregate_lists_and_log_their_mean():
    a = KvleaseConnectorStats(data={"bytes_read": 10, "read_seconds.tcp": [0.1]})
    b = KvleaseConnectorStats(data={"bytes_read": 5, "read_seconds.tcp": [0.3]})
    shared = b.data["read_seconds.tcp"]
    a.aggregate(b)
    assert a.data == {"bytes_read": 15, "read_seconds.tcp": [0.1, 0.3]}
    assert shared == [0.3], "aggregate changed the other payload's list"
    assert a.reduce() == {"bytes_read": 15, "read_seconds.tcp_mean": 0.2}
    assert not KvleaseConnectorStats(data={"read_seconds.tcp": []}).reduce()


def test_stats_of_real_schedulers_are_scraped():
    """vLLM's real Schedulers (tests/vllm's P and D, workers played by the test) return
    the connector's stats in their SchedulerStats; recorded by vLLM's logger they give
    P's grants and its releases by reason, and D's failed handshake."""
    import socket

    from sched_harness import create_model_runner_output, create_request
    from test_kvlease_scheduler import (
        D_WORKER,
        LEASE,
        kvlease_scheduler,
        request_from,
        worker_output,
    )
    from vllm.v1.request import RequestStatus

    p, p_clock = kvlease_scheduler("kv_producer", "p0")
    d, _ = kvlease_scheduler("kv_consumer", "d0")
    stats = {id(p): [], id(d): []}

    def run(engine, connector_output=None, output=True):
        sched_out = engine.schedule()
        scheduled = [engine.requests[r] for r in sched_out.num_scheduled_tokens]
        runner = create_model_runner_output(scheduled if output else [])
        if connector_output is not None:
            runner.kv_connector_output = connector_output
        finished = {}
        for eco in engine.update_from_output(sched_out, runner).values():
            if eco.scheduler_stats is not None:
                stats[id(engine)].append(eco.scheduler_stats)
            finished.update({o.request_id: o for o in eco.outputs if o.finish_reason})
        run.finished = finished
        return sched_out

    try:
        # P grants two leases.
        granted = []
        for _ in range(2):
            req = create_request(num_tokens=40, max_tokens=1,
                                 kv_transfer_params={"do_remote_decode": True})
            p.add_request(req)
            run(p)
            granted.append((req, run.finished[req.request_id].kv_transfer_params))
        (a, params), (b, _) = granted

        # D takes A, handshakes with P, then aborts it: P releases A (aborted).
        d_req = request_from(params, a)
        d.add_request(d_req)
        deadline = time.monotonic() + 30
        while d_req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            assert time.monotonic() < deadline, "D never finished its handshake with P"
            run(d, output=False)
            time.sleep(0.01)
        d.finish_requests([d_req.request_id], RequestStatus.FINISHED_ABORTED)
        sched_out = run(d, output=False)
        aborts = [m for e, kind, m in sched_out.kv_connector_metadata.transmits
                  if kind == "abort"]
        assert aborts
        run(p, worker_output(notifs=[(D_WORKER, m) for m in aborts]), output=False)

        # Nobody heartbeats B: the reaper releases it (expired).
        p_clock.advance(2 * LEASE)
        run(p, worker_output(), output=False)
        assert p.connector.scheduler.prefill.lease(b.request_id) is None

        # D is sent to a P whose side channel is gone: the handshake fails.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead_port = s.getsockname()[1]
        lost = create_request(num_tokens=40, max_tokens=1, kv_transfer_params={
            **params, "remote_engine_id": "p9", "remote_request_id": "p9-lease",
            "remote_port": dead_port})
        d.add_request(lost)
        deadline = time.monotonic() + 30
        while not d.connector.scheduler.decode.stats()["failed"]:
            assert time.monotonic() < deadline, "D's handshake with a dead P never failed"
            run(d)
            time.sleep(0.01)
        # The step whose scheduling pass sees the failure computes the prompt locally: this
        # one, or the next when the failure landed after this step's scheduling pass (the
        # handshake runs on its own thread).
        if lost.num_computed_tokens == 0:
            run(d)
        assert lost.num_computed_tokens == len(lost.prompt_token_ids)

        logger, model = prom_logger(engine_indexes=(0, 1))
        for index, engine in enumerate((p, d)):
            for s in stats[id(engine)]:
                logger.record(s, None, engine_idx=index)

        assert sample("vllm:kvlease_leases_granted_total", model, 0) == 2
        for reason, n in [("aborted", 1), ("expired", 1), ("completed", 0)]:
            assert sample("vllm:kvlease_leases_released_total", model, 0, reason=reason) == n
        assert sample("vllm:kvlease_handshake_failures_total", model, 1) == 1
        assert sample("vllm:kvlease_handshake_failures_total", model, 0) == 0
    finally:
        p.connector.shutdown()
        d.connector.shutdown()
