//! The TCP backend on real loopback sockets: byte-exact reads from several peers,
//! refusals, bad metadata, the public types and the advertised address.

mod common;

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use kvlease_gpu_mem::{
    BlockPool, DmaRegion, HostRegion, KvHalf, KvLayout, MemoryRequest, RegionBytes,
};
use kvlease_lease::BlockId;
use kvlease_transport::{
    Agent, AgentConfig, BatchStatus, ConnectError, LocalRange, ReadBatch, ReadOp, Refusal,
    RegionDesc, RegionId, TransferError,
};

use common::{
    LIMIT, Rng, agent, bytes_of, config, filled, frame, handshake_raw, one_read, raw, wait,
};

#[test]
fn random_reads_from_several_peers_are_byte_exact() -> Result<()> {
    let mut sources = Vec::new();
    for p in 0..3u64 {
        let a = agent(&format!("p{p}"));
        let regions: Vec<(Arc<HostRegion>, RegionDesc)> = (0..2u64)
            .map(|r| {
                let region = filled(1 << 20, p * 10 + r + 1);
                let desc = a.register(region.clone()).expect("registers");
                (region, desc)
            })
            .collect();
        sources.push((a, regions));
    }
    let mut c = config("d", None);
    c.limits.chunk_len = 64 * 1024; // exercise chunking and striping
    c.num_connections = 3;
    let d = Agent::new(c)?;
    let dst = Arc::new(HostRegion::new(8 << 20)?);
    let dst_id = RegionId(d.register(dst.clone())?.id);
    let peers: Vec<_> = sources
        .iter()
        .map(|(a, _)| d.connect(&a.metadata()))
        .collect::<Result<_, _>>()?;

    let mut rng = Rng(42);
    for _round in 0..4 {
        // Several batches in flight at once, to several peers, into disjoint destinations.
        let mut posted = Vec::new();
        let mut next_dst = 0u64;
        for _ in 0..6 {
            let p = rng.below(3) as usize;
            let mut ops = Vec::new();
            let mut expect = Vec::new();
            for _ in 0..1 + rng.below(12) {
                let (region, desc) = &sources[p].1[rng.below(2) as usize];
                let len = 1 + rng.below(200 * 1024);
                let offset = rng.below(desc.len - len + 1);
                if next_dst + len > dst.len() as u64 {
                    break;
                }
                ops.push(ReadOp {
                    local: LocalRange {
                        region: dst_id,
                        offset: next_dst,
                        len,
                    },
                    remote: desc.at(offset),
                });
                expect.push((next_dst, bytes_of(&**region, offset, len)));
                next_dst += len;
            }
            if ops.is_empty() {
                break;
            }
            let n = ops.len();
            let id = d.post_read(
                peers[p],
                ReadBatch {
                    ops,
                    notif: None,
                    fence: None,
                },
                LIMIT,
            )?;
            posted.push((id, n, expect));
        }
        for (id, n, expect) in posted {
            let BatchStatus::Done(stats) = wait(&d, id)? else {
                bail!("batch failed");
            };
            ensure!(stats.ops == n);
            ensure!(stats.bytes == expect.iter().map(|(_, b)| b.len() as u64).sum::<u64>());
            for (at, want) in expect {
                ensure!(
                    bytes_of(&*dst, at, want.len() as u64) == want,
                    "bytes differ at {at}"
                );
            }
        }
    }
    let served: u64 = sources.iter().map(|(a, _)| a.stats().reads_served).sum();
    ensure!(served > 0);
    Ok(())
}

#[test]
fn pool_head_ranges_read_across_agents() -> Result<()> {
    // A P rank with 4 heads; a D rank reads heads 2..4 of K and V of two blocks (the
    // heterogeneous-TP pattern) into its own pool of 2 heads.
    let p_layout = KvLayout::new(2, 8, 4, 16, 32, 2)?;
    let d_layout = KvLayout::new(2, 8, 2, 16, 32, 2)?;
    let p_pool = BlockPool::new(p_layout, MemoryRequest::Host)?;
    let mut rng = Rng(7);
    let src: Vec<u8> = (0..p_layout.total_bytes())
        .map(|_| rng.next() as u8)
        .collect();
    p_pool.region().write_from(0, &src)?;
    let d_pool = BlockPool::new(d_layout, MemoryRequest::Host)?;
    let p = agent("p-tp4");
    let d = agent("d-tp2");
    let desc = p.register(p_pool.region().clone())?;
    let dst = RegionId(d.register(d_pool.region().clone())?.id);
    let peer = d.connect(&p.metadata())?;
    let mut ops = Vec::new();
    let mut expect = Vec::new();
    for layer in 0..2 {
        for (pb, db) in [(BlockId(3), BlockId(0)), (BlockId(5), BlockId(1))] {
            for half in [KvHalf::K, KvHalf::V] {
                let from = p_layout.heads_range(layer, pb, half, 2..4)?;
                let to = d_layout.heads_range(layer, db, half, 0..2)?;
                ensure!(from.end - from.start == to.end - to.start);
                ops.push(ReadOp {
                    local: LocalRange {
                        region: dst,
                        offset: to.start,
                        len: to.end - to.start,
                    },
                    remote: desc.at(from.start),
                });
                expect.push((
                    to.start,
                    src[from.start as usize..from.end as usize].to_vec(),
                ));
            }
        }
    }
    let id = d.post_read(
        peer,
        ReadBatch {
            ops,
            notif: None,
            fence: None,
        },
        LIMIT,
    )?;
    ensure!(matches!(wait(&d, id)?, BatchStatus::Done(_)));
    for (at, want) in expect {
        ensure!(bytes_of(&**d_pool.region(), at, want.len() as u64) == want);
    }
    Ok(())
}

