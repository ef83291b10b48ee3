//! The decoder. Never panics on any input; every rejection is a [`DecodeError`].

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::OnceLock;

use kvlease_lease::{BlockId, ConsumerId, EngineId, Generation, InvalidId, RequestId};

use crate::error::{DecodeError, Field, InvalidDigest};
use crate::message::{
    Abort, ExpiredLease, HeartbeatIds, Notif, PushRegistration, ReadComplete, ReservationRef,
};
use crate::{HEARTBEAT_PREFIX, MAX_ID_LEN, MAX_NOTIF_LEN, PromptDigest, VERSION_PREFIX};

/// `ID_BYTE[b]` is whether byte `b` may appear in an id (`[A-Za-z0-9-_.:@/+=]`, the set
/// `kvlease_lease` enforces; a test checks that both agree on every byte).
static ID_BYTE: [bool; 256] = ID_BYTE_TABLE;

const fn id_byte_table() -> [bool; 256] {
    let mut table = [false; 256];
    let mut i = 0;
    while i < 256 {
        // `i < 256`, so it fits a byte.
        let b = i as u8;
        table[i] = b.is_ascii_alphanumeric()
            || matches!(b, b'-' | b'_' | b'.' | b':' | b'@' | b'/' | b'+' | b'=');
        i += 1;
    }
    table
}

/// Up to this many ids, duplicates are found by comparing every pair, which is cheaper
/// than building a hash set.
const PAIRWISE_DUPLICATE_CHECK: usize = 8;

/// Whether `bytes` lies in the reserved namespace: it starts with `HB:`, or with `KVL`
/// followed by an ASCII digit. Everything else is an application message.
pub fn is_reserved(bytes: &[u8]) -> bool {
    bytes.starts_with(HEARTBEAT_PREFIX)
        || (bytes.starts_with(VERSION_PREFIX)
            && bytes
                .get(VERSION_PREFIX.len())
                .is_some_and(u8::is_ascii_digit))
}

/// Decodes one notification.
///
/// Messages outside the reserved namespace ([`is_reserved`]) are returned as
/// [`Notif::App`] unchanged, whatever their length or content. Reserved messages are
/// checked completely: length, UTF-8, every id, every number, no repeated request id in a
/// heartbeat or expiry notice, no missing or extra field.
///
/// Never panics.
///
/// # Errors
/// A [`DecodeError`] naming what is wrong and where, for a reserved message that does not
/// follow the format in the crate docs.
pub fn decode(bytes: &[u8]) -> Result<Notif<'_>, DecodeError> {
    if !is_reserved(bytes) {
        return Ok(Notif::App(bytes));
    }
    if bytes.len() > MAX_NOTIF_LEN {
        return Err(DecodeError::TooLong {
            len: bytes.len(),
            max: MAX_NOTIF_LEN,
        });
    }
    let text = std::str::from_utf8(bytes).map_err(|e| DecodeError::NotUtf8 {
        offset: e.valid_up_to(),
    })?;
    if let Some(list) = text.strip_prefix("HB:") {
        return decode_heartbeat(list, HEARTBEAT_PREFIX.len()).map(Notif::Heartbeat);
    }
    decode_versioned(text)
}

fn decode_heartbeat(list: &str, base: usize) -> Result<HeartbeatIds<'_>, DecodeError> {
    let bytes = list.as_bytes();
    // Fast path: one branch-free pass over the bytes (class check and comma count), then
    // one pass over the ids (length and duplicate check).
    let mut bad = false;
    let mut commas = 0usize;
    for &b in bytes {
        bad |= !LIST_BYTE[usize::from(b)];
        commas += usize::from(b == b',');
    }
    if bad {
        return Err(first_list_error(bytes, base));
    }
    let count = commas + 1;
    check_ids(list, base, count)?;
    Ok(HeartbeatIds::new_validated(list, count))
}

