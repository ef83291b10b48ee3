//! D's typed errors: handshakes, read setup and verification. HTTP statuses are made only
//! at the edge ([`handshake_api`]).

use super::*;

/// The core's kind of a failed handshake ([`HandshakeError`]), carrying the shell's error
/// for the message.
pub(super) fn handshake_error(e: HandshakeFailure) -> HandshakeError {
    let kind = match &e {
        HandshakeFailure::Auth { .. } => HandshakeError::Auth,
        HandshakeFailure::NotAllowed { .. } => HandshakeError::NotAllowed,
        HandshakeFailure::Connect { .. } | HandshakeFailure::Thread => HandshakeError::Connect,
        // P was there and busy (its caps full, or it cut us off to make room): retry.
        HandshakeFailure::SideChannel { source, .. } if source.is_transient() => {
            HandshakeError::Connect
        }
        HandshakeFailure::SideChannel { .. }
        | HandshakeFailure::BadInfo { .. }
        | HandshakeFailure::WrongEngine { .. }
        | HandshakeFailure::Shape { .. }
        | HandshakeFailure::TpSize { .. }
        | HandshakeFailure::InstanceAhead { .. }
        | HandshakeFailure::Metadata { .. } => HandshakeError::NotFound,
    };
    kind(Arc::new(e))
}

/// The HTTP answer to a failed handshake (the one mapping of a [`HandshakeFailure`], by the
/// kind [`handshake_error`] gave it); `None` for P's TP size, which the core refused (it
/// answers as a failed load). A P that was there but busy, or whose workers could not be
/// connected, is a retryable 503 `kv_load_failed` with `Retry-After`.
pub(super) fn handshake_api(e: &HandshakeError) -> Option<ApiError> {
    match e {
        HandshakeError::Auth(_) => Some(ApiError::new(
            StatusCode::FORBIDDEN,
            "peer_auth_failed",
            e.to_string(),
        )),
        HandshakeError::NotAllowed(_) => Some(ApiError::new(
            StatusCode::FORBIDDEN,
            "prefill_host_not_allowed",
            e.to_string(),
        )),
        // P was reachable but its side channel or workers were busy (or went away): a
        // retry (from prefill: the proxy's) may succeed.
        HandshakeError::Connect(_) => {
            Some(ApiError::kv_load_failed(e.to_string()).retry_after(Duration::from_secs(1)))
        }
        HandshakeError::NotFound(_) | HandshakeError::Other(_) => Some(ApiError::bad_field(
            "kv_transfer_params.remote_engine_id",
            e.to_string(),
        )),
        HandshakeError::TpSize { .. } => None,
    }
}

/// Why a read batch could not be set up or failed in the transport.
#[derive(Debug, thiserror::Error)]
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
