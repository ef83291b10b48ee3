//! The shared-memory backend: agents on one host, real sockets, a second process.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixStream};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use kvlease_gpu_mem::{
    DmaRegion, ForeignRegion, HostRegion, RegionBytes, recv_with_fds, send_with_fds,
};
use kvlease_transport::metadata::decode_metadata;
use kvlease_transport::{
    Agent, AgentConfig, Backend, BackendChoice, BatchStatus, CmaPolicy, ConnectError, FenceRead,
    LocalRange, ReadBatch, ReadOp, Refusal, RegionDesc, RegionId, TransferError,
};

mod common;
use common::{LIMIT, bytes_of, wait};

fn agent(name: &str, backend: BackendChoice, token: Option<&[u8]>) -> Agent {
    let mut c = AgentConfig::new(name);
    c.backend = backend;
    c.auth_token = token.map(<[u8]>::to_vec);
    Agent::new(c).expect("agent binds on loopback")
}

fn agent_cma(name: &str, cma: CmaPolicy) -> Agent {
    let mut c = AgentConfig::new(name);
    c.auth_token = Some(b"tok".to_vec());
    c.cma = cma;
    Agent::new(c).expect("agent binds on loopback")
}

/// Plain heap memory (not memfd-backed, as a buffer registered from Python is), filled.
fn heap(len: usize, seed: u64) -> Arc<ForeignRegion> {
    let bytes = (0..len).map(|i| pattern(seed, i)).collect();
    Arc::new(ForeignRegion::from_heap(bytes).expect("not empty"))
}

/// Posts `batch` and waits for it.
fn run(d: &Agent, peer: kvlease_transport::PeerId, batch: ReadBatch) -> Result<BatchStatus> {
    let id = d.post_read(peer, batch, LIMIT)?;
    wait(d, id)
}

fn pattern(seed: u64, i: usize) -> u8 {
    ((i as u64).wrapping_mul(seed | 1) >> 3) as u8 ^ (i % 251) as u8
}

fn filled(len: usize, seed: u64) -> Arc<HostRegion> {
    let r = HostRegion::new(len).expect("host memory");
    let bytes: Vec<u8> = (0..len).map(|i| pattern(seed, i)).collect();
    r.write_from(0, &bytes).expect("in bounds");
    Arc::new(r)
}

fn notifs(agent: &Agent, want: usize, within: Duration) -> Vec<Vec<u8>> {
    let start = Instant::now();
    let mut all = Vec::new();
    while all.len() < want && start.elapsed() < within {
        for (_, msgs) in agent.get_new_notifs() {
            all.extend(msgs);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    all
}

fn read(dst: RegionId, dst_offset: u64, len: u64, desc: &RegionDesc, offset: u64) -> ReadOp {
    ReadOp {
        local: LocalRange {
            region: dst,
            offset: dst_offset,
            len,
        },
        remote: desc.at(offset),
    }
}

#[test]
fn auto_picks_shm_on_one_host_and_moves_bytes_exactly() -> Result<()> {
    let p = agent("p", BackendChoice::Auto, Some(b"cluster"));
    let src = filled(12 << 20, 7);
    let desc = p.register(src.clone())?;
    let fence = Arc::new(HostRegion::new(4096)?);
    fence.store_u64(64, 3)?;
    let fence_desc = p.register(fence)?;

    let d = agent("d", BackendChoice::Auto, Some(b"cluster"));
    let dst = Arc::new(HostRegion::new(12 << 20)?);
    let dst_id = RegionId(d.register(dst.clone())?.id);
    let peer = d.connect(&p.metadata())?;
    let (backend, why) = d.peer_backend(peer).context("connected")?;
    ensure!(backend == Backend::Shm, "auto picked {backend}: {why}");
    // P connects back for notifications, as the agents do.
    let _back = p.connect(&d.metadata())?;

    // A small batch (copied by the poster) and a large one (split with the copy pool on
    // a host of more than one core), odd offsets.
    for (ops, total) in [
        (vec![read(dst_id, 3, 5000, &desc, 11)], 5000u64),
        (
            (0..10u64)
                .map(|i| {
                    read(
                        dst_id,
                        i * ((1 << 20) + 100) + 1,
                        (1 << 20) + 77,
                        &desc,
                        i * 999_983,
                    )
                })
                .collect(),
            10 * ((1 << 20) + 77),
        ),
    ] {
        let batch = ReadBatch {
            ops: ops.clone(),
            notif: Some(b"done".to_vec()),
            fence: Some(FenceRead {
                remote: fence_desc.at(64),
                expected: 3,
            }),
        };
        let id = d.post_read(peer, batch, LIMIT)?;
        // The copies run on the posting thread (with the pool's for the large batch):
        // the batch is complete when post_read returns.
        let status = d.poll_batch(id)?;
        ensure!(
            !matches!(status, BatchStatus::Pending),
            "{total} bytes: still pending after post_read returned"
        );
        match status {
            BatchStatus::Done(stats) => {
                ensure!(stats.backend == Backend::Shm, "{stats:?}");
                ensure!(
                    stats.bytes == total && stats.fence_word == Some(3),
                    "{stats:?}"
                );
            }
            other => bail!("batch ended {other:?}"),
        }
        for op in &ops {
            ensure!(
                bytes_of(dst.as_ref(), op.local.offset, op.local.len)
                    == bytes_of(src.as_ref(), op.remote.offset, op.local.len),
                "bytes differ for {op:?}"
            );
        }
        ensure!(notifs(&p, 1, LIMIT) == vec![b"done".to_vec()]);
    }
    // Nothing went through P's TCP server.
    ensure!(p.stats().reads_served == 0, "{:?}", p.stats());
    Ok(())
}

#[test]
fn a_changed_fence_fails_the_batch_and_sends_no_notification() -> Result<()> {
    let p = agent("p", BackendChoice::Auto, None);
    let src = filled(1 << 20, 3);
    let desc = p.register(src)?;
    let fence = Arc::new(HostRegion::new(4096)?);
    fence.store_u64(0, 9)?;
    let fence_desc = p.register(fence)?;
    let d = agent("d", BackendChoice::Shm, None);
    let dst = Arc::new(HostRegion::new(1 << 20)?);
    let dst_id = RegionId(d.register(dst)?.id);
    let peer = d.connect(&p.metadata())?;
    let _back = p.connect(&d.metadata())?;
    let batch = ReadBatch {
        ops: vec![read(dst_id, 0, 4096, &desc, 0)],
        notif: Some(b"never".to_vec()),
        fence: Some(FenceRead {
            remote: fence_desc.at(0),
            expected: 8,
        }),
    };
    let id = d.post_read(peer, batch, LIMIT)?;
    match wait(&d, id)? {
        BatchStatus::Failed(TransferError::FenceMismatch {
            expected: 8,
            found: 9,
            ..
        }) => {}
        other => bail!("expected a fence mismatch, got {other:?}"),
    }
    ensure!(notifs(&p, 1, Duration::from_millis(300)).is_empty());
    Ok(())
}

#[test]
fn out_of_bounds_and_wrong_key_reads_are_refused() -> Result<()> {
    let p = agent("p", BackendChoice::Auto, None);
    let desc = p.register(filled(1 << 20, 5))?;
    let d = agent("d", BackendChoice::Auto, None);
    let dst = Arc::new(HostRegion::new(1 << 20)?);
    let dst_id = RegionId(d.register(dst)?.id);
    let peer = d.connect(&p.metadata())?;
    ensure!(d.peer_backend(peer).map(|b| b.0) == Some(Backend::Shm));
    let cases = [
        (
            read(dst_id, 0, 2, &desc, (1 << 20) - 1),
            Refusal::OutOfBounds,
        ),
        (
            ReadOp {
                remote: kvlease_transport::RemoteRange {
                    key: desc.key ^ 1,
                    ..desc.at(0)
                },
                ..read(dst_id, 0, 16, &desc, 0)
            },
            Refusal::BadKey,
        ),
    ];
    for (op, want) in cases {
        let batch = ReadBatch {
            ops: vec![read(dst_id, 0, 8, &desc, 0), op],
            notif: None,
            fence: None,
        };
        let id = d.post_read(peer, batch, LIMIT)?;
        match wait(&d, id)? {
            BatchStatus::Failed(TransferError::Refused { reason, .. }) if reason == want => {}
            other => bail!("expected {want:?}, got {other:?}"),
        }
    }
    // A fence outside the region is refused too.
    let batch = ReadBatch {
        ops: vec![read(dst_id, 0, 8, &desc, 0)],
        notif: None,
        fence: Some(FenceRead {
            remote: desc.at(1 << 20),
            expected: 0,
        }),
    };
    let id = d.post_read(peer, batch, LIMIT)?;
    match wait(&d, id)? {
        BatchStatus::Failed(TransferError::Refused {
            reason: Refusal::OutOfBounds,
            ..
        }) => Ok(()),
        other => bail!("expected a refused fence, got {other:?}"),
    }
}

#[test]
fn a_peer_on_another_host_gets_tcp_and_shm_only_refuses_it() -> Result<()> {
    let p = agent("p", BackendChoice::Auto, None);
    let src = filled(1 << 20, 9);
    let desc = p.register(src.clone())?;
    let mut meta: serde_json::Value = serde_json::from_slice(&p.metadata())?;
    meta["backends"]["shm"]["host"] = "another-boot-id/net:[1]".into();
    let meta = serde_json::to_vec(&meta)?;
    decode_metadata(&meta)?;

    let d = agent("d", BackendChoice::Auto, None);
    let dst = Arc::new(HostRegion::new(1 << 20)?);
    let dst_id = RegionId(d.register(dst.clone())?.id);
    let peer = d.connect(&meta)?;
    let (backend, why) = d.peer_backend(peer).context("connected")?;
    ensure!(backend == Backend::Tcp, "{backend}: {why}");
    ensure!(why.contains("another host"), "{why}");
    let id = d.post_read(
        peer,
        ReadBatch {
            ops: vec![read(dst_id, 0, 1000, &desc, 5)],
            ..ReadBatch::default()
        },
        LIMIT,
    )?;
    match wait(&d, id)? {
        BatchStatus::Done(stats) => ensure!(stats.backend == Backend::Tcp),
        other => bail!("{other:?}"),
    }
    ensure!(bytes_of(dst.as_ref(), 0, 1000) == bytes_of(src.as_ref(), 5, 1000));

    let strict = agent("d-strict", BackendChoice::Shm, None);
    match strict.connect(&meta) {
        Err(ConnectError::BackendUnavailable {
            backend: Backend::Shm,
            ..
        }) => {}
        other => bail!("shm-only to another host: {other:?}"),
    }
    // A TCP-only agent offers no shm entry; shm-only refuses it as well.
    let tcp_only = agent("p-tcp", BackendChoice::Tcp, None);
    let tcp_meta = decode_metadata(&tcp_only.metadata())?;
    ensure!(!tcp_meta.backends.contains_key("shm"));
    ensure!(strict.connect(&tcp_only.metadata()).is_err());
    Ok(())
}

/// Writes one frame `[type][len u32 LE][body]`.
fn frame(ty: u8, body: &[u8]) -> Vec<u8> {
    let mut f = vec![ty];
    f.extend_from_slice(&(body.len() as u32).to_le_bytes());
    f.extend_from_slice(body);
    f
}

/// Neither the regions nor a notification ring: no descriptor at all.
#[test]
fn the_descriptors_are_never_handed_to_an_unauthenticated_peer() -> Result<()> {
    let p = agent("p", BackendChoice::Auto, Some(b"right"));
    p.register(filled(1 << 20, 1))?;
    // A D with the wrong token does not even get the TCP link.
    let wrong = agent("d", BackendChoice::Auto, Some(b"wrong"));
    ensure!(matches!(
        wrong.connect(&p.metadata()),
        Err(ConnectError::AuthRejected { .. })
    ));
    // A raw client on the Unix socket with a forged proof gets a refusal and no fd.
    let failures = p.stats().auth_failures;
    let mut s = raw_hello(&p, "x")?;
    let mut header = [0u8; 5];
    s.read_exact(&mut header)?;
    ensure!(header[0] == 2, "expected CHALLENGE, got type {}", header[0]);
    let mut body = vec![0; u32::from_le_bytes(header[1..5].try_into()?) as usize];
    s.read_exact(&mut body)?;
    let mut proof = vec![32u8];
    proof.extend_from_slice(&[0xAB; 32]);
    s.write_all(&frame(3, &proof))?;
    // Everything that follows, with any descriptors attached, until P closes.
    let mut rest = Vec::new();
    let mut fds = Vec::new();
    loop {
        let mut buf = [0u8; 256];
        let (n, got) = recv_with_fds(s.as_fd(), &mut buf)?;
        fds.extend(got);
        if n == 0 {
            break;
        }
        rest.extend_from_slice(&buf[..n]);
    }
    ensure!(
        fds.is_empty(),
        "an unauthenticated peer got {} fds",
        fds.len()
    );
    ensure!(rest.len() >= 6 && rest[0] == 4 && rest[5] == 0, "{rest:?}");
    ensure!(
        rest.len() == 5 + 2,
        "P sent more than AUTH_RESULT: {rest:?}"
    );
    ensure!(p.stats().auth_failures > failures);
    Ok(())
}

const CHILD_ENV: &str = "KVLEASE_SHM_TEST_CHILD";

/// The P side of `another_process_on_the_host_reads_over_shm`: does nothing unless
/// started by it.
#[test]
fn child_target_process() -> Result<()> {
    if std::env::var_os(CHILD_ENV).is_none() {
        return Ok(());
    }
    let p = agent("p-child", BackendChoice::Auto, Some(b"tok"));
    let desc = p.register(filled(6 << 20, 11))?;
    let meta: String = p.metadata().iter().map(|b| format!("{b:02x}")).collect();
    println!("\nDESC {} {}\nMETA {meta}", desc.id, desc.key);
    std::io::stdout().flush()?;
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    Ok(())
}

/// Runs the test `test` of this binary as a child process with `env` set (the child
/// side of a two-process test), its stdin and stdout piped; returns it and its stdout.
fn spawn_child(
    test: &str,
    env: &str,
    extra: &[&str],
) -> Result<(std::process::Child, BufReader<std::process::ChildStdout>)> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--exact", test])
        .args(extra)
        .args(["--nocapture", "--test-threads=1"])
        .env(env, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let out = BufReader::new(child.stdout.take().context("stdout")?);
    Ok((child, out))
}

/// Reads a child target's announcement: its `DESC` line's numbers and its `META` line's
/// metadata (hex), which comes last.
fn read_announcement(out: &mut impl BufRead) -> Result<(Vec<u64>, Vec<u8>)> {
    let mut desc = None;
    let mut line = String::new();
    loop {
        line.clear();
        ensure!(out.read_line(&mut line)? > 0, "child ended early");
        if let Some(rest) = line.trim().strip_prefix("DESC ") {
            desc = Some(
                rest.split(' ')
                    .map(str::parse::<u64>)
                    .collect::<Result<Vec<_>, _>>()?,
            );
        }
        if let Some(hex) = line.trim().strip_prefix("META ") {
            let meta = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16))
                .collect::<Result<_, _>>()?;
            return Ok((desc.context("DESC line")?, meta));
        }
    }
}

