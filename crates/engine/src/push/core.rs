//! P's side of push mode: which registrations P holds, when it writes, and who is told.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::Duration;

use kvlease_lease::{
    BlockId, EngineId, Generation, HeartbeatBatch, HeartbeatTracker, LeaseConfig, RequestId,
    Timestamp,
};

use kvlease_notif::{PromptDigest, PushNotice, ReservationRef};

use super::Reservation;

/// How to build a [`PushCore`].
#[derive(Debug, Clone)]
pub struct PushConfig {
    /// P's heartbeat terms: one batch per D engine every `lease.interval()`.
    pub lease: LeaseConfig,
    /// How long a push whose prefill is done waits for D's registration, and how long a
    /// registration waits for P's leg, before giving up.
    pub registration_wait: Duration,
    /// How long an ended push's transfer id is remembered, so that a late or duplicated
    /// registration for it is refused instead of starting a write.
    pub remember_ended: Duration,
}

impl PushConfig {
    /// Heartbeats on `lease`'s interval; registrations wait one lease duration; ended
    /// transfers are remembered for two.
    pub fn new(lease: LeaseConfig) -> Self {
        Self {
            registration_wait: lease.duration(),
            remember_ended: lease.duration().saturating_mul(2),
            lease,
        }
    }
}

/// Why a command was refused. Nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PushError {
    /// P's leg of this transfer was admitted already.
    #[error("transfer {transfer} is admitted already")]
    Duplicate {
        /// The transfer.
        transfer: RequestId,
    },
    /// The transfer is not being pushed: never admitted, or its push ended (retired,
    /// written, failed, or D's reservation is gone). The caller frees its blocks itself;
    /// nothing is written.
    #[error("transfer {transfer} is not being pushed")]
    NotPushing {
        /// The transfer.
        transfer: RequestId,
    },
    /// The prefill of this transfer was reported done already.
    #[error("transfer {transfer}'s prefill was reported done already")]
    AlreadyDone {
        /// The transfer.
        transfer: RequestId,
    },
}

/// What [`PushCore::handle_registration`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegistrationOutcome {
    /// Recorded (and, when P's prefill is done, the write was planned).
    Accepted,
    /// The same registration again: nothing changed.
    Duplicate,
    /// The transfer already holds another registration (another engine or generation):
    /// ignored.
    Conflict,
    /// The transfer's push ended: ignored, nothing is written.
    Ended,
    /// The reservation's lease is too short for P's heartbeat interval (P could not keep
    /// it): P answered with a push-failed, so that D frees the blocks at once.
    LeaseTooShort,
    /// P's leg and the registration carry different prompt digests: the transfer id
    /// matched another request's leg. P answered with a push-failed and writes nothing;
    /// the leg keeps waiting for a matching registration.
    PromptMismatch,
}

impl RegistrationOutcome {
    /// The outcome's name in metrics and logs: `accepted`, `duplicate`, `conflict`,
    /// `ended`, `lease_too_short`, `prompt_mismatch`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Accepted => "accepted",
            Self::Duplicate => "duplicate",
            Self::Conflict => "conflict",
            Self::Ended => "ended",
            Self::LeaseTooShort => "lease_too_short",
            Self::PromptMismatch => "prompt_mismatch",
        }
    }
}

/// How a push ended on P.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PushOutcome {
    /// The write completed and D was told (write-done).
    Written,
    /// The write could not be posted or failed; D was told (push-failed).
    WriteFailed,
    /// D reported the reservation released (aborted or expired there); nothing more is
    /// written.
    ReservationGone,
    /// The request retired on P (aborted, or finished without pushing) before its write;
    /// D was told (push-failed) if it had registered.
    Retired,
    /// P's prefill ended but no registration came within
    /// [`PushConfig::registration_wait`]; P freed its blocks.
    NoRegistration,
    /// D's registration named a lease P cannot keep; D was told (push-failed).
    LeaseTooShort,
}

