//! RDMA tests on real verbs devices: in CI, two SoftRoCE (rxe) devices inside one qemu
//! guest (`scripts/softroce/test.sh`): rxeP on vP 10.77.2.1 (the prefill side, P, whose
//! memory is read) and rxeD on vD 10.77.2.2 (the decode side, D, which reads).
//!
//! Every test that needs the devices is `#[ignore]`d, so a plain `cargo test` lists it as
//! ignored instead of passing having done nothing; the harness runs the binary with
//! `--include-ignored`. Run explicitly, such a test fails where a device is missing.
//! `auto_falls_back_to_tcp_when_one_side_has_no_device` runs everywhere (on a host
//! without RDMA it checks the no-device fallback); with `KVLEASE_REQUIRE_RDMA=1` (set by
//! the harness) it fails instead of taking that branch when the devices do not open.
//! Devices: `KV_TEST_RDMA_DEV` / `KV_TEST_RDMA_PEER_DEV` (default rxeP / rxeD), their
//! addresses `KV_TEST_RDMA_ADDR` / `KV_TEST_RDMA_PEER_ADDR` (optional: pick the GID).
#![cfg(feature = "verbs")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use kvlease_gpu_mem::{DmaRegion, HostRegion, RegionBytes};
use kvlease_transport::verbs::{
    Device, DeviceConfig, Endpoint, EndpointBatchStatus, EndpointConfig, EndpointState,
    MemoryRegion, ProtectionDomain, RdmaRead, RemoteRegion, VerbsError, WorkCompletionStatus,
};
use kvlease_transport::{Backend, BatchId};

const TIMEOUT: Duration = Duration::from_secs(60);

fn required() -> bool {
    std::env::var("KVLEASE_REQUIRE_RDMA").is_ok_and(|v| v == "1")
}

fn config(dev_var: &str, addr_var: &str, default: &str) -> DeviceConfig {
    let name = std::env::var(dev_var).unwrap_or_else(|_| default.to_owned());
    let mut c = DeviceConfig::named(name);
    if let Some(a) = std::env::var(addr_var).ok().and_then(|a| a.parse().ok()) {
        c = c.with_ipv4(a);
    }
    c
}

/// Opens P's and D's devices.
fn try_devices() -> Result<(Device, Device), VerbsError> {
    let p = Device::open(&config("KV_TEST_RDMA_DEV", "KV_TEST_RDMA_ADDR", "rxeP"))?;
    let d = Device::open(&config(
        "KV_TEST_RDMA_PEER_DEV",
        "KV_TEST_RDMA_PEER_ADDR",
        "rxeD",
    ))?;
    Ok((p, d))
}

/// Opens P's and D's devices for a test that needs them (an `#[ignore]`d one).
///
/// # Panics
/// Where a device does not open, naming the test and why.
fn devices(test: &str) -> (Device, Device) {
    try_devices().unwrap_or_else(|e| panic!("{test} needs RDMA devices (rxeP/rxeD): {e}"))
}

/// Both sides of one connection.
struct Pair {
    p_pd: ProtectionDomain,
    d_pd: ProtectionDomain,
    p: Endpoint,
    d: Endpoint,
}

impl Pair {
    fn new(p_dev: &Device, d_dev: &Device, cfg: EndpointConfig) -> Result<Self> {
        let p_pd = p_dev.alloc_pd()?;
        let d_pd = d_dev.alloc_pd()?;
        let mut p = Endpoint::new(&p_pd, cfg.clone())?;
        let mut d = Endpoint::new(&d_pd, cfg)?;
        // The side channel: here a byte copy; in the agent, its TCP handshake.
        let (pi, di) = (p.local_info().encode(), d.local_info().encode());
        p.connect(&kvlease_transport::verbs::ConnectionInfo::decode(&di)?)?;
        d.connect(&kvlease_transport::verbs::ConnectionInfo::decode(&pi)?)?;
        ensure!(p.state() == EndpointState::Connected && d.state() == EndpointState::Connected);
        ensure!(d.query_qp_state()? == "RTS", "D's QP is not in RTS");
        Ok(Self { p_pd, d_pd, p, d })
    }

    fn poll(&mut self) -> Result<()> {
        self.p.poll()?;
        self.d.poll()?;
        Ok(())
    }

    /// Polls both sides until D's batch is final.
    fn wait(&mut self, id: BatchId) -> Result<EndpointBatchStatus> {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            self.poll()?;
            match self.d.poll_batch(id) {
                Some(EndpointBatchStatus::Pending) => {}
                Some(s) => return Ok(s),
                None => bail!("batch {id:?} unknown"),
            }
            ensure!(
                Instant::now() < deadline,
                "batch {id:?} still pending after {TIMEOUT:?}"
            );
        }
    }

    /// Polls both sides until `who` (true = P) received `n` notifications.
    fn notifs(&mut self, p_side: bool, n: usize) -> Result<Vec<Vec<u8>>> {
        let deadline = Instant::now() + TIMEOUT;
        let mut got = Vec::new();
        while got.len() < n {
            self.poll()?;
            got.extend(if p_side {
                self.p.take_notifs()
            } else {
                self.d.take_notifs()
            });
            ensure!(
                Instant::now() < deadline,
                "{} of {n} notifications after {TIMEOUT:?}",
                got.len()
            );
        }
        Ok(got)
    }
}

