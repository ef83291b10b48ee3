//! Push mode over verbs: P's RDMA WRITEs into ranges D granted remote-write access to for
//! one reservation (`Agent::grant_write`), revoked when D clears the reservation's fence
//! word. A module of the `rxe` test binary (`tests/rxe.rs`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use kvlease_gpu_mem::{DmaRegion, HostRegion, RegionBytes};
use kvlease_transport::{
    Agent, Backend, BackendChoice, BatchStatus, LocalRange, PeerId, RegionDesc, RegionId,
    TransferError, WriteBatch, WriteFence, WriteGrant, WriteOp,
};

use super::agent::pair;

const POOL: usize = 1 << 20;
/// Where the reservation's blocks lie in D's pool.
const DEST: u64 = 64 << 10;
const LEN: usize = 256 << 10;
/// The fence word's offset in D's fence table.
const WORD: u64 = 8;

/// P with a source region, D with a pool and a fence table, P connected to D over verbs.
struct Push {
    p: Agent,
    d: Agent,
    peer: PeerId,
    src: Arc<HostRegion>,
    src_id: u64,
    pool: Arc<HostRegion>,
    pool_desc: RegionDesc,
    fences: RegionDesc,
}

impl Push {
    fn new() -> Result<Self> {
        let (p, d) = pair(BackendChoice::Auto)?;
        let src = Arc::new(HostRegion::new(POOL)?);
        let src_id = p.register(Arc::clone(&src) as Arc<dyn DmaRegion>)?.id;
        let pool = Arc::new(HostRegion::new(POOL)?);
        let pool_desc = d.register(Arc::clone(&pool) as Arc<dyn DmaRegion>)?;
        let fences = d.register(Arc::new(HostRegion::new(4096)?) as Arc<dyn DmaRegion>)?;
        // P connects after both sides registered: the link names the regions it knew then.
        let peer = p.connect(&crate::off_host(&d))?;
        let (backend, why) = p.peer_backend(peer).context("peer is connected")?;
        ensure!(backend == Backend::Verbs, "backend {backend}: {why}");
        Ok(Self {
            p,
            d,
            peer,
            src,
            src_id,
            pool,
            pool_desc,
            fences,
        })
    }

    /// D publishes `generation` and grants the reservation's range for it.
    fn reserve(&self, generation: u64) -> Result<WriteGrant> {
        self.d
            .set_write_fence(RegionId(self.fences.id), WORD, generation)?;
        Ok(self.d.grant_write(
            RegionId(self.fences.id),
            WORD,
            generation,
            LocalRange {
                region: RegionId(self.pool_desc.id),
                offset: DEST,
                len: LEN as u64,
            },
        )?)
    }

    /// D clears the fence word: the reservation ended, its grant is revoked.
    fn clear(&self) -> Result<()> {
        Ok(self.d.set_write_fence(RegionId(self.fences.id), WORD, 0)?)
    }

    fn batch(&self, expected: u64, remote_offset: u64, notif: Option<&[u8]>) -> WriteBatch {
        WriteBatch {
            ops: vec![WriteOp {
                local: LocalRange {
                    region: RegionId(self.src_id),
                    offset: 0,
                    len: LEN as u64,
                },
                remote: self.pool_desc.at(remote_offset),
            }],
            notif: notif.map(<[u8]>::to_vec),
            fence: WriteFence {
                remote: self.fences.at(WORD),
                expected,
            },
        }
    }

    /// Writes P's source into the reservation's range under `grant`; the batch's end.
    fn write(&self, grant: &WriteGrant, notif: Option<&[u8]>) -> Result<BatchStatus> {
        let batch = self.batch(grant.generation, DEST, notif);
        let id = self
            .p
            .post_write_granted(self.peer, batch, &[*grant], super::TIMEOUT)?;
        wait(&self.p, id)
    }
}

fn wait(p: &Agent, id: kvlease_transport::BatchId) -> Result<BatchStatus> {
    let deadline = Instant::now() + super::TIMEOUT;
    loop {
        match p.poll_batch(id)? {
            BatchStatus::Pending => {}
            s => return Ok(s),
        }
        ensure!(Instant::now() < deadline, "write batch still pending");
    }
}

