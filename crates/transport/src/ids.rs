//! The crate's shared ids and ranges: what every backend and the agent name regions,
//! peers, batches, senders and reads by. This module imports nothing of the crate, so any
//! module may import it.

/// Longest agent name, in bytes.
pub const MAX_NAME_LEN: usize = 1024;

/// A locally registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegionId(pub u64);

/// A connected peer (returned by [`Agent::connect`](crate::Agent::connect)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub(crate) u64);

/// A posted read batch: returned by [`Agent::post_read`](crate::Agent::post_read), and
/// by the verbs endpoint's `post_read_batch` (there it names a batch of that endpoint).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BatchId(pub(crate) u64);

/// A peer's name, as it announced it in its metadata and handshake.
pub type PeerName = String;

/// Who sent a notification: the name its connection proved, and the id of the session it
/// proved it with ([`Agent::bind_session`](crate::Agent::bind_session); `None`: the
/// cluster token, or no token at all).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Sender {
    /// The proven name.
    pub name: PeerName,
    /// [`Session::id`](kvlease_proto::auth::Session::id) of the session it proved.
    pub session: Option<u64>,
}

impl Sender {
    /// A sender that proved `name` without a session.
    pub fn unbound(name: impl Into<PeerName>) -> Self {
        Self {
            name: name.into(),
            session: None,
        }
    }
}

impl std::fmt::Display for Sender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.session {
            Some(id) => write!(f, "{} (session {id:016x})", self.name),
            None => f.write_str(&self.name),
        }
    }
}

/// A range in a locally registered region: a read's destination, a write's source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalRange {
    /// The local region.
    pub region: RegionId,
    /// Offset inside it.
    pub offset: u64,
    /// Bytes to read (or write).
    pub len: u64,
}

/// A source position in a peer's registered region (from its [`RegionDesc`](crate::RegionDesc)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRange {
    /// The peer's region id ([`RegionDesc::id`](crate::RegionDesc::id)).
    pub region: u64,
    /// The region's key ([`RegionDesc::key`](crate::RegionDesc::key)).
    pub key: u64,
    /// Offset inside the region.
    pub offset: u64,
}

/// One read: `local.len` bytes from `remote` into `local`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadOp {
    /// Destination.
    pub local: LocalRange,
    /// Source.
    pub remote: RemoteRange,
}

/// A read of one 8-byte generation word, performed only after every data read of the
/// batch completed; the batch fails with [`TransferError::FenceMismatch`](crate::TransferError::FenceMismatch) when the word
/// differs from `expected`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FenceRead {
    /// The word (8 bytes, 8-aligned, e.g. a `FenceTable` slot on the peer).
    pub remote: RemoteRange,
    /// The generation the reader was given.
    pub expected: u64,
}

/// A batch of reads from one peer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReadBatch {
    /// The reads (at least one).
    pub ops: Vec<ReadOp>,
    /// Sent to the peer only after every read (and the fence) completed and matched.
    pub notif: Option<Vec<u8>>,
    /// The fence read that ends the batch.
    pub fence: Option<FenceRead>,
}

/// The write fence: D's 8-byte generation word (in a region D registered, e.g. a
/// `FenceTable` slot) that must hold `expected` when a write's bytes land. D's receiver
/// checks it under the lock D's [`Agent::set_write_fence`](crate::Agent::set_write_fence)
/// takes, after the write's bytes arrived and before any of them lands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteFence {
    /// The word on the peer (8 bytes, 8-aligned, host memory).
    pub remote: RemoteRange,
    /// The generation of the reservation the write answers.
    pub expected: u64,
}

/// One write: `local.len` bytes from `local` (a source range of this agent) into
/// `remote` (a destination range the peer registered).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteOp {
    /// Source.
    pub local: LocalRange,
    /// Destination.
    pub remote: RemoteRange,
}

/// A batch of fenced writes to one peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteBatch {
    /// The writes (at least one).
    pub ops: Vec<WriteOp>,
    /// Sent to the peer only after every write landed.
    pub notif: Option<Vec<u8>>,
    /// The fence every write of the batch is checked against on the peer.
    pub fence: WriteFence,
}

/// Remote-write access D granted on a verbs link to one reservation's destination range
/// ([`Agent::grant_write`](crate::Agent::grant_write)), handed to P with the
/// reservation; P names it in
/// [`Agent::post_write_granted`](crate::Agent::post_write_granted). The rkey stands for
/// the generation: D revokes it when the generation's fence word changes, and a new
/// reservation gets a new rkey.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteGrant {
    /// D's region ([`RegionDesc::id`](crate::RegionDesc::id)).
    pub region: u64,
    /// Start of the granted range in the region.
    pub offset: u64,
    /// Length of the granted range.
    pub len: u64,
    /// The generation the range is granted for.
    pub generation: u64,
    /// The key of the range's remote-write registration.
    pub rkey: u32,
}

impl WriteGrant {
    /// Whether `len` bytes at `offset` of region `region` lie inside the grant.
    pub fn covers(&self, region: u64, offset: u64, len: u64) -> bool {
        let end = offset.checked_add(len);
        let grant_end = self.offset.checked_add(self.len);
        match (end, grant_end) {
            (Some(end), Some(grant_end)) => {
                region == self.region && offset >= self.offset && end <= grant_end
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::WriteGrant;

    #[test]
    fn a_grant_covers_exactly_its_range_of_its_region() {
        let g = WriteGrant {
            region: 3,
            offset: 4096,
            len: 8192,
            generation: 1,
            rkey: 9,
        };
        assert!(g.covers(3, 4096, 8192));
        assert!(g.covers(3, 8192, 4096));
        assert!(g.covers(3, 12_287, 1));
        assert!(!g.covers(3, 4095, 1), "before the range");
        assert!(!g.covers(3, 12_288, 1), "after the range");
        assert!(!g.covers(3, 4096, 8193), "past its end");
        assert!(!g.covers(4, 4096, 1), "another region");
        assert!(!g.covers(3, u64::MAX, 2), "an overflowing range");
        let at_end = WriteGrant {
            offset: u64::MAX - 1,
            len: 2,
            ..g
        };
        assert!(!at_end.covers(3, u64::MAX - 1, 1), "an overflowing grant");
    }
}