/// Reads the announcement of a child target that registered a source region of `len`
/// bytes and a 4096-byte fence region (`DESC id key fence_id fence_key`): their
/// descriptors and the child's metadata.
fn read_source_and_fence(
    out: &mut impl BufRead,
    len: usize,
) -> Result<(RegionDesc, RegionDesc, Vec<u8>)> {
    let (desc, meta) = read_announcement(out)?;
    let [id, key, fence_id, fence_key] = desc[..] else {
        bail!("DESC line {desc:?}: want 4 numbers");
    };
    let src = RegionDesc {
        id,
        key,
        len: len as u64,
        base: 0,
    };
    let fence = RegionDesc {
        id: fence_id,
        key: fence_key,
        len: 4096,
        base: 0,
    };
    Ok((src, fence, meta))
}

#[test]
fn another_process_on_the_host_reads_over_shm() -> Result<()> {
    let (mut child, mut out) = spawn_child("child_target_process", CHILD_ENV, &[])?;
    let (desc, meta) = read_announcement(&mut out)?;
    let [id, key] = desc[..] else {
        bail!("DESC line {desc:?}: want id and key");
    };
    let d = agent("d", BackendChoice::Auto, Some(b"tok"));
    let dst = Arc::new(HostRegion::new(6 << 20)?);
    let dst_id = RegionId(d.register(dst.clone())?.id);
    let peer = d.connect(&meta)?;
    let (backend, why) = d.peer_backend(peer).context("connected")?;
    ensure!(backend == Backend::Shm, "{backend}: {why}");
    let desc = RegionDesc {
        id,
        key,
        len: 6 << 20,
        base: 0,
    };
    let id = d.post_read(
        peer,
        ReadBatch {
            ops: vec![read(dst_id, 0, 6 << 20, &desc, 0)],
            ..ReadBatch::default()
        },
        LIMIT,
    )?;
    match wait(&d, id)? {
        BatchStatus::Done(stats) => ensure!(stats.backend == Backend::Shm),
        other => bail!("{other:?}"),
    }
    let want: Vec<u8> = (0..6 << 20).map(|i| pattern(11, i)).collect();
    ensure!(bytes_of(dst.as_ref(), 0, 6 << 20) == want, "bytes differ");
    child.stdin.take().context("stdin")?.write_all(b"quit\n")?;
    ensure!(child.wait()?.success());
    Ok(())
}

/// P and D on shm, P connected back (as the agents do); P's name is "p", D's "d".
fn shm_pair(token: Option<&[u8]>) -> Result<(Agent, Agent, kvlease_transport::PeerId)> {
    let p = agent("p", BackendChoice::Auto, token);
    let d = agent("d", BackendChoice::Shm, token);
    d.register(Arc::new(HostRegion::new(4096)?))?;
    let peer = d.connect(&p.metadata())?;
    ensure!(d.peer_backend(peer).map(|b| b.0) == Some(Backend::Shm));
    Ok((p, d, peer))
}

