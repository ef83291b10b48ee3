//! The staging copier for CUDA device memory: asynchronous copies on its own stream
//! into pinned slots, one event per slot.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, sys};

use super::{
    CudaError, CudaPinnedRegion, context, device_address, device_ordinal, driver, report_drop,
};
use crate::region::DmaRegion;
use crate::staging::{self, Copier, StagingConfig};

/// The staging copier for CUDA device memory: asynchronous copies on its own stream
/// between the region and `depth` pinned slots, with one event per slot (see
/// [`staging`]).
#[derive(Debug)]
pub struct CudaCopier {
    // Field order is drop order. `Drop::drop` first waits for the stream; then the events
    // and the stream go, then the pinned slots, then the region, then the context.
    events: Vec<CudaEvent>,
    in_flight: Vec<bool>,
    stream: Arc<CudaStream>,
    staging: CudaPinnedRegion,
    region: Arc<dyn DmaRegion>,
    config: StagingConfig,
    ordinal: u32,
    ctx: Arc<CudaContext>,
}

impl CudaCopier {
    /// A copier for device memory `region` with `config.depth()` pinned slots of
    /// `config.chunk_len()` bytes and a new non-blocking stream.
    ///
    /// # Errors
    /// [`CudaError::NotDeviceMemory`], [`CudaError::NoDriver`], [`CudaError::Driver`].
    pub fn new(region: Arc<dyn DmaRegion>, config: StagingConfig) -> Result<Self, CudaError> {
        let ordinal = device_ordinal(region.as_ref())?;
        let ctx = context(ordinal)?;
        let stream = ctx.new_stream().map_err(driver("cuStreamCreate"))?;
        let events = (0..config.depth())
            .map(|_| ctx.new_event(None).map_err(driver("cuEventCreate")))
            .collect::<Result<Vec<_>, _>>()?;
        let chunk_len = config.chunk_len();
        let staging_len = chunk_len
            .checked_mul(config.depth())
            .ok_or(CudaError::TooLarge { bytes: chunk_len })?;
        let staging = CudaPinnedRegion::new(ordinal, staging_len)?;
        Ok(Self {
            events,
            in_flight: vec![false; config.depth()],
            stream,
            staging,
            region,
            config,
            ordinal,
            ctx,
        })
    }

    /// Switches to another device region of the same device, after every copy in flight
    /// has finished.
    ///
    /// # Errors
    /// [`CudaError::NotDeviceMemory`], [`CudaError::OtherDevice`], or the failure of a
    /// copy in flight.
    pub fn set_region(&mut self, region: Arc<dyn DmaRegion>) -> Result<(), CudaError> {
        let ordinal = device_ordinal(region.as_ref())?;
        if ordinal != self.ordinal {
            return Err(CudaError::OtherDevice {
                copier: self.ordinal,
                region: ordinal,
            });
        }
        self.wait_all()?;
        self.region = region;
        Ok(())
    }

    /// The region this copier moves.
    pub fn region(&self) -> &Arc<dyn DmaRegion> {
        &self.region
    }

    fn check(&self, slot: usize, offset: usize, len: usize) -> Result<(), CudaError> {
        check_request(self.config, self.region.len(), slot, offset, len)
    }

    /// The host address of the start of `slot` (inside the pinned staging allocation).
    fn slot_ptr(&self, slot: usize) -> *mut u8 {
        self.staging
            .base_ptr()
            .wrapping_add(slot * self.config.chunk_len())
    }

    /// Marks the copy just enqueued for `slot`. If the event cannot be recorded, nothing
    /// could tell when the slot is free again, so the stream is drained before the error
    /// is returned.
    fn record(&mut self, slot: usize) -> Result<(), CudaError> {
        if let Err(err) = self.events[slot].record(&self.stream) {
            if let Err(sync) = self.stream.synchronize() {
                tracing::error!(error = %sync, "CUDA staging: stream sync after a failed event record");
            }
            return Err(CudaError::Driver {
                call: "cuEventRecord",
                source: err,
            });
        }
        self.in_flight[slot] = true;
        Ok(())
    }

