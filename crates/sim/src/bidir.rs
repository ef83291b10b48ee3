//! Bidirectional mode under clock skew: how P learns the deadline of D's cached turn.
//!
//! The decisions are the engine's, as the agents run them: D keeps a finished turn's
//! blocks in a [`DecoderHold`] (the fixed TTL, on D's clock) and answers with
//! [`DecoderKvParams`]; P decides with [`plan_pull`] on the next turn's prompt. The
//! deadline reaches P either as
//! - [`DeadlineBasis::ClockOffset`]: the absolute deadline on D's clock, which P converts
//!   with the real [`ClockOffsetEstimator`] (lowest-RTT sample) fed by probes over the
//!   simulated network (asymmetric one-way delays, jitter) at the handshake (worst case
//!   within the rtt/2 error bound); or
//! - [`DeadlineBasis::RelativeTtl`]: the remaining TTL at the moment D sends. The message
//!   ages in flight by its one-way delay, which P cannot know; P, holding the params until
//!   the next turn, ages them ([`DecoderKvParams::aged_by`]) by its own elapsed time since
//!   receipt and, conservatively, by the **whole** lowest probe round trip as the flight
//!   time ([`FlightAllowance::FullRtt`], the default: the one-way delay of a message on the
//!   fast path is at most the round trip; jitter above it is for the margin to cover).
//!
//! The next turn arrives at P after a think time drawn around the TTL, so that many
//! decisions fall near the deadline. P pulls when [`plan_pull`] finds that the deadline
//! leaves `margin + pull_time` after now, else recomputes. A pull's request travels to D
//! (one-way delay up + jitter), then reads for `pull_time`. The oracle is D's own hold: at
//! the end of the read D's clock is fed to [`DecoderHold::handle_timeout`]; if the entry is
//! gone the read saw freed blocks (**unsafe**). A decline whose read would have ended with
//! the entry still held is a **needless recompute**. P's reading of the deadline on its
//! clock ([`estimated_deadline`]) is compared with the true one for every decision.
//!
//! Clocks: P local = base + true; D local = base + skew + true × (1 + drift). Everything is
//! drawn from the seed, so the same config gives the same [`BidirReport`].

use std::time::Duration;

use kvlease_engine::{
    DeadlineBasis, DecoderHold, DecoderKvParams, Held, PullDecision, PullPolicy, RecomputeReason,
    block_hashes, estimated_deadline, plan_pull,
};
use kvlease_lease::{
    BlockId, ClockOffset, ClockOffsetEstimator, DecoderTtl, PeerTimestamp, RequestId, Timestamp,
};

use crate::rng::Rng;

/// What P takes off a relative TTL for its unknown time in flight (ages the params by).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlightAllowance {
    /// Nothing (the margin covers the flight; what the agents' proxy does).
    None,
    /// Half the lowest probe RTT (exact only for symmetric paths).
    HalfRtt,
    /// The whole lowest probe RTT (the default: covers any asymmetry on the fast path).
    FullRtt,
}

/// A deliberate bug in P's deadline estimate, to prove that the oracle catches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BidirBug {
    /// Offset basis: P reads D's timestamp as if it were its own clock (a zero offset).
    IgnoreOffset,
    /// Relative basis: P never ages the TTL (neither flight time nor time since receipt).
    UnagedTtl,
}

/// One bidirectional world. The same config gives the same run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BidirConfig {
    /// Seed of every random choice.
    pub seed: u64,
    /// D's clock minus P's clock, in milliseconds (either sign).
    pub skew_ms: i64,
    /// D's clock drift relative to true time, in parts per million (either sign).
    pub drift_ppm: i64,
    /// Smallest one-way delay P → D.
    pub delay_up: Duration,
    /// Smallest one-way delay D → P.
    pub delay_down: Duration,
    /// Extra delay per message, uniform in `0..=jitter`.
    pub jitter: Duration,
    /// `decoder_kv_blocks_ttl`.
    pub ttl: Duration,
    /// `pull_safety_margin`.
    pub margin: Duration,
    /// Time of the pull's read on D (P's expected transfer time, added to the margin).
    pub pull_time: Duration,
    /// Probes of D's clock at the handshake.
    pub probes: u32,
    /// Conversations (each one finished turn and one next turn).
    pub conversations: u32,
    /// The basis P uses.
    pub basis: DeadlineBasis,
    /// With [`DeadlineBasis::RelativeTtl`]: what P subtracts for the flight.
    pub flight: FlightAllowance,
    /// A deliberate bug, for the oracle's own tests.
    pub bug: Option<BidirBug>,
}

