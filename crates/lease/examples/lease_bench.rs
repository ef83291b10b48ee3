//! Throughput and memory of the lease machinery. Prints `key=value` lines.
//!
//! ```text
//! cargo run --release -p kvlease-lease --example lease_bench [-- --leases N --tracked M]
//! ```
//!
//! Throughputs use the thread's on-CPU time (`/proc/thread-self/schedstat`), not wall
//! time: on a shared machine the wall clock mostly measures the run queue. Short spans
//! (one reaper call, one D step; keys ending in `_wall_*`) use wall time, since the
//! scheduler's accounting only advances at ticks. Cache pollution by other processes still
//! shows, so read the figures as orders of magnitude. Memory is measured as the growth of the resident set
//! (`/proc/self/status` `VmRSS`) in a fresh child process per measurement, so it includes
//! the allocator's own overhead; the block-id vectors are empty there (the budget excludes
//! them).
#![allow(clippy::print_stdout)]
// The benchmark measures wall time; the state machines themselves never read a clock.
#![allow(clippy::disallowed_methods)]

use std::hint::black_box;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvlease_lease::{
    BlockId, EngineId, Event, HeartbeatTracker, LeaseConfig, LeaseTable, RequestId, Timestamp,
};

/// vLLM-style request ids: "cmpl-" + 32 hex digits + "-0" (39 bytes).
fn request_ids(n: usize, salt: u64) -> Vec<RequestId> {
    (0..n as u64)
        .map(|i| {
            let h = splitmix(i ^ salt.rotate_left(17));
            let s = format!("cmpl-{:016x}{:016x}-0", h, splitmix(h));
            RequestId::new(&s).expect("hex ids are valid")
        })
        .collect()
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn shuffle<T>(v: &mut [T], seed: u64) {
    let mut s = seed;
    for i in (1..v.len()).rev() {
        s = splitmix(s);
        v.swap(i, (s % (i as u64 + 1)) as usize);
    }
}

fn secs(ms: u64) -> Timestamp {
    Timestamp::from_millis(ms)
}

/// A span of this thread's on-CPU time, and of wall time for spans too short for the
/// scheduler's accounting (it advances at ticks and context switches).
#[derive(Clone, Copy)]
struct Span(u64, Instant);

impl Span {
    fn start() -> Self {
        Self(cpu_ns(), Instant::now())
    }

    /// On-CPU time: for spans of many milliseconds.
    fn elapsed(self) -> Duration {
        Duration::from_nanos(cpu_ns().saturating_sub(self.0))
    }

    /// Wall time: for short spans (includes time on the run queue when preempted).
    fn wall(self) -> Duration {
        self.1.elapsed()
    }
}

/// Nanoseconds this thread has run on a CPU.
fn cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .expect("/proc/thread-self/schedstat is readable (Linux)")
}

fn rss_bytes() -> anyhow::Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .context("no VmRSS line")?;
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .context("malformed VmRSS")?
        .parse()?;
    Ok(kb * 1024)
}

fn per_sec(count: usize, elapsed: Duration) -> f64 {
    count as f64 / elapsed.as_secs_f64()
}

fn ns_per(elapsed: Duration, count: usize) -> f64 {
    elapsed.as_nanos() as f64 / count as f64
}

struct Args {
    leases: usize,
    tracked: usize,
}

fn parse_args() -> anyhow::Result<(Option<String>, Args)> {
    let mut phase = None;
    let mut args = Args {
        leases: 1_000_000,
        tracked: 100_000,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--leases" => args.leases = it.next().context("--leases N")?.parse()?,
            "--tracked" => args.tracked = it.next().context("--tracked N")?.parse()?,
            "--phase" => phase = Some(it.next().context("--phase NAME")?),
            other => bail!("unknown argument {other}"),
        }
    }
    Ok((phase, args))
}

