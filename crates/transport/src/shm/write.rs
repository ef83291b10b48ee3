//! The writer's side of fenced writes on the shared-memory link: each chunk goes to the
//! peer's agent over the link's authenticated Unix socket, and the peer's own process
//! lands it under its write-fence lock, copying it from this process's memory (a pulled
//! write) or from the socket.
//!
//! # Why the peer's process lands the bytes
//! The peer's memory is never mapped writable here: the memfds it hands over are sealed
//! against every writer but its own mapping, and a cross-memory write into its process
//! would need it to name this process as its ptracer. More to the point, a write that
//! this process copied straight into the peer's memory could be checked against the
//! fence word only by this process, under a lock shared across the two processes; the
//! peer's clear would then have to wait for a lock holder it cannot tell apart from a
//! dead one (a stalled writer that wakes after the peer gave up waiting lands a stale
//! byte). So the fence stays where TCP keeps it: the peer copies each chunk into the
//! destination only under the fence word's stripe of its write-fence lock, after
//! finding the word holds the write's generation, and
//! [`Agent::set_write_fence`](crate::Agent::set_write_fence) takes the same stripe. Once
//! the clear returned, no chunk checked against the old generation lands, whatever this
//! process does or fails to do; a peer that stalls or dies mid-write holds only its
//! connection thread on the receiving side, never the lock.
//!
//! # The stream
//! The frames are sent on the Unix socket the hand-over came on (the peer says it serves
//! them with `"write": true` in its `shm` metadata entry; without it, writes go over
//! TCP), and answered by TCP's `WRITE_ACK` or `WRITE_ERR` (see `tcp::wire`). A chunk
//! whose source is a memfd-backed region goes as a `WRITE_PULL` when the peer says it
//! pulls (`"write_pull": true`): the region's memfd is handed over first, once per
//! stream (`SHM_WRITE_SRC`), and the peer copies the chunk from its read-only mapping of
//! it. A chunk from other host memory of this process (a
//! [`ForeignRegion`](kvlease_gpu_mem::ForeignRegion): a serving engine's CPU cache, a
//! Python buffer) goes as a `WRITE_PULL` too when the peer reads other processes
//! (`"write_pull_cma": true`) and cross-memory attach is on here: the region's address
//! and length are named once per stream (`SHM_WRITE_CMA_SRC`), after this process named
//! the peer's (`SO_PEERCRED`) as its ptracer as [`CmaPolicy`] says, and the peer copies
//! the chunk with `process_vm_readv`. When the kernel refuses it that read (another
//! ptracer named since, Yama's `ptrace_scope` 2, another user), the peer answers
//! `SourceUnreadable`; the chunk is sent again on the socket, and so is every later
//! chunk from such memory on the stream (logged once). Any other chunk goes as TCP's
//! `WRITE_REQ` with its payload, which leaves straight from the source region
//! (`writev`, no staging copy). The posting thread sends the
//! batch's chunks with up to [`WINDOW`] unanswered at a time and completes each chunk on
//! its answer, which the peer sends in order. The small frames (`WRITE_PULL`,
//! `SHM_WRITE_CMA_SRC`) are held back and sent together, before anything else goes on
//! the socket and before a read of the answers that may wait; answers already received
//! are taken before the window refills, so a window refills in one send; the peer
//! answers the same way, all frames that arrived together in one send;
//! [`Agent::post_write`](crate::Agent::post_write) returns once every chunk was answered
//! (the batch is settled then, so its source is free again: the peer reads a pulled
//! chunk's source only before it answers). One batch at a time uses a link's stream. A
//! batch whose deadline passes between frames (also while it waited for the stream)
//! fails with `Timeout` and sends nothing more; each send waits at most until the
//! deadline, and the answers to chunks already sent (held-back frames included, sent
//! then) at most [`ANSWER_GRACE`] longer. A
//! stream that timed out mid-frame or past that grace, broke or carried a malformed
//! answer is given up (its batch fails), and the link's later writes go over TCP.

