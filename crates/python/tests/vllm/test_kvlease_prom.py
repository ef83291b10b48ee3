"""KvleaseConnector's Prometheus metrics (``vllm:kvlease_*``) through vLLM 0.33.0's own
``PrometheusStatLogger``: vLLM builds them with ``KvleaseConnector.build_prom_metrics``
(its ``KVConnectorProm``), a ``SchedulerStats`` carrying the connector's stats is recorded
as the engine core's frontend records it, and vLLM's registry (prometheus_client's
``REGISTRY``) is scraped. tests/worker/test_worker_prom.py feeds them from real engines.
"""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY, generate_latest
from sched_harness import create_vllm_config
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.stats import SchedulerStats

from kvlease.vllm import KvleaseConnectorStats, KvleasePromMetrics
from kvlease.vllm.stats import READ_SECONDS_BUCKETS


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
    # The histogram: 4 ms and 200 ms over tcp, 0.5 ms over shm.
    assert value("vllm:kvlease_read_seconds_count", backend="tcp") == 2
    assert value("vllm:kvlease_read_seconds_sum", backend="tcp") == pytest.approx(0.204)
    assert value("vllm:kvlease_read_seconds_bucket", backend="tcp", le="0.005") == 1
    assert value("vllm:kvlease_read_seconds_bucket", backend="tcp", le="0.25") == 2
    assert value("vllm:kvlease_read_seconds_bucket", backend="shm", le="0.001") == 1
    assert READ_SECONDS_BUCKETS[0] == 0.001

    # The other engine's series exist, at 0; nothing was recorded under its label.
    other = {"model_name": model, "engine": "1"}
    assert REGISTRY.get_sample_value("vllm:kvlease_leases_granted_total", other) == 0
    assert REGISTRY.get_sample_value(
        "vllm:kvlease_leases_released_total", {**other, "reason": "expired"}
    ) == 0
    assert REGISTRY.get_sample_value(
        "vllm:kvlease_reads_total", {**other, "backend": "tcp", "status": "done"}
    ) is None

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
        "reads", "read_bytes", "stale_reads", "handshake_failures",
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
