//! A queue pair that stops completing work: a module of the `rxe` test binary
//! (`tests/rxe.rs`).
//!
//! The loss is real: nftables in the guest drops every RoCE v2 packet (UDP 4791) it
//! receives for a while. D's queue pairs wait for ever for an ACK (`verbs_ack_timeout`
//! 0), so the device never retransmits the lost READ and never fails it: only D's stall
//! check can end it (with the check disabled, the read hangs until its timeout).

use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use kvlease_gpu_mem::{DmaRegion, HostRegion, RegionBytes};
use kvlease_transport::{
    Agent, AgentConfig, Backend, BackendChoice, BatchStatus, FenceRead, LocalRange, ReadBatch,
    ReadOp, RegionId,
};

const TABLE: &str = "kvlease_stall_test";
const STALL: Duration = Duration::from_millis(500);

/// Drops every RoCE v2 packet this host receives while it lives (an nftables table of
/// its own, deleted on drop). On input, not output: rxe retries a send that netfilter
/// refuses locally until it goes out, so only a packet dropped after it left is lost.
struct RoceDrop;

fn nft(args: &[&str]) -> Result<()> {
    let out = Command::new("nft")
        .args(args)
        .output()
        .context("running nft (package nftables; the test runs as root in the SoftRoCE VM)")?;
    ensure!(
        out.status.success(),
        "nft {args:?}: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

impl RoceDrop {
    fn install() -> Result<Self> {
        nft(&["add", "table", "inet", TABLE])?;
        let guard = Self;
        nft(&[
            "add",
            "chain",
            "inet",
            TABLE,
            "in",
            "{ type filter hook input priority 0; }",
        ])?;
        nft(&[
            "add", "rule", "inet", TABLE, "in", "udp", "dport", "4791", "drop",
        ])?;
        Ok(guard)
    }
}

impl Drop for RoceDrop {
    fn drop(&mut self) {
        if let Err(e) = nft(&["delete", "table", "inet", TABLE]) {
            eprintln!("could not delete the nftables table {TABLE}: {e:#}");
        }
    }
}

/// D reads 4 MiB from P over verbs while every RoCE packet is dropped: the read stays
/// pending (nothing completes it, nothing fails it) until D's stall check resets the
/// queue pair and posts it again, counted in `verbs_stall_resets`. Once packets flow, the
/// batch completes byte-exact with its fence word, over verbs, well inside its timeout.
#[test]
#[ignore = "needs RDMA devices rxeP/rxeD: scripts/softroce/test.sh runs it"]
fn a_read_the_device_lost_is_posted_again_after_the_stall_limit() -> Result<()> {
    super::devices("a_read_the_device_lost_is_posted_again_after_the_stall_limit");
    let p = super::agent::agent(
        "p",
        super::agent::addr("KV_TEST_RDMA_ADDR", [10, 77, 2, 1]),
        BackendChoice::Verbs,
    )?;
    let mut c = AgentConfig::new("d");
    c.listen = SocketAddr::new(super::agent::d_addr(), 0);
    c.backend = BackendChoice::Verbs;
    c.limits.verbs_ack_timeout = 0;
    c.limits.verbs_stall_timeout = STALL;
    let d = Agent::new(c)?;

    const LEN: usize = 4 << 20;
    let data = super::pattern(LEN, 41);
    let src = Arc::new(HostRegion::new(LEN)?);
    src.write_from(0, &data)?;
    let fences = Arc::new(HostRegion::new(4096)?);
    fences.store_u64(8, 3)?;
    let src_desc = p.register(Arc::clone(&src) as Arc<dyn DmaRegion>)?;
    let fence_desc = p.register(Arc::clone(&fences) as Arc<dyn DmaRegion>)?;
    let dst = Arc::new(HostRegion::new(LEN)?);
    let dst_desc = d.register(Arc::clone(&dst) as Arc<dyn DmaRegion>)?;
    let peer = d.connect(&crate::off_host(&p))?;
    let (backend, why) = d.peer_backend(peer).context("peer is connected")?;
    ensure!(backend == Backend::Verbs, "backend {backend}: {why}");
    let batch = || ReadBatch {
        ops: vec![ReadOp {
            local: LocalRange {
                region: RegionId(dst_desc.id),
                offset: 0,
                len: LEN as u64,
            },
            remote: src_desc.at(0),
        }],
        notif: None,
        fence: Some(FenceRead {
            remote: fence_desc.at(8),
            expected: 3,
        }),
    };
    let wait = |id| super::agent::wait(&d, id);
    // Packets flowing: no stall.
    match wait(d.post_read(peer, batch(), Duration::from_secs(60))?)? {
        BatchStatus::Done(s) => ensure!(s.fence_word == Some(3)),
        other => bail!("the first read: {other:?}"),
    }
    ensure!(d.stats().verbs_stall_resets == 0, "a stall without a loss");
    dst.write_from(0, &vec![0u8; LEN])?;

    let lost = RoceDrop::install()?;
    let id = d.post_read(peer, batch(), Duration::from_secs(60))?;
    let dropped_at = Instant::now();
    // Two stall limits and more: the lost read is neither done nor failed, and D reset the
    // queue pair at least once (its re-posted read was lost too).
    while dropped_at.elapsed() < 3 * STALL {
        match d.poll_batch(id)? {
            BatchStatus::Pending => {}
            other => bail!("the read ended while every packet was dropped: {other:?}"),
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let resets = d.stats().verbs_stall_resets;
    ensure!(
        resets >= 1,
        "no stall reset after {:?}",
        dropped_at.elapsed()
    );
    drop(lost);
    let healed_at = Instant::now();
    match wait(id)? {
        BatchStatus::Done(s) => {
            ensure!(s.fence_word == Some(3), "fence word {:?}", s.fence_word);
            ensure!(s.backend == Backend::Verbs, "moved by {}", s.backend);
        }
        other => bail!("the lost read after the loss ended: {other:?}"),
    }
    println!(
        "stall resets while dropping: {resets}, in all: {}; done {:?} after the loss ended",
        d.stats().verbs_stall_resets,
        healed_at.elapsed()
    );
    ensure!(super::bytes(&dst, 0, LEN)? == data, "bytes differ");
    Ok(())
}