use std::collections::{HashMap, VecDeque};
use std::io::{self, BufReader, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvlease_gpu_mem::{DmaRegion, send_with_fds};

use crate::batch::Batch;
use crate::config::{Backend, CmaPolicy};
use crate::error::{Refusal, TransferError};
use crate::ids::WriteFence;
use crate::link::WriteChunk;
use crate::sync::lock;
use crate::tcp::TcpLink;
use crate::tcp::wire::{self, Body, FrameError};

/// Most chunks sent and not yet answered: enough to keep the peer's receiver busy,
/// few enough that its answers (17 bytes each) never fill the socket while this side
/// sends.
pub(super) const WINDOW: usize = 32;

/// Most source regions handed over on one stream (the peer refuses more); writes from
/// further ones go on the socket.
const MAX_SOURCES: usize = super::MAX_REGIONS;

/// How long past a batch's deadline the answers to chunks already sent are still
/// awaited, so that a batch that timed out leaves the stream in step (a stream whose
/// answers do not come even then is given up).
const ANSWER_GRACE: Duration = Duration::from_secs(1);

/// The write stream of one link.
#[derive(Debug)]
pub(super) struct Writer {
    /// `None` once a write broke the stream (or the peer does not serve writes).
    stream: Mutex<Option<Stream>>,
}

#[derive(Debug)]
struct Stream {
    out: UnixStream,
    answers: BufReader<UnixStream>,
    next_req: u64,
    /// Whether the peer pulls writes from memfds handed over on the stream.
    pull: bool,
    /// Whether (and as what policy says) the peer pulls writes from other host memory of
    /// this process with cross-memory attach; `None` once it could not.
    cma: Option<CmaPolicy>,
    /// Whether the peer's process was named as this one's ptracer.
    ptracer_named: bool,
    /// The source regions handed over on the stream, by their address here: the id the
    /// peer knows each by, whether it is named by address (cma), and the region, held so
    /// that the address names no other region while the stream lives (the peer's
    /// mapping holds a memfd's pages anyway).
    sources: HashMap<usize, (u64, bool, Arc<dyn DmaRegion>)>,
    /// The id of the next source handed over.
    next_source: u64,
    /// Frames not sent yet (`WRITE_PULL`s, `SHM_WRITE_CMA_SRC`s), sent together before
    /// anything else goes on the socket and before a read of the answers that may wait.
    pending: Vec<u8>,
    /// Payloads from memory a socket cannot read (CUDA device, staged host), copied to
    /// the host before they go on the socket (at most one chunk).
    bounce: Vec<u8>,
}

/// A chunk sent and not answered yet.
struct Sent {
    req: u64,
    region: u64,
    offset: u64,
    len: u64,
    /// The chunk, when the peer pulls it with cross-memory attach: sent again on the
    /// socket should the peer's read be refused.
    cma: Option<WriteChunk>,
}

/// Why the stream is given up.
enum Broken {
    /// The batch's deadline passed in a socket call.
    Timeout,
    /// The socket failed or an answer broke the format.
    Stream(String),
}

impl From<FrameError> for Broken {
    fn from(e: FrameError) -> Self {
        match e {
            FrameError::Io(err) if is_timeout(&err) => Self::Timeout,
            FrameError::Io(err) => Self::Stream(err.to_string()),
            FrameError::Malformed(why) => Self::Stream(why),
        }
    }
}

fn is_timeout(err: &io::Error) -> bool {
    matches!(
        err.kind(),
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
    )
}

impl Writer {
    /// A writer on a clone of the link's socket `sock`, or one that leaves every write to
    /// TCP (`serves` false: the peer does not serve writes on it; or the clone failed);
    /// `pull`: the peer pulls writes from memfds handed over on it; `cma`: from other
    /// host memory of this process too, with cross-memory attach under this policy
    /// (`None`: it does not, or cma is off here).
    pub(super) fn new(sock: &UnixStream, serves: bool, pull: bool, cma: Option<CmaPolicy>) -> Self {
        let stream = serves
            .then(|| {
                let out = sock.try_clone().ok()?;
                let answers = BufReader::with_capacity(4096, sock.try_clone().ok()?);
                Some(Stream {
                    out,
                    answers,
                    next_req: 1,
                    pull,
                    cma: cma.filter(|&policy| pull && policy != CmaPolicy::Off),
                    ptracer_named: false,
                    sources: HashMap::new(),
                    next_source: 1,
                    pending: Vec::with_capacity(WINDOW * (wire::HEADER_LEN + wire::WRITE_PULL_LEN)),
                    bounce: Vec::new(),
                })
            })
            .flatten();
        Self {
            stream: Mutex::new(stream),
        }
    }

    /// Runs `batch`'s chunks on the stream; `Err(chunks)` hands them back when the link
    /// has no write stream (any more): the caller sends them over TCP.
    pub(super) fn post(
        &self,
        tcp: &TcpLink,
        batch: &Arc<Batch>,
        chunks: Vec<WriteChunk>,
        fence: WriteFence,
    ) -> Result<(), Vec<WriteChunk>> {
        let mut guard = lock(&self.stream);
        let Some(stream) = guard.as_mut() else {
            return Err(chunks);
        };
        {
            let mut st = batch.lock();
            st.backend = Backend::Shm;
            if !st.is_running() {
                return Ok(());
            }
            // Sending from the source: the batch is not settled until this returns.
            st.in_receive += 1;
        }
        let result = stream.run(tcp, batch, chunks, fence);
        if let Err(broken) = result {
            let err = match broken {
                Broken::Timeout => TransferError::Timeout {
                    peer: batch.peer.clone(),
                    timeout: batch.timeout,
                },
                Broken::Stream(why) => {
                    tracing::warn!(peer = %batch.peer, %why, "shm write stream broken; this link's later writes go over TCP");
                    TransferError::Disconnected {
                        peer: batch.peer.clone(),
                        reason: format!("shm write stream: {why}"),
                    }
                }
            };
            // Mid-frame, perhaps: the stream cannot carry another write.
            *guard = None;
            tcp.fail(batch, err);
        }
        batch.lock().in_receive -= 1;
        Ok(())
    }
}

impl Stream {
    /// Sends the chunks (while the batch runs) and completes each on its answer; returns
    /// once every chunk sent was answered, or the stream broke.
    fn run(
        &mut self,
        tcp: &TcpLink,
        batch: &Arc<Batch>,
        chunks: Vec<WriteChunk>,
        fence: WriteFence,
    ) -> Result<(), Broken> {
        let f = (
            fence.remote.region,
            fence.remote.key,
            fence.remote.offset,
            fence.expected,
        );
        let mut sent = VecDeque::with_capacity(WINDOW);
        let mut chunks = chunks.into_iter();
        // Chunks whose pull the peer could not read, sent again on the socket.
        let mut again = VecDeque::new();
        loop {
            // Answers already here are taken first, so that the window refills in one
            // send rather than one frame per answer.
            if sent.len() < WINDOW
                && (sent.is_empty() || self.answers.buffer().is_empty())
                && batch.lock().is_running()
                && let Some(c) = again.pop_front().or_else(|| chunks.next())
            {
                let req = self.next_req;
                self.next_req += 1;
                let dest = (c.remote.region, c.remote.key, c.remote.offset);
                if batch.deadline <= Instant::now() {
                    // At a frame boundary: the batch fails, the stream stays in step.
                    tcp.fail(
                        batch,
                        TransferError::Timeout {
                            peer: batch.peer.clone(),
                            timeout: batch.timeout,
                        },
                    );
                    continue;
                }
                self.set_timeouts(batch.deadline)?;
                let pulled = self.pull_source(&c.src, &batch.peer)?;
                let sent_now = match pulled {
                    // The peer copies the bytes from the source itself.
                    Some((src, _)) => {
                        let frame = wire::write_pull(req, (src, c.src_offset), dest, c.len, f);
                        self.pending.extend_from_slice(&frame);
                        Ok(())
                    }
                    None => {
                        self.flush()?;
                        let header = wire::write_req(req, dest, c.len, f);
                        match kvlease_gpu_mem::staging::send_to_fd(
                            c.src.as_ref(),
                            &header,
                            c.src_offset,
                            c.len,
                            self.out.as_fd(),
                            &mut self.bounce,
                        ) {
                            Ok(sent_now) => sent_now,
                            // Checked when posted; nothing was sent.
                            Err(source) => {
                                tcp.fail(
                                    batch,
                                    TransferError::Local {
                                        peer: batch.peer.clone(),
                                        source,
                                    },
                                );
                                continue;
                            }
                        }
                    }
                };
                sent_now.map_err(|err| Broken::from(FrameError::Io(err)))?;
                sent.push_back(Sent {
                    req,
                    region: c.remote.region,
                    offset: c.remote.offset,
                    len: c.len,
                    cma: matches!(pulled, Some((_, true))).then_some(c),
                });
                continue;
            }
            let Some(s) = sent.pop_front() else {
                return Ok(());
            };
            let grace = batch.deadline.checked_add(ANSWER_GRACE);
            self.set_timeouts(grace.unwrap_or(batch.deadline))?;
            if self.answers.buffer().is_empty() {
                // The read below may wait for the peer, which may wait for these (chunks
                // counted as sent already: they go within the answers' grace).
                self.flush()?;
            }
            let code = self.answer(s.req)?;
            if code == Some(Refusal::SourceUnreadable.code())
                && let Some(c) = s.cma
            {
                self.cma_refused(&batch.peer);
                again.push_back(c);
                continue;
            }
            answered(tcp, batch, &s, fence.expected, code);
        }
    }

    /// Sends the frames held back.
    fn flush(&mut self) -> Result<(), Broken> {
        if !self.pending.is_empty() {
            let sent = self.out.write_all(&self.pending);
            self.pending.clear();
            sent.map_err(|err| Broken::from(FrameError::Io(err)))?;
        }
        Ok(())
    }

    /// The peer could not read this process: later chunks from memory that is not
    /// memfd-backed go on the socket.
    fn cma_refused(&mut self, peer: &str) {
        if self.cma.take().is_some() {
            tracing::warn!(
                peer,
                "the shm peer could not read this process (cross-memory attach refused); this link's writes from non-memfd memory go on the socket"
            );
            self.sources.retain(|_, (_, cma, _)| !*cma);
        }
    }

    /// The id under which the peer pulls writes from `src`, and whether it reads it with
    /// cross-memory attach; handed over if it was not yet (a memfd with `SHM_WRITE_SRC`,
    /// other host memory by address with `SHM_WRITE_CMA_SRC`). `None` when the peer does
    /// not pull from such memory, `src` is not host memory, or the stream holds
    /// [`MAX_SOURCES`] already: the write's payload then goes on the socket.
    fn pull_source(
        &mut self,
        src: &Arc<dyn DmaRegion>,
        peer: &str,
    ) -> Result<Option<(u64, bool)>, Broken> {
        if !self.pull || !src.kind().is_host_accessible() {
            return Ok(None);
        }
        let at = Arc::as_ptr(src).cast::<()>() as usize;
        if let Some((id, cma, _)) = self.sources.get(&at) {
            return Ok(Some((*id, *cma)));
        }
        if self.next_source > MAX_SOURCES as u64 {
            return Ok(None);
        }
        let id = self.next_source;
        let len = src.len() as u64;
        let cma = match src.shared_fd() {
            Some(fd) => {
                // The descriptor travels with the frame's bytes: those before it first.
                self.flush()?;
                let mut body = [0u8; wire::SHM_WRITE_SRC_LEN];
                body[..8].copy_from_slice(&id.to_le_bytes());
                body[8..].copy_from_slice(&len.to_le_bytes());
                send_with_fds(
                    self.out.as_fd(),
                    &wire::frame(wire::SHM_WRITE_SRC, &body),
                    &[fd],
                )
                .map_err(|err| Broken::from(FrameError::Io(err)))?;
                false
            }
            None => {
                let Some(policy) = self.cma else {
                    return Ok(None);
                };
                // Before the first address goes out, and only when one will (naming a
                // ptracer lets that process attach to this one, not only read it).
                if !self.ptracer_named {
                    super::server::name_ptracer(&self.out, policy, peer);
                    self.ptracer_named = true;
                }
                let mut body = [0u8; wire::SHM_WRITE_CMA_SRC_LEN];
                body[..8].copy_from_slice(&id.to_le_bytes());
                body[8..16].copy_from_slice(&len.to_le_bytes());
                body[16..].copy_from_slice(&(src.base_ptr() as u64).to_le_bytes());
                self.pending
                    .extend_from_slice(&wire::frame(wire::SHM_WRITE_CMA_SRC, &body));
                true
            }
        };
        self.next_source += 1;
        self.sources.insert(at, (id, cma, src.clone()));
        Ok(Some((id, cma)))
    }

    /// Bounds the next socket calls by `deadline`.
    fn set_timeouts(&self, deadline: Instant) -> Result<(), Broken> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Broken::Timeout);
        }
        let set = self
            .out
            .set_write_timeout(Some(left))
            .and_then(|()| self.out.set_read_timeout(Some(left)));
        set.map_err(|e| Broken::Stream(e.to_string()))
    }

    /// Reads the answer to `req` (the peer answers in order): `None` for `WRITE_ACK`,
    /// the refusal code of a `WRITE_ERR`.
    fn answer(&mut self, req: u64) -> Result<Option<u8>, Broken> {
        let (ty, len) = wire::read_header(
            &mut self.answers,
            &[wire::WRITE_ACK, wire::WRITE_ERR],
            |ty| {
                if ty == wire::WRITE_ACK {
                    wire::WRITE_ACK_LEN
                } else {
                    wire::WRITE_ERR_LEN
                }
            },
        )?;
        let body = wire::read_body(&mut self.answers, len)?;
        let mut b = Body(&body);
        let got = b.u64()?;
        let code = if ty == wire::WRITE_ERR {
            Some(b.u8()?)
        } else {
            None
        };
        b.finish()?;
        if got != req {
            return Err(Broken::Stream(format!(
                "the answer to write {got} came where {req}'s was due"
            )));
        }
        Ok(code)
    }
}

/// Completes the chunk `s` on its answer: `code` `None` (every byte landed) or the
/// refusal code (nothing of it landed).
fn answered(tcp: &TcpLink, batch: &Arc<Batch>, s: &Sent, expected: u64, code: Option<u8>) {
    match code.map(Refusal::from_code) {
        None => {
            let next = batch.lock().chunk_done(s.len);
            tcp.advance(batch, next);
        }
        Some(Refusal::Stale) => tcp.fail(
            batch,
            TransferError::Stale {
                peer: batch.peer.clone(),
                region: s.region,
                offset: s.offset,
                len: s.len,
                expected,
            },
        ),
        Some(reason) => tcp.fail(
            batch,
            TransferError::Refused {
                peer: batch.peer.clone(),
                region: s.region,
                offset: s.offset,
                len: s.len,
                reason,
            },
        ),
    }
}
