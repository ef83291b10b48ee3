//! The messages and their encoders.

use std::time::Duration;

use kvlease_lease::{BlockId, ConsumerId, Generation, ReleaseReason, Released, RequestId};

use crate::PromptDigest;
use crate::digest::PROMPT_DIGEST_LEN;
use crate::error::EncodeError;
use crate::{ABORT_PREFIX, READ_COMPLETE_PREFIX};
use crate::{EXPIRED_PREFIX, HEARTBEAT_PREFIX, MAX_NOTIF_LEN, MIN_SPLIT_LEN};
use crate::{
    PUSH_FAILED_PREFIX, PUSH_HEARTBEAT_PREFIX, PUSH_REGISTER_PREFIX, RELEASED_PREFIX,
    WRITE_DONE_PREFIX,
};

/// A decoded notification.
///
/// Borrowed from the received bytes where that saves work on the hot path (heartbeat ids,
/// application payloads); the rare structured kinds own their ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notif<'a> {
    /// `HB:` + request ids (D → P): renew these leases.
    Heartbeat(HeartbeatIds<'a>),
    /// `KVL1:RC:` (D → P): a consumer finished reading a request's blocks.
    ReadComplete(ReadComplete),
    /// `KVL1:AB:` (D → P): D aborted the request; P frees its blocks at once (a
    /// notify-only completion).
    Abort(Abort),
    /// `KVL1:EX:` (P → D): the explicit expiry signal — P reclaimed these leases while D
    /// may still track them.
    Expired(Vec<ExpiredLease>),
    /// `KVL1:PR:` (D → P, push mode): D reserved blocks for a transfer; P writes into them.
    PushRegister(PushRegistration),
    /// `KVL1:PH:` + transfer ids (P → D, push mode): renew these reservations.
    PushHeartbeat(HeartbeatIds<'a>),
    /// `KVL1:WD:` (P → D, push mode): the write into the reservation completed.
    WriteDone(ReservationRef),
    /// `KVL1:PF:` (P → D, push mode): P will not write the reservation (its post failed,
    /// or the request retired on P); D frees it and recomputes.
    PushFailed(ReservationRef),
    /// `KVL1:RR:` (D → P, push mode): D released the reservation (aborted or expired); P
    /// writes nothing more into it.
    ReservationReleased(ReservationRef),
    /// Anything outside the reserved namespace: the application's own message, unchanged.
    App(&'a [u8]),
}

/// The request ids of one heartbeat message, validated in place (no per-id allocation).
///
/// Every id is a valid request id (non-empty, at most 256 bytes of `[A-Za-z0-9-_.:@/+=]`)
/// and no id repeats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeartbeatIds<'a> {
    list: &'a str,
    len: usize,
}

impl<'a> HeartbeatIds<'a> {
    /// Wraps a comma-separated list that the decoder has validated.
    pub(crate) fn new_validated(list: &'a str, len: usize) -> Self {
        Self { list, len }
    }

    /// The number of ids (at least one).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always `false`: a heartbeat names at least one id. Present for API symmetry.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The ids in message order, as `&str` (look them up directly in a map keyed by
    /// [`RequestId`], which implements `Borrow<str>`).
    pub fn iter(&self) -> std::str::Split<'a, char> {
        self.list.split(',')
    }

    /// The ids as the comma-separated text of the message.
    pub fn as_str(&self) -> &'a str {
        self.list
    }
}

impl<'a> IntoIterator for HeartbeatIds<'a> {
    type Item = &'a str;
    type IntoIter = std::str::Split<'a, char>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl<'a> IntoIterator for &HeartbeatIds<'a> {
    type Item = &'a str;
    type IntoIter = std::str::Split<'a, char>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// A read-completion report: `consumer` finished reading `request`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ReadComplete {
    /// The request (P's remote request id).
    pub request: RequestId,
    /// Who read: the D engine and its rank.
    pub consumer: ConsumerId,
    /// How many distinct consumers will report a read of this request from this P worker
    /// (at least 1; D knows it from the TP sizes).
    pub consumers_total: u32,
}

impl ReadComplete {
    /// The message bytes: `KVL1:RC:<request>;<engine>;<rank>;<consumers_total>`.
    ///
    /// At most 8 + 256 + 1 + 256 + 1 + 10 + 1 + 10 bytes, far below [`MAX_NOTIF_LEN`].
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            READ_COMPLETE_PREFIX.len()
                + self.request.as_str().len()
                + self.consumer.engine.as_str().len()
                + 24,
        );
        self.encode_into(&mut out);
        out
    }

    /// Appends the message bytes to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(READ_COMPLETE_PREFIX);
        out.extend_from_slice(self.request.as_str().as_bytes());
        out.push(b';');
        out.extend_from_slice(self.consumer.engine.as_str().as_bytes());
        out.push(b';');
        push_decimal(out, u64::from(self.consumer.rank));
        out.push(b';');
        push_decimal(out, u64::from(self.consumers_total));
    }
}

