//! Bidirectional multi-turn mode in the main world ([`WorldConfig::bidir`]): D holds
//! finished turns, P pulls or recomputes the next turn's shared prefix, under every fault
//! of the random worlds; the hold and pull oracles find nothing, every outcome of a hold
//! occurs, and planted bugs are caught.

use std::io::Write as _;

use std::time::Duration;

use kvlease_sim::{Bug, Crash, Report, World, WorldConfig, run, seeds_from_env};

fn total(reports: &[Report], f: impl Fn(&Report) -> u64) -> u64 {
    reports.iter().map(f).sum()
}

/// The command that replays `seed` in `test` of this file.
fn repro(seed: u64, test: &str) -> String {
    format!(
        "KVLEASE_SIM_SEED={seed} cargo test -p kvlease-sim --test bidir_world {test} -- --exact --nocapture"
    )
}

#[test]
fn bidir_seeds() {
    let mut reports = Vec::new();
    let mut failed = String::new();
    for seed in seeds_from_env(64) {
        let report = run(WorldConfig::bidir(seed));
        if !report.failures.is_empty() {
            failed += &format!(
                "seed {seed} failed:\n  {}\n  stats: {:?}\n  reproduce: {}\n",
                report.failures.join("\n  "),
                report.stats,
                repro(seed, "bidir_seeds")
            );
        }
        reports.push(report);
    }
    assert!(failed.is_empty(), "{failed}");
    let counts = [
        ("turns", total(&reports, |r| r.stats.turns)),
        ("holds", total(&reports, |r| r.stats.holds)),
        ("pulls", total(&reports, |r| r.stats.pulls)),
        ("pulls_stale", total(&reports, |r| r.stats.pulls_stale)),
        (
            "pulls_stale_expired",
            total(&reports, |r| r.stats.pulls_stale_expired),
        ),
        (
            "pulls_stale_restarted",
            total(&reports, |r| r.stats.pulls_stale_restarted),
        ),
        ("pulls_failed", total(&reports, |r| r.stats.pulls_failed)),
        (
            "turns_recomputed",
            total(&reports, |r| r.stats.turns_recomputed),
        ),
        ("holds_pulled", total(&reports, |r| r.stats.holds_pulled)),
        ("holds_expired", total(&reports, |r| r.stats.holds_expired)),
        ("holds_evicted", total(&reports, |r| r.stats.holds_evicted)),
        (
            "holds_lost_with_d",
            total(&reports, |r| r.stats.holds_lost_with_d),
        ),
        (
            "cache_heartbeats",
            total(&reports, |r| r.stats.cache_heartbeats),
        ),
        (
            "cache_heartbeats_extended",
            total(&reports, |r| r.stats.cache_heartbeats_extended),
        ),
    ];
    if std::env::var_os("KVLEASE_SIM_SEEDS").is_some() {
        let mut line = format!("bidir: seeds={}", reports.len());
        for (name, count) in counts {
            line += &format!(" {name}={count}");
        }
        // Past the test harness's capture, so that CI logs show it.
        let _ = writeln!(std::io::stdout().lock(), "{line}");
    }
    assert_eq!(
        total(&reports, |r| r.stats.arrived + r.stats.turns),
        total(&reports, |r| r.stats.outcomes_ok)
    );
    // Every outcome of a next turn and of a hold occurred (over all seeds together). A
    // failed pull (D crashed or cut off during the read) is too rare to ask for.
    if reports.len() >= 32 {
        for (name, count) in counts
            .iter()
            .filter(|(n, _)| !matches!(*n, "pulls_failed" | "pulls_stale_expired"))
        {
            assert!(*count > 0, "{name}: never in {} seeds", reports.len());
        }
        // Under the faults it claims.
        let faults = [
            ("messages_lost", total(&reports, |r| r.stats.messages_lost)),
            (
                "messages_duplicated",
                total(&reports, |r| r.stats.messages_duplicated),
            ),
            ("stalls", total(&reports, |r| r.stats.stalls)),
            ("lost_with_p", total(&reports, |r| r.stats.lost_with_p)),
            ("d_restarts", total(&reports, |r| r.stats.d_restarts)),
        ];
        for (name, count) in faults {
            assert!(count > 0, "{name}: never in {} seeds", reports.len());
        }
    }
}

/// Runs `bug` planted in the bidirectional worlds of `seeds`; returns every failure.
fn planted(bug: Bug, seeds: std::ops::Range<u64>) -> Vec<String> {
    seeds
        .flat_map(|seed| run(WorldConfig::bidir(seed).with_bug(bug)).failures)
        .collect()
}

