//! The TCP backend's fenced reads and staged memory (regions that are not
//! host-accessible, served and received through the pipelined stager).

mod common;

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use kvlease_gpu_mem::{DmaRegion, FenceTable, HostRegion, RegionBytes, StagedHostRegion, staging};
use kvlease_lease::BlockId;
use kvlease_transport::{
    Agent, BatchStatus, FenceRead, LocalRange, ReadBatch, ReadOp, Refusal, RegionDesc, RegionId,
    TransferError,
};

use common::{
    LIMIT, Rng, agent, bytes_of, config, fake_peer, filled, frame, half_answer, hello, notifs_from,
    one_read, raw, read_frame, read_req, single_conn, wait,
};

#[test]
fn fence_read_happens_after_the_data() -> Result<()> {
    // The fake target holds back the data responses and checks that no fence request
    // arrives before it sent them.
    let (meta, desc, h) = fake_peer("fenced", |mut s| {
        let mut reqs = Vec::new();
        for _ in 0..3 {
            let Ok((5, body)) = read_frame(&mut s) else {
                return;
            };
            reqs.push(body);
        }
        let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
        let mut b = [0u8; 1];
        if s.read(&mut b).is_ok() {
            return; // something arrived before the data was served: fail the batch
        }
        let _ = s.set_read_timeout(Some(LIMIT));
        for body in reqs {
            let len = u64::from_le_bytes(body[32..40].try_into().unwrap_or_default());
            let _ = s.write_all(&frame(6, &[&body[..8], &len.to_le_bytes()[..]].concat()));
            let _ = s.write_all(&vec![0x11; len as usize]);
        }
        let Ok((5, body)) = read_frame(&mut s) else {
            return;
        };
        if u64::from_le_bytes(body[24..32].try_into().unwrap_or_default()) != 4096 {
            return;
        }
        let _ = s.write_all(&frame(6, &[&body[..8], &8u64.to_le_bytes()[..]].concat()));
        let _ = s.write_all(&7u64.to_ne_bytes());
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let _ = s.read(&mut b);
    })?;
    let d = single_conn("d")?;
    let dst = Arc::new(HostRegion::new(3 * 1000)?);
    let dst_id = RegionId(d.register(dst.clone())?.id);
    let peer = d.connect(&meta)?;
    let ops = (0..3)
        .map(|i| ReadOp {
            local: LocalRange {
                region: dst_id,
                offset: i * 1000,
                len: 1000,
            },
            remote: desc.at(i * 1000),
        })
        .collect();
    let id = d.post_read(
        peer,
        ReadBatch {
            ops,
            notif: None,
            fence: Some(FenceRead {
                remote: desc.at(4096),
                expected: 7,
            }),
        },
        LIMIT,
    )?;
    match wait(&d, id)? {
        BatchStatus::Done(stats) => ensure!(stats.fence_word == Some(7) && stats.bytes == 3000),
        other => bail!("{other:?}"),
    }
    ensure!(bytes_of(&*dst, 0, 3000) == vec![0x11; 3000]);
    drop(d);
    h.join().ok();
    Ok(())
}