/// `LIST_BYTE[b]`: byte `b` may appear in a list of ids (an id byte or `,`).
static LIST_BYTE: [bool; 256] = {
    let mut table = ID_BYTE_TABLE;
    table[b',' as usize] = true;
    table
};

const ID_BYTE_TABLE: [bool; 256] = id_byte_table();

/// The first error, in message order, of a list that holds a byte outside the id set.
fn first_list_error(bytes: &[u8], base: usize) -> DecodeError {
    let mut start = 0usize;
    for (i, &b) in bytes.iter().enumerate() {
        if b == b',' {
            if let Err(e) = check_id_len(i - start, base + start, Field::Request) {
                return e;
            }
            start = i + 1;
        } else if !ID_BYTE[usize::from(b)] {
            return DecodeError::InvalidIdByte {
                offset: base + i,
                byte: b,
                field: Field::Request,
            };
        }
    }
    // Not reached for a list that holds a bad byte; report the list's start otherwise.
    DecodeError::InvalidIdByte {
        offset: base,
        byte: bytes.first().copied().unwrap_or(0),
        field: Field::Request,
    }
}

fn check_id_len(len: usize, offset: usize, field: Field) -> Result<(), DecodeError> {
    if len == 0 {
        Err(DecodeError::EmptyId { offset, field })
    } else if len > MAX_ID_LEN {
        Err(DecodeError::IdTooLong { offset, len, field })
    } else {
        Ok(())
    }
}

/// Checks the length of each of the `count` comma-separated ids of `list` (which starts at
/// byte `base` of the message) and that no id repeats; the first error in message order.
fn check_ids(list: &str, base: usize, count: usize) -> Result<(), DecodeError> {
    if count <= PAIRWISE_DUPLICATE_CHECK {
        let mut offset = base;
        for (i, id) in list.split(',').enumerate() {
            check_id_len(id.len(), offset, Field::Request)?;
            let mut other_offset = base;
            for other in list.split(',').take(i) {
                if other == id {
                    return Err(DecodeError::DuplicateId {
                        offset,
                        first: other_offset,
                    });
                }
                other_offset += other.len() + 1;
            }
            offset += id.len() + 1;
        }
        return Ok(());
    }
    match check_distinct_hashed(list, base, count) {
        Some(result) => result,
        None => {
            let mut offset = base;
            for id in list.split(',') {
                check_id_len(id.len(), offset, Field::Request)?;
                offset += id.len() + 1;
            }
            check_distinct_sorted(list, base)
        }
    }
}

/// The per-process key of [`id_hash`], drawn once from the standard library's random
/// hasher keys, so that a peer cannot precompute ids that collide.
fn hash_key() -> u64 {
    static KEY: OnceLock<u64> = OnceLock::new();
    *KEY.get_or_init(|| RandomState::new().hash_one(0x6b76_6c65_6173_6531_u64) | 1)
}

/// A fast keyed hash of an id (multiply-rotate over 8-byte words). Not a cryptographic
/// hash: a flood of collisions is cut off by the probe limit of [`check_distinct_hashed`].
fn id_hash(id: &[u8], key: u64) -> u64 {
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut h = key ^ (id.len() as u64).wrapping_mul(K);
    let mut chunks = id.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
        h = (h ^ w).wrapping_mul(K).rotate_left(29);
    }
    let mut tail = [0u8; 8];
    let rest = chunks.remainder();
    tail[..rest.len()].copy_from_slice(rest);
    h = (h ^ u64::from_le_bytes(tail)).wrapping_mul(K);
    h ^= h >> 32;
    h = h.wrapping_mul(key);
    h ^ (h >> 29)
}

/// Longest probe sequence accepted before giving up on the hash table (a collision flood
/// from a hostile peer); the caller then checks by sorting, which has no bad case.
const MAX_PROBES: usize = 32;