#[test]
fn wrong_key_out_of_bounds_and_unknown_region_are_refused() -> Result<()> {
    let p = agent("p");
    let d = agent("d");
    let region = filled(4096, 3);
    let desc = p.register(region.clone())?;
    let other = p.register(filled(4096, 4))?;
    let dst = Arc::new(HostRegion::new(8192)?);
    let dst_id = RegionId(d.register(dst.clone())?.id);
    let peer = d.connect(&p.metadata())?;
    let mut bad_key = desc.at(0);
    bad_key.key ^= 1;
    let mut unknown = desc.at(0);
    unknown.region = 999_999;
    let cases = [
        (bad_key, 16, Refusal::BadKey),
        (desc.at(4000), 200, Refusal::OutOfBounds),
        (desc.at(u64::MAX - 8), 8, Refusal::OutOfBounds),
        (unknown, 16, Refusal::UnknownRegion),
        // The key of another region does not open this one.
        (
            kvlease_transport::RemoteRange {
                key: other.key,
                ..desc.at(0)
            },
            16,
            Refusal::BadKey,
        ),
    ];
    for (remote, len, want) in cases {
        let id = d.post_read(peer, one_read(dst_id, len, remote), LIMIT)?;
        match wait(&d, id)? {
            BatchStatus::Failed(TransferError::Refused { peer, reason, .. }) => {
                ensure!(peer == "p");
                ensure!(reason == want, "{reason:?} != {want:?}");
            }
            other => bail!("expected a refusal, got {other:?}"),
        }
    }
    ensure!(
        bytes_of(&*dst, 0, 8192) == vec![0; 8192],
        "nothing was written"
    );
    ensure!(p.stats().reads_refused == 5);
    ensure!(p.stats().reads_served == 0);
    // The connection is still good.
    let id = d.post_read(peer, one_read(dst_id, 4096, desc.at(0)), LIMIT)?;
    ensure!(matches!(wait(&d, id)?, BatchStatus::Done(_)));
    ensure!(bytes_of(&*dst, 0, 4096) == bytes_of(&*region, 0, 4096));
    // After deregistration the region is gone.
    p.deregister(RegionId(desc.id))?;
    let id = d.post_read(peer, one_read(dst_id, 16, desc.at(0)), LIMIT)?;
    ensure!(matches!(
        wait(&d, id)?,
        BatchStatus::Failed(TransferError::Refused {
            reason: Refusal::UnknownRegion,
            ..
        })
    ));
    // Local ranges are checked before anything is sent.
    let err = d
        .post_read(peer, one_read(dst_id, 8193, desc.at(0)), LIMIT)
        .expect_err("destination too long");
    ensure!(matches!(err, TransferError::Local { .. }), "{err:?}");
    Ok(())
}

#[test]
fn bad_metadata_and_unknown_ids_are_errors() -> Result<()> {
    let d = agent("d");
    ensure!(matches!(
        d.connect(b"not json"),
        Err(ConnectError::Metadata(_))
    ));
    let p = agent("p");
    let mut meta: serde_json::Value = serde_json::from_slice(&p.metadata())?;
    meta["name"] = "somebody-else".into();
    let err = d
        .connect(&serde_json::to_vec(&meta)?)
        .expect_err("name mismatch");
    ensure!(matches!(err, ConnectError::Handshake { .. }), "{err}");
    let desc = p.register(filled(16, 1))?;
    let peer = d.connect(&p.metadata())?;
    let dst = RegionId(d.register(Arc::new(HostRegion::new(16)?))?.id);
    let id = d.post_read(peer, one_read(dst, 16, desc.at(0)), LIMIT)?;
    ensure!(matches!(wait(&d, id)?, BatchStatus::Done(_)));
    ensure!(
        matches!(d.poll_batch(id), Err(TransferError::UnknownBatch(_))),
        "reported once"
    );
    d.disconnect(peer)?;
    ensure!(matches!(
        d.post_read(peer, one_read(dst, 16, desc.at(0)), LIMIT),
        Err(TransferError::UnknownPeer(_))
    ));
    Ok(())
}

