//! The wire format of every kvlease notification.
//!
//! Heartbeats, read completions, aborts and expiry notices ride the transport's
//! notification channel (`send_notif` / `get_new_notifs`) next to the application's own
//! messages. This crate says which bytes are ours and what they mean ([`decode()`], the
//! `encode*` functions, and [`expiry_notice`]: which released lease deserves a notice).
//! Feeding a decoded message to the state machines of `kvlease-lease` is the engine
//! cores' work (`kvlease-engine`'s `PrefillCore` and `DecodeCore`).
//!
//! It does **not** send or receive anything, read a clock or start threads: `now` is an
//! argument and bytes come in and go out as slices and vectors.
//!
//! # Format (version 1)
//!
//! All kvlease messages are ASCII text. Ids need no escaping: request and engine ids hold
//! 1 to 256 bytes of `[A-Za-z0-9-_.:@/+=]` (see `kvlease_lease::RequestId`), so `,` and `;`
//! separate fields.
//!
//! ```text
//! heartbeat      = "HB:" request *("," request)                       ; D -> P
//! read-complete  = "KVL1:RC:" request ";" engine ";" rank ";" total    ; D -> P
//! abort          = "KVL1:AB:" request ";" engine ";" rank              ; D -> P
//! expired        = "KVL1:EX:" request ";" gen *("," request ";" gen)   ; P -> D
//! push-register  = "KVL1:PR:" transfer ";" gen ";" lease-ms ";" block *("," block)
//!                  [";" prompt]                                        ; D -> P
//! push-heartbeat = "KVL1:PH:" transfer *("," transfer)                ; P -> D
//! write-done     = "KVL1:WD:" transfer ";" gen                        ; P -> D
//! push-failed    = "KVL1:PF:" transfer ";" gen                        ; P -> D
//! released       = "KVL1:RR:" transfer ";" gen                        ; D -> P
//! transfer       = request                  ; the transfer id the router gave both legs
//! lease-ms       = decimal u64 (>= 1), the reservation's lease in milliseconds
//! block          = decimal u32, one of D's block ids, in token order
//! prompt         = 32 LHEXDIG   ; a digest of D's prompt's token ids (PromptDigest)
//! LHEXDIG        = DIGIT / %x61-66                                     ; 0-9, a-f
//! rank, total    = decimal u32 (total >= 1)
//! gen            = decimal u64 (>= 1), the lease's generation
//! decimal        = "0" / %x31-39 *DIGIT                                ; canonical
//! ```
//!
//! - **Reserved namespace.** A message is ours when it starts with `HB:` (the heartbeat
//!   prefix of the SPEC, kept unversioned so that it reads like the system it replaces), or
//!   with `KVL` followed by an ASCII digit (a versioned kvlease message). Everything else,
//!   including the empty message, is [`Notif::App`] and is passed through unchanged.
//!   Applications must not start their own messages with `HB:` or `KVL<digit>`.
//! - **Versioning.** `KVL<version>:` carries the format version; this codec speaks `1` and
//!   rejects others with [`DecodeError::UnsupportedVersion`], so a future format can be
//!   told apart from garbage and counted. A new kind inside version 1 is rejected as
//!   [`DecodeError::UnknownKind`] by older peers, which is why new kinds must be optional
//!   for the protocol's safety (an unknown message is dropped and counted, like a lost one).
//! - **Strictness.** A reserved message is accepted only in the canonical form above: no
//!   empty or repeated ids, no leading zeros, no missing or extra fields, at most
//!   [`MAX_NOTIF_LEN`] bytes. The decoder never panics; every rejection is a
//!   [`DecodeError`] with the byte offset, for the caller to count.
//!
//! # Size limit
//! [`MAX_NOTIF_LEN`] is 16 KiB. The verbs backend receives notifications with SENDs into
//! pre-posted receive slots of this size, so it bounds memory per queue pair (64 slots are
//! 1 MiB) while keeping heartbeat traffic to few messages: 12,500 ids of ~48 bytes make
//! about 37 messages per interval per P worker, where 4 KiB slots would need ~150. NIXL
//! itself sets no fixed notification size (UCX active messages); we need one because a
//! receive slot is fixed. [`encode_heartbeats`] and [`encode_expired`] split a larger
//! batch into several messages; they never drop or truncate an id.
//!
//! # Call order
//! P, in each forward-loop step: [`decode()`] every `(peer, bytes)` from `get_new_notifs`
//! and feed heartbeats, read completions and aborts to its `LeaseTable` with the step's
//! `now`, passing [`Notif::App`] payloads on; run the table's reaper and drain its events
//! as `kvlease-lease` documents; send [`encode_expired`] notices (entries from
//! [`expiry_notice`]) for leases that expired while their reader still heartbeated them.
//! D, in each step: [`decode()`] every received message (expiry notices untrack the
//! requests, for the scheduler to recompute or abort), then [`encode_heartbeats`] every
//! `HeartbeatTracker::poll_heartbeat` batch and send the messages to each P worker.
//!
//! # Push mode
//! D registers the blocks it reserved for a transfer ([`PushRegistration`]); P renews the
//! reservation with [`encode_push_heartbeats`] (one batch per D engine per interval,
//! naming transfer ids) and ends it with a write-done or a push-failed; D tells P when it
//! released the reservation itself (aborted or expired). The last three carry the
//! reservation's generation ([`ReservationRef`]), so that a message about an old
//! reservation is told apart from one about the current one. A registration must fit in
//! one message ([`MAX_NOTIF_LEN`]): about 1,500 blocks with long ids and large block
//! numbers; [`PushRegistration::encode`] refuses a larger one rather than split it.
//!
//! A registration may carry a [`PromptDigest`] of D's prompt (the optional last field,
//! written only when there is one): where the transfer id comes from a client's request
//! id and can repeat, P compares it with its own leg's digest and refuses a registration
//! for another prompt. The codec only carries the digest; an empty, uppercase or
//! wrong-length one is [`DecodeError::BadDigest`].
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod decode;
mod digest;
mod error;
mod message;

