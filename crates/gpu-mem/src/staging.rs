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
//! ([`RegionBytes::write_to_fd`] / [`RegionBytes::read_from_fd`]). The lower-level
//! [`send`] / [`recv`] take any [`Copier`]. [`write_region`] / [`read_region`] copy between
//! a host buffer and a region of any kind (how P fills and D verifies device blocks).
//!
//! None of these writes or reads anything but the `len` payload bytes, so framing stays
//! with the transport. This module starts no threads and reads no clock.

use std::error::Error as StdError;
use std::io::{self, Read, Write};

use std::sync::Arc;

use crate::{DmaRegion, MemoryKind, RegionAccessError, RegionBytes};

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
#[non_exhaustive]
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
#[non_exhaustive]
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
    match offset.checked_add(len) {
        Some(end) if end <= memory_len => Ok(()),
        _ => Err(RegionAccessError::OutOfBounds {
            offset: offset as u64,
            len: len as u64,
            region_len: memory_len as u64,
        }),
    }
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

/// Copies `src` into `region` at `offset`, whatever the memory kind: host-accessible
/// kinds through [`RegionBytes`], CUDA device memory with a synchronous host→device copy.
/// This is how P fills KV blocks of any pool with the same bytes.
///
/// # Errors
/// [`StagingError::Range`], [`StagingError::NoCudaSupport`], [`StagingError::Device`].
pub fn write_region(region: &dyn DmaRegion, offset: usize, src: &[u8]) -> Result<(), StagingError> {
    let kind = region.kind();
    if kind.is_host_accessible() {
        return Ok(region.write_from(offset as u64, src)?);
    }
    if kind == MemoryKind::StagedHost {
        return Ok(crate::region::staged_write(region, offset as u64, src)?);
    }
    check_range(offset, src.len(), region.len())?;
    #[cfg(feature = "cuda")]
    {
        crate::cuda::copy_htod(region, offset, src).map_err(device_error)
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(StagingError::NoCudaSupport { kind })
    }
}

/// Copies `dst.len()` bytes of `region` at `offset` into `dst`, whatever the memory
/// kind (the counterpart of [`write_region`]). This is how D verifies KV blocks of any
/// pool: it copies them to the host and digests the host bytes.
///
/// # Errors
/// As [`write_region`].
pub fn read_region(
    region: &dyn DmaRegion,
    offset: usize,
    dst: &mut [u8],
) -> Result<(), StagingError> {
    let kind = region.kind();
    if kind.is_host_accessible() {
        return Ok(region.read_into(offset as u64, dst)?);
    }
    if kind == MemoryKind::StagedHost {
        return Ok(crate::region::staged_read(region, offset as u64, dst)?);
    }
    check_range(offset, dst.len(), region.len())?;
    #[cfg(feature = "cuda")]
    {
        crate::cuda::copy_dtoh(region, offset, dst).map_err(device_error)
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(StagingError::NoCudaSupport { kind })
    }
}

#[cfg(feature = "cuda")]
fn device_error(err: crate::cuda::CudaError) -> StagingError {
    match err {
        crate::cuda::CudaError::Range(range) => StagingError::Range(range),
        other => StagingError::Device(Box::new(other)),
    }
}

/// The TCP backend's per-thread entry point: moves a range of any registered region to a
/// socket or from one. CUDA device memory goes through a `cuda::CudaCopier` pipeline
/// (module docs), created on first use and reused for later regions of the same device;
/// host memory of every kind through a [`HostCopier`] pipeline (one `memcpy` per chunk).
/// The sink and source are arbitrary `Write`/`Read` code, so host memory is not lent to
/// them as a slice (see [`RegionBytes`]); the TCP backend moves host-accessible memory
/// zero-copy itself, with [`RegionBytes::write_to_fd`] / [`RegionBytes::read_from_fd`].
///
/// Keep one `Stager` per connection thread: it owns pinned staging slots and a CUDA
/// stream, and is not meant to be shared.
#[derive(Debug)]
pub struct Stager {
    config: StagingConfig,
    /// The pipeline for [`MemoryKind::StagedHost`] regions.
    host: Option<HostCopier>,
    #[cfg(feature = "cuda")]
    cuda: Option<crate::cuda::CudaCopier>,
}

