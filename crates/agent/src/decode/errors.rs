//! D's typed errors: handshakes, read setup and verification. HTTP statuses are made only
//! at the edge ([`HandshakeFailure::to_api`]).

use super::*;

/// Why a read batch could not be set up or failed in the transport.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReadSetupError {
    /// No connection to that P worker.
    #[error("P worker {p_rank} is not connected")]
    NotConnected {
        /// The P worker.
        p_rank: u32,
    },
    /// A block or head range is outside a pool.
    #[error("{what}: {source}")]
    Layout {
        /// Which side.
        what: &'static str,
        /// The layout's error.
        #[source]
        source: kvlease_gpu_mem::LayoutError,
    },
    /// The transport refused the batch.
    #[error("posting the batch")]
    Post(#[source] kvlease_transport::TransferError),
    /// The transport failed the batch.
    #[error("reading")]
    Transfer(#[source] kvlease_transport::TransferError),
}

/// Why the bytes read did not verify.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VerifyError {
    /// A block could not be read back from the pool.
    #[error("reading back block {block}: {source}")]
    ReadBack {
        /// The block.
        block: u32,
        /// The pool's error.
        #[source]
        source: kvlease_gpu_mem::BlockCopyError,
    },
    /// A value differs from the one the tokens give.
    #[error("KV mismatch at layer {layer} position {pos} {half} head {head}")]
    Mismatch {
        /// Layer.
        layer: u32,
        /// Token position.
        pos: usize,
        /// `K` or `V`.
        half: &'static str,
        /// Head.
        head: u32,
    },
    /// The digest differs from P's.
    #[error("kv_digest mismatch: read {read}, P published {want}")]
    Digest {
        /// What was read.
        read: KvDigest,
        /// What P published.
        want: KvDigest,
    },
    /// A verify thread panicked.
    #[error("verify thread panicked")]
    Panicked,
}
