//! Same-host reads between two processes through the transport's real batched read, and
//! in-process copies of the same chunks as references.
//!
//! ```text
//! cargo run --release -p kvlease-transport --example ipc_read_bench -- \
//!     [--memory cuda|host] [--seconds S] [--scale K]
//! ```
//!
//! P runs in a child process (this binary again, with `--serve`): it fills a region with a
//! seeded pattern, registers it with an [`Agent`] and announces its metadata on stdout. D,
//! in this process, registers a destination region, connects over shared memory and reads
//! with [`Agent::post_read`]: with `--memory cuda` (the default) P's and D's regions are
//! device memory of device 0 and D reads P's through CUDA IPC; with `--memory host` they
//! are memfd-backed host memory read through the shared mapping (a dry run of the same
//! plumbing on a machine without a GPU).
//!
//! Workloads, as `gpu_pair.py` (the Python pair of the 2026-12-04 GPU run) has them: 64 ×
//! 64 KiB, 64 × 1 MiB and 256 × 4 MiB (1 GiB), chunk `i` read from offset `i × size` of P's
//! region to the same offset of D's; sizes divided by `--scale`. Each is read once and
//! compared byte for byte with the pattern (after the destination was zeroed), then timed
//! for `--seconds` (at least 3 batches); a batch counts when [`Agent::poll_batch`] reports
//! it done. Then the references, in this process, on the same chunks:
//! - `--memory cuda`: through cudarc, one asynchronous device-to-device copy per chunk on
//!   one stream and one stream synchronisation per batch (`d2d_chunked_*`), and one copy
//!   of the whole region per batch (`d2d_contiguous_1g`);
//! - `--memory host`: one `memcpy` per chunk, and one of the whole region.
//!
//! Output: `key=value` lines (used by `scripts/gpu-check.sh`), GB/s = 10^9 bytes per
//! second, each byte counted once: `ipc_read_{64k_x64,1m_x64,4m_x256}_gbps`,
//! `d2d_chunked_{64k_x64,1m_x64,4m_x256}_gbps`, `d2d_contiguous_1g_gbps`,
//! `ipc_read_backend` (the backend each verified batch reported: `shm`), `ipc_read_verified`;
//! with `--memory host` every key has the prefix `host_`. The key names keep the unscaled
//! sizes (`scale=` says by how much they were divided).

use std::hint::black_box;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use kvlease_gpu_mem::staging::{read_region, write_region};
use kvlease_gpu_mem::{DmaRegion, HostRegion};
use kvlease_transport::{
    Agent, AgentConfig, Backend, BackendChoice, BatchStatus, LocalRange, PeerId, ReadBatch, ReadOp,
    RegionDesc, RegionId,
};

/// How long one batch may take before the run fails.
const LIMIT: Duration = Duration::from_secs(60);

/// The token both sides prove (the shm link is authenticated, as the agents' are).
const TOKEN: &[u8] = b"ipc-read-bench";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Memory {
    Cuda,
    Host,
}

impl Memory {
    fn name(self) -> &'static str {
        match self {
            Self::Cuda => "cuda",
            Self::Host => "host",
        }
    }

    /// The prefix of every key this run prints.
    fn prefix(self) -> &'static str {
        match self {
            Self::Cuda => "",
            Self::Host => "host_",
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Args {
    memory: Memory,
    seconds: f64,
    scale: usize,
    serve: bool,
}

fn parse() -> Result<Args> {
    let mut args = Args {
        memory: Memory::Cuda,
        seconds: 1.0,
        scale: 1,
        serve: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--serve" {
            args.serve = true;
            continue;
        }
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--memory" => {
                args.memory = match value.as_str() {
                    "cuda" => Memory::Cuda,
                    "host" => Memory::Host,
                    other => bail!("--memory {other}: expected cuda or host"),
                }
            }
            "--seconds" => args.seconds = value.parse().context("--seconds S")?,
            "--scale" => args.scale = value.parse().context("--scale K")?,
            other => bail!("unknown flag {other}"),
        }
    }
    ensure!(
        args.seconds > 0.0 && args.scale > 0 && (64 << 10) % args.scale == 0,
        "--seconds must be positive and --scale a divisor of 65536"
    );
    Ok(args)
}

/// One workload: its name in the keys, the number of chunks and their size.
#[derive(Debug, Clone, Copy)]
struct Workload {
    name: &'static str,
    count: usize,
    size: usize,
}

impl Workload {
    fn bytes(self) -> usize {
        self.count * self.size
    }

