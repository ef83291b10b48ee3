//! The TCP backend's notifications: FIFO per peer, size limits, and the notification
//! connection (ordering, split frames, malformed frames, authentication, back-pressure,
//! disconnect).

mod common;

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use kvlease_gpu_mem::HostRegion;
use kvlease_transport::{Agent, BatchStatus, ReadBatch, RegionId, TransferError};

use common::{
    LIMIT, NOTIF_CONN, agent, bytes_of, closed, config, filled, frame, handshake_raw, hello_at,
    notifs_from, one_read, poll_for, raw, read_frame, wait,
};

#[test]
fn notifs_are_fifo_per_peer_grouped_and_size_limited() -> Result<()> {
    let p = agent("p");
    let mut c = config("d1", None);
    c.limits.max_notif_len = 1000;
    let d1 = Agent::new(c)?;
    let d2 = agent("d2");
    let p1 = d1.connect(&p.metadata())?;
    let p2 = d2.connect(&p.metadata())?;
    for i in 0..300u32 {
        d1.send_notif(p1, format!("a{i}").into_bytes())?;
        if i % 3 == 0 {
            d2.send_notif(p2, format!("b{i}").into_bytes())?;
        }
    }
    let err = d1
        .send_notif(p1, vec![b'x'; 1001])
        .expect_err("over the limit");
    ensure!(
        matches!(
            err,
            TransferError::NotifTooLarge {
                len: 1001,
                max: 1000,
                ..
            }
        ),
        "{err}"
    );
    d1.send_notif(p1, vec![b'y'; 1000])?;
    let got = notifs_from(&p, 301 + 100);
    ensure!(got.len() == 2);
    let a = &got.iter().find(|(n, _)| n == "d1").expect("d1 group").1;
    let b = &got.iter().find(|(n, _)| n == "d2").expect("d2 group").1;
    let mut want_a: Vec<Vec<u8>> = (0..300).map(|i| format!("a{i}").into_bytes()).collect();
    want_a.push(vec![b'y'; 1000]);
    ensure!(*a == want_a, "d1's notifications out of order");
    ensure!(
        *b == (0..300)
            .step_by(3)
            .map(|i| format!("b{i}").into_bytes())
            .collect::<Vec<_>>()
    );
    ensure!(p.get_new_notifs().is_empty(), "drained");
    // A batch notification over the limit is refused before anything is posted.
    let err = d1
        .post_read(
            p1,
            ReadBatch {
                ops: vec![],
                notif: Some(vec![0; 1001]),
                fence: None,
            },
            LIMIT,
        )
        .expect_err("invalid");
    ensure!(matches!(
        err,
        TransferError::InvalidBatch { .. } | TransferError::NotifTooLarge { .. }
    ));
    Ok(())
}

#[test]
fn notifications_ride_their_own_connection_in_order_and_whole() -> Result<()> {
    let p = agent("p");
    let d1 = agent("d1");
    let d2 = agent("d2");
    let p1 = d1.connect(&p.metadata())?;
    let p2 = d2.connect(&p.metadata())?;
    // Nobody reads the notification connection but the poll: nothing is delivered
    // before it runs, however long we wait.
    d1.send_notif(p1, b"first".to_vec())?;
    std::thread::sleep(Duration::from_millis(50));
    ensure!(p.stats().notifs_received == 0, "{:?}", p.stats());
    ensure!(poll_for(&p, 1) == vec![("d1".to_owned(), vec![b"first".to_vec()])]);
    // Many messages from two senders, interleaved with polls on P, among them
    // notifications of the largest allowed size (64 KiB: split over several reads).
    let big = |i: u32| -> Vec<u8> {
        let mut v = vec![(i % 251) as u8; kvlease_transport::DEFAULT_MAX_NOTIF_LEN];
        v[..4].copy_from_slice(&i.to_le_bytes());
        v
    };
    let mut want1 = Vec::new();
    let mut want2 = Vec::new();
    let mut got: Vec<(String, Vec<Vec<u8>>)> = Vec::new();
    let collect = |got: &mut Vec<(String, Vec<Vec<u8>>)>| {
        for (peer, msgs) in p.get_new_notifs() {
            match got.iter_mut().find(|(q, _)| *q == peer) {
                Some((_, m)) => m.extend(msgs),
                None => got.push((peer, msgs)),
            }
        }
    };
    for i in 0..3000u32 {
        let m1 = if i % 100 == 7 {
            big(i)
        } else {
            format!("a{i}").into_bytes()
        };
        d1.send_notif(p1, m1.clone())?;
        want1.push(m1);
        if i % 3 == 0 {
            let m2 = format!("b{i}").into_bytes();
            d2.send_notif(p2, m2.clone())?;
            want2.push(m2);
        }
        if i % 50 == 0 {
            collect(&mut got);
        }
    }
    let start = Instant::now();
    while got.iter().map(|(_, m)| m.len()).sum::<usize>() < want1.len() + want2.len()
        && start.elapsed() < LIMIT
    {
        collect(&mut got);
        // The senders write on what their sockets did not take.
        d1.get_new_notifs();
        d2.get_new_notifs();
        std::thread::sleep(Duration::from_micros(200));
    }
    let of = |name: &str| got.iter().find(|(q, _)| q == name).map(|(_, m)| m.clone());
    ensure!(
        of("d1") == Some(want1),
        "d1's notifications whole and in order"
    );
    ensure!(
        of("d2") == Some(want2),
        "d2's notifications whole and in order"
    );
    ensure!(p.stats().malformed_frames == 0 && p.stats().notifs_dropped_overflow == 0);
    Ok(())
}

