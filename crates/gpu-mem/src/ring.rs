//! A bounded single-producer, single-consumer ring of byte records in a sealed memfd that
//! two processes on one host share (the transport's same-host notification path).
//!
//! # Roles
//! The consumer creates the ring ([`RingReader::new`]) and hands its descriptor
//! ([`RingReader::fd`]) to the producer, which maps it read-write ([`RingWriter::map`]).
//! Each side treats what the other writes into the shared pages as hostile input: it
//! never reads or writes outside its mapping, never allocates more than the ring holds,
//! never panics, never waits, and reports an inconsistency as an error ([`RingCorrupt`],
//! [`PushError::Corrupt`]).
//!
//! # Layout
//! | offset | field | written by |
//! | --- | --- | --- |
//! | 0 | magic `kvlring1` (informative) | consumer, at creation |
//! | 64 | tail: bytes published (`u64`, a multiple of 8) | producer (release) |
//! | 128 | head: bytes consumed (`u64`, a multiple of 8) | consumer (release) |
//! | 192 | closed: non-zero once the consumer stopped reading | consumer |
//! | [`RING_HEADER_LEN`] | data: `capacity` bytes (a power of two) | producer |
//!
//! Positions are byte counters that only grow; a position lies at `pos % capacity` in the
//! data area. A record is an 8-byte little-endian length followed by its bytes, padded to
//! a multiple of 8, so a length word never straddles the end of the data area (the bytes
//! may wrap around to its start). Each side keeps its own position privately and only
//! publishes it: the shared copy of the other side's position is a claim, checked before
//! use (`tail - head` must lie in `0..=capacity`, records must fit what was published).
//!
//! # Ordering
//! The producer writes a record, then stores the tail with release; the consumer loads
//! the tail with acquire before it reads the records up to it, and stores the head with
//! release once it has copied them out; the producer loads the head with acquire before it
//! reuses that space. So whatever the producer did before a push (for the transport: its
//! reads of the consumer's memory) happens before whatever the consumer does after it
//! drained that record.
//!
//! # Concurrent writers
//! As for [`SharedRegionView`](crate::SharedRegionView): record bytes are only copied,
//! through raw pointers, between the mapping and private buffers; no reference to the
//! shared bytes is ever created. A peer that rewrites them mid-copy yields unspecified
//! bytes (the consumer checks every length it acts on after copying it out once), never a
//! torn Rust value or an aliased borrow. The index words are accessed as atomics.

use std::fmt;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::ShareError;
use crate::host::{Mapping, Writers, map_memfd, sealed_file};

/// Bytes before the data area (one page: the index words, each on its own cache line).
pub const RING_HEADER_LEN: usize = 4096;
/// Smallest ring capacity (data bytes).
pub const MIN_RING_CAPACITY: usize = 4096;
/// Largest ring capacity (data bytes).
pub const MAX_RING_CAPACITY: usize = 1 << 30;
/// Bytes of a record's length word.
pub const RING_RECORD_HEADER: usize = 8;

const MAGIC: u64 = u64::from_le_bytes(*b"kvlring1");
const MAGIC_AT: usize = 0;
const TAIL_AT: usize = 64;
const HEAD_AT: usize = 128;
const CLOSED_AT: usize = 192;