fn region(pd: &ProtectionDomain, len: usize, seed: u64) -> Result<(Arc<HostRegion>, MemoryRegion)> {
    let r = Arc::new(HostRegion::new(len)?);
    if seed != 0 {
        r.write_from(0, &pattern(len, seed))?;
    }
    let mr = pd.register(Arc::clone(&r) as Arc<dyn DmaRegion>)?;
    Ok((r, mr))
}

/// Deterministic bytes (xorshift) so every byte of a read can be checked.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

fn bytes(r: &HostRegion, offset: u64, len: usize) -> Result<Vec<u8>> {
    let mut v = vec![0u8; len];
    r.read_into(offset, &mut v)?;
    Ok(v)
}

#[test]
#[ignore = "needs RDMA devices rxeP/rxeD: scripts/softroce/test.sh runs it"]
fn multi_mb_read_batch_is_byte_exact() -> Result<()> {
    let (p_dev, d_dev) = devices("multi_mb_read_batch_is_byte_exact");
    let mut pair = Pair::new(&p_dev, &d_dev, EndpointConfig::default())?;
    const SRC: usize = 24 << 20;
    let (src, src_mr) = region(&pair.p_pd, SRC, 0x5eed)?;
    let (dst, dst_mr) = region(&pair.d_pd, SRC, 0)?;
    let remote = src_mr.remote();
    // 64 blocks of 256 KiB scattered (block i of P lands at a permuted slot on D) plus one
    // 4 MiB read that the endpoint splits into several work requests.
    const BLOCK: u64 = 256 << 10;
    let mut ops = Vec::new();
    for i in 0..64u64 {
        let j = (i * 37) % 64;
        ops.push(RdmaRead {
            local: dst_mr.clone(),
            local_offset: j * BLOCK,
            remote,
            remote_offset: i * BLOCK,
            len: BLOCK,
        });
    }
    let big = 4u64 << 20;
    ops.push(RdmaRead {
        local: dst_mr.clone(),
        local_offset: 16 << 20,
        remote,
        remote_offset: 20 << 20,
        len: big,
    });
    let t = Instant::now();
    let id = pair.d.post_read_batch(&ops, None, None)?;
    // The destination handle may go: the in-flight table keeps the MR alive.
    drop(ops);
    drop(dst_mr);
    let status = pair.wait(id)?;
    let secs = t.elapsed().as_secs_f64();
    ensure!(
        matches!(status, EndpointBatchStatus::Done),
        "batch: {status:?}"
    );
    let want = bytes(&src, 0, SRC)?;
    let got = bytes(&dst, 0, SRC)?;
    for i in 0..64usize {
        let j = (i * 37) % 64;
        let b = BLOCK as usize;
        ensure!(
            got[j * b..(j + 1) * b] == want[i * b..(i + 1) * b],
            "block {i} differs"
        );
    }
    ensure!(
        got[16 << 20..20 << 20] == want[20 << 20..24 << 20],
        "4 MiB read differs"
    );
    println!(
        "read 20 MiB rxeP <- rxeD in {secs:.2} s ({:.1} MB/s)",
        20.0 * 1.048_576 / secs
    );
    Ok(())
}

#[test]
#[ignore = "needs RDMA devices rxeP/rxeD: scripts/softroce/test.sh runs it"]
fn notifications_flow_both_ways_in_order() -> Result<()> {
    let (p_dev, d_dev) = devices("notifications_flow_both_ways_in_order");
    let cfg = EndpointConfig {
        notif_slot_size: 256,
        recv_slots: 8,
        ..EndpointConfig::default()
    };
    let mut pair = Pair::new(&p_dev, &d_dev, cfg)?;
    // More messages than receive slots: the ring is re-posted as it drains.
    let msgs: Vec<Vec<u8>> = (0..40)
        .map(|i| format!("HB:req-{i}").into_bytes())
        .collect();
    for m in &msgs {
        pair.d.send_notif(m)?;
    }
    let got = pair.notifs(true, msgs.len())?;
    ensure!(got == msgs, "D -> P out of order or changed: {got:?}");
    let back: Vec<Vec<u8>> = (0..20).map(|i| vec![i as u8; 1 + i * 12]).collect();
    for m in &back {
        pair.p.send_notif(m)?;
    }
    let got = pair.notifs(false, back.len())?;
    ensure!(got == back, "P -> D differs");
    // A full slot is fine; one byte more is refused, not truncated.
    pair.d.send_notif(&[7u8; 256])?;
    ensure!(pair.notifs(true, 1)? == vec![vec![7u8; 256]]);
    match pair.d.send_notif(&[7u8; 257]) {
        Err(VerbsError::NotifTooLarge {
            len: 257,
            limit: 256,
        }) => {}
        other => bail!("oversized notification: {other:?}"),
    }
    // A batch's notification reaches P once the batch is done.
    let (_src, src_mr) = region(&pair.p_pd, 1 << 20, 9)?;
    let (_dst, dst_mr) = region(&pair.d_pd, 1 << 20, 0)?;
    let op = RdmaRead {
        local: dst_mr,
        local_offset: 0,
        remote: src_mr.remote(),
        remote_offset: 0,
        len: 1 << 20,
    };
    let id = pair
        .d
        .post_read_batch(&[op], None, Some(b"done:1".to_vec()))?;
    ensure!(matches!(pair.wait(id)?, EndpointBatchStatus::Done));
    ensure!(pair.notifs(true, 1)? == vec![b"done:1".to_vec()]);
    Ok(())
}