#[test]
fn a_frame_split_over_many_reads_is_delivered_once_whole() -> Result<()> {
    let p = agent("p");
    let mut s = raw(&p)?;
    handshake_raw(&mut s, "slow", NOTIF_CONN)?;
    let body: Vec<u8> = (0..50_000u32).map(|i| (i % 253) as u8).collect();
    let mut bytes = frame(8, &body);
    bytes.extend_from_slice(&frame(8, b"next"));
    // The header itself arrives in two pieces, the body in many.
    // The last piece completes the large frame (one byte short before it) and brings
    // the next one.
    let cuts = [0, 3, 7, 1000, 20_000, 49_000, body.len() + 4, bytes.len()];
    for w in cuts.windows(2) {
        ensure!(
            p.get_new_notifs().is_empty(),
            "delivered before it was whole"
        );
        s.write_all(&bytes[w[0]..w[1]])?;
        s.flush()?;
        // Give the bytes time to cross loopback, so that each piece is a read of its own.
        std::thread::sleep(Duration::from_millis(20));
    }
    let got = poll_for(&p, 2);
    ensure!(
        got == vec![("slow".to_owned(), vec![body, b"next".to_vec()])],
        "one whole notification, then the next"
    );
    ensure!(p.stats().malformed_frames == 0);
    Ok(())
}

#[test]
fn a_malformed_frame_closes_only_its_notification_connection() -> Result<()> {
    let mut c = config("p", None);
    c.limits.max_notif_len = 1024;
    let p = Agent::new(c)?;
    let src = filled(4096, 3);
    let desc = p.register(src.clone())?;
    let d = agent("d");
    let peer = d.connect(&p.metadata())?;
    let cases: Vec<Vec<u8>> = vec![
        frame(8, &[0; 1025]),            // over max_notif_len
        frame(5, &[0; 40]),              // a READ_REQ: only NOTIF travels here
        vec![8, 0xff, 0xff, 0xff, 0x7f], // absurd length
        frame(99, b"x"),                 // unknown type
    ];
    for (i, bad) in cases.iter().enumerate() {
        let mut s = raw(&p)?;
        let name = format!("m{i}");
        handshake_raw(&mut s, &name, NOTIF_CONN)?;
        let mut bytes = frame(8, b"fine");
        bytes.extend_from_slice(bad);
        bytes.extend_from_slice(&frame(8, b"never"));
        s.write_all(&bytes)?;
        d.send_notif(peer, format!("d{i}").into_bytes())?;
        let got = poll_for(&p, 2);
        ensure!(
            got.contains(&(name.clone(), vec![b"fine".to_vec()])),
            "case {i}: the frame before the bad one is delivered: {got:?}"
        );
        ensure!(
            got.contains(&("d".to_owned(), vec![format!("d{i}").into_bytes()])),
            "case {i}: the other peer is still heard: {got:?}"
        );
        ensure!(closed(&mut s), "case {i}: connection stays open");
        ensure!(
            p.stats().malformed_frames == i as u64 + 1,
            "case {i}: {:?}",
            p.stats()
        );
        ensure!(
            p.get_new_notifs().is_empty(),
            "case {i}: nothing after the bad frame"
        );
    }
    // D's link still works both ways: notifications and reads.
    d.send_notif(peer, b"still".to_vec())?;
    ensure!(poll_for(&p, 1) == vec![("d".to_owned(), vec![b"still".to_vec()])]);
    let dst = Arc::new(HostRegion::new(4096)?);
    let dst_id = RegionId(d.register(dst.clone())?.id);
    let id = d.post_read(peer, one_read(dst_id, 4096, desc.at(0)), LIMIT)?;
    ensure!(matches!(wait(&d, id)?, BatchStatus::Done(_)));
    ensure!(bytes_of(&*dst, 0, 4096) == bytes_of(&*src, 0, 4096));
    Ok(())
}