impl PushOutcome {
    /// The outcome's name in metrics and logs: `written`, `write_failed`,
    /// `reservation_gone`, `retired`, `no_registration`, `lease_too_short`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Written => "written",
            Self::WriteFailed => "write_failed",
            Self::ReservationGone => "reservation_gone",
            Self::Retired => "retired",
            Self::NoRegistration => "no_registration",
            Self::LeaseTooShort => "lease_too_short",
        }
    }
}

/// A push ended: P's blocks are free for the shell to reuse.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushEnded {
    /// The transfer.
    pub transfer: RequestId,
    /// P's own id of the request.
    pub request: RequestId,
    /// The D engine that registered, if one did.
    pub decode: Option<EngineId>,
    /// P's blocks of the request (empty when its prefill never finished).
    pub blocks: Vec<BlockId>,
    /// How it ended.
    pub outcome: PushOutcome,
}

/// A write to post: P's blocks into D's, one pair per block, under D's generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WritePlan {
    /// The transfer.
    pub transfer: RequestId,
    /// The D engine to write into.
    pub decode: EngineId,
    /// D's reservation generation; the receiver refuses the write under any other.
    pub generation: Generation,
    /// `(P's block, D's block)` pairs, in token order ([`write_pairs`]).
    pub pairs: Vec<(BlockId, BlockId)>,
}

/// A message from P to a D engine about a reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PushMessage {
    /// The write of the reservation's generation completed.
    WriteDone {
        /// The transfer.
        transfer: RequestId,
        /// The reservation's generation.
        generation: Generation,
    },
    /// P will not write this reservation: free it and recompute.
    PushFailed {
        /// The transfer.
        transfer: RequestId,
        /// The reservation's generation.
        generation: Generation,
    },
}

impl PushMessage {
    /// The message's frame for D (`KVL1:WD:` / `KVL1:PF:` transfer id and generation).
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let (notice, transfer, generation) = match self {
            Self::WriteDone {
                transfer,
                generation,
            } => (PushNotice::WriteDone, transfer, generation),
            Self::PushFailed {
                transfer,
                generation,
            } => (PushNotice::PushFailed, transfer, generation),
        };
        ReservationRef {
            transfer: transfer.clone(),
            generation: *generation,
        }
        .encode(notice)
    }
}

/// What the shell does, drained with [`PushCore::poll_action`] in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PushAction {
    /// Post this write; report its result with [`PushCore::handle_write_result`].
    Write(WritePlan),
    /// Send `message` to D engine `to`.
    Send {
        /// The D engine.
        to: EngineId,
        /// The message.
        message: PushMessage,
    },
    /// A push ended; free its blocks.
    Ended(PushEnded),
}

/// Counters since the core was created. All are monotonic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PushStats {
    /// Pushes admitted.
    pub admitted: u64,
    /// Registrations accepted.
    pub registrations: u64,
    /// Registrations not accepted when they arrived: duplicates, conflicts, for ended
    /// pushes, leases too short, prompt mismatches with the leg held.
    pub registrations_ignored: u64,
    /// Registrations that waited for P's leg longer than the wait and were dropped.
    pub registrations_dropped: u64,
    /// Writes planned.
    pub writes: u64,
    /// Pushes ended, by any outcome.
    pub ended: u64,
    /// Reservation-released messages that named no registration P holds.
    pub releases_ignored: u64,
    /// Registrations refused because their prompt digest differs from P's leg's, in
    /// either order: refused on arrival ([`RegistrationOutcome::PromptMismatch`], also
    /// counted in `registrations_ignored`) or, held while waiting for the leg, dropped
    /// when the leg came (counted in `registrations` when it arrived). D was told
    /// (push-failed) each time.
    pub prompt_mismatches: u64,
}

/// Where a push is.
#[derive(Debug)]
struct Push {
    /// P's request id; `None` while only D's registration has arrived.
    request: Option<RequestId>,
    /// The digest of P's prompt, when P's leg carries one.
    prompt: Option<PromptDigest>,
    registration: Option<Registered>,
    /// P's blocks, once its prefill is done.
    blocks: Option<Vec<BlockId>>,
    /// The generation of the write in flight, if one was posted.
    writing: Option<Generation>,
    /// D reported the reservation released while a write was in flight.
    gone: bool,
    /// The request retired while a write was in flight.
    retired: bool,
    /// When the push (or the lone registration) gives up waiting, in ns; 0 when not waiting.
    deadline: u64,
}

