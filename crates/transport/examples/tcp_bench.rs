//! Transport throughput and notification round trip, two processes on one host.
//!
//! `tcp_bench [--backend tcp|shm|cma] [--conns N] [--seconds S] [--sweep] [--no-write]` starts itself
//! again as the target (`--serve`), which registers a region filled with a pattern and
//! echoes notifications; this process reads from it with batches of `block × batch` and
//! verifies the bytes of the first batch of every point. `--backend` (default `tcp`)
//! picks the backend both agents use: `tcp` over loopback, `shm` the same-host
//! shared-memory backend (both agents `BackendChoice::Shm`; the registered host regions
//! are memfd-backed, so each link lands on shm, which the run checks with
//! `Agent::peer_backend`), `cma` the same link with the target's region plain heap memory
//! (`ForeignRegion::from_heap`, not memfd-backed, as a buffer registered from Python),
//! which D reads with cross-memory attach (the run checks that the batches say `cma`).
//! Prints one `key=value` per figure: `backend=`,
//! `read_gbps_<block>x<batch>=` (GB/s, 10^9 bytes, with `--sweep`), `read_1m_x64_gbps=`
//! and `read_64k_x64_gbps=` (the headlines, measured longer), `notif_rtt_us=` (median)
//! and `notif_rtt_p99_us=`.
//!
//! It also measures fenced WRITEs on the same work, the other way round (this process
//! writes `block × 64` from its region into a destination the target registered, under a
//! fence word the target published with `Agent::set_write_fence`; the first batch is read
//! back and checked, and must say the backend that moved it: `tcp`, or `shm` for `shm`
//! and `cma`, whose writes go on the shm link's Unix socket and land in the target's
//! process, which pulls them from this process's source: its memfd with `shm`; with
//! `cma` both this process's source and the target's destination are plain heap memory,
//! and the target reads the source with cross-memory attach):
//! `<backend>_write_gbps_64x1m=`, `<backend>_read_gbps_64x1m=` (the READ headline again,
//! under the name that pairs with it), `<backend>_write_over_read_64x1m=`, and the same
//! for `64x64k` (`--no-write`: not); `<backend>` is `tcp`, `shm` or `cma`; and the
//! target's counts, `<backend>_writes_pulled=` and `<backend>_writes_landed=` (on `shm`
//! and `cma` the run fails unless every write chunk landed was pulled).
//!
//! `--staged` (with `--backend tcp`) puts every region but the fence in staged memory
//! (`StagedHostRegion`: host memory moved as CUDA device memory is), so reads go through
//! the pipelined stager on both sides and writes through the writer's host bounce buffer
//! and the receiver's synchronous landing copy; the keys then read `tcp_staged_…` (and
//! `staged=true` is printed).

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use kvlease_gpu_mem::{DmaRegion, ForeignRegion, HostRegion, StagedHostRegion, staging};
use kvlease_transport::{
    Agent, AgentConfig, Backend, BackendChoice, BatchStatus, LocalRange, ReadBatch, ReadOp,
    RegionDesc, RegionId, WriteBatch, WriteFence, WriteOp,
};

const REGION: usize = 256 << 20;
/// The target's write destination (64 × 1 MiB).
const WRITE_REGION: usize = 64 << 20;
/// The target's write-fence region, and the generation it publishes.
const FENCE_REGION: usize = 64;
const GENERATION: u64 = 1;
const TIMEOUT: Duration = Duration::from_secs(60);

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Result<Vec<u8>> {
    ensure!(s.len().is_multiple_of(2), "odd hex");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).context("bad hex"))
        .collect()
}

fn pattern(i: usize) -> u8 {
    (i % 251) as u8 ^ (i >> 12) as u8
}

fn config(name: &str, conns: usize, backend: Backend) -> AgentConfig {
    let mut c = AgentConfig::new(name);
    c.backend = match backend {
        Backend::Shm | Backend::Cma => BackendChoice::Shm,
        _ => BackendChoice::Tcp,
    };
    c.num_connections = conns;
    c
}

fn parse_backend(s: &str) -> Result<Backend> {
    match s {
        "tcp" => Ok(Backend::Tcp),
        "shm" => Ok(Backend::Shm),
        "cma" => Ok(Backend::Cma),
        other => bail!("--backend {other}: expected tcp, shm or cma"),
    }
}

