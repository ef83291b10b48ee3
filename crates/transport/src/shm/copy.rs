//! The copies of a shared-memory batch, and of writes a peer asked this process to pull
//! from its memory: on the posting (or receiving) thread, with a process-wide pool of
//! helper threads for large batches.
//!
//! Why on the posting thread: a hand-off to another thread costs a wake-up (a few µs,
//! more on a loaded host) per batch, and the poster usually has nothing better to do than
//! wait for the batch. Why a pool for large batches only: one thread copies at about
//! memory speed; a second core helps a large batch, but the wake-ups cost more than they
//! save on a small one. The pool is started on first use, holds at most
//! [`MAX_COPY_THREADS`]` - 1` threads and never more than the host's cores minus one,
//! and lives as long as the process (its threads sleep on a channel when idle).
//!
//! A large batch is cut into chunks of about [`CHUNK_BYTES`] (whole copies, in order) that
//! the poster and the helpers claim one at a time until none is left: a helper that starts
//! late, or a core taken by another process, leaves more chunks to the others instead of
//! a fixed half the batch waits for. The poster then waits for the chunks the helpers
//! still copy (at most one each), so the batch is complete when
//! [`Agent::post_read`](crate::Agent::post_read) returns, with no sleep in a poll loop
//! between the last byte and the caller.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use crossbeam_channel::Sender;
use kvlease_gpu_mem::{CmaError, CmaRead, DmaRegion, MAX_CMA_IOVECS, read_vectored};

use super::mapped::{CopyError, Source};
use crate::batch::Batch;
use crate::error::TransferError;
use crate::sync::lock;

/// Batches with more data bytes than this are split between the posting thread and the
/// copy pool.
pub(crate) const SPLIT_BYTES: u64 = 8 << 20;

/// About how many bytes one claim of a split batch copies (whole copies: one larger than
/// this is a chunk of its own).
pub(crate) const CHUNK_BYTES: u64 = 2 << 20;

/// Most bytes of cma copies one `process_vm_readv` call takes.
const CMA_CALL_BYTES: u64 = 64 << 20;

/// Most threads copying one batch (the posting thread included).
pub(crate) const MAX_COPY_THREADS: usize = 4;

/// What the link does when copies end: the copy code calls back into it and knows
/// nothing else of the link.
pub(super) trait Completion: Send + Sync + std::fmt::Debug {
    /// Ends a batch whose copies all finished (`copied`: none was cut short).
    fn complete(&self, batch: &Arc<Batch>, copies: &[CopyOp], copied: bool);

    /// The kernel refused a cross-memory read: later reads of such regions go elsewhere.
    fn cma_refused(&self, err: &CmaError);
}

/// One data copy: `len` bytes at `src_offset` of a peer's memory into `dest` at
/// `dest_offset` (a batch's read, or a write the peer asked this process to pull).
#[derive(Debug)]
pub(super) struct CopyOp {
    pub(super) src: Arc<Source>,
    pub(super) src_offset: u64,
    pub(super) dest: Arc<dyn DmaRegion>,
    pub(super) dest_offset: u64,
    pub(super) len: u64,
}

/// Copies cut into chunks that several threads claim ([`split`]).
trait Chunked: Send + Sync {
    /// How many chunks there are.
    fn count(&self) -> usize;

    /// Copies chunk `i`; false when it was cut short.
    fn copy(&self, i: usize) -> bool;

    /// Runs once, on the thread that finished the last chunk (`copied`: none was cut
    /// short), before [`split`] returns.
    fn done(&self, copied: bool);
}

/// Chunked work that several threads claim; the thread that finishes the last chunk
/// ends it.
struct Job {
    work: Arc<dyn Chunked>,
    /// The next chunk to claim (past the end once every chunk was claimed).
    next: AtomicUsize,
    /// Chunks not yet copied.
    left: AtomicUsize,
    copied: AtomicBool,
    /// Set (under the mutex) once the work was ended.
    done: Mutex<bool>,
    done_cv: Condvar,
}