#[derive(Debug, Clone)]
struct Registered {
    decode: EngineId,
    generation: Generation,
    blocks: Vec<BlockId>,
    prompt: Option<PromptDigest>,
}

/// Whether two prompt digests tell different prompts apart: both are there and differ.
/// Without a digest on either side nothing is checked.
fn prompts_differ(leg: Option<PromptDigest>, registration: Option<PromptDigest>) -> bool {
    matches!((leg, registration), (Some(a), Some(b)) if a != b)
}

/// The pairs P writes: P's `prefill` blocks hold the whole prompt, D's `decode` blocks are
/// the **last** blocks of it (D registers only the blocks its prefix cache lacks), so the
/// two lists line up at their ends. `None` when D asks for more blocks than P has.
///
/// Pairing from the start instead would write P's prefix into D's suffix slots.
pub fn write_pairs(prefill: &[BlockId], decode: &[BlockId]) -> Option<Vec<(BlockId, BlockId)>> {
    //= docs/spec.md#push-mode
    //# D's blocks are the last blocks of the prompt: P pairs them with its own from the end
    let skip = prefill.len().checked_sub(decode.len())?;
    Some(
        prefill[skip..]
            .iter()
            .copied()
            .zip(decode.iter().copied())
            .collect(),
    )
}

/// P's push-mode core.
///
/// # Call order
/// In each forward-loop step: `admit` every new push leg; feed D's messages
/// (`handle_registration`, `handle_reservation_released`), the prefills that ended
/// (`handle_prefill_done`), the writes that completed (`handle_write_result`) and the
/// requests that retired (`retire`); `handle_timeout(now)`; then drain `poll_action`
/// (post writes, send messages, free ended pushes' blocks) and `poll_heartbeat(now)`
/// (send each batch to its D engine).
///
/// # Rules
/// - A push writes once: when its prefill is done **and** D's registration is held, and
///   only if the request has not retired and D has not reported the reservation gone.
/// - P heartbeats a registration (one batch per D engine per interval, naming transfer
///   ids) from the moment both its leg and the registration are there until the push
///   ends.
/// - Every admitted push ends exactly once ([`PushAction::Ended`]); D is told by
///   write-done or push-failed unless D itself reported the reservation gone.
/// - When P's leg and D's registration both carry a prompt digest and the two differ,
///   the registration is refused (push-failed to D, nothing written) whichever came
///   first, and the leg keeps waiting for a matching one.
#[derive(Debug)]
pub struct PushCore {
    config: PushConfig,
    pushes: HashMap<RequestId, Push>,
    /// Ended transfers, until when they are remembered (ns).
    ended: HashMap<RequestId, u64>,
    /// Deadlines of waiting pushes and remembered transfers, `(ns, transfer)`.
    timers: BTreeSet<(u64, RequestId)>,
    heartbeats: HeartbeatTracker,
    actions: VecDeque<PushAction>,
    stats: PushStats,
}