impl Stager {
    /// A stager whose device pipelines use `config`. Allocates nothing until device
    /// memory is moved.
    pub fn new(config: StagingConfig) -> Self {
        Self {
            config,
            host: None,
            #[cfg(feature = "cuda")]
            cuda: None,
        }
    }

    /// The configuration of its device pipelines.
    pub fn config(&self) -> StagingConfig {
        self.config
    }

    /// Writes `len` bytes of `region` at `offset` to `sink`.
    ///
    /// # Errors
    /// [`StagingError::Range`] before anything moves; [`StagingError::Io`] when the sink
    /// fails; for device memory also [`StagingError::Copy`], [`StagingError::Device`]
    /// (setting up the pipeline) or [`StagingError::NoCudaSupport`].
    pub fn send<W: Write + ?Sized>(
        &mut self,
        region: &Arc<dyn DmaRegion>,
        offset: usize,
        len: usize,
        sink: &mut W,
    ) -> Result<(), StagingError> {
        check_range(offset, len, region.len())?;
        if region.kind().is_host_accessible() || region.kind() == MemoryKind::StagedHost {
            return send(self.host_copier(region)?, offset, len, sink);
        }
        self.device_send(region, offset, len, sink)
    }

    /// Reads `len` bytes from `source` into `region` at `offset`; returns once they are
    /// in the region (on the device, for device memory).
    ///
    /// # Errors
    /// As [`send`](Self::send), with the source in place of the sink.
    pub fn recv<R: Read + ?Sized>(
        &mut self,
        region: &Arc<dyn DmaRegion>,
        offset: usize,
        len: usize,
        source: &mut R,
    ) -> Result<(), StagingError> {
        check_range(offset, len, region.len())?;
        if region.kind().is_host_accessible() || region.kind() == MemoryKind::StagedHost {
            return recv(self.host_copier(region)?, offset, len, source);
        }
        self.device_recv(region, offset, len, source)
    }

    /// The host-copier pipeline for a [`MemoryKind::StagedHost`] region, its slots reused
    /// across regions.
    fn host_copier(
        &mut self,
        region: &Arc<dyn DmaRegion>,
    ) -> Result<&mut HostCopier, StagingError> {
        let copier = match self.host.take() {
            Some(mut copier) => {
                copier.region = Arc::clone(region);
                copier
            }
            None => HostCopier::new(Arc::clone(region), self.config)?,
        };
        Ok(self.host.insert(copier))
    }

    #[cfg(feature = "cuda")]
    fn copier(
        &mut self,
        region: &Arc<dyn DmaRegion>,
    ) -> Result<&mut crate::cuda::CudaCopier, StagingError> {
        use crate::cuda::{CudaCopier, CudaError};
        let same = |copier: &CudaCopier| {
            std::ptr::addr_eq(Arc::as_ptr(copier.region()), Arc::as_ptr(region))
        };
        let reuse = match self.cuda.take() {
            Some(copier) if same(&copier) => Some(copier),
            Some(mut copier) => match copier.set_region(Arc::clone(region)) {
                Ok(()) => Some(copier),
                // Another device: a new copier (the old one waits for its stream on drop).
                Err(CudaError::OtherDevice { .. }) => None,
                Err(other) => return Err(device_error(other)),
            },
            None => None,
        };
        let copier = match reuse {
            Some(copier) => copier,
            None => CudaCopier::new(Arc::clone(region), self.config).map_err(device_error)?,
        };
        Ok(self.cuda.insert(copier))
    }

    #[cfg(feature = "cuda")]
    fn device_send<W: Write + ?Sized>(
        &mut self,
        region: &Arc<dyn DmaRegion>,
        offset: usize,
        len: usize,
        sink: &mut W,
    ) -> Result<(), StagingError> {
        send(self.copier(region)?, offset, len, sink)
    }

    #[cfg(feature = "cuda")]
    fn device_recv<R: Read + ?Sized>(
        &mut self,
        region: &Arc<dyn DmaRegion>,
        offset: usize,
        len: usize,
        source: &mut R,
    ) -> Result<(), StagingError> {
        recv(self.copier(region)?, offset, len, source)
    }

    #[cfg(not(feature = "cuda"))]
    fn device_send<W: Write + ?Sized>(
        &mut self,
        region: &Arc<dyn DmaRegion>,
        _offset: usize,
        _len: usize,
        _sink: &mut W,
    ) -> Result<(), StagingError> {
        Err(StagingError::NoCudaSupport {
            kind: region.kind(),
        })
    }