/// Fails unless `peer` landed on `want`.
fn check_backend(agent: &Agent, peer: kvlease_transport::PeerId, want: Backend) -> Result<()> {
    let (got, why) = agent.peer_backend(peer).context("peer backend")?;
    // A cma batch runs on an shm link.
    let link = if want == Backend::Cma {
        Backend::Shm
    } else {
        want
    };
    ensure!(got == link, "the link landed on {got}, not {link}: {why}");
    Ok(())
}

/// A zeroed region of `len` bytes: plain heap memory for `cma`, staged memory with
/// `--staged`, else memfd-backed host memory.
fn zeroed(len: usize, backend: Backend, staged: bool) -> Result<Arc<dyn DmaRegion>> {
    Ok(if backend == Backend::Cma {
        Arc::new(ForeignRegion::from_heap(vec![0; len])?)
    } else if staged {
        Arc::new(StagedHostRegion::new(len)?)
    } else {
        Arc::new(HostRegion::new(len)?)
    })
}

/// The target: serve reads, echo notifications until `quit`.
fn serve(conns: usize, backend: Backend, staged: bool) -> Result<()> {
    let agent = Agent::new(config("bench-target", conns, backend))?;
    let bytes: Vec<u8> = (0..REGION).map(pattern).collect();
    let region = zeroed(REGION, backend, staged)?;
    staging::write_region(region.as_ref(), 0, &bytes)?;
    agent.register(region)?;
    // Registered after the read source, so their ids (and metadata order) follow it.
    let dest = zeroed(WRITE_REGION, backend, staged)?;
    agent.register(dest)?;
    let fence = agent.register(Arc::new(HostRegion::new(FENCE_REGION)?))?;
    agent.set_write_fence(RegionId(fence.id), 0, GENERATION)?;
    println!("META {}", hex(&agent.metadata()));
    std::io::stdout().flush()?;
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    let reader_meta = unhex(line.trim().strip_prefix("META ").context("expected META")?)?;
    let back = agent.connect(&reader_meta)?;
    check_backend(&agent, back, backend)?;
    loop {
        for (_, msgs) in agent.get_new_notifs() {
            for m in msgs {
                if m == b"quit" {
                    // What of this process's writes it pulled from the writer's memory.
                    let stats = agent.stats();
                    println!("PULLED {} {}", stats.writes_pulled, stats.writes_landed);
                    return Ok(());
                }
                agent.send_notif(back, m)?;
            }
        }
        std::thread::yield_now();
    }
}

/// Waits for batch `id`; returns the backend that moved it.
fn wait(agent: &Agent, id: kvlease_transport::BatchId) -> Result<Backend> {
    loop {
        match agent.poll_batch(id)? {
            BatchStatus::Pending => std::thread::yield_now(),
            BatchStatus::Done(stats) => return Ok(stats.backend),
            BatchStatus::Failed(e) => bail!("batch failed: {e}"),
        }
    }
}

fn batch(dst: RegionId, src: &RegionDesc, block: u64, n: u64) -> ReadBatch {
    ReadBatch {
        ops: (0..n)
            .map(|i| ReadOp {
                local: LocalRange {
                    region: dst,
                    offset: i * block,
                    len: block,
                },
                // Spread the source blocks over the region like a real pool.
                remote: src.at((i * 7 % n) * block),
            })
            .collect(),
        notif: None,
        fence: None,
    }
}

/// GB/s of `block × n` batches, run back to back for `seconds`.
#[allow(clippy::too_many_arguments)]
fn measure(
    agent: &Agent,
    peer: kvlease_transport::PeerId,
    dst_region: &dyn DmaRegion,
    dst: RegionId,
    src: &RegionDesc,
    block: u64,
    n: u64,
    seconds: f64,
    want: Backend,
) -> Result<f64> {
    // Verify the first batch byte for byte, and the backend that moved it.
    staging::write_region(dst_region, 0, &vec![0; (block * n) as usize])?;
    let moved = wait(
        agent,
        agent.post_read(peer, batch(dst, src, block, n), TIMEOUT)?,
    )?;
    ensure!(moved == want, "the batch went over {moved}, not {want}");
    let mut got = vec![0; (block * n) as usize];
    staging::read_region(dst_region, 0, &mut got)?;
    for i in 0..n {
        let from = ((i * 7 % n) * block) as usize;
        let at = (i * block) as usize;
        ensure!(
            got[at..at + block as usize]
                .iter()
                .enumerate()
                .all(|(j, &b)| b == pattern(from + j)),
            "byte mismatch in block {i}"
        );
    }
    let t0 = Instant::now();
    let mut bytes = 0u64;
    while t0.elapsed().as_secs_f64() < seconds {
        wait(
            agent,
            agent.post_read(peer, batch(dst, src, block, n), TIMEOUT)?,
        )?;
        bytes += block * n;
    }
    Ok(bytes as f64 / t0.elapsed().as_secs_f64() / 1e9)
}

