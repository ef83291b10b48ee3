//! The simulation suite: the seed sweep, named scenarios, the determinism check, and tests
//! that plant a bug and assert that the checker catches it.

use std::io::Write as _;
use std::time::Duration;

use kvlease_lease::LeaseConfig;

use kvlease_sim::{
    Bug, Report, World, WorldConfig, repro_command, run, scenario_seeds, seeds_from_env,
};

/// Runs `make(seed)` for every seed; panics with every failure and its repro command.
fn sweep(test: &str, seeds: Vec<u64>, make: impl Fn(u64) -> WorldConfig) -> Vec<Report> {
    let mut reports = Vec::new();
    let mut failed = String::new();
    for seed in seeds {
        let report = run(make(seed));
        if !report.failures.is_empty() {
            failed += &format!(
                "seed {seed} failed:\n  {}\n  stats: {:?}\n  reproduce: {}\n",
                report.failures.join("\n  "),
                report.stats,
                repro_command(seed, test)
            );
        }
        reports.push(report);
    }
    assert!(failed.is_empty(), "{failed}");
    reports
}

fn total(reports: &[Report], f: impl Fn(&Report) -> u64) -> u64 {
    reports.iter().map(f).sum()
}

#[test]
fn sim_seeds() {
    let reports = sweep("sim_seeds", seeds_from_env(64), WorldConfig::random);
    let n = reports.len();
    let faults = [
        ("p_restarts", total(&reports, |r| r.stats.p_restarts)),
        ("d_restarts", total(&reports, |r| r.stats.d_restarts)),
        ("stalls", total(&reports, |r| r.stats.stalls)),
        ("partitions", total(&reports, |r| r.stats.partitions)),
        ("forged", total(&reports, |r| r.stats.forged)),
    ];
    if std::env::var_os("KVLEASE_SIM_SEEDS").is_some() {
        let mut line = format!("sim: seeds={n}");
        for (name, count) in faults {
            line += &format!(" {name}={count}");
        }
        line += &format!(
            " requests={} outcomes_ok={}",
            total(&reports, |r| r.stats.arrived),
            total(&reports, |r| r.stats.outcomes_ok)
        );
        // Straight to the process's stdout, past the test harness's capture, so that CI
        // logs show it without --nocapture.
        let _ = writeln!(std::io::stdout().lock(), "{line}");
    }
    if n >= 256 {
        for (name, count) in faults {
            assert!(count > 0, "{name}: no such fault in {n} seeds");
        }
        // Some D asked P's side channel about a newer instance a request named (it
        // usually learns of the restart from the broken connection meanwhile).
        assert!(total(&reports, |r| r.stats.instance_checks) > 0);
    }
    assert_eq!(
        total(&reports, |r| r.stats.arrived),
        total(&reports, |r| r.stats.outcomes_ok)
    );
    // The sweep exercised what it claims to (over all seeds together).
    if reports.len() >= 32 {
        assert!(total(&reports, |r| r.stats.reads_ok) > 0);
        assert!(total(&reports, |r| r.stats.released_completed) > 0);
        assert!(total(&reports, |r| r.stats.released_expired) > 0);
        assert!(total(&reports, |r| r.stats.crash_reclaims) > 0);
        assert!(total(&reports, |r| r.stats.messages_lost) > 0);
        assert!(total(&reports, |r| r.stats.messages_duplicated) > 0);
        assert!(total(&reports, |r| r.stats.messages_partitioned) > 0);
        assert!(total(&reports, |r| r.stats.deferred_batches) > 0);
        assert!(total(&reports, |r| r.stats.expiry_notices) > 0);
        assert!(total(&reports, |r| r.stats.failed_reads + r.stats.stale_reads) > 0);
        assert!(total(&reports, |r| r.stats.forged_ignored) > 0);
        assert!(total(&reports, |r| r.stats.lost_with_d) > 0);
        assert!(total(&reports, |r| r.stats.lost_with_p) > 0);
        assert!(total(&reports, |r| r.stats.forgotten_engines) > 0);
    }
}

/// The full trace (every core event and action, every message) of one seed is the same
/// in two runs: the cores hand things out in an order their inputs define, not a hash's
/// (each run's hash maps get fresh random keys, so an order that followed them would
/// differ here), and the shell does not sort. Seeds 2, 11, 14, 17 and 27 failed while
/// `DecodeCore` walked a hash map to fail the requests waiting for an engine.
#[test]
fn same_seed_same_log() {
    for seed in 0..32 {
        let a = World::new(WorldConfig::random(seed)).record_log().run();
        let b = World::new(WorldConfig::random(seed)).record_log().run();
        assert!(a.failures.is_empty(), "seed {seed}: {:?}", a.failures);
        assert!(
            a.log.iter().any(|l| l.contains(" event "))
                && a.log.iter().any(|l| l.contains(" send ")),
            "seed {seed}: the log holds no events or messages"
        );
        if let Some(i) = (0..a.log.len().max(b.log.len())).find(|&i| a.log.get(i) != b.log.get(i)) {
            panic!(
                "seed {seed}: the runs differ at line {i} of {} and {}:\n  first:  {:?}\n  second: {:?}",
                a.log.len(),
                b.log.len(),
                a.log.get(i),
                b.log.get(i)
            );
        }
        assert_eq!(a.trace_hash, b.trace_hash);
    }
}

