//! Fenced one-sided writes on the same-host backend, over the real shm link (agents on one
//! host, real Unix sockets, real threads and a second process): byte-exact landing in
//! memfd-backed and plain heap (cma) memory, pulled by the receiver from the writer's
//! memfds and, with cross-memory attach, from its plain heap memory (on the socket when
//! the kernel refuses that read), refusal (`Stale`, nothing landed) after the receiver
//! cleared the fence, and a race of writers hammering while the receiver clears the
//! fence and reuses the memory for another pattern.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use kvlease_gpu_mem::{DmaRegion, ForeignRegion, HostRegion, RegionBytes};
use kvlease_transport::{
    Agent, AgentConfig, Backend, BackendChoice, BatchStatus, CmaPolicy, LocalRange, PeerId,
    RegionDesc, RegionId, TransferError, WriteBatch, WriteFence, WriteOp,
};

use common::{LIMIT, bytes_of, filled, wait};

/// The fence word's offset in D's fence region.
const FENCE_AT: u64 = 8;

fn agent(name: &str) -> Agent {
    agent_with(name, CmaPolicy::default())
}

fn agent_with(name: &str, cma: CmaPolicy) -> Agent {
    let mut c = AgentConfig::new(name);
    c.backend = BackendChoice::Shm;
    c.auth_token = Some(b"tok".to_vec());
    c.cma = cma;
    Agent::new(c).expect("agent binds on loopback")
}

/// D's memory: memfd-backed (`HostRegion`), or plain heap memory (`ForeignRegion`, as a
/// buffer registered from Python is: the memory cma reaches).
#[derive(Clone, Copy, Debug)]
enum Memory {
    Memfd,
    Heap,
}

fn zeroed(len: usize, memory: Memory) -> Result<Arc<dyn DmaRegion>> {
    Ok(match memory {
        Memory::Memfd => Arc::new(HostRegion::new(len)?),
        Memory::Heap => Arc::new(ForeignRegion::from_heap(vec![0; len])?),
    })
}

/// D with a zeroed destination and a fence region, P with a filled source, P connected
/// to D over shm.
struct Pair {
    p: Agent,
    d: Agent,
    src: Arc<HostRegion>,
    src_id: RegionId,
    dst: Arc<dyn DmaRegion>,
    dst_desc: RegionDesc,
    fence_desc: RegionDesc,
    peer: PeerId,
}

fn pair(len: usize, memory: Memory) -> Result<Pair> {
    pair_with(len, memory, CmaPolicy::default())
}

/// As [`pair`], with cma on P as `cma` says.
fn pair_with(len: usize, memory: Memory, cma: CmaPolicy) -> Result<Pair> {
    let d = agent("d");
    let dst = zeroed(len, memory)?;
    let dst_desc = d.register(dst.clone())?;
    let fence_desc = d.register(zeroed(64, memory)?)?;
    let p = agent_with("p", cma);
    let src = filled(len, 7);
    let src_id = RegionId(p.register(src.clone())?.id);
    let peer = p.connect(&d.metadata())?;
    let (backend, why) = p.peer_backend(peer).context("connected")?;
    ensure!(backend == Backend::Shm, "{backend}: {why}");
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
    fn op(&self, src_offset: u64, dst_offset: u64, len: u64) -> WriteOp {
        WriteOp {
            local: LocalRange {
                region: self.src_id,
                offset: src_offset,
                len,
            },
            remote: self.dst_desc.at(dst_offset),
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
                fence: WriteFence {
                    remote: self.fence_desc.at(FENCE_AT),
                    expected,
                },
            },
            LIMIT,
        )?;
        wait(&self.p, b)
    }
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

fn lands_byte_exact(memory: Memory) -> Result<()> {
    let t = pair(4 << 20, memory)?;
    t.set_fence(7)?;
    // One op over the 1 MiB chunk length (split), two small ones.
    let ops = vec![
        t.op(0, 1 << 20, (2 << 20) + 123),
        t.op(3 << 20, 17, 4000),
        t.op(100, (3 << 20) + 500, 1),
    ];
    let status = t.write(ops.clone(), 7, Some(b"landed".to_vec()))?;
    let BatchStatus::Done(stats) = status else {
        bail!("expected Done, got {status:?}");
    };
    ensure!(stats.ops == 3 && stats.bytes == (2 << 20) + 123 + 4000 + 1);
    ensure!(stats.backend == Backend::Shm, "{}", stats.backend);
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
    // The notification comes only after the writes landed (D's process landed them).
    ensure!(notifs(&t.d, 1, LIMIT) == vec![b"landed".to_vec()]);
    let stats = t.d.stats();
    ensure!(stats.writes_landed >= 3 && stats.bytes_landed == (2 << 20) + 123 + 4000 + 1);
    Ok(())
}