impl BidirConfig {
    /// A realistic world: D ±10 s skewed, ±200 ppm drift, delays 0.2–5 ms asymmetric with
    /// up to 10 ms jitter, the default 480 s TTL and 5 s margin, 200 ms pulls, all drawn
    /// from `seed`.
    pub fn realistic(seed: u64, basis: DeadlineBasis) -> Self {
        let mut rng = Rng::new(seed ^ 0xb1d1_77e1);
        let skew_ms = rng.range(0, 20_000) as i64 - 10_000;
        let drift_ppm = rng.range(0, 400) as i64 - 200;
        Self {
            seed,
            skew_ms,
            drift_ppm,
            delay_up: Duration::from_micros(rng.range(200, 5_000)),
            delay_down: Duration::from_micros(rng.range(200, 5_000)),
            jitter: Duration::from_micros(rng.range(0, 10_000)),
            ttl: Duration::from_secs(480),
            margin: Duration::from_secs(5),
            pull_time: Duration::from_millis(200),
            probes: 8,
            conversations: 200,
            basis,
            flight: FlightAllowance::FullRtt,
            bug: None,
        }
    }

    /// The same world with `bug` planted.
    pub fn with_bug(mut self, bug: BidirBug) -> Self {
        self.bug = Some(bug);
        self
    }
}

/// The outcome of one bidirectional run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BidirReport {
    /// The seed.
    pub seed: u64,
    /// Decisions taken (one per conversation).
    pub decisions: u64,
    /// Pulls whose read ended after D freed the blocks (the unsafe outcome).
    pub unsafe_pulls: u64,
    /// Pulls that read live blocks.
    pub safe_pulls: u64,
    /// Declines whose read would have ended with the blocks still live.
    pub needless_recomputes: u64,
    /// Declines of blocks that would indeed have been freed.
    pub needed_recomputes: u64,
    /// Per decision: P's estimated deadline minus the true deadline, both on P's clock, in
    /// nanoseconds (positive = P thinks it has more time than it has: the dangerous side).
    pub deadline_errors_ns: Vec<i64>,
    /// Every broken rule with its conversation (only unsafe pulls are failures).
    pub failures: Vec<String>,
}

/// A clock: local = base + offset + true × (1 + drift), in nanoseconds.
#[derive(Debug, Clone, Copy)]
struct Clock {
    offset_ns: i128,
    drift_ppm: i128,
}

/// Every clock starts this far from zero so that a negative skew stays representable.
const BASE_NS: i128 = 1_000_000_000_000;

impl Clock {
    fn local_ns(&self, true_ns: u64) -> i128 {
        let t = i128::from(true_ns);
        BASE_NS + self.offset_ns + t + t * self.drift_ppm / 1_000_000
    }

    fn local(&self, true_ns: u64) -> Timestamp {
        Timestamp::from_nanos(u64::try_from(self.local_ns(true_ns).max(0)).unwrap_or(u64::MAX))
    }