#[test]
fn fence_match_sends_the_notif_and_mismatch_fails_without_it() -> Result<()> {
    let p = agent("p");
    let data = filled(64 * 1024, 11);
    let data_desc = p.register(data.clone())?;
    let fence = FenceTable::new(16)?;
    let fence_desc = p.register(fence.region())?;
    fence.publish(&[BlockId(3), BlockId(4)], 7)?;
    let d = agent("d");
    let dst = Arc::new(HostRegion::new(64 * 1024)?);
    let dst_id = RegionId(d.register(dst.clone())?.id);
    let peer = d.connect(&p.metadata())?;
    let word_at = fence.word_offset(BlockId(4))?;
    let batch = |expected: u64, notif: &[u8]| ReadBatch {
        ops: vec![ReadOp {
            local: LocalRange {
                region: dst_id,
                offset: 0,
                len: 64 * 1024,
            },
            remote: data_desc.at(0),
        }],
        notif: Some(notif.to_vec()),
        fence: Some(FenceRead {
            remote: fence_desc.at(word_at),
            expected,
        }),
    };
    let id = d.post_read(peer, batch(7, b"done-1"), LIMIT)?;
    match wait(&d, id)? {
        BatchStatus::Done(stats) => ensure!(stats.fence_word == Some(7)),
        other => bail!("{other:?}"),
    }
    ensure!(bytes_of(&*dst, 0, 64 * 1024) == bytes_of(&*data, 0, 64 * 1024));
    ensure!(notifs_from(&p, 1) == vec![("d".to_owned(), vec![b"done-1".to_vec()])]);

    // P released the lease (and maybe reused the blocks): the word moved on.
    fence.publish(&[BlockId(3), BlockId(4)], 0)?;
    let id = d.post_read(peer, batch(7, b"done-2"), LIMIT)?;
    match wait(&d, id)? {
        BatchStatus::Failed(TransferError::FenceMismatch {
            peer,
            expected,
            found,
        }) => ensure!(peer == "p" && expected == 7 && found == 0),
        other => bail!("{other:?}"),
    }
    // The failed batch's notification is never sent; a later one still is.
    d.send_notif(peer, b"after".to_vec())?;
    ensure!(notifs_from(&p, 1) == vec![("d".to_owned(), vec![b"after".to_vec()])]);
    Ok(())
}

// ---- staged memory: regions that are not host-accessible (device memory) ----
//
// A `StagedHostRegion` is host memory whose kind says "not host-accessible", so the server
// serves it and the reader fills it through the pipelined `Stager` (pinned bounce buffers
// on a GPU, a `HostCopier` here): the same code path as CUDA device memory.

fn staged(len: usize, seed: u64) -> Result<Arc<StagedHostRegion>> {
    let r = StagedHostRegion::new(len)?;
    let mut rng = Rng(seed | 1);
    let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
    staging::write_region(&r, 0, &bytes)?;
    Ok(Arc::new(r))
}

fn staged_bytes(r: &dyn DmaRegion, offset: u64, len: u64) -> Result<Vec<u8>> {
    let mut v = vec![0; len as usize];
    staging::read_region(r, offset as usize, &mut v)?;
    Ok(v)
}

/// A reader whose chunks span several 2 MiB staging chunks.
fn big_chunk_reader(name: &str, conns: usize) -> Result<Agent> {
    let mut c = config(name, None);
    c.limits.chunk_len = 7 << 20;
    c.num_connections = conns;
    Ok(Agent::new(c)?)
}

