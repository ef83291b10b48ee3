//! Identifier newtypes shared by every kvlease crate.

use std::fmt;
use std::num::NonZeroU64;
use std::sync::Arc;

/// Longest identifier accepted, in bytes.
pub const MAX_ID_LEN: usize = 256;

/// Why a string is not a valid [`RequestId`] or [`EngineId`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidId {
    /// The identifier is empty.
    #[error("identifier is empty")]
    Empty,
    /// The identifier is longer than [`MAX_ID_LEN`] bytes.
    #[error("identifier is {len} bytes long; the limit is {MAX_ID_LEN}")]
    TooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// The identifier holds a byte outside the allowed set.
    #[error(
        "identifier holds byte {byte:#04x} at {position}; allowed: ASCII letters, digits and `-_.:@/+=`"
    )]
    BadByte {
        /// The offending byte.
        byte: u8,
        /// Its position.
        position: usize,
    },
}

fn validate(s: &str) -> Result<(), InvalidId> {
    if s.is_empty() {
        return Err(InvalidId::Empty);
    }
    if s.len() > MAX_ID_LEN {
        return Err(InvalidId::TooLong { len: s.len() });
    }
    for (position, &byte) in s.as_bytes().iter().enumerate() {
        if !(byte.is_ascii_alphanumeric() || b"-_.:@/+=".contains(&byte)) {
            return Err(InvalidId::BadByte { byte, position });
        }
    }
    Ok(())
}

macro_rules! string_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        ///
        /// Holds 1 to [`MAX_ID_LEN`] bytes of ASCII letters, digits and `-_.:@/+=`, so that
        /// it can be written into any notification without escaping. Cloning is cheap.
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(Arc<str>);

        impl $name {
            /// Checks `s` and wraps it.
            ///
            /// # Errors
            /// [`InvalidId`] when `s` is empty, too long or holds a byte outside the set.
            pub fn new(s: &str) -> Result<Self, InvalidId> {
                validate(s)?;
                Ok(Self(Arc::from(s)))
            }

            /// The identifier as a string.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({:?})", stringify!($name), &*self.0)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl std::str::FromStr for $name {
            type Err = InvalidId;
            fn from_str(s: &str) -> Result<Self, InvalidId> {
                Self::new(s)
            }
        }

        impl std::borrow::Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        #[cfg(feature = "serde")]
        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&self.0)
            }
        }

        /// Deserializing validates: an invalid id is an error naming why.
        #[cfg(feature = "serde")]
        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = <std::borrow::Cow<'de, str> as serde::Deserialize>::deserialize(d)?;
                Self::new(&s).map_err(serde::de::Error::custom)
            }
        }
    };
}

string_id!(
    /// A request's identifier, as the serving engine names it (vLLM's `request_id`).
    RequestId
);
string_id!(
    /// An engine instance's identifier (vLLM's `engine_id` / `remote_engine_id`).
    EngineId
);

/// Who reported a read: one rank (TP worker) of a reading engine.
///
/// With heterogeneous tensor parallelism several ranks of one decode engine read the same
/// request from P; P frees the blocks after the expected number of *distinct* consumers
/// reported, so a duplicate report from the same rank counts once.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConsumerId {
    /// The reading engine.
    pub engine: EngineId,
    /// The reader's rank within that engine.
    pub rank: u32,
}

impl ConsumerId {
    /// Names rank `rank` of engine `engine`.
    pub fn new(engine: EngineId, rank: u32) -> Self {
        Self { engine, rank }
    }
}

impl fmt::Display for ConsumerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.engine, self.rank)
    }
}

/// The index of a KV block in a block pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

/// A lease's fencing token.
///
/// Every grant gets a fresh generation, never zero and never reused by the same table, so a
/// reader that compares the generation it was given with the one published next to the
/// blocks detects after the fact that the lease was released (and maybe the blocks reused).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Generation(pub NonZeroU64);

impl Generation {
    /// The published word of blocks that no lease holds.
    pub const FREE_WORD: u64 = 0;

    /// The generation as the `u64` word published in the fence region.
    pub fn word(self) -> u64 {
        self.0.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_accept_vllm_style_names_and_reject_others() {
        assert!(RequestId::new("cmpl-3f2a_9.0").is_ok());
        assert!(RequestId::new("chatcmpl-abc:rank/1+x=y@z").is_ok());
        assert_eq!(RequestId::new(""), Err(InvalidId::Empty));
        assert_eq!(
            RequestId::new("a,b"),
            Err(InvalidId::BadByte {
                byte: b',',
                position: 1
            })
        );
        assert_eq!(
            EngineId::new(&"x".repeat(MAX_ID_LEN + 1)),
            Err(InvalidId::TooLong {
                len: MAX_ID_LEN + 1
            })
        );
        assert!(EngineId::new(&"x".repeat(MAX_ID_LEN)).is_ok());
        assert!(RequestId::new("é").is_err());
    }
}