impl Job {
    /// Claims and copies chunks until none is left unclaimed.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.work.count() {
                return;
            }
            if !self.work.copy(i) {
                self.copied.store(false, Ordering::Relaxed);
            }
            // AcqRel: the last chunk's thread sees every other chunk's copies (and
            // `copied`) as done.
            if self.left.fetch_sub(1, Ordering::AcqRel) == 1 {
                self.work.done(self.copied.load(Ordering::Relaxed));
                *lock(&self.done) = true;
                self.done_cv.notify_all();
                return;
            }
        }
    }

    /// Waits until the work was ended (by this thread or another).
    fn wait(&self) {
        let mut done = lock(&self.done);
        while !*done {
            done = self
                .done_cv
                .wait(done)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }
}

/// The process-wide helper threads.
struct Pool {
    tx: Sender<Arc<Job>>,
    threads: usize,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let want = std::thread::available_parallelism()
            .map_or(1, usize::from)
            .min(MAX_COPY_THREADS)
            .saturating_sub(1);
        let (tx, rx) = crossbeam_channel::unbounded::<Arc<Job>>();
        let mut threads = 0;
        for _ in 0..want {
            let rx = rx.clone();
            let spawned = std::thread::Builder::new()
                .name("kvl-shm-copy".into())
                .spawn(move || {
                    while let Ok(job) = rx.recv() {
                        job.work();
                    }
                });
            match spawned {
                Ok(_) => threads += 1,
                Err(err) => {
                    tracing::warn!(%err, "shm copy pool: starting a thread failed");
                    break;
                }
            }
        }
        Pool { tx, threads }
    })
}

/// The chunks `copies` is cut into: chunks of about [`CHUNK_BYTES`] when they hold more
/// than [`SPLIT_BYTES`] and the pool has threads, else one.
fn chunks_of(copies: &[CopyOp]) -> Vec<Range<usize>> {
    let total: u64 = copies.iter().map(|c| c.len).sum();
    if total > SPLIT_BYTES && pool().threads > 0 {
        chunks(copies, CHUNK_BYTES)
    } else {
        std::iter::once(0..copies.len()).collect()
    }
}

/// Copies `work`'s chunks and ends it before it returns: on this thread, with the pool's
/// help when there is more than one chunk.
fn split(work: Arc<dyn Chunked>) {
    let helpers = match work.count() {
        0 | 1 => 0,
        n => pool().threads.min(n - 1),
    };
    if helpers == 0 {
        let mut copied = true;
        for i in 0..work.count() {
            copied &= work.copy(i);
        }
        work.done(copied);
        return;
    }
    let job = Arc::new(Job {
        left: AtomicUsize::new(work.count()),
        work,
        next: AtomicUsize::new(0),
        copied: AtomicBool::new(true),
        done: Mutex::new(false),
        done_cv: Condvar::new(),
    });
    for _ in 0..helpers {
        // The pool's threads are gone (cannot happen while the process lives): this
        // thread copies every chunk.
        if pool().tx.send(job.clone()).is_err() {
            break;
        }
    }
    job.work();
    job.wait();
}

/// A batch's reads.
struct BatchCopies<C> {
    core: Arc<C>,
    batch: Arc<Batch>,
    copies: Vec<CopyOp>,
    chunks: Vec<Range<usize>>,
}

impl<C: Completion> Chunked for BatchCopies<C> {
    fn count(&self) -> usize {
        self.chunks.len()
    }

    fn copy(&self, i: usize) -> bool {
        let copies = &self.copies[self.chunks[i].clone()];
        let batch = &self.batch;
        match copy_in_order(copies, || batch.lock().is_running()) {
            Ok(copied) => copied,
            Err(err) => {
                // The kernel refused cross-memory attach between the batch's probe and
                // this copy (the peer named another ptracer meanwhile): later batches go
                // over TCP.
                if let CopyError::Cma(err) = &err
                    && err.is_refusal()
                {
                    self.core.cma_refused(err);
                }
                // Both ranges were checked at post time; fail rather than panic.
                batch.lock().fail(TransferError::LocalCopy {
                    peer: batch.peer.clone(),
                    reason: err.to_string(),
                });
                false
            }
        }
    }