#[test]
fn staged_regions_are_served_and_received_byte_exact_in_every_direction() -> Result<()> {
    let p = agent("p");
    let src_staged = staged(16 << 20, 21)?;
    let src_host = filled(16 << 20, 22);
    ensure!(
        src_staged.check_host_range(0, 1).is_err(),
        "staged is not host-accessible"
    );
    let staged_desc = p.register(src_staged.clone())?;
    let host_desc = p.register(src_host.clone())?;
    let d = big_chunk_reader("d", 2)?;
    let dst_staged = Arc::new(StagedHostRegion::new(32 << 20)?);
    let dst_host = Arc::new(HostRegion::new(32 << 20)?);
    let staged_id = RegionId(d.register(dst_staged.clone())?.id);
    let host_id = RegionId(d.register(dst_host.clone())?.id);
    let peer = d.connect(&p.metadata())?;

    let mut rng = Rng(77);
    // (source, destination): staged→host, host→staged, staged→staged.
    let cases: [(&dyn DmaRegion, &RegionDesc, RegionId, &dyn DmaRegion); 3] = [
        (&*src_staged, &staged_desc, host_id, &*dst_host),
        (&*src_host, &host_desc, staged_id, &*dst_staged),
        (&*src_staged, &staged_desc, staged_id, &*dst_staged),
    ];
    for (src, desc, dst_id, dst) in cases {
        let mut ops = Vec::new();
        let mut expect = Vec::new();
        let mut next = 0u64;
        // Lengths from one byte to several staging chunks, at odd offsets.
        for len in [1, 4095, (2 << 20) + 3, 9 << 20, 1 + rng.below(3 << 20)] {
            let offset = rng.below(desc.len - len + 1);
            ops.push(ReadOp {
                local: LocalRange {
                    region: dst_id,
                    offset: next,
                    len,
                },
                remote: desc.at(offset),
            });
            expect.push((next, staged_bytes(src, offset, len)?));
            next += len + 17;
        }
        let n = ops.len();
        let id = d.post_read(
            peer,
            ReadBatch {
                ops,
                notif: None,
                fence: None,
            },
            LIMIT,
        )?;
        let BatchStatus::Done(stats) = wait(&d, id)? else {
            bail!("batch into {} failed", dst.kind());
        };
        ensure!(stats.ops == n);
        for (at, want) in expect {
            ensure!(
                staged_bytes(dst, at, want.len() as u64)? == want,
                "{} → {}: bytes differ at {at}",
                src.kind(),
                dst.kind()
            );
        }
    }
    ensure!(p.stats().reads_served > 0);

    // Bounds are still checked for staged memory, on both sides.
    let id = d.post_read(
        peer,
        one_read(host_id, 4096, staged_desc.at((16 << 20) - 100)),
        LIMIT,
    )?;
    ensure!(matches!(
        wait(&d, id)?,
        BatchStatus::Failed(TransferError::Refused {
            reason: Refusal::OutOfBounds,
            ..
        })
    ));
    let err = d.post_read(
        peer,
        ReadBatch {
            ops: vec![ReadOp {
                local: LocalRange {
                    region: staged_id,
                    offset: (32 << 20) - 10,
                    len: 4096,
                },
                remote: staged_desc.at(0),
            }],
            notif: None,
            fence: None,
        },
        LIMIT,
    );
    ensure!(
        matches!(err, Err(TransferError::Local { .. })),
        "local out of bounds: {err:?}"
    );
    Ok(())
}

#[test]
fn a_fenced_read_of_staged_blocks_checks_the_word_after_the_data() -> Result<()> {
    let p = agent("p");
    let data = staged(8 << 20, 31)?;
    let data_desc = p.register(data.clone())?;
    let fence = FenceTable::new(16)?;
    let fence_desc = p.register(fence.region())?;
    fence.publish(&[BlockId(2)], 9)?;
    let d = big_chunk_reader("d", 1)?;
    let dst = Arc::new(StagedHostRegion::new(8 << 20)?);
    let dst_id = RegionId(d.register(dst.clone())?.id);
    let peer = d.connect(&p.metadata())?;
    let word_at = fence.word_offset(BlockId(2))?;
    let batch = |expected: u64| ReadBatch {
        ops: vec![ReadOp {
            local: LocalRange {
                region: dst_id,
                offset: 0,
                len: 8 << 20,
            },
            remote: data_desc.at(0),
        }],
        notif: Some(b"fenced".to_vec()),
        fence: Some(FenceRead {
            remote: fence_desc.at(word_at),
            expected,
        }),
    };
    let id = d.post_read(peer, batch(9), LIMIT)?;
    match wait(&d, id)? {
        BatchStatus::Done(stats) => ensure!(stats.fence_word == Some(9) && stats.bytes == 8 << 20),
        other => bail!("{other:?}"),
    }
    ensure!(staged_bytes(&*dst, 0, 8 << 20)? == staged_bytes(&*data, 0, 8 << 20)?);
    ensure!(notifs_from(&p, 1) == vec![("d".to_owned(), vec![b"fenced".to_vec()])]);
    // The lease moved on: the staged data arrives, the fence fails the batch, no notif.
    fence.publish(&[BlockId(2)], 10)?;
    let id = d.post_read(peer, batch(9), LIMIT)?;
    ensure!(matches!(
        wait(&d, id)?,
        BatchStatus::Failed(TransferError::FenceMismatch {
            expected: 9,
            found: 10,
            ..
        })
    ));
    std::thread::sleep(Duration::from_millis(200));
    ensure!(
        p.get_new_notifs().is_empty(),
        "no notif after a fence mismatch"
    );
    Ok(())
}