/// Why a ring could not be created or mapped.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    /// The capacity is not a power of two in
    /// [`MIN_RING_CAPACITY`]..=[`MAX_RING_CAPACITY`].
    #[error(
        "ring capacity {capacity} must be a power of two in {MIN_RING_CAPACITY}..={MAX_RING_CAPACITY}"
    )]
    BadCapacity {
        /// The capacity asked for.
        capacity: u64,
    },
    /// The largest record does not fit the ring with its length word.
    #[error("records of {max_record} bytes do not fit a ring of {capacity} bytes")]
    BadMaxRecord {
        /// The largest record asked for.
        max_record: u64,
        /// The ring's capacity.
        capacity: u64,
    },
    /// The producer's file is not a sealed memfd of the right size.
    #[error("the ring's file is unusable")]
    File(#[source] ShareError),
    /// Creating or mapping the memfd failed.
    #[error("{op} failed")]
    Io {
        /// What was done.
        op: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

/// Why [`RingWriter::try_push`] wrote nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PushError {
    /// The record is longer than the ring's largest record.
    #[error("record of {len} bytes exceeds the ring's limit of {max} bytes")]
    TooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Not enough free space now (the consumer has not drained the ring).
    #[error("ring full: {need} bytes needed, {free} free")]
    Full {
        /// Bytes the record takes (length word and padding included).
        need: u64,
        /// Bytes free.
        free: u64,
    },
    /// The consumer closed the ring (it stopped reading, or found it corrupt).
    #[error("the consumer closed the ring")]
    Closed,
    /// The consumer published a head that no honest consumer could have.
    #[error("the ring's head {head} is inconsistent with its tail {tail}")]
    Corrupt {
        /// The head found.
        head: u64,
        /// This producer's tail.
        tail: u64,
    },
}

/// The producer published something no honest producer could have; the ring is closed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("ring corrupt: {what} (head {head}, tail {tail})")]
pub struct RingCorrupt {
    /// What was wrong.
    pub what: &'static str,
    /// The consumer's position.
    pub head: u64,
    /// The tail found.
    pub tail: u64,
}

fn validate(capacity: u64, max_record: u64) -> Result<(), RingError> {
    if !capacity.is_power_of_two()
        || capacity < MIN_RING_CAPACITY as u64
        || capacity > MAX_RING_CAPACITY as u64
    {
        return Err(RingError::BadCapacity { capacity });
    }
    if max_record > capacity - RING_RECORD_HEADER as u64 {
        return Err(RingError::BadMaxRecord {
            max_record,
            capacity,
        });
    }
    Ok(())
}

/// Bytes a record of `len` bytes takes in the ring (`len <= capacity`, so no overflow).
fn record_bytes(len: u64) -> u64 {
    RING_RECORD_HEADER as u64 + len.next_multiple_of(8)
}

/// The mapping of a ring, shared by both ends: bounds-checked access to its words and its
/// data area.
struct Shared {
    map: Mapping,
    capacity: u64,
}

impl Shared {
    /// The index word at `at` (one of the `*_AT` constants).
    fn word(&self, at: usize) -> &AtomicU64 {
        debug_assert!(at + 8 <= RING_HEADER_LEN && at.is_multiple_of(8));
        let ptr = self.map.as_ptr().wrapping_add(at).cast::<u64>();
        // SAFETY: `at` is one of the header constants: 8-aligned (the mapping is
        // page-aligned) and inside the header page, which is mapped read-write for as long
        // as `self` lives (the returned borrow is tied to `&self`). The other process
        // accesses these words only as atomics or through plain stores of whole words (a
        // hostile one); either way an atomic access of ours reads some value, never tears
        // a Rust value, and no non-atomic reference to the word exists in this process.
        unsafe { AtomicU64::from_ptr(ptr) }
    }

    fn data(&self) -> *mut u8 {
        self.map.as_ptr().wrapping_add(RING_HEADER_LEN)
    }

    /// Where `len <= capacity` bytes starting at position `pos` lie: (offset, first part,
    /// second part from the start of the data area).
    fn split(&self, pos: u64, len: usize) -> (usize, usize, usize) {
        // `capacity` is a power of two that fits a `usize` (at most 1 GiB).
        let start = (pos & (self.capacity - 1)) as usize;
        let first = len.min(self.capacity as usize - start);
        (start, first, len - first)
    }

    /// Copies `out.len()` bytes from position `pos` (wrapping) into `out`. Copies nothing
    /// when `out` is longer than the ring.
    fn copy_out(&self, pos: u64, out: &mut [u8]) {
        if out.len() as u64 > self.capacity {
            return;
        }
        let (start, first, rest) = self.split(pos, out.len());
        // SAFETY: `start + first <= capacity` and `rest <= capacity` (`split`, with
        // `out.len() <= capacity`): both source ranges lie inside the data area, mapped
        // for `capacity` bytes after the header while `self` lives; `out` is a private
        // buffer of `first + rest` bytes that cannot overlap the mapping. See "Concurrent
        // writers" for the other process writing meanwhile.
        unsafe {
            std::ptr::copy_nonoverlapping(self.data().wrapping_add(start), out.as_mut_ptr(), first);
        }
        // SAFETY: as above, the second part: `rest` bytes from the data area's start into
        // `out[first..]`.
        unsafe {
            std::ptr::copy_nonoverlapping(self.data(), out.as_mut_ptr().wrapping_add(first), rest);
        }
    }

    /// Copies `bytes` into the data area at position `pos` (wrapping). Copies nothing when
    /// `bytes` is longer than the ring.
    fn copy_in(&self, pos: u64, bytes: &[u8]) {
        if bytes.len() as u64 > self.capacity {
            return;
        }
        let (start, first, rest) = self.split(pos, bytes.len());
        // SAFETY: as in `copy_out`, both destination ranges lie inside the data area,
        // mapped read-write; `bytes` is a private buffer that cannot overlap the mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.data().wrapping_add(start), first);
        }
        // SAFETY: as above, the second part at the data area's start.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr().wrapping_add(first), self.data(), rest);
        }
    }
}