#[test]
#[ignore = "needs RDMA devices rxeP/rxeD: scripts/softroce/test.sh runs it"]
fn many_batches_through_a_small_window_complete_byte_exact() -> Result<()> {
    let (p_dev, d_dev) = devices("many_batches_through_a_small_window_complete_byte_exact");
    // A window of 8 reads, chains of 4, and a signalling interval longer than any chain:
    // queued reads wait for whole chains, and batches that share a chain are reported
    // through their own last work request.
    let cfg = EndpointConfig {
        max_outstanding_reads: 8,
        wrs_per_doorbell: 4,
        signal_every: 64,
        ..EndpointConfig::default()
    };
    let mut pair = Pair::new(&p_dev, &d_dev, cfg)?;
    const BLOCK: u64 = 16 << 10;
    const BLOCKS: u64 = 64;
    let (src, src_mr) = region(&pair.p_pd, (BLOCK * BLOCKS) as usize, 0xc4a1)?;
    let (dst, dst_mr) = region(&pair.d_pd, (BLOCK * BLOCKS) as usize, 0)?;
    let mut next = 0u64;
    let mut ids = Vec::new();
    // Batches of 1..=7 reads (block i of P lands at slot BLOCKS-1-i on D), 15 batches,
    // 57 reads, all posted before any is polled.
    for b in 0..15u64 {
        let n = 1 + (b * 3) % 7;
        let n = n.min(BLOCKS - next);
        let ops: Vec<RdmaRead> = (next..next + n)
            .map(|i| RdmaRead {
                local: dst_mr.clone(),
                local_offset: (BLOCKS - 1 - i) * BLOCK,
                remote: src_mr.remote(),
                remote_offset: i * BLOCK,
                len: BLOCK,
            })
            .collect();
        next += n;
        ids.push(
            pair.d
                .post_read_batch(&ops, None, Some(format!("b{b}").into_bytes()))?,
        );
    }
    for id in &ids {
        let status = pair.wait(*id)?;
        ensure!(
            matches!(status, EndpointBatchStatus::Done),
            "batch {id:?}: {status:?}"
        );
    }
    let want = bytes(&src, 0, (BLOCK * BLOCKS) as usize)?;
    let got = bytes(&dst, 0, (BLOCK * BLOCKS) as usize)?;
    let b = BLOCK as usize;
    for i in 0..next as usize {
        let j = BLOCKS as usize - 1 - i;
        ensure!(
            got[j * b..(j + 1) * b] == want[i * b..(i + 1) * b],
            "block {i} differs"
        );
    }
    let notifs = pair.notifs(true, ids.len())?;
    let expect: Vec<Vec<u8>> = (0..ids.len())
        .map(|b| format!("b{b}").into_bytes())
        .collect();
    ensure!(notifs == expect, "batch notifications: {notifs:?}");
    Ok(())
}

#[test]
#[ignore = "needs RDMA devices rxeP/rxeD: scripts/softroce/test.sh runs it"]
fn fenced_read_sees_the_generation_after_the_data() -> Result<()> {
    let (p_dev, d_dev) = devices("fenced_read_sees_the_generation_after_the_data");
    let mut pair = Pair::new(&p_dev, &d_dev, EndpointConfig::default())?;
    let (src, src_mr) = region(&pair.p_pd, 4 << 20, 77)?;
    let (fences, fence_mr) = region(&pair.p_pd, 4096, 0)?;
    let (dst, dst_mr) = region(&pair.d_pd, 4 << 20, 0)?;
    let (word, word_mr) = region(&pair.d_pd, 4096, 0)?;
    let slot = 8 * 5;
    for generation in [41u64, 42] {
        fences.store_u64(slot, generation)?;
        let data = RdmaRead {
            local: dst_mr.clone(),
            local_offset: 0,
            remote: src_mr.remote(),
            remote_offset: 0,
            len: 4 << 20,
        };
        let fence = RdmaRead {
            local: word_mr.clone(),
            local_offset: 0,
            remote: fence_mr.remote(),
            remote_offset: slot,
            len: 8,
        };
        let id = pair.d.post_read_batch(&[data], Some(&fence), None)?;
        ensure!(matches!(pair.wait(id)?, EndpointBatchStatus::Done));
        ensure!(word.load_u64(0)? == generation, "fence word");
        ensure!(bytes(&dst, 0, 4 << 20)? == bytes(&src, 0, 4 << 20)?, "data");
    }
    // A fence that does not fit one work request is refused up front.
    let too_big = RdmaRead {
        local: dst_mr,
        local_offset: 0,
        remote: src_mr.remote(),
        remote_offset: 0,
        len: 4 << 20,
    };
    ensure!(pair.d.post_read_batch(&[], Some(&too_big), None).is_err());
    Ok(())
}