/// Bits of an entry of [`check_distinct_hashed`]: a tag from the hash, `offset + 1` (15
/// bits: the list is shorter than [`MAX_NOTIF_LEN`] = 2^14 bytes) and the length (9 bits:
/// at most 256).
const LEN_BITS: u32 = 9;
const OFFSET_BITS: u32 = 15;
const _: () = assert!(MAX_NOTIF_LEN < (1 << OFFSET_BITS) - 1 && MAX_ID_LEN < 1 << LEN_BITS);

/// Duplicate check with an open-addressing table of `(tag, offset, len)` words: one
/// allocation per message, none per id. `None` when the probe limit was hit.
fn check_distinct_hashed(list: &str, base: usize, count: usize) -> Option<Result<(), DecodeError>> {
    let size = (count * 2).next_power_of_two();
    let mask = size - 1;
    let key = hash_key();
    let bytes = list.as_bytes();
    let mut table = vec![0u64; size];
    let mut offset = 0usize;
    for id in list.split(',') {
        if let Err(e) = check_id_len(id.len(), base + offset, Field::Request) {
            return Some(Err(e));
        }
        let hash = id_hash(id.as_bytes(), key);
        let tag = hash >> (LEN_BITS + OFFSET_BITS);
        // `offset + 1` so that an empty slot (0) never matches an entry.
        let entry =
            (tag << (LEN_BITS + OFFSET_BITS)) | ((offset as u64 + 1) << LEN_BITS) | id.len() as u64;
        let mut slot = (hash as usize) & mask;
        let mut probes = 0;
        loop {
            let other = table[slot];
            if other == 0 {
                table[slot] = entry;
                break;
            }
            let same_tag_and_len = (other >> (LEN_BITS + OFFSET_BITS)) == tag
                && (other & ((1 << LEN_BITS) - 1)) == id.len() as u64;
            if same_tag_and_len {
                let other_offset = ((other >> LEN_BITS) & ((1 << OFFSET_BITS) - 1)) as usize - 1;
                if bytes.get(other_offset..other_offset + id.len()) == Some(id.as_bytes()) {
                    return Some(Err(DecodeError::DuplicateId {
                        offset: base + offset,
                        first: base + other_offset,
                    }));
                }
            }
            probes += 1;
            if probes > MAX_PROBES {
                return None;
            }
            slot = (slot + 1) & mask;
        }
        offset += id.len() + 1;
    }
    Some(Ok(()))
}

/// Duplicate check by sorting: O(n log n) whatever the input.
fn check_distinct_sorted(list: &str, base: usize) -> Result<(), DecodeError> {
    let mut sorted: Vec<(&str, usize)> = Vec::new();
    let mut offset = base;
    for id in list.split(',') {
        sorted.push((id, offset));
        offset += id.len() + 1;
    }
    sorted.sort_unstable();
    for pair in sorted.windows(2) {
        if pair[0].0 == pair[1].0 {
            // Equal ids sort by offset: pair[0] is the earlier one.
            return Err(DecodeError::DuplicateId {
                offset: pair[1].1,
                first: pair[0].1,
            });
        }
    }
    Ok(())
}

