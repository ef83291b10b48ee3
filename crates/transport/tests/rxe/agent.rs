//! RDMA tests through the `Agent` (backend selection): a module of the `rxe` test binary
//! (`tests/rxe.rs`), so its tests keep their `agent::` names.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use kvlease_gpu_mem::{DmaRegion, HostRegion, RegionBytes};
use kvlease_transport::Backend;
use kvlease_transport::{
    Agent, AgentConfig, BackendChoice, BatchStatus, ConnectError, FenceRead, LocalRange, ReadBatch,
    ReadOp, RegionId,
};

pub(super) fn addr(var: &str, default: [u8; 4]) -> IpAddr {
    std::env::var(var)
        .ok()
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| IpAddr::V4(Ipv4Addr::from(default)))
}

pub(super) fn agent(name: &str, ip: IpAddr, backend: BackendChoice) -> Result<Agent> {
    let mut c = AgentConfig::new(name);
    c.listen = SocketAddr::new(ip, 0);
    c.backend = backend;
    Ok(Agent::new(c)?)
}

/// D's address (on rxeD's side of the pair).
/// An error and its causes, joined with ": ".
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        out = format!("{out}: {c}");
        cause = c.source();
    }
    out
}

pub(super) fn d_addr() -> IpAddr {
    addr("KV_TEST_RDMA_PEER_ADDR", [10, 77, 2, 2])
}

/// P (on rxeP's address) and D (on rxeD's), both asking for `backend`.
pub(super) fn pair(backend: BackendChoice) -> Result<(Agent, Agent)> {
    let p = agent("p", addr("KV_TEST_RDMA_ADDR", [10, 77, 2, 1]), backend)?;
    let d = agent("d", d_addr(), backend)?;
    Ok((p, d))
}

/// Polls `id` until it is no longer pending (60 s at most).
pub(super) fn wait(d: &Agent, id: kvlease_transport::BatchId) -> Result<BatchStatus> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match d.poll_batch(id)? {
            BatchStatus::Pending => {}
            s => return Ok(s),
        }
        ensure!(Instant::now() < deadline, "batch still pending");
    }
}

/// D reads 8 MiB from P with a fence and a notification through whichever backend
/// the agents picked; every byte is checked.
fn read_through(p: &Agent, d: &Agent) -> Result<()> {
    let src = Arc::new(HostRegion::new(8 << 20)?);
    src.write_from(0, &super::pattern(8 << 20, 11))?;
    let fences = Arc::new(HostRegion::new(4096)?);
    fences.store_u64(16, 7)?;
    let src_desc = p.register(Arc::clone(&src) as Arc<dyn DmaRegion>)?;
    let fence_desc = p.register(Arc::clone(&fences) as Arc<dyn DmaRegion>)?;
    let dst = Arc::new(HostRegion::new(8 << 20)?);
    let dst_desc = d.register(Arc::clone(&dst) as Arc<dyn DmaRegion>)?;
    let peer = d.connect(&crate::off_host(p))?;
    // The batch notification travels on D's connection to P.
    let batch = ReadBatch {
        ops: vec![ReadOp {
            local: LocalRange {
                region: RegionId(dst_desc.id),
                offset: 0,
                len: 8 << 20,
            },
            remote: src_desc.at(0),
        }],
        notif: Some(b"read-done".to_vec()),
        fence: Some(FenceRead {
            remote: fence_desc.at(16),
            expected: 7,
        }),
    };
    let id = d.post_read(peer, batch, Duration::from_secs(60))?;
    match wait(d, id)? {
        BatchStatus::Done(stats) => ensure!(stats.fence_word == Some(7)),
        other => bail!("batch: {other:?}"),
    }
    ensure!(super::bytes(&dst, 0, 8 << 20)? == super::bytes(&src, 0, 8 << 20)?);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let n = p.get_new_notifs();
        if n.iter().any(|(_, m)| m.iter().any(|m| m == b"read-done")) {
            break;
        }
        ensure!(Instant::now() < deadline, "notification never arrived");
        std::thread::sleep(Duration::from_millis(5));
    }
    // A stale generation fails the batch, over either backend.
    let stale = ReadBatch {
        ops: vec![ReadOp {
            local: LocalRange {
                region: RegionId(dst_desc.id),
                offset: 0,
                len: 4096,
            },
            remote: src_desc.at(0),
        }],
        notif: None,
        fence: Some(FenceRead {
            remote: fence_desc.at(16),
            expected: 6,
        }),
    };
    let id = d.post_read(peer, stale, Duration::from_secs(60))?;
    ensure!(
        matches!(wait(d, id)?, BatchStatus::Failed(_)),
        "stale fence accepted"
    );
    Ok(())
}

#[test]
#[ignore = "needs RDMA devices rxeP/rxeD: scripts/softroce/test.sh runs it"]
fn auto_uses_verbs_when_both_sides_have_a_device() -> Result<()> {
    super::devices("auto_uses_verbs_when_both_sides_have_a_device");
    let (p, d) = pair(BackendChoice::Auto)?;
    read_through(&p, &d)?;
    let peer = d.connect(&crate::off_host(&p))?;
    let (backend, why) = d.peer_backend(peer).context("peer is connected")?;
    ensure!(backend == Backend::Verbs, "backend {backend}: {why}");
    Ok(())
}

/// Runs everywhere: on a host without RDMA, D itself has no device; in the VM, P
/// runs TCP-only (its metadata has no verbs entry, as on a host without a device).
#[test]
fn auto_falls_back_to_tcp_when_one_side_has_no_device() -> Result<()> {
    let rdma = match super::try_devices() {
        Ok(_) => true,
        Err(e) => {
            ensure!(!super::required(), "KVLEASE_REQUIRE_RDMA=1 but: {e}");
            println!("no RDMA devices here ({e}): checking the no-device fallback");
            false
        }
    };
    let (pip, dip) = if rdma {
        (
            addr("KV_TEST_RDMA_ADDR", [10, 77, 2, 1]),
            addr("KV_TEST_RDMA_PEER_ADDR", [10, 77, 2, 2]),
        )
    } else {
        (
            IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V4(Ipv4Addr::LOCALHOST),
        )
    };
    let p_choice = if rdma {
        BackendChoice::Tcp
    } else {
        BackendChoice::Auto
    };
    let p = agent("p", pip, p_choice)?;
    let d = agent("d", dip, BackendChoice::Auto)?;
    let peer = d.connect(&crate::off_host(&p))?;
    let (backend, why) = d.peer_backend(peer).context("peer is connected")?;
    ensure!(backend == Backend::Tcp, "backend {backend}");
    let expected = if rdma {
        "no verbs backend"
    } else {
        "no RDMA device"
    };
    ensure!(why.contains(expected), "reason {why:?} lacks {expected:?}");
    println!("fallback reason: {why}");
    read_through(&p, &d)?;
    // `verbs` forced against a TCP-only peer is an error naming the reason.
    let strict = agent("d-strict", dip, BackendChoice::Verbs)?;
    match strict.connect(&crate::off_host(&p)) {
        Err(
            e @ ConnectError::BackendUnavailable {
                backend: Backend::Verbs,
                ..
            },
        ) => {
            let reason = error_chain(&e);
            ensure!(reason.contains(expected), "{reason}");
        }
        other => bail!("forced verbs: {other:?}"),
    }
    Ok(())
}