    fn wait(&mut self, slot: usize) -> Result<(), CudaError> {
        if self.in_flight[slot] {
            self.events[slot]
                .synchronize()
                .map_err(driver("cuEventSynchronize"))?;
            self.in_flight[slot] = false;
        }
        Ok(())
    }

    fn check_slot(&self, slot: usize) -> Result<(), CudaError> {
        staging::check_copy(slot, 0, 0, self.config, 0)?;
        Ok(())
    }
}

/// The refusal of a copy request (`slot`, `offset`, `len`) by a copier with `config`
/// over a region of `region_len` bytes, as every copier refuses it
/// ([`staging::check_copy`]): a range outside the region is
/// `CudaError::Slot(SlotError::Range(_))`, like the host copier's `SlotError::Range`. No
/// driver call: tested without a GPU.
pub(super) fn check_request(
    config: StagingConfig,
    region_len: usize,
    slot: usize,
    offset: usize,
    len: usize,
) -> Result<(), CudaError> {
    staging::check_copy(slot, offset, len, config, region_len)?;
    Ok(())
}

impl Copier for CudaCopier {
    type Error = CudaError;

    fn config(&self) -> StagingConfig {
        self.config
    }

    fn memory_len(&self) -> usize {
        self.region.len()
    }

    fn stage_out(&mut self, slot: usize, offset: usize, len: usize) -> Result<(), CudaError> {
        self.check(slot, offset, len)?;
        self.ctx
            .bind_to_thread()
            .map_err(driver("cuCtxSetCurrent"))?;
        let src = device_address(self.region.as_ref(), offset);
        let dst = self.slot_ptr(slot);
        // SAFETY: `src .. src + len` lies inside the device region and `dst .. dst + len`
        // inside slot `slot` of the pinned staging buffer (both checked above). Both stay
        // allocated until the copy finishes: the copier owns the buffer and an `Arc` of
        // the region, and waits for the stream before it drops or replaces either. The host
        // touches the slot only through `slot`/`slot_mut`, which wait for its event first.
        let copied =
            unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, self.stream.cu_stream()) };
        copied.result().map_err(driver("cuMemcpyDtoHAsync"))?;
        self.record(slot)
    }

    fn stage_in(&mut self, slot: usize, offset: usize, len: usize) -> Result<(), CudaError> {
        self.check(slot, offset, len)?;
        self.ctx
            .bind_to_thread()
            .map_err(driver("cuCtxSetCurrent"))?;
        let dst = device_address(self.region.as_ref(), offset);
        let src = self.slot_ptr(slot);
        // SAFETY: as in `stage_out`, with the direction reversed: the slot is only read by
        // the copy and the host cannot write it until its event has completed.
        let copied = unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src.cast_const().cast(), len, self.stream.cu_stream())
        };
        copied.result().map_err(driver("cuMemcpyHtoDAsync"))?;
        self.record(slot)
    }

    fn slot(&mut self, slot: usize) -> Result<&[u8], CudaError> {
        self.check_slot(slot)?;
        self.wait(slot)?;
        // SAFETY: the slot is `chunk_len` initialised bytes (zeroed at allocation) inside
        // the pinned buffer the copier owns, which nobody else can reach; its copies have
        // finished (waited above) and no new one can start while the borrow of `self`
        // lives. Other slots, which copies may be using, are not part of the slice.
        Ok(unsafe { std::slice::from_raw_parts(self.slot_ptr(slot), self.config.chunk_len()) })
    }

    fn slot_mut(&mut self, slot: usize) -> Result<&mut [u8], CudaError> {
        self.check_slot(slot)?;
        self.wait(slot)?;
        // SAFETY: as in `slot`; `&mut self` makes the host borrow unique.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.slot_ptr(slot), self.config.chunk_len()) })
    }

    fn wait_all(&mut self) -> Result<(), CudaError> {
        self.stream
            .synchronize()
            .map_err(driver("cuStreamSynchronize"))?;
        self.in_flight.fill(false);
        Ok(())
    }
}

impl Drop for CudaCopier {
    fn drop(&mut self) {
        // Copies in flight use the staging buffer and the region: finish them first.
        report_drop("cuStreamSynchronize", self.stream.synchronize());
    }
}