#[test]
fn many_notifications_cross_the_ring_in_order_with_max_size_ones_and_wrap_around() -> Result<()> {
    let (p, d, peer) = shm_pair(Some(b"tok"))?;
    let max = kvlease_transport::DEFAULT_MAX_NOTIF_LEN;
    // Far more bytes than the ring holds (2 MiB): it wraps around many times, and the
    // sender waits for the drain below whenever it is full.
    let n = 3000u32;
    let msg = move |i: u32| -> Vec<u8> {
        let len = match i % 7 {
            0 => max,
            1 => 4,
            k => 4 + (i as usize * 131 * k as usize) % (max - 4),
        };
        let mut m = vec![(i % 251) as u8; len];
        m[..4].copy_from_slice(&i.to_le_bytes());
        m
    };
    let sender = std::thread::spawn(move || -> Result<()> {
        for i in 0..n {
            let m = msg(i);
            let mut tries = 0;
            loop {
                match d.send_notif(peer, m.clone()) {
                    Ok(()) => break,
                    // The drain below is slower than us for a while: try again.
                    Err(TransferError::NotifRingFull { .. }) if tries < 1000 => tries += 1,
                    Err(e) => bail!("notification {i}: {e}"),
                }
            }
        }
        Ok(())
    });
    let mut got = Vec::new();
    let start = Instant::now();
    while got.len() < n as usize && start.elapsed() < LIMIT {
        for (from, msgs) in p.get_new_notifs() {
            ensure!(from == "d", "from {from}");
            got.extend(msgs);
        }
    }
    sender.join().expect("sender thread")?;
    ensure!(got.len() == n as usize, "{} of {n} arrived", got.len());
    for (i, m) in got.iter().enumerate() {
        ensure!(
            *m == msg(i as u32),
            "notification {i} differs (len {})",
            m.len()
        );
    }
    ensure!(p.stats().notifs_received == u64::from(n));
    ensure!(p.stats().notif_rings_corrupt == 0);
    Ok(())
}

#[test]
fn a_full_ring_is_a_typed_error_and_drains_in_order() -> Result<()> {
    let (p, d, peer) = shm_pair(None)?;
    let max = kvlease_transport::DEFAULT_MAX_NOTIF_LEN;
    let mut sent = 0u32;
    let err = loop {
        let mut m = vec![0u8; max];
        m[..4].copy_from_slice(&sent.to_le_bytes());
        match d.send_notif(peer, m) {
            Ok(()) => sent += 1,
            Err(e) => break e,
        }
        ensure!(
            sent < 1000,
            "the ring never filled: notifications go elsewhere"
        );
    };
    match err {
        TransferError::NotifRingFull { len, capacity, .. } => {
            ensure!(len == max && capacity >= 16 * max, "{err}");
        }
        other => bail!("expected NotifRingFull, got {other:?}"),
    }
    // The ring holds at least 16 of the largest notifications.
    ensure!(sent >= 16, "only {sent} fitted");
    let got = notifs(&p, sent as usize, LIMIT);
    ensure!(got.len() == sent as usize);
    for (i, m) in got.iter().enumerate() {
        ensure!(m[..4] == (i as u32).to_le_bytes(), "order broken at {i}");
    }
    // Room again; a notification over the limit is refused before it reaches the ring.
    d.send_notif(peer, b"again".to_vec())?;
    ensure!(notifs(&p, 1, LIMIT) == vec![b"again".to_vec()]);
    ensure!(matches!(
        d.send_notif(peer, vec![0; max + 1]),
        Err(TransferError::NotifTooLarge { .. })
    ));
    Ok(())
}

#[test]
fn a_batch_notification_comes_after_its_data_and_keeps_its_order() -> Result<()> {
    let p = agent("p", BackendChoice::Auto, None);
    // More than one copy thread's share: the pool may copy the last part.
    let len: u64 = 24 << 20;
    let src = filled(len as usize, 21);
    let desc = p.register(src.clone())?;
    let d = agent("d", BackendChoice::Auto, None);
    let dst = Arc::new(HostRegion::new(len as usize)?);
    let dst_id = RegionId(d.register(dst.clone())?.id);
    // Device-like memory: batches into it go over TCP, and their notifications still
    // through the ring.
    let staged = Arc::new(kvlease_gpu_mem::StagedHostRegion::new(1 << 20)?);
    let staged_id = RegionId(d.register(staged)?.id);
    let peer = d.connect(&p.metadata())?;
    ensure!(d.peer_backend(peer).map(|b| b.0) == Some(Backend::Shm));
    let want = bytes_of(src.as_ref(), 0, len);
    for round in 0..4u8 {
        src.write_from(0, &want)?;
        let id = d.post_read(
            peer,
            ReadBatch {
                ops: (0..24)
                    .map(|i| read(dst_id, i << 20, 1 << 20, &desc, ((i * 5) % 24) << 20))
                    .collect(),
                notif: Some(vec![b'n', round]),
                fence: None,
            },
            LIMIT,
        )?;
        // As soon as P hears of it, P reuses its blocks: D's copies must be over.
        ensure!(notifs(&p, 1, LIMIT) == vec![vec![b'n', round]]);
        src.write_from(0, &vec![0xEE; len as usize])?;
        match wait(&d, id)? {
            BatchStatus::Done(stats) => ensure!(stats.backend == Backend::Shm),
            other => bail!("{other:?}"),
        }
        for i in 0..24u64 {
            let from = ((i * 5) % 24) << 20;
            ensure!(
                bytes_of(dst.as_ref(), i << 20, 1 << 20)
                    == want[from as usize..(from + (1 << 20)) as usize],
                "round {round}: block {i} holds bytes written after the notification"
            );
        }
    }
    // A batch moved by TCP notifies through the ring too: its notification and a later
    // one arrive in order.
    src.write_from(0, &want)?;
    let id = d.post_read(
        peer,
        ReadBatch {
            ops: vec![read(staged_id, 0, 4096, &desc, 0)],
            notif: Some(b"tcp batch".to_vec()),
            fence: None,
        },
        LIMIT,
    )?;
    match wait(&d, id)? {
        BatchStatus::Done(stats) => ensure!(stats.backend == Backend::Tcp, "{stats:?}"),
        other => bail!("{other:?}"),
    }
    d.send_notif(peer, b"after".to_vec())?;
    ensure!(notifs(&p, 2, LIMIT) == vec![b"tcp batch".to_vec(), b"after".to_vec()]);
    Ok(())
}

/// A raw connection to P's shm socket (named in its metadata) that has sent `HELLO` as
/// `name`, with a fixed nonce.
fn raw_hello(p: &Agent, name: &str) -> Result<UnixStream> {
    let meta = decode_metadata(&p.metadata())?;
    let socket = meta.backends["shm"]["socket"]
        .as_str()
        .context("socket name")?
        .to_owned();
    let mut s = UnixStream::connect_addr(&UnixAddr::from_abstract_name(socket.as_bytes())?)?;
    s.set_read_timeout(Some(LIMIT))?;
    let mut hello = Vec::new();
    hello.extend_from_slice(&1u16.to_le_bytes());
    hello.extend_from_slice(&0u16.to_le_bytes());
    hello.extend_from_slice(&[7; 32]);
    hello.extend_from_slice(&u16::try_from(name.len())?.to_le_bytes());
    hello.extend_from_slice(name.as_bytes());
    s.write_all(&frame(1, &hello))?;
    Ok(s)
}

/// A raw client on P's shm socket (no token), as a malicious peer would run it: the
/// handshake, then every frame with its descriptors until `SHM_END`. Returns the socket
/// (kept open: P keeps the ring while it is), the ring's file with its capacity and
/// largest record, and the regions' files.
fn raw_shm_client(
    p: &Agent,
    name: &str,
) -> Result<(UnixStream, std::fs::File, u64, u64, Vec<std::fs::File>)> {
    let mut s = raw_hello(p, name)?;
    let mut header = [0u8; 5];
    s.read_exact(&mut header)?;
    let mut body = vec![0; u32::from_le_bytes(header[1..5].try_into()?) as usize];
    s.read_exact(&mut body)?;
    s.write_all(&frame(3, &[0]))?;
    s.read_exact(&mut header)?;
    ensure!(header[0] == 4, "expected AUTH_RESULT");
    let mut body = vec![0; u32::from_le_bytes(header[1..5].try_into()?) as usize];
    s.read_exact(&mut body)?;
    ensure!(body[0] == 1, "refused");
    let mut ring = None;
    let mut regions = Vec::new();
    loop {
        let mut header = [0u8; 5];
        let (n, mut fds) = recv_with_fds(s.as_fd(), &mut header)?;
        ensure!(n == 5, "split header");
        let mut body = vec![0; u32::from_le_bytes(header[1..5].try_into()?) as usize];
        s.read_exact(&mut body)?;
        match header[0] {
            11 => {
                let cap = u64::from_le_bytes(body[..8].try_into()?);
                let max = u64::from_le_bytes(body[8..16].try_into()?);
                ring = Some((std::fs::File::from(fds.pop().context("ring fd")?), cap, max));
            }
            9 => regions.push(std::fs::File::from(fds.pop().context("region fd")?)),
            // The grant table.
            12 => {}
            // P hands over no device memory unless it registered some.
            13 => bail!("an SHM_CUDA_REGION frame from a P without device memory"),
            10 => break,
            t => bail!("frame type {t}"),
        }
    }
    let (file, cap, max) = ring.context("no SHM_RING frame")?;
    Ok((s, file, cap, max, regions))
}

const RING_TAIL: u64 = 64;
const RING_DATA: u64 = kvlease_gpu_mem::RING_HEADER_LEN as u64;