fn main() -> anyhow::Result<()> {
    let (phase, args) = parse_args()?;
    match phase.as_deref() {
        Some("mem-table") => return mem_table(args.leases),
        Some("mem-tracker") => return mem_tracker(args.tracked),
        // For instruction counts: `valgrind --tool=cachegrind ... --phase heartbeat`.
        Some("heartbeat") => return heartbeat_only(args.leases),
        Some(other) => bail!("unknown phase {other}"),
        None => {}
    }
    println!("clock=thread_cpu_time");
    println!("leases={}", args.leases);
    println!("tracked={}", args.tracked);
    for phase in ["mem-table", "mem-tracker"] {
        let out = Command::new(std::env::current_exe()?)
            .args(["--phase", phase])
            .args(["--leases", &args.leases.to_string()])
            .args(["--tracked", &args.tracked.to_string()])
            .output()?;
        if !out.status.success() {
            bail!("{phase}: {}", String::from_utf8_lossy(&out.stderr));
        }
        print!("{}", String::from_utf8_lossy(&out.stdout));
    }
    table_throughput(args.leases);
    reap_scaling(args.leases);
    reap_steady_state(args.leases / 10);
    tracker_steps(args.tracked);
    Ok(())
}

/// Bytes per live lease: table, index, heap entry and the request id's allocation.
fn mem_table(n: usize) -> anyhow::Result<()> {
    let before = rss_bytes()?;
    let mut table = LeaseTable::new(LeaseConfig::default());
    for id in request_ids(n, 1) {
        table.grant(Timestamp::ZERO, id, Vec::new(), 1)?;
    }
    let after = rss_bytes()?;
    black_box(&table);
    println!(
        "table_bytes_per_lease={:.1}",
        (after - before) as f64 / n as f64
    );
    Ok(())
}

/// Bytes per tracked request: positions, the engine's id list and the id's allocation.
fn mem_tracker(n: usize) -> anyhow::Result<()> {
    let engines: Vec<EngineId> = (0..8)
        .map(|e| EngineId::new(&format!("prefill-{e}")))
        .collect::<Result<_, _>>()?;
    let before = rss_bytes()?;
    let mut tracker = HeartbeatTracker::new(&LeaseConfig::default());
    for (i, id) in request_ids(n, 2).into_iter().enumerate() {
        tracker.track(Timestamp::ZERO, id, engines[i % 8].clone(), 4)?;
    }
    let after = rss_bytes()?;
    black_box(&tracker);
    println!(
        "tracker_bytes_per_request={:.1}",
        (after - before) as f64 / n as f64
    );
    Ok(())
}

/// Grants `n` leases, then one shuffled heartbeat round: the hot path alone.
fn heartbeat_only(n: usize) -> anyhow::Result<()> {
    let ids = request_ids(n, 3);
    let mut table = LeaseTable::new(LeaseConfig::default());
    for id in &ids {
        table.grant(Timestamp::ZERO, id.clone(), Vec::new(), 1)?;
    }
    let mut shuffled = ids;
    shuffle(&mut shuffled, 7);
    let messages: Vec<String> = shuffled
        .chunks(1000)
        .map(|c| {
            c.iter()
                .map(RequestId::as_str)
                .collect::<Vec<_>>()
                .join(",")
        })
        .collect();
    let start = Span::start();
    let mut held = 0;
    for msg in &messages {
        held += table.handle_heartbeat(secs(10_000), msg.split(',')).held;
    }
    let t = start.elapsed();
    println!("heartbeat_only_held={held}");
    println!("heartbeat_only_ids_per_sec={:.0}", per_sec(n, t));
    Ok(())
}

