//! A pipelined staging engine: moves a range of memory that a socket cannot read or write
//! directly (CUDA device memory) through a few host staging buffers, overlapping the copy
//! of one chunk with the socket IO of another.
//!
//! # The pipeline
//! The range is cut into chunks of [`StagingConfig::chunk_len`] bytes (the last one may be
//! shorter); chunk `i` uses staging slot `i % depth`.
//! - [`send`] (memory → wire): the copies of the first `depth` chunks are started at once;
//!   then, for each chunk, it waits for that chunk's copy, writes its slot to the sink, and
//!   starts the copy of chunk `i + depth` into the slot it just emptied. While chunk `i` is
//!   written, chunks `i + 1 .. i + depth` are being copied.
//! - [`recv`] (wire → memory): for each chunk it waits until its slot is free (the copy of
//!   chunk `i - depth` has finished), reads the chunk from the source into the slot, and
//!   starts the copy from the slot into memory. While chunk `i + 1` is read, chunk `i` is
//!   being copied. It returns after the last copy has finished.
//!
//! With `depth = 2` this is double buffering, with `depth = 3` triple buffering.
//!
//! # Copiers
//! The pipeline is generic over a [`Copier`], which owns the staging slots and knows how to
//! copy between them and one memory:
//! - [`HostCopier`] copies host memory with `memcpy`. Its copies finish before they
//!   return, so it overlaps nothing; it exists so that the pipeline logic (chunking, slot
//!   reuse, error handling) runs on every machine, and as the baseline of the staging
//!   benchmark.
//! - `cuda::CudaCopier` (feature `cuda`) copies CUDA device memory with asynchronous
//!   copies on its own stream into pinned slots, one CUDA event per slot.
//!
//! # The seam for the TCP backend
//! The TCP backend of `kvlease-transport` serves and receives reads of registered regions.
//! Each connection thread keeps one [`Stager`] and calls:
//! - on P, answering a read of `len` bytes at `offset` of `region`, after writing its reply
//!   header: `stager.send(&region, offset, len, &mut socket)`;
//! - on D, receiving those bytes into a destination region, after reading the reply
//!   header: `stager.recv(&region, offset, len, &mut socket)`.
//!
//! For CUDA device memory the stager runs the pipeline above with a `cuda::CudaCopier` it
//! creates on first use, and for host memory (host-accessible kinds, and
//! [`MemoryKind::StagedHost`]: host memory posing as device memory, for tests and
//! benchmarks without a GPU) the same pipeline with a [`HostCopier`]. The TCP backend
//! itself moves host-accessible memory zero-copy, without a stager
//! ([`RegionBytes::write_to_fd`](crate::RegionBytes::write_to_fd) / [`RegionBytes::read_from_fd`](crate::RegionBytes::read_from_fd)). The lower-level
//! [`send`] / [`recv`] take any [`Copier`]. [`write_region`] / [`read_region`] copy between
//! a host buffer and a region of any kind (how P fills and D verifies device blocks).
//!
//! None of these writes or reads anything but the `len` payload bytes, so framing stays
//! with the transport. This module starts no threads and reads no clock.

mod host_copier;
mod stager;

pub use host_copier::HostCopier;
pub use stager::{Stager, read_region, send_to_fd, write_region};

use std::error::Error as StdError;
use std::io::{self, Read, Write};

use crate::{MemoryKind, RegionAccessError};

/// The largest [`StagingConfig::depth`]: more slots than this only hold more pinned memory.
pub const MAX_DEPTH: usize = 16;

/// Chunk size and number of staging slots of a pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagingConfig {
    chunk_len: usize,
    depth: usize,
}

impl StagingConfig {
    /// The default chunk: 2 MiB, large enough that a copy and a socket write each cost far
    /// more than their fixed overhead, small enough that three slots stay cheap.
    pub const DEFAULT_CHUNK_LEN: usize = 2 << 20;
    /// The default depth: triple buffering.
    pub const DEFAULT_DEPTH: usize = 3;

    /// A configuration of `depth` slots of `chunk_len` bytes each.
    ///
    /// # Errors
    /// [`StagingError::InvalidConfig`] when `chunk_len` is 0 or `depth` is not in
    /// `1..=MAX_DEPTH`.
    pub fn new(chunk_len: usize, depth: usize) -> Result<Self, StagingError> {
        if chunk_len == 0 || depth == 0 || depth > MAX_DEPTH {
            return Err(StagingError::InvalidConfig { chunk_len, depth });
        }
        Ok(Self { chunk_len, depth })
    }

    /// Bytes per chunk (and per staging slot).
    pub fn chunk_len(self) -> usize {
        self.chunk_len
    }

    /// Number of staging slots.
    pub fn depth(self) -> usize {
        self.depth
    }
}

impl Default for StagingConfig {
    fn default() -> Self {
        Self {
            chunk_len: Self::DEFAULT_CHUNK_LEN,
            depth: Self::DEFAULT_DEPTH,
        }
    }
}