#[test]
fn hostile_ring_contents_close_that_ring_without_over_reading() -> Result<()> {
    use std::os::unix::fs::FileExt;
    let p = agent("p", BackendChoice::Auto, None);
    let src = filled(8192, 8);
    p.register(src.clone())?;
    // A well-behaved record through the raw ring first: P reads the ring it handed over.
    let (_s, ring, cap, max, regions) = raw_shm_client(&p, "evil")?;
    // P's memory is the peer's to read, not to write.
    let [region] = &regions[..] else {
        bail!("{} regions handed over", regions.len());
    };
    ensure!(
        region.write_all_at(b"evil", 0).is_err(),
        "a peer wrote P's memory"
    );
    ensure!(
        bytes_of(src.as_ref(), 0, 8192) == (0..8192).map(|i| pattern(8, i)).collect::<Vec<_>>()
    );
    ensure!(cap.is_power_of_two() && max == kvlease_transport::DEFAULT_MAX_NOTIF_LEN as u64);
    ring.write_all_at(&5u64.to_le_bytes(), RING_DATA)?;
    ring.write_all_at(b"hello", RING_DATA + 8)?;
    ring.write_all_at(&16u64.to_le_bytes(), RING_TAIL)?;
    ensure!(p.get_new_notifs() == vec![("evil".to_owned(), vec![b"hello".to_vec()])]);
    drop(ring);

    // Each hostile pattern on its own connection: (record length word, tail).
    let cases: [(&str, u64, u64); 5] = [
        ("tail not 8-aligned", 5, 13),
        ("tail more than a ring ahead", 5, cap + 8),
        ("tail behind the head", 5, u64::MAX - 7),
        ("record longer than max_notif_len", max + 1, max + 16),
        ("record past the tail", 100, 16),
    ];
    for (i, (what, len_word, tail)) in cases.into_iter().enumerate() {
        let (mut s, ring, ..) = raw_shm_client(&p, "evil")?;
        ring.write_all_at(&len_word.to_le_bytes(), RING_DATA)?;
        ring.write_all_at(&tail.to_le_bytes(), RING_TAIL)?;
        let got = p.get_new_notifs();
        ensure!(got.is_empty(), "{what}: delivered {got:?}");
        ensure!(
            p.stats().notif_rings_corrupt == i as u64 + 1,
            "{what}: {:?}",
            p.stats()
        );
        // P shut the connection down, and reads that ring no more.
        let mut b = [0u8; 1];
        ensure!(s.read(&mut b)? == 0, "{what}: connection still open");
        ring.write_all_at(&5u64.to_le_bytes(), RING_DATA)?;
        ring.write_all_at(&16u64.to_le_bytes(), RING_TAIL)?;
        ensure!(p.get_new_notifs().is_empty(), "{what}: read after close");
    }
    // The agent still works: an honest peer's notifications arrive.
    let d = agent("d", BackendChoice::Shm, None);
    let peer = d.connect(&p.metadata())?;
    d.send_notif(peer, b"fine".to_vec())?;
    ensure!(notifs(&p, 1, LIMIT) == vec![b"fine".to_vec()]);
    Ok(())
}

#[test]
fn a_closed_link_leaves_its_last_notifications_then_its_ring() -> Result<()> {
    let (p, d, peer) = shm_pair(None)?;
    for i in 0..10u8 {
        d.send_notif(peer, vec![i])?;
    }
    d.disconnect(peer)?;
    ensure!(notifs(&p, 10, LIMIT) == (0..10u8).map(|i| vec![i]).collect::<Vec<_>>());
    ensure!(p.stats().notif_rings_corrupt == 0);
    Ok(())
}

#[test]
fn a_region_deregistered_after_connect_is_refused_over_shm() -> Result<()> {
    let p = agent("p", BackendChoice::Auto, None);
    let src = filled(1 << 20, 4);
    let desc = p.register(src.clone())?;
    let kept = p.register(filled(1 << 20, 5))?;
    let d = agent("d", BackendChoice::Shm, None);
    let dst = Arc::new(HostRegion::new(1 << 20)?);
    let dst_id = RegionId(d.register(dst.clone())?.id);
    let peer = d.connect(&p.metadata())?;
    let one = |from: &RegionDesc| ReadBatch {
        ops: vec![read(dst_id, 0, 4096, from, 0)],
        ..ReadBatch::default()
    };
    match wait(&d, d.post_read(peer, one(&desc), LIMIT)?)? {
        BatchStatus::Done(stats) => ensure!(stats.backend == Backend::Shm),
        other => bail!("{other:?}"),
    }
    p.deregister(RegionId(desc.id))?;
    // The slot is reused by a region registered later: the old id is still refused.
    let later = p.register(filled(1 << 20, 6))?;
    match wait(&d, d.post_read(peer, one(&desc), LIMIT)?)? {
        BatchStatus::Failed(TransferError::Refused {
            reason: Refusal::UnknownRegion,
            ..
        }) => {}
        other => bail!("a deregistered region was read: {other:?}"),
    }
    // As a fence too.
    let fenced = ReadBatch {
        fence: Some(FenceRead {
            remote: desc.at(0),
            expected: 0,
        }),
        ..one(&kept)
    };
    ensure!(matches!(
        wait(&d, d.post_read(peer, fenced, LIMIT)?)?,
        BatchStatus::Failed(TransferError::Refused {
            reason: Refusal::UnknownRegion,
            ..
        })
    ));
    // The regions still registered are read as before; the later one (not handed over
    // at connect) over TCP.
    match wait(&d, d.post_read(peer, one(&kept), LIMIT)?)? {
        BatchStatus::Done(stats) => ensure!(stats.backend == Backend::Shm),
        other => bail!("{other:?}"),
    }
    let mut later_desc = later;
    later_desc.base = 0;
    match wait(&d, d.post_read(peer, one(&later_desc), LIMIT)?)? {
        BatchStatus::Done(stats) => ensure!(stats.backend == Backend::Tcp),
        other => bail!("{other:?}"),
    }
    ensure!(
        bytes_of(dst.as_ref(), 0, 4096) == (0..4096).map(|i| pattern(6, i)).collect::<Vec<_>>()
    );
    drop(src);
    Ok(())
}

#[test]
fn a_peer_gets_no_cuda_entries_without_device_regions() -> Result<()> {
    let p = agent("p", BackendChoice::Auto, None);
    p.register(filled(8192, 1))?;
    // Staged host memory runs through the device paths elsewhere, but is no device
    // memory: no CUDA IPC entry for it (and no memfd either: it is read over TCP).
    p.register(Arc::new(kvlease_gpu_mem::StagedHostRegion::new(8192)?))?;
    // `raw_shm_client` fails on an `SHM_CUDA_REGION` frame.
    let (_s, _ring, _, _, regions) = raw_shm_client(&p, "d")?;
    ensure!(regions.len() == 1, "{} regions handed over", regions.len());
    Ok(())
}

/// A fake P shared-memory socket: for one connection it answers the handshake as the
/// agent `name` would (no token), hands over a grant table of 512 slots, writes `frames`
/// (whole frames, with no descriptor attached except where `fd_on` names the frame's
/// index) and `SHM_END`, and keeps the socket until the peer closes it. Returns the
/// socket's name.
#[cfg(feature = "cuda")]
fn fake_shm_socket(
    name: &str,
    frames: Vec<Vec<u8>>,
    fd_on: Option<usize>,
) -> Result<(String, std::thread::JoinHandle<Result<()>>)> {
    use std::os::unix::net::UnixListener;
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let socket = format!(
        "kvlease-test-fake-p-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    let listener = UnixListener::bind_addr(&UnixAddr::from_abstract_name(socket.as_bytes())?)?;
    let name = name.to_owned();
    let thread = std::thread::spawn(move || -> Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_read_timeout(Some(LIMIT))?;
        let read_frame = |s: &mut UnixStream| -> Result<u8> {
            let mut header = [0u8; 5];
            s.read_exact(&mut header)?;
            let mut body = vec![0; u32::from_le_bytes(header[1..5].try_into()?) as usize];
            s.read_exact(&mut body)?;
            Ok(header[0])
        };
        ensure!(read_frame(&mut s)? == 1, "expected HELLO");
        let mut challenge = Vec::new();
        challenge.extend_from_slice(&1u16.to_le_bytes());
        challenge.push(0);
        challenge.extend_from_slice(&[9; 32]);
        challenge.extend_from_slice(&(name.len() as u16).to_le_bytes());
        challenge.extend_from_slice(name.as_bytes());
        s.write_all(&frame(2, &challenge))?;
        ensure!(read_frame(&mut s)? == 3, "expected PROOF");
        s.write_all(&frame(4, &[1, 0]))?;
        let table = HostRegion::new(4096)?;
        let table_fd = table.shared_fd().context("memfd")?;
        send_with_fds(s.as_fd(), &frame(12, &4096u64.to_le_bytes()), &[table_fd])?;
        let spare = HostRegion::new(4096)?;
        let fd = spare.shared_fd().context("memfd")?;
        // D hangs up on the first frame it refuses: later writes may fail.
        let _ = frames.iter().enumerate().try_for_each(|(i, f)| {
            if fd_on == Some(i) {
                send_with_fds(s.as_fd(), f, &[fd])
            } else {
                (&s).write_all(f)
            }
        });
        let _ = s.write_all(&frame(10, &[]));
        // Until D closes (or gives up on) the link.
        s.set_read_timeout(None)?;
        let mut byte = [0u8; 1];
        let _ = s.read(&mut byte);
        Ok(())
    });
    Ok((socket, thread))
}

/// An `SHM_CUDA_REGION` frame: id, key, length, grant slot, then a handle's wire form.
#[cfg(feature = "cuda")]
fn cuda_entry(id: u64, key: u64, len: u64, slot: u64, handle: &[u8]) -> Vec<u8> {
    let mut body = Vec::new();
    for v in [id, key, len, slot] {
        body.extend_from_slice(&v.to_le_bytes());
    }
    body.extend_from_slice(handle);
    frame(13, &body)
}