#[test]
#[ignore = "needs RDMA devices rxeP/rxeD: scripts/softroce/test.sh runs it"]
fn wrong_rkey_fails_only_its_batch_and_the_qp_recovers() -> Result<()> {
    let (p_dev, d_dev) = devices("wrong_rkey_fails_only_its_batch_and_the_qp_recovers");
    let mut pair = Pair::new(&p_dev, &d_dev, EndpointConfig::default())?;
    let (src, src_mr) = region(&pair.p_pd, 8 << 20, 3)?;
    let (dst, dst_mr) = region(&pair.d_pd, 8 << 20, 0)?;
    let read = |off: u64, len: u64, remote: RemoteRegion| RdmaRead {
        local: dst_mr.clone(),
        local_offset: off,
        remote,
        remote_offset: off,
        len,
    };
    let good = src_mr.remote();
    let id = pair
        .d
        .post_read_batch(&[read(0, 1 << 20, good)], None, None)?;
    ensure!(matches!(pair.wait(id)?, EndpointBatchStatus::Done));

    let bad = RemoteRegion::new(good.addr(), good.len(), good.rkey() ^ 0x5a5a);
    let bad_id = pair
        .d
        .post_read_batch(&[read(1 << 20, 1 << 20, bad)], None, None)?;
    match pair.wait(bad_id)? {
        EndpointBatchStatus::Failed(VerbsError::WorkRequest {
            op: "READ", status, ..
        }) => {
            ensure!(
                status.code() == WorkCompletionStatus::REM_ACCESS_ERR,
                "status {status}"
            );
            println!("bad rkey failed as expected: {status}");
        }
        other => bail!("bad rkey batch: {other:?}"),
    }
    ensure!(
        pair.d.state() == EndpointState::NeedsReconnect,
        "D state {:?}",
        pair.d.state()
    );
    ensure!(pair.d.errors() == 1);
    // Posted while the QP is down: waits for the reconnect instead of failing.
    let waiting = pair
        .d
        .post_read_batch(&[read(2 << 20, 2 << 20, good)], None, None)?;
    pair.d.send_notif(b"after-reconnect")?;
    // P's QP went to ERR as well (its receives flush); poll it into its reset.
    let deadline = Instant::now() + TIMEOUT;
    while pair.p.state() == EndpointState::Connected {
        pair.p.poll()?;
        ensure!(Instant::now() < deadline, "P never noticed the QP error");
    }
    // The reconnect handshake over the side channel: new PSNs both ways.
    let d_info = pair.d.reset()?;
    let p_info = pair.p.reset()?;
    pair.p.connect(&d_info)?;
    pair.d.connect(&p_info)?;
    ensure!(pair.d.query_qp_state()? == "RTS");
    ensure!(
        matches!(pair.wait(waiting)?, EndpointBatchStatus::Done),
        "batch posted while down"
    );
    let next = pair
        .d
        .post_read_batch(&[read(4 << 20, 4 << 20, good)], None, None)?;
    ensure!(
        matches!(pair.wait(next)?, EndpointBatchStatus::Done),
        "batch after recovery"
    );
    ensure!(
        bytes(&dst, 2 << 20, 6 << 20)? == bytes(&src, 2 << 20, 6 << 20)?,
        "data after recovery"
    );
    ensure!(
        bytes(&dst, 1 << 20, 1 << 20)? == vec![0u8; 1 << 20],
        "failed batch wrote data"
    );
    ensure!(pair.notifs(true, 1)? == vec![b"after-reconnect".to_vec()]);
    Ok(())
}

#[test]
#[ignore = "needs RDMA devices rxeP/rxeD: scripts/softroce/test.sh runs it"]
fn out_of_bounds_and_foreign_regions_are_refused_before_posting() -> Result<()> {
    let (p_dev, d_dev) = devices("out_of_bounds_and_foreign_regions_are_refused");
    let mut pair = Pair::new(&p_dev, &d_dev, EndpointConfig::default())?;
    let (_src, src_mr) = region(&pair.p_pd, 1 << 20, 1)?;
    let (_dst, dst_mr) = region(&pair.d_pd, 1 << 20, 0)?;
    let op = |local: MemoryRegion, lo: u64, ro: u64, len: u64| RdmaRead {
        local,
        local_offset: lo,
        remote: src_mr.remote(),
        remote_offset: ro,
        len,
    };
    for (o, side) in [
        (op(dst_mr.clone(), 1 << 20, 0, 1), "local"),
        (op(dst_mr.clone(), u64::MAX, 0, 2), "local"),
        (op(dst_mr.clone(), 0, (1 << 20) - 4, 8), "remote"),
        (op(dst_mr, 0, u64::MAX, 8), "remote"),
    ] {
        match pair.d.post_read_batch(&[o], None, None) {
            Err(VerbsError::OutOfBounds { side: s, .. }) if s == side => {}
            other => bail!("{side}: {other:?}"),
        }
    }
    // A destination registered on P's PD is not D's memory.
    match pair
        .d
        .post_read_batch(&[op(src_mr.clone(), 0, 0, 8)], None, None)
    {
        Err(VerbsError::ForeignRegion) => {}
        other => bail!("foreign region: {other:?}"),
    }
    ensure!(pair.d.state() == EndpointState::Connected);
    pair.poll().context("poll after refusals")?;
    Ok(())
}

