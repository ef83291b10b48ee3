//! The copies of a shared-memory batch: on the posting thread, with a process-wide pool of
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

use super::mapped::{CopyError, MappedRegion, Source};
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

/// One data copy of a batch.
#[derive(Debug)]
pub(super) struct CopyOp {
    pub(super) src: Arc<MappedRegion>,
    pub(super) src_offset: u64,
    pub(super) dest: Arc<dyn DmaRegion>,
    pub(super) dest_offset: u64,
    pub(super) len: u64,
}

/// A batch cut into chunks that several threads claim; the thread that finishes the last
/// chunk completes the batch.
#[derive(Debug)]
struct Job {
    core: Arc<dyn Completion>,
    batch: Arc<Batch>,
    copies: Vec<CopyOp>,
    chunks: Vec<Range<usize>>,
    /// The next chunk to claim (past the end once every chunk was claimed).
    next: AtomicUsize,
    /// Chunks not yet copied.
    left: AtomicUsize,
    copied: AtomicBool,
    /// Set (under the mutex) once the batch was completed.
    done: Mutex<bool>,
    done_cv: Condvar,
}

impl Job {
    /// Claims and copies chunks until none is left unclaimed.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(range) = self.chunks.get(i).cloned() else {
                return;
            };
            if !copy_some(self.core.as_ref(), &self.batch, &self.copies[range]) {
                self.copied.store(false, Ordering::Relaxed);
            }
            // AcqRel: the last chunk's thread sees every other chunk's copies (and
            // `copied`) as done.
            if self.left.fetch_sub(1, Ordering::AcqRel) == 1 {
                let copied = self.copied.load(Ordering::Relaxed);
                self.core.complete(&self.batch, &self.copies, copied);
                *lock(&self.done) = true;
                self.done_cv.notify_all();
                return;
            }
        }
    }

    /// Waits until the batch was completed (by this thread or another).
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
#[derive(Debug)]
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

/// Copies `copies` into their destinations and completes `batch` (whose `in_receive`
/// the caller raised by one) before it returns: on this thread, with the pool's help
/// when the batch holds more than [`SPLIT_BYTES`].
pub(super) fn run<C: Completion + 'static>(core: &Arc<C>, batch: &Arc<Batch>, copies: Vec<CopyOp>) {
    let total: u64 = copies.iter().map(|c| c.len).sum();
    let chunks = if total > SPLIT_BYTES && pool().threads > 0 {
        chunks(&copies, CHUNK_BYTES)
    } else {
        Vec::new()
    };
    let helpers = match chunks.len() {
        0 | 1 => 0,
        n => pool().threads.min(n - 1),
    };
    if helpers == 0 {
        let copied = copy_some(core.as_ref(), batch, &copies);
        core.complete(batch, &copies, copied);
        return;
    }
    let job = Arc::new(Job {
        core: core.clone() as Arc<dyn Completion>,
        batch: batch.clone(),
        left: AtomicUsize::new(chunks.len()),
        chunks,
        next: AtomicUsize::new(0),
        copies,
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

/// Copies `copies` in order. Returns false when the batch stopped running meanwhile
/// (failed or timed out): the caller's memory must not be written any further.
fn copy_some(core: &dyn Completion, batch: &Batch, copies: &[CopyOp]) -> bool {
    let mut rest = copies;
    while !rest.is_empty() {
        if !batch.lock().is_running() {
            return false;
        }
        // Consecutive cma copies go in one vectored system call; others one by one.
        let cma = cma_run(rest);
        let (done, result) = if cma.len() > 1 {
            let n = cma.len();
            (n, read_vectored(&cma).map_err(CopyError::from))
        } else {
            let c = &rest[0];
            (
                1,
                c.src
                    .source
                    .copy_to(c.src_offset, c.dest.as_ref(), c.dest_offset, c.len),
            )
        };
        if let Err(err) = result {
            // The kernel refused cross-memory attach between the batch's probe and this
            // copy (the peer named another ptracer meanwhile): later batches go over TCP.
            if let CopyError::Cma(err) = &err
                && err.is_refusal()
            {
                core.cma_refused(err);
            }
            // Both ranges were checked at post time; fail rather than panic.
            batch.lock().fail(TransferError::LocalCopy {
                peer: batch.peer.clone(),
                reason: err.to_string(),
            });
            return false;
        }
        rest = &rest[done..];
    }
    true
}

/// The cma copies at the start of `copies`, as reads of one `process_vm_readv`: at most
/// [`MAX_CMA_IOVECS`] and [`CMA_CALL_BYTES`] (so that a stopped batch is seen between
/// calls), at least one when the first copy is a cma one.
fn cma_run(copies: &[CopyOp]) -> Vec<CmaRead<'_>> {
    let mut reads = Vec::new();
    let mut bytes = 0u64;
    for c in copies.iter().take(MAX_CMA_IOVECS) {
        let Source::Cma(src) = &c.src.source else {
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