#[test]
fn same_seed_same_trace() {
    for seed in [1, 7, 12345] {
        let a = run(WorldConfig::random(seed));
        let b = run(WorldConfig::random(seed));
        assert_eq!(
            a.trace_hash, b.trace_hash,
            "seed {seed} is not deterministic"
        );
        assert_eq!(a.stats, b.stats);
    }
    assert_ne!(
        run(WorldConfig::random(1)).trace_hash,
        run(WorldConfig::random(2)).trace_hash
    );
}

#[test]
fn d_crash_reclaims_within_bound() {
    let reports = sweep(
        "d_crash_reclaims_within_bound",
        scenario_seeds(16),
        WorldConfig::d_crash,
    );
    let mut reclaims = 0;
    let mut bounded = 0;
    for r in &reports {
        reclaims += r.stats.crash_reclaims;
        let config = WorldConfig::d_crash(r.seed);
        let extension = LeaseConfig::from_duration(config.lease)
            .unwrap()
            .extension();
        let step = config.p_step + config.step_jitter + Duration::from_millis(1);
        // Both sides of the bound, as in quinn's idle_timeout tests: never before the
        // extension after the last delivered heartbeat, never later than one P step past it.
        if let Some((min, max)) = r.stats.crash_reclaim_after_heartbeat {
            bounded += 1;
            assert!(
                min >= extension,
                "seed {}: reclaimed {min:?} after the last heartbeat",
                r.seed
            );
            assert!(
                max <= extension + step,
                "seed {}: reclaimed {max:?} after the last heartbeat (extension {extension:?})",
                r.seed
            );
        }
    }
    // Over all seeds together (a replay of one seed checks only its oracles).
    if reports.len() > 1 {
        assert!(reclaims > 0, "no lease of the crashed D was reclaimed");
        assert!(
            bounded > 0,
            "no reclaim measured against a heartbeat-set expiry"
        );
    }
}

#[test]
fn overloaded_d_keeps_its_leases() {
    let reports = sweep(
        "overloaded_d_keeps_its_leases",
        scenario_seeds(4),
        WorldConfig::overloaded,
    );
    for r in &reports {
        let lease = WorldConfig::overloaded(r.seed).lease;
        assert!(
            r.stats.max_queue_wait >= lease * 10,
            "seed {}: queue wait {:?} is not 10 leases",
            r.seed,
            r.stats.max_queue_wait
        );
        assert!(r.stats.messages_lost > 0);
        assert_eq!(
            r.stats.done, r.stats.arrived,
            "seed {}: {:?}",
            r.seed, r.stats
        );
        assert_eq!(r.stats.stale_reads, 0);
        assert_eq!(r.stats.recomputed_after_notice, 0);
    }
}

#[test]
fn hetero_tp_frees_after_all_consumers() {
    for (p_tp, d_tp) in [(4, 2), (1, 2), (2, 2)] {
        let reports = sweep(
            "hetero_tp_frees_after_all_consumers",
            scenario_seeds(8),
            |seed| WorldConfig::hetero_tp(seed, p_tp, d_tp),
        );
        if reports.len() > 1 {
            assert!(total(&reports, |r| r.stats.released_completed) > 0);
        }
    }
}

#[test]
fn late_heartbeats_after_completion_change_nothing() {
    let reports = sweep(
        "late_heartbeats_after_completion_change_nothing",
        scenario_seeds(8),
        WorldConfig::late_heartbeats,
    );
    if reports.len() > 1 {
        assert!(total(&reports, |r| r.stats.heartbeats_after_release) > 0);
        assert!(total(&reports, |r| r.stats.released_completed) > 0);
    }
}

#[test]
fn restarted_p_serves_again_within_bound() {
    let reports = sweep(
        "restarted_p_serves_again_within_bound",
        scenario_seeds(8),
        WorldConfig::p_restart,
    );
    assert!(total(&reports, |r| r.stats.p_restarts) >= reports.len() as u64);
    if reports.len() > 1 {
        assert!(total(&reports, |r| r.stats.restart_checks) > 0);
        assert!(total(&reports, |r| r.stats.forgotten_engines) > 0);
    }
}