/// A well-formed CUDA IPC handle of `len` bytes on a device nobody has (all-zero UUID)
/// and with a handle the driver never issued.
#[cfg(feature = "cuda")]
fn unopenable_handle(len: u64) -> Vec<u8> {
    let mut h = vec![0u8; 112];
    h[..4].copy_from_slice(b"KVCI");
    h[4] = 1;
    h[104..112].copy_from_slice(&len.to_le_bytes());
    h
}

#[cfg(feature = "cuda")]
#[test]
fn malformed_cuda_entries_from_a_peer_are_refused_with_a_typed_error() -> Result<()> {
    use kvlease_gpu_mem::cuda::ipc::{IpcError, IpcHandleError};
    use kvlease_transport::{ConnectError, LinkError, ShmError};
    // P is real (D's TCP link goes to it); its shm entry names a fake socket.
    let p = agent("p", BackendChoice::Auto, None);
    let good = unopenable_handle(4096);
    let mut bad_magic = good.clone();
    bad_magic[0] = b'X';
    let mut zero_len = good.clone();
    zero_len[104..112].fill(0);
    let connect =
        |frames: Vec<Vec<u8>>, fd_on: Option<usize>| -> Result<Result<(), ConnectError>> {
            let (socket, server) = fake_shm_socket("p", frames, fd_on)?;
            let mut meta = decode_metadata(&p.metadata())?;
            meta.backends
                .get_mut("shm")
                .and_then(|e| e.as_object_mut())
                .context("shm entry")?
                .insert("socket".into(), socket.into());
            let d = agent("d", BackendChoice::Shm, None);
            let connected = d.connect(&serde_json::to_vec(&meta)?).map(|peer| {
                assert_eq!(d.peer_backend(peer).map(|b| b.0), Some(Backend::Shm));
            });
            drop(d);
            server
                .join()
                .map_err(|_| anyhow::anyhow!("fake P panicked"))??;
            Ok(connected)
        };
    let refused = |r: Result<(), ConnectError>| match r {
        Err(ConnectError::BackendUnavailable { source, .. }) => Ok(*source),
        other => bail!("expected a refused shm link, got {other:?}"),
    };
    // A handle that is not one: the typed error names the region and why.
    let err = refused(connect(vec![cuda_entry(5, 1, 4096, 0, &bad_magic)], None)?)?;
    ensure!(
        matches!(
            err,
            LinkError::Shm(ShmError::CudaRegion {
                region: 5,
                source: IpcError::Handle(IpcHandleError::Magic)
            })
        ),
        "{err:?}"
    );
    let err = refused(connect(vec![cuda_entry(5, 1, 4096, 0, &zero_len)], None)?)?;
    ensure!(
        matches!(
            err,
            LinkError::Shm(ShmError::CudaRegion {
                source: IpcError::Handle(IpcHandleError::ZeroLength),
                ..
            })
        ),
        "{err:?}"
    );
    // Frames that break the hand-over itself.
    for (what, frames, fd_on) in [
        (
            "length differs",
            vec![cuda_entry(5, 1, 8192, 0, &good)],
            None,
        ),
        (
            "slot outside the table",
            vec![cuda_entry(5, 1, 4096, 512, &good)],
            None,
        ),
        (
            "a descriptor attached",
            vec![cuda_entry(5, 1, 4096, 0, &good)],
            Some(0),
        ),
        (
            "handed over twice",
            vec![
                cuda_entry(5, 1, 4096, 0, &good),
                cuda_entry(5, 1, 4096, 1, &good),
            ],
            None,
        ),
        ("short frame", vec![frame(13, &[0; 100])], None),
    ] {
        let err = refused(connect(frames, fd_on)?).context(what)?;
        ensure!(
            matches!(err, LinkError::Shm(ShmError::Malformed { .. })),
            "{what}: {err:?}"
        );
    }
    // A well-formed entry this process cannot open (no driver here, or no device with
    // that UUID): skipped, and the link comes up; that region would be read over TCP.
    connect(vec![cuda_entry(5, 1, 4096, 0, &good)], None)?.map_err(|e| anyhow::anyhow!("{e:?}"))?;
    Ok(())
}

#[cfg(feature = "cuda")]
const CUDA_CHILD_ENV: &str = "KVLEASE_SHM_CUDA_TEST_CHILD";
#[cfg(feature = "cuda")]
const CUDA_LEN: usize = (8 << 20) + 4096;

/// The P side of `cuda_device_memory_is_read_over_shm_from_another_process`, started by it
/// (CUDA IPC needs two processes).
#[cfg(feature = "cuda")]
#[test]
#[ignore = "the P side of cuda_device_memory_is_read_over_shm_from_another_process, which starts it"]
fn cuda_child_target_process() -> Result<()> {
    if std::env::var_os(CUDA_CHILD_ENV).is_none() {
        return Ok(());
    }
    let p = agent("p-cuda", BackendChoice::Auto, Some(b"tok"));
    let device = Arc::new(kvlease_gpu_mem::cuda::CudaDeviceRegion::new(0, CUDA_LEN)?);
    let data: Vec<u8> = (0..CUDA_LEN).map(|i| pattern(13, i)).collect();
    kvlease_gpu_mem::cuda::copy_htod(device.as_ref(), 0, &data)?;
    let desc = p.register(device)?;
    let fence = Arc::new(HostRegion::new(4096)?);
    fence.store_u64(16, 42)?;
    let fence_desc = p.register(fence)?;
    let meta: String = p.metadata().iter().map(|b| format!("{b:02x}")).collect();
    println!(
        "\nDESC {} {} {} {}\nMETA {meta}",
        desc.id, desc.key, fence_desc.id, fence_desc.key
    );
    std::io::stdout().flush()?;
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    Ok(())
}

/// D reads P's CUDA device memory, opened through CUDA IPC over the shm socket, into host
/// and device memory with a fence read, in one batch over shm; P runs in a child process.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU (CUDA IPC between two processes); not yet run on one"]
fn cuda_device_memory_is_read_over_shm_from_another_process() -> Result<()> {
    use kvlease_gpu_mem::cuda;
    let (mut child, mut out) = spawn_child(
        "cuda_child_target_process",
        CUDA_CHILD_ENV,
        &["--include-ignored"],
    )?;
    let (src, fence, meta) = read_source_and_fence(&mut out, CUDA_LEN)?;
    let d = agent("d", BackendChoice::Auto, Some(b"tok"));
    let host = Arc::new(HostRegion::new(CUDA_LEN)?);
    let host_id = RegionId(d.register(host.clone())?.id);
    let device = Arc::new(cuda::CudaDeviceRegion::new(0, CUDA_LEN)?);
    let device_id = RegionId(d.register(device.clone())?.id);
    let peer = d.connect(&meta)?;
    let (backend, why) = d.peer_backend(peer).context("connected")?;
    ensure!(backend == Backend::Shm, "{backend}: {why}");
    let half = CUDA_LEN as u64 / 2;
    let batch = ReadBatch {
        ops: vec![
            // Device → host, odd offsets; device → device, the other half.
            read(host_id, 3, half - 3, &src, 3),
            read(device_id, half, half, &src, half),
        ],
        notif: None,
        fence: Some(FenceRead {
            remote: fence.at(16),
            expected: 42,
        }),
    };
    let batch = d.post_read(peer, batch, LIMIT)?;
    match wait(&d, batch)? {
        BatchStatus::Done(stats) => ensure!(
            stats.backend == Backend::Shm && stats.fence_word == Some(42),
            "{stats:?}"
        ),
        other => bail!("{other:?}"),
    }
    let want: Vec<u8> = (0..CUDA_LEN).map(|i| pattern(13, i)).collect();
    let half = half as usize;
    ensure!(
        bytes_of(host.as_ref(), 3, half as u64 - 3) == want[3..half],
        "device → host differs"
    );
    let mut back = vec![0; half];
    cuda::copy_dtoh(device.as_ref(), half, &mut back)?;
    ensure!(back == want[half..], "device → device differs");
    // A wrong key and a range past the end are refused over shm as over TCP.
    let bad = RegionDesc {
        key: src.key ^ 1,
        ..src
    };
    for (op, want) in [
        (read(host_id, 0, 16, &bad, 0), Refusal::BadKey),
        (
            read(host_id, 0, 16, &src, CUDA_LEN as u64 - 8),
            Refusal::OutOfBounds,
        ),
    ] {
        let batch = d.post_read(
            peer,
            ReadBatch {
                ops: vec![op],
                ..ReadBatch::default()
            },
            LIMIT,
        )?;
        match wait(&d, batch)? {
            BatchStatus::Failed(TransferError::Refused { reason, .. }) => {
                ensure!(reason == want, "{reason:?}");
            }
            other => bail!("{other:?}"),
        }
    }
    child.stdin.take().context("stdin")?.write_all(b"quit\n")?;
    ensure!(child.wait()?.success());
    Ok(())
}

const CMA_CHILD_ENV: &str = "KVLEASE_SHM_CMA_TEST_CHILD";
const CMA_LEN: usize = (6 << 20) + 123;

/// The P side of `heap_memory_of_another_process_is_read_through_cma`: does nothing
/// unless started by it.
#[test]
fn cma_child_target_process() -> Result<()> {
    if std::env::var_os(CMA_CHILD_ENV).is_none() {
        return Ok(());
    }
    let p = agent_cma("p-cma", CmaPolicy::LastPeer);
    let desc = p.register(heap(CMA_LEN, 17))?;
    let fence = Arc::new(HostRegion::new(4096)?);
    fence.store_u64(8, 77)?;
    let fence_desc = p.register(fence)?;
    let meta: String = p.metadata().iter().map(|b| format!("{b:02x}")).collect();
    println!(
        "\nDESC {} {} {} {}\nMETA {meta}",
        desc.id, desc.key, fence_desc.id, fence_desc.key
    );
    std::io::stdout().flush()?;
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    Ok(())
}

