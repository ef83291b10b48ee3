//! Typed errors of the codec. Every variant says where in the message it went wrong, so a
//! receiver can log and count malformed notifications instead of crashing on them.

use std::fmt;

/// A field of a structured notification, named in errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Field {
    /// The protocol version after `KVL`.
    Version,
    /// The two-letter kind after the version (`RC`, `AB`, `EX`, `PR`, `PH`, `WD`, `PF`,
    /// `RR`).
    Kind,
    /// A request id.
    Request,
    /// The engine id of the consumer that reports.
    Engine,
    /// The consumer's rank.
    Rank,
    /// The number of consumers that will report a read of the request.
    ConsumersTotal,
    /// A lease or reservation generation.
    Generation,
    /// A reservation's lease in milliseconds (push registration).
    Lease,
    /// A block id (push registration).
    Block,
}

impl Field {
    /// The field's name as the format description spells it.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Version => "version",
            Self::Kind => "kind",
            Self::Request => "request",
            Self::Engine => "engine",
            Self::Rank => "rank",
            Self::ConsumersTotal => "consumers_total",
            Self::Generation => "generation",
            Self::Lease => "lease_ms",
            Self::Block => "block",
        }
    }
}

impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a notification in the reserved namespace (see the crate docs) could not be decoded.
///
/// Offsets are byte offsets from the start of the message. [`DecodeError::label`] gives a
/// stable short name for a metrics counter.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The message is longer than the limit.
    #[error("notification is {len} bytes long; the limit is {max}")]
    TooLong {
        /// Its length in bytes.
        len: usize,
        /// The limit ([`crate::MAX_NOTIF_LEN`]).
        max: usize,
    },
    /// The message is not valid UTF-8.
    #[error("notification is not UTF-8 (invalid sequence at byte {offset})")]
    NotUtf8 {
        /// Where the first invalid sequence starts.
        offset: usize,
    },
    /// A request or engine id is empty (e.g. `HB:`, `HB:a,,b` or a trailing comma).
    #[error("empty {field} id at byte {offset}")]
    EmptyId {
        /// Where the id should start.
        offset: usize,
        /// Which id.
        field: Field,
    },
    /// An id is longer than the id limit (256 bytes).
    #[error("{field} id at byte {offset} is {len} bytes long; the limit is 256")]
    IdTooLong {
        /// Where the id starts.
        offset: usize,
        /// Its length.
        len: usize,
        /// Which id.
        field: Field,
    },
    /// An id holds a byte outside `[A-Za-z0-9-_.:@/+=]`.
    #[error("byte {byte:#04x} at {offset} is not allowed in a {field} id")]
    InvalidIdByte {
        /// Where the byte is.
        offset: usize,
        /// The byte.
        byte: u8,
        /// Which id.
        field: Field,
    },
    /// A heartbeat, a push heartbeat or an expiry notice names the same request twice.
    #[error("request id at byte {offset} repeats the one at byte {first}")]
    DuplicateId {
        /// Where the repetition starts.
        offset: usize,
        /// Where the first occurrence starts.
        first: usize,
    },
    /// A push registration names the same block twice (two writes would land in it).
    #[error("block at byte {offset} repeats the one at byte {first}")]
    DuplicateBlock {
        /// Where the repetition starts.
        offset: usize,
        /// Where the first occurrence starts.
        first: usize,
    },
    /// A number is empty, not canonical decimal (no sign, no leading zero), out of range
    /// or zero where zero is not allowed.
    #[error("bad {field} at byte {offset}")]
    BadNumber {
        /// Where the number starts.
        offset: usize,
        /// Which number.
        field: Field,
    },
    /// A push registration's prompt digest is not 32 lowercase hex digits (empty, another
    /// length, uppercase or another byte).
    #[error("bad prompt digest at byte {offset}: 32 lowercase hex digits expected")]
    BadDigest {
        /// Where the digest starts, or the first byte that is not a lowercase hex digit.
        offset: usize,
    },
    /// The message ends before a required field.
    #[error("notification ends at byte {offset}, before the {field} field")]
    Truncated {
        /// The message length (where the field should have started).
        offset: usize,
        /// The missing field.
        field: Field,
    },
    /// The message has more fields than its kind defines.
    #[error("unexpected data at byte {offset}")]
    TrailingData {
        /// Where the extra data starts.
        offset: usize,
    },
    /// `KVL<version>:` with a version this codec does not speak.
    #[error("unsupported notification format version {version} at byte {offset}")]
    UnsupportedVersion {
        /// Where the version starts.
        offset: usize,
        /// The version (saturated at `u32::MAX`).
        version: u32,
    },
    /// A known version with an unknown kind.
    #[error("unknown notification kind at byte {offset}")]
    UnknownKind {
        /// Where the kind starts.
        offset: usize,
    },
}

impl DecodeError {
    /// A stable snake_case name of the variant, for a metrics label.
    pub const fn label(&self) -> &'static str {
        match self {
            Self::TooLong { .. } => "too_long",
            Self::NotUtf8 { .. } => "not_utf8",
            Self::EmptyId { .. } => "empty_id",
            Self::IdTooLong { .. } => "id_too_long",
            Self::InvalidIdByte { .. } => "invalid_id_byte",
            Self::DuplicateId { .. } => "duplicate_id",
            Self::DuplicateBlock { .. } => "duplicate_block",
            Self::BadNumber { .. } => "bad_number",
            Self::BadDigest { .. } => "bad_digest",
            Self::Truncated { .. } => "truncated",
            Self::TrailingData { .. } => "trailing_data",
            Self::UnsupportedVersion { .. } => "unsupported_version",
            Self::UnknownKind { .. } => "unknown_kind",
        }
    }
}

/// Why a batch could not be encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// The requested message size cannot hold one entry of the longest allowed id, or is
    /// above [`crate::MAX_NOTIF_LEN`].
    #[error(
        "message size limit {max_len} is outside {min}..={max}",
        min = crate::MIN_SPLIT_LEN,
        max = crate::MAX_NOTIF_LEN
    )]
    BadMaxLen {
        /// The limit asked for.
        max_len: usize,
    },
    /// The message would be longer than [`crate::MAX_NOTIF_LEN`] and its kind is not split
    /// (a push registration with too many blocks).
    #[error("message would be {len} bytes long; the limit is {max}", max = crate::MAX_NOTIF_LEN)]
    TooLong {
        /// Its length in bytes.
        len: usize,
    },
}

/// Why a text is not a [`crate::PromptDigest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum InvalidDigest {
    /// Not 32 bytes long.
    #[error("a prompt digest is 32 lowercase hex digits, not {len} bytes")]
    Length {
        /// Its length in bytes.
        len: usize,
    },
    /// A byte that is not a lowercase hex digit (`[0-9a-f]`).
    #[error("byte {byte:#04x} at {position} is not a lowercase hex digit")]
    BadByte {
        /// The byte.
        byte: u8,
        /// Where it is in the digest's text.
        position: usize,
    },
}