/// A granted write lands byte-exact over verbs with its notification after it; once D
/// cleared the fence word, a write under the revoked grant fails at P with `Stale` and no
/// byte of D's pool changes. The pool's own registration grants no remote write: a
/// write naming its rkey fails the same way. A write outside the grant, or for another
/// generation than the grant's, is refused before anything is posted; deregistering the
/// destination region revokes its grants.
#[test]
#[ignore = "needs RDMA devices rxeP/rxeD: scripts/softroce/test.sh runs it"]
fn granted_write_lands_and_a_revoked_grant_fails_without_a_byte() -> Result<()> {
    super::devices("granted_write_lands_and_a_revoked_grant_fails_without_a_byte");
    let t = Push::new()?;
    let data = super::pattern(LEN, 21);
    t.src.write_from(0, &data)?;
    let grant = t.reserve(5)?;
    match t.write(&grant, Some(b"write-done"))? {
        BatchStatus::Done(s) => ensure!(s.backend == Backend::Verbs, "went over {}", s.backend),
        other => bail!("granted write: {other:?}"),
    }
    ensure!(
        super::bytes(&t.pool, DEST, LEN)? == data,
        "written bytes differ"
    );
    ensure!(
        super::bytes(&t.pool, 0, DEST as usize)?
            .iter()
            .all(|b| *b == 0),
        "bytes before the range changed"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let n = t.d.get_new_notifs();
        if n.iter().any(|(_, m)| m.iter().any(|m| m == b"write-done")) {
            break;
        }
        ensure!(Instant::now() < deadline, "write-done never arrived");
        std::thread::sleep(Duration::from_millis(5));
    }

    // Refused at P: outside the grant, or another generation.
    let outside = t.batch(5, DEST + 4096, None);
    match t
        .p
        .post_write_granted(t.peer, outside, &[grant], super::TIMEOUT)
    {
        Err(TransferError::InvalidBatch { reason, .. }) => {
            ensure!(reason.contains("outside every write grant"), "{reason}");
        }
        other => bail!("write outside the grant: {other:?}"),
    }
    let other_gen = t.batch(6, DEST, None);
    match t
        .p
        .post_write_granted(t.peer, other_gen, &[grant], super::TIMEOUT)
    {
        Err(TransferError::InvalidBatch { reason, .. }) => {
            ensure!(reason.contains("generation"), "{reason}");
        }
        other => bail!("write for another generation: {other:?}"),
    }

    // The reservation ends: D clears, then reuses the blocks.
    t.clear()?;
    let reused = super::pattern(LEN, 22);
    t.pool.write_from(DEST, &reused)?;
    t.src.write_from(0, &super::pattern(LEN, 23))?;
    match t.write(&grant, None)? {
        BatchStatus::Failed(TransferError::Stale { expected: 5, .. }) => {}
        other => bail!("write under a revoked grant: {other:?}"),
    }
    ensure!(
        super::bytes(&t.pool, DEST, LEN)? == reused,
        "a write under a revoked grant changed D's bytes"
    );

    // The pool's own rkey (from D's metadata) takes no remote write.
    let meta: serde_json::Value = serde_json::from_slice(&t.d.metadata())?;
    let pool_rkey = meta["backends"]["verbs"]["rkeys"][t.pool_desc.id.to_string()]
        .as_u64()
        .context("D's metadata names the pool's rkey")?;
    let forged = WriteGrant {
        region: t.pool_desc.id,
        offset: 0,
        len: POOL as u64,
        generation: 7,
        rkey: u32::try_from(pool_rkey)?,
    };
    t.reserve(7)?;
    match t.write(&forged, None)? {
        BatchStatus::Failed(TransferError::Stale { .. }) => {}
        other => bail!("write naming the pool's rkey: {other:?}"),
    }
    ensure!(
        super::bytes(&t.pool, DEST, LEN)? == reused,
        "a write naming the pool's rkey changed D's bytes"
    );

    // The queue pair recovered: a fresh grant writes again.
    let grant = t.reserve(8)?;
    match t.write(&grant, None)? {
        BatchStatus::Done(_) => {}
        other => bail!("write after the refusals: {other:?}"),
    }
    ensure!(super::bytes(&t.pool, DEST, LEN)? == super::pattern(LEN, 23));
    // Granting against a word that holds another generation grants nothing.
    let stale = t.d.grant_write(
        RegionId(t.fences.id),
        WORD,
        7,
        LocalRange {
            region: RegionId(t.pool_desc.id),
            offset: DEST,
            len: LEN as u64,
        },
    );
    ensure!(
        matches!(stale, Err(kvlease_transport::RegisterError::Grant { .. })),
        "{stale:?}"
    );

    // Deregistering the destination region ends its grants with it.
    let grant = t.reserve(9)?;
    t.d.deregister(RegionId(t.pool_desc.id))?;
    let before = super::bytes(&t.pool, 0, POOL)?;
    t.src.write_from(0, &super::pattern(LEN, 24))?;
    match t.write(&grant, None)? {
        BatchStatus::Failed(TransferError::Stale { expected: 9, .. }) => {}
        other => bail!("write into a deregistered region: {other:?}"),
    }
    ensure!(
        super::bytes(&t.pool, 0, POOL)? == before,
        "a write into a deregistered region changed D's bytes"
    );
    Ok(())
}