// ----- through the Agent (backend selection) -----

#[path = "rxe/agent.rs"]
mod agent;
#[path = "rxe/stall.rs"]
mod stall;
#[path = "rxe/write.rs"]
mod write;

// ----- side channel authentication -----

/// One frame of the verbs side channel (`[type u8][len u32 LE][body]`).
fn side_frame(ty: u8, body: &[u8]) -> Vec<u8> {
    let mut f = vec![ty];
    f.extend_from_slice(&u32::try_from(body.len()).unwrap_or(u32::MAX).to_le_bytes());
    f.extend_from_slice(body);
    f
}

fn read_side_frame(s: &mut std::net::TcpStream) -> Result<(u8, Vec<u8>)> {
    use std::io::Read;
    let mut h = [0u8; 5];
    s.read_exact(&mut h)?;
    let mut body = vec![0u8; u32::from_le_bytes([h[1], h[2], h[3], h[4]]) as usize];
    s.read_exact(&mut body)?;
    Ok((h[0], body))
}

/// A client's run of the verbs side channel's exchange against `addr` (P's agent `p`),
/// proving `token` over `proved` and sending `sent` as its queue-pair info. Whether P
/// accepted the proof and proved itself over both infos.
fn verbs_exchange(
    addr: std::net::SocketAddr,
    token: Option<&[u8]>,
    proved: &[u8],
    sent: &[u8],
) -> Result<bool> {
    use std::io::Write;

    use kvlease_proto::auth::{AuthResult, ClientAuth, VERBS_ROLES};
    const HELLO: u8 = 1;
    const CHALLENGE: u8 = 2;
    const PROOF: u8 = 3;
    const AUTH_RESULT: u8 = 4;
    const VERBS_INFO: u8 = 15;
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let client = ClientAuth::new(VERBS_ROLES, 0, [7; 32], "intruder/d0", token, Some("p"))
        .with_binding(proved);
    s.write_all(
        &[
            side_frame(HELLO, &client.hello()),
            side_frame(VERBS_INFO, sent),
        ]
        .concat(),
    )?;
    let (ty, challenge) = read_side_frame(&mut s)?;
    anyhow::ensure!(ty == CHALLENGE, "no challenge: frame {ty}");
    let (proved_client, proof) = client.on_challenge(&challenge)?;
    s.write_all(&side_frame(PROOF, &proof))?;
    let (ty, result) = read_side_frame(&mut s)?;
    anyhow::ensure!(ty == AUTH_RESULT, "frame {ty}");
    if !AuthResult::decode(&result)?.ok {
        // Refused: nothing follows, no queue pair.
        let mut rest = Vec::new();
        let _ = std::io::Read::read_to_end(&mut s, &mut rest);
        anyhow::ensure!(rest.is_empty(), "P sent more after refusing: {rest:?}");
        return Ok(false);
    }
    let (ty, theirs) = read_side_frame(&mut s)?;
    anyhow::ensure!(ty == VERBS_INFO, "frame {ty}");
    anyhow::ensure!(
        proved_client.on_result_bound(&result, &theirs).is_ok(),
        "P's proof does not cover its info"
    );
    Ok(true)
}

