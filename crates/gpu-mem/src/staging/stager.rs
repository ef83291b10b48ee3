//! Moving a range of any region, whatever its memory kind: one-shot copies
//! ([`write_region`], [`read_region`]) and the TCP backend's per-thread [`Stager`].

use std::io::{self, Read, Write};
use std::os::fd::BorrowedFd;
use std::sync::Arc;

use super::{HostCopier, StagingConfig, StagingError, check_range, recv, send};
use crate::{DmaRegion, MemoryKind, RegionAccessError, RegionBytes};

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

/// Writes `header`, then `len` bytes of `region` at `offset`, to `fd` (a socket), whatever
/// the memory kind: host-accessible memory straight from the region
/// ([`RegionBytes::write_to_fd`], one `writev`, no copy); other memory (CUDA device,
/// staged host) copied into `bounce` first ([`read_region`]) and sent from there. This is
/// how a fenced write's payload leaves its source. `bounce` grows to `len` for such
/// memory and is left for the next call.
///
/// The inner result is the IO outcome, as `write_to_fd`'s; a device copy that fails is
/// an IO error there too (nothing of the payload was sent, the header neither).
///
/// # Errors
/// [`RegionAccessError::OutOfBounds`] (any kind) or
/// [`RegionAccessError::NotHostAccessible`] (a host-accessible kind's own check): nothing
/// is written then.
pub fn send_to_fd(
    region: &dyn DmaRegion,
    header: &[u8],
    offset: u64,
    len: u64,
    fd: BorrowedFd<'_>,
    bounce: &mut Vec<u8>,
) -> Result<io::Result<()>, RegionAccessError> {
    if region.kind().is_host_accessible() {
        return region.write_to_fd(header, offset, len, fd);
    }
    crate::region::check_bounds(offset, len, region.len() as u64)?;
    // Inside the region, whose length is a `usize`.
    let (offset, len) = (offset as usize, len as usize);
    bounce.resize(len, 0);
    if let Err(err) = read_region(region, offset, &mut bounce[..len]) {
        return match err {
            StagingError::Range(range) => Err(range),
            other => Ok(Err(io::Error::other(other))),
        };
    }
    Ok(crate::region::write_all_fd(fd, header, &bounce[..len]))
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