/// A pull that ignores D's fence word reads blocks D freed (poisoned) or gave to another
/// request: the pull oracle sees both the unmatched fence and the wrong KV.
#[test]
fn planted_pull_ignoring_the_fence_is_caught() {
    let failures = planted(Bug::PullIgnoresFence, 0..16);
    assert!(
        failures
            .iter()
            .any(|f| f.contains("pulled from a read whose fence did not match")),
        "{failures:?}"
    );
    assert!(
        failures.iter().any(|f| f.contains("wrong turn KV")),
        "{failures:?}"
    );
}

/// A D that does not free a cached turn when P reports its read keeps it to the TTL: the
/// hold oracle sees it still held after the read completion.
#[test]
fn planted_hold_kept_after_read_is_caught() {
    let failures = planted(Bug::KeepHoldAfterRead, 0..8);
    assert!(
        failures
            .iter()
            .any(|f| f.contains("still held after P's read completion")),
        "{failures:?}"
    );
}

/// A D that never expires its cached turns keeps them past the TTL: the hold oracle sees
/// them held past their deadline.
#[test]
fn planted_missing_expiry_is_caught() {
    let failures = planted(Bug::NoHoldExpiry, 0..4);
    assert!(
        failures
            .iter()
            .any(|f| f.contains("held past its deadline")),
        "{failures:?}"
    );
}

/// A D that frees a cached turn's blocks without the free word first lets a later pull
/// match its fence on blocks another request overwrote: the pull oracle sees the wrong KV.
#[test]
fn planted_hold_fence_not_cleared_is_caught() {
    let failures = planted(Bug::SkipHoldFenceClear, 0..16);
    assert!(
        failures.iter().any(|f| f.contains("wrong turn KV")),
        "{failures:?}"
    );
}

/// The same seed gives the same full trace in bidirectional mode too.
#[test]
fn bidir_same_seed_same_log() {
    for seed in 0..8 {
        let a = World::new(WorldConfig::bidir(seed)).record_log().run();
        let b = World::new(WorldConfig::bidir(seed)).record_log().run();
        assert!(a.failures.is_empty(), "seed {seed}: {:?}", a.failures);
        assert!(a.log.iter().any(|l| l.contains(" plan_pull ")));
        assert_eq!(a.log, b.log, "seed {seed}");
        assert_eq!(a.trace_hash, b.trace_hash);
    }
}

/// A bidirectional world of `seed` with one D that crashes three times and comes back
/// 200 ms later, so that next turns wait on P with the params of an earlier incarnation
/// while the new one holds turns on the same blocks.
fn restarting_d(seed: u64) -> WorldConfig {
    let mut c = WorldConfig::bidir(seed);
    c.d_engines = 1;
    c.partitions.retain(|p| p.d == 0);
    c.d_stalls.retain(|s| s.engine == 0);
    let span = c.arrival_gap * u32::try_from(c.requests).unwrap_or(u32::MAX);
    c.d_crashes = (1..=3)
        .map(|k| Crash {
            engine: 0,
            at: span * k / 4,
            restart_after: Some(Duration::from_millis(200)),
        })
        .collect();
    c
}

/// After a D restart P pulls with the params of the earlier incarnation from the D running
/// now (its handshake of the old one dropped with the failed read): the new incarnation's
/// generations start above the old one's, so the fence refuses every such pull (stale),
/// and none reads another turn's KV.
#[test]
fn pulls_with_an_earlier_d_incarnations_params_are_stale() {
    let (mut stale, mut restarts) = (0, 0);
    for seed in seeds_from_env(64) {
        let report = run(restarting_d(seed));
        assert!(
            report.failures.is_empty(),
            "seed {seed}: {:?}",
            report.failures
        );
        stale += report.stats.pulls_stale_restarted;
        restarts += report.stats.d_restarts;
    }
    if std::env::var_os("KVLEASE_SIM_SEEDS").is_some() {
        let line =
            format!("bidir restarting D: d_restarts={restarts} pulls_stale_restarted={stale}");
        let _ = writeln!(std::io::stdout().lock(), "{line}");
    }
    assert!(stale > 0, "no pull with an earlier incarnation's params");
}

/// A D that restarts with the hold generations of its first incarnation lets P's pull
/// with the earlier incarnation's params match a turn held now on the same blocks: the
/// pull oracle sees another conversation's KV.
#[test]
fn planted_hold_generations_repeating_across_d_restarts_is_caught() {
    let failures: Vec<String> = (0..64)
        .flat_map(|seed| run(restarting_d(seed).with_bug(Bug::HoldGenerationsRepeat)).failures)
        .collect();
    assert!(
        failures.iter().any(|f| f.contains("wrong turn KV")),
        "{failures:?}"
    );
}