#[test]
fn a_write_lands_byte_exact_in_memfd_memory_over_shm() -> Result<()> {
    lands_byte_exact(Memory::Memfd)
}

#[test]
fn a_write_lands_byte_exact_in_plain_heap_memory_over_shm() -> Result<()> {
    lands_byte_exact(Memory::Heap)
}

#[test]
fn a_write_after_the_receiver_cleared_the_fence_is_stale_and_lands_nothing() -> Result<()> {
    for memory in [Memory::Memfd, Memory::Heap] {
        let t = pair(1 << 20, memory)?;
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
            "{memory:?}: {status:?}"
        );
        ensure!(
            bytes_of(t.dst.as_ref(), 0, 1 << 20) == before,
            "{memory:?}: a stale write landed"
        );
        // A write carrying another generation than the one published is refused too.
        t.set_fence(4)?;
        let status = t.write(vec![t.op(0, 0, 10)], 3, None)?;
        ensure!(matches!(
            status,
            BatchStatus::Failed(TransferError::Stale { .. })
        ));
        ensure!(bytes_of(t.dst.as_ref(), 0, 1 << 20) == before);
        ensure!(t.d.stats().writes_stale >= 2 && t.d.stats().writes_landed == 1);
        // The link still writes: the new generation lands.
        ensure!(matches!(
            t.write(vec![t.op(0, 0, 4096)], 4, None)?,
            BatchStatus::Done(_)
        ));
        ensure!(
            notifs(&t.d, 1, Duration::from_millis(50)).is_empty(),
            "{memory:?}: a refused batch sent its notification"
        );
    }
    Ok(())
}

#[test]
fn refused_writes_name_why_and_land_nothing() -> Result<()> {
    let t = pair(1 << 16, Memory::Memfd)?;
    t.set_fence(1)?;
    let mut bad_key = t.op(0, 0, 16);
    bad_key.remote.key ^= 1;
    let past_end = t.op(0, (1 << 16) - 8, 16);
    for op in [bad_key, past_end] {
        let status = t.write(vec![op], 1, None)?;
        ensure!(
            matches!(status, BatchStatus::Failed(TransferError::Refused { .. })),
            "{status:?}"
        );
    }
    ensure!(bytes_of(t.dst.as_ref(), 0, 1 << 16).iter().all(|&b| b == 0));
    Ok(())
}

/// P's plain heap memory (as a serving engine's CPU cache or a Python buffer is), for
/// writes from it: `len` bytes of a pattern.
fn heap_source(p: &Agent, len: usize) -> Result<(RegionId, Vec<u8>)> {
    let bytes: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
    let heap = Arc::new(ForeignRegion::from_heap(bytes.clone())?);
    Ok((RegionId(p.register(heap)?.id), bytes))
}

/// Writes from P's plain heap memory and from its memfd in one batch, with cma on P as
/// `cma` says: D pulls the memfd chunk always, the heap chunk with cross-memory attach
/// when P allows it (else its payload goes on the socket); every byte lands either way,
/// and after the clear neither way lands a byte of the old generation.
fn heap_and_memfd_writes_land(cma: CmaPolicy) -> Result<()> {
    let t = pair_with(1 << 20, Memory::Memfd, cma)?;
    t.set_fence(2)?;
    let (heap_id, heap_bytes) = heap_source(&t.p, 300_000)?;
    let from_heap = |src_offset, dst_offset, len| WriteOp {
        local: LocalRange {
            region: heap_id,
            offset: src_offset,
            len,
        },
        remote: t.dst_desc.at(dst_offset),
    };
    let ops = vec![from_heap(0, 0, 300_000), t.op(5, 400_000, 200_000)];
    let status = t.write(ops, 2, None)?;
    let BatchStatus::Done(stats) = status else {
        bail!("{cma:?}: expected Done, got {status:?}");
    };
    ensure!(stats.backend == Backend::Shm, "{}", stats.backend);
    ensure!(bytes_of(t.dst.as_ref(), 0, 300_000) == heap_bytes);
    ensure!(bytes_of(t.dst.as_ref(), 400_000, 200_000) == bytes_of(t.src.as_ref(), 5, 200_000));
    let before = bytes_of(t.dst.as_ref(), 0, 1 << 20);
    ensure!(before[300_000..400_000].iter().all(|&b| b == 0));
    let d_stats = t.d.stats();
    let pulled = if cma == CmaPolicy::Off { 1 } else { 2 };
    ensure!(
        d_stats.writes_landed == 2 && d_stats.writes_pulled == pulled,
        "{cma:?}: {} landed, {} pulled",
        d_stats.writes_landed,
        d_stats.writes_pulled
    );
    // After the clear, neither way lands a byte of the old generation.
    t.set_fence(0)?;
    for op in [from_heap(0, 0, 1000), t.op(0, 0, 1000)] {
        let status = t.write(vec![op], 2, None)?;
        ensure!(
            matches!(
                status,
                BatchStatus::Failed(TransferError::Stale { expected: 2, .. })
            ),
            "{cma:?}: {status:?}"
        );
    }
    ensure!(bytes_of(t.dst.as_ref(), 0, 1 << 20) == before);
    Ok(())
}

