//! Bidirectional mode under clock skew: both deadline bases are safe with the default
//! margin, too small a margin breaks them, and planted bugs are caught by the oracle.
//! The safety tests honour `KVLEASE_SIM_SEED` (replay one) like the rest of the suite; the
//! tests that expect a failure somewhere run fixed seeds.

use std::time::Duration;

use kvlease_engine::DeadlineBasis;
use kvlease_sim::{BidirBug, BidirConfig, BidirReport, run_bidir, scenario_seeds};

const BASES: [DeadlineBasis; 2] = [DeadlineBasis::ClockOffset, DeadlineBasis::RelativeTtl];

fn repro(seed: u64, test: &str) -> String {
    format!(
        "KVLEASE_SIM_SEED={seed} cargo test -p kvlease-sim --test bidir_ttl {test} -- --exact --nocapture"
    )
}

/// Runs `make(seed)` for every scenario seed (`KVLEASE_SIM_SEED` replays one); returns the
/// reports.
fn runs(seeds: u64, make: impl Fn(u64) -> BidirConfig) -> Vec<BidirReport> {
    scenario_seeds(seeds)
        .into_iter()
        .map(|s| run_bidir(&make(s)))
        .collect()
}

/// Runs `make(seed)` for the fixed seeds `0..seeds`: for tests that assert that a failure
/// shows up somewhere among them, which one replayed seed need not show.
fn runs_fixed(seeds: u64, make: impl Fn(u64) -> BidirConfig) -> Vec<BidirReport> {
    (0..seeds).map(|s| run_bidir(&make(s))).collect()
}

#[test]
fn both_bases_safe_under_ten_second_skew() {
    let test = "both_bases_safe_under_ten_second_skew";
    let mut failed = String::new();
    let (mut pulls, mut declines) = (0, 0);
    for basis in BASES {
        for skew_ms in [-10_000, 10_000] {
            for r in runs(16, |s| {
                let mut c = BidirConfig::realistic(s, basis);
                c.skew_ms = skew_ms;
                c
            }) {
                assert_eq!(r.decisions, 200);
                pulls += r.safe_pulls;
                declines += r.needless_recomputes + r.needed_recomputes;
                if r.unsafe_pulls > 0 || !r.failures.is_empty() {
                    failed += &format!(
                        "{basis:?} skew {skew_ms} ms seed {}: {:?}\n  reproduce: {}\n",
                        r.seed,
                        r.failures,
                        repro(r.seed, test)
                    );
                }
            }
        }
    }
    assert!(failed.is_empty(), "{failed}");
    // The scenario puts decisions on both sides of the deadline.
    assert!(
        pulls > 0 && declines > 0,
        "{pulls} pulls, {declines} declines"
    );
}

#[test]
fn estimates_err_on_the_safe_side_without_drift_or_jitter() {
    // Without drift, the offset basis is within its rtt/2 bound (never late); without
    // jitter, subtracting the whole RTT covers the one-way delay (never late).
    for basis in BASES {
        for r in runs(8, |s| {
            let mut c = BidirConfig::realistic(s, basis);
            c.skew_ms = 30_000;
            c.drift_ppm = 0;
            c.delay_up = Duration::from_micros(200);
            c.delay_down = Duration::from_millis(20);
            if basis == DeadlineBasis::RelativeTtl {
                c.jitter = Duration::ZERO;
            }
            c
        }) {
            let worst = r.deadline_errors_ns.iter().copied().max().unwrap_or(0);
            assert!(worst <= 0, "{basis:?} seed {}: late by {worst} ns", r.seed);
        }
    }
}

#[test]
fn same_seed_same_report() {
    for basis in BASES {
        let a = run_bidir(&BidirConfig::realistic(3, basis));
        let b = run_bidir(&BidirConfig::realistic(3, basis));
        assert_eq!(a, b);
        assert_ne!(
            a.deadline_errors_ns,
            run_bidir(&BidirConfig::realistic(4, basis)).deadline_errors_ns
        );
    }
}

#[test]
fn too_small_a_margin_breaks_both() {
    // D's clock 200 ppm fast makes its 480 s TTL ~96 ms shorter in true time; with no
    // margin both bases pull blocks that D has already freed.
    for basis in BASES {
        let unsafe_pulls: u64 = runs_fixed(8, |s| {
            let mut c = BidirConfig::realistic(s, basis);
            c.drift_ppm = 200;
            c.jitter = Duration::from_millis(50);
            c.margin = Duration::ZERO;
            c
        })
        .iter()
        .map(|r| r.unsafe_pulls)
        .sum();
        assert!(unsafe_pulls > 0, "{basis:?}: no unsafe pull with no margin");
    }
}

fn caught(basis: DeadlineBasis, skew_ms: i64, bug: BidirBug) -> Vec<String> {
    runs_fixed(8, |s| {
        let mut c = BidirConfig::realistic(s, basis).with_bug(bug);
        c.skew_ms = skew_ms;
        c
    })
    .into_iter()
    .flat_map(|r| r.failures)
    .collect()
}

#[test]
fn oracle_catches_ignored_offset() {
    // D 10 s ahead: reading its deadline as P's own time gives P 10 s that do not exist.
    let failures = caught(DeadlineBasis::ClockOffset, 10_000, BidirBug::IgnoreOffset);
    assert!(
        failures
            .iter()
            .any(|f| f.contains("pull read freed blocks")),
        "{failures:?}"
    );
}

#[test]
fn oracle_catches_unaged_ttl() {
    let failures = caught(DeadlineBasis::RelativeTtl, 0, BidirBug::UnagedTtl);
    assert!(
        failures
            .iter()
            .any(|f| f.contains("pull read freed blocks")),
        "{failures:?}"
    );
}