/// Why a pipelined transfer failed.
///
/// After an error the memory range may be partly written ([`recv`]) or the sink may have
/// received some chunks ([`send`]); every copy that was in flight has finished (or its
/// failure was logged), so the copier can be used again.
#[derive(Debug, thiserror::Error)]
pub enum StagingError {
    /// The chunk length or depth is out of range.
    #[error(
        "invalid staging configuration: chunk_len {chunk_len}, depth {depth} (need chunk_len > 0 and 1 <= depth <= {MAX_DEPTH})"
    )]
    InvalidConfig {
        /// The requested chunk length.
        chunk_len: usize,
        /// The requested depth.
        depth: usize,
    },
    /// The range lies outside the copier's memory.
    #[error(transparent)]
    Range(#[from] RegionAccessError),
    /// Writing a chunk to the sink, or reading one from the source, failed.
    #[error("socket IO failed on chunk {chunk} (memory offset {offset}, {len} bytes)")]
    Io {
        /// Index of the chunk in the transfer.
        chunk: usize,
        /// Memory offset of the chunk.
        offset: usize,
        /// Length of the chunk.
        len: usize,
        /// The IO error.
        #[source]
        source: io::Error,
    },
    /// The copier failed to copy a chunk between memory and its staging slot.
    #[error("staging copy failed on chunk {chunk} (memory offset {offset})")]
    Copy {
        /// Index of the chunk in the transfer.
        chunk: usize,
        /// Memory offset of the chunk.
        offset: usize,
        /// The copier's error.
        #[source]
        source: Box<dyn StdError + Send + Sync>,
    },
    /// Device memory in a build without the `cuda` feature.
    #[error("{kind} memory needs the `cuda` feature of kvlease-gpu-mem")]
    NoCudaSupport {
        /// The region's kind.
        kind: MemoryKind,
    },
    /// Setting up device access (context, stream, pinned slots) or a direct device copy
    /// failed.
    #[error("CUDA device access failed")]
    Device(#[source] Box<dyn StdError + Send + Sync>),
}

/// A copier refused an operation on a staging slot.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SlotError {
    /// The slot index is not below the depth.
    #[error("staging slot {slot} does not exist (depth {depth})")]
    NoSuchSlot {
        /// The slot asked for.
        slot: usize,
        /// The number of slots.
        depth: usize,
    },
    /// The copy is longer than a slot.
    #[error("a copy of {len} bytes does not fit a staging slot of {chunk_len} bytes")]
    TooLong {
        /// The requested length.
        len: usize,
        /// The slot length.
        chunk_len: usize,
    },
    /// The memory range lies outside the copier's memory (or the memory cannot be
    /// accessed that way).
    #[error(transparent)]
    Range(#[from] RegionAccessError),
}

/// Checks `offset .. offset + len` against memory of `memory_len` bytes.
///
/// # Errors
/// [`RegionAccessError::OutOfBounds`] when the range does not lie inside.
pub fn check_range(offset: usize, len: usize, memory_len: usize) -> Result<(), RegionAccessError> {
    crate::region::check_bounds(offset as u64, len as u64, memory_len as u64)
}

/// Checks one copy request of a copier: slot index, length and memory range.
///
/// # Errors
/// The [`SlotError`] that describes the first problem found.
pub fn check_copy(
    slot: usize,
    offset: usize,
    len: usize,
    config: StagingConfig,
    memory_len: usize,
) -> Result<(), SlotError> {
    if slot >= config.depth {
        return Err(SlotError::NoSuchSlot {
            slot,
            depth: config.depth,
        });
    }
    if len > config.chunk_len {
        return Err(SlotError::TooLong {
            len,
            chunk_len: config.chunk_len,
        });
    }
    check_range(offset, len, memory_len)?;
    Ok(())
}

/// Copies between one memory and a set of staging slots, for [`send`] and [`recv`].
///
/// A copy may still be running when `stage_out`/`stage_in` return; [`Copier::slot`] and
/// [`Copier::slot_mut`] wait for every copy of their slot before they lend its buffer, so
/// the host never touches a slot the copy engine is using. Copies on one copier run in the
/// order they were started.
pub trait Copier {
    /// The copier's error type.
    type Error: StdError + Send + Sync + 'static;

    /// Chunk length and depth.
    fn config(&self) -> StagingConfig;

    /// Length in bytes of the memory; offsets are relative to its start.
    fn memory_len(&self) -> usize;

    /// Starts copying `len` bytes at `offset` of the memory into the start of `slot`.
    ///
    /// # Errors
    /// A [`SlotError`]-like refusal (bad slot, too long, out of range) or a copy failure.
    fn stage_out(&mut self, slot: usize, offset: usize, len: usize) -> Result<(), Self::Error>;

    /// Starts copying the first `len` bytes of `slot` to `offset` of the memory.
    ///
    /// # Errors
    /// A [`SlotError`]-like refusal (bad slot, too long, out of range) or a copy failure.
    fn stage_in(&mut self, slot: usize, offset: usize, len: usize) -> Result<(), Self::Error>;

    /// Waits for the copies of `slot`, then lends its whole buffer (`chunk_len` bytes).
    ///
    /// # Errors
    /// A bad slot, or the failure of a copy that was in flight.
    fn slot(&mut self, slot: usize) -> Result<&[u8], Self::Error>;

    /// Waits for the copies of `slot`, then lends its whole buffer for writing.
    ///
    /// # Errors
    /// A bad slot, or the failure of a copy that was in flight.
    fn slot_mut(&mut self, slot: usize) -> Result<&mut [u8], Self::Error>;

    /// Waits for every copy in flight.
    ///
    /// # Errors
    /// The failure of a copy that was in flight.
    fn wait_all(&mut self) -> Result<(), Self::Error>;
}

/// Chunk `i` of `offset .. offset + len`: its memory offset and length.
fn chunk_at(offset: usize, len: usize, chunk_len: usize, i: usize) -> (usize, usize) {
    let start = i * chunk_len;
    (offset + start, chunk_len.min(len - start))
}

fn copy_error<E: StdError + Send + Sync + 'static>(
    chunk: usize,
    offset: usize,
) -> impl FnOnce(E) -> StagingError {
    move |source| StagingError::Copy {
        chunk,
        offset,
        source: Box::new(source),
    }
}