#[test]
fn a_write_from_plain_heap_memory_is_pulled_with_cross_memory_attach_and_lands() -> Result<()> {
    heap_and_memfd_writes_land(CmaPolicy::default())
}

#[test]
fn a_write_from_plain_heap_memory_goes_on_the_socket_with_cma_off_and_lands() -> Result<()> {
    heap_and_memfd_writes_land(CmaPolicy::Off)
}

/// `len` bytes at `offset` of any region (staged memory is not host-accessible).
fn staged_bytes(r: &dyn DmaRegion, offset: u64, len: u64) -> Result<Vec<u8>> {
    let mut v = vec![0; len as usize];
    kvlease_gpu_mem::staging::read_region(r, offset as usize, &mut v)?;
    Ok(v)
}

/// Writes into and out of staged memory (the path CUDA device memory takes) over shm:
/// D pulls a memfd source (and, with cma, a heap source) into a host bounce buffer and
/// copies it into its staged destination under the fence lock; a staged source's payload
/// goes on the socket from P's host bounce buffer. Every byte lands; after the clear none
/// of the old generation does, whichever way it came.
#[test]
fn writes_into_and_out_of_staged_memory_land_byte_exact_over_shm() -> Result<()> {
    use kvlease_gpu_mem::StagedHostRegion;
    const LEN: usize = 3 << 20;
    let d = agent("d");
    let dst: Arc<dyn DmaRegion> = Arc::new(StagedHostRegion::new(LEN)?);
    let dst_desc = d.register(dst.clone())?;
    let fence = d.register(Arc::new(HostRegion::new(64)?))?;
    d.set_write_fence(RegionId(fence.id), FENCE_AT, 9)?;
    let p = agent("p");
    let memfd = filled(LEN, 3);
    let memfd_id = RegionId(p.register(memfd.clone())?.id);
    let (heap_id, heap_bytes) = heap_source(&p, 500_000)?;
    let staged_src: Arc<dyn DmaRegion> = Arc::new(StagedHostRegion::new(LEN)?);
    let pattern: Vec<u8> = (0..LEN).map(|i| (i * 7 % 253) as u8 | 1).collect();
    kvlease_gpu_mem::staging::write_region(staged_src.as_ref(), 0, &pattern)?;
    let staged_id = RegionId(p.register(staged_src)?.id);
    let peer = p.connect(&d.metadata())?;
    let (backend, why) = p.peer_backend(peer).context("connected")?;
    ensure!(backend == Backend::Shm, "{backend}: {why}");
    let op = |region, src_offset, dst_offset, len| WriteOp {
        local: LocalRange {
            region,
            offset: src_offset,
            len,
        },
        remote: dst_desc.at(dst_offset),
    };
    let write = |ops: Vec<WriteOp>, expected| -> Result<BatchStatus> {
        let b = p.post_write(
            peer,
            WriteBatch {
                ops,
                notif: None,
                fence: WriteFence {
                    remote: fence.at(FENCE_AT),
                    expected,
                },
            },
            LIMIT,
        )?;
        wait(&p, b)
    };
    // Memfd (pulled, over the 1 MiB chunk length), heap (pulled with cma), staged (on
    // the socket), side by side in the destination.
    let ops = vec![
        op(memfd_id, 10, 0, (1 << 20) + 5),
        op(heap_id, 0, 1 << 20 | 1 << 19, 500_000),
        op(staged_id, 3, 2 << 20, 700_000),
    ];
    let status = write(ops, 9)?;
    let BatchStatus::Done(stats) = status else {
        bail!("expected Done, got {status:?}");
    };
    ensure!(stats.backend == Backend::Shm, "{}", stats.backend);
    ensure!(
        staged_bytes(dst.as_ref(), 0, (1 << 20) + 5)?
            == bytes_of(memfd.as_ref(), 10, (1 << 20) + 5)
    );
    ensure!(staged_bytes(dst.as_ref(), 1 << 20 | 1 << 19, 500_000)? == heap_bytes);
    ensure!(staged_bytes(dst.as_ref(), 2 << 20, 700_000)? == pattern[3..700_003]);
    ensure!(
        staged_bytes(dst.as_ref(), (1 << 20) + 5, (1 << 19) - 5)?
            .iter()
            .all(|&b| b == 0),
        "bytes between the writes changed"
    );
    ensure!(
        d.stats().writes_pulled >= 2,
        "{} pulled",
        d.stats().writes_pulled
    );
    let before = staged_bytes(dst.as_ref(), 0, LEN as u64)?;
    d.set_write_fence(RegionId(fence.id), FENCE_AT, 0)?;
    for o in [
        op(memfd_id, 0, 0, 4096),
        op(heap_id, 0, 0, 4096),
        op(staged_id, 0, 0, 4096),
    ] {
        let status = write(vec![o], 9)?;
        ensure!(
            matches!(
                status,
                BatchStatus::Failed(TransferError::Stale { expected: 9, .. })
            ),
            "{status:?}"
        );
    }
    ensure!(
        staged_bytes(dst.as_ref(), 0, LEN as u64)? == before,
        "a stale write landed in staged memory"
    );
    Ok(())
}

