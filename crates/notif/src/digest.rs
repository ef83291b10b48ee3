//! [`PromptDigest`]: a 128-bit digest of a prompt's token ids, opaque to this crate.

use std::fmt;
use std::str::FromStr;

use crate::error::InvalidDigest;

/// A 128-bit digest of a prompt's token ids, written as 32 lowercase hex digits.
///
/// Push mode matches P's leg and D's registration by transfer id; when the transfer id
/// comes from a client-controlled request id it can repeat, so both sides may carry a
/// digest of their prompt and P refuses a registration whose digest differs from its
/// leg's (docs/spec.md, "Push mode"). How the digest is computed is the caller's business
/// (the vLLM connector computes it in Python); this crate only carries and compares it.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PromptDigest([u8; 16]);

/// The length of a digest's text: 32 hex digits.
pub const PROMPT_DIGEST_LEN: usize = 32;

impl PromptDigest {
    /// The digest of these 16 bytes (big-endian: the first byte is the first two digits).
    #[must_use]
    pub const fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }

    /// The digest's 16 bytes.
    #[must_use]
    pub const fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// Parses exactly 32 lowercase hex digits (`[0-9a-f]{32}`), the only form the wire
    /// format writes: uppercase digits, a sign, a prefix, spaces or another length are
    /// refused.
    ///
    /// # Errors
    /// [`InvalidDigest::Length`] when `text` is not 32 bytes long,
    /// [`InvalidDigest::BadByte`] naming the first byte that is not a lowercase hex digit.
    pub fn parse(text: &str) -> Result<Self, InvalidDigest> {
        let bytes = text.as_bytes();
        if bytes.len() != PROMPT_DIGEST_LEN {
            return Err(InvalidDigest::Length { len: bytes.len() });
        }
        let mut out = [0u8; 16];
        for (i, pair) in bytes.chunks_exact(2).enumerate() {
            let high = hex_value(pair[0]).ok_or(InvalidDigest::BadByte {
                byte: pair[0],
                position: 2 * i,
            })?;
            let low = hex_value(pair[1]).ok_or(InvalidDigest::BadByte {
                byte: pair[1],
                position: 2 * i + 1,
            })?;
            out[i] = (high << 4) | low;
        }
        Ok(Self(out))
    }

    /// Appends the 32 lowercase hex digits to `out`.
    pub(crate) fn write_hex(&self, out: &mut Vec<u8>) {
        for byte in self.0 {
            out.push(HEX[usize::from(byte >> 4)]);
            out.push(HEX[usize::from(byte & 0xf)]);
        }
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// The value of a lowercase hex digit.
fn hex_value(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        _ => None,
    }
}

impl FromStr for PromptDigest {
    type Err = InvalidDigest;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for PromptDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for byte in self.0 {
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for PromptDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PromptDigest({self})")
    }
}
