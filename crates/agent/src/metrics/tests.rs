use super::*;

/// `(exposed sample name, TYPE line name, type)` for every name the agents must expose.
const REQUIRED: [(&str, &str, &str); 15] = [
    ("kvlease_blocks_total", "kvlease_blocks_total", "gauge"),
    ("kvlease_blocks_held", "kvlease_blocks_held", "gauge"),
    ("kvlease_leases_active", "kvlease_leases_active", "gauge"),
    (
        "kvlease_leases_granted_total",
        "kvlease_leases_granted",
        "counter",
    ),
    (
        "kvlease_leases_released_total{reason=\"completed\"}",
        "kvlease_leases_released",
        "counter",
    ),
    (
        "kvlease_heartbeats_sent_total",
        "kvlease_heartbeats_sent",
        "counter",
    ),
    (
        "kvlease_heartbeats_received_total",
        "kvlease_heartbeats_received",
        "counter",
    ),
    (
        "kvlease_heartbeat_unknown_ids_total",
        "kvlease_heartbeat_unknown_ids",
        "counter",
    ),
    (
        "kvlease_lease_extensions_total",
        "kvlease_lease_extensions",
        "counter",
    ),
    (
        "kvlease_stale_reads_total",
        "kvlease_stale_reads",
        "counter",
    ),
    (
        "kvlease_transfer_bytes_total",
        "kvlease_transfer_bytes",
        "counter",
    ),
    (
        "kvlease_requests_total{outcome=\"ok\"}",
        "kvlease_requests",
        "counter",
    ),
    (
        "kvlease_notif_malformed_total",
        "kvlease_notif_malformed",
        "counter",
    ),
    (
        "kvlease_lease_reclaim_seconds_bucket{le=\"0.001\"}",
        "kvlease_lease_reclaim_seconds",
        "histogram",
    ),
    (
        "kvlease_lease_reclaim_seconds_count",
        "kvlease_lease_reclaim_seconds",
        "histogram",
    ),
];

fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| {
            line.strip_prefix(name)
                .and_then(|rest| rest.strip_prefix(' '))
        })
        .and_then(|v| v.trim().parse().ok())
}

#[test]
fn every_required_name_is_exposed_with_its_type() {
    let text = Metrics::new().encode();
    for (sample_name, type_name, kind) in REQUIRED {
        assert_eq!(
            sample(&text, sample_name),
            Some(0.0),
            "{sample_name} missing or non-zero in:\n{text}"
        );
        assert!(
            text.contains(&format!("# TYPE {type_name} {kind}\n")),
            "# TYPE {type_name} {kind} missing"
        );
    }
    for reason in ["completed", "expired", "aborted"] {
        let name = format!("kvlease_leases_released_total{{reason=\"{reason}\"}}");
        assert_eq!(sample(&text, &name), Some(0.0), "{name}");
    }
    assert!(
        !text.contains("_total_total"),
        "a counter registered with its suffix:\n{text}"
    );
    assert!(text.ends_with("# EOF\n"));
}

#[test]
fn limit_counters_are_exposed_and_transport_drops_are_summed() {
    let metrics = Metrics::new();
    let text = metrics.encode();
    for name in [
        "kvlease_notifs_dropped_total",
        "kvlease_notifs_refused_total",
        "kvlease_side_channel_refused_total",
        "kvlease_http_connections_refused_total",
        "kvlease_verbs_stall_resets_total",
    ] {
        assert_eq!(sample(&text, name), Some(0.0), "{name} in:\n{text}");
    }
    let endpoint = |name: &str| {
        let mut config = kvlease_transport::AgentConfig::new(name);
        config.backend = kvlease_transport::BackendChoice::Tcp;
        config.limits.max_notif_len = 100;
        config.limits.max_pending_notif_bytes = 100;
        kvlease_transport::Agent::new(config).expect("loopback endpoint")
    };
    let (p, d) = (endpoint("p"), endpoint("d"));
    metrics.watch_transport(p.stats_handle());
    metrics.watch_transport(d.stats_handle());
    // A link's notification connection leaves what the inbox cannot hold in the
    // socket; notifications are dropped only when they arrive on a data connection
    // (a peer older than the notification connection, spoken by hand here).
    use std::io::{Read, Write};
    let frame = |ty: u8, body: &[u8]| {
        let mut v = vec![ty];
        v.extend_from_slice(&(body.len() as u32).to_le_bytes());
        v.extend_from_slice(body);
        v
    };
    let read_frame = |s: &mut std::net::TcpStream| {
        let mut h = [0u8; 5];
        s.read_exact(&mut h).expect("frame header");
        let mut body = vec![0; u32::from_le_bytes([h[1], h[2], h[3], h[4]]) as usize];
        s.read_exact(&mut body).expect("frame body");
        (h[0], body)
    };
    let mut s = std::net::TcpStream::connect(p.local_addr()).expect("connect");
    // HELLO: version 1, data connection 0, a nonce, the name.
    let mut hello = vec![1, 0, 0, 0];
    hello.extend_from_slice(&[9; 32]);
    hello.extend_from_slice(&3u16.to_le_bytes());
    hello.extend_from_slice(b"old");
    s.write_all(&frame(1, &hello)).expect("HELLO");
    assert_eq!(read_frame(&mut s).0, 2, "CHALLENGE");
    s.write_all(&frame(3, &[0])).expect("PROOF");
    assert_eq!(read_frame(&mut s), (4, vec![1, 0]), "AUTH_RESULT ok");
    for _ in 0..3 {
        s.write_all(&frame(8, &[0; 100])).expect("NOTIF");
    }
    // One fits the inbox; the other two are dropped.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while p.stats().notifs_dropped_overflow < 2 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    assert_eq!(
        sample(&metrics.encode(), "kvlease_notifs_dropped_total"),
        Some(2.0)
    );
}