    /// `64k_x64`, as the keys have it.
    fn key(self) -> String {
        format!("{}_x{}", self.name, self.count)
    }

    fn chunk(self, i: usize) -> std::ops::Range<usize> {
        i * self.size..(i + 1) * self.size
    }
}

fn workloads(scale: usize) -> [Workload; 3] {
    [
        ("64k", 64, 64 << 10),
        ("1m", 64, 1 << 20),
        ("4m", 256, 4 << 20),
    ]
    .map(|(name, count, size)| Workload {
        name,
        count,
        size: size / scale,
    })
}

/// Bytes of the region on each side: the largest workload.
fn total_bytes(scale: usize) -> usize {
    workloads(scale)
        .iter()
        .map(|w| w.bytes())
        .max()
        .unwrap_or(0)
}

/// Host buffers of the fills and checks hold this many bytes (not the whole region).
const PIECE: usize = 16 << 20;

/// The pattern's bytes at `start .. start + len` (a byte depends only on its position).
fn pattern(start: usize, len: usize) -> Vec<u8> {
    (start as u64..(start + len) as u64)
        .map(|i| (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as u8 ^ i as u8)
        .collect()
}

/// Writes the pattern (or zeros) over the first `len` bytes of `region`, a piece at a time.
fn fill(region: &dyn DmaRegion, len: usize, zeros: bool) -> Result<()> {
    for start in (0..len).step_by(PIECE) {
        let n = PIECE.min(len - start);
        let bytes = if zeros { vec![0; n] } else { pattern(start, n) };
        write_region(region, start, &bytes)?;
    }
    Ok(())
}

/// Whether the first `len` bytes of `region` hold the pattern, read a piece at a time.
fn holds_pattern(region: &dyn DmaRegion, len: usize) -> Result<bool> {
    let mut back = vec![0; PIECE.min(len)];
    for start in (0..len).step_by(PIECE) {
        let n = PIECE.min(len - start);
        read_region(region, start, &mut back[..n])?;
        if back[..n] != pattern(start, n) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Runs `batch` once, then again and again for `seconds` (at least 3 times); returns
/// GB/s for `bytes` per batch.
fn timed(seconds: f64, bytes: usize, mut batch: impl FnMut() -> Result<()>) -> Result<f64> {
    batch()?;
    let start = Instant::now();
    let mut batches = 0u64;
    while batches < 3 || start.elapsed().as_secs_f64() < seconds {
        batch()?;
        batches += 1;
    }
    Ok(bytes as f64 * batches as f64 / start.elapsed().as_secs_f64() / 1e9)
}

fn agent(name: &str, backend: BackendChoice) -> Result<Agent> {
    let mut config = AgentConfig::new(name);
    config.backend = backend;
    config.auth_token = Some(TOKEN.to_vec());
    Agent::new(config).context("creating the agent")
}

/// A zeroed region of `len` bytes of `memory` (device memory of device 0, or a
/// memfd-backed host region).
fn region(memory: Memory, len: usize) -> Result<Arc<dyn DmaRegion>> {
    match memory {
        Memory::Host => Ok(Arc::new(HostRegion::new(len)?)),
        #[cfg(feature = "cuda")]
        Memory::Cuda => Ok(Arc::new(kvlease_gpu_mem::cuda::CudaDeviceRegion::new(
            0, len,
        )?)),
        #[cfg(not(feature = "cuda"))]
        Memory::Cuda => bail!("--memory cuda needs the `cuda` feature of kvlease-transport"),
    }
}

/// Fails with a clear message where device memory cannot work here.
fn check_memory(memory: Memory) -> Result<()> {
    if memory == Memory::Host {
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    {
        use kvlease_gpu_mem::cuda::{self, CudaAvailability};
        // `probe` asks cudarc's `is_culib_present()` first, so a missing driver is an
        // error here and not a panic inside cudarc.
        match cuda::probe() {
            CudaAvailability::Available { .. } => Ok(()),
            CudaAvailability::NoDriver => bail!(
                "--memory cuda: no CUDA driver (libcuda.so could not be loaded): run this on a GPU host, or use --memory host"
            ),
            CudaAvailability::Unusable { reason } => {
                bail!("--memory cuda: the CUDA driver is unusable: {reason}")
            }
        }
    }
    #[cfg(not(feature = "cuda"))]
    bail!("--memory cuda needs the `cuda` feature of kvlease-transport")
}

/// P: fills a region with the pattern, registers it, announces it (`DESC id key`, then
/// `META` with the metadata in hex) and serves until stdin gives a line or closes.
fn serve(args: Args) -> Result<()> {
    let total = total_bytes(args.scale);
    let p = agent("ipc-bench-p", BackendChoice::Auto)?;
    let src = region(args.memory, total)?;
    fill(src.as_ref(), total, false)?;
    let desc = p.register(src)?;
    let meta: String = p.metadata().iter().map(|b| format!("{b:02x}")).collect();
    let mut out = std::io::stdout().lock();
    writeln!(out, "DESC {} {}", desc.id, desc.key)?;
    writeln!(out, "META {meta}")?;
    out.flush()?;
    drop(out);
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    Ok(())
}

/// The child process that serves as P; killed if the run ends early.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

impl Server {
    fn start(args: Args) -> Result<(Self, BufReader<ChildStdout>)> {
        let mut child = Command::new(std::env::current_exe()?)
            .args(["--serve", "--memory", args.memory.name()])
            .args(["--scale", &args.scale.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting P's process")?;
        let out = child.stdout.take().context("P's stdout")?;
        Ok((Self(child), BufReader::new(out)))
    }

    /// Lets P end and checks that it ended well.
    fn stop(mut self) -> Result<()> {
        if let Some(mut stdin) = self.0.stdin.take() {
            stdin.write_all(b"quit\n")?;
        }
        let status = self.0.wait()?;
        ensure!(status.success(), "P's process ended with {status}");
        Ok(())
    }
}

/// P's announcement: its region's descriptor and its metadata.
fn announcement(out: &mut impl BufRead, len: usize) -> Result<(RegionDesc, Vec<u8>)> {
    let mut desc = None;
    let mut line = String::new();
    loop {
        line.clear();
        ensure!(
            out.read_line(&mut line)? > 0,
            "P's process ended before announcing its region"
        );
        if let Some(rest) = line.trim().strip_prefix("DESC ") {
            let words: Vec<u64> = rest.split(' ').map(str::parse).collect::<Result<_, _>>()?;
            let [id, key] = words[..] else {
                bail!("DESC line {rest:?}: want id and key");
            };
            desc = Some(RegionDesc {
                id,
                key,
                len: len as u64,
                base: 0,
            });
        }
        if let Some(hex) = line.trim().strip_prefix("META ") {
            let meta = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(hex.get(i..i + 2).unwrap_or("?"), 16))
                .collect::<Result<_, _>>()?;
            return Ok((desc.context("no DESC line before META")?, meta));
        }
    }
}

/// Posts one batch and spins until it is done; returns the backend it reports.
fn read(d: &Agent, peer: PeerId, ops: &[ReadOp]) -> Result<Backend> {
    let batch = ReadBatch {
        ops: ops.to_vec(),
        ..ReadBatch::default()
    };
    let id = d.post_read(peer, batch, LIMIT)?;
    loop {
        match d.poll_batch(id)? {
            BatchStatus::Pending => std::thread::yield_now(),
            BatchStatus::Done(stats) => return Ok(stats.backend),
            BatchStatus::Failed(err) => bail!("the batch failed: {err}"),
        }
    }
}

/// D: reads every workload from P in another process, verified, then timed.
fn ipc_reads(args: Args) -> Result<()> {
    let prefix = args.memory.prefix();
    let total = total_bytes(args.scale);
    let (server, mut out) = Server::start(args)?;
    let (src, meta) = announcement(&mut out, total)?;
    let d = agent("ipc-bench-d", BackendChoice::Shm)?;
    let dst = region(args.memory, total)?;
    let dst_id = RegionId(d.register(dst.clone())?.id);
    let peer = d
        .connect(&meta)
        .context("connecting to P over shared memory")?;
    for w in workloads(args.scale) {
        let ops: Vec<ReadOp> = (0..w.count)
            .map(|i| ReadOp {
                local: LocalRange {
                    region: dst_id,
                    offset: w.chunk(i).start as u64,
                    len: w.size as u64,
                },
                remote: src.at(w.chunk(i).start as u64),
            })
            .collect();
        fill(dst.as_ref(), w.bytes(), true)?;
        let backend = read(&d, peer, &ops)?;
        // Over shm, and for device memory through CUDA IPC: a region P could not hand
        // over, or D could not open, would have gone over TCP.
        ensure!(
            backend == Backend::Shm,
            "{}: the batch went over {backend}, not shared memory{}",
            w.key(),
            if args.memory == Memory::Cuda {
                " (CUDA IPC)"
            } else {
                ""
            }
        );
        ensure!(
            holds_pattern(dst.as_ref(), w.bytes())?,
            "{}: the bytes read differ from P's",
            w.key()
        );
        let gbps = timed(args.seconds, w.bytes(), || read(&d, peer, &ops).map(|_| ()))?;
        println!("{prefix}ipc_read_{}_gbps={gbps:.2}", w.key());
    }
    println!("{prefix}ipc_read_backend=shm");
    println!("{prefix}ipc_read_verified=1");
    drop(d);
    server.stop()
}

/// The host references: one `memcpy` per chunk, and one of the whole region.
fn host_references(args: Args, data: &[u8]) -> Result<()> {
    let mut dst = vec![0u8; data.len()];
    for w in workloads(args.scale) {
        let batch = |dst: &mut [u8]| {
            for i in 0..w.count {
                dst[w.chunk(i)].copy_from_slice(&data[w.chunk(i)]);
            }
            black_box(&dst);
        };
        dst.fill(0);
        batch(&mut dst);
        ensure!(
            dst[..w.bytes()] == data[..w.bytes()],
            "{}: copy differs",
            w.key()
        );
        let gbps = timed(args.seconds, w.bytes(), || {
            batch(&mut dst);
            Ok(())
        })?;
        println!("host_d2d_chunked_{}_gbps={gbps:.2}", w.key());
    }
    let gbps = timed(args.seconds, data.len(), || {
        dst.copy_from_slice(data);
        black_box(&dst);
        Ok(())
    })?;
    ensure!(dst == data, "contiguous copy differs");
    println!("host_d2d_contiguous_1g_gbps={gbps:.2}");
    Ok(())
}

/// The device references through cudarc, on the legacy stream of device 0 (no other
/// stream in this context, so cudarc records no events around the copies): one
/// asynchronous copy per chunk and one synchronisation per batch; one copy of the whole
/// region per batch.
#[cfg(feature = "cuda")]
fn device_references(args: Args, data: &[u8]) -> Result<()> {
    use cudarc::driver::{CudaContext, CudaSlice, CudaStream};

    fn chunked(
        stream: &Arc<CudaStream>,
        src: &CudaSlice<u8>,
        dst: &mut CudaSlice<u8>,
        w: Workload,
    ) -> Result<()> {
        for i in 0..w.count {
            stream.memcpy_dtod(&src.slice(w.chunk(i)), &mut dst.slice_mut(w.chunk(i)))?;
        }
        stream.synchronize()?;
        Ok(())
    }

    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let src = stream.clone_htod(data)?;
    let mut dst = stream.alloc_zeros::<u8>(data.len())?;
    stream.synchronize()?;
    for w in workloads(args.scale) {
        stream.memset_zeros(&mut dst)?;
        chunked(&stream, &src, &mut dst, w)?;
        let back = stream.clone_dtoh(&dst.slice(0..w.bytes()))?;
        ensure!(back == data[..w.bytes()], "{}: copy differs", w.key());
        let gbps = timed(args.seconds, w.bytes(), || {
            chunked(&stream, &src, &mut dst, w)
        })?;
        println!("d2d_chunked_{}_gbps={gbps:.2}", w.key());
    }
    stream.memset_zeros(&mut dst)?;
    let gbps = timed(args.seconds, data.len(), || {
        stream.memcpy_dtod(&src, &mut dst)?;
        stream.synchronize()?;
        Ok(())
    })?;
    ensure!(stream.clone_dtoh(&dst)? == data, "contiguous copy differs");
    println!("d2d_contiguous_1g_gbps={gbps:.2}");
    Ok(())
}

fn bench(args: Args) -> Result<()> {
    check_memory(args.memory)?;
    if args.serve {
        return serve(args);
    }
    let prefix = args.memory.prefix();
    println!("{prefix}ipc_read_memory={}", args.memory.name());
    println!("{prefix}ipc_read_scale={}", args.scale);
    ipc_reads(args)?;
    let data = pattern(0, total_bytes(args.scale));
    match args.memory {
        Memory::Host => host_references(args, &data),
        #[cfg(feature = "cuda")]
        Memory::Cuda => device_references(args, &data),
        #[cfg(not(feature = "cuda"))]
        Memory::Cuda => bail!("--memory cuda needs the `cuda` feature of kvlease-transport"),
    }
}

fn main() -> std::process::ExitCode {
    match parse().and_then(bench) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("ipc_read_bench: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
