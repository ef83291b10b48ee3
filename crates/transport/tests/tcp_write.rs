//! Fenced one-sided writes on the TCP backend, on real loopback sockets: byte-exact
//! landing under a matching fence, refusal (`Stale`, nothing landed) after the receiver
//! cleared it, a race of many writes against a clear, and hand-written write frames that
//! break the rules (unauthenticated, out of range, unknown regions, oversized, malformed).

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Result, ensure};
use kvlease_gpu_mem::{HostRegion, RegionBytes};
use kvlease_transport::{
    Agent, BatchStatus, LocalRange, RegionDesc, RegionId, RegisterError, RemoteRange,
    TransferError, WriteBatch, WriteFence, WriteGrant, WriteOp,
};
use proptest::prelude::*;

use common::{
    LIMIT, agent, bytes_of, filled, frame, handshake_raw, poll_for, raw, read_frame, wait,
};

const WRITE_REQ: u8 = 18;
const WRITE_ACK: u8 = 19;
const WRITE_ERR: u8 = 20;
/// The fence word's offset in D's fence region.
const FENCE_AT: u64 = 8;

/// D with a zeroed destination and a fence region, P with a filled source, P connected
/// to D.
struct Pair {
    p: Agent,
    d: Agent,
    src: Arc<HostRegion>,
    src_id: RegionId,
    dst: Arc<HostRegion>,
    dst_desc: RegionDesc,
    fence_desc: RegionDesc,
    peer: kvlease_transport::PeerId,
}

fn pair(len: usize) -> Result<Pair> {
    let d = agent("d");
    let dst = Arc::new(HostRegion::new(len)?);
    let dst_desc = d.register(dst.clone())?;
    let fence_desc = d.register(Arc::new(HostRegion::new(64)?))?;
    let p = agent("p");
    let src = filled(len, 7);
    let src_id = RegionId(p.register(src.clone())?.id);
    let peer = p.connect(&d.metadata())?;
    Ok(Pair {
        p,
        d,
        src,
        src_id,
        dst,
        dst_desc,
        fence_desc,
        peer,
    })
}

impl Pair {
    fn fence(&self, expected: u64) -> WriteFence {
        WriteFence {
            remote: RemoteRange {
                region: self.fence_desc.id,
                key: self.fence_desc.key,
                offset: FENCE_AT,
            },
            expected,
        }
    }

    fn op(&self, src_offset: u64, dst_offset: u64, len: u64) -> WriteOp {
        WriteOp {
            local: LocalRange {
                region: self.src_id,
                offset: src_offset,
                len,
            },
            remote: RemoteRange {
                region: self.dst_desc.id,
                key: self.dst_desc.key,
                offset: dst_offset,
            },
        }
    }

    fn set_fence(&self, generation: u64) -> Result<()> {
        Ok(self
            .d
            .set_write_fence(RegionId(self.fence_desc.id), FENCE_AT, generation)?)
    }

    fn write(
        &self,
        ops: Vec<WriteOp>,
        expected: u64,
        notif: Option<Vec<u8>>,
    ) -> Result<BatchStatus> {
        let b = self.p.post_write(
            self.peer,
            WriteBatch {
                ops,
                notif,
                fence: self.fence(expected),
            },
            LIMIT,
        )?;
        wait(&self.p, b)
    }
}

#[test]
fn a_write_lands_byte_exact_when_the_fence_holds_its_generation() -> Result<()> {
    let t = pair(4 << 20)?;
    t.set_fence(7)?;
    // One op over the 1 MiB chunk length (split and striped), two small ones.
    let ops = vec![
        t.op(0, 1 << 20, (2 << 20) + 123),
        t.op(3 << 20, 17, 4000),
        t.op(100, (3 << 20) + 500, 1),
    ];
    let status = t.write(ops.clone(), 7, Some(b"landed".to_vec()))?;
    let BatchStatus::Done(stats) = status else {
        anyhow::bail!("expected Done, got {status:?}");
    };
    ensure!(stats.ops == 3 && stats.bytes == (2 << 20) + 123 + 4000 + 1);
    for op in &ops {
        ensure!(
            bytes_of(t.dst.as_ref(), op.remote.offset, op.local.len)
                == bytes_of(t.src.as_ref(), op.local.offset, op.local.len),
            "bytes differ at destination offset {}",
            op.remote.offset
        );
    }
    // Nothing outside the written ranges changed.
    ensure!(bytes_of(t.dst.as_ref(), 0, 17).iter().all(|&b| b == 0));
    ensure!(bytes_of(t.dst.as_ref(), 4017, 1000).iter().all(|&b| b == 0));
    // The notification comes only after the writes landed.
    let got = poll_for(&t.d, 1);
    ensure!(
        got == vec![("p".to_owned(), vec![b"landed".to_vec()])],
        "{got:?}"
    );
    let stats = t.d.stats();
    ensure!(stats.writes_landed >= 3 && stats.bytes_landed == (2 << 20) + 123 + 4000 + 1);
    Ok(())
}