#[test]
fn clones_share_values_and_encode_shows_them() {
    let metrics = Metrics::new();
    let clone = metrics.clone();
    clone.leases_granted.inc_by(3);
    clone.blocks_total.set(512);
    clone.blocks_held.set(7);
    clone.lease_released(ReleaseReason::Expired).inc();
    clone.request(RequestOutcome::KvLoadFailed).inc_by(2);
    clone.transfer_bytes.inc_by(1 << 20);
    clone.read_bytes(Backend::Cma).inc_by(4096);
    clone.lease_reclaim_seconds.observe(4.5);
    clone.set_peer_backend("p-0", Backend::Tcp);
    let text = metrics.encode();
    assert_eq!(sample(&text, "kvlease_leases_granted_total"), Some(3.0));
    assert_eq!(sample(&text, "kvlease_blocks_total"), Some(512.0));
    assert_eq!(sample(&text, "kvlease_blocks_held"), Some(7.0));
    assert_eq!(
        sample(&text, "kvlease_leases_released_total{reason=\"expired\"}"),
        Some(1.0)
    );
    assert_eq!(
        sample(&text, "kvlease_leases_released_total{reason=\"completed\"}"),
        Some(0.0)
    );
    assert_eq!(
        sample(&text, "kvlease_requests_total{outcome=\"kv_load_failed\"}"),
        Some(2.0)
    );
    assert_eq!(
        sample(&text, "kvlease_transfer_bytes_total"),
        Some(1_048_576.0)
    );
    assert_eq!(
        sample(&text, "kvlease_read_bytes_total{backend=\"cma\"}"),
        Some(4096.0)
    );
    assert_eq!(
        sample(&text, "kvlease_read_bytes_total{backend=\"tcp\"}"),
        Some(0.0)
    );
    assert_eq!(
        sample(&text, "kvlease_lease_reclaim_seconds_count"),
        Some(1.0)
    );
    assert_eq!(
        sample(&text, "kvlease_lease_reclaim_seconds_sum"),
        Some(4.5)
    );
    assert_eq!(
        sample(&text, "kvlease_lease_reclaim_seconds_bucket{le=\"4.096\"}"),
        Some(0.0)
    );
    assert_eq!(
        sample(&text, "kvlease_lease_reclaim_seconds_bucket{le=\"8.192\"}"),
        Some(1.0)
    );
    assert_eq!(
        sample(&text, "kvlease_peer_backend{peer=\"p-0\",backend=\"tcp\"}"),
        Some(1.0)
    );
    metrics.set_peer_backend("p-0", Backend::Verbs);
    let text = metrics.encode();
    assert_eq!(
        sample(&text, "kvlease_peer_backend{peer=\"p-0\",backend=\"tcp\"}"),
        None
    );
    assert_eq!(
        sample(
            &text,
            "kvlease_peer_backend{peer=\"p-0\",backend=\"verbs\"}"
        ),
        Some(1.0)
    );
    metrics.remove_peer("p-0");
    assert!(!metrics.encode().contains("peer=\"p-0\""));
}