/// The public types cross threads (like tokio's `tests/async_send_sync.rs`); the verbs
/// types are checked in `src/verbs/tests.rs`.
#[test]
fn public_types_are_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Agent>();
    send_sync::<AgentConfig>();
    send_sync::<kvlease_transport::AgentMetadata>();
    send_sync::<ReadBatch>();
    send_sync::<BatchStatus>();
    send_sync::<kvlease_transport::BatchStats>();
    send_sync::<kvlease_transport::TransportStats>();
    send_sync::<kvlease_transport::AgentError>();
    send_sync::<ConnectError>();
    send_sync::<kvlease_transport::RegisterError>();
    send_sync::<kvlease_transport::MetadataError>();
    send_sync::<TransferError>();
    send_sync::<kvlease_transport::LinkError>();
    send_sync::<kvlease_transport::Backend>();
}

#[test]
fn backend_names() {
    use kvlease_transport::Backend;
    assert_eq!(Backend::Verbs.as_str(), "verbs");
    assert_eq!(Backend::Tcp.to_string(), "tcp");
}

/// An agent listening everywhere advertises the address it is told, with the port it
/// bound when the advertised port is 0 (what `--advertise-host` passes); a peer connects
/// through it.
#[test]
fn advertised_ip_with_port_zero_keeps_the_bound_port() {
    let mut c = config("adv", None);
    c.listen = "0.0.0.0:0".parse().expect("literal");
    c.advertise = Some("127.0.0.2:0".parse().expect("literal"));
    let p = Agent::new(c).expect("binds");
    let md = kvlease_transport::metadata::decode_metadata(&p.metadata()).expect("metadata");
    let addr: std::net::SocketAddr = md.tcp_addr.parse().expect("a socket address");
    assert_eq!(addr.ip(), std::net::IpAddr::from([127, 0, 0, 2]));
    assert_ne!(addr.port(), 0, "the bound port, not 0");
    let d = agent("adv-d");
    d.connect(&p.metadata())
        .expect("connects through the advertised address");
}

#[test]
fn one_poll_takes_what_the_inbox_holds_and_the_rest_waits_in_the_socket() -> Result<()> {
    let mut c = config("p", None);
    c.limits.max_notif_len = 1000;
    c.limits.max_pending_notif_bytes = 4000;
    c.limits.max_pending_notifs = 3;
    let p = Agent::new(c)?;
    // Two senders (so that P asks epoll which connections are ready), ten notifications
    // each: no poll may return more than the inbox holds (3 in count, 4000 bytes), and
    // none is dropped: the rest waits on the notification connections.
    let (d, e) = (agent("d"), agent("e"));
    let (to_p_from_d, to_p_from_e) = (d.connect(&p.metadata())?, e.connect(&p.metadata())?);
    let sent: Vec<Vec<u8>> = (0..10u8)
        .map(|i| vec![i; if i % 2 == 0 { 1000 } else { 10 }])
        .collect();
    for m in &sent {
        d.send_notif(to_p_from_d, m.clone())?;
        e.send_notif(to_p_from_e, m.clone())?;
    }
    let start = Instant::now();
    let (mut from_d, mut from_e) = (Vec::new(), Vec::new());
    while from_d.len() + from_e.len() < 2 * sent.len() && start.elapsed() < LIMIT {
        let polled = p.get_new_notifs();
        let count: usize = polled.iter().map(|(_, m)| m.len()).sum();
        let bytes: usize = polled.iter().flat_map(|(_, m)| m).map(Vec::len).sum();
        ensure!(count <= 3, "one poll returned {count} notifications");
        ensure!(bytes <= 4000, "one poll returned {bytes} bytes");
        for (from, msgs) in polled {
            match from.as_str() {
                "d" => from_d.extend(msgs),
                "e" => from_e.extend(msgs),
                other => bail!("from {other}"),
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    ensure!(from_d == sent && from_e == sent, "in order, none lost");
    ensure!(p.stats().notifs_dropped_overflow == 0, "{:?}", p.stats());
    ensure!(p.stats().notifs_received == 20, "{:?}", p.stats());

    // A data connection (an older peer's, here a raw one) is read by its serving thread:
    // there the inbox bounds hold by dropping and counting.
    let mut s = raw(&p)?;
    handshake_raw(&mut s, "old", 0)?;
    for i in 0..10u8 {
        s.write_all(&frame(8, &[i; 1000]))?;
    }
    let deadline = Instant::now() + LIMIT;
    while p.stats().notifs_received + p.stats().notifs_dropped_overflow < 30
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(2));
    }
    let stats = p.stats_handle().stats();
    ensure!(
        stats.notifs_received == 23 && stats.notifs_dropped_overflow == 7,
        "{stats:?}"
    );
    let got = p.get_new_notifs();
    ensure!(
        got.len() == 1 && got[0].1 == (0..3u8).map(|i| vec![i; 1000]).collect::<Vec<_>>(),
        "{got:?}"
    );
    // A bound below one notification is refused at build time.
    let mut c = config("bad", None);
    c.limits.max_notif_len = 1000;
    c.limits.max_pending_notif_bytes = 999;
    ensure!(Agent::new(c).is_err());
    let mut c = config("bad", None);
    c.limits.max_queued_notif_bytes = 0;
    ensure!(Agent::new(c).is_err());
    Ok(())
}
