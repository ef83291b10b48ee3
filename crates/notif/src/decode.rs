//! The decoder. Never panics on any input; every rejection is a [`DecodeError`].

use std::collections::{HashMap, HashSet};

use kvlease_lease::{ConsumerId, EngineId, Generation, InvalidId, RequestId};

use crate::error::{DecodeError, Field};
use crate::message::{Abort, ExpiredLease, HeartbeatIds, Notif, ReadComplete};
use crate::{HEARTBEAT_PREFIX, MAX_ID_LEN, MAX_NOTIF_LEN, VERSION_PREFIX};

/// `ID_BYTE[b]` is whether byte `b` may appear in an id (`[A-Za-z0-9-_.:@/+=]`, the set
/// `kvlease_lease` enforces; a test checks that both agree on every byte).
static ID_BYTE: [bool; 256] = id_byte_table();

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
    let mut count = 0usize;
    let mut start = 0usize;
    for (i, &b) in bytes.iter().enumerate() {
        if b == b',' {
            check_id_len(i - start, base + start, Field::Request)?;
            count += 1;
            start = i + 1;
        } else if !ID_BYTE[usize::from(b)] {
            return Err(DecodeError::InvalidIdByte {
                offset: base + i,
                byte: b,
                field: Field::Request,
            });
        }
    }
    check_id_len(bytes.len() - start, base + start, Field::Request)?;
    count += 1;
    check_distinct(list.split(','), base, count)?;
    Ok(HeartbeatIds::new_validated(list, count))
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

/// Checks that the `count` ids yielded by `ids` (comma-separated pieces starting at byte
/// `base`) are distinct.
fn check_distinct<'a>(
    ids: impl Iterator<Item = &'a str> + Clone,
    base: usize,
    count: usize,
) -> Result<(), DecodeError> {
    // Offsets of the pieces are recovered by adding up lengths (+1 for each comma).
    if count <= PAIRWISE_DUPLICATE_CHECK {
        let mut offset = base;
        for (i, id) in ids.clone().enumerate() {
            let mut other_offset = base;
            for other in ids.clone().take(i) {
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
    let mut seen: HashSet<&str> = HashSet::with_capacity(count);
    let mut offset = base;
    for id in ids.clone() {
        if !seen.insert(id) {
            return Err(DecodeError::DuplicateId {
                offset,
                first: first_offset(ids, base, id),
            });
        }
        offset += id.len() + 1;
    }
    Ok(())
}

fn first_offset<'a>(ids: impl Iterator<Item = &'a str>, base: usize, wanted: &str) -> usize {
    let mut offset = base;
    for id in ids {
        if id == wanted {
            break;
        }
        offset += id.len() + 1;
    }
    offset
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
    } else if ["RC:", "AB:", "EX:"]
        .iter()
        .any(|known| known.starts_with(kind))
    {
        // A known kind cut short, e.g. `KVL1:RC`.
        Err(DecodeError::Truncated {
            offset: text.len(),
            field: Field::Kind,
        })
    } else {
        Err(DecodeError::UnknownKind { offset: kind_at })
    }
}

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
        let rest = self.rest.ok_or(DecodeError::Truncated {
            offset: self.end,
            field,
        })?;
        let at = self.offset;
        match rest.split_once(';') {
            Some((head, tail)) => {
                self.rest = Some(tail);
                self.offset += head.len() + 1;
                Ok((head, at))
            }
            None => {
                self.rest = None;
                Ok((rest, at))
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
        let (word, word_at) = fields.take(Field::Generation)?;
        let generation = number::<u64>((word, word_at), Field::Generation)?;
        let generation = std::num::NonZeroU64::new(generation)
            .map(Generation)
            .ok_or(DecodeError::BadNumber {
                offset: word_at,
                field: Field::Generation,
            })?;
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
        // `InvalidId` is non-exhaustive; a future reason is still a bad byte somewhere in
        // the id, reported at its start.
        _ => DecodeError::InvalidIdByte {
            offset: at,
            byte: 0,
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