#[test]
fn a_write_after_the_receiver_cleared_the_fence_is_stale_and_lands_nothing() -> Result<()> {
    let t = pair(1 << 20)?;
    t.set_fence(3)?;
    ensure!(matches!(
        t.write(vec![t.op(0, 0, 4096)], 3, None)?,
        BatchStatus::Done(_)
    ));
    let before = bytes_of(t.dst.as_ref(), 0, 1 << 20);
    t.set_fence(0)?;
    let status = t.write(
        vec![t.op(4096, 0, 300_000), t.op(0, 500_000, 70)],
        3,
        Some(b"never".to_vec()),
    )?;
    ensure!(
        matches!(
            status,
            BatchStatus::Failed(TransferError::Stale { expected: 3, .. })
        ),
        "{status:?}"
    );
    ensure!(
        bytes_of(t.dst.as_ref(), 0, 1 << 20) == before,
        "a stale write landed"
    );
    // A write carrying another generation than the one published is refused too.
    t.set_fence(4)?;
    let status = t.write(vec![t.op(0, 0, 10)], 3, None)?;
    ensure!(matches!(
        status,
        BatchStatus::Failed(TransferError::Stale { .. })
    ));
    ensure!(bytes_of(t.dst.as_ref(), 0, 1 << 20) == before);
    ensure!(t.d.stats().writes_stale >= 2);
    std::thread::sleep(Duration::from_millis(50));
    ensure!(
        t.d.get_new_notifs().is_empty(),
        "a refused batch sent its notification"
    );
    Ok(())
}

/// Write grants are verbs access: an agent without a verbs backend grants nothing (the
/// fence word is checked first), and a TCP link ignores the grants a batch carries, its
/// receiver fencing the writes as ever.
#[test]
fn grants_are_verbs_access_and_a_tcp_receiver_fences_granted_writes_itself() -> Result<()> {
    let t = pair(1 << 20)?;
    t.set_fence(3)?;
    let dest = LocalRange {
        region: RegionId(t.dst_desc.id),
        offset: 0,
        len: 4096,
    };
    let fence = RegionId(t.fence_desc.id);
    match t.d.grant_write(fence, FENCE_AT, 4, dest) {
        Err(RegisterError::Grant { reason, .. }) => {
            ensure!(reason.contains("holds generation 3, not 4"), "{reason}");
        }
        other => anyhow::bail!("grant for an unpublished generation: {other:?}"),
    }
    match t.d.grant_write(fence, FENCE_AT, 3, dest) {
        Err(RegisterError::Grant { reason, .. }) => {
            ensure!(reason.contains("no verbs backend"), "{reason}");
        }
        other => anyhow::bail!("grant without verbs: {other:?}"),
    }
    ensure!(matches!(
        t.d.grant_write(RegionId(999), FENCE_AT, 3, dest),
        Err(RegisterError::Unknown(RegionId(999)))
    ));
    let grant = WriteGrant {
        region: t.dst_desc.id,
        offset: 0,
        len: 1 << 20,
        generation: 3,
        rkey: 1,
    };
    let batch = |expected| WriteBatch {
        ops: vec![t.op(0, 0, 4096)],
        notif: None,
        fence: t.fence(expected),
    };
    let id = t.p.post_write_granted(t.peer, batch(3), &[grant], LIMIT)?;
    ensure!(matches!(wait(&t.p, id)?, BatchStatus::Done(_)));
    ensure!(bytes_of(t.dst.as_ref(), 0, 4096) == bytes_of(t.src.as_ref(), 0, 4096));
    t.set_fence(0)?;
    let before = bytes_of(t.dst.as_ref(), 0, 1 << 20);
    t.src.write_from(0, &[0xee; 4096])?;
    let id = t.p.post_write_granted(t.peer, batch(3), &[grant], LIMIT)?;
    let status = wait(&t.p, id)?;
    ensure!(
        matches!(status, BatchStatus::Failed(TransferError::Stale { .. })),
        "{status:?}"
    );
    ensure!(bytes_of(t.dst.as_ref(), 0, 1 << 20) == before);
    Ok(())
}