/// The new request's bytes D puts into the blocks after it reused them.
fn reuse_pattern(round: u64, len: u64) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(31) ^ round.wrapping_mul(0x9e)) as u8 | 1)
        .collect()
}

/// Writers hammer D's blocks under one generation while D clears the fence, at once
/// fills the blocks with another request's bytes, and checks that none of them changes
/// afterwards: a write checked before the clear but landed after it (a fence check
/// that did not exclude the clear) shows as a changed byte.
fn no_write_lands_after_the_clear(memory: Memory) -> Result<()> {
    const SLOT: u64 = 128 * 1024;
    const WRITERS: u64 = 4;
    for round in 0..8u64 {
        let t = Arc::new(pair((SLOT * WRITERS) as usize, memory)?);
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
                        // Fresh bytes for every write, split in 16 KiB chunks.
                        let stamp = (w << 40 | i).to_le_bytes().repeat((SLOT / 8) as usize);
                        t.src.write_from(w * SLOT, &stamp)?;
                        let ops = (0..SLOT / (16 << 10))
                            .map(|k| {
                                t.op(
                                    w * SLOT + k * (16 << 10),
                                    w * SLOT + k * (16 << 10),
                                    16 << 10,
                                )
                            })
                            .collect();
                        match t.write(ops, generation, None)? {
                            BatchStatus::Done(_) => {}
                            BatchStatus::Failed(TransferError::Stale { .. }) => stale += 1,
                            other => bail!("unexpected {other:?}"),
                        }
                    }
                    Ok(stale)
                })
            })
            .collect();
        let until = |what: &str, done: &dyn Fn() -> bool| -> Result<()> {
            let start = Instant::now();
            while !done() {
                ensure!(start.elapsed() < LIMIT, "{what} within {LIMIT:?}");
                std::thread::sleep(Duration::from_micros(200));
            }
            Ok(())
        };
        // Clear while writes stream in: after a few landed, at another point each round.
        until("writes landing", &|| {
            t.d.stats().writes_landed >= 8 * (round + 1)
        })?;
        t.set_fence(0)?;
        let landed = t.d.stats().writes_landed;
        // The blocks belong to another request now: its bytes.
        let reused = reuse_pattern(round, SLOT * WRITERS);
        t.dst.write_from(0, &reused)?;
        // Every writer meets the cleared fence at least once before they stop.
        until("stale writes", &|| t.d.stats().writes_stale >= 2 * WRITERS)?;
        stop.store(true, Ordering::SeqCst);
        let mut stale = 0;
        for w in writers {
            stale += w.join().expect("writer thread")?;
        }
        ensure!(landed > 0, "no write landed before the clear");
        ensure!(stale > 0, "no write was refused after the clear");
        let now = bytes_of(t.dst.as_ref(), 0, SLOT * WRITERS);
        let changed = now.iter().zip(&reused).filter(|(a, b)| a != b).count();
        ensure!(
            changed == 0,
            "{memory:?} round {round}: {changed} bytes of the reused blocks changed after the clear returned"
        );
        ensure!(
            t.d.stats().writes_landed == landed,
            "{memory:?}: a write landed after the clear"
        );
    }
    Ok(())
}

#[test]
fn no_byte_of_the_old_generation_lands_in_reused_memfd_blocks() -> Result<()> {
    no_write_lands_after_the_clear(Memory::Memfd)
}

#[test]
fn no_byte_of_the_old_generation_lands_in_reused_heap_blocks() -> Result<()> {
    no_write_lands_after_the_clear(Memory::Heap)
}

const CHILD_ENV: &str = "KVLEASE_SHM_WRITE_CHILD";
const CHILD_LEN: usize = 3 << 20;