/// The consumer end of a ring: creates it, and drains the records the producer publishes.
pub struct RingReader {
    shared: Shared,
    file: File,
    max_record: u64,
    /// Bytes consumed (private; published to the producer after each drain).
    head: u64,
    /// Set once the ring was found corrupt or closed: nothing more is read.
    closed: bool,
}

impl RingReader {
    /// Creates a ring of `capacity` data bytes (a power of two) for records of at most
    /// `max_record` bytes, in a new memfd sealed against resizing.
    ///
    /// # Errors
    /// [`RingError::BadCapacity`], [`RingError::BadMaxRecord`], [`RingError::Io`].
    pub fn new(capacity: usize, max_record: usize) -> Result<Self, RingError> {
        validate(capacity as u64, max_record as u64)?;
        let (map, file) = map_memfd(
            c"kvlease-ring",
            RING_HEADER_LEN + capacity,
            false,
            Writers::AnyHolder,
        )
        .map_err(|source| RingError::Io {
            op: "creating the ring's memfd",
            source,
        })?;
        let shared = Shared {
            map,
            capacity: capacity as u64,
        };
        shared.word(MAGIC_AT).store(MAGIC, Ordering::Relaxed);
        Ok(Self {
            shared,
            file,
            max_record: max_record as u64,
            head: 0,
            closed: false,
        })
    }

    /// The ring's descriptor, to hand to the producer.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// Data bytes.
    pub fn capacity(&self) -> usize {
        // At most MAX_RING_CAPACITY.
        self.shared.capacity as usize
    }

    /// Largest record accepted.
    pub fn max_record(&self) -> usize {
        // At most the capacity.
        self.max_record as usize
    }

    /// Whether nothing was published since the last drain (one load, no system call), or
    /// the ring is closed.
    pub fn is_empty(&self) -> bool {
        self.closed || self.shared.word(TAIL_AT).load(Ordering::Relaxed) == self.head
    }

    /// Whether the ring is closed ([`close`](Self::close), or found corrupt).
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// Hands every record published so far to `deliver`, oldest first, and frees their
    /// space. Returns how many were delivered. Stops at the tail it found on entry, so a
    /// call delivers at most [`capacity`](Self::capacity) bytes of records however fast
    /// the producer publishes. A closed ring delivers nothing.
    ///
    /// # Errors
    /// [`RingCorrupt`] when the producer published an impossible tail or record (records
    /// before it were delivered); the ring is closed then (and the producer told so).
    pub fn drain(&mut self, mut deliver: impl FnMut(Vec<u8>)) -> Result<usize, RingCorrupt> {
        if self.closed {
            return Ok(0);
        }
        let tail = self.shared.word(TAIL_AT).load(Ordering::Acquire);
        let corrupt = |what, head| RingCorrupt { what, head, tail };
        let avail = tail.wrapping_sub(self.head);
        if avail > self.shared.capacity || !tail.is_multiple_of(8) {
            self.close();
            return Err(corrupt(
                "the tail is not within one ring of the head",
                self.head,
            ));
        }
        let mut pos = self.head;
        let mut delivered = 0;
        let mut result = Ok(());
        while pos != tail {
            let left = tail.wrapping_sub(pos);
            if left < RING_RECORD_HEADER as u64 {
                result = Err(corrupt("a partial length word", pos));
                break;
            }
            let mut word = [0u8; RING_RECORD_HEADER];
            self.shared.copy_out(pos, &mut word);
            let len = u64::from_le_bytes(word);
            if len > self.max_record {
                result = Err(corrupt("a record longer than the limit", pos));
                break;
            }
            // `len <= max_record < capacity`: no overflow.
            let need = record_bytes(len);
            if need > left {
                result = Err(corrupt("a record past the tail", pos));
                break;
            }
            // `len <= max_record`, a `usize`.
            let mut bytes = vec![0u8; len as usize];
            self.shared
                .copy_out(pos.wrapping_add(RING_RECORD_HEADER as u64), &mut bytes);
            deliver(bytes);
            delivered += 1;
            pos = pos.wrapping_add(need);
        }
        // The delivered records' space is free again (they were copied out above).
        self.head = pos;
        self.shared.word(HEAD_AT).store(pos, Ordering::Release);
        match result {
            Ok(()) => Ok(delivered),
            Err(e) => {
                self.close();
                Err(e)
            }
        }
    }