fn decode_versioned(text: &str) -> Result<Notif<'_>, DecodeError> {
    // `is_reserved` saw `KVL` and a digit.
    let after_kvl = VERSION_PREFIX.len();
    let rest = &text[after_kvl..];
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    let version = parse_decimal::<u32>(&rest[..digits]).unwrap_or(u32::MAX);
    let colon = after_kvl + digits;
    match text.as_bytes().get(colon) {
        None => {
            return Err(DecodeError::Truncated {
                offset: text.len(),
                field: Field::Kind,
            });
        }
        Some(b':') => {}
        Some(_) => {
            return Err(DecodeError::BadNumber {
                offset: after_kvl,
                field: Field::Version,
            });
        }
    }
    if version != 1 || rest[..digits].len() != 1 {
        return Err(DecodeError::UnsupportedVersion {
            offset: after_kvl,
            version,
        });
    }
    let kind_at = colon + 1;
    let kind = &text[kind_at..];
    if kind.is_empty() {
        return Err(DecodeError::Truncated {
            offset: text.len(),
            field: Field::Kind,
        });
    }
    let body_at = kind_at + 3;
    if let Some(body) = kind.strip_prefix("RC:") {
        decode_read_complete(body, body_at, text.len()).map(Notif::ReadComplete)
    } else if let Some(body) = kind.strip_prefix("AB:") {
        decode_abort(body, body_at, text.len()).map(Notif::Abort)
    } else if let Some(body) = kind.strip_prefix("EX:") {
        decode_expired(body, body_at).map(Notif::Expired)
    } else if let Some(body) = kind.strip_prefix("PR:") {
        decode_push_register(body, body_at, text.len()).map(Notif::PushRegister)
    } else if let Some(list) = kind.strip_prefix("PH:") {
        decode_heartbeat(list, body_at).map(Notif::PushHeartbeat)
    } else if let Some(body) = kind.strip_prefix("WD:") {
        decode_reservation(body, body_at, text.len()).map(Notif::WriteDone)
    } else if let Some(body) = kind.strip_prefix("PF:") {
        decode_reservation(body, body_at, text.len()).map(Notif::PushFailed)
    } else if let Some(body) = kind.strip_prefix("RR:") {
        decode_reservation(body, body_at, text.len()).map(Notif::ReservationReleased)
    } else if KINDS.iter().any(|known| known.starts_with(kind)) {
        // A known kind cut short, e.g. `KVL1:RC`.
        Err(DecodeError::Truncated {
            offset: text.len(),
            field: Field::Kind,
        })
    } else {
        Err(DecodeError::UnknownKind { offset: kind_at })
    }
}

/// Every kind of version 1, as it appears after `KVL1:`.
const KINDS: [&str; 8] = ["RC:", "AB:", "EX:", "PR:", "PH:", "WD:", "PF:", "RR:"];

/// Splits `;`-separated fields, tracking their byte offsets in the message.
struct Fields<'a> {
    rest: Option<&'a str>,
    offset: usize,
    end: usize,
}

impl<'a> Fields<'a> {
    fn new(body: &'a str, offset: usize, end: usize) -> Self {
        Self {
            rest: Some(body),
            offset,
            end,
        }
    }

    /// The next field and its offset.
    fn take(&mut self, field: Field) -> Result<(&'a str, usize), DecodeError> {
        self.take_optional().ok_or(DecodeError::Truncated {
            offset: self.end,
            field,
        })
    }

    /// The next field and its offset, or `None` when every field has been taken (for an
    /// optional last field).
    fn take_optional(&mut self) -> Option<(&'a str, usize)> {
        let rest = self.rest?;
        let at = self.offset;
        match rest.split_once(';') {
            Some((head, tail)) => {
                self.rest = Some(tail);
                self.offset += head.len() + 1;
                Some((head, at))
            }
            None => {
                self.rest = None;
                Some((rest, at))
            }
        }
    }

    /// Succeeds when every field has been taken.
    fn finish(self) -> Result<(), DecodeError> {
        match self.rest {
            None => Ok(()),
            // The separator before the extra field is the first unexpected byte.
            Some(_) => Err(DecodeError::TrailingData {
                offset: self.offset - 1,
            }),
        }
    }
}

fn decode_read_complete(body: &str, at: usize, end: usize) -> Result<ReadComplete, DecodeError> {
    let mut fields = Fields::new(body, at, end);
    let request = request_id(fields.take(Field::Request)?)?;
    let consumer = consumer(&mut fields)?;
    let (total, total_at) = fields.take(Field::ConsumersTotal)?;
    let consumers_total = number::<u32>((total, total_at), Field::ConsumersTotal)?;
    if consumers_total == 0 {
        return Err(DecodeError::BadNumber {
            offset: total_at,
            field: Field::ConsumersTotal,
        });
    }
    fields.finish()?;
    Ok(ReadComplete {
        request,
        consumer,
        consumers_total,
    })
}