/// The D side of `another_process_writes_into_this_one_over_shm` and
/// `a_write_the_receiver_may_not_read_from_goes_on_the_socket_and_lands`: does nothing
/// unless started by one. Registers a zeroed region (memfd or heap, per its argument
/// line) and a fence region, publishes generation 5, announces them, and on `check`
/// reports what landed (byte sum, writes pulled, writes refused).
#[test]
fn child_write_target() -> Result<()> {
    if std::env::var_os(CHILD_ENV).is_none() {
        return Ok(());
    }
    let d = agent("d-child");
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    let memory = if line.trim() == "heap" {
        Memory::Heap
    } else {
        Memory::Memfd
    };
    let dst = zeroed(CHILD_LEN, memory)?;
    let desc = d.register(dst.clone())?;
    let fence = d.register(zeroed(64, memory)?)?;
    d.set_write_fence(RegionId(fence.id), FENCE_AT, 5)?;
    let meta: String = d.metadata().iter().map(|b| format!("{b:02x}")).collect();
    println!(
        "\nDESC {} {} {} {}\nMETA {meta}",
        desc.id, desc.key, fence.id, fence.key
    );
    std::io::stdout().flush()?;
    line.clear();
    std::io::stdin().read_line(&mut line)?;
    // Cleared: the writer's next batch must land nothing.
    d.set_write_fence(RegionId(fence.id), FENCE_AT, 0)?;
    let sum: u64 = bytes_of(dst.as_ref(), 0, CHILD_LEN as u64)
        .iter()
        .map(|&b| u64::from(b))
        .sum();
    let stats = d.stats();
    println!(
        "\nSUM {sum}\nPULLED {} {}",
        stats.writes_pulled, stats.writes_refused
    );
    std::io::stdout().flush()?;
    line.clear();
    std::io::stdin().read_line(&mut line)?;
    let after: u64 = bytes_of(dst.as_ref(), 0, CHILD_LEN as u64)
        .iter()
        .map(|&b| u64::from(b))
        .sum();
    println!("\nAFTER {after}");
    std::io::stdout().flush()?;
    Ok(())
}

fn line_with(out: &mut impl BufRead, prefix: &str) -> Result<String> {
    let mut line = String::new();
    loop {
        line.clear();
        ensure!(out.read_line(&mut line)? > 0, "child ended early");
        if let Some(rest) = line.trim().strip_prefix(prefix) {
            return Ok(rest.to_owned());
        }
    }
}

/// A `child_write_target` process, run by `cmd` (the test binary, or a command that
/// runs it), with a destination of `memory` ("memfd" or "heap").
struct Target {
    child: std::process::Child,
    out: BufReader<std::process::ChildStdout>,
    stdin: std::process::ChildStdin,
    dst: RegionDesc,
    fence: RegionDesc,
    meta: Vec<u8>,
}

impl Target {
    fn start(mut cmd: Command, memory: &str) -> Result<Self> {
        let mut child = cmd
            .args([
                "--exact",
                "child_write_target",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let mut out = BufReader::new(child.stdout.take().context("stdout")?);
        let mut stdin = child.stdin.take().context("stdin")?;
        writeln!(stdin, "{memory}")?;
        let desc: Vec<u64> = line_with(&mut out, "DESC ")?
            .split(' ')
            .map(str::parse)
            .collect::<Result<_, _>>()?;
        let [id, key, fence_id, fence_key] = desc[..] else {
            bail!("DESC {desc:?}");
        };
        let hex = line_with(&mut out, "META ")?;
        let meta: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16))
            .collect::<Result<_, _>>()?;
        let dst = RegionDesc {
            id,
            key,
            len: CHILD_LEN as u64,
            base: 0,
        };
        let fence = RegionDesc {
            id: fence_id,
            key: fence_key,
            len: 64,
            base: 0,
        };
        Ok(Self {
            child,
            out,
            stdin,
            dst,
            fence,
            meta,
        })
    }

    /// Asks the child for what landed: the byte sum of its destination, its
    /// `writes_pulled` and `writes_refused` (then it clears the fence).
    fn check(&mut self) -> Result<(u64, u64, u64)> {
        writeln!(self.stdin, "check")?;
        let sum = line_with(&mut self.out, "SUM ")?.parse()?;
        let counts: Vec<u64> = line_with(&mut self.out, "PULLED ")?
            .split(' ')
            .map(str::parse)
            .collect::<Result<_, _>>()?;
        let [pulled, refused] = counts[..] else {
            bail!("PULLED {counts:?}");
        };
        Ok((sum, pulled, refused))
    }
}

/// A write of all of `src` into the child's destination under generation `expected`.
fn child_batch(src: RegionId, t: &Target, expected: u64) -> WriteBatch {
    WriteBatch {
        ops: vec![WriteOp {
            local: LocalRange {
                region: src,
                offset: 0,
                len: CHILD_LEN as u64,
            },
            remote: t.dst.at(0),
        }],
        notif: None,
        fence: WriteFence {
            remote: t.fence.at(FENCE_AT),
            expected,
        },
    }
}