/// P (a child process) registers plain heap memory; D reads it with cross-memory attach
/// (the batch says `cma`, the bytes are equal), its reads outside the registered range or
/// under a wrong key are refused as over TCP; a D with cma off reads it over TCP.
#[test]
fn heap_memory_of_another_process_is_read_through_cma() -> Result<()> {
    let (mut child, mut out) = spawn_child("cma_child_target_process", CMA_CHILD_ENV, &[])?;
    let (src, fence, meta) = read_source_and_fence(&mut out, CMA_LEN)?;
    let want: Vec<u8> = (0..CMA_LEN).map(|i| pattern(17, i)).collect();
    for (cma, expect) in [
        (CmaPolicy::LastPeer, Backend::Cma),
        (CmaPolicy::Off, Backend::Tcp),
    ] {
        let d = agent_cma("d", cma);
        let dst = Arc::new(HostRegion::new(CMA_LEN + 4096)?);
        let dst_id = RegionId(d.register(dst.clone())?.id);
        let peer = d.connect(&meta)?;
        let (backend, why) = d.peer_backend(peer).context("connected")?;
        ensure!(backend == Backend::Shm, "{backend}: {why}");
        // Odd offsets and lengths, more than the split threshold, a fence in memfd memory.
        let half = CMA_LEN as u64 / 2 + 5;
        let batch = ReadBatch {
            ops: vec![
                read(dst_id, 1, half, &src, 0),
                read(dst_id, 1 + half, CMA_LEN as u64 - half, &src, half),
            ],
            notif: None,
            fence: Some(FenceRead {
                remote: fence.at(8),
                expected: 77,
            }),
        };
        match run(&d, peer, batch)? {
            BatchStatus::Done(stats) => ensure!(
                stats.backend == expect
                    && stats.bytes == CMA_LEN as u64
                    && stats.fence_word == Some(77),
                "{cma:?}: {stats:?}"
            ),
            other => bail!("{cma:?}: {other:?}"),
        }
        ensure!(
            bytes_of(dst.as_ref(), 1, CMA_LEN as u64) == want,
            "{cma:?}: bytes differ"
        );
        let bad_key = RegionDesc {
            key: src.key ^ 1,
            ..src
        };
        for (op, reason) in [
            (
                read(dst_id, 0, 16, &src, CMA_LEN as u64 - 8),
                Refusal::OutOfBounds,
            ),
            (
                read(dst_id, 0, 1, &src, CMA_LEN as u64),
                Refusal::OutOfBounds,
            ),
            (read(dst_id, 0, 16, &bad_key, 0), Refusal::BadKey),
        ] {
            let batch = ReadBatch {
                ops: vec![op],
                ..ReadBatch::default()
            };
            match run(&d, peer, batch)? {
                BatchStatus::Failed(TransferError::Refused { reason: got, .. }) => {
                    ensure!(got == reason, "{cma:?}: {got:?}, want {reason:?}");
                }
                other => bail!("{cma:?}: an out-of-range read ended {other:?}"),
            }
        }
    }
    child.stdin.take().context("stdin")?.write_all(b"quit\n")?;
    ensure!(child.wait()?.success());
    Ok(())
}

/// In one process: heap memory is read through cma, also after the ptracer was named;
/// a P with cma off hands no address over (D reads over TCP); a deregistered region is
/// refused; a fence word in heap memory is read through cma as well.
#[test]
fn cma_follows_the_policy_of_both_ends_and_the_grants() -> Result<()> {
    let want: Vec<u8> = (0..1 << 20).map(|i| pattern(23, i)).collect();
    for (p_cma, d_cma, expect) in [
        (CmaPolicy::LastPeer, CmaPolicy::LastPeer, Backend::Cma),
        (CmaPolicy::AnyProcess, CmaPolicy::LastPeer, Backend::Cma),
        (CmaPolicy::Off, CmaPolicy::LastPeer, Backend::Tcp),
        (CmaPolicy::LastPeer, CmaPolicy::Off, Backend::Tcp),
    ] {
        let p = agent_cma("p", p_cma);
        let desc = p.register(heap(1 << 20, 23))?;
        let memfd = p.register(filled(4096, 2))?;
        let d = agent_cma("d", d_cma);
        let dst = Arc::new(HostRegion::new(1 << 20)?);
        let dst_id = RegionId(d.register(dst.clone())?.id);
        let peer = d.connect(&p.metadata())?;
        let case = format!("P {p_cma:?}, D {d_cma:?}");
        let whole = ReadBatch {
            ops: vec![read(dst_id, 0, 1 << 20, &desc, 0)],
            ..ReadBatch::default()
        };
        match run(&d, peer, whole.clone())? {
            BatchStatus::Done(stats) => ensure!(stats.backend == expect, "{case}: {stats:?}"),
            other => bail!("{case}: {other:?}"),
        }
        ensure!(
            bytes_of(dst.as_ref(), 0, 1 << 20) == want,
            "{case}: bytes differ"
        );
        // Memfd memory stays shm.
        let plain = ReadBatch {
            ops: vec![read(dst_id, 0, 4096, &memfd, 0)],
            ..ReadBatch::default()
        };
        match run(&d, peer, plain)? {
            BatchStatus::Done(stats) => {
                ensure!(stats.backend == Backend::Shm, "{case}: {stats:?}");
            }
            other => bail!("{case}: {other:?}"),
        }
        // A fence word in heap memory (8-aligned: the heap allocation is), read through
        // cma too; a changed one fails the batch.
        let word = u64::from_ne_bytes(want[8..16].try_into()?);
        for (expected, ok) in [(word, true), (word ^ 1, false)] {
            let fenced = ReadBatch {
                fence: Some(FenceRead {
                    remote: desc.at(8),
                    expected,
                }),
                ..whole.clone()
            };
            match (run(&d, peer, fenced)?, ok) {
                (BatchStatus::Done(stats), true) => ensure!(
                    stats.backend == expect && stats.fence_word == Some(word),
                    "{case}: {stats:?}"
                ),
                (BatchStatus::Failed(TransferError::FenceMismatch { found, .. }), false) => {
                    ensure!(found == word, "{case}: found {found}");
                }
                (other, _) => bail!("{case}: fence {ok}: {other:?}"),
            }
        }
        // Data from memfd memory, the fence word from heap memory: `cma` too.
        let memfd_data = ReadBatch {
            ops: vec![read(dst_id, 0, 4096, &memfd, 0)],
            notif: None,
            fence: Some(FenceRead {
                remote: desc.at(8),
                expected: word,
            }),
        };
        match run(&d, peer, memfd_data)? {
            BatchStatus::Done(stats) => ensure!(
                stats.backend == expect && stats.fence_word == Some(word),
                "{case}: {stats:?}"
            ),
            other => bail!("{case}: {other:?}"),
        }
        p.deregister(RegionId(desc.id))?;
        match run(&d, peer, whole)? {
            BatchStatus::Failed(TransferError::Refused {
                reason: Refusal::UnknownRegion,
                ..
            }) => {}
            other => bail!("{case}: a deregistered region was read: {other:?}"),
        }
    }
    Ok(())
}

const CMA_REFUSED_CHILD_ENV: &str = "KVLEASE_SHM_CMA_REFUSED_CHILD";
const REFUSED_LEN: usize = (2 << 20) + 77;

/// The D side of `a_reader_the_kernel_refuses_reads_over_tcp`, started by it as another
/// user: reads P's heap region (P's metadata and region on stdin) and prints the backend
/// of each batch.
#[test]
fn cma_refused_child_process() -> Result<()> {
    if std::env::var_os(CMA_REFUSED_CHILD_ENV).is_none() {
        return Ok(());
    }
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    let words: Vec<&str> = line.split_whitespace().collect();
    let [id, key, meta] = words[..] else {
        bail!("want id, key and metadata, got {line:?}");
    };
    let meta: Vec<u8> = (0..meta.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&meta[i..i + 2], 16))
        .collect::<Result<_, _>>()?;
    let src = RegionDesc {
        id: id.parse()?,
        key: key.parse()?,
        len: REFUSED_LEN as u64,
        base: 0,
    };
    let d = agent_cma("d-other-user", CmaPolicy::LastPeer);
    let dst = Arc::new(HostRegion::new(REFUSED_LEN)?);
    let dst_id = RegionId(d.register(dst.clone())?.id);
    let peer = d.connect(&meta)?;
    let (link, why) = d.peer_backend(peer).context("connected")?;
    ensure!(link == Backend::Shm, "{link}: {why}");
    let want: Vec<u8> = (0..REFUSED_LEN).map(|i| pattern(29, i)).collect();
    let mut backends = Vec::new();
    for _ in 0..2 {
        dst.write_from(0, &vec![0; REFUSED_LEN])?;
        let batch = ReadBatch {
            ops: vec![read(dst_id, 0, REFUSED_LEN as u64, &src, 0)],
            ..ReadBatch::default()
        };
        match run(&d, peer, batch)? {
            BatchStatus::Done(stats) => backends.push(stats.backend.to_string()),
            other => bail!("{other:?}"),
        }
        ensure!(
            bytes_of(dst.as_ref(), 0, REFUSED_LEN as u64) == want,
            "bytes differ"
        );
    }
    println!("\nBACKENDS {}", backends.join(" "));
    Ok(())
}