/// A notify-only completion: `consumer` aborted `request`, so P frees it at once.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Abort {
    /// The request (P's remote request id).
    pub request: RequestId,
    /// Who aborted it.
    pub consumer: ConsumerId,
}

impl Abort {
    /// The message bytes: `KVL1:AB:<request>;<engine>;<rank>`.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            ABORT_PREFIX.len()
                + self.request.as_str().len()
                + self.consumer.engine.as_str().len()
                + 12,
        );
        self.encode_into(&mut out);
        out
    }

    /// Appends the message bytes to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(ABORT_PREFIX);
        out.extend_from_slice(self.request.as_str().as_bytes());
        out.push(b';');
        out.extend_from_slice(self.consumer.engine.as_str().as_bytes());
        out.push(b';');
        push_decimal(out, u64::from(self.consumer.rank));
    }
}

/// One entry of an expiry notice: P reclaimed `request`'s lease of `generation`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ExpiredLease {
    /// The request whose lease expired.
    pub request: RequestId,
    /// The generation of the lease that expired, so that D can tell a notice about an old
    /// grant from one about the lease it holds now.
    pub generation: Generation,
}

/// D's registration of the blocks it reserved for a push transfer.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PushRegistration {
    /// The transfer id the router gave both legs.
    pub transfer: RequestId,
    /// The reservation's generation (the write fence).
    pub generation: Generation,
    /// The reservation's lease, in whole milliseconds (at least 1).
    pub lease_ms: u64,
    /// D's blocks to write into, in token order (at least one, no repeats).
    pub blocks: Vec<BlockId>,
    /// A digest of D's prompt's token ids, when D's shell computed one; P refuses the
    /// registration when its leg carries another.
    pub prompt: Option<PromptDigest>,
}

impl PushRegistration {
    /// The reservation's lease.
    pub fn lease(&self) -> Duration {
        Duration::from_millis(self.lease_ms)
    }

    /// The message bytes:
    /// `KVL1:PR:<transfer>;<generation>;<lease_ms>;<block>,<block>,...[;<prompt>]`, the
    /// prompt digest (32 lowercase hex digits) only when there is one.
    ///
    /// # Errors
    /// [`EncodeError::TooLong`] when the blocks do not fit in [`MAX_NOTIF_LEN`] bytes.
    pub fn encode(&self) -> Result<Vec<u8>, EncodeError> {
        let mut out = Vec::with_capacity(
            PUSH_REGISTER_PREFIX.len()
                + self.transfer.as_str().len()
                + 44
                + 6 * self.blocks.len()
                + 1
                + PROMPT_DIGEST_LEN,
        );
        out.extend_from_slice(PUSH_REGISTER_PREFIX);
        out.extend_from_slice(self.transfer.as_str().as_bytes());
        out.push(b';');
        push_decimal(&mut out, self.generation.word());
        out.push(b';');
        push_decimal(&mut out, self.lease_ms);
        out.push(b';');
        for (i, block) in self.blocks.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            push_decimal(&mut out, u64::from(block.0));
        }
        if let Some(prompt) = &self.prompt {
            out.push(b';');
            prompt.write_hex(&mut out);
        }
        if out.len() > MAX_NOTIF_LEN {
            return Err(EncodeError::TooLong { len: out.len() });
        }
        Ok(out)
    }
}

/// Which push-mode message about one reservation ([`ReservationRef::encode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PushNotice {
    /// `KVL1:WD:` (P → D): the write completed.
    WriteDone,
    /// `KVL1:PF:` (P → D): P will not write.
    PushFailed,
    /// `KVL1:RR:` (D → P): D released the reservation.
    ReservationReleased,
}

/// A reservation, named by its transfer and generation.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ReservationRef {
    /// The transfer.
    pub transfer: RequestId,
    /// The reservation's generation.
    pub generation: Generation,
}

impl ReservationRef {
    /// The message bytes of `notice` about this reservation: `<prefix><transfer>;<gen>`.
    #[must_use]
    pub fn encode(&self, notice: PushNotice) -> Vec<u8> {
        let prefix = match notice {
            PushNotice::WriteDone => WRITE_DONE_PREFIX,
            PushNotice::PushFailed => PUSH_FAILED_PREFIX,
            PushNotice::ReservationReleased => RELEASED_PREFIX,
        };
        let mut out = Vec::with_capacity(prefix.len() + self.transfer.as_str().len() + 21);
        out.extend_from_slice(prefix);
        out.extend_from_slice(self.transfer.as_str().as_bytes());
        out.push(b';');
        push_decimal(&mut out, self.generation.word());
        out
    }
}

/// Encodes reservation heartbeats (push mode, P → D) for transfer `ids` as
/// `KVL1:PH:id,id,...` messages of at most `max_len` bytes, split like
/// [`encode_heartbeats`].
///
/// # Errors
/// [`EncodeError::BadMaxLen`] when `max_len` is outside
/// [`MIN_SPLIT_LEN`]`..=`[`MAX_NOTIF_LEN`].
pub fn encode_push_heartbeats<'a, I>(ids: I, max_len: usize) -> Result<Vec<Vec<u8>>, EncodeError>
where
    I: IntoIterator<Item = &'a RequestId>,
{
    let mut splitter = Splitter::new(PUSH_HEARTBEAT_PREFIX, max_len)?;
    for id in ids {
        let id = id.as_str().as_bytes();
        splitter.push(id.len(), |out| out.extend_from_slice(id));
    }
    Ok(splitter.finish())
}