impl PushCore {
    /// An idle core.
    pub fn new(config: PushConfig) -> Self {
        Self {
            heartbeats: HeartbeatTracker::new(&config.lease),
            config,
            pushes: HashMap::new(),
            ended: HashMap::new(),
            timers: BTreeSet::new(),
            actions: VecDeque::new(),
            stats: PushStats::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &PushConfig {
        &self.config
    }

    /// The counters.
    pub fn stats(&self) -> PushStats {
        self.stats
    }

    /// Admitted pushes not yet ended.
    pub fn pushing(&self) -> usize {
        self.pushes.values().filter(|p| p.request.is_some()).count()
    }

    /// Whether nothing is pushing, waiting, heartbeated or queued (remembered ended ids
    /// do not count).
    pub fn is_idle(&self) -> bool {
        self.pushes.is_empty() && self.heartbeats.is_empty() && self.actions.is_empty()
    }

    /// Whether `transfer` has a write in flight.
    pub fn is_writing(&self, transfer: &RequestId) -> bool {
        self.pushes
            .get(transfer)
            .is_some_and(|p| p.writing.is_some())
    }

    /// Admits P's leg of `transfer` (P's own id `request`), with a digest of P's prompt
    /// when the shell computed one (`prompt`). A registration that came first and carries
    /// another digest is dropped: D is told (push-failed), and the leg waits for a
    /// matching registration as if none had come.
    ///
    /// # Errors
    /// [`PushError::Duplicate`] when admitted already, [`PushError::NotPushing`] when the
    /// transfer's push ended already.
    pub fn admit(
        &mut self,
        now: Timestamp,
        transfer: RequestId,
        request: RequestId,
        prompt: Option<PromptDigest>,
    ) -> Result<(), PushError> {
        if self.ended.contains_key(&transfer) {
            return Err(PushError::NotPushing { transfer });
        }
        let push = self.pushes.entry(transfer.clone()).or_insert_with(|| Push {
            request: None,
            prompt: None,
            registration: None,
            blocks: None,
            writing: None,
            gone: false,
            retired: false,
            deadline: 0,
        });
        if push.request.is_some() {
            return Err(PushError::Duplicate { transfer });
        }
        push.request = Some(request);
        push.prompt = prompt;
        self.stats.admitted += 1;
        //= docs/spec.md#push-mode
        //# a registration held while it waits for P's leg is dropped when the leg arrives
        //# with another digest
        if let Some(r) = push
            .registration
            .take_if(|r| prompts_differ(prompt, r.prompt))
        {
            self.stats.prompt_mismatches += 1;
            self.actions.push_back(PushAction::Send {
                to: r.decode,
                message: PushMessage::PushFailed {
                    transfer: transfer.clone(),
                    generation: r.generation,
                },
            });
        }
        let registered = push.registration.as_ref().map(|r| r.decode.clone());
        // The lone registration stops waiting for the leg (or, dropped, waits no more);
        // the leg's own wait starts when its prefill ends.
        self.set_deadline(&transfer, None);
        if let Some(decode) = registered {
            self.track(now, &transfer, decode);
        }
        Ok(())
    }

    /// D engine `from` registered `reservation`.
    ///
    /// Refused with a push-failed to `from` ([`RegistrationOutcome::PromptMismatch`]) when
    /// P's leg is admitted with a prompt digest and the registration carries another: the
    /// leg is left as it was.
    pub fn handle_registration(
        &mut self,
        now: Timestamp,
        from: &EngineId,
        reservation: Reservation,
    ) -> RegistrationOutcome {
        let transfer = reservation.transfer.clone();
        if self.ended.contains_key(&transfer) {
            self.stats.registrations_ignored += 1;
            return RegistrationOutcome::Ended;
        }
        let push = self.pushes.get(&transfer);
        let leg_prompt = push.filter(|p| p.request.is_some()).and_then(|p| p.prompt);
        let mismatch = prompts_differ(leg_prompt, reservation.prompt);
        if let Some(r) = push.and_then(|p| p.registration.as_ref()) {
            let same = &r.decode == from && r.generation == reservation.generation;
            // Another reservation for another prompt is refused like any mismatch below
            // (D is told); anything else next to the one held is ignored.
            if !mismatch || same {
                self.stats.registrations_ignored += 1;
                return if same && r.blocks == reservation.blocks && r.prompt == reservation.prompt {
                    RegistrationOutcome::Duplicate
                } else {
                    RegistrationOutcome::Conflict
                };
            }
        }
        // Before the lease check: a registration for another prompt must not end the leg.
        //= docs/spec.md#push-mode
        //# When both P's leg and D's registration carry a prompt digest and the two differ,
        //# P does not accept the registration: it answers push-failed for that
        //# registration's generation at once and writes nothing
        if mismatch {
            self.actions.push_back(PushAction::Send {
                to: from.clone(),
                message: PushMessage::PushFailed {
                    transfer,
                    generation: reservation.generation,
                },
            });
            self.stats.registrations_ignored += 1;
            self.stats.prompt_mismatches += 1;
            return RegistrationOutcome::PromptMismatch;
        }
        //= docs/spec.md#push-mode
        //# P accepts a registration only if its heartbeat interval is at most a sixth of
        //# the reservation's lease
        if self.config.lease.interval() > reservation.lease / 6 {
            self.actions.push_back(PushAction::Send {
                to: from.clone(),
                message: PushMessage::PushFailed {
                    transfer: transfer.clone(),
                    generation: reservation.generation,
                },
            });
            if self
                .pushes
                .get(&transfer)
                .is_some_and(|p| p.request.is_some())
            {
                self.end(now, &transfer, PushOutcome::LeaseTooShort);
            }
            self.stats.registrations_ignored += 1;
            return RegistrationOutcome::LeaseTooShort;
        }
        self.stats.registrations += 1;
        let registered = Registered {
            decode: from.clone(),
            generation: reservation.generation,
            blocks: reservation.blocks,
            prompt: reservation.prompt,
        };
        match self.pushes.get_mut(&transfer) {
            Some(push) => {
                push.registration = Some(registered);
                self.set_deadline(&transfer, None);
                self.track(now, &transfer, from.clone());
                self.maybe_write(now, &transfer);
            }
            None => {
                self.pushes.insert(
                    transfer.clone(),
                    Push {
                        request: None,
                        prompt: None,
                        registration: Some(registered),
                        blocks: None,
                        writing: None,
                        gone: false,
                        retired: false,
                        deadline: 0,
                    },
                );
                let wait = now + self.config.registration_wait;
                self.set_deadline(&transfer, Some(wait));
            }
        }
        RegistrationOutcome::Accepted
    }

    /// P's prefill of `transfer` ended; `blocks` hold the whole prompt's KV in token order.
    /// Plans the write when D's registration is held, else waits for it (at most
    /// [`PushConfig::registration_wait`]).
    ///
    /// # Errors
    /// [`PushError::NotPushing`] when the transfer was never admitted or its push ended
    /// (the request retired, or D's reservation is gone): nothing is written and the
    /// caller frees `blocks`. [`PushError::AlreadyDone`] on a second report.
    pub fn handle_prefill_done(
        &mut self,
        now: Timestamp,
        transfer: &RequestId,
        blocks: Vec<BlockId>,
    ) -> Result<(), PushError> {
        //= docs/spec.md#push-mode
        //# P never writes for a request that retired
        let Some(push) = self
            .pushes
            .get_mut(transfer)
            .filter(|p| p.request.is_some())
        else {
            return Err(PushError::NotPushing {
                transfer: transfer.clone(),
            });
        };
        if push.blocks.is_some() {
            return Err(PushError::AlreadyDone {
                transfer: transfer.clone(),
            });
        }
        push.blocks = Some(blocks);
        if push.registration.is_none() {
            let wait = now + self.config.registration_wait;
            self.set_deadline(transfer, Some(wait));
        }
        self.maybe_write(now, transfer);
        Ok(())
    }

    /// The write of `transfer` under `generation` ended: `ok` when every byte landed, else
    /// it failed to post or complete. Returns whether it named the write in flight.
    pub fn handle_write_result(
        &mut self,
        now: Timestamp,
        transfer: &RequestId,
        generation: Generation,
        ok: bool,
    ) -> bool {
        let Some(push) = self.pushes.get(transfer) else {
            return false;
        };
        if push.writing != Some(generation) {
            return false;
        }
        let decode = push.registration.as_ref().map(|r| r.decode.clone());
        let outcome = if push.gone {
            // D gave the reservation up meanwhile; its fence refused whatever arrived.
            PushOutcome::ReservationGone
        } else if push.retired {
            PushOutcome::Retired
        } else if ok {
            PushOutcome::Written
        } else {
            //= docs/spec.md#push-mode
            //# A write that fails to post is reported to D at once (push-failed)
            PushOutcome::WriteFailed
        };
        if let Some(to) = decode {
            let message = match outcome {
                PushOutcome::Written => Some(PushMessage::WriteDone {
                    transfer: transfer.clone(),
                    generation,
                }),
                PushOutcome::ReservationGone => None,
                _ => Some(PushMessage::PushFailed {
                    transfer: transfer.clone(),
                    generation,
                }),
            };
            if let Some(message) = message {
                self.actions.push_back(PushAction::Send { to, message });
            }
        }
        self.end(now, transfer, outcome);
        true
    }

    /// D engine `from` released its reservation of `transfer` under `generation` (aborted
    /// or expired on D). The push ends without a write; a write in flight ends it when its
    /// result comes. Returns whether it named the registration P holds.
    pub fn handle_reservation_released(
        &mut self,
        now: Timestamp,
        from: &EngineId,
        transfer: &RequestId,
        generation: Generation,
    ) -> bool {
        let Some(push) = self.pushes.get_mut(transfer) else {
            self.stats.releases_ignored += 1;
            return false;
        };
        let matches = push
            .registration
            .as_ref()
            .is_some_and(|r| &r.decode == from && r.generation == generation);
        if !matches {
            self.stats.releases_ignored += 1;
            return false;
        }
        //= docs/spec.md#push-mode
        //# P never writes into a reservation D reported released
        if push.writing.is_some() {
            push.gone = true;
            return true;
        }
        if push.request.is_some() {
            self.end(now, transfer, PushOutcome::ReservationGone);
        } else {
            // A lone registration: forget it, remember the id against duplicates.
            self.forget(now, transfer);
        }
        true
    }

    /// The request of `transfer` retired on P (aborted, or finished without pushing). Its
    /// push ends without a write (a write in flight ends it when its result comes) and D
    /// is told. Returns whether it was pushing.
    pub fn retire(&mut self, now: Timestamp, transfer: &RequestId) -> bool {
        let Some(push) = self
            .pushes
            .get_mut(transfer)
            .filter(|p| p.request.is_some())
        else {
            return false;
        };
        if push.writing.is_some() {
            push.retired = true;
            return true;
        }
        if let Some(r) = &push.registration {
            self.actions.push_back(PushAction::Send {
                to: r.decode.clone(),
                message: PushMessage::PushFailed {
                    transfer: transfer.clone(),
                    generation: r.generation,
                },
            });
        }
        self.end(now, transfer, PushOutcome::Retired);
        true
    }

    /// Ends what waited too long: a prefilled push without a registration
    /// ([`PushOutcome::NoRegistration`]), a registration without P's leg (dropped); and
    /// forgets ended transfers remembered long enough.
    pub fn handle_timeout(&mut self, now: Timestamp) {
        let now_ns = now.as_nanos_saturating();
        while let Some((at, transfer)) = self.timers.first().cloned() {
            if at > now_ns {
                break;
            }
            self.timers.pop_first();
            if self.ended.get(&transfer) == Some(&at) {
                self.ended.remove(&transfer);
                continue;
            }
            let Some(push) = self.pushes.get(&transfer).filter(|p| p.deadline == at) else {
                continue;
            };
            if push.request.is_some() {
                self.end(now, &transfer, PushOutcome::NoRegistration);
            } else {
                self.stats.registrations_dropped += 1;
                //= docs/spec.md#push-mode
                //# a registration whose P leg does not come within the registration wait
                //# is dropped, and D is told at once (push-failed)
                if let Some(Push {
                    registration: Some(r),
                    ..
                }) = self.forget(now, &transfer)
                {
                    self.actions.push_back(PushAction::Send {
                        to: r.decode,
                        message: PushMessage::PushFailed {
                            transfer,
                            generation: r.generation,
                        },
                    });
                }
            }
        }
    }

    /// When [`handle_timeout`](Self::handle_timeout) or
    /// [`poll_heartbeat`](Self::poll_heartbeat) should next be called.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        let timer = self
            .timers
            .first()
            .map(|(at, _)| Timestamp::from_nanos(*at));
        match (timer, self.heartbeats.poll_timeout()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The next reservation heartbeat due at `now`: one batch of transfer ids per D engine
    /// per interval. Call until `None`.
    #[must_use]
    pub fn poll_heartbeat(&mut self, now: Timestamp) -> Option<HeartbeatBatch> {
        //= docs/spec.md#push-mode
        //# P renews every reservation it holds with one batched heartbeat per D engine
        //# per interval, naming transfer ids
        self.heartbeats.poll_heartbeat(now)
    }

    /// The next thing to do, in order; `None` when all were drained.
    #[must_use]
    pub fn poll_action(&mut self) -> Option<PushAction> {
        self.actions.pop_front()
    }

    fn track(&mut self, now: Timestamp, transfer: &RequestId, decode: EngineId) {
        let admitted = self
            .pushes
            .get(transfer)
            .is_some_and(|p| p.request.is_some());
        if admitted {
            // Cannot fail: a transfer is tracked once (admit and registration each happen
            // once per push) and one worker is asked for.
            let _ = self.heartbeats.track(now, transfer.clone(), decode, 1);
        }
    }

    fn maybe_write(&mut self, now: Timestamp, transfer: &RequestId) {
        let Some(push) = self.pushes.get_mut(transfer) else {
            return;
        };
        let (Some(blocks), Some(r), None, Some(_)) = (
            &push.blocks,
            &push.registration,
            push.writing,
            &push.request,
        ) else {
            return;
        };
        let Some(pairs) = write_pairs(blocks, &r.blocks) else {
            // D asked for more blocks than the prompt has: no write can be right.
            let (to, generation) = (r.decode.clone(), r.generation);
            self.actions.push_back(PushAction::Send {
                to,
                message: PushMessage::PushFailed {
                    transfer: transfer.clone(),
                    generation,
                },
            });
            self.end(now, transfer, PushOutcome::WriteFailed);
            return;
        };
        push.writing = Some(r.generation);
        self.stats.writes += 1;
        self.actions.push_back(PushAction::Write(WritePlan {
            transfer: transfer.clone(),
            decode: r.decode.clone(),
            generation: r.generation,
            pairs,
        }));
    }

    fn set_deadline(&mut self, transfer: &RequestId, at: Option<Timestamp>) {
        let Some(push) = self.pushes.get_mut(transfer) else {
            return;
        };
        if push.deadline != 0 {
            self.timers.remove(&(push.deadline, transfer.clone()));
        }
        push.deadline = at.map_or(0, |t| t.as_nanos_saturating().max(1));
        if push.deadline != 0 {
            self.timers.insert((push.deadline, transfer.clone()));
        }
    }

    /// Removes `transfer`'s entry and remembers the id for a while.
    fn forget(&mut self, now: Timestamp, transfer: &RequestId) -> Option<Push> {
        self.set_deadline(transfer, None);
        let push = self.pushes.remove(transfer)?;
        self.heartbeats.untrack(transfer);
        let until = (now + self.config.remember_ended).as_nanos_saturating();
        if let Some(old) = self.ended.insert(transfer.clone(), until) {
            self.timers.remove(&(old, transfer.clone()));
        }
        self.timers.insert((until, transfer.clone()));
        Some(push)
    }

    fn end(&mut self, now: Timestamp, transfer: &RequestId, outcome: PushOutcome) {
        let Some(push) = self.forget(now, transfer) else {
            return;
        };
        let Some(request) = push.request else {
            debug_assert!(false, "only admitted pushes end");
            return;
        };
        self.stats.ended += 1;
        self.actions.push_back(PushAction::Ended(PushEnded {
            transfer: transfer.clone(),
            request,
            decode: push.registration.map(|r| r.decode),
            blocks: push.blocks.unwrap_or_default(),
            outcome,
        }));
    }
}