    fn done(&self, copied: bool) {
        self.core.complete(&self.batch, &self.copies, copied);
    }
}

/// Copies `copies` into their destinations and completes `batch` (whose `in_receive`
/// the caller raised by one) before it returns: on this thread, with the pool's help
/// when the batch holds more than [`SPLIT_BYTES`].
pub(super) fn run<C: Completion + 'static>(core: &Arc<C>, batch: &Arc<Batch>, copies: Vec<CopyOp>) {
    split(Arc::new(BatchCopies {
        core: core.clone(),
        batch: batch.clone(),
        chunks: chunks_of(&copies),
        copies,
    }));
}

/// Writes pulled together.
struct PullCopies {
    copies: Vec<CopyOp>,
    chunks: Vec<Range<usize>>,
    /// Set when a copy failed.
    failed: AtomicBool,
}

impl Chunked for PullCopies {
    fn count(&self) -> usize {
        self.chunks.len()
    }

    fn copy(&self, i: usize) -> bool {
        let copies = &self.copies[self.chunks[i].clone()];
        // One failure is enough: the caller copies each again to learn which.
        let copied = copy_in_order(copies, || !self.failed.load(Ordering::Relaxed))
            .is_ok_and(|copied| copied);
        if !copied {
            self.failed.store(true, Ordering::Relaxed);
        }
        copied
    }

    fn done(&self, _: bool) {}
}

/// Copies `copies` (writes pulled from a peer) into their destinations before it
/// returns, as a batch's reads are copied: on this thread, with the pool's help when they
/// hold more than [`SPLIT_BYTES`], consecutive cma copies in one system call. Returns
/// false when any copy failed: the destinations' bytes are then unspecified.
pub(super) fn pull(copies: Vec<CopyOp>) -> bool {
    let work = Arc::new(PullCopies {
        chunks: chunks_of(&copies),
        copies,
        failed: AtomicBool::new(false),
    });
    split(work.clone());
    !work.failed.load(Ordering::Relaxed)
}

/// `copies` cut into contiguous groups of at least `bytes` bytes each (the last one may
/// hold less).
fn chunks(copies: &[CopyOp], bytes: u64) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut acc = 0;
    for (i, c) in copies.iter().enumerate() {
        acc += c.len;
        if acc >= bytes {
            out.push(start..i + 1);
            start = i + 1;
            acc = 0;
        }
    }
    if start < copies.len() {
        out.push(start..copies.len());
    }
    out
}

/// Copies `copies` in order, consecutive cma copies in one vectored system call, while
/// `go_on` holds before each call. `Ok(false)` when it stopped holding: the caller's
/// memory must not be written any further.
fn copy_in_order(copies: &[CopyOp], go_on: impl Fn() -> bool) -> Result<bool, CopyError> {
    let mut rest = copies;
    while !rest.is_empty() {
        if !go_on() {
            return Ok(false);
        }
        let cma = cma_run(rest);
        let done = if cma.len() > 1 {
            read_vectored(&cma)?;
            cma.len()
        } else {
            let c = &rest[0];
            c.src
                .copy_to(c.src_offset, c.dest.as_ref(), c.dest_offset, c.len)?;
            1
        };
        rest = &rest[done..];
    }
    Ok(true)
}

/// The cma copies at the start of `copies`, as reads of one `process_vm_readv`: at most
/// [`MAX_CMA_IOVECS`] and [`CMA_CALL_BYTES`] (so that a stopped batch is seen between
/// calls), at least one when the first copy is a cma one.
fn cma_run(copies: &[CopyOp]) -> Vec<CmaRead<'_>> {
    let mut reads = Vec::new();
    let mut bytes = 0u64;
    for c in copies.iter().take(MAX_CMA_IOVECS) {
        let Source::Cma(src) = c.src.as_ref() else {
            break;
        };
        if !reads.is_empty() && bytes + c.len > CMA_CALL_BYTES {
            break;
        }
        bytes += c.len;
        reads.push(CmaRead {
            src,
            offset: c.src_offset,
            dst: c.dest.as_ref(),
            dst_offset: c.dest_offset,
            len: c.len,
        });
    }
    reads
}
