//! Heartbeat codec throughput, printed as `key=value` lines.
//!
//! ```sh
//! cargo run --release -p kvlease-notif --example notif_bench
//! ```
//!
//! Measures, for batches of 12,500 ids of vLLM-like length (~45 bytes): encoding
//! (`encode_heartbeats`, split at `MAX_NOTIF_LEN`), decoding (`decode` + iterating the ids),
//! and P's whole path (`decode` + `LeaseTable::handle_heartbeat`, as P's engine core runs it) with
//! 10^6 live leases. Wall time on a shared machine is noisy: read the figures as orders of
//! magnitude and compare runs on the same host.
// A benchmark measures wall time; the crate's ban on reading the clock is for the library.
#![allow(clippy::disallowed_methods)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use kvlease_lease::{BlockId, LeaseConfig, LeaseTable, RequestId, Timestamp};
use kvlease_notif::{MAX_NOTIF_LEN, Notif, decode, encode_heartbeats};

const BATCH: usize = 12_500;
const LEASES: usize = 1_000_000;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn request_id(i: usize) -> Result<RequestId> {
    // Shaped like vLLM's ids: "cmpl-" + 32 hex digits + "-0".
    Ok(RequestId::new(&format!(
        "cmpl-{:016x}{:016x}-0",
        (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
        i
    ))?)
}

/// This thread's CPU time (user + system) from `/proc/thread-self/stat`, in seconds, or
/// `None` where that file does not exist. On a shared machine it is a better measure than
/// wall time, which includes the time other processes ran.
fn thread_cpu_secs() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").ok()?;
    // Fields after the command name (which is in parentheses and may hold spaces).
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    // The kernel reports clock ticks; USER_HZ is 100 on Linux.
    Some((utime + stime) / 100.0)
}

/// Ids per second by wall time and by CPU time.
struct Rate {
    wall: f64,
    cpu: Option<f64>,
}

impl Rate {
    fn print(&self, key: &str) {
        println!("{key}_ids_per_s_wall={:.0}", self.wall);
        if let Some(cpu) = self.cpu {
            println!("{key}_ids_per_s_cpu={cpu:.0}");
        }
    }
}

/// Runs `f` (which handles `ids_per_call` ids) until at least `min` has passed.
fn rate(ids_per_call: usize, min: Duration, mut f: impl FnMut()) -> Rate {
    f(); // warm up
    let cpu_start = thread_cpu_secs();
    let start = Instant::now();
    let mut calls = 0u64;
    while start.elapsed() < min {
        f();
        calls += 1;
    }
    let ids = calls as f64 * ids_per_call as f64;
    let wall = start.elapsed().as_secs_f64();
    let cpu = cpu_start
        .zip(thread_cpu_secs())
        .map(|(a, b)| b - a)
        .filter(|&c| c > 0.0);
    Rate {
        wall: ids / wall,
        cpu: cpu.map(|c| ids / c),
    }
}

fn main() -> Result<()> {
    let min = Duration::from_millis(
        std::env::var("NOTIF_BENCH_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1000),
    );
    let ids: Vec<RequestId> = (0..BATCH).map(request_id).collect::<Result<_>>()?;
    let messages = encode_heartbeats(&ids, MAX_NOTIF_LEN)?;
    let bytes: usize = messages.iter().map(Vec::len).sum();
    println!("batch_ids={BATCH}");
    println!(
        "avg_id_bytes={:.1}",
        ids.iter().map(|i| i.as_str().len()).sum::<usize>() as f64 / BATCH as f64
    );
    println!("messages_per_batch={}", messages.len());
    println!("bytes_per_batch={bytes}");

    let encode = rate(BATCH, min, || {
        black_box(encode_heartbeats(black_box(&ids), MAX_NOTIF_LEN).ok());
    });
    encode.print("encode");

    let decode_rate = rate(BATCH, min, || {
        for m in &messages {
            if let Ok(Notif::Heartbeat(hb)) = decode(black_box(m)) {
                for id in hb {
                    black_box(id);
                }
            }
        }
    });
    decode_rate.print("decode");

    // P's whole path against a table of 10^6 live leases (the batch is 12,500 of them).
    let config = LeaseConfig::from_duration(Duration::from_secs(3600))?;
    let mut table = LeaseTable::new(config);
    let t0 = Timestamp::ZERO;
    for i in 0..LEASES {
        let block = u32::try_from(i)?;
        table.grant(t0, request_id(i)?, vec![BlockId(block)], 1)?;
    }
    let mut now_ms = 1000u64;
    let mut unknown = 0u64;
    let route_rate = rate(BATCH, min, || {
        now_ms += 1;
        for m in &messages {
            if let Ok(Notif::Heartbeat(ids)) = decode(black_box(m)) {
                let outcome = table.handle_heartbeat(Timestamp::from_millis(now_ms), ids.iter());
                unknown += u64::from(outcome.unknown);
            }
        }
    });
    if unknown != 0 {
        return Err(format!("{unknown} ids named no lease").into());
    }
    println!("live_leases={LEASES}");
    route_rate.print("route_heartbeat");
    Ok(())
}