#[test]
fn a_peer_dying_mid_staged_transfer_fails_that_batch_and_staging_goes_on() -> Result<()> {
    // Reader side: a peer answers half of a staged destination's bytes and dies.
    let good = agent("good");
    let good_region = staged(8 << 20, 41)?;
    let good_desc = good.register(good_region.clone())?;
    let d = big_chunk_reader("d", 1)?;
    let dst = Arc::new(StagedHostRegion::new(8 << 20)?);
    let dst_id = RegionId(d.register(dst.clone())?.id);
    let (meta, desc, h) = fake_peer("dying", |mut s| {
        let _ = half_answer(&mut s);
    })?;
    let dying = d.connect(&meta)?;
    let id = d.post_read(dying, one_read(dst_id, 1 << 20, desc.at(0)), LIMIT)?;
    match wait(&d, id)? {
        BatchStatus::Failed(TransferError::Disconnected { peer, .. }) => ensure!(peer == "dying"),
        other => bail!("expected Disconnected, got {other:?}"),
    }
    h.join().ok();
    let good_peer = d.connect(&good.metadata())?;
    let id = d.post_read(good_peer, one_read(dst_id, 8 << 20, good_desc.at(0)), LIMIT)?;
    ensure!(matches!(wait(&d, id)?, BatchStatus::Done(_)));
    ensure!(staged_bytes(&*dst, 0, 8 << 20)? == staged_bytes(&*good_region, 0, 8 << 20)?);

    // Server side: a reader asks for 8 MiB of a staged region, takes the header and a
    // little, and dies; the server closes that connection and serves the next one.
    let mut s = raw(&good)?;
    s.write_all(&hello("quitter"))?;
    let (ty, _) = read_frame(&mut s)?;
    ensure!(ty == 2, "CHALLENGE");
    s.write_all(&frame(3, &[0]))?;
    let (ty, body) = read_frame(&mut s)?;
    ensure!(ty == 4 && body[0] == 1, "AUTH_RESULT ok");
    let served_before = good.stats().reads_served;
    s.write_all(&read_req(1, &good_desc, 0, 8 << 20))?;
    let mut head = [0u8; 5 + 16 + 1000];
    s.read_exact(&mut head)?;
    ensure!(head[0] == 6, "READ_RESP");
    let want = staged_bytes(&*good_region, 0, 1000)?;
    ensure!(
        head[21..] == want[..],
        "first staged bytes are the region's"
    );
    drop(s);
    let id = d.post_read(
        good_peer,
        one_read(dst_id, 4 << 20, good_desc.at(4 << 20)),
        LIMIT,
    )?;
    ensure!(matches!(wait(&d, id)?, BatchStatus::Done(_)));
    ensure!(staged_bytes(&*dst, 0, 4 << 20)? == staged_bytes(&*good_region, 4 << 20, 4 << 20)?);
    // The server counts a read after its last byte left, which may be after D has it.
    let deadline = Instant::now() + Duration::from_secs(10);
    while good.stats().reads_served < served_before + 1 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    ensure!(
        good.stats().reads_served == served_before + 1,
        "the broken read is not counted ({} reads served after it, expected {})",
        good.stats().reads_served - served_before,
        1
    );
    Ok(())
}