/// P in this process writes all of `src` (registered as `src_id`) into the child
/// `target` under generation 5; the child's destination must then sum to `want`. Then
/// the child clears the fence, and a write of other bytes lands nothing. Returns the
/// child's `writes_pulled` and `writes_refused`.
fn write_into_child(
    mut target: Target,
    p: &Agent,
    src: &dyn DmaRegion,
    src_id: RegionId,
    what: &str,
) -> Result<(u64, u64)> {
    let peer = p.connect(&target.meta)?;
    ensure!(p.peer_backend(peer).map(|b| b.0) == Some(Backend::Shm));
    let status = wait(
        p,
        p.post_write(peer, child_batch(src_id, &target, 5), LIMIT)?,
    )?;
    let BatchStatus::Done(stats) = status else {
        bail!("{what}: {status:?}");
    };
    ensure!(stats.backend == Backend::Shm && stats.bytes == CHILD_LEN as u64);
    let want: u64 = bytes_of(src, 0, CHILD_LEN as u64)
        .iter()
        .map(|&b| u64::from(b))
        .sum();
    let (sum, pulled, refused) = target.check()?;
    ensure!(sum == want, "{what}: the child holds {sum}, want {want}");
    // The child cleared the fence before it answered: refused, nothing lands.
    src.write_from(0, &vec![0xff; CHILD_LEN])?;
    let status = wait(
        p,
        p.post_write(peer, child_batch(src_id, &target, 5), LIMIT)?,
    )?;
    ensure!(
        matches!(status, BatchStatus::Failed(TransferError::Stale { .. })),
        "{what}: {status:?}"
    );
    writeln!(target.stdin, "again")?;
    let after: u64 = line_with(&mut target.out, "AFTER ")?.parse()?;
    ensure!(after == want, "{what}: a stale write landed in the child");
    ensure!(target.child.wait()?.success());
    Ok((pulled, refused))
}

#[test]
fn another_process_writes_into_this_one_over_shm() -> Result<()> {
    for memory in ["memfd", "heap"] {
        let target = Target::start(Command::new(std::env::current_exe()?), memory)?;
        let p = agent("p");
        let src = filled(CHILD_LEN, 9);
        let src_id = RegionId(p.register(src.clone())?.id);
        let (pulled, refused) = write_into_child(target, &p, src.as_ref(), src_id, memory)?;
        // Three chunks of 1 MiB, each pulled from P's memfd.
        ensure!(
            pulled == 3 && refused == 0,
            "{memory}: {pulled} pulled, {refused} refused"
        );
    }
    Ok(())
}

/// P in this process writes from its plain heap memory into a `child_write_target`
/// run by `cmd`, as [`write_into_child`]; returns the child's `writes_pulled` and
/// `writes_refused`.
fn heap_into_child(cmd: Command, what: &str) -> Result<(u64, u64)> {
    let target = Target::start(cmd, "memfd")?;
    let p = agent("p");
    let bytes = bytes_of(filled(CHILD_LEN, 11).as_ref(), 0, CHILD_LEN as u64);
    let src = Arc::new(ForeignRegion::from_heap(bytes)?);
    let src_id = RegionId(p.register(src.clone())?.id);
    write_into_child(target, &p, src.as_ref(), src_id, what)
}

#[test]
fn another_process_pulls_writes_from_this_ones_heap_with_cross_memory_attach() -> Result<()> {
    let cmd = Command::new(std::env::current_exe()?);
    let (pulled, refused) = heap_into_child(cmd, "heap source")?;
    ensure!(
        pulled == 3 && refused == 0,
        "{pulled} pulled, {refused} refused"
    );
    Ok(())
}

/// Whether this process runs as root (and so may start a child under another user).
fn is_root() -> Result<bool> {
    let out = Command::new("id").arg("-u").output()?;
    Ok(String::from_utf8_lossy(&out.stdout).trim() == "0")
}

#[test]
fn a_write_the_receiver_may_not_read_from_goes_on_the_socket_and_lands() -> Result<()> {
    // D runs as another user, so the kernel refuses its `process_vm_readv` of this
    // process: its first pull is answered `SourceUnreadable`, and P sends that chunk and
    // the rest on the socket.
    if !is_root()? {
        eprintln!("skipped: starting D under another user needs root");
        return Ok(());
    }
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(std::env::current_exe()?);
    let (pulled, refused) = heap_into_child(cmd, "unreadable")?;
    // The pulls already sent when the first refusal came back (all three 1 MiB chunks
    // go out before it does) refused once each, every chunk then on the socket.
    ensure!(
        pulled == 0 && (1..=3).contains(&refused),
        "{pulled} pulled, {refused} refused"
    );
    Ok(())
}

