//! RDMA READ (or WRITE) throughput of the verbs backend between two local devices (in
//! CI: rxeP and rxeD inside the SoftRoCE VM; `scripts/bench/verbs.sh` runs it next to
//! perftest's `ib_read_bw` and `ib_write_bw` on the same pair).
//!
//! usage: verbs_read_bw [P_DEV] [D_DEV] [SIZE] [ITERS] [BATCH]
//! (defaults rxeP rxeD 1048576 128 64). Prints `key=value` lines:
//! `verbs_read_<size>_gbit_s`, `verbs_read_<size>_mb_s`, `verbs_read_<size>_secs`.
//! With `KV_BENCH_OP=write`, P writes into D's memory instead (push mode: D's destination
//! registered for remote writes with `register_remote_write`, as a write grant is), and
//! the keys read `verbs_write_…`.
//!
//! The endpoints use the library's [`EndpointConfig::default`]; for experiments the env
//! variables `KV_BENCH_OUTSTANDING`, `KV_BENCH_SIGNAL_EVERY`, `KV_BENCH_DOORBELL` and
//! `KV_BENCH_MAX_WR_BYTES` override its fields, `KV_BENCH_SPIN=1` busy-polls instead of
//! yielding when a poll reaped nothing, and `KV_BENCH_SPAN` sets the bytes the reads cycle
//! through on each side (default 16 MiB).
#![cfg_attr(not(feature = "verbs"), allow(unused))]

#[cfg(not(feature = "verbs"))]
fn main() {
    eprintln!("verbs_read_bw: built without the verbs feature");
    std::process::exit(2);
}

#[cfg(feature = "verbs")]
fn main() -> anyhow::Result<()> {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use anyhow::{Context, bail};
    use kvlease_gpu_mem::{DmaRegion, HostRegion, RegionBytes};
    use kvlease_transport::verbs::{
        ConnectionInfo, Device, DeviceConfig, Endpoint, EndpointBatchStatus, EndpointConfig,
        RdmaRead, RdmaWrite,
    };

    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, d: &str| args.get(i).cloned().unwrap_or_else(|| d.to_owned());
    let (p_name, d_name) = (arg(1, "rxeP"), arg(2, "rxeD"));
    let size: u64 = arg(3, "1048576").parse().context("SIZE")?;
    let iters: u64 = arg(4, "128").parse().context("ITERS")?;
    let per_batch: u64 = arg(5, "64").parse().context("BATCH")?;

    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u32>().ok());
    let mut config = EndpointConfig::default();
    if let Some(v) = env("KV_BENCH_OUTSTANDING") {
        config.max_outstanding_reads = v;
    }
    if let Some(v) = env("KV_BENCH_SIGNAL_EVERY") {
        config.signal_every = v;
    }
    if let Some(v) = env("KV_BENCH_DOORBELL") {
        config.wrs_per_doorbell = v;
    }
    if let Some(v) = env("KV_BENCH_MAX_WR_BYTES") {
        config.max_wr_bytes = v;
    }
    let spin = env("KV_BENCH_SPIN") == Some(1);
    let write = std::env::var("KV_BENCH_OP").is_ok_and(|v| v == "write");

    let p_dev = Device::open(&DeviceConfig::named(p_name))?;
    let d_dev = Device::open(&DeviceConfig::named(d_name))?;
    let (p_pd, d_pd) = (p_dev.alloc_pd()?, d_dev.alloc_pd()?);
    let mut p = Endpoint::new(&p_pd, config.clone())?;
    let mut d = Endpoint::new(&d_pd, config)?;
    p.connect(&ConnectionInfo::decode(&d.local_info().encode())?)?;
    d.connect(&ConnectionInfo::decode(&p.local_info().encode())?)?;

    // Source and destination: 16 MiB (or one block, if larger), reused cyclically;
    // `KV_BENCH_SPAN` (bytes) overrides the 16 MiB (perftest reads one block over and over).
    let span = env("KV_BENCH_SPAN").map_or(16 << 20, u64::from).max(size);
    let src = Arc::new(HostRegion::new(span as usize)?);
    src.write_from(0, &vec![0xa5; span as usize])?;
    let dst = Arc::new(HostRegion::new(span as usize)?);
    let src_mr = p_pd.register(Arc::clone(&src) as Arc<dyn DmaRegion>)?;
    let dst_mr = d_pd.register(Arc::clone(&dst) as Arc<dyn DmaRegion>)?;
    let slots = span / size;
    // Push mode: the destination's remote-write registration (a write grant's).
    let grant = d_pd.register_remote_write(Arc::clone(&dst) as Arc<dyn DmaRegion>, 0, span)?;
    let writes: Vec<RdmaWrite> = (0..iters)
        .map(|i| RdmaWrite {
            local: src_mr.clone(),
            local_offset: ((i + 1) % slots) * size,
            remote: grant.remote(),
            remote_offset: (i % slots) * size,
            len: size,
        })
        .collect();
    let ops: Vec<RdmaRead> = (0..iters)
        .map(|i| RdmaRead {
            local: dst_mr.clone(),
            local_offset: (i % slots) * size,
            remote: src_mr.remote(),
            remote_offset: ((i + 1) % slots) * size,
            len: size,
        })
        .collect();

    let t0 = Instant::now();
    let mut ids = Vec::new();
    if write {
        for batch in writes.chunks(per_batch.max(1) as usize) {
            ids.push(p.post_write_batch(batch, None)?);
        }
    } else {
        for batch in ops.chunks(per_batch.max(1) as usize) {
            ids.push(d.post_read_batch(batch, None, None)?);
        }
    }
    // The side that posted polls (the other side's NIC serves it).
    let poster = if write { &mut p } else { &mut d };
    let deadline = t0 + Duration::from_secs(600);
    let mut spins = 0u32;
    for id in ids {
        loop {
            // Yield when nothing completed: under emulation the kernel's rxe threads need
            // the CPU we would spin on.
            if poster.poll()? == 0 && !spin {
                std::thread::yield_now();
            }
            match poster.poll_batch(id) {
                Some(EndpointBatchStatus::Pending) => {}
                Some(EndpointBatchStatus::Done) => break,
                other => bail!("batch {id:?}: {other:?}"),
            }
            // Read the clock only now and then: in the TCG guest the TSC is unstable, so
            // the clock is HPET, and each read is an emulated device access.
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) && Instant::now() > deadline {
                bail!("timed out");
            }
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let bytes = (size * iters) as f64;
    let mut check = vec![0u8; size as usize];
    dst.read_into(0, &mut check)?;
    if check.iter().any(|&b| b != 0xa5) {
        bail!("destination bytes differ from the source");
    }
    let label = if size.is_multiple_of(1 << 20) {
        format!("{}m", size >> 20)
    } else {
        format!("{}k", size >> 10)
    };
    let op = if write { "write" } else { "read" };
    println!("verbs_{op}_{label}_gbit_s={:.3}", bytes * 8.0 / 1e9 / secs);
    println!("verbs_{op}_{label}_mb_s={:.1}", bytes / 1e6 / secs);
    println!("verbs_{op}_{label}_secs={secs:.2}");
    grant.revoke();
    Ok(())
}