    #[cfg(not(feature = "cuda"))]
    fn device_recv<R: Read + ?Sized>(
        &mut self,
        region: &Arc<dyn DmaRegion>,
        _offset: usize,
        _len: usize,
        _source: &mut R,
    ) -> Result<(), StagingError> {
        Err(StagingError::NoCudaSupport {
            kind: region.kind(),
        })
    }
}

/// The copier for host memory ([`MemoryKind::Host`], [`MemoryKind::CudaPinned`] and
/// [`MemoryKind::StagedHost`]): bounds-checked `memcpy` between a region and owned slots.
///
/// Its copies are complete when `stage_out`/`stage_in` return, so it overlaps nothing;
/// see the module docs for why it exists.
#[derive(Debug)]
pub struct HostCopier {
    region: Arc<dyn DmaRegion>,
    slots: Vec<Box<[u8]>>,
    config: StagingConfig,
}

impl HostCopier {
    /// A copier between `region` and `config.depth()` slots of `config.chunk_len()` bytes.
    ///
    /// # Errors
    /// [`RegionAccessError::NotHostAccessible`] for device memory (use `cuda::CudaCopier`).
    pub fn new(
        region: Arc<dyn DmaRegion>,
        config: StagingConfig,
    ) -> Result<Self, RegionAccessError> {
        let kind = region.kind();
        if !(kind.is_host_accessible() || kind == MemoryKind::StagedHost) {
            return Err(RegionAccessError::NotHostAccessible { kind });
        }
        let slots = (0..config.depth)
            .map(|_| vec![0u8; config.chunk_len].into_boxed_slice())
            .collect();
        Ok(Self {
            region,
            slots,
            config,
        })
    }

    /// The region this copier moves.
    pub fn region(&self) -> &Arc<dyn DmaRegion> {
        &self.region
    }

    fn slot_index(&self, slot: usize) -> Result<usize, SlotError> {
        if slot < self.config.depth {
            Ok(slot)
        } else {
            Err(SlotError::NoSuchSlot {
                slot,
                depth: self.config.depth,
            })
        }
    }
}

impl Copier for HostCopier {
    type Error = SlotError;

    fn config(&self) -> StagingConfig {
        self.config
    }

    fn memory_len(&self) -> usize {
        self.region.len()
    }

    fn stage_out(&mut self, slot: usize, offset: usize, len: usize) -> Result<(), SlotError> {
        check_copy(slot, offset, len, self.config, self.memory_len())?;
        crate::region::staged_read(&*self.region, offset as u64, &mut self.slots[slot][..len])?;
        Ok(())
    }

    fn stage_in(&mut self, slot: usize, offset: usize, len: usize) -> Result<(), SlotError> {
        check_copy(slot, offset, len, self.config, self.memory_len())?;
        crate::region::staged_write(&*self.region, offset as u64, &self.slots[slot][..len])?;
        Ok(())
    }

    fn slot(&mut self, slot: usize) -> Result<&[u8], SlotError> {
        let slot = self.slot_index(slot)?;
        Ok(&self.slots[slot])
    }

    fn slot_mut(&mut self, slot: usize) -> Result<&mut [u8], SlotError> {
        let slot = self.slot_index(slot)?;
        Ok(&mut self.slots[slot])
    }

    fn wait_all(&mut self) -> Result<(), SlotError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::io::Cursor;
    use std::rc::Rc;

    use proptest::prelude::*;

    use super::*;
    use crate::HostRegion;

    /// Bytes that differ at every position of a chunk boundary (a shifted or repeated
    /// chunk would not match).
    fn pattern(len: usize) -> Vec<u8> {
        (0..len as u64)
            .map(|i| {
                let x = (i ^ 0x9e37_79b9).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                (x >> 56) as u8 ^ (i as u8)
            })
            .collect()
    }

    fn host_region(bytes: &[u8]) -> Arc<dyn DmaRegion> {
        let region = HostRegion::new(bytes.len().max(1)).expect("small test mmap");
        region.write_from(0, bytes).expect("in range");
        Arc::new(region)
    }

    fn contents(region: &dyn DmaRegion) -> Vec<u8> {
        let mut out = vec![0; region.len()];
        region.read_into(0, &mut out).expect("whole region");
        out
    }

    fn config(chunk_len: usize, depth: usize) -> StagingConfig {
        StagingConfig::new(chunk_len, depth).expect("valid test config")
    }