fn decode_abort(body: &str, at: usize, end: usize) -> Result<Abort, DecodeError> {
    let mut fields = Fields::new(body, at, end);
    let request = request_id(fields.take(Field::Request)?)?;
    let consumer = consumer(&mut fields)?;
    fields.finish()?;
    Ok(Abort { request, consumer })
}

fn consumer(fields: &mut Fields<'_>) -> Result<ConsumerId, DecodeError> {
    let (engine, at) = fields.take(Field::Engine)?;
    let engine = EngineId::new(engine).map_err(|e| id_error(e, at, Field::Engine))?;
    let rank = number::<u32>(fields.take(Field::Rank)?, Field::Rank)?;
    Ok(ConsumerId { engine, rank })
}

fn decode_expired(body: &str, at: usize) -> Result<Vec<ExpiredLease>, DecodeError> {
    let mut leases = Vec::new();
    // Request id -> offset of its entry, to reject a repeated request.
    let mut seen: HashMap<&str, usize> = HashMap::new();
    let mut offset = at;
    for entry in body.split(',') {
        let end = offset + entry.len();
        let mut fields = Fields::new(entry, offset, end);
        let (request_text, request_at) = fields.take(Field::Request)?;
        let request = request_id((request_text, request_at))?;
        let generation = generation(fields.take(Field::Generation)?)?;
        fields.finish()?;
        if let Some(&first) = seen.get(request_text) {
            return Err(DecodeError::DuplicateId { offset, first });
        }
        seen.insert(request_text, offset);
        leases.push(ExpiredLease {
            request,
            generation,
        });
        offset = end + 1;
    }
    Ok(leases)
}

fn decode_push_register(
    body: &str,
    at: usize,
    end: usize,
) -> Result<PushRegistration, DecodeError> {
    let mut fields = Fields::new(body, at, end);
    let transfer = request_id(fields.take(Field::Request)?)?;
    let generation = generation(fields.take(Field::Generation)?)?;
    let (lease, lease_at) = fields.take(Field::Lease)?;
    let lease_ms = number::<u64>((lease, lease_at), Field::Lease)?;
    if lease_ms == 0 {
        return Err(DecodeError::BadNumber {
            offset: lease_at,
            field: Field::Lease,
        });
    }
    let (list, list_at) = fields.take(Field::Block)?;
    let prompt_text = fields.take_optional();
    fields.finish()?;
    let mut blocks = Vec::new();
    // Block -> offset of its first occurrence, to reject a repeated block.
    let mut seen: HashMap<u32, usize> = HashMap::new();
    let mut offset = list_at;
    for text in list.split(',') {
        let block = number::<u32>((text, offset), Field::Block)?;
        if let Some(&first) = seen.get(&block) {
            return Err(DecodeError::DuplicateBlock { offset, first });
        }
        seen.insert(block, offset);
        blocks.push(BlockId(block));
        offset += text.len() + 1;
    }
    let prompt = prompt_text.map(prompt_digest).transpose()?;
    Ok(PushRegistration {
        transfer,
        generation,
        lease_ms,
        blocks,
        prompt,
    })
}

/// A prompt digest: exactly 32 lowercase hex digits (an empty field is refused: the field
/// is left out when there is no digest).
fn prompt_digest((text, at): (&str, usize)) -> Result<PromptDigest, DecodeError> {
    PromptDigest::parse(text).map_err(|e| DecodeError::BadDigest {
        offset: match e {
            InvalidDigest::Length { .. } => at,
            InvalidDigest::BadByte { position, .. } => at + position,
        },
    })
}