/// With a cluster token on both agents the link is verbs (the side channel's proofs
/// pass). P gives no queue pair to a peer without the token, nor to one whose proof
/// covers another queue-pair info than the one it sends (its info swapped on the way,
/// or a proof replayed with other info): the exchange binds both names and both infos.
/// A peer that proves its own info gets P's, with P's proof over both.
#[test]
#[ignore = "needs RDMA devices rxeP/rxeD: scripts/softroce/test.sh runs it"]
fn verbs_side_channel_requires_the_cluster_token() -> Result<()> {
    use std::net::{IpAddr, Ipv4Addr, SocketAddr};

    use kvlease_transport::verbs::{Endpoint, EndpointConfig};
    use kvlease_transport::{Agent, AgentConfig, BackendChoice};

    let (_p_dev, d_dev) = devices("verbs_side_channel_requires_the_cluster_token");
    let ip = |var: &str, d: [u8; 4]| -> IpAddr {
        std::env::var(var)
            .ok()
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| IpAddr::V4(Ipv4Addr::from(d)))
    };
    let agent = |name: &str, addr: IpAddr| -> Result<Agent> {
        let mut c = AgentConfig::new(name);
        c.listen = SocketAddr::new(addr, 0);
        c.backend = BackendChoice::Verbs;
        c.auth_token = Some(b"rxe-test-token".to_vec());
        Ok(Agent::new(c)?)
    };
    let p = agent("p", ip("KV_TEST_RDMA_ADDR", [10, 77, 2, 1]))?;
    let d = agent("d", ip("KV_TEST_RDMA_PEER_ADDR", [10, 77, 2, 2]))?;
    let peer = d.connect(&off_host(&p))?;
    let (backend, why) = d.peer_backend(peer).context("peer is connected")?;
    anyhow::ensure!(backend == Backend::Verbs, "backend {backend}: {why}");

    let meta = kvlease_transport::metadata::decode_metadata(&p.metadata())?;
    let addr: SocketAddr = meta.backends["verbs"]["addr"]
        .as_str()
        .context("verbs addr")?
        .parse()?;
    let pd = d_dev.alloc_pd()?;
    let ep = Endpoint::new(&pd, EndpointConfig::default())?;
    let info = ep.local_info().encode();
    let other = Endpoint::new(&pd, EndpointConfig::default())?
        .local_info()
        .encode();
    anyhow::ensure!(info != other, "two endpoints, two infos");
    let token = Some(&b"rxe-test-token"[..]);
    anyhow::ensure!(
        !verbs_exchange(addr, None, &info, &info)?,
        "a peer without the token got a queue pair"
    );
    anyhow::ensure!(
        !verbs_exchange(addr, Some(&b"another token"[..]), &info, &info)?,
        "a peer with another token got a queue pair"
    );
    anyhow::ensure!(
        !verbs_exchange(addr, token, &info, &other)?,
        "a peer whose info is not the one it proved got a queue pair"
    );
    anyhow::ensure!(
        verbs_exchange(addr, token, &info, &info)?,
        "a peer that proved its own info got no queue pair"
    );
    // D checks P's name too: a P whose verbs side channel serves another agent is refused.
    let impostor = agent("someone-else", ip("KV_TEST_RDMA_ADDR", [10, 77, 2, 1]))?;
    let mut forged: serde_json::Value = serde_json::from_slice(&off_host(&p))?;
    let theirs: serde_json::Value = serde_json::from_slice(&impostor.metadata())?;
    forged["backends"]["verbs"] = theirs["backends"]["verbs"].clone();
    let strict = {
        let mut c = AgentConfig::new("d-strict");
        c.listen = SocketAddr::new(ip("KV_TEST_RDMA_PEER_ADDR", [10, 77, 2, 2]), 0);
        c.backend = BackendChoice::Verbs;
        c.auth_token = Some(b"rxe-test-token".to_vec());
        Agent::new(c)?
    };
    let err = strict
        .connect(&serde_json::to_vec(&forged)?)
        .expect_err("a verbs side channel of another agent");
    let chain = format!("{err:?}");
    anyhow::ensure!(chain.contains("WrongPeer"), "{chain}");
    println!("refused: {err}");
    Ok(())
}

// ----- memory verbs cannot register -----

/// Memory that is not host memory and has no dmabuf path (here the staged test kind,
/// which stands for CUDA device memory without dmabuf support) is refused by verbs
/// registration with a reason that names the kind and the TCP path peers take instead.
#[test]
#[ignore = "needs RDMA devices rxeP/rxeD: scripts/softroce/test.sh runs it"]
fn device_memory_without_dmabuf_is_refused_with_the_reason() -> Result<()> {
    let (p_dev, _) = devices("device_memory_without_dmabuf_is_refused_with_the_reason");
    let pd = p_dev.alloc_pd()?;
    let staged = Arc::new(kvlease_gpu_mem::StagedHostRegion::new(1 << 20)?);
    match pd.register(staged as Arc<dyn DmaRegion>) {
        Err(e @ VerbsError::UnsupportedMemory { .. }) => {
            let msg = e.to_string();
            ensure!(msg.contains("staged-host"), "{msg}");
            ensure!(msg.contains("mirror"), "{msg}");
            println!("refused: {msg}");
        }
        other => bail!("staged memory registered with verbs: {other:?}"),
    }
    // Host memory on the same PD is registered directly, not through dmabuf.
    let (_r, mr) = region(&pd, 4096, 0)?;
    ensure!(!mr.is_dmabuf());
    Ok(())
}

/// Reads `len` bytes at 0 of `src` into `dst` (D's region ids) with a fence on P's word 8
/// expecting `expected`: the backend that moved the batch, or None when it failed.
fn agent_read(
    d: &kvlease_transport::Agent,
    peer: kvlease_transport::PeerId,
    dst: u64,
    src: &kvlease_transport::RegionDesc,
    fence: &kvlease_transport::RegionDesc,
    len: usize,
    expected: u64,
) -> Result<Option<Backend>> {
    use kvlease_transport::{BatchStatus, FenceRead, LocalRange, ReadBatch, ReadOp, RegionId};
    let batch = ReadBatch {
        ops: vec![ReadOp {
            local: LocalRange {
                region: RegionId(dst),
                offset: 0,
                len: len as u64,
            },
            remote: src.at(0),
        }],
        notif: None,
        fence: Some(FenceRead {
            remote: fence.at(8),
            expected,
        }),
    };
    let id = d.post_read(peer, batch, TIMEOUT)?;
    let deadline = Instant::now() + TIMEOUT;
    loop {
        match d.poll_batch(id)? {
            BatchStatus::Done(s) => {
                ensure!(s.fence_word == Some(expected));
                return Ok(Some(s.backend));
            }
            BatchStatus::Failed(e) => {
                println!("batch failed: {e}");
                return Ok(None);
            }
            _ => {}
        }
        ensure!(Instant::now() < deadline, "batch still pending");
    }
}