    /// Sends `offset..offset+len` of a patterned region and receives it into a zeroed
    /// one, checking every byte (and that nothing outside the range changed).
    fn round_trip(mem_len: usize, offset: usize, len: usize, chunk_len: usize, depth: usize) {
        let src = pattern(mem_len);
        let mut copier = HostCopier::new(host_region(&src), config(chunk_len, depth)).unwrap();
        let mut wire = Vec::new();
        send(&mut copier, offset, len, &mut wire).unwrap();
        assert_eq!(
            wire,
            src[offset..offset + len],
            "send {mem_len} {offset}+{len} chunk {chunk_len} depth {depth}"
        );

        let dst = host_region(&vec![0; mem_len]);
        let mut copier = HostCopier::new(Arc::clone(&dst), config(chunk_len, depth)).unwrap();
        recv(&mut copier, offset, len, &mut Cursor::new(&wire)).unwrap();
        let got = contents(dst.as_ref());
        let mut want = vec![0; mem_len.max(1)];
        want[offset..offset + len].copy_from_slice(&src[offset..offset + len]);
        assert_eq!(
            got, want,
            "recv {mem_len} {offset}+{len} chunk {chunk_len} depth {depth}"
        );
    }

    #[test]
    fn every_byte_survives_across_chunk_sizes() {
        let mem_len = 3 * 4096 + 17;
        for chunk_len in [1, 7, 4096, 4097, 1 << 20] {
            for depth in [1, 2, 3] {
                for (offset, len) in [
                    (0, 0),
                    (0, mem_len),
                    (5, mem_len - 5),
                    (0, chunk_len.min(mem_len)),
                    (3, (2 * chunk_len + 1).min(mem_len - 3)),
                    (mem_len - 1, 1),
                ] {
                    round_trip(mem_len, offset, len, chunk_len, depth);
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn random_ranges_round_trip(
            mem_len in 1usize..5000,
            chunk_len in 1usize..700,
            depth in 1usize..=4,
            a in any::<prop::sample::Index>(),
            b in any::<prop::sample::Index>(),
        ) {
            let offset = a.index(mem_len + 1);
            let len = b.index(mem_len - offset + 1);
            round_trip(mem_len, offset, len, chunk_len, depth);
        }
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Op {
        Out {
            slot: usize,
            offset: usize,
            len: usize,
        },
        In {
            slot: usize,
            offset: usize,
            len: usize,
        },
        Slot(usize),
        SlotMut(usize),
        WaitAll,
        Write(usize),
        Read(usize),
    }

    /// The host copier plus a log of the calls the pipeline makes, and optional fault
    /// injection: the `fail_at`-th stage_out/stage_in fails.
    struct Recording {
        inner: HostCopier,
        log: Rc<RefCell<Vec<Op>>>,
        stages: usize,
        fail_at: Option<usize>,
    }

    impl Recording {
        fn new(
            region: Arc<dyn DmaRegion>,
            config: StagingConfig,
            log: &Rc<RefCell<Vec<Op>>>,
        ) -> Self {
            Self {
                inner: HostCopier::new(region, config).unwrap(),
                log: Rc::clone(log),
                stages: 0,
                fail_at: None,
            }
        }

        fn stage(&mut self) -> Result<(), io::Error> {
            self.stages += 1;
            if self.fail_at == Some(self.stages) {
                return Err(io::Error::other("injected copy failure"));
            }
            Ok(())
        }
    }

    impl Copier for Recording {
        type Error = io::Error;

        fn config(&self) -> StagingConfig {
            self.inner.config()
        }

        fn memory_len(&self) -> usize {
            self.inner.memory_len()
        }

        fn stage_out(&mut self, slot: usize, offset: usize, len: usize) -> Result<(), io::Error> {
            self.stage()?;
            self.log.borrow_mut().push(Op::Out { slot, offset, len });
            self.inner
                .stage_out(slot, offset, len)
                .map_err(io::Error::other)
        }

        fn stage_in(&mut self, slot: usize, offset: usize, len: usize) -> Result<(), io::Error> {
            self.stage()?;
            self.log.borrow_mut().push(Op::In { slot, offset, len });
            self.inner
                .stage_in(slot, offset, len)
                .map_err(io::Error::other)
        }

        fn slot(&mut self, slot: usize) -> Result<&[u8], io::Error> {
            self.log.borrow_mut().push(Op::Slot(slot));
            self.inner.slot(slot).map_err(io::Error::other)
        }

        fn slot_mut(&mut self, slot: usize) -> Result<&mut [u8], io::Error> {
            self.log.borrow_mut().push(Op::SlotMut(slot));
            self.inner.slot_mut(slot).map_err(io::Error::other)
        }

        fn wait_all(&mut self) -> Result<(), io::Error> {
            self.log.borrow_mut().push(Op::WaitAll);
            Ok(())
        }
    }

    /// A socket stand-in that logs each write and fails after `limit` bytes.
    struct LoggedSink {
        log: Rc<RefCell<Vec<Op>>>,
        bytes: Vec<u8>,
        limit: usize,
    }

    impl Write for LoggedSink {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            if self.bytes.len() + buf.len() > self.limit {
                return Err(io::Error::new(io::ErrorKind::BrokenPipe, "peer went away"));
            }
            self.log.borrow_mut().push(Op::Write(buf.len()));
            self.bytes.extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    struct LoggedSource<'a> {
        log: Rc<RefCell<Vec<Op>>>,
        inner: Cursor<&'a [u8]>,
    }

    impl Read for LoggedSource<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = self.inner.read(buf)?;
            self.log.borrow_mut().push(Op::Read(n));
            Ok(n)
        }
    }

    #[test]
    fn send_copies_ahead_of_the_write() {
        let log = Rc::default();
        let src = pattern(450);
        let mut copier = Recording::new(host_region(&src), config(100, 2), &log);
        let mut sink = LoggedSink {
            log: Rc::clone(&log),
            bytes: Vec::new(),
            limit: usize::MAX,
        };
        send(&mut copier, 0, 450, &mut sink).unwrap();
        assert_eq!(sink.bytes, src);
        use Op::*;
        let out = |slot, chunk: usize, len| Out {
            slot,
            offset: chunk * 100,
            len,
        };
        assert_eq!(
            *log.borrow(),
            [
                out(0, 0, 100),
                out(1, 1, 100),
                Slot(0),
                Write(100),
                out(0, 2, 100),
                Slot(1),
                Write(100),
                out(1, 3, 100),
                Slot(0),
                Write(100),
                out(0, 4, 50),
                Slot(1),
                Write(100),
                Slot(0),
                Write(50),
            ]
        );
    }

    #[test]
    fn recv_reads_the_next_chunk_while_the_last_one_copies() {
        let log = Rc::default();
        let src = pattern(250);
        let dst = host_region(&[0; 300]);
        let mut copier = Recording::new(Arc::clone(&dst), config(100, 3), &log);
        let mut source = LoggedSource {
            log: Rc::clone(&log),
            inner: Cursor::new(&src),
        };
        recv(&mut copier, 50, 250, &mut source).unwrap();
        assert_eq!(contents(dst.as_ref())[50..], src);
        use Op::*;
        assert_eq!(
            *log.borrow(),
            [
                SlotMut(0),
                Read(100),
                In {
                    slot: 0,
                    offset: 50,
                    len: 100
                },
                SlotMut(1),
                Read(100),
                In {
                    slot: 1,
                    offset: 150,
                    len: 100
                },
                SlotMut(2),
                Read(50),
                In {
                    slot: 2,
                    offset: 250,
                    len: 50
                },
                WaitAll,
            ]
        );
    }

    #[test]
    fn a_failing_sink_stops_the_send_at_its_chunk_and_the_copier_stays_usable() {
        let src = pattern(1000);
        let log = Rc::default();
        let mut copier = Recording::new(host_region(&src), config(100, 3), &log);
        let mut sink = LoggedSink {
            log: Rc::clone(&log),
            bytes: Vec::new(),
            limit: 350,
        };
        let err = send(&mut copier, 0, 1000, &mut sink).unwrap_err();
        match &err {
            StagingError::Io {
                chunk: 3,
                offset: 300,
                len: 100,
                source,
            } => {
                assert_eq!(source.kind(), io::ErrorKind::BrokenPipe);
            }
            other => panic!("unexpected error {other:?}"),
        }
        assert_eq!(sink.bytes, src[..300]);
        assert_eq!(
            log.borrow().last(),
            Some(&Op::WaitAll),
            "drained after the error"
        );

        let mut wire = Vec::new();
        send(&mut copier, 10, 990, &mut wire).unwrap();
        assert_eq!(wire, src[10..]);
    }

    #[test]
    fn a_short_source_fails_at_its_chunk_after_writing_what_arrived() {
        let src = pattern(1000);
        let dst = host_region(&[0; 1000]);
        let mut copier = HostCopier::new(Arc::clone(&dst), config(100, 2)).unwrap();
        let err = recv(&mut copier, 0, 1000, &mut Cursor::new(&src[..250])).unwrap_err();
        match &err {
            StagingError::Io {
                chunk: 2,
                offset: 200,
                len: 100,
                source,
            } => {
                assert_eq!(source.kind(), io::ErrorKind::UnexpectedEof);
            }
            other => panic!("unexpected error {other:?}"),
        }
        let got = contents(dst.as_ref());
        assert_eq!(got[..200], src[..200]);
        assert!(got[250..].iter().all(|&b| b == 0));
    }

    #[test]
    fn a_failing_copy_names_its_chunk_and_drains() {
        for (fail_at, chunk) in [(1, 0), (2, 1), (4, 3)] {
            let log = Rc::default();
            let src = pattern(600);
            let mut copier = Recording::new(host_region(&src), config(100, 2), &log);
            copier.fail_at = Some(fail_at);
            let mut wire = Vec::new();
            let err = send(&mut copier, 0, 600, &mut wire).unwrap_err();
            match &err {
                StagingError::Copy {
                    chunk: c,
                    offset,
                    source,
                } => {
                    assert_eq!((*c, *offset), (chunk, chunk * 100));
                    assert!(source.to_string().contains("injected"), "{source}");
                }
                other => panic!("unexpected error {other:?}"),
            }
            // Chunks before the failed copy's slot-mate were sent intact.
            assert_eq!(wire, src[..wire.len()]);
            assert_eq!(log.borrow().last(), Some(&Op::WaitAll));

            let log = Rc::default();
            let dst = host_region(&[0; 600]);
            let mut copier = Recording::new(dst, config(100, 2), &log);
            copier.fail_at = Some(fail_at);
            let err = recv(&mut copier, 0, 600, &mut Cursor::new(&src)).unwrap_err();
            assert!(
                matches!(err, StagingError::Copy { chunk: c, .. } if c == fail_at - 1),
                "{err:?}"
            );
            assert_eq!(log.borrow().last(), Some(&Op::WaitAll));
        }
    }

    #[test]
    fn out_of_range_is_refused_before_anything_moves() {
        let log = Rc::default();
        let mut copier = Recording::new(host_region(&pattern(100)), config(10, 2), &log);
        let mut wire = Vec::new();
        for (offset, len) in [(0, 101), (101, 0), (usize::MAX, 2)] {
            let err = send(&mut copier, offset, len, &mut wire).unwrap_err();
            assert!(
                matches!(
                    err,
                    StagingError::Range(RegionAccessError::OutOfBounds { .. })
                ),
                "{err:?}"
            );
            let err = recv(&mut copier, offset, len, &mut Cursor::new(&[0; 200][..])).unwrap_err();
            assert!(matches!(err, StagingError::Range(_)), "{err:?}");
        }
        assert!(wire.is_empty());
        assert!(log.borrow().is_empty());
    }

    #[test]
    fn host_copier_checks_every_request() {
        let region = host_region(&pattern(100));
        let mut copier = HostCopier::new(region, config(10, 3)).unwrap();
        assert_eq!(
            copier.stage_out(3, 0, 1),
            Err(SlotError::NoSuchSlot { slot: 3, depth: 3 })
        );
        assert_eq!(
            copier.stage_in(0, 0, 11),
            Err(SlotError::TooLong {
                len: 11,
                chunk_len: 10
            })
        );
        assert!(matches!(
            copier.stage_out(0, 95, 6),
            Err(SlotError::Range(_))
        ));
        assert!(matches!(copier.slot(7), Err(SlotError::NoSuchSlot { .. })));
        assert!(matches!(
            copier.slot_mut(3),
            Err(SlotError::NoSuchSlot { .. })
        ));
        copier.stage_out(2, 90, 10).unwrap();
        assert_eq!(copier.slot(2).unwrap()[..10], pattern(100)[90..]);
    }

    #[test]
    fn stager_moves_host_regions_through_the_host_copier() {
        let src = pattern(10_000);
        let from = host_region(&src);
        let to = host_region(&[0; 10_000]);
        let mut stager = Stager::new(config(100, 2));
        let mut wire = Vec::new();
        stager.send(&from, 123, 9_000, &mut wire).unwrap();
        assert_eq!(wire, src[123..9_123]);
        stager.recv(&to, 7, 9_000, &mut Cursor::new(&wire)).unwrap();
        let got = contents(to.as_ref());
        assert_eq!(got[7..9_007], src[123..9_123]);
        assert!(got[..7].iter().chain(&got[9_007..]).all(|&b| b == 0));

        let err = stager.send(&from, 9_999, 2, &mut wire).unwrap_err();
        assert!(matches!(err, StagingError::Range(_)), "{err:?}");
        let err = stager
            .recv(&to, 0, 100, &mut Cursor::new(&src[..99]))
            .unwrap_err();
        assert!(
            matches!(&err, StagingError::Io { source, .. } if source.kind() == io::ErrorKind::UnexpectedEof),
            "{err:?}"
        );
        let mut broken = LoggedSink {
            log: Rc::default(),
            bytes: Vec::new(),
            limit: 10,
        };
        let err = stager.send(&from, 0, 100, &mut broken).unwrap_err();
        assert!(
            matches!(
                err,
                StagingError::Io {
                    offset: 0,
                    len: 100,
                    ..
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn stager_pipelines_staged_host_regions_in_chunks() {
        let src = pattern(10_000);
        let from: Arc<dyn DmaRegion> = Arc::new(crate::StagedHostRegion::new(10_000).unwrap());
        let to: Arc<dyn DmaRegion> = Arc::new(crate::StagedHostRegion::new(10_000).unwrap());
        // The bytes are refused by RegionBytes, as device memory is.
        assert!(matches!(
            from.check_host_range(0, 1),
            Err(RegionAccessError::NotHostAccessible { .. })
        ));
        write_region(from.as_ref(), 0, &src).unwrap();
        let mut stager = Stager::new(config(64, 3));
        let log = Rc::new(RefCell::new(Vec::new()));
        let mut sink = LoggedSink {
            log: Rc::clone(&log),
            bytes: Vec::new(),
            limit: usize::MAX,
        };
        stager.send(&from, 123, 9_000, &mut sink).unwrap();
        assert_eq!(sink.bytes, src[123..9_123]);
        // Chunked writes (one per 64-byte chunk) show that the pipeline ran.
        assert_eq!(log.borrow().len(), 9_000usize.div_ceil(64));
        stager
            .recv(&to, 7, 9_000, &mut Cursor::new(&sink.bytes))
            .unwrap();
        let mut got = vec![0; 10_000];
        read_region(to.as_ref(), 0, &mut got).unwrap();
        assert_eq!(got[7..9_007], src[123..9_123]);
        assert!(got[..7].iter().chain(&got[9_007..]).all(|&b| b == 0));
        let err = stager
            .recv(&to, 0, 100, &mut Cursor::new(&src[..99]))
            .unwrap_err();
        assert!(matches!(err, StagingError::Io { chunk: 1, .. }), "{err:?}");
    }

    #[test]
    fn region_copies_of_any_kind_on_host_memory() {
        let region = host_region(&[0; 4096]);
        write_region(region.as_ref(), 100, b"kv blocks").unwrap();
        let mut back = [0; 11];
        read_region(region.as_ref(), 99, &mut back).unwrap();
        assert_eq!(&back, b"\0kv blocks\0");
        let err = write_region(region.as_ref(), 4090, &[1; 7]).unwrap_err();
        assert!(matches!(err, StagingError::Range(_)), "{err:?}");
        let err = read_region(region.as_ref(), usize::MAX, &mut [0; 2]).unwrap_err();
        assert!(matches!(err, StagingError::Range(_)), "{err:?}");
    }

    #[test]
    fn config_limits() {
        for (chunk, depth) in [(0, 2), (1, 0), (1, MAX_DEPTH + 1)] {
            assert!(matches!(
                StagingConfig::new(chunk, depth),
                Err(StagingError::InvalidConfig { .. })
            ));
        }
        let c = config(1, MAX_DEPTH);
        assert_eq!((c.chunk_len(), c.depth()), (1, MAX_DEPTH));
        let d = StagingConfig::default();
        assert_eq!((d.chunk_len(), d.depth()), (2 << 20, 3));
    }
}