#[test]
fn an_unauthenticated_notification_connection_delivers_nothing() -> Result<()> {
    let p = Agent::new(config("p", Some(b"secret")))?;
    // A failed proof on a notification connection: its notifications are dropped and
    // counted, the connection is never handed to the poll.
    let mut s = raw(&p)?;
    s.write_all(&hello_at("mallory", NOTIF_CONN))?;
    let (ty, _) = read_frame(&mut s)?;
    ensure!(ty == 2, "CHALLENGE");
    let mut proof = vec![32];
    proof.extend_from_slice(&[0xAB; 32]);
    s.write_all(&frame(3, &proof))?;
    let (ty, body) = read_frame(&mut s)?;
    ensure!(ty == 4 && body[0] == 0, "AUTH_RESULT not ok");
    s.write_all(&frame(8, b"HB:forged"))?;
    // No handshake at all.
    let mut s2 = raw(&p)?;
    s2.write_all(&frame(8, b"HB:forged2"))?;
    let deadline = Instant::now() + LIMIT;
    while p.stats().notifs_dropped_unauthenticated < 2 && Instant::now() < deadline {
        ensure!(
            p.get_new_notifs().is_empty(),
            "a forged notification was delivered"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    ensure!(
        p.stats().notifs_dropped_unauthenticated == 2,
        "{:?}",
        p.stats()
    );
    ensure!(p.stats().auth_failures == 1);
    ensure!(p.get_new_notifs().is_empty());
    // A peer with another token does not get a link at all; the right one does.
    let wrong = Agent::new(config("d-wrong", Some(b"other")))?;
    ensure!(wrong.connect(&p.metadata()).is_err());
    let good = Agent::new(config("d", Some(b"secret")))?;
    let peer = good.connect(&p.metadata())?;
    good.send_notif(peer, b"hello".to_vec())?;
    ensure!(poll_for(&p, 1) == vec![("d".to_owned(), vec![b"hello".to_vec()])]);
    Ok(())
}

#[test]
fn a_receiver_that_never_polls_gets_the_sender_a_typed_error_not_a_hang() -> Result<()> {
    let p = agent("p");
    let src = filled(4096, 8);
    let desc = p.register(src.clone())?;
    let mut c = config("d", None);
    c.limits.max_queued_notif_bytes = 256 << 10;
    let d = Agent::new(c)?;
    let peer = d.connect(&p.metadata())?;
    // P does not poll: the socket buffers fill, then D's queue; then sends are refused.
    let msg = |i: u32| -> Vec<u8> {
        let mut v = vec![7; 16 << 10];
        v[..4].copy_from_slice(&i.to_le_bytes());
        v
    };
    let mut accepted = Vec::new();
    let full = loop {
        // Kernel buffers on loopback hold a few MiB at most; 64 MiB is far beyond.
        ensure!(
            accepted.len() < 4096,
            "64 MiB of notifications accepted unread"
        );
        let i = accepted.len() as u32;
        match d.send_notif(peer, msg(i)) {
            Ok(()) => accepted.push(msg(i)),
            Err(e) => break e,
        }
    };
    ensure!(
        matches!(
            &full,
            TransferError::NotifQueueFull { peer, max, .. } if peer == "p" && *max == 256 << 10
        ),
        "{full:?}"
    );
    // A batch whose notification does not fit fails with the same error, after its reads.
    let dst = Arc::new(HostRegion::new(4096)?);
    let dst_id = RegionId(d.register(dst.clone())?.id);
    let mut batch = one_read(dst_id, 4096, desc.at(0));
    // As large as the notification refused above, so that it cannot fit either.
    batch.notif = Some(vec![9; 16 << 10]);
    let id = d.post_read(peer, batch, LIMIT)?;
    match wait(&d, id)? {
        BatchStatus::Failed(TransferError::NotifQueueFull { .. }) => {}
        other => bail!("batch: {other:?}"),
    }
    ensure!(bytes_of(&*dst, 0, 4096) == bytes_of(&*src, 0, 4096));
    // P polls at last, D writes on its queue as it polls: every accepted notification
    // arrives, in order; the refused ones never do.
    let start = Instant::now();
    let mut got = Vec::new();
    while got.len() < accepted.len() && start.elapsed() < LIMIT {
        for (_, msgs) in p.get_new_notifs() {
            got.extend(msgs);
        }
        d.get_new_notifs();
        std::thread::sleep(Duration::from_micros(200));
    }
    ensure!(
        got.len() == accepted.len(),
        "{} of {}",
        got.len(),
        accepted.len()
    );
    ensure!(got == accepted, "in order");
    // The link is healthy again.
    d.send_notif(peer, b"after".to_vec())?;
    ensure!(poll_for(&p, 1) == vec![("d".to_owned(), vec![b"after".to_vec()])]);
    Ok(())
}

#[test]
fn disconnect_and_drop_close_the_notification_connection() -> Result<()> {
    // P serves two inbound connections at most: one link (a data connection and the
    // notification connection). Another link fits only once the first one is closed.
    let mut c = config("p", None);
    c.limits.max_inbound_connections = 2;
    let p = Agent::new(c)?;
    let single = |name: &str| -> Result<Agent> {
        let mut c = config(name, None);
        c.num_connections = 1;
        Ok(Agent::new(c)?)
    };
    let connect_when_free = |d: &Agent| -> Result<kvlease_transport::PeerId> {
        let start = Instant::now();
        loop {
            // The poll reaps notification connections the peer closed.
            p.get_new_notifs();
            match d.connect(&p.metadata()) {
                Ok(peer) => return Ok(peer),
                Err(e) if start.elapsed() > LIMIT => bail!("never connected: {e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    };
    let d1 = single("d1")?;
    let peer = d1.connect(&p.metadata())?;
    d1.send_notif(peer, b"one".to_vec())?;
    ensure!(poll_for(&p, 1) == vec![("d1".to_owned(), vec![b"one".to_vec()])]);
    let d2 = single("d2")?;
    ensure!(d2.connect(&p.metadata()).is_err(), "P is full");
    // disconnect closes both of d1's connections.
    d1.disconnect(peer)?;
    ensure!(matches!(
        d1.send_notif(peer, b"x".to_vec()),
        Err(TransferError::UnknownPeer(_))
    ));
    let peer2 = connect_when_free(&d2)?;
    d2.send_notif(peer2, b"two".to_vec())?;
    ensure!(poll_for(&p, 1) == vec![("d2".to_owned(), vec![b"two".to_vec()])]);
    // Dropping the agent closes them too.
    drop(d2);
    let d3 = single("d3")?;
    let peer3 = connect_when_free(&d3)?;
    d3.send_notif(peer3, b"three".to_vec())?;
    ensure!(poll_for(&p, 1) == vec![("d3".to_owned(), vec![b"three".to_vec()])]);
    // Dropping the receiver closes its side: the sender's writes fail before long.
    drop(p);
    let start = Instant::now();
    loop {
        match d3.send_notif(peer3, b"anyone?".to_vec()) {
            Err(TransferError::Disconnected { .. }) => break,
            Err(e) => bail!("{e}"),
            Ok(()) if start.elapsed() > LIMIT => bail!("sends still succeed"),
            Ok(()) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
    Ok(())
}