fn decode_reservation(body: &str, at: usize, end: usize) -> Result<ReservationRef, DecodeError> {
    let mut fields = Fields::new(body, at, end);
    let transfer = request_id(fields.take(Field::Request)?)?;
    let generation = generation(fields.take(Field::Generation)?)?;
    fields.finish()?;
    Ok(ReservationRef {
        transfer,
        generation,
    })
}

/// A generation: canonical decimal, at least 1.
fn generation((text, at): (&str, usize)) -> Result<Generation, DecodeError> {
    let word = number::<u64>((text, at), Field::Generation)?;
    std::num::NonZeroU64::new(word)
        .map(Generation)
        .ok_or(DecodeError::BadNumber {
            offset: at,
            field: Field::Generation,
        })
}

fn request_id((text, at): (&str, usize)) -> Result<RequestId, DecodeError> {
    RequestId::new(text).map_err(|e| id_error(e, at, Field::Request))
}

fn id_error(error: InvalidId, at: usize, field: Field) -> DecodeError {
    match error {
        InvalidId::Empty => DecodeError::EmptyId { offset: at, field },
        InvalidId::TooLong { len } => DecodeError::IdTooLong {
            offset: at,
            len,
            field,
        },
        InvalidId::BadByte { byte, position } => DecodeError::InvalidIdByte {
            offset: at + position,
            byte,
            field,
        },
    }
}

fn number<T: std::str::FromStr>((text, at): (&str, usize), field: Field) -> Result<T, DecodeError> {
    parse_decimal(text).ok_or(DecodeError::BadNumber { offset: at, field })
}

/// Canonical decimal: one or more digits, no sign, no leading zero (except `0` itself),
/// in range of `T`.
fn parse_decimal<T: std::str::FromStr>(text: &str) -> Option<T> {
    let bytes = text.as_bytes();
    let canonical = !bytes.is_empty()
        && bytes.iter().all(u8::is_ascii_digit)
        && (bytes.len() == 1 || bytes[0] != b'0');
    if canonical { text.parse().ok() } else { None }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Short distinct ids: `a`, `b`, …, `aa`, `ab`, … (base 36).
    fn ids(n: usize) -> Vec<String> {
        const DIGITS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyz";
        (0..n)
            .map(|mut i| {
                let mut s = Vec::new();
                loop {
                    s.push(DIGITS[i % 36]);
                    i /= 36;
                    if i == 0 {
                        break;
                    }
                }
                String::from_utf8(s).unwrap()
            })
            .collect()
    }

    #[test]
    fn hashed_and_sorted_checks_agree() {
        // Up to the size limit: ~5,000 one- to three-byte ids in one message.
        for n in [9, 100, 4000] {
            let mut list = ids(n);
            let joined = list.join(",");
            assert_eq!(check_distinct_hashed(&joined, 3, n), Some(Ok(())));
            assert_eq!(check_distinct_sorted(&joined, 3), Ok(()));
            // A duplicate of the id at index n / 3, at the end.
            list.push(list[n / 3].clone());
            let joined = list.join(",");
            let first = 3 + list[..n / 3].iter().map(|s| s.len() + 1).sum::<usize>();
            let offset = 3 + joined.len() - list[n / 3].len();
            let want = Err(DecodeError::DuplicateId { offset, first });
            assert_eq!(check_distinct_hashed(&joined, 3, n + 1), Some(want.clone()));
            assert_eq!(check_distinct_sorted(&joined, 3), want);
            assert_eq!(check_ids(&joined, 3, n + 1), want);
        }
    }

    #[test]
    fn hash_separates_similar_ids() {
        let key = hash_key();
        let a = id_hash(b"cmpl-0000000000000001-0", key);
        let b = id_hash(b"cmpl-0000000000000002-0", key);
        let c = id_hash(b"cmpl-0000000000000001-", key);
        assert!(a != b && a != c && b != c);
        assert_eq!(a, id_hash(b"cmpl-0000000000000001-0", key));
    }
}