/// After a failure: let every copy in flight finish before the caller reuses the copier.
fn drain<C: Copier>(copier: &mut C, error: StagingError) -> StagingError {
    if let Err(drain_error) = copier.wait_all() {
        tracing::error!(%drain_error, %error, "staging: a copy in flight failed while draining after an error");
    }
    error
}

/// Streams `len` bytes at `offset` of the copier's memory to `sink`, chunk by chunk, with
/// the copy of the next chunks overlapping the write of the current one (module docs).
///
/// # Errors
/// [`StagingError::Range`] before anything moves when the range is outside the memory;
/// [`StagingError::Io`] when the sink fails and [`StagingError::Copy`] when a copy fails,
/// after the copies in flight have finished.
pub fn send<C: Copier, W: Write + ?Sized>(
    copier: &mut C,
    offset: usize,
    len: usize,
    sink: &mut W,
) -> Result<(), StagingError> {
    check_range(offset, len, copier.memory_len())?;
    let config = copier.config();
    let (count, depth) = (len.div_ceil(config.chunk_len), config.depth);
    let at = |i: usize| chunk_at(offset, len, config.chunk_len, i);
    let result = (|| {
        for i in 0..count.min(depth) {
            let (off, n) = at(i);
            copier
                .stage_out(i % depth, off, n)
                .map_err(copy_error(i, off))?;
        }
        for i in 0..count {
            let (slot, (off, n)) = (i % depth, at(i));
            let buffer = copier.slot(slot).map_err(copy_error(i, off))?;
            sink.write_all(&buffer[..n])
                .map_err(|source| StagingError::Io {
                    chunk: i,
                    offset: off,
                    len: n,
                    source,
                })?;
            if i + depth < count {
                let (next_off, next_n) = at(i + depth);
                copier
                    .stage_out(slot, next_off, next_n)
                    .map_err(copy_error(i + depth, next_off))?;
            }
        }
        Ok(())
    })();
    result.map_err(|error| drain(copier, error))
}

/// Receives `len` bytes from `source` into `offset` of the copier's memory, chunk by chunk,
/// with the read of the next chunk overlapping the copy of the current one (module docs).
/// Returns once every byte is in memory.
///
/// # Errors
/// [`StagingError::Range`] before anything moves when the range is outside the memory;
/// [`StagingError::Io`] when the source fails or ends early, and [`StagingError::Copy`]
/// when a copy fails, after the copies in flight have finished.
pub fn recv<C: Copier, R: Read + ?Sized>(
    copier: &mut C,
    offset: usize,
    len: usize,
    source: &mut R,
) -> Result<(), StagingError> {
    check_range(offset, len, copier.memory_len())?;
    let config = copier.config();
    let result = (|| {
        for i in 0..len.div_ceil(config.chunk_len) {
            let (slot, (off, n)) = (i % config.depth, chunk_at(offset, len, config.chunk_len, i));
            let buffer = copier.slot_mut(slot).map_err(copy_error(i, off))?;
            source
                .read_exact(&mut buffer[..n])
                .map_err(|source| StagingError::Io {
                    chunk: i,
                    offset: off,
                    len: n,
                    source,
                })?;
            copier.stage_in(slot, off, n).map_err(copy_error(i, off))?;
        }
        let last = len.div_ceil(config.chunk_len).saturating_sub(1);
        copier
            .wait_all()
            .map_err(copy_error(last, offset + last * config.chunk_len))
    })();
    result.map_err(|error| drain(copier, error))
}

#[cfg(test)]
mod tests;