    /// The first true time at which the local clock reads at least `local_ns`.
    fn true_at(&self, local_ns: i128) -> u64 {
        let want = local_ns - BASE_NS - self.offset_ns;
        let scale = 1_000_000 + self.drift_ppm;
        // Start from the rounded inverse and step to the first true time that reaches it.
        let mut t = (want * 1_000_000 / scale).max(0);
        while t > 0 && self.local_ns(t as u64 - 1) >= local_ns {
            t -= 1;
        }
        while self.local_ns(t as u64) < local_ns {
            t += 1;
        }
        u64::try_from(t).unwrap_or(u64::MAX)
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

fn signed_ns(t: Timestamp) -> i128 {
    i128::from(t.as_nanos_saturating())
}

/// Tokens per block, of D and P alike.
const BLOCK_SIZE: u32 = 16;

/// The tokens of conversation `conv`'s finished turn: one whole block.
fn turn_tokens(conv: u32) -> Vec<u32> {
    (0..BLOCK_SIZE).map(|i| conv.wrapping_mul(31) + i).collect()
}

/// D's answer for a turn of `tokens` kept as `held` in `block` at `d_now` (D's clock), as
/// the decode agent builds it.
fn d_answer(
    request: &RequestId,
    tokens: &[u32],
    block: BlockId,
    held: Held,
    d_now: Timestamp,
) -> DecoderKvParams {
    DecoderKvParams {
        kvlease_bidir: true,
        remote_engine_id: "d".into(),
        remote_host: "d".into(),
        remote_port: 1,
        kvlease_clock_port: 2,
        remote_block_ids: vec![block.0],
        remote_request_id: request.to_string(),
        tp_size: 1,
        kvlease_generation: held.generation.word(),
        conversation_id: request.to_string(),
        kvlease_num_tokens: tokens.len() as u32,
        kvlease_block_size: BLOCK_SIZE,
        kvlease_block_hashes: block_hashes(tokens, BLOCK_SIZE)
            .iter()
            .map(|h| format!("{h:016x}"))
            .collect(),
        kvlease_deadline_ns: held.deadline.as_nanos_saturating(),
        kvlease_ttl_remaining: held.deadline.saturating_duration_since(d_now),
        kvlease_renew_extension_ms: 0,
    }
}

/// Runs one bidirectional world.
pub fn run_bidir(config: &BidirConfig) -> BidirReport {
    let mut rng = Rng::new(config.seed);
    let mut report = BidirReport {
        seed: config.seed,
        ..BidirReport::default()
    };
    let Ok(ttl) = DecoderTtl::from_duration(config.ttl) else {
        report
            .failures
            .push(format!("TTL {:?} out of range", config.ttl));
        return report;
    };
    let mut world = BidirWorld {
        config,
        p_clock: Clock {
            offset_ns: 0,
            drift_ppm: 0,
        },
        d_clock: Clock {
            offset_ns: i128::from(config.skew_ms) * 1_000_000,
            drift_ppm: i128::from(config.drift_ppm.clamp(-100_000, 100_000)),
        },
        ttl,
        rng: &mut rng,
        now: 1_000_000_000,
        report,
    };
    let Some(offset) = world.probe_offset() else {
        world.report.failures.push("no clock sample".into());
        return world.report;
    };
    let rtt = offset.rtt();
    let p = PView {
        policy: PullPolicy {
            threshold_tokens: BLOCK_SIZE,
            safety_margin: config.margin,
            basis: config.basis,
        },
        // The planted bug: a zero offset, as if D's clock were P's.
        offset: match config.bug {
            Some(BidirBug::IgnoreOffset) => ClockOffset::from_nanos(0),
            _ => offset,
        },
        allowance: match config.flight {
            FlightAllowance::None => Duration::ZERO,
            FlightAllowance::HalfRtt => rtt / 2,
            FlightAllowance::FullRtt => rtt,
        },
    };
    for conv in 0..config.conversations {
        world.conversation(&p, conv);
    }
    world.report
}

/// One run in progress: the config, both clocks, the true time and the report so far.
struct BidirWorld<'a> {
    config: &'a BidirConfig,
    p_clock: Clock,
    d_clock: Clock,
    ttl: DecoderTtl,
    rng: &'a mut Rng,
    /// True time, in nanoseconds.
    now: u64,
    report: BidirReport,
}

/// P's side of the run, fixed at the handshake: its policy, its reading of D's clock and
/// what it subtracts for the flight of D's answer.
struct PView {
    policy: PullPolicy,
    offset: ClockOffset,
    allowance: Duration,
}

impl BidirWorld<'_> {
    /// One message's flight P → D.
    fn up(&mut self) -> u64 {
        nanos(self.config.delay_up) + self.rng.range(0, nanos(self.config.jitter))
    }

    /// One message's flight D → P.
    fn down(&mut self) -> u64 {
        nanos(self.config.delay_down) + self.rng.range(0, nanos(self.config.jitter))
    }

    /// The handshake: probes 10 ms apart, each (t0, D's clock on arrival, t1); P's
    /// estimate of D's clock, if any sample was taken.
    fn probe_offset(&mut self) -> Option<ClockOffset> {
        let mut est = ClockOffsetEstimator::new();
        for _ in 0..self.config.probes.max(1) {
            let t0 = self.now;
            let at_d = t0 + self.up();
            let t1 = at_d + self.down();
            let remote = PeerTimestamp::from_nanos(self.d_clock.local(at_d).as_nanos_saturating());
            // t1 > t0 always (delays are non-negative), so the sample is accepted or ignored.
            let _ = est.add_sample(self.p_clock.local(t0), remote, self.p_clock.local(t1));
            self.now = t1 + 10_000_000;
        }
        est.offset()
    }