/// The expiry notice entry for `released`, if it deserves one: it expired (not completed
/// or aborted) and had been heartbeated, so a D still tracks it.
pub fn expiry_notice(released: &Released) -> Option<ExpiredLease> {
    (released.reason == ReleaseReason::Expired && released.last_heartbeat.is_some()).then(|| {
        ExpiredLease {
            request: released.request.clone(),
            generation: released.generation,
        }
    })
}

/// Encodes heartbeats for `ids` as `HB:id,id,...` messages of at most `max_len` bytes.
///
/// Splits a batch that does not fit into one message into as many as needed; never drops,
/// reorders or truncates an id, so the concatenated id lists of the messages are `ids`.
/// An empty `ids` gives no message. Ids are written as they are (callers pass distinct ids;
/// a repeated id in one message is rejected by the decoder).
///
/// # Errors
/// [`EncodeError::BadMaxLen`] when `max_len` is outside
/// [`MIN_SPLIT_LEN`]`..=`[`MAX_NOTIF_LEN`].
pub fn encode_heartbeats<'a, I>(ids: I, max_len: usize) -> Result<Vec<Vec<u8>>, EncodeError>
where
    I: IntoIterator<Item = &'a RequestId>,
{
    let mut splitter = Splitter::new(HEARTBEAT_PREFIX, max_len)?;
    for id in ids {
        let id = id.as_str().as_bytes();
        splitter.push(id.len(), |out| out.extend_from_slice(id));
    }
    Ok(splitter.finish())
}

/// Encodes an expiry notice for `leases` as `KVL1:EX:req;gen,req;gen,...` messages of at
/// most `max_len` bytes, split like [`encode_heartbeats`]. An empty `leases` gives no message.
///
/// # Errors
/// [`EncodeError::BadMaxLen`] when `max_len` is outside
/// [`MIN_SPLIT_LEN`]`..=`[`MAX_NOTIF_LEN`].
pub fn encode_expired<'a, I>(leases: I, max_len: usize) -> Result<Vec<Vec<u8>>, EncodeError>
where
    I: IntoIterator<Item = &'a ExpiredLease>,
{
    let mut splitter = Splitter::new(EXPIRED_PREFIX, max_len)?;
    let mut digits = [0u8; 20];
    for lease in leases {
        let id = lease.request.as_str().as_bytes();
        let generation = decimal(&mut digits, lease.generation.word());
        splitter.push(id.len() + 1 + generation.len(), |out| {
            out.extend_from_slice(id);
            out.push(b';');
            out.extend_from_slice(generation);
        });
    }
    Ok(splitter.finish())
}

/// Packs comma-separated entries behind a prefix into messages of at most `max_len` bytes.
struct Splitter {
    prefix: &'static [u8],
    max_len: usize,
    done: Vec<Vec<u8>>,
    current: Vec<u8>,
}

impl Splitter {
    fn new(prefix: &'static [u8], max_len: usize) -> Result<Self, EncodeError> {
        if !(MIN_SPLIT_LEN..=MAX_NOTIF_LEN).contains(&max_len) {
            return Err(EncodeError::BadMaxLen { max_len });
        }
        Ok(Self {
            prefix,
            max_len,
            done: Vec::new(),
            current: Vec::new(),
        })
    }

    /// Appends one entry of `len` bytes, written by `write`. `len` is at most
    /// `MIN_SPLIT_LEN - prefix.len()` (ids are at most 256 bytes), so an entry always fits
    /// into a fresh message.
    fn push(&mut self, len: usize, write: impl FnOnce(&mut Vec<u8>)) {
        if self.current.is_empty() {
            self.start();
        } else if self.current.len() + 1 + len > self.max_len {
            let full = std::mem::take(&mut self.current);
            self.done.push(full);
            self.start();
        } else {
            self.current.push(b',');
        }
        write(&mut self.current);
        debug_assert!(self.current.len() <= self.max_len);
    }

    fn start(&mut self) {
        self.current = Vec::with_capacity(self.max_len);
        self.current.extend_from_slice(self.prefix);
    }

    fn finish(mut self) -> Vec<Vec<u8>> {
        if !self.current.is_empty() {
            self.current.shrink_to_fit();
            self.done.push(self.current);
        }
        self.done
    }
}

/// Writes `n` in decimal into `buf` and returns the digits.
fn decimal(buf: &mut [u8; 20], mut n: u64) -> &[u8] {
    let mut at = buf.len();
    loop {
        at -= 1;
        // `n % 10` is below 10, so the cast and the addition cannot overflow.
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    &buf[at..]
}

fn push_decimal(out: &mut Vec<u8>, n: u64) {
    let mut buf = [0u8; 20];
    out.extend_from_slice(decimal(&mut buf, n));
}