const WRITER_ENV: &str = "KVLEASE_SHM_WRITE_WRITER";
const KILL_LEN: usize = 8 << 20;

/// The P side of `a_writer_killed_mid_write_holds_nothing_of_the_receiver`: does nothing
/// unless started by it. Reads D's metadata and regions from stdin, then writes 8 MiB
/// batches under generation 5 until it is killed.
#[test]
fn child_writer() -> Result<()> {
    if std::env::var_os(WRITER_ENV).is_none() {
        return Ok(());
    }
    let mut stdin = BufReader::new(std::io::stdin());
    let desc: Vec<u64> = line_with(&mut stdin, "DESC ")?
        .split(' ')
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let [id, key, fence_id, fence_key] = desc[..] else {
        bail!("DESC {desc:?}");
    };
    let hex = line_with(&mut stdin, "META ")?;
    let meta: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16))
        .collect::<Result<_, _>>()?;
    let p = agent("p-child");
    let src = RegionId(p.register(filled(KILL_LEN, 3))?.id);
    let peer = p.connect(&meta)?;
    let dst = RegionDesc {
        id,
        key,
        len: KILL_LEN as u64,
        base: 0,
    };
    let fence = RegionDesc {
        id: fence_id,
        key: fence_key,
        len: 64,
        base: 0,
    };
    loop {
        let batch = WriteBatch {
            ops: vec![WriteOp {
                local: LocalRange {
                    region: src,
                    offset: 0,
                    len: KILL_LEN as u64,
                },
                remote: dst.at(0),
            }],
            notif: None,
            fence: WriteFence {
                remote: fence.at(FENCE_AT),
                expected: 5,
            },
        };
        wait(&p, p.post_write(peer, batch, LIMIT)?)?;
    }
}