/// On a verbs link, memory verbs cannot register itself (staged host memory, which
/// stands for CUDA device memory without dmabuf) is served through registered host
/// mirrors: P's staged source after `sync_for_peers`, D's staged destination copied out
/// of its mirror before the batch is done. Every src/dst mix moves over verbs (RDMA
/// READ, not the link's TCP) and is byte-exact as read back through the staging copy; a
/// changed fence generation fails a mirrored batch.
#[test]
#[ignore = "needs RDMA devices rxeP/rxeD: scripts/softroce/test.sh runs it"]
fn staged_memory_moves_over_verbs_through_host_mirrors() -> Result<()> {
    use kvlease_gpu_mem::{StagedHostRegion, staging};
    use kvlease_transport::{BackendChoice, RegionId};

    devices("staged_memory_moves_over_verbs_through_host_mirrors");
    let (p, d) = agent::pair(BackendChoice::Verbs)?;
    const LEN: usize = 3 << 20;
    let data = pattern(LEN, 29);
    let staged_src = Arc::new(StagedHostRegion::new(LEN)?);
    staging::write_region(staged_src.as_ref(), 0, &data)?;
    let host_src = Arc::new(HostRegion::new(LEN)?);
    host_src.write_from(0, &data)?;
    let fences = Arc::new(HostRegion::new(4096)?);
    fences.store_u64(8, 5)?;
    let staged_src_d = p.register(Arc::clone(&staged_src) as Arc<dyn DmaRegion>)?;
    let host_src_d = p.register(Arc::clone(&host_src) as Arc<dyn DmaRegion>)?;
    let fence_d = p.register(Arc::clone(&fences) as Arc<dyn DmaRegion>)?;
    ensure!(
        p.is_mirrored(RegionId(staged_src_d.id)),
        "staged source not mirrored"
    );
    ensure!(
        !p.is_mirrored(RegionId(host_src_d.id)),
        "host source mirrored"
    );
    ensure!(!p.is_mirrored(RegionId(fence_d.id)), "fence words mirrored");
    // Written before registration: the mirror gets it through the sync only.
    p.sync_for_peers(RegionId(staged_src_d.id), 0, LEN as u64)?;
    let staged_dst = Arc::new(StagedHostRegion::new(LEN)?);
    let host_dst = Arc::new(HostRegion::new(LEN)?);
    let staged_dst_d = d.register(Arc::clone(&staged_dst) as Arc<dyn DmaRegion>)?;
    let host_dst_d = d.register(Arc::clone(&host_dst) as Arc<dyn DmaRegion>)?;
    ensure!(
        d.is_mirrored(RegionId(staged_dst_d.id)),
        "staged destination not mirrored"
    );
    let peer = d.connect(&off_host(&p))?;
    let (backend, why) = d.peer_backend(peer).context("peer is connected")?;
    ensure!(backend == Backend::Verbs, "backend {backend}: {why}");

    // Each destination as D reads it back (staged memory through the staging copy).
    let dst_bytes = |staged: bool| -> Result<Vec<u8>> {
        let mut v = vec![0u8; LEN];
        if staged {
            staging::read_region(staged_dst.as_ref(), 0, &mut v)?;
        } else {
            host_dst.read_into(0, &mut v)?;
        }
        Ok(v)
    };
    let zero = vec![0u8; LEN];
    // (destination staged, source staged)
    for (dst_staged, src_staged) in [(false, true), (true, false), (true, true), (false, false)] {
        let label = format!("staged dst {dst_staged}, staged src {src_staged}");
        staging::write_region(staged_dst.as_ref(), 0, &zero)?;
        host_dst.write_from(0, &zero)?;
        let dst = if dst_staged {
            &staged_dst_d
        } else {
            &host_dst_d
        };
        let src = if src_staged {
            &staged_src_d
        } else {
            &host_src_d
        };
        let moved = agent_read(&d, peer, dst.id, src, &fence_d, LEN, 5)?;
        ensure!(
            moved == Some(Backend::Verbs),
            "{label}: moved by {moved:?}, not verbs"
        );
        ensure!(dst_bytes(dst_staged)? == data, "{label}: bytes differ");
    }
    // A changed generation fails a mirrored batch, and its bytes are not copied out of
    // the mirror into the staged destination.
    staging::write_region(staged_dst.as_ref(), 0, &zero)?;
    fences.store_u64(8, 6)?;
    ensure!(
        agent_read(&d, peer, staged_dst_d.id, &staged_src_d, &fence_d, LEN, 5)?.is_none(),
        "stale fence accepted on a mirrored source"
    );
    ensure!(
        dst_bytes(true)? == zero,
        "a failed batch was copied into its destination"
    );
    ensure!(
        agent_read(&d, peer, staged_dst_d.id, &staged_src_d, &fence_d, LEN, 6)?
            == Some(Backend::Verbs),
        "the current generation is refused"
    );
    ensure!(
        dst_bytes(true)? == data,
        "bytes differ after the fence change"
    );
    // Out-of-range and unknown syncs are errors, not panics.
    ensure!(
        p.sync_for_peers(RegionId(staged_src_d.id), 1, LEN as u64)
            .is_err()
    );
    ensure!(p.sync_for_peers(RegionId(u64::MAX), 0, 1).is_err());
    // Syncing host memory is a no-op that checks the range.
    p.sync_for_peers(RegionId(host_src_d.id), 0, LEN as u64)?;
    Ok(())
}

