//! Leases against the single-timeout baseline, in simulated worlds; prints `key=value`.
//!
//! ```sh
//! cargo run --release -p kvlease-sim --example sim_figures
//! SIM_FIGURES_SEEDS=64 cargo run --release -p kvlease-sim --example sim_figures
//! ```
//!
//! Two worlds, each run with leases, with a short fixed timeout (= the lease duration) and
//! with a long one (16 lease durations, the shape of vLLM's 480 s against a 30 s lease):
//! - `d_crash`: a D engine dies; how long do its leases hold P's blocks?
//! - `overloaded`: D queues requests for more than 10 lease durations; how many reads find
//!   their blocks released (wasted prefills, recomputed)?
//!
//! All times are virtual; counts are means over the seeds, `_worst_` the maximum.

use kvlease_sim::{Report, WorldConfig, run};

fn seeds() -> u64 {
    std::env::var("SIM_FIGURES_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(32)
}

/// Turns a world into the same world in another lease mode.
type Mode = fn(WorldConfig) -> WorldConfig;

/// Runs `make(seed)` in the three modes and prints `f(report)` summed per mode.
fn compare(world: &str, make: fn(u64) -> WorldConfig) {
    let modes: [(&str, Mode); 3] = [
        ("lease", |c| c),
        ("fixed_short", |c| {
            let t = c.lease;
            c.with_fixed_timeout(t)
        }),
        ("fixed_long", |c| {
            let t = c.lease * 16;
            c.with_fixed_timeout(t)
        }),
    ];
    for (mode, apply) in modes {
        let reports: Vec<Report> = (0..seeds()).map(|s| run(apply(make(s)))).collect();
        let n = reports.len().max(1) as f64;
        let mean = |f: &dyn Fn(&Report) -> f64| reports.iter().map(f).sum::<f64>() / n;
        let lease = make(0).lease.as_secs_f64();
        println!("{world}.{mode}.lease_s={lease:.3}");
        println!(
            "{world}.{mode}.failures={}",
            reports.iter().map(|r| r.failures.len()).sum::<usize>()
        );
        println!(
            "{world}.{mode}.crash_reclaims={:.2}",
            mean(&|r| r.stats.crash_reclaims as f64)
        );
        let worst = reports
            .iter()
            .map(|r| r.stats.crash_reclaim_since_crash_max)
            .max()
            .unwrap_or_default();
        println!(
            "{world}.{mode}.reclaim_after_crash_worst_s={:.3}",
            worst.as_secs_f64()
        );
        println!(
            "{world}.{mode}.wasted_prefills={:.2}",
            mean(&|r| (r.stats.stale_reads + r.stats.recomputed_after_notice) as f64)
        );
        println!(
            "{world}.{mode}.reads_ok={:.2}",
            mean(&|r| r.stats.reads_ok as f64)
        );
        println!(
            "{world}.{mode}.released_expired={:.2}",
            mean(&|r| r.stats.released_expired as f64)
        );
    }
}

fn main() {
    println!("seeds={}", seeds());
    compare("d_crash", WorldConfig::d_crash);
    compare("overloaded", WorldConfig::overloaded);
}