    /// Stops reading: later drains deliver nothing, and the producer's pushes fail with
    /// [`PushError::Closed`]. Dropping the reader closes it too.
    pub fn close(&mut self) {
        self.closed = true;
        self.shared.word(CLOSED_AT).store(1, Ordering::Release);
    }
}

impl Drop for RingReader {
    fn drop(&mut self) {
        self.close();
    }
}

impl fmt::Debug for RingReader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RingReader")
            .field("capacity", &self.shared.capacity)
            .field("max_record", &self.max_record)
            .field("head", &self.head)
            .field("closed", &self.closed)
            .finish_non_exhaustive()
    }
}

/// The producer end of a ring another process created ([`RingReader`]).
pub struct RingWriter {
    shared: Shared,
    max_record: u64,
    /// Bytes published (private; the shared tail is only ever stored from it).
    tail: u64,
}

impl RingWriter {
    /// Maps the ring `fd` read-write, as its consumer described it (`capacity` data bytes,
    /// records of at most `max_record` bytes). The descriptor is closed once mapped.
    ///
    /// # Errors
    /// [`RingError::BadCapacity`], [`RingError::BadMaxRecord`]; [`RingError::File`] when
    /// the file's size is not sealed or it is shorter than the ring; [`RingError::Io`]
    /// when mapping fails.
    pub fn map(fd: OwnedFd, capacity: u64, max_record: u64) -> Result<Self, RingError> {
        validate(capacity, max_record)?;
        // `capacity <= MAX_RING_CAPACITY`: fits a `usize`.
        let len = RING_HEADER_LEN + capacity as usize;
        let (file, _) = sealed_file(fd, len as u64).map_err(RingError::File)?;
        // Only the ring's bytes are mapped, whatever the file's (sealed) size.
        let map =
            Mapping::new(&file, len, libc::PROT_READ | libc::PROT_WRITE).map_err(|source| {
                RingError::Io {
                    op: "mapping the ring",
                    source,
                }
            })?;
        Ok(Self {
            shared: Shared { map, capacity },
            max_record,
            tail: 0,
        })
    }

    /// Largest record accepted.
    pub fn max_record(&self) -> usize {
        // At most the capacity.
        self.max_record as usize
    }

    /// Data bytes.
    pub fn capacity(&self) -> usize {
        // At most MAX_RING_CAPACITY.
        self.shared.capacity as usize
    }

    /// Whether the consumer closed the ring.
    pub fn is_closed(&self) -> bool {
        self.shared.word(CLOSED_AT).load(Ordering::Acquire) != 0
    }

    /// Publishes `bytes` as one record, or writes nothing and says why. Never waits.
    ///
    /// # Errors
    /// [`PushError::TooLarge`], [`PushError::Full`], [`PushError::Closed`],
    /// [`PushError::Corrupt`].
    pub fn try_push(&mut self, bytes: &[u8]) -> Result<(), PushError> {
        if self.is_closed() {
            return Err(PushError::Closed);
        }
        if bytes.len() as u64 > self.max_record {
            return Err(PushError::TooLarge {
                len: bytes.len(),
                max: self.max_record(),
            });
        }
        let head = self.shared.word(HEAD_AT).load(Ordering::Acquire);
        let used = self.tail.wrapping_sub(head);
        if used > self.shared.capacity || !head.is_multiple_of(8) {
            return Err(PushError::Corrupt {
                head,
                tail: self.tail,
            });
        }
        let free = self.shared.capacity - used;
        let need = record_bytes(bytes.len() as u64);
        if need > free {
            return Err(PushError::Full { need, free });
        }
        let len = (bytes.len() as u64).to_le_bytes();
        self.shared.copy_in(self.tail, &len);
        self.shared
            .copy_in(self.tail.wrapping_add(RING_RECORD_HEADER as u64), bytes);
        self.tail = self.tail.wrapping_add(need);
        self.shared
            .word(TAIL_AT)
            .store(self.tail, Ordering::Release);
        Ok(())
    }
}

