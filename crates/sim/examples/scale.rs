//! Heartbeat traffic at scale, by simulation: 256 P engines (TP 2) and 1,024 D engines
//! (TP 2) running the real engine cores, the production lease (30 s, heartbeats every 5 s),
//! at four load levels; prints `key=value` lines.
//!
//! ```sh
//! cargo run --release -p kvlease-sim --example scale
//! SCALE_REQUESTS=4096,65536 cargo run --release -p kvlease-sim --example scale
//! ```
//!
//! Requests arrive over the first 15 s; every D engine decodes one request for longer than
//! the run, so the others stay tracked and heartbeated. The figures are measured over
//! virtual seconds 20 to 60, when every request has arrived and is tracked:
//! `hb_msgs_per_s_per_p_worker` (messages each P worker receives), the bytes of those
//! messages, and `live_requests` (requests D tracks, the mean over the window). Each level
//! is one seed, one run of 60 virtual seconds (the largest takes about 25 s in release).

use std::time::{Duration, Instant};

use kvlease_sim::{World, WorldConfig};

fn levels() -> Vec<usize> {
    std::env::var("SCALE_REQUESTS")
        .ok()
        .map(|s| s.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![2_048, 16_384, 65_536, 262_144])
}

fn main() {
    let (from, to) = (Duration::from_secs(20), Duration::from_secs(60));
    for requests in levels() {
        let started = Instant::now();
        let config = WorldConfig::scale(1, requests);
        let workers = (config.p_engines as u64 * u64::from(config.p_tp)) as f64;
        let (p_engines, d_engines) = (config.p_engines, config.d_engines);
        let mut world = World::new(config);
        let early = world.run_until(from);
        let late = world.run_until(to);
        let window = (to - from).as_secs_f64();
        let msgs = (late.stats.heartbeat_messages - early.stats.heartbeat_messages) as f64;
        let bytes = (late.stats.heartbeat_bytes - early.stats.heartbeat_bytes) as f64;
        let live =
            (late.stats.tracked_request_ns - early.stats.tracked_request_ns) as f64 / 1e9 / window;
        let tag = format!("requests_{requests}");
        println!("{tag}.p_engines={p_engines}");
        println!("{tag}.d_engines={d_engines}");
        println!("{tag}.p_workers={workers}");
        println!("{tag}.live_requests={live:.0}");
        println!(
            "{tag}.hb_msgs_per_s_per_p_worker={:.2}",
            msgs / window / workers
        );
        println!(
            "{tag}.hb_bytes_per_s_per_p_worker={:.0}",
            bytes / window / workers
        );
        println!("{tag}.hb_msgs_per_s_total={:.0}", msgs / window);
        println!("{tag}.hb_bytes_per_s_total={:.0}", bytes / window);
        println!(
            "{tag}.failures={}",
            late.failures.len() + early.failures.len()
        );
        for f in late.failures.iter().take(3) {
            println!("{tag}.failure={f}");
        }
        println!("{tag}.wall_s={:.1}", started.elapsed().as_secs_f64());
    }
}