#[test]
fn a_writer_killed_mid_write_holds_nothing_of_the_receiver() -> Result<()> {
    let d = agent("d");
    let dst = zeroed(KILL_LEN, Memory::Memfd)?;
    let desc = d.register(dst.clone())?;
    let fence = d.register(zeroed(64, Memory::Memfd)?)?;
    d.set_write_fence(RegionId(fence.id), FENCE_AT, 5)?;
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--exact", "child_writer", "--nocapture", "--test-threads=1"])
        .env(WRITER_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()?;
    let meta: String = d.metadata().iter().map(|b| format!("{b:02x}")).collect();
    writeln!(
        child.stdin.as_mut().context("stdin")?,
        "DESC {} {} {} {}\nMETA {meta}",
        desc.id,
        desc.key,
        fence.id,
        fence.key
    )?;
    let start = Instant::now();
    while d.stats().writes_landed < 20 {
        ensure!(start.elapsed() < LIMIT, "the child's writes did not land");
        std::thread::sleep(Duration::from_millis(1));
    }
    // Killed while its writes stream in: most likely in the middle of one.
    child.kill()?;
    child.wait()?;
    let cleared = Instant::now();
    d.set_write_fence(RegionId(fence.id), FENCE_AT, 0)?;
    ensure!(
        cleared.elapsed() < Duration::from_secs(1),
        "the clear waited {:?} after the writer died",
        cleared.elapsed()
    );
    let landed = d.stats().writes_landed;
    let reused = reuse_pattern(1, KILL_LEN as u64);
    dst.write_from(0, &reused)?;
    std::thread::sleep(Duration::from_millis(100));
    ensure!(bytes_of(dst.as_ref(), 0, KILL_LEN as u64) == reused);
    ensure!(d.stats().writes_landed == landed);
    // D goes on: a new writer's write of the new generation lands.
    d.set_write_fence(RegionId(fence.id), FENCE_AT, 6)?;
    let p = agent("p");
    let src = filled(4096, 4);
    let src_id = RegionId(p.register(src.clone())?.id);
    let peer = p.connect(&d.metadata())?;
    let batch = WriteBatch {
        ops: vec![WriteOp {
            local: LocalRange {
                region: src_id,
                offset: 0,
                len: 4096,
            },
            remote: desc.at(0),
        }],
        notif: None,
        fence: WriteFence {
            remote: fence.at(FENCE_AT),
            expected: 6,
        },
    };
    ensure!(matches!(
        wait(&p, p.post_write(peer, batch, LIMIT)?)?,
        BatchStatus::Done(_)
    ));
    ensure!(bytes_of(dst.as_ref(), 0, 4096) == bytes_of(src.as_ref(), 0, 4096));
    Ok(())
}

const STOPPED_ENV: &str = "KVLEASE_SHM_WRITE_STOPPED";
const STOPPED_LEN: usize = 32 << 20;

/// The D side of `a_write_to_a_stopped_receiver_times_out_then_goes_over_tcp`: does
/// nothing unless started by it. Registers a zeroed region and a fence region under
/// generation 5, announces them, and waits for a line on stdin.
#[test]
fn child_stopped_target() -> Result<()> {
    if std::env::var_os(STOPPED_ENV).is_none() {
        return Ok(());
    }
    let d = agent("d-child");
    let desc = d.register(zeroed(STOPPED_LEN, Memory::Memfd)?)?;
    let fence = d.register(zeroed(64, Memory::Memfd)?)?;
    d.set_write_fence(RegionId(fence.id), FENCE_AT, 5)?;
    let meta: String = d.metadata().iter().map(|b| format!("{b:02x}")).collect();
    println!(
        "\nDESC {} {} {} {}\nMETA {meta}",
        desc.id, desc.key, fence.id, fence.key
    );
    std::io::stdout().flush()?;
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    Ok(())
}

fn signal(pid: u32, sig: &str) -> Result<()> {
    ensure!(
        Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()?
            .success(),
        "kill {sig} {pid}"
    );
    Ok(())
}

#[test]
fn a_write_to_a_stopped_receiver_times_out_then_goes_over_tcp() -> Result<()> {
    let mut child = Command::new(std::env::current_exe()?)
        .args([
            "--exact",
            "child_stopped_target",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(STOPPED_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut out = BufReader::new(child.stdout.take().context("stdout")?);
    let desc: Vec<u64> = line_with(&mut out, "DESC ")?
        .split(' ')
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let [id, key, fence_id, fence_key] = desc[..] else {
        bail!("DESC {desc:?}");
    };
    let hex = line_with(&mut out, "META ")?;
    let meta: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16))
        .collect::<Result<_, _>>()?;
    let p = agent("p");
    let src = filled(STOPPED_LEN, 6);
    let src_id = RegionId(p.register(src)?.id);
    let peer = p.connect(&meta)?;
    let batch = |len: usize| WriteBatch {
        ops: vec![WriteOp {
            local: LocalRange {
                region: src_id,
                offset: 0,
                len: len as u64,
            },
            remote: kvlease_transport::RemoteRange {
                region: id,
                key,
                offset: 0,
            },
        }],
        notif: None,
        fence: WriteFence {
            remote: kvlease_transport::RemoteRange {
                region: fence_id,
                key: fence_key,
                offset: FENCE_AT,
            },
            expected: 5,
        },
    };
    let pid = child.id();
    signal(pid, "-STOP")?;
    let started = Instant::now();
    let status = wait(
        &p,
        p.post_write(peer, batch(STOPPED_LEN), Duration::from_millis(300))?,
    );
    let took = started.elapsed();
    signal(pid, "-CONT")?;
    let status = status?;
    ensure!(
        matches!(status, BatchStatus::Failed(TransferError::Timeout { .. })),
        "{status:?}"
    );
    ensure!(took < Duration::from_secs(5), "the write took {took:?}");
    // The stream was given up mid-frame: the link's next write goes over TCP and lands.
    let status = wait(&p, p.post_write(peer, batch(1 << 20), LIMIT)?)?;
    let BatchStatus::Done(stats) = status else {
        bail!("{status:?}");
    };
    ensure!(stats.backend == Backend::Tcp, "{}", stats.backend);
    writeln!(child.stdin.as_mut().context("stdin")?, "quit")?;
    ensure!(child.wait()?.success());
    Ok(())
}

#[test]
fn a_write_whose_deadline_passed_before_it_was_sent_leaves_the_stream_in_step() -> Result<()> {
    let t = pair(1 << 20, Memory::Memfd)?;
    t.set_fence(2)?;
    let id = t.p.post_write(
        t.peer,
        WriteBatch {
            ops: vec![t.op(0, 0, 1 << 20)],
            notif: None,
            fence: WriteFence {
                remote: t.fence_desc.at(FENCE_AT),
                expected: 2,
            },
        },
        Duration::ZERO,
    )?;
    let status = wait(&t.p, id)?;
    ensure!(
        matches!(status, BatchStatus::Failed(TransferError::Timeout { .. })),
        "{status:?}"
    );
    ensure!(t.d.stats().writes_landed == 0);
    // Nothing was sent: the link's next write still goes over shm.
    let status = t.write(vec![t.op(0, 0, 1 << 20)], 2, None)?;
    let BatchStatus::Done(stats) = status else {
        bail!("{status:?}");
    };
    ensure!(stats.backend == Backend::Shm, "{}", stats.backend);
    ensure!(bytes_of(t.dst.as_ref(), 0, 1 << 20) == bytes_of(t.src.as_ref(), 0, 1 << 20));
    Ok(())
}