#[test]
fn the_fence_setter_checks_its_word() -> Result<()> {
    let t = pair(4096)?;
    ensure!(t.d.set_write_fence(RegionId(9999), 0, 1).is_err());
    ensure!(
        t.d.set_write_fence(RegionId(t.fence_desc.id), 3, 1)
            .is_err(),
        "misaligned"
    );
    ensure!(
        t.d.set_write_fence(RegionId(t.fence_desc.id), 64, 1)
            .is_err(),
        "outside"
    );
    Ok(())
}

#[test]
fn no_destination_byte_changes_once_the_clear_returned() -> Result<()> {
    const SLOT: u64 = 256 * 1024;
    const WRITERS: u64 = 4;
    for round in 0..5u64 {
        let t = Arc::new(pair((SLOT * WRITERS) as usize)?);
        let generation = 10 + round;
        t.set_fence(generation)?;
        let stop = Arc::new(AtomicBool::new(false));
        let writers: Vec<_> = (0..WRITERS)
            .map(|w| {
                let (t, stop) = (t.clone(), stop.clone());
                std::thread::spawn(move || -> Result<u64> {
                    let mut stale = 0;
                    for i in 1u64.. {
                        if stop.load(Ordering::SeqCst) {
                            break;
                        }
                        // Fresh bytes for every write, so a late landing shows.
                        let stamp = (w << 40 | i).to_le_bytes().repeat((SLOT / 8) as usize);
                        t.src.write_from(w * SLOT, &stamp)?;
                        let op = t.op(w * SLOT, w * SLOT, SLOT);
                        match t.write(vec![op], generation, None)? {
                            BatchStatus::Done(_) => {}
                            BatchStatus::Failed(TransferError::Stale { .. }) => stale += 1,
                            other => anyhow::bail!("unexpected {other:?}"),
                        }
                    }
                    Ok(stale)
                })
            })
            .collect();
        // Clear while writes stream in: after a few landed, at a different point each round.
        let until = |what: &str, done: &dyn Fn() -> bool| -> Result<()> {
            let start = std::time::Instant::now();
            while !done() {
                ensure!(start.elapsed() < LIMIT, "{what} within {LIMIT:?}");
                std::thread::sleep(Duration::from_millis(1));
            }
            Ok(())
        };
        until("writes landing", &|| {
            t.d.stats().writes_landed >= 4 * (round + 1)
        })?;
        t.set_fence(0)?;
        let after_clear = bytes_of(t.dst.as_ref(), 0, SLOT * WRITERS);
        let landed = t.d.stats().writes_landed;
        // Every writer meets the cleared fence at least once before they stop.
        until("stale writes", &|| t.d.stats().writes_stale >= 2 * WRITERS)?;
        stop.store(true, Ordering::SeqCst);
        let mut stale = 0;
        for w in writers {
            stale += w.join().expect("writer thread")?;
        }
        ensure!(landed > 0, "no write landed before the clear");
        ensure!(stale > 0, "no write was refused after the clear");
        ensure!(
            bytes_of(t.dst.as_ref(), 0, SLOT * WRITERS) == after_clear,
            "a destination byte changed after the clear returned (round {round})"
        );
        ensure!(
            t.d.stats().writes_landed == landed,
            "a write landed after the clear"
        );
    }
    Ok(())
}

#[test]
fn a_write_to_a_peer_that_stops_reading_times_out_and_gives_the_source_back() -> Result<()> {
    // The peer takes the connections and then reads nothing: the payload fills the
    // socket and the writer thread blocks mid-frame until the timeout shuts it down.
    let (meta, desc, peer_thread) = common::fake_peer("stalled", |data| {
        std::thread::sleep(Duration::from_secs(3));
        drop(data);
    })?;
    let p = common::single_conn("p")?;
    let src = RegionId(p.register(filled(32 << 20, 5))?.id);
    let peer = p.connect(&meta)?;
    let batch = WriteBatch {
        ops: vec![WriteOp {
            local: LocalRange {
                region: src,
                offset: 0,
                len: 32 << 20,
            },
            remote: desc.at(0),
        }],
        notif: Some(b"never".to_vec()),
        fence: WriteFence {
            remote: desc.at(0),
            expected: 1,
        },
    };
    let started = std::time::Instant::now();
    let id = p.post_write(peer, batch, Duration::from_millis(300))?;
    let status = wait(&p, id)?;
    ensure!(
        matches!(status, BatchStatus::Failed(TransferError::Timeout { .. })),
        "{status:?}"
    );
    ensure!(
        started.elapsed() < Duration::from_secs(3),
        "the timeout did not cut the write short"
    );
    peer_thread.join().expect("fake peer");
    Ok(())
}

