//! The simulation suite: the seed sweep, named scenarios, the determinism check, and tests
//! that plant a bug and assert that the checker catches it.

use std::io::Write as _;
use std::time::Duration;

use kvlease_lease::LeaseConfig;

use kvlease_sim::{
    Bug, PushReport, PushWorldConfig, Report, World, WorldConfig, repro_command, run, run_push,
    scenario_seeds, seeds_from_env,
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

// ------------------------------------------------------------------- push mode

fn push_sweep(
    test: &str,
    seeds: Vec<u64>,
    make: impl Fn(u64) -> PushWorldConfig,
) -> Vec<PushReport> {
    let mut failed = String::new();
    let mut reports = Vec::new();
    for seed in seeds {
        let report = run_push(make(seed));
        if !report.failures.is_empty() {
            failed += &format!(
                "seed {seed} failed:\n  {}\n  reproduce: {}\n",
                report
                    .failures
                    .iter()
                    .take(10)
                    .cloned()
                    .collect::<Vec<_>>()
                    .join("\n  "),
                repro_command(seed, test)
            );
        }
        reports.push(report);
    }
    assert!(failed.is_empty(), "{failed}");
    reports
}

/// Push mode under every fault: no write lands in blocks not held for it, written KV is
/// right, every reservation and push ends once, a dead P's reservations go within about
/// a lease.
#[test]
fn push_seeds() {
    let reports = push_sweep("push_seeds", seeds_from_env(64), PushWorldConfig::random);
    let sum = |f: fn(&PushReport) -> u64| reports.iter().map(f).sum::<u64>();
    let line = format!(
        "push: seeds={} written={} aborted={} expired={} failed={} refused_writes={} failed_posts={} lost_with_p={} max_dead_p_reclaim_ms={}",
        reports.len(),
        sum(|r| r.written),
        sum(|r| r.aborted),
        sum(|r| r.expired),
        sum(|r| r.failed),
        sum(|r| r.refused_writes),
        sum(|r| r.failed_posts),
        sum(|r| r.lost_with_p),
        reports
            .iter()
            .map(|r| r.dead_p_reclaim.as_millis())
            .max()
            .unwrap_or(0),
    );
    if std::env::var_os("KVLEASE_SIM_SEEDS").is_some() {
        let _ = writeln!(std::io::stdout().lock(), "{line}");
    }
    if reports.len() >= 16 {
        // Every outcome and fault occurred somewhere.
        for (name, n) in [
            ("written", sum(|r| r.written)),
            ("aborted", sum(|r| r.aborted)),
            ("expired", sum(|r| r.expired)),
            ("failed", sum(|r| r.failed)),
            ("refused_writes", sum(|r| r.refused_writes)),
            ("failed_posts", sum(|r| r.failed_posts)),
            ("lost_with_p", sum(|r| r.lost_with_p)),
        ] {
            assert!(n > 0, "no {name} in {line}");
        }
    }
}

/// A P that dies mid-prefill: D frees its reservations within one lease (plus a delay
/// and a step) of the death, never earlier than the last heartbeat's extension.
#[test]
fn push_dead_prefill_is_reclaimed_within_a_lease() {
    let reports = push_sweep(
        "push_dead_prefill_is_reclaimed_within_a_lease",
        scenario_seeds(8),
        |seed| PushWorldConfig {
            p_death: Some(Duration::from_secs(3)),
            p_stall: None,
            ..PushWorldConfig::random(seed)
        },
    );
    for r in &reports {
        assert!(r.lost_with_p > 0, "seed {}: P died with no push", r.seed);
        // One lease (1.2 s), a message's delay (at most 6 ms) and a step (10 ms).
        assert!(
            r.dead_p_reclaim <= Duration::from_millis(1200 + 6 + 10),
            "seed {}: {:?}",
            r.seed,
            r.dead_p_reclaim
        );
    }
}

/// No fault at all: every reservation is written, none expires (P's heartbeats name the
/// transfer ids D reserved under, so they renew every reservation however long the
/// prefill).
#[test]
fn push_without_faults_writes_everything() {
    let reports = push_sweep(
        "push_without_faults_writes_everything",
        scenario_seeds(8),
        |seed| PushWorldConfig {
            loss_ppm: 0,
            dup_ppm: 0,
            write_fail_ppm: 0,
            abort_ppm: 0,
            p_death: None,
            p_stall: None,
            ..PushWorldConfig::random(seed)
        },
    );
    for r in &reports {
        assert_eq!(
            (r.expired, r.failed, r.aborted, r.refused_writes),
            (0, 0, 0, 0),
            "seed {}",
            r.seed
        );
        assert_eq!(r.written + r.refused_at_d, 120, "seed {}", r.seed);
    }
}

/// A P that stalls for two and a half leases: D's reservations for it expire and go to
/// other requests meanwhile; when P resumes, its late writes meet the fence (refused) or
/// D's release (never posted), and no byte lands in another request's blocks.
#[test]
fn push_stalled_prefill_never_writes_into_reused_blocks() {
    let reports = push_sweep(
        "push_stalled_prefill_never_writes_into_reused_blocks",
        scenario_seeds(8),
        |seed| PushWorldConfig {
            p_death: None,
            p_stall: Some((Duration::from_secs(2), Duration::from_secs(3))),
            ..PushWorldConfig::random(seed)
        },
    );
    for r in &reports {
        assert!(
            r.expired > 0,
            "seed {}: nothing expired during the stall",
            r.seed
        );
    }
}

#[test]
fn push_same_seed_same_log() {
    for seed in scenario_seeds(4) {
        let a = run_push(PushWorldConfig::random(seed));
        let b = run_push(PushWorldConfig::random(seed));
        assert!(a.log.len() > 100, "seed {seed}: a short log");
        if let Some(i) = (0..a.log.len().max(b.log.len())).find(|&i| a.log.get(i) != b.log.get(i)) {
            panic!(
                "seed {seed}: logs differ at line {i}:\n  {:?}\n  {:?}",
                a.log.get(i),
                b.log.get(i)
            );
        }
        assert_eq!(a, b);
    }
}
