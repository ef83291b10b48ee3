//! Staging throughput: how fast the pipelined staging engine moves memory to a sink
//! (device→host direction, `staging_d2h_gbps`) and from a source into memory
//! (host→device direction, `staging_h2d_gbps`), without a network in between.
//!
//! ```text
//! cargo run --release -p kvlease-gpu-mem --example staging_bench -- \
//!     [--memory host|cuda] [--bytes N] [--chunk N] [--depth N] [--iters N]
//! ```
//!
//! `--memory host` (the default) runs the host copier over an mmap region; `--memory cuda`
//! runs the CUDA copier over device memory of device 0. The sink discards bytes
//! (`io::sink`) and the source is a host buffer, so the figures are the staging engine's
//! ceiling. After timing, the data is read back and compared byte for byte (`verified=1`).
//!
//! With `--memory cuda` it then times plain driver copies of the same bytes between a
//! pinned host buffer (`CudaPinnedRegion`) and the same device region, one synchronous
//! copy of `--bytes` per iteration (`cuda::copy_htod` / `cuda::copy_dtoh`), and prints
//! them as `pinned_h2d_gbps` and `pinned_d2h_gbps`: the limit the staging figures are
//! held to (`scripts/gpu-check.sh` prints their ratios). Those bytes are verified too.
//!
//! The two directions do not do the same host work: `staging_d2h_gbps` hands each slot to
//! a sink that discards it unread, while `staging_h2d_gbps` first copies each chunk from a
//! pageable host buffer into its slot (one `memcpy` per chunk on the posting thread, as a
//! socket receive would). So the bench also prints each direction the other way:
//! `staging_h2d_nosrc_gbps` with a source that leaves the slots as they are (the h2d
//! pipeline alone, the counterpart of the discarding sink) and `staging_d2h_copysink_gbps`
//! with a sink that copies each slot into a pageable host buffer (the counterpart of the
//! copying source). Comparing the four tells the pipeline's own cost from the host copy's.
//!
//! Output is `key=value` lines (used by `scripts/gpu-check.sh`).

use std::error::Error;
use std::io::{Cursor, Read};
use std::sync::Arc;
use std::time::Instant;

use kvlease_gpu_mem::staging::{self, Copier, HostCopier, StagingConfig};
use kvlease_gpu_mem::{DmaRegion, HostRegion};

type Result<T> = std::result::Result<T, Box<dyn Error>>;

struct Args {
    memory: String,
    bytes: usize,
    chunk: usize,
    depth: usize,
    iters: usize,
}

fn parse() -> Result<Args> {
    let mut args = Args {
        memory: "host".to_owned(),
        bytes: 256 << 20,
        chunk: StagingConfig::DEFAULT_CHUNK_LEN,
        depth: StagingConfig::DEFAULT_DEPTH,
        iters: 5,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--memory" => args.memory = value,
            "--bytes" => args.bytes = value.parse()?,
            "--chunk" => args.chunk = value.parse()?,
            "--depth" => args.depth = value.parse()?,
            "--iters" => args.iters = value.parse()?,
            other => return Err(format!("unknown flag {other}").into()),
        }
    }
    if args.bytes == 0 || args.iters == 0 {
        return Err("--bytes and --iters must be positive".into());
    }
    Ok(args)
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as u8 ^ i as u8)
        .collect()
}

fn gbps(bytes: usize, iters: usize, secs: f64) -> f64 {
    (bytes * iters) as f64 / secs / 1e9
}

/// A source that writes nothing: each slot goes to memory as it is (the counterpart of
/// `io::sink`, which takes each slot without reading it).
struct UntouchedSource;

impl Read for UntouchedSource {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        Ok(buf.len())
    }
}

