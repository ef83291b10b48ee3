//! Relative TTLs on the wire against clock-offset deadlines, under skew, drift, delay
//! asymmetry and jitter; prints `key=value` lines and a table.
//!
//! ```sh
//! cargo run --release -p kvlease-sim --example bidir_ttl
//! BIDIR_TTL_SEEDS=4 cargo run --release -p kvlease-sim --example bidir_ttl
//! ```
//!
//! Grid: skew {-30,-10,0,10,30} s × drift {-200,0,200} ppm × one-way delays (up/down)
//! {0.5/0.5, 0.5/20, 20/0.5} ms × jitter {0, 5, 50} ms, each run with `seeds` seeds of 200
//! conversations (TTL 480 s, pull 200 ms, 8 handshake probes), for both bases (the relative
//! TTL also with half or no RTT subtracted for the flight) and margins
//! {5 s, 1 s, 100 ms, 10 ms, 0}. Deterministic per seed.

use std::time::Duration;

use kvlease_engine::DeadlineBasis;
use kvlease_sim::{BidirConfig, BidirReport, FlightAllowance, run_bidir};

fn seeds() -> u64 {
    std::env::var("BIDIR_TTL_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2)
}

const SKEWS_MS: [i64; 5] = [-30_000, -10_000, 0, 10_000, 30_000];
const DRIFTS_PPM: [i64; 3] = [-200, 0, 200];
const DELAYS_US: [(u64, u64); 3] = [(500, 500), (500, 20_000), (20_000, 500)];
const JITTERS_US: [u64; 3] = [0, 5_000, 50_000];
const MARGINS_MS: [u64; 5] = [5_000, 1_000, 100, 10, 0];

/// Totals over the grid for one basis and margin, with unsafe pulls split by each axis.
#[derive(Default)]
struct Totals {
    decisions: u64,
    unsafe_pulls: u64,
    safe_pulls: u64,
    needless: u64,
    needed: u64,
    errors: Vec<i64>,
    unsafe_by_skew: [u64; 5],
    unsafe_by_drift: [u64; 3],
    unsafe_by_delay: [u64; 3],
    unsafe_by_jitter: [u64; 3],
}

fn grid(basis: DeadlineBasis, flight: FlightAllowance, margin: Duration) -> Totals {
    let mut t = Totals::default();
    let mut world = 0u64;
    for (si, &skew) in SKEWS_MS.iter().enumerate() {
        for (di, &drift) in DRIFTS_PPM.iter().enumerate() {
            for (ai, &(up, down)) in DELAYS_US.iter().enumerate() {
                for (ji, &jitter) in JITTERS_US.iter().enumerate() {
                    world += 1;
                    for s in 0..seeds() {
                        // The same seed for both bases and every margin: same draws.
                        let mut c = BidirConfig::realistic(world * 1_000 + s, basis);
                        c.skew_ms = skew;
                        c.drift_ppm = drift;
                        c.delay_up = Duration::from_micros(up);
                        c.delay_down = Duration::from_micros(down);
                        c.jitter = Duration::from_micros(jitter);
                        c.margin = margin;
                        c.flight = flight;
                        let r: BidirReport = run_bidir(&c);
                        t.decisions += r.decisions;
                        t.unsafe_pulls += r.unsafe_pulls;
                        t.safe_pulls += r.safe_pulls;
                        t.needless += r.needless_recomputes;
                        t.needed += r.needed_recomputes;
                        t.errors.extend(&r.deadline_errors_ns);
                        t.unsafe_by_skew[si] += r.unsafe_pulls;
                        t.unsafe_by_drift[di] += r.unsafe_pulls;
                        t.unsafe_by_delay[ai] += r.unsafe_pulls;
                        t.unsafe_by_jitter[ji] += r.unsafe_pulls;
                    }
                }
            }
        }
    }
    t.errors.sort_unstable();
    t
}

fn pct(sorted: &[i64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i] as f64 / 1e6
}

fn name(basis: DeadlineBasis, flight: FlightAllowance) -> &'static str {
    match (basis, flight) {
        (DeadlineBasis::ClockOffset, _) => "clock_offset",
        (DeadlineBasis::RelativeTtl, FlightAllowance::FullRtt) => "relative_ttl",
        (DeadlineBasis::RelativeTtl, FlightAllowance::HalfRtt) => "relative_ttl_half_rtt",
        (DeadlineBasis::RelativeTtl, FlightAllowance::None) => "relative_ttl_no_flight",
    }
}

fn main() {
    println!("seeds_per_world={}", seeds());
    let mut rows = Vec::new();
    let variants = [
        (DeadlineBasis::ClockOffset, FlightAllowance::FullRtt),
        (DeadlineBasis::RelativeTtl, FlightAllowance::FullRtt),
        (DeadlineBasis::RelativeTtl, FlightAllowance::HalfRtt),
        (DeadlineBasis::RelativeTtl, FlightAllowance::None),
    ];
    for (basis, flight) in variants {
        for margin_ms in MARGINS_MS {
            let t = grid(basis, flight, Duration::from_millis(margin_ms));
            let k = format!("{}.margin_ms_{margin_ms}", name(basis, flight));
            println!("{k}.decisions={}", t.decisions);
            println!("{k}.unsafe_pulls={}", t.unsafe_pulls);
            println!("{k}.safe_pulls={}", t.safe_pulls);
            println!("{k}.needless_recomputes={}", t.needless);
            println!("{k}.needed_recomputes={}", t.needed);
            for (p, label) in [(0.0, "min"), (0.01, "p1"), (0.5, "p50"), (0.99, "p99")] {
                println!("{k}.deadline_error_{label}_ms={:.3}", pct(&t.errors, p));
            }
            println!("{k}.deadline_error_max_ms={:.3}", pct(&t.errors, 1.0));
            for (i, v) in SKEWS_MS.iter().enumerate() {
                println!("{k}.unsafe_by_skew_s_{}={}", v / 1000, t.unsafe_by_skew[i]);
            }
            for (i, v) in DRIFTS_PPM.iter().enumerate() {
                println!("{k}.unsafe_by_drift_ppm_{v}={}", t.unsafe_by_drift[i]);
            }
            for (i, (u, d)) in DELAYS_US.iter().enumerate() {
                println!(
                    "{k}.unsafe_by_delay_up{}us_down{}us={}",
                    u, d, t.unsafe_by_delay[i]
                );
            }
            for (i, v) in JITTERS_US.iter().enumerate() {
                println!("{k}.unsafe_by_jitter_us_{v}={}", t.unsafe_by_jitter[i]);
            }
            rows.push((basis, flight, margin_ms, t));
        }
    }
    println!();
    println!(
        "| basis | margin | decisions | unsafe | needless recompute | err p1 ms | err p50 ms | err max ms |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for (basis, flight, margin_ms, t) in &rows {
        println!(
            "| {} | {} ms | {} | {} | {} | {:.3} | {:.3} | {:.3} |",
            name(*basis, *flight),
            margin_ms,
            t.decisions,
            t.unsafe_pulls,
            t.needless,
            pct(&t.errors, 0.01),
            pct(&t.errors, 0.5),
            pct(&t.errors, 1.0)
        );
    }
}
