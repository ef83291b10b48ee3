//! Single-thread memcpy between two buffers: the limit a same-host READ is compared to.
//!
//! `memcpy_bench [--seconds S]` copies a batch of 64 blocks (64 KiB and 1 MiB) from one
//! buffer into another, block by block with `copy_from_slice` (libc `memcpy`), in one
//! thread, again and again for S seconds (default 1) per size. Both buffers are written
//! and the batch copied a few times before the clock starts (pages faulted in, caches
//! warm), as in `tcp_bench`, which also reads the same blocks again and again. The copy
//! of the first batch is checked byte for byte. Prints `memcpy_64k_x64_gbps=` and
//! `memcpy_1m_x64_gbps=` (GB/s, 10^9 bytes per second, bytes copied once).

use std::hint::black_box;
use std::time::Instant;

use anyhow::{Context, Result, ensure};

const BATCH: usize = 64;

fn pattern(i: usize) -> u8 {
    (i % 251) as u8 ^ (i >> 12) as u8
}

fn copy_batch(dst: &mut [u8], src: &[u8], block: usize) {
    for (d, s) in dst.chunks_exact_mut(block).zip(src.chunks_exact(block)) {
        d.copy_from_slice(s);
    }
}

fn measure(block: usize, seconds: f64) -> Result<f64> {
    let bytes = block * BATCH;
    let src: Vec<u8> = (0..bytes).map(pattern).collect();
    let mut dst = vec![0u8; bytes];
    copy_batch(&mut dst, &src, block);
    ensure!(
        dst == src,
        "copy of {BATCH} x {block} B differs from its source"
    );
    for _ in 0..3 {
        copy_batch(black_box(&mut dst), black_box(&src), block);
    }
    let t0 = Instant::now();
    let mut batches = 0u64;
    while batches < 3 || t0.elapsed().as_secs_f64() < seconds {
        copy_batch(black_box(&mut dst), black_box(&src), block);
        black_box(&dst);
        batches += 1;
    }
    Ok((bytes as u64 * batches) as f64 / t0.elapsed().as_secs_f64() / 1e9)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let seconds: f64 = match args.iter().position(|a| a == "--seconds") {
        Some(i) => args
            .get(i + 1)
            .context("--seconds S")?
            .parse()
            .context("--seconds S")?,
        None => 1.0,
    };
    for (name, block) in [("64k", 64usize << 10), ("1m", 1 << 20)] {
        println!(
            "memcpy_{name}_x{BATCH}_gbps={:.3}",
            measure(block, seconds)?
        );
    }
    Ok(())
}