pub use decode::{decode, is_reserved};
pub use digest::{PROMPT_DIGEST_LEN, PromptDigest};
pub use error::{DecodeError, EncodeError, Field, InvalidDigest};
pub use message::{
    Abort, ExpiredLease, HeartbeatIds, Notif, PushNotice, PushRegistration, ReadComplete,
    ReservationRef, encode_expired, encode_heartbeats, encode_push_heartbeats, expiry_notice,
};

/// The prefix of every heartbeat message (`HB:`), defined here and nowhere else.
pub const HEARTBEAT_PREFIX: &[u8] = b"HB:";

/// The largest notification this codec produces or accepts in its reserved namespace,
/// in bytes (16 KiB; the crate docs give the reason).
pub const MAX_NOTIF_LEN: usize = 16 * 1024;

/// The smallest `max_len` the batch encoders accept: the longest expiry entry (a 256-byte
/// id, `;` and a 20-digit generation) behind its prefix, so that every entry fits in a
/// message of its own.
pub const MIN_SPLIT_LEN: usize = EXPIRED_PREFIX.len() + MAX_ID_LEN + 1 + 20;

/// The start of every versioned message; a digit must follow.
const VERSION_PREFIX: &[u8] = b"KVL";
const READ_COMPLETE_PREFIX: &[u8] = b"KVL1:RC:";
const ABORT_PREFIX: &[u8] = b"KVL1:AB:";
const EXPIRED_PREFIX: &[u8] = b"KVL1:EX:";
const PUSH_REGISTER_PREFIX: &[u8] = b"KVL1:PR:";
const PUSH_HEARTBEAT_PREFIX: &[u8] = b"KVL1:PH:";
const WRITE_DONE_PREFIX: &[u8] = b"KVL1:WD:";
const PUSH_FAILED_PREFIX: &[u8] = b"KVL1:PF:";
const RELEASED_PREFIX: &[u8] = b"KVL1:RR:";

use kvlease_lease::MAX_ID_LEN;

#[cfg(test)]
mod tests;