// ---- hand-written write frames ----

/// A destination: region, key, offset.
type Dest = (u64, u64, u64);
/// A fence: region, key, offset, expected generation.
type Fence = (u64, u64, u64, u64);

fn write_req(req: u64, dst: Dest, len: u64, fence: Fence, payload: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    for v in [
        req, dst.0, dst.1, dst.2, len, fence.0, fence.1, fence.2, fence.3,
    ] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    let mut f = frame(WRITE_REQ, &b);
    f.extend_from_slice(payload);
    f
}

/// The answer to a write: `Ok(())` for `WRITE_ACK`, `Err(code)` for `WRITE_ERR`.
fn answer(s: &mut TcpStream, req: u64) -> Result<Result<(), u8>> {
    let (ty, body) = read_frame(s)?;
    ensure!(body[..8] == req.to_le_bytes(), "answer to another request");
    match ty {
        WRITE_ACK => Ok(Ok(())),
        WRITE_ERR => Ok(Err(body[8])),
        _ => anyhow::bail!("unexpected frame type {ty}"),
    }
}

/// D with a destination, a fence region holding `generation` at `FENCE_AT`, and a raw
/// connection to it (authenticated when `auth`).
fn raw_target(
    len: usize,
    generation: u64,
    auth: bool,
) -> Result<(Agent, Arc<HostRegion>, RegionDesc, RegionDesc, TcpStream)> {
    let d = agent("d");
    let dst = Arc::new(HostRegion::new(len)?);
    let dst_desc = d.register(dst.clone())?;
    let fence_desc = d.register(Arc::new(HostRegion::new(64)?))?;
    d.set_write_fence(RegionId(fence_desc.id), FENCE_AT, generation)?;
    let mut s = raw(&d)?;
    if auth {
        handshake_raw(&mut s, "p", 0)?;
    }
    Ok((d, dst, dst_desc, fence_desc, s))
}

#[test]
fn refused_write_frames_land_nothing_and_the_connection_serves_on() -> Result<()> {
    let (d, dst, dd, fd, mut s) = raw_target(4096, 5, false)?;
    let fence = (fd.id, fd.key, FENCE_AT, 5);
    let payload = vec![0xAB; 100];
    // Unauthenticated: refused, payload skipped, the connection still answers.
    s.write_all(&write_req(1, (dd.id, dd.key, 0), 100, fence, &payload))?;
    ensure!(answer(&mut s, 1)? == Err(1), "unauthenticated");
    handshake_raw(&mut s, "p", 0)?;
    let cases: Vec<(u64, Dest, u64, Fence, u8)> = vec![
        // Past the end of the destination.
        (2, (dd.id, dd.key, 4000), 100, fence, 4),
        // Offset overflowing.
        (3, (dd.id, dd.key, u64::MAX - 10), 100, fence, 4),
        // Unknown destination, wrong key.
        (4, (dd.id + 100, dd.key, 0), 100, fence, 2),
        (5, (dd.id, dd.key ^ 1, 0), 100, fence, 3),
        // Unknown fence region, wrong fence key, fence word outside or misaligned.
        (
            6,
            (dd.id, dd.key, 0),
            100,
            (fd.id + 100, fd.key, FENCE_AT, 5),
            2,
        ),
        (
            7,
            (dd.id, dd.key, 0),
            100,
            (fd.id, fd.key ^ 1, FENCE_AT, 5),
            3,
        ),
        (8, (dd.id, dd.key, 0), 100, (fd.id, fd.key, 60, 5), 4),
        (9, (dd.id, dd.key, 0), 100, (fd.id, fd.key, 4, 5), 4),
        // Stale generation.
        (10, (dd.id, dd.key, 0), 100, (fd.id, fd.key, FENCE_AT, 4), 7),
    ];
    for (req, dst_range, len, fence, code) in cases {
        s.write_all(&write_req(req, dst_range, len, fence, &payload))?;
        ensure!(
            answer(&mut s, req)? == Err(code),
            "request {req}: expected code {code}"
        );
    }
    ensure!(
        bytes_of(dst.as_ref(), 0, 4096).iter().all(|&b| b == 0),
        "a refused write landed"
    );
    // The connection still lands a good write.
    s.write_all(&write_req(11, (dd.id, dd.key, 10), 100, fence, &payload))?;
    ensure!(answer(&mut s, 11)? == Ok(()));
    ensure!(bytes_of(dst.as_ref(), 10, 100) == payload);
    let stats = d.stats();
    ensure!(stats.writes_refused == 10 && stats.writes_stale == 1 && stats.writes_landed == 1);
    Ok(())
}