impl fmt::Debug for RingWriter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RingWriter")
            .field("capacity", &self.shared.capacity)
            .field("max_record", &self.max_record)
            .field("tail", &self.tail)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::os::unix::fs::FileExt;

    use proptest::prelude::*;

    use super::*;

    fn pair(capacity: usize, max_record: usize) -> (RingReader, RingWriter) {
        let reader = RingReader::new(capacity, max_record).expect("ring");
        let fd = reader.fd().try_clone_to_owned().expect("dup");
        let writer = RingWriter::map(fd, capacity as u64, max_record as u64).expect("writer maps");
        (reader, writer)
    }

    fn drain_all(r: &mut RingReader) -> Result<Vec<Vec<u8>>, RingCorrupt> {
        let mut out = Vec::new();
        r.drain(|m| out.push(m))?;
        Ok(out)
    }

    /// A writable handle on the ring's file, as a hostile peer holds one.
    fn raw(r: &RingReader) -> File {
        File::from(r.fd().try_clone_to_owned().expect("dup"))
    }

    #[test]
    fn records_arrive_in_order_and_wrap_around() {
        let (mut r, mut w) = pair(8192, 1000);
        assert!(r.is_empty());
        let mut next = 0u32;
        let mut expect = 0u32;
        // Many rounds of a few records of varying lengths: the positions wrap many times.
        for round in 0..500u32 {
            for _ in 0..(round % 5 + 1) {
                let len = (next as usize * 37) % 1000;
                let mut m = next.to_le_bytes().to_vec();
                m.resize(len.max(4), (next % 251) as u8);
                w.try_push(&m).expect("room");
                next += 1;
            }
            assert!(!r.is_empty());
            for m in drain_all(&mut r).expect("consistent") {
                let n = u32::from_le_bytes(m[..4].try_into().expect("4 bytes"));
                assert_eq!(n, expect);
                assert_eq!(m.len(), ((n as usize * 37) % 1000).max(4));
                assert!(m[4..].iter().all(|&b| b == (n % 251) as u8));
                expect += 1;
            }
            assert!(r.is_empty());
        }
        assert_eq!(expect, next);
    }

    #[test]
    fn a_full_ring_refuses_until_drained_and_limits_hold() {
        let (mut r, mut w) = pair(4096, 4088);
        // The largest record fills the ring exactly.
        w.try_push(&[7; 4088]).expect("fits exactly");
        assert_eq!(w.try_push(&[]), Err(PushError::Full { need: 8, free: 0 }));
        assert_eq!(
            w.try_push(&[0; 4089]),
            Err(PushError::TooLarge {
                len: 4089,
                max: 4088
            })
        );
        assert_eq!(drain_all(&mut r).expect("ok"), vec![vec![7; 4088]]);
        w.try_push(b"").expect("room again");
        w.try_push(b"x").expect("room");
        assert_eq!(drain_all(&mut r).expect("ok"), vec![vec![], b"x".to_vec()]);
        drop(r);
        assert!(w.is_closed());
        assert_eq!(w.try_push(b"late"), Err(PushError::Closed));
    }

    #[test]
    fn bad_shapes_are_refused() {
        assert!(matches!(
            RingReader::new(4095, 10),
            Err(RingError::BadCapacity { .. })
        ));
        assert!(matches!(
            RingReader::new(2048, 10),
            Err(RingError::BadCapacity { .. })
        ));
        assert!(matches!(
            RingReader::new(4096, 4089),
            Err(RingError::BadMaxRecord { .. })
        ));
        let r = RingReader::new(4096, 100).expect("ring");
        // The writer must not map past the file: a claimed capacity larger than the file.
        let fd = r.fd().try_clone_to_owned().expect("dup");
        assert!(matches!(
            RingWriter::map(fd, 8192, 100),
            Err(RingError::File(ShareError::TooShort { .. }))
        ));
        // A file that is not sealed.
        let (p, _q) = io::pipe().expect("pipe");
        assert!(matches!(
            RingWriter::map(OwnedFd::from(p), 4096, 100),
            Err(RingError::File(ShareError::NotSealed))
        ));
    }

    #[test]
    fn a_corrupt_tail_closes_the_ring_after_the_good_records() {
        let (mut r, mut w) = pair(4096, 100);
        w.try_push(b"good").expect("room");
        // The producer claims a record of 4000 bytes after it (over the limit).
        let f = raw(&r);
        let pos = RING_HEADER_LEN as u64 + 16;
        f.write_all_at(&4000u64.to_le_bytes(), pos).expect("pwrite");
        f.write_all_at(&32u64.to_le_bytes(), TAIL_AT as u64)
            .expect("pwrite");
        let mut got = Vec::new();
        let err = r.drain(|m| got.push(m)).expect_err("corrupt");
        assert_eq!(err.what, "a record longer than the limit");
        assert_eq!(got, vec![b"good".to_vec()]);
        assert!(r.is_closed() && r.is_empty());
        assert_eq!(w.try_push(b"more"), Err(PushError::Closed));
        // Closed: nothing more is read, whatever the producer writes.
        assert_eq!(r.drain(|_| panic!("closed")), Ok(0));
    }

    #[test]
    fn a_hostile_head_is_reported_to_the_producer() {
        let (r, mut w) = pair(4096, 100);
        let f = raw(&r);
        f.write_all_at(&12u64.to_le_bytes(), HEAD_AT as u64)
            .expect("pwrite");
        assert!(matches!(w.try_push(b"x"), Err(PushError::Corrupt { .. })));
        f.write_all_at(&u64::MAX.to_le_bytes(), HEAD_AT as u64)
            .expect("pwrite");
        assert!(matches!(w.try_push(b"x"), Err(PushError::Corrupt { .. })));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Push(usize),
        Drain,
    }

    proptest! {
        /// Against a queue model: every push that the ring accepts comes out once, in
        /// order; a push is refused as full exactly when the model says it does not fit.
        #[test]
        fn behaves_like_a_bounded_queue(ops in proptest::collection::vec(
            prop_oneof![(0usize..600).prop_map(Op::Push), Just(Op::Drain)], 1..200)
        ) {
            let (mut r, mut w) = pair(4096, 600);
            let mut model: VecDeque<Vec<u8>> = VecDeque::new();
            let mut used = 0u64;
            for (i, op) in ops.into_iter().enumerate() {
                match op {
                    Op::Push(len) => {
                        let m = vec![(i % 256) as u8; len];
                        let need = record_bytes(len as u64);
                        match w.try_push(&m) {
                            Ok(()) => {
                                prop_assert!(used + need <= 4096);
                                used += need;
                                model.push_back(m);
                            }
                            Err(PushError::Full { .. }) => prop_assert!(used + need > 4096),
                            Err(e) => prop_assert!(false, "{e}"),
                        }
                    }
                    Op::Drain => {
                        let got = drain_all(&mut r).expect("consistent");
                        let want: Vec<Vec<u8>> = model.drain(..).collect();
                        prop_assert_eq!(got, want);
                        used = 0;
                    }
                }
            }
        }

        /// Whatever a hostile producer writes into the shared pages (tail, length words,
        /// bytes), draining never panics, delivers only records within the limit and at
        /// most one ring's worth of bytes, and either succeeds or closes the ring.
        #[test]
        fn hostile_contents_never_over_read(
            tail in prop_oneof![any::<u64>(), (0u64..5000), (0u64..600).prop_map(|t| t * 8)],
            head_before in 0u64..3,
            writes in proptest::collection::vec((0u64..4096, any::<u64>()), 0..40),
            honest in proptest::collection::vec(0usize..300, 0..5),
        ) {
            let (mut r, mut w) = pair(4096, 300);
            // Some honest traffic first, so the head is not always zero.
            for _ in 0..head_before {
                w.try_push(&[1; 200]).expect("room");
                drain_all(&mut r).expect("honest");
            }
            for len in honest {
                let _ = w.try_push(&vec![2; len]);
            }
            let f = raw(&r);
            for (at, v) in writes {
                f.write_all_at(&v.to_le_bytes(), RING_HEADER_LEN as u64 + (at & !7))
                    .expect("pwrite");
            }
            f.write_all_at(&tail.to_le_bytes(), TAIL_AT as u64).expect("pwrite");
            let mut total = 0u64;
            let mut count = 0u64;
            let res = r.drain(|m| {
                total += record_bytes(m.len() as u64);
                count += 1;
                assert!(m.len() <= 300);
            });
            prop_assert!(total <= 4096);
            match res {
                Ok(n) => prop_assert_eq!(n as u64, count),
                Err(_) => {
                    prop_assert!(r.is_closed());
                    prop_assert_eq!(r.drain(|_| ()), Ok(0));
                }
            }
        }
    }
}
