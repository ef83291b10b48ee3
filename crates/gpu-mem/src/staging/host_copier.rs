//! The copier for host memory: bounds-checked `memcpy` between a region and owned
//! slots.

use std::sync::Arc;

use super::{Copier, SlotError, StagingConfig, check_copy};
use crate::{DmaRegion, MemoryKind, RegionAccessError};

/// The copier for host memory ([`MemoryKind::Host`], [`MemoryKind::CudaPinned`] and
/// [`MemoryKind::StagedHost`]): bounds-checked `memcpy` between a region and owned slots.
///
/// Its copies are complete when `stage_out`/`stage_in` return, so it overlaps nothing;
/// see the module docs for why it exists.
#[derive(Debug)]
pub struct HostCopier {
    pub(super) region: Arc<dyn DmaRegion>,
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