fn table_throughput(n: usize) {
    let ids = request_ids(n, 3);
    let mut table = LeaseTable::new(LeaseConfig::default());
    let start = Span::start();
    for (i, id) in ids.iter().enumerate() {
        let blocks = vec![BlockId(i as u32); 4];
        table
            .grant(Timestamp::ZERO, id.clone(), blocks, 1)
            .expect("ids are distinct");
    }
    let t = start.elapsed();
    println!("grant_per_sec={:.0}", per_sec(n, t));
    println!("grant_ns={:.1}", ns_per(t, n));

    // Heartbeats in messages of 1000 ids, as a decoder hands them over.
    let chunk = 1000;
    let mut now_ms = 5_000;
    let mut run = |label: &str, order: &[RequestId], table: &mut LeaseTable| {
        let rounds = 3;
        let start = Span::start();
        let mut held = 0u64;
        for _ in 0..rounds {
            now_ms += 5_000;
            for msg in order.chunks(chunk) {
                held += u64::from(table.handle_heartbeat(secs(now_ms), msg).held);
            }
        }
        let t = start.elapsed();
        assert_eq!(held, (rounds * order.len()) as u64);
        println!(
            "heartbeat_{label}_ids_per_sec={:.0}",
            per_sec(rounds * order.len(), t)
        );
    };
    run("grant_order", &ids, &mut table);
    let mut shuffled = ids.clone();
    shuffle(&mut shuffled, 7);
    run("shuffled", &shuffled, &mut table);
    // As a zero-copy decoder hands them over: ids split out of the message's bytes, no
    // RequestId built (the message buffer is hot in cache, as after a receive).
    let messages: Vec<String> = shuffled
        .chunks(chunk)
        .map(|c| {
            c.iter()
                .map(RequestId::as_str)
                .collect::<Vec<_>>()
                .join(",")
        })
        .collect();
    let start = Span::start();
    let mut held = 0u64;
    for msg in &messages {
        held += u64::from(
            table
                .handle_heartbeat(secs(now_ms + 5_000), msg.split(','))
                .held,
        );
    }
    let t = start.elapsed();
    assert_eq!(held, n as u64);
    println!("heartbeat_wire_shuffled_ids_per_sec={:.0}", per_sec(n, t));
    let unknown = request_ids(n / 10, 99);
    let start = Span::start();
    for msg in unknown.chunks(chunk) {
        black_box(table.handle_heartbeat(secs(now_ms + 5_000), msg));
    }
    println!(
        "heartbeat_unknown_ids_per_sec={:.0}",
        per_sec(unknown.len(), start.elapsed())
    );
    let s = table.stats();
    println!("heartbeat_extensions={}", s.extensions);
}

/// k leases expire among n live ones: the reaper's cost follows k.
fn reap_scaling(n: usize) {
    // k grows at fixed n, then n grows at fixed k.
    let cases = [1usize, 100, 10_000, n / 10]
        .map(|k| (n, k))
        .into_iter()
        .chain([(n / 100, 100), (n / 10, 100)]);
    for (n, k) in cases {
        let ids = request_ids(n, 4 + k as u64);
        let mut table = LeaseTable::new(LeaseConfig::default());
        // The k doomed leases are granted at 0 s (expire at 30 s), the others at 10 s.
        for (i, id) in ids.into_iter().enumerate() {
            let at = if i % (n / k) == 0 { 0 } else { 10_000 };
            table
                .grant(secs(at), id, vec![BlockId(0)], 1)
                .expect("ids are distinct");
        }
        let doomed = n.div_ceil(n / k);
        let start = Span::start();
        let released = table.handle_timeout(secs(30_000));
        let t = start.wall();
        assert_eq!(released, doomed);
        let mut events = 0;
        while let Some(Event::Released(_)) = table.poll_event() {
            events += 1;
        }
        assert_eq!(events, doomed);
        // An idle reaper call (nothing due) for comparison.
        let start = Span::start();
        let idle = table.handle_timeout(secs(30_001));
        let idle_t = start.wall();
        assert_eq!(idle, 0);
        println!(
            "reap_k={doomed} reap_n={} reap_wall_us={:.1} reap_wall_ns_per_expired={:.1} reap_idle_wall_ns={}",
            n,
            t.as_secs_f64() * 1e6,
            ns_per(t, doomed),
            idle_t.as_nanos()
        );
    }
}