/// Times `iters` recv (source → memory) and send (memory → sink) passes, each with and
/// without a host copy of every chunk (module docs), then verifies.
fn run<C: Copier>(copier: &mut C, args: &Args) -> Result<()> {
    let data = pattern(args.bytes);
    // Warm-up pass: faults in pages and fills the memory with the pattern.
    staging::recv(copier, 0, args.bytes, &mut Cursor::new(&data))?;

    let start = Instant::now();
    for _ in 0..args.iters {
        staging::recv(copier, 0, args.bytes, &mut Cursor::new(&data))?;
    }
    let h2d = gbps(args.bytes, args.iters, start.elapsed().as_secs_f64());

    let start = Instant::now();
    for _ in 0..args.iters {
        staging::send(copier, 0, args.bytes, &mut std::io::sink())?;
    }
    let d2h = gbps(args.bytes, args.iters, start.elapsed().as_secs_f64());

    // The same passes the other way: a sink that copies into pageable memory (touched
    // first), a source that copies nothing.
    let mut pageable = vec![1u8; args.bytes];
    let start = Instant::now();
    for _ in 0..args.iters {
        staging::send(copier, 0, args.bytes, &mut Cursor::new(&mut pageable[..]))?;
    }
    let d2h_copysink = gbps(args.bytes, args.iters, start.elapsed().as_secs_f64());
    let start = Instant::now();
    for _ in 0..args.iters {
        staging::recv(copier, 0, args.bytes, &mut UntouchedSource)?;
    }
    let h2d_nosrc = gbps(args.bytes, args.iters, start.elapsed().as_secs_f64());
    // The untouched source left the slots' old bytes in memory: fill it again.
    staging::recv(copier, 0, args.bytes, &mut Cursor::new(&data))?;

    let mut back = Vec::with_capacity(args.bytes);
    staging::send(copier, 0, args.bytes, &mut back)?;
    // The copying sink's passes and the refilled memory must both hold the pattern.
    let verified = back == data && pageable == data;

    println!("staging_d2h_gbps={d2h:.2}");
    println!("staging_h2d_gbps={h2d:.2}");
    println!("staging_d2h_copysink_gbps={d2h_copysink:.2}");
    println!("staging_h2d_nosrc_gbps={h2d_nosrc:.2}");
    println!("verified={}", u8::from(verified));
    if !verified {
        return Err("staged bytes differ from the source".into());
    }
    Ok(())
}

/// Times plain synchronous driver copies of `args.bytes` between a pinned host buffer and
/// `device` (host → device first), then checks the bytes that came back.
#[cfg(feature = "cuda")]
fn pinned_copies(device: &dyn DmaRegion, args: &Args) -> Result<()> {
    use kvlease_gpu_mem::cuda::{self, CudaPinnedRegion};
    let pinned = CudaPinnedRegion::new(0, args.bytes)?;
    // SAFETY: `pinned` is `len` bytes of host memory (zeroed at allocation) that this
    // function owns and outlives the slice; nothing else reads or writes it while the
    // slice lives (the copies below take it as their host buffer and are synchronous).
    let host = unsafe { std::slice::from_raw_parts_mut(pinned.base_ptr(), pinned.len()) };
    let data = pattern(args.bytes);
    host.copy_from_slice(&data);
    // Warm-up pass in each direction.
    cuda::copy_htod(device, 0, host)?;
    cuda::copy_dtoh(device, 0, host)?;

    let start = Instant::now();
    for _ in 0..args.iters {
        cuda::copy_htod(device, 0, host)?;
    }
    let h2d = gbps(args.bytes, args.iters, start.elapsed().as_secs_f64());
    host.fill(0);
    let start = Instant::now();
    for _ in 0..args.iters {
        cuda::copy_dtoh(device, 0, host)?;
    }
    let d2h = gbps(args.bytes, args.iters, start.elapsed().as_secs_f64());

    println!("pinned_d2h_gbps={d2h:.2}");
    println!("pinned_h2d_gbps={h2d:.2}");
    if *host != *data {
        return Err("pinned copies: the bytes back from the device differ".into());
    }
    println!("pinned_verified=1");
    Ok(())
}

fn main() -> std::process::ExitCode {
    match bench() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("staging_bench: {err}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn bench() -> Result<()> {
    let args = parse()?;
    let config = StagingConfig::new(args.chunk, args.depth)?;
    println!(
        "memory={} bytes={} chunk={} depth={} iters={}",
        args.memory, args.bytes, args.chunk, args.depth, args.iters
    );
    match args.memory.as_str() {
        "host" => {
            let region: Arc<dyn DmaRegion> = Arc::new(HostRegion::new(args.bytes)?);
            run(&mut HostCopier::new(region, config)?, &args)
        }
        #[cfg(feature = "cuda")]
        "cuda" => {
            use kvlease_gpu_mem::cuda::{CudaCopier, CudaDeviceRegion};
            let region: Arc<dyn DmaRegion> = Arc::new(CudaDeviceRegion::new(0, args.bytes)?);
            run(&mut CudaCopier::new(Arc::clone(&region), config)?, &args)?;
            pinned_copies(region.as_ref(), &args)
        }
        other => Err(format!(
            "--memory {other}: expected host or cuda (cuda needs the `cuda` feature)"
        )
        .into()),
    }
}