/// Fenced writes out of and into staged memory: the writer sends a staged source's bytes
/// through a host bounce buffer, the receiver copies them into a staged destination under
/// the fence lock (the path CUDA device memory takes). Every direction lands byte-exact;
/// once the receiver cleared the fence, a write of the old generation lands nothing.
#[test]
fn fenced_writes_from_and_into_staged_memory_land_byte_exact_and_stale_ones_land_nothing()
-> Result<()> {
    use kvlease_transport::{WriteBatch, WriteFence, WriteOp};
    const LEN: usize = 6 << 20;
    let d = agent("d");
    let dst_staged = Arc::new(StagedHostRegion::new(LEN)?);
    let dst_host = Arc::new(HostRegion::new(LEN)?);
    let staged_dd = d.register(dst_staged.clone())?;
    let host_dd = d.register(dst_host.clone())?;
    let fence = d.register(Arc::new(HostRegion::new(64)?))?;
    d.set_write_fence(RegionId(fence.id), 8, 5)?;
    let p = agent("p");
    let src_staged = staged(LEN, 31)?;
    let src_host = filled(LEN, 32);
    let staged_src = RegionId(p.register(src_staged.clone())?.id);
    let host_src = RegionId(p.register(src_host.clone())?.id);
    let peer = p.connect(&d.metadata())?;
    let write = |src: RegionId, dst: &RegionDesc, expected: u64| -> Result<BatchStatus> {
        // One op over the 1 MiB chunk length (split and striped), one small one.
        let op = |src_offset, dst_offset, len| WriteOp {
            local: LocalRange {
                region: src,
                offset: src_offset,
                len,
            },
            remote: dst.at(dst_offset),
        };
        let b = p.post_write(
            peer,
            WriteBatch {
                ops: vec![op(1000, 4096, (3 << 20) + 77), op(0, 5 << 20, 999)],
                notif: None,
                fence: WriteFence {
                    remote: fence.at(8),
                    expected,
                },
            },
            LIMIT,
        )?;
        wait(&p, b)
    };
    // (source, its bytes, destination, its bytes): staged→staged, host→staged,
    // staged→host.
    let cases: [(RegionId, &dyn DmaRegion, &RegionDesc, &dyn DmaRegion); 3] = [
        (staged_src, &*src_staged, &staged_dd, &*dst_staged),
        (host_src, &*src_host, &staged_dd, &*dst_staged),
        (staged_src, &*src_staged, &host_dd, &*dst_host),
    ];
    for (i, (src, src_bytes, dd, dst_bytes)) in cases.into_iter().enumerate() {
        staging::write_region(dst_bytes, 0, &vec![0; LEN])?;
        let status = write(src, dd, 5)?;
        ensure!(
            matches!(status, BatchStatus::Done(_)),
            "case {i}: {status:?}"
        );
        ensure!(
            staged_bytes(dst_bytes, 4096, (3 << 20) + 77)?
                == staged_bytes(src_bytes, 1000, (3 << 20) + 77)?,
            "case {i}: the large write differs"
        );
        ensure!(
            staged_bytes(dst_bytes, 5 << 20, 999)? == staged_bytes(src_bytes, 0, 999)?,
            "case {i}: the small write differs"
        );
        ensure!(
            staged_bytes(dst_bytes, 0, 4096)?.iter().all(|&b| b == 0),
            "case {i}: bytes before the write changed"
        );
    }
    // Cleared: the old generation lands nothing in staged memory.
    d.set_write_fence(RegionId(fence.id), 8, 0)?;
    let before = staged_bytes(&*dst_staged, 0, LEN as u64)?;
    let status = write(staged_src, &staged_dd, 5)?;
    ensure!(
        matches!(
            status,
            BatchStatus::Failed(TransferError::Stale { expected: 5, .. })
        ),
        "{status:?}"
    );
    ensure!(
        staged_bytes(&*dst_staged, 0, LEN as u64)? == before,
        "a stale write landed in staged memory"
    );
    Ok(())
}
