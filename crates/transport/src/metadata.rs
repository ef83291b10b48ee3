//! The agent metadata a peer loads to connect: versioned JSON.
//!
//! ```json
//! {"format":1,"name":"prefill-0","tcp_addr":"10.0.0.5:7000","auth":true,
//!  "regions":[{"id":1,"base":140230000000000,"len":1048576,"key":1234,"kind":"host"}],
//!  "backends":{"verbs":{...}}}
//! ```
//!
//! `backends` is the extension point: each backend stores what its peers need (the verbs
//! backend: GID, port, QP numbers; the shm backend: `{"host": <boot id>/<net namespace>,
//! "socket": <abstract Unix socket name>}`) under its own key through
//! `Context::set_backend_metadata`, and reads the peer's entry on connect. Unknown keys are
//! ignored, so an agent without a backend still reads metadata of one that has it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::MetadataError;
use crate::ids::RemoteRange;

/// The metadata format this build writes and reads.
pub const METADATA_FORMAT: u32 = 1;

/// A registered region as peers see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RegionDesc {
    /// Region id, unique per agent.
    pub id: u64,
    /// Base address of the region in the owner's address space (the remote address for
    /// verbs; informational for TCP, where offsets are relative to the region).
    pub base: u64,
    /// Length in bytes.
    pub len: u64,
    /// The key a reader must present: random per registration for TCP, the rkey for verbs.
    pub key: u64,
}

/// A peer's metadata, as decoded by [`Agent::connect`](crate::Agent::connect) (also
/// available to callers through [`decode_metadata`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentMetadata {
    /// Format version ([`METADATA_FORMAT`]).
    pub format: u32,
    /// The agent's name.
    pub name: String,
    /// Its TCP data/control address.
    pub tcp_addr: String,
    /// Whether it requires the cluster token.
    pub auth: bool,
    /// Its registered regions.
    pub regions: Vec<RegionDesc>,
    /// Backend-specific entries, by backend name.
    #[serde(default)]
    pub backends: BTreeMap<String, serde_json::Value>,
}

/// Decodes metadata bytes produced by [`Agent::metadata`](crate::Agent::metadata).
///
/// # Errors
/// [`MetadataError::Invalid`] for bytes that are not metadata JSON,
/// [`MetadataError::Version`] for another format version.
pub fn decode_metadata(bytes: &[u8]) -> Result<AgentMetadata, MetadataError> {
    #[derive(Deserialize)]
    struct Version {
        format: u32,
    }
    let version: Version = serde_json::from_slice(bytes).map_err(MetadataError::Invalid)?;
    if version.format != METADATA_FORMAT {
        return Err(MetadataError::Version {
            found: version.format,
            supported: METADATA_FORMAT,
        });
    }
    serde_json::from_slice(bytes).map_err(MetadataError::Invalid)
}

pub(crate) fn encode_metadata(meta: &AgentMetadata) -> Vec<u8> {
    // Serialising plain strings, integers and `serde_json::Value`s cannot fail.
    serde_json::to_vec(meta).unwrap_or_default()
}

impl RegionDesc {
    /// The position `offset` bytes into this region.
    pub fn at(&self, offset: u64) -> RemoteRange {
        RemoteRange {
            region: self.id,
            key: self.key,
            offset,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_version_check() {
        let meta = AgentMetadata {
            format: METADATA_FORMAT,
            name: "p0".into(),
            tcp_addr: "127.0.0.1:9".into(),
            auth: false,
            regions: vec![RegionDesc {
                id: 1,
                base: 4096,
                len: 10,
                key: u64::MAX,
            }],
            backends: BTreeMap::from([("verbs".into(), serde_json::json!({"gid": "fe80::1"}))]),
        };
        let bytes = encode_metadata(&meta);
        assert_eq!(decode_metadata(&bytes).expect("round trip"), meta);
        let future = String::from_utf8(bytes)
            .expect("json is utf-8")
            .replace("\"format\":1", "\"format\":2");
        assert!(matches!(
            decode_metadata(future.as_bytes()),
            Err(MetadataError::Version { found: 2, .. })
        ));
        assert!(matches!(
            decode_metadata(b"\xff"),
            Err(MetadataError::Invalid(_))
        ));
    }
}