/// The mirror contract: bytes written into a mirrored region reach verbs peers only after
/// `sync_for_peers` of their range. Before it, a verbs read returns the mirror's old bytes
/// (the mirror is real memory, not an alias of the region); a TCP peer reads the region
/// itself and sees the new bytes at once. Syncing a sub-range updates only that range.
#[test]
#[ignore = "needs RDMA devices rxeP/rxeD: scripts/softroce/test.sh runs it"]
fn verbs_peers_see_a_mirrored_write_only_after_sync_for_peers() -> Result<()> {
    use kvlease_gpu_mem::{StagedHostRegion, staging};
    use kvlease_transport::{BackendChoice, RegionId};

    devices("verbs_peers_see_a_mirrored_write_only_after_sync_for_peers");
    let (p, d) = agent::pair(BackendChoice::Verbs)?;
    let d_tcp = agent::agent("d-tcp", agent::d_addr(), BackendChoice::Tcp)?;
    const LEN: usize = 1 << 20;
    let old = pattern(LEN, 41);
    let new = pattern(LEN, 42);
    let src = Arc::new(StagedHostRegion::new(LEN)?);
    staging::write_region(src.as_ref(), 0, &old)?;
    let fences = Arc::new(HostRegion::new(4096)?);
    fences.store_u64(8, 1)?;
    let src_d = p.register(Arc::clone(&src) as Arc<dyn DmaRegion>)?;
    let fence_d = p.register(Arc::clone(&fences) as Arc<dyn DmaRegion>)?;
    let id = RegionId(src_d.id);
    p.sync_for_peers(id, 0, LEN as u64)?;
    let dst = Arc::new(HostRegion::new(LEN)?);
    let dst_d = d.register(Arc::clone(&dst) as Arc<dyn DmaRegion>)?;
    let tcp_dst = Arc::new(HostRegion::new(LEN)?);
    let tcp_dst_d = d_tcp.register(Arc::clone(&tcp_dst) as Arc<dyn DmaRegion>)?;
    let peer = d.connect(&off_host(&p))?;
    let tcp_peer = d_tcp.connect(&off_host(&p))?;
    ensure!(
        d.peer_backend(peer)
            .is_some_and(|(b, _)| b == Backend::Verbs)
    );
    ensure!(
        d_tcp
            .peer_backend(tcp_peer)
            .is_some_and(|(b, _)| b == Backend::Tcp)
    );

    let via_verbs = || -> Result<Vec<u8>> {
        let moved = agent_read(&d, peer, dst_d.id, &src_d, &fence_d, LEN, 1)?;
        ensure!(moved == Some(Backend::Verbs), "moved by {moved:?}");
        bytes(&dst, 0, LEN)
    };
    let via_tcp = || -> Result<Vec<u8>> {
        let moved = agent_read(&d_tcp, tcp_peer, tcp_dst_d.id, &src_d, &fence_d, LEN, 1)?;
        ensure!(moved == Some(Backend::Tcp), "moved by {moved:?}");
        bytes(&tcp_dst, 0, LEN)
    };
    ensure!(via_verbs()? == old, "first read");
    staging::write_region(src.as_ref(), 0, &new)?;
    ensure!(
        via_verbs()? == old,
        "verbs saw the write before sync_for_peers"
    );
    ensure!(via_tcp()? == new, "TCP did not read the region itself");
    // Half the range synced: the other half stays old.
    let half = LEN / 2;
    p.sync_for_peers(id, 0, half as u64)?;
    let got = via_verbs()?;
    ensure!(got[..half] == new[..half], "synced half differs");
    ensure!(got[half..] == old[half..], "unsynced half changed");
    p.sync_for_peers(id, half as u64, (LEN - half) as u64)?;
    ensure!(via_verbs()? == new, "after the full sync");
    Ok(())
}

/// `p`'s metadata as a peer on another host sees it: without the shared-memory entry, so
/// that agents in one process (one host) pick verbs or TCP as across hosts.
fn off_host(p: &kvlease_transport::Agent) -> Vec<u8> {
    let mut meta: serde_json::Value =
        serde_json::from_slice(&p.metadata()).expect("an agent's metadata is JSON");
    if let Some(backends) = meta["backends"].as_object_mut() {
        backends.remove("shm");
    }
    serde_json::to_vec(&meta).expect("JSON values serialise")
}