/// Steady state: n leases heartbeated every 5 s in messages spread over 10 ms steps, the
/// reaper called every step. Its per-step cost includes re-filing renewed deadlines.
fn reap_steady_state(n: usize) {
    let ids = request_ids(n, 5);
    let mut table = LeaseTable::new(LeaseConfig::default());
    for id in &ids {
        table
            .grant(Timestamp::ZERO, id.clone(), vec![BlockId(0)], 1)
            .expect("ids are distinct");
    }
    let step_ms = 10;
    let steps_per_interval = 5_000 / step_ms;
    let per_step = n.div_ceil(steps_per_interval as usize);
    let mut reap_time = Duration::ZERO;
    let mut steps = 0usize;
    let mut cursor = 0usize;
    for step in 1..=(120_000 / step_ms) {
        let now = secs(step * step_ms);
        let end = (cursor + per_step).min(n);
        let _ = table.handle_heartbeat(now, &ids[cursor..end]);
        cursor = if end == n { 0 } else { end };
        let start = Span::start();
        let released = table.handle_timeout(now);
        reap_time += start.wall();
        assert_eq!(released, 0, "a heartbeated lease expired");
        steps += 1;
    }
    let s = table.stats();
    println!(
        "reap_steady_n={n} reap_steady_step_wall_ns={:.0} reap_refiles_per_lease_per_min={:.2}",
        ns_per(reap_time, steps),
        s.reaper_refiles as f64 / n as f64 / 2.0
    );
}

fn tracker_steps(n: usize) {
    let engines: Vec<EngineId> = (0..8)
        .map(|e| EngineId::new(&format!("prefill-{e}")).expect("valid engine id"))
        .collect();
    let ids = request_ids(n, 6);
    let mut tracker = HeartbeatTracker::new(&LeaseConfig::default());
    let start = Span::start();
    for (i, id) in ids.iter().enumerate() {
        tracker
            .track(Timestamp::ZERO, id.clone(), engines[i % 8].clone(), 4)
            .expect("ids are distinct");
    }
    println!("track_ns={:.1}", ns_per(start.elapsed(), n));
    let mut batches = 0;
    while let Some(b) = tracker.poll_heartbeat(Timestamp::ZERO) {
        batches += 1;
        black_box(b);
    }
    assert_eq!(batches, 8);

    // Idle steps: nothing due.
    let polls = 1_000_000;
    let start = Span::start();
    for i in 0..polls {
        let now = Timestamp::from_nanos(1_000 + i as u64);
        if tracker.poll_heartbeat(now).is_some() {
            unreachable!("nothing is due before 5 s");
        }
    }
    println!("d_idle_step_ns={:.1}", ns_per(start.elapsed(), polls));

    // 60 s of 10 ms steps with batches due every 5 s per engine (phases spread), plus a
    // churn of 1% of the requests per interval.
    let mut tracker = HeartbeatTracker::new(&LeaseConfig::default());
    for (i, id) in ids.iter().enumerate() {
        let at = Timestamp::from_millis((i % 8) as u64 * 600);
        tracker
            .track(at, id.clone(), engines[i % 8].clone(), 4)
            .expect("ids are distinct");
    }
    let step_ms = 10u64;
    let mut worst = Duration::ZERO;
    let mut total = Duration::ZERO;
    let mut steps = 0usize;
    let mut listed = 0usize;
    for step in 0..(60_000 / step_ms) {
        let now = Timestamp::from_millis(step * step_ms);
        let start = Span::start();
        while let Some(b) = tracker.poll_heartbeat(now) {
            listed += b.requests.len();
            black_box(b);
        }
        let t = start.wall();
        total += t;
        worst = worst.max(t);
        steps += 1;
    }
    println!("d_step_amortised_wall_ns={:.0}", ns_per(total, steps));
    println!(
        "d_step_with_batch_worst_wall_us={:.1}",
        worst.as_secs_f64() * 1e6
    );
    println!("d_ids_listed={listed}");
    let start = Span::start();
    for id in &ids {
        tracker.untrack(id);
    }
    println!("untrack_ns={:.1}", ns_per(start.elapsed(), n));
}
