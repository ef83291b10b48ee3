//! Push mode's decisions: D reserves blocks for a transfer and registers them with P, P
//! writes the KV into them when its prefill ends (docs/spec.md, "Push mode").
//!
//! Leases run both ways. D holds each [`Reservation`] under a lease in its own
//! [`Reservations`] table (a [`LeaseTable`](kvlease_lease::LeaseTable) keyed by the
//! transfer id the router gave both legs); P's [`PushCore`] renews it with one batched
//! heartbeat per D engine while the request waits or prefills on P. Every reservation
//! carries a generation, the **write fence**: a write or a write-done for a generation D
//! no longer holds is refused, so blocks D released and handed to another request never
//! take a late write.
//!
//! - **D** ([`Reservations`]): `reserve` at admission (send the [`Reservation`] to P),
//!   `handle_heartbeat` / `handle_write_done` / `handle_push_failed` from P, `abort` when
//!   the request ends on D, `handle_timeout` for the reaper; every reservation ends in
//!   exactly one [`ReservationEnded`] (written, aborted, expired or failed), drained with
//!   `poll_event`. [`Reservations::admits_write`] is the fence a transport's receiver
//!   checks before any byte lands.
//! - **P** ([`PushCore`]): `admit` P's leg, `handle_registration` D's reservation,
//!   `handle_prefill_done` with P's blocks; the core issues a [`WritePlan`] once both are
//!   there (never after the request retired or D reported the reservation gone), pairs
//!   P's blocks with D's from the end ([`write_pairs`]: D registers only the blocks its
//!   prefix cache lacks), reports a failed post to D, and ends every admitted push exactly
//!   once ([`PushEnded`]).
//!
//! Time is an argument and nothing here does IO: the shells (the simulator's `run_push`,
//! later the agents) send the messages, post the writes and free the blocks.

mod core;
mod reserve;

pub use core::{
    PushAction, PushConfig, PushCore, PushEnded, PushError, PushMessage, PushOutcome, PushStats,
    RegistrationOutcome, WritePlan, write_pairs,
};
pub use reserve::{
    FenceVerdict, Reservation, ReservationEnded, ReservationOutcome, ReservationStats, Reservations,
};

#[cfg(test)]
mod tests;