/// A batch of `n` fenced writes of `block` bytes from the start of `src` into `dest`.
fn write_batch(
    src: RegionId,
    dest: &RegionDesc,
    fence: &RegionDesc,
    block: u64,
    n: u64,
) -> WriteBatch {
    WriteBatch {
        ops: (0..n)
            .map(|i| WriteOp {
                local: LocalRange {
                    region: src,
                    offset: i * block,
                    len: block,
                },
                remote: dest.at((i * 7 % n) * block),
            })
            .collect(),
        notif: None,
        fence: WriteFence {
            remote: fence.at(0),
            expected: GENERATION,
        },
    }
}

/// The target's write destination and fence word.
struct WriteTarget {
    dest: RegionDesc,
    fence: RegionDesc,
}

/// GB/s of fenced `block × n` write batches, run back to back for `seconds`. The first
/// batch is read back (into the upper half of `region`) and checked, and must have gone
/// over `want`.
#[allow(clippy::too_many_arguments)]
fn measure_write(
    agent: &Agent,
    peer: kvlease_transport::PeerId,
    region: &dyn DmaRegion,
    local: RegionId,
    target: &WriteTarget,
    block: u64,
    n: u64,
    seconds: f64,
    want: Backend,
) -> Result<f64> {
    let total = (block * n) as usize;
    let stamp: Vec<u8> = (0..total).map(|i| pattern(i + 12_345)).collect();
    staging::write_region(region, 0, &stamp)?;
    let post = || {
        agent.post_write(
            peer,
            write_batch(local, &target.dest, &target.fence, block, n),
            TIMEOUT,
        )
    };
    let got = wait(agent, post()?)?;
    ensure!(got == want, "the write went over {got}, not {want}");
    let back = (REGION / 2) as u64;
    let read_back = ReadBatch {
        ops: vec![ReadOp {
            local: LocalRange {
                region: local,
                offset: back,
                len: block * n,
            },
            remote: target.dest.at(0),
        }],
        notif: None,
        fence: None,
    };
    wait(agent, agent.post_read(peer, read_back, TIMEOUT)?)?;
    let mut got = vec![0; total];
    staging::read_region(region, back as usize, &mut got)?;
    for i in 0..n {
        let at = ((i * 7 % n) * block) as usize;
        let from = (i * block) as usize;
        ensure!(
            got[at..at + block as usize] == stamp[from..from + block as usize],
            "write mismatch in block {i}"
        );
    }
    let t0 = Instant::now();
    let mut bytes = 0u64;
    while t0.elapsed().as_secs_f64() < seconds {
        wait(agent, post()?)?;
        bytes += block * n;
    }
    Ok(bytes as f64 / t0.elapsed().as_secs_f64() / 1e9)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| args.iter().position(|a| a == name);
    let value = |name: &str, default: &str| -> String {
        flag(name)
            .and_then(|i| args.get(i + 1).cloned())
            .unwrap_or_else(|| default.to_owned())
    };
    let conns: usize = value("--conns", "2").parse()?;
    let backend_name = value("--backend", "tcp");
    let backend = parse_backend(&backend_name)?;
    let staged = flag("--staged").is_some();
    // Staged memory is no shm or cma source: those links would send it over TCP.
    ensure!(
        !staged || backend == Backend::Tcp,
        "--staged runs with --backend tcp only"
    );
    if flag("--serve").is_some() {
        return serve(conns, backend, staged);
    }
    let seconds: f64 = value("--seconds", "0.25").parse()?;
    let mut child = Command::new(std::env::current_exe()?)
        .args([
            "--serve",
            "--conns",
            &conns.to_string(),
            "--backend",
            &backend_name,
        ])
        .args(staged.then_some("--staged"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut child_out = BufReader::new(child.stdout.take().context("child stdout")?);
    let mut line = String::new();
    child_out.read_line(&mut line)?;
    let target_meta = unhex(line.trim().strip_prefix("META ").context("expected META")?)?;

    let agent = Agent::new(config("bench-reader", conns, backend))?;
    // With `cma`, this process's memory is plain heap memory too: the target reads it
    // with cross-memory attach for this process's writes.
    let dst_region = zeroed(REGION, backend, staged)?;
    let dst = RegionId(agent.register(dst_region.clone())?.id);
    let peer = agent.connect(&target_meta)?;
    check_backend(&agent, peer, backend)?;
    let target_regions = agent.peer_metadata(peer).context("peer metadata")?.regions;
    let src = *target_regions.first().context("target region")?;
    let write_target = match target_regions[..] {
        [_, dest, fence, ..] => Some(WriteTarget { dest, fence }),
        _ => None,
    };
    let mut child_in = child.stdin.take().context("child stdin")?;
    writeln!(child_in, "META {}", hex(&agent.metadata()))?;
    child_in.flush()?;

    println!("backend={backend}");
    println!("staged={staged}");
    // The write keys' prefix.
    let keys = if staged {
        format!("{backend}_staged")
    } else {
        backend.to_string()
    };
    println!("conns={conns}");
    if flag("--sweep").is_some() {
        for block_kib in [16u64, 64, 256, 1024, 4096] {
            for n in [1u64, 16, 64, 256] {
                let block = block_kib * 1024;
                if block * n > REGION as u64 {
                    continue;
                }
                let gbps = measure(
                    &agent,
                    peer,
                    dst_region.as_ref(),
                    dst,
                    &src,
                    block,
                    n,
                    seconds,
                    backend,
                )?;
                println!("read_gbps_{block_kib}k_x{n}={gbps:.3}");
            }
        }
    }
    // The headline lines, measured for at least 2 s each.
    let mut headline = Vec::new();
    for (block, label) in [(1 << 20, "1m"), (64 << 10, "64k")] {
        let gbps = measure(
            &agent,
            peer,
            dst_region.as_ref(),
            dst,
            &src,
            block,
            64,
            seconds.max(2.0),
            backend,
        )?;
        println!("read_{label}_x64_gbps={gbps:.3}");
        headline.push((block, label, gbps));
    }
    // Fenced WRITEs of the same sizes, next to the READs. `--no-write` skips them (the
    // notification benchmark's short rounds).
    let writes = flag("--no-write").is_none();
    // A cma link writes as shm does: on the link's socket, landed by the target.
    let write_backend = if backend == Backend::Tcp {
        Backend::Tcp
    } else {
        Backend::Shm
    };
    if let (Some(target), true) = (&write_target, writes) {
        for (block, label, read) in headline {
            let write = measure_write(
                &agent,
                peer,
                dst_region.as_ref(),
                dst,
                target,
                block,
                64,
                seconds.max(2.0),
                write_backend,
            )?;
            println!("{keys}_write_gbps_64x{label}={write:.3}");
            println!("{keys}_read_gbps_64x{label}={read:.3}");
            println!("{keys}_write_over_read_64x{label}={:.3}", write / read);
        }
    }

    // Notification ping-pong: D → P → D (P answers over its own connection to D).
    // Wait for P's connection back to us first.
    let mut lat = Vec::with_capacity(2000);
    for i in 0..2200u32 {
        let msg = i.to_le_bytes().to_vec();
        let t0 = Instant::now();
        agent.send_notif(peer, msg.clone())?;
        'wait: loop {
            for (_, msgs) in agent.get_new_notifs() {
                if msgs.contains(&msg) {
                    break 'wait;
                }
            }
            ensure!(t0.elapsed() < TIMEOUT, "no echo");
            std::thread::yield_now();
        }
        if i >= 200 {
            lat.push(t0.elapsed().as_secs_f64() * 1e6);
        }
    }
    lat.sort_by(f64::total_cmp);
    println!("notif_rtt_us={:.1}", lat[lat.len() / 2]);
    println!("notif_rtt_p99_us={:.1}", lat[lat.len() * 99 / 100]);
    agent.send_notif(peer, b"quit".to_vec())?;
    line.clear();
    child_out.read_line(&mut line)?;
    let pulled: Vec<u64> = line
        .trim()
        .strip_prefix("PULLED ")
        .context("expected PULLED")?
        .split(' ')
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    if let (&[pulled, landed], true) = (&pulled[..], writes) {
        // Every write chunk the target landed came from a pull of this process's memory,
        // on shm from its memfd, on cma with cross-memory attach (TCP: none).
        println!("{keys}_writes_pulled={pulled}");
        println!("{keys}_writes_landed={landed}");
        ensure!(
            backend == Backend::Tcp || pulled == landed,
            "the target pulled {pulled} of the {landed} writes it landed"
        );
    }
    let status = child.wait()?;
    ensure!(status.success(), "target exited with {status}");
    Ok(())
}