    /// One conversation: D finishes a turn and holds its blocks, P decides on the next
    /// turn, and the oracle checks the decision against D's hold at the read's end.
    fn conversation(&mut self, p: &PView, conv: u32) {
        let config = self.config;
        // D finishes a turn and holds its blocks, then answers P with the deadline.
        self.now += self.rng.range(0, 2_000_000_000);
        let finish = self.now;
        let mut hold = DecoderHold::new(self.ttl, false);
        let Ok(request) = RequestId::new(&format!("conv-{conv}")) else {
            self.report
                .failures
                .push(format!("conv {conv}: bad request id"));
            return;
        };
        let d_now = self.d_clock.local(finish);
        let turn = turn_tokens(conv);
        let Ok(held) = hold.insert(d_now, request.clone(), vec![BlockId(conv)]) else {
            self.report
                .failures
                .push(format!("conv {conv}: insert failed"));
            return;
        };
        let answer = d_answer(&request, &turn, BlockId(conv), held, d_now);
        if let Err(e) = answer.check() {
            self.report
                .failures
                .push(format!("conv {conv}: D's params: {e}"));
        }
        let received = finish + self.down();
        let p_received = self.p_clock.local(received);

        // The next turn (the finished one and more) arrives after a think time around the
        // TTL.
        let ttl_ns = nanos(config.ttl);
        let think = self.rng.range(
            ttl_ns.saturating_sub(20_000_000_000),
            ttl_ns + 5_000_000_000,
        );
        let decide = received + think;
        let p_now = self.p_clock.local(decide);
        let mut prompt = turn;
        prompt.extend(0..BLOCK_SIZE / 2);

        // What P holds at the decision, and its reading of the deadline: the relative TTL
        // is read on arrival (less the flight allowance) and aged until the decision.
        let (estimate, seen) = match (config.basis, config.bug) {
            (DeadlineBasis::RelativeTtl, Some(BidirBug::UnagedTtl)) => (
                estimated_deadline(config.basis, &answer, p_now, None),
                answer,
            ),
            (DeadlineBasis::RelativeTtl, _) => {
                let arrived = answer.aged_by(p.allowance);
                (
                    estimated_deadline(config.basis, &arrived, p_received, None),
                    arrived.aged_by(p_now.saturating_duration_since(p_received)),
                )
            }
            (DeadlineBasis::ClockOffset, _) => (
                estimated_deadline(config.basis, &answer, p_now, Some(p.offset)),
                answer,
            ),
        };
        let Some(estimate) = estimate else {
            self.report
                .failures
                .push(format!("conv {conv}: no deadline estimate"));
            return;
        };
        let decision = plan_pull(
            &p.policy,
            &seen,
            &prompt,
            BLOCK_SIZE,
            p_now,
            Some(p.offset),
            config.pull_time,
        );
        let pull = self.pulls(conv, decision);

        // The oracle: the true deadline on P's clock, and D's hold at the read's end.
        let free_true = self.d_clock.true_at(signed_ns(held.deadline));
        let true_deadline_p = self.p_clock.local_ns(free_true);
        let err = signed_ns(estimate) - true_deadline_p;
        self.report
            .deadline_errors_ns
            .push(i64::try_from(err).unwrap_or(i64::MAX));
        let read_end = decide + self.up() + nanos(config.pull_time);
        hold.handle_timeout(self.d_clock.local(read_end));
        let live = hold.deadline(&request).is_some();
        let report = &mut self.report;
        report.decisions += 1;
        match (pull, live) {
            (true, true) => report.safe_pulls += 1,
            (true, false) => {
                report.unsafe_pulls += 1;
                if report.failures.len() < 20 {
                    report.failures.push(format!(
                        "conv {conv}: pull read freed blocks: read ended {:.3} s after D freed \
                         them (estimate error {:+.3} s)",
                        read_end.saturating_sub(free_true) as f64 / 1e9,
                        err as f64 / 1e9
                    ));
                }
            }
            (false, true) => report.needless_recomputes += 1,
            (false, false) => report.needed_recomputes += 1,
        }
    }

    /// Whether P's `decision` pulls; a pull of anything but D's block, or a recompute for
    /// any reason but the deadline, is a failure.
    fn pulls(&mut self, conv: u32, decision: PullDecision) -> bool {
        match decision {
            PullDecision::Pull { blocks, .. } => {
                if blocks != [BlockId(conv)] {
                    self.report
                        .failures
                        .push(format!("conv {conv}: pull of {blocks:?}, D holds {conv}"));
                }
                true
            }
            PullDecision::Recompute(RecomputeReason::DeadlineTooClose) => false,
            PullDecision::Recompute(other) => {
                self.report
                    .failures
                    .push(format!("conv {conv}: recompute for {other:?}"));
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_inverse_is_the_first_true_time() {
        for drift in [-200, 0, 200] {
            let c = Clock {
                offset_ns: -10_000_000_000,
                drift_ppm: drift,
            };
            let target = c.local_ns(123_456_789_012);
            let t = c.true_at(target);
            assert!(c.local_ns(t) >= target);
            assert!(c.local_ns(t - 1) < target);
        }
    }
}
