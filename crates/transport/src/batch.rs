//! Backend-neutral state of one read or write batch.
//!
//! A batch is split into data chunks; the backend completes them one by one
//! ([`Batch::lock`] + [`BatchState::chunk_done`]). When the last data chunk is done the
//! backend performs the fence read (if any), then sends the notification (if any), then
//! marks the batch done. A failure marks it failed at once; [`BatchState::in_receive`]
//! counts chunks whose bytes are being written into the destination (or, for a write
//! batch, sent from the source) right now, and the batch is reported failed only once
//! that is zero, so the caller never gets its memory back while a transfer into or out
//! of it is still running. A write batch has no fence read (the peer checks its fence
//! before each write lands) and completes a chunk when the peer acknowledges it.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::config::Backend;
use crate::error::TransferError;
use crate::ids::FenceRead;

/// What a finished batch moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchStats {
    /// Data bytes read or written (the fence word not included).
    pub bytes: u64,
    /// Read (or write) ops in the batch.
    pub ops: usize,
    /// The fence word read, when the batch had a fence.
    pub fence_word: Option<u64>,
    /// The backend that moved the bytes. A peer connected over verbs still has batches
    /// that touch memory verbs could not register (not even through a host mirror, or
    /// registered after connect) moved over TCP.
    pub backend: Backend,
}

/// Where a batch stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchStatus {
    /// Still running.
    Pending,
    /// Every read completed (and the fence matched); the notification was handed to the
    /// connection.
    Done(BatchStats),
    /// The batch failed; the destination bytes are unspecified. No transfer into them is
    /// running any more.
    Failed(TransferError),
}

/// Where a batch stands.
#[derive(Debug)]
pub(crate) enum BatchPhase {
    Running,
    Done(BatchStats),
    Failed(TransferError),
}

/// The mutable part of a batch.
#[derive(Debug)]
pub(crate) struct BatchState {
    /// Data chunks not yet completed.
    pub(crate) remaining: usize,
    /// Chunks currently being received into their destination (reads) or sent from
    /// their source (writes).
    pub(crate) in_receive: usize,
    /// The fence read, taken when it is posted.
    pub(crate) fence: Option<FenceRead>,
    /// The notification, taken when it is sent.
    pub(crate) notif: Option<Vec<u8>>,
    pub(crate) phase: BatchPhase,
    pub(crate) bytes: u64,
    pub(crate) ops: usize,
    pub(crate) fence_word: Option<u64>,
    /// The backend that moves the bytes (TCP unless the verbs link posts it to its
    /// queue pair).
    pub(crate) backend: Backend,
}

/// What the backend must do after a data chunk completed.
#[derive(Debug)]
pub(crate) enum Next {
    /// More chunks outstanding, or the batch already ended.
    Nothing,
    /// Post this fence read, then call [`BatchState::fence_done`] with the word.
    Fence(FenceRead),
    /// All reads done: send this notification, then call [`BatchState::finish`].
    Notify(Vec<u8>),
    /// All reads done, nothing to send: call [`BatchState::finish`].
    Finish,
}

impl BatchState {
    pub(crate) fn is_running(&self) -> bool {
        matches!(self.phase, BatchPhase::Running)
    }

    /// Records a completed data chunk of `bytes` bytes.
    pub(crate) fn chunk_done(&mut self, bytes: u64) -> Next {
        if !self.is_running() {
            return Next::Nothing;
        }
        self.bytes += bytes;
        self.remaining = self.remaining.saturating_sub(1);
        if self.remaining > 0 {
            return Next::Nothing;
        }
        self.after_reads()
    }

    /// Records the fence word read after all data.
    pub(crate) fn fence_done(&mut self, peer: &str, expected: u64, found: u64) -> Next {
        if !self.is_running() {
            return Next::Nothing;
        }
        self.fence_word = Some(found);
        if found != expected {
            self.phase = BatchPhase::Failed(TransferError::FenceMismatch {
                peer: peer.to_owned(),
                expected,
                found,
            });
            return Next::Nothing;
        }
        self.after_reads()
    }

    fn after_reads(&mut self) -> Next {
        if let Some(fence) = self.fence.take() {
            return Next::Fence(fence);
        }
        match self.notif.take() {
            Some(n) => Next::Notify(n),
            None => Next::Finish,
        }
    }

    /// Marks the batch done (after its notification, if any, was handed to the link).
    pub(crate) fn finish(&mut self) {
        if self.is_running() {
            self.phase = BatchPhase::Done(BatchStats {
                bytes: self.bytes,
                ops: self.ops,
                fence_word: self.fence_word,
                backend: self.backend,
            });
        }
    }

    /// Fails the batch unless it already ended. Returns whether this call failed it.
    pub(crate) fn fail(&mut self, err: TransferError) -> bool {
        if self.is_running() {
            self.phase = BatchPhase::Failed(err);
            true
        } else {
            false
        }
    }
}

/// One posted batch.
#[derive(Debug)]
pub(crate) struct Batch {
    pub(crate) id: u64,
    pub(crate) peer: String,
    pub(crate) timeout: Duration,
    pub(crate) deadline: Instant,
    state: Mutex<BatchState>,
    /// Mirrors "ended and nothing in receive", so that pollers need not take the lock
    /// (a spinning poller would otherwise starve the connection threads of it).
    settled: AtomicBool,
}

/// The locked state; updates [`Batch::is_settled`] when released.
pub(crate) struct BatchGuard<'a> {
    guard: MutexGuard<'a, BatchState>,
    settled: &'a AtomicBool,
}

impl Deref for BatchGuard<'_> {
    type Target = BatchState;
    fn deref(&self) -> &BatchState {
        &self.guard
    }
}

impl DerefMut for BatchGuard<'_> {
    fn deref_mut(&mut self) -> &mut BatchState {
        &mut self.guard
    }
}

impl Drop for BatchGuard<'_> {
    fn drop(&mut self) {
        let settled = !self.guard.is_running() && self.guard.in_receive == 0;
        self.settled.store(settled, Ordering::Release);
    }
}

impl Batch {
    pub(crate) fn new(
        id: u64,
        peer: String,
        timeout: Duration,
        chunks: usize,
        ops: usize,
        fence: Option<FenceRead>,
        notif: Option<Vec<u8>>,
    ) -> Self {
        let now = Instant::now();
        Self {
            id,
            peer,
            timeout,
            // A timeout too large for `Instant` means "a century".
            deadline: now
                .checked_add(timeout)
                .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 86_400)))
                .unwrap_or(now),
            state: Mutex::new(BatchState {
                remaining: chunks,
                in_receive: 0,
                fence,
                notif,
                phase: BatchPhase::Running,
                bytes: 0,
                ops,
                fence_word: None,
                backend: Backend::Tcp,
            }),
            settled: AtomicBool::new(false),
        }
    }

    /// Whether the batch ended and no transfer into its memory is running.
    pub(crate) fn is_settled(&self) -> bool {
        self.settled.load(Ordering::Acquire)
    }

    /// Locks the state. A panic while holding the lock cannot leave it inconsistent in a
    /// way that matters more than failing the batch, so poisoning is ignored.
    pub(crate) fn lock(&self) -> BatchGuard<'_> {
        BatchGuard {
            guard: self
                .state
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
            settled: &self.settled,
        }
    }
}