/// A copy of this test binary that user `nobody` can run, in a directory of its own under
/// the temporary directory (removed on drop): the checkout may lie where `nobody` cannot
/// reach it (a clone in a private directory).
struct RunnableCopy {
    dir: std::path::PathBuf,
    exe: std::path::PathBuf,
}

impl RunnableCopy {
    /// The copy, or why `nobody` could not run one.
    fn new() -> Result<std::result::Result<Self, String>> {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let dir = std::env::temp_dir().join(format!("kvlease-nobody-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let copy = Self {
            exe: dir.join("shm-test"),
            dir,
        };
        std::fs::set_permissions(&copy.dir, std::fs::Permissions::from_mode(0o755))?;
        std::fs::copy(std::env::current_exe()?, &copy.exe)?;
        std::fs::set_permissions(&copy.exe, std::fs::Permissions::from_mode(0o755))?;
        // Every directory above it must let others through.
        for dir in copy.dir.ancestors().skip(1) {
            if std::fs::metadata(dir)?.mode() & 0o001 == 0 {
                return Ok(Err(format!(
                    "{} is closed to other users, so nobody cannot run a copy of the test \
                     binary under the temporary directory (set TMPDIR elsewhere)",
                    dir.display()
                )));
            }
        }
        Ok(Ok(copy))
    }
}

impl Drop for RunnableCopy {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// D runs as another user (`nobody`, without `CAP_SYS_PTRACE`): P hands it the address
/// of its heap region, but the kernel refuses D's `process_vm_readv` (`EPERM`), so D's
/// batches go over TCP, report `tcp`, and the bytes are right. Needs root (to start D as
/// another user); skipped otherwise. D runs from a copy of this binary under the
/// temporary directory, so that wherever the checkout lies `nobody` can execute it
/// (skipped, saying why, when the temporary directory itself is closed to others).
#[test]
fn a_reader_the_kernel_refuses_reads_over_tcp() -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::process::CommandExt;
    if std::fs::metadata("/proc/self")?.uid() != 0 {
        eprintln!("skipped: starting D as another user needs root");
        return Ok(());
    }
    let copy = match RunnableCopy::new()? {
        Ok(copy) => copy,
        Err(why) => {
            eprintln!("skipped: {why}");
            return Ok(());
        }
    };
    let p = agent_cma("p", CmaPolicy::LastPeer);
    let desc = p.register(heap(REFUSED_LEN, 29))?;
    let meta: String = p.metadata().iter().map(|b| format!("{b:02x}")).collect();
    let mut child = Command::new(&copy.exe)
        .args(["--exact", "cma_refused_child_process", "--nocapture"])
        .args(["--test-threads=1"])
        .env(CMA_REFUSED_CHILD_ENV, "1")
        .uid(65534)
        .gid(65534)
        .current_dir("/")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    writeln!(
        child.stdin.take().context("stdin")?,
        "{} {} {meta}",
        desc.id,
        desc.key
    )?;
    let mut out = String::new();
    child
        .stdout
        .take()
        .context("stdout")?
        .read_to_string(&mut out)?;
    ensure!(child.wait()?.success(), "D failed: {out}");
    let backends = out
        .lines()
        .find_map(|l| l.strip_prefix("BACKENDS "))
        .context("no BACKENDS line")?;
    ensure!(backends == "tcp tcp", "{backends}");
    Ok(())
}

/// A write's destination: region, key, offset.
type WriteDest = (u64, u64, u64);
/// A write's fence: region, key, offset, expected generation.
type WriteFenceWords = (u64, u64, u64, u64);

/// A `WRITE_REQ` frame with its payload, as a peer on the shm socket sends it.
fn shm_write_req(req: u64, dst: WriteDest, fence: WriteFenceWords, payload: &[u8]) -> Vec<u8> {
    let mut body = Vec::new();
    for v in [
        req,
        dst.0,
        dst.1,
        dst.2,
        payload.len() as u64,
        fence.0,
        fence.1,
        fence.2,
        fence.3,
    ] {
        body.extend_from_slice(&v.to_le_bytes());
    }
    let mut f = frame(18, &body);
    f.extend_from_slice(payload);
    f
}

/// The answer to a write on the shm socket: `Ok` for `WRITE_ACK`, the refusal code of a
/// `WRITE_ERR`.
fn shm_write_answer(s: &mut UnixStream, req: u64) -> Result<Result<(), u8>> {
    let mut header = [0u8; 5];
    s.read_exact(&mut header)?;
    let mut body = vec![0; u32::from_le_bytes(header[1..5].try_into()?) as usize];
    s.read_exact(&mut body)?;
    ensure!(
        u64::from_le_bytes(body[..8].try_into()?) == req,
        "answer to another write"
    );
    match header[0] {
        19 => Ok(Ok(())),
        20 => Ok(Err(body[8])),
        t => bail!("frame type {t}"),
    }
}

/// A pulled write and its answer: req id, source (id, offset), destination, fence.
type PullCase = (u64, (u64, u64), WriteDest, WriteFenceWords, Result<(), u8>);

/// A `WRITE_PULL` frame: the write's bytes are `len` bytes at `src` (source id, offset).
fn shm_write_pull(
    req: u64,
    src: (u64, u64),
    dst: WriteDest,
    len: u64,
    fence: WriteFenceWords,
) -> Vec<u8> {
    let mut body = Vec::new();
    for v in [
        req, src.0, src.1, dst.0, dst.1, dst.2, len, fence.0, fence.1, fence.2, fence.3,
    ] {
        body.extend_from_slice(&v.to_le_bytes());
    }
    frame(22, &body)
}

#[test]
fn writes_pulled_from_a_handed_over_memfd_are_checked_and_fenced() -> Result<()> {
    let d = agent("d", BackendChoice::Shm, None);
    let dst_region = Arc::new(HostRegion::new(4096)?);
    let dst = d.register(dst_region.clone())?;
    let fence = d.register(Arc::new(HostRegion::new(64)?))?;
    d.set_write_fence(RegionId(fence.id), 8, 5)?;
    let meta = decode_metadata(&d.metadata())?;
    ensure!(
        meta.backends["shm"]["write_pull"] == true,
        "D does not offer pulled writes"
    );
    let (mut s, ..) = raw_shm_client(&d, "w")?;
    // The writer's source: a memfd-backed region handed over as source 1.
    let src = filled(1024, 3);
    let mut body = 1u64.to_le_bytes().to_vec();
    body.extend_from_slice(&1024u64.to_le_bytes());
    let fd = src.shared_fd().context("a memfd")?;
    send_with_fds(s.as_fd(), &frame(21, &body), &[fd])?;
    let f = (fence.id, fence.key, 8, 5);
    let cases: [PullCase; 7] = [
        (1, (1, 7), (dst.id, dst.key, 100), f, Ok(())),
        // A source never handed over.
        (2, (9, 0), (dst.id, dst.key, 0), f, Err(2)),
        // Past the source's end.
        (3, (1, 1020), (dst.id, dst.key, 0), f, Err(4)),
        (4, (1, 0), (dst.id + 99, dst.key, 0), f, Err(2)),
        (5, (1, 0), (dst.id, dst.key ^ 1, 0), f, Err(3)),
        (6, (1, 0), (dst.id, dst.key, 4090), f, Err(4)),
        (
            7,
            (1, 0),
            (dst.id, dst.key, 0),
            (fence.id, fence.key, 8, 4),
            Err(7),
        ),
    ];
    for (req, from, to, fence, want) in cases {
        s.write_all(&shm_write_pull(req, from, to, 16, fence))?;
        let got = shm_write_answer(&mut s, req)?;
        ensure!(got == want, "write {req}: {got:?}, want {want:?}");
    }
    let bytes = bytes_of(dst_region.as_ref(), 0, 4096);
    ensure!(
        bytes[100..116] == bytes_of(src.as_ref(), 7, 16)[..],
        "the good write did not land"
    );
    ensure!(
        bytes
            .iter()
            .enumerate()
            .all(|(i, &b)| (100..116).contains(&i) || b == 0),
        "a refused write landed"
    );
    // Once the fence moved on, a pulled write of the old generation lands nothing.
    d.set_write_fence(RegionId(fence.id), 8, 6)?;
    s.write_all(&shm_write_pull(8, (1, 0), (dst.id, dst.key, 0), 16, f))?;
    ensure!(shm_write_answer(&mut s, 8)? == Err(7));
    ensure!(bytes_of(dst_region.as_ref(), 0, 4096) == bytes);
    // Socket writes still go on the same stream, after pulled ones.
    let f6 = (fence.id, fence.key, 8, 6);
    s.write_all(&shm_write_req(9, (dst.id, dst.key, 200), f6, &[0xcd; 8]))?;
    ensure!(shm_write_answer(&mut s, 9)? == Ok(()));
    s.write_all(&shm_write_pull(10, (1, 0), (dst.id, dst.key, 300), 8, f6))?;
    ensure!(shm_write_answer(&mut s, 10)? == Ok(()));
    let now = bytes_of(dst_region.as_ref(), 0, 4096);
    ensure!(now[200..208] == [0xcd; 8] && now[300..308] == bytes_of(src.as_ref(), 0, 8)[..]);
    ensure!(d.stats().writes_landed == 3 && d.stats().writes_refused == 7);
    // A source frame without its descriptor closes the connection.
    s.write_all(&frame(21, &body))?;
    let mut rest = Vec::new();
    ensure!(s.read_to_end(&mut rest)? == 0, "the connection stayed open");
    Ok(())
}

#[test]
fn write_frames_on_the_shm_socket_are_checked_and_hostile_ones_close_it() -> Result<()> {
    let d = agent("d", BackendChoice::Shm, None);
    let dst_region = Arc::new(HostRegion::new(4096)?);
    let dst = d.register(dst_region.clone())?;
    let fence = d.register(Arc::new(HostRegion::new(64)?))?;
    d.set_write_fence(RegionId(fence.id), 8, 5)?;
    let (mut s, ..) = raw_shm_client(&d, "w")?;
    let f = (fence.id, fence.key, 8, 5);
    let cases: [(u64, WriteDest, WriteFenceWords, Result<(), u8>); 6] = [
        (1, (dst.id, dst.key, 100), f, Ok(())),
        (2, (dst.id + 99, dst.key, 0), f, Err(2)),
        (3, (dst.id, dst.key ^ 1, 0), f, Err(3)),
        (4, (dst.id, dst.key, 4090), f, Err(4)),
        (5, (dst.id, dst.key, 0), (fence.id, fence.key, 8, 4), Err(7)),
        (6, (dst.id, dst.key, 0), (fence.id, fence.key, 3, 5), Err(4)),
    ];
    for (req, to, fence, want) in cases {
        s.write_all(&shm_write_req(req, to, fence, &[0xab; 16]))?;
        let got = shm_write_answer(&mut s, req)?;
        ensure!(got == want, "write {req}: {got:?}, want {want:?}");
    }
    let bytes = bytes_of(dst_region.as_ref(), 0, 4096);
    ensure!(
        bytes[100..116].iter().all(|&b| b == 0xab),
        "the good write did not land"
    );
    ensure!(
        bytes
            .iter()
            .enumerate()
            .all(|(i, &b)| (100..116).contains(&i) || b == 0),
        "a refused write landed"
    );
    ensure!(d.stats().writes_landed == 1 && d.stats().writes_refused == 5);
    // A write over the limit is refused and the connection closed (its payload is not
    // read); so is any other frame on the socket.
    let mut over = shm_write_req(7, (dst.id, dst.key, 0), f, &[]);
    // The length word (the fifth of the body).
    over[5 + 32..5 + 40].copy_from_slice(&((16u64 << 20) + 1).to_le_bytes());
    s.write_all(&over)?;
    ensure!(shm_write_answer(&mut s, 7)? == Err(6));
    let mut rest = Vec::new();
    ensure!(s.read_to_end(&mut rest)? == 0, "the connection stayed open");
    let (mut s, ..) = raw_shm_client(&d, "w2")?;
    s.write_all(&frame(8, b"hi"))?;
    ensure!(s.read_to_end(&mut rest)? == 0, "the connection stayed open");
    // Counted once the connection's thread ended, just after the peer saw it closed.
    let start = Instant::now();
    while d.stats().malformed_frames < 2 {
        ensure!(start.elapsed() < LIMIT, "malformed frames not counted");
        std::thread::sleep(Duration::from_millis(1));
    }
    ensure!(bytes_of(dst_region.as_ref(), 0, 4096) == bytes);
    Ok(())
}

/// A `SHM_WRITE_CMA_SRC` frame: source id, length, address in the sender's process.
fn cma_source(id: u64, len: u64, addr: u64) -> Vec<u8> {
    let words = [id, len, addr];
    frame(
        23,
        &words
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect::<Vec<_>>(),
    )
}

/// A receiver of pulled writes: a heap destination, a fence word at offset 0 of `fence`
/// holding generation 9, and a raw shm client past the hand-over.
struct PullTarget {
    d: Agent,
    dst: Arc<HostRegion>,
    dest: RegionDesc,
    fence: RegionDesc,
    s: UnixStream,
}

fn pull_target(dst_len: usize, client: &str) -> Result<PullTarget> {
    let d = agent("d", BackendChoice::Auto, None);
    let dst = Arc::new(HostRegion::new(dst_len)?);
    let dest = d.register(dst.clone())?;
    let fence = d.register(Arc::new(HostRegion::new(4096)?))?;
    d.set_write_fence(RegionId(fence.id), 0, 9)?;
    let (s, ..) = raw_shm_client(&d, client)?;
    Ok(PullTarget {
        d,
        dst,
        dest,
        fence,
        s,
    })
}

/// A pulled write's source (id, offset), length, generation, and the answer it gets.
type LyingPull = ((u64, u64), u64, u64, Result<(), u8>);

/// A writer that lies about its cma sources (an address that is none, ranges past a
/// source, a source named twice) gets typed refusals and lands nothing it should not;
/// only a real range of its own process lands, and only under the fence's generation.
#[test]
fn a_writer_lying_about_its_cma_sources_is_refused_and_lands_nothing() -> Result<()> {
    let PullTarget {
        d,
        dst,
        dest,
        fence,
        mut s,
    } = pull_target(1 << 16, "liar")?;
    // This process's own heap: what an honest writer names.
    let src: Vec<u8> = (0..4096).map(|i| (i % 253) as u8 | 1).collect();
    s.write_all(&cma_source(1, 4096, 0))?;
    s.write_all(&cma_source(2, 4096, src.as_ptr() as u64))?;
    let cases: [LyingPull; 5] = [
        // Address 0 is no range: the writer is told to send the bytes itself.
        ((1, 0), 4096, 9, Err(8)),
        // Past the end of the source it named.
        ((2, 1), 4096, 9, Err(4)),
        // A source it never named.
        ((7, 0), 16, 9, Err(2)),
        // Another generation than the fence holds.
        ((2, 0), 4096, 8, Err(7)),
        // The real range under the fence's generation: lands.
        ((2, 0), 4096, 9, Ok(())),
    ];
    for (req, (from, len, generation, want)) in (1u64..).zip(cases) {
        let to = (dest.id, dest.key, 0);
        let words = (fence.id, fence.key, 0, generation);
        s.write_all(&shm_write_pull(req, from, to, len, words))?;
        let got = shm_write_answer(&mut s, req)?;
        ensure!(got == want, "write {req}: {got:?}, want {want:?}");
        if want.is_err() {
            ensure!(
                bytes_of(dst.as_ref(), 0, 1 << 16).iter().all(|&b| b == 0),
                "refused write {req} landed bytes"
            );
        }
    }
    ensure!(bytes_of(dst.as_ref(), 0, 4096) == src);
    let stats = d.stats();
    ensure!(stats.writes_pulled == 1 && stats.writes_refused == 4 && stats.writes_stale == 1);
    // Naming a source id twice breaks the stream: D closes it.
    s.write_all(&cma_source(2, 4096, src.as_ptr() as u64))?;
    let mut byte = [0u8; 1];
    ensure!(
        matches!(s.read(&mut byte), Ok(0) | Err(_)),
        "D kept serving a stream that named a source twice"
    );
    ensure!(d.stats().malformed_frames >= 1);
    Ok(())
}

/// A pulled write's source (id, offset), destination offset, generation, and the answer
/// it gets.
type GroupedPull = ((u64, u64), u64, u64, Result<(), u8>);

/// Pulls that arrive together (one send) land together under one check of their fence
/// word, yet each is answered, in order, as it fares alone: a source never named, a range
/// past its source, an address nothing is mapped at (the kernel's read fails) and another
/// generation than the fence holds are refused and land nothing; the pulls beside them
/// land.
#[test]
fn pulls_that_arrive_together_are_each_answered_as_they_fare() -> Result<()> {
    let PullTarget {
        d,
        dst,
        dest,
        fence,
        mut s,
    } = pull_target(1 << 20, "group")?;
    let src: Vec<u8> = (0..1 << 18).map(|i| (i % 251) as u8 | 1).collect();
    let mut frames = cma_source(1, 1 << 18, src.as_ptr() as u64);
    // Below the lowest address a process may map: the read fails with EFAULT.
    frames.extend(cma_source(2, 1 << 15, 4096));
    let piece = 1u64 << 14;
    let mut cases: Vec<GroupedPull> = (0..16)
        .map(|i| ((1, i * piece), i * piece, 9, Ok(())))
        .collect();
    cases[3] = ((7, 0), 3 * piece, 9, Err(2));
    cases[5] = ((1, 1 << 18), 5 * piece, 9, Err(4));
    cases[8] = ((2, 0), 8 * piece, 9, Err(8));
    cases[11] = ((1, 11 * piece), 11 * piece, 8, Err(7));
    for (req, (from, to, generation, _)) in (1u64..).zip(&cases) {
        let to = (dest.id, dest.key, *to);
        let words = (fence.id, fence.key, 0, *generation);
        frames.extend(shm_write_pull(req, *from, to, piece, words));
    }
    s.write_all(&frames)?;
    for (req, (_, to, _, want)) in (1u64..).zip(&cases) {
        let got = shm_write_answer(&mut s, req)?;
        ensure!(got == *want, "write {req}: {got:?}, want {want:?}");
        let landed = bytes_of(dst.as_ref(), *to, piece);
        if want.is_ok() {
            let at = *to as usize;
            ensure!(
                landed == src[at..at + piece as usize],
                "write {req} landed wrong bytes"
            );
        } else {
            ensure!(
                landed.iter().all(|&b| b == 0),
                "refused write {req} landed bytes"
            );
        }
    }
    let stats = d.stats();
    ensure!(
        stats.writes_pulled == 12 && stats.writes_refused == 4 && stats.writes_stale == 1,
        "{stats:?}"
    );
    ensure!(stats.bytes_landed == 12 * piece);
    Ok(())
}