#[test]
fn churn_with_forgers_produces_no_wrong_output() {
    let reports = sweep(
        "churn_with_forgers_produces_no_wrong_output",
        scenario_seeds(8),
        WorldConfig::churn,
    );
    if reports.len() > 1 {
        assert!(total(&reports, |r| r.stats.stale_reads) > 0);
        assert!(total(&reports, |r| r.stats.forged_ignored) > 0);
        assert!(total(&reports, |r| r.stats.rogue_owned) > 0);
        assert!(total(&reports, |r| r.stats.refused_at_p) > 0);
    }
}

/// Runs seeds until one fails with a failure that contains `expect`; returns every
/// failure seen (the test asserts that one contains `expect`).
fn first_failure(make: impl Fn(u64) -> WorldConfig, expect: &str) -> Vec<String> {
    let mut seen = Vec::new();
    for seed in 0..16 {
        let report = run(make(seed));
        let caught = report.failures.iter().any(|f| f.contains(expect));
        seen.extend(report.failures);
        if caught {
            break;
        }
    }
    seen
}

#[test]
fn checker_catches_ignored_heartbeats() {
    let failures = first_failure(
        |s| WorldConfig::overloaded(s).with_bug(Bug::IgnoreHeartbeats),
        "before its expiry",
    );
    assert!(
        failures.iter().any(|f| f.contains("before its expiry")),
        "{failures:?}"
    );
}

#[test]
fn checker_catches_grant_order_reaper() {
    let failures = first_failure(
        |s| WorldConfig::d_crash(s).with_bug(Bug::GrantOrderReaper),
        "not reclaimed",
    );
    assert!(
        failures
            .iter()
            .any(|f| f.contains("not reclaimed") || f.contains("reclaimed late")),
        "{failures:?}"
    );
}

#[test]
fn checker_catches_underreported_consumers() {
    let failures = first_failure(
        |s| WorldConfig::hetero_tp(s, 1, 2).with_bug(Bug::UnderreportConsumers),
        "consumers reported",
    );
    assert!(
        failures.iter().any(|f| f.contains("consumers reported")),
        "{failures:?}"
    );
}

#[test]
fn checker_catches_skipped_fence_clear() {
    let failures = first_failure(
        |s| WorldConfig::churn(s).with_bug(Bug::SkipFenceClear),
        "wrong output",
    );
    assert!(
        failures.iter().any(|f| f.contains("wrong output")),
        "{failures:?}"
    );
}

#[test]
fn checker_catches_ignored_fence() {
    let failures = first_failure(
        |s| WorldConfig::churn(s).with_bug(Bug::IgnoreFence),
        "fence did not match",
    );
    assert!(
        failures.iter().any(|f| f.contains("fence did not match")),
        "{failures:?}"
    );
}

#[test]
fn checker_catches_a_stale_connection() {
    let failures = first_failure(
        |s| WorldConfig::p_restart(s).with_bug(Bug::NeverForget),
        "restart:",
    );
    assert!(
        failures.iter().any(|f| f.contains("restart:")),
        "{failures:?}"
    );
}

#[test]
fn checker_catches_dropped_refusals() {
    let failures = first_failure(
        |s| WorldConfig::churn(s).with_bug(Bug::DropRefusals),
        "no outcome",
    );
    assert!(
        failures.iter().any(|f| f.contains("no outcome")),
        "{failures:?}"
    );
}

#[test]
fn checker_catches_leaked_reads() {
    let failures = first_failure(
        |s| WorldConfig::churn(s).with_bug(Bug::SkipAbortedReads),
        "leak:",
    );
    assert!(failures.iter().any(|f| f.contains("leak:")), "{failures:?}");
}

#[test]
#[ignore = "long sweep: cargo test -p kvlease-sim --test sim -- --ignored sim_stress"]
fn sim_stress() {
    // Seeds far from the sweep's, so that the stress run covers new worlds.
    let seeds: Vec<u64> = if std::env::var_os("KVLEASE_SIM_SEED").is_some() {
        seeds_from_env(4096)
    } else {
        (0..seeds_from_env(4096).len() as u64)
            .map(|s| s + (1 << 32))
            .collect()
    };
    let n = seeds.len();
    let reports = sweep("sim_stress", seeds, WorldConfig::random);
    assert_eq!(reports.len(), n);
}

/// The overload scenario matters: with the single-timeout baseline (one lease duration,
/// no extension) the same worlds lose most reads to released blocks, while leases lose none
/// (`overloaded_d_keeps_its_leases`).
#[test]
fn baseline_fixed_timeout_wastes_prefills_under_overload() {
    for seed in scenario_seeds(2) {
        let config = WorldConfig::overloaded(seed);
        let timeout = config.lease;
        let report = run(config.with_fixed_timeout(timeout));
        assert!(report.failures.is_empty(), "{:?}", report.failures);
        assert!(
            report.stats.stale_reads + report.stats.recomputed_after_notice > 0,
            "seed {seed}: {:?}",
            report.stats
        );
    }
}