/// The race: a writer thread keeps writing its round's pattern under the round's grant
/// while D clears the fence word and refills the blocks with its own pattern. After the
/// clear returned, no byte of the old generation lands: D's refill stays intact, every
/// round, whatever the writer had in flight.
#[test]
#[ignore = "needs RDMA devices rxeP/rxeD: scripts/softroce/test.sh runs it"]
fn no_old_byte_lands_after_the_clear_returns() -> Result<()> {
    super::devices("no_old_byte_lands_after_the_clear_returns");
    let t = Arc::new(Push::new()?);
    const ROUNDS: u64 = 8;
    let current: Arc<Mutex<Option<WriteGrant>>> = Arc::new(Mutex::new(None));
    let stop = Arc::new(AtomicBool::new(false));
    let landed = Arc::new(AtomicU64::new(0));
    let refused = Arc::new(AtomicU64::new(0));
    let writer = {
        let (t, current, stop, landed, refused) = (
            Arc::clone(&t),
            Arc::clone(&current),
            Arc::clone(&stop),
            Arc::clone(&landed),
            Arc::clone(&refused),
        );
        std::thread::spawn(move || -> Result<()> {
            let mut written_for = 0;
            while !stop.load(Ordering::SeqCst) {
                let Some(grant) = *current.lock().expect("lock") else {
                    std::thread::yield_now();
                    continue;
                };
                if grant.generation != written_for {
                    // The source holds the generation's pattern (P fills it once per round).
                    t.src
                        .write_from(0, &super::pattern(LEN, 100 + grant.generation))?;
                    written_for = grant.generation;
                }
                match t.write(&grant, None)? {
                    BatchStatus::Done(_) => landed.fetch_add(1, Ordering::SeqCst),
                    BatchStatus::Failed(TransferError::Stale { .. }) => {
                        refused.fetch_add(1, Ordering::SeqCst)
                    }
                    other => bail!("writer: {other:?}"),
                };
            }
            Ok(())
        })
    };
    let mut outcome = Ok(());
    for round in 1..=ROUNDS {
        let grant = t.reserve(round)?;
        let before = landed.load(Ordering::SeqCst);
        *current.lock().expect("lock") = Some(grant);
        // Let writes of this round land (and more be in flight), then end the reservation
        // while the writer keeps going under the old grant.
        let deadline = Instant::now() + Duration::from_secs(30);
        while landed.load(Ordering::SeqCst) < before + 2 {
            ensure!(Instant::now() < deadline, "round {round}: no write landed");
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(u64::from(round as u32 % 4)));
        t.clear()?;
        let refill = super::pattern(LEN, 200 + round);
        t.pool.write_from(DEST, &refill)?;
        // The writer keeps writing under the revoked grant meanwhile: three more writes
        // end (one of them may have been in flight during the clear).
        let refused_before = refused.load(Ordering::SeqCst);
        let ended = || landed.load(Ordering::SeqCst) + refused.load(Ordering::SeqCst);
        let ended_before = ended();
        let deadline = Instant::now() + Duration::from_secs(30);
        while ended() < ended_before + 3 {
            ensure!(
                Instant::now() < deadline,
                "round {round}: the writer's writes stopped ending"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        if super::bytes(&t.pool, DEST, LEN)? != refill {
            outcome = Err(anyhow::anyhow!(
                "round {round}: a byte of the old generation landed after the clear returned"
            ));
            break;
        }
        let refused_now = refused.load(Ordering::SeqCst) - refused_before;
        if refused_now < 2 {
            outcome = Err(anyhow::anyhow!(
                "round {round}: only {refused_now} writes under the revoked grant were refused"
            ));
            break;
        }
    }
    stop.store(true, Ordering::SeqCst);
    writer
        .join()
        .map_err(|_| anyhow::anyhow!("writer panicked"))??;
    println!(
        "{} writes landed, {} refused after their grant was revoked",
        landed.load(Ordering::SeqCst),
        refused.load(Ordering::SeqCst)
    );
    outcome
}

/// Push with staged memory (standing for device memory) on a verbs link: P's staged
/// source has only a host mirror, so a granted write from it goes over the link's TCP
/// connections from P's bounce buffer, not as an RDMA WRITE of the mirror's (stale)
/// bytes; D's staged pool gets no write grant, so P writes into it without one and D's
/// receiver lands it under the fence lock. Both land byte-exact; after the clear, a
/// write of the old generation into the staged pool lands nothing.
#[test]
#[ignore = "needs RDMA devices rxeP/rxeD: scripts/softroce/test.sh runs it"]
fn staged_memory_is_written_over_the_verbs_links_tcp() -> Result<()> {
    use kvlease_gpu_mem::{StagedHostRegion, staging};
    super::devices("staged_memory_is_written_over_the_verbs_links_tcp");
    let (p, d) = pair(BackendChoice::Verbs)?;
    let data = super::pattern(LEN, 31);
    let staged_src = Arc::new(StagedHostRegion::new(POOL)?);
    staging::write_region(staged_src.as_ref(), 0, &data)?;
    let staged_src_id = RegionId(
        p.register(Arc::clone(&staged_src) as Arc<dyn DmaRegion>)?
            .id,
    );
    ensure!(
        p.is_mirrored(staged_src_id),
        "P's staged source not mirrored"
    );
    let host_src = Arc::new(HostRegion::new(POOL)?);
    let more = super::pattern(LEN, 32);
    host_src.write_from(0, &more)?;
    let host_src_id = RegionId(p.register(Arc::clone(&host_src) as Arc<dyn DmaRegion>)?.id);
    let host_pool = Arc::new(HostRegion::new(POOL)?);
    let host_pool_d = d.register(Arc::clone(&host_pool) as Arc<dyn DmaRegion>)?;
    let staged_pool = Arc::new(StagedHostRegion::new(POOL)?);
    let staged_pool_d = d.register(Arc::clone(&staged_pool) as Arc<dyn DmaRegion>)?;
    let fences = d.register(Arc::new(HostRegion::new(4096)?) as Arc<dyn DmaRegion>)?;
    let peer = p.connect(&crate::off_host(&d))?;
    let (backend, why) = p.peer_backend(peer).context("peer is connected")?;
    ensure!(backend == Backend::Verbs, "backend {backend}: {why}");
    let batch = |src: RegionId, dest: &RegionDesc, generation| WriteBatch {
        ops: vec![WriteOp {
            local: LocalRange {
                region: src,
                offset: 0,
                len: LEN as u64,
            },
            remote: dest.at(DEST),
        }],
        notif: None,
        fence: WriteFence {
            remote: fences.at(WORD),
            expected: generation,
        },
    };
    let range = |dest: &RegionDesc| LocalRange {
        region: RegionId(dest.id),
        offset: DEST,
        len: LEN as u64,
    };

    // Staged source into a granted host range: over TCP, byte-exact.
    d.set_write_fence(RegionId(fences.id), WORD, 3)?;
    let grant = d.grant_write(RegionId(fences.id), WORD, 3, range(&host_pool_d))?;
    let id = p.post_write_granted(
        peer,
        batch(staged_src_id, &host_pool_d, 3),
        &[grant],
        super::TIMEOUT,
    )?;
    match wait(&p, id)? {
        BatchStatus::Done(s) => ensure!(s.backend == Backend::Tcp, "went over {}", s.backend),
        other => bail!("write from staged memory: {other:?}"),
    }
    ensure!(
        super::bytes(&host_pool, DEST, LEN)? == data,
        "bytes from staged memory differ"
    );

    // A staged pool gets no grant; an ungranted write lands in it over TCP.
    d.set_write_fence(RegionId(fences.id), WORD, 4)?;
    let refused = d.grant_write(RegionId(fences.id), WORD, 4, range(&staged_pool_d));
    ensure!(
        matches!(refused, Err(kvlease_transport::RegisterError::Grant { .. })),
        "a staged pool got a write grant: {refused:?}"
    );
    let id = p.post_write(peer, batch(host_src_id, &staged_pool_d, 4), super::TIMEOUT)?;
    match wait(&p, id)? {
        BatchStatus::Done(s) => ensure!(s.backend == Backend::Tcp, "went over {}", s.backend),
        other => bail!("write into staged memory: {other:?}"),
    }
    let mut got = vec![0; LEN];
    staging::read_region(staged_pool.as_ref(), DEST as usize, &mut got)?;
    ensure!(got == more, "bytes landed in staged memory differ");

    // Cleared: the old generation lands nothing in the staged pool.
    d.set_write_fence(RegionId(fences.id), WORD, 0)?;
    let id = p.post_write(
        peer,
        batch(staged_src_id, &staged_pool_d, 4),
        super::TIMEOUT,
    )?;
    match wait(&p, id)? {
        BatchStatus::Failed(TransferError::Stale { expected: 4, .. }) => {}
        other => bail!("a write of a cleared generation: {other:?}"),
    }
    staging::read_region(staged_pool.as_ref(), DEST as usize, &mut got)?;
    ensure!(got == more, "a stale write changed the staged pool");
    Ok(())
}