#[test]
fn oversized_and_malformed_write_frames_close_the_connection() -> Result<()> {
    // A write over the receiver's bound: refused without reading its payload, closed.
    let (d, dst, dd, fd, mut s) = raw_target(4096, 5, true)?;
    let fence = (fd.id, fd.key, FENCE_AT, 5);
    s.write_all(&write_req(
        1,
        (dd.id, dd.key, 0),
        u64::MAX,
        fence,
        &[1; 1000],
    ))?;
    ensure!(answer(&mut s, 1)? == Err(6));
    ensure!(
        common::closed(&mut s),
        "connection left open after an oversized write"
    );
    // The same before authentication.
    let mut s = raw(&d)?;
    s.write_all(&write_req(2, (dd.id, dd.key, 0), 1 << 40, fence, &[1; 10]))?;
    ensure!(answer(&mut s, 2)? == Err(6));
    ensure!(common::closed(&mut s));
    // A WRITE_REQ body of the wrong length, and a truncated one.
    for body_len in [40usize, 80] {
        let mut s = raw(&d)?;
        handshake_raw(&mut s, "p", 0)?;
        s.write_all(&frame(WRITE_REQ, &vec![0; body_len]))?;
        ensure!(common::closed(&mut s), "body of {body_len} bytes accepted");
    }
    // A write whose payload never fully arrives lands nothing.
    let mut s = raw(&d)?;
    handshake_raw(&mut s, "p", 0)?;
    let f = write_req(3, (dd.id, dd.key, 0), 1000, fence, &[9; 500]);
    s.write_all(&f)?;
    drop(s);
    std::thread::sleep(Duration::from_millis(100));
    ensure!(bytes_of(dst.as_ref(), 0, 4096).iter().all(|&b| b == 0));
    ensure!(d.stats().writes_landed == 0);
    ensure!(d.stats().malformed_frames >= 3);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Random write frames against a model: a write lands exactly when its regions and
    /// keys are right, both ranges lie inside and the fence holds its generation; the
    /// destination equals the model after each answer.
    #[test]
    fn random_write_frames_match_the_model(
        writes in proptest::collection::vec(
            (0u8..4, 0u64..5000, 0u64..3000, 0u8..4, 0u64..70, 0u64..3, any::<u8>()),
            1..12,
        )
    ) {
        let (_d, dst, dd, fd, mut s) = raw_target(4096, 1, true).expect("target");
        let mut model = vec![0u8; 4096];
        for (i, (region, offset, len, fregion, foffset, expected, byte)) in
            writes.into_iter().enumerate()
        {
            let req = i as u64 + 1;
            let dst_range = match region {
                0 => (dd.id, dd.key ^ 1, offset),
                1 => (dd.id + 50, dd.key, offset),
                _ => (dd.id, dd.key, offset),
            };
            let fence = match fregion {
                0 => (fd.id, fd.key ^ 1, foffset, expected),
                _ => (fd.id, fd.key, foffset, expected),
            };
            let payload = vec![byte; len as usize];
            s.write_all(&write_req(req, dst_range, len, fence, &payload)).expect("send");
            let got = answer(&mut s, req).expect("answer");
            // The fence region's other words hold 0.
            let word = u64::from(foffset == FENCE_AT);
            let lands = region >= 2
                && fregion >= 1
                && offset + len <= 4096
                && foffset % 8 == 0
                && foffset + 8 <= 64
                && expected == word;
            prop_assert_eq!(got.is_ok(), lands, "write {}: {:?}", req, got);
            if lands {
                model[offset as usize..(offset + len) as usize].fill(byte);
            }
            prop_assert!(bytes_of(dst.as_ref(), 0, 4096) == model);
        }
    }
}
