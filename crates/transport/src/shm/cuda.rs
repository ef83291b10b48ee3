//! CUDA device regions over the shm socket (feature `cuda`): P hands each registered
//! device region over as a CUDA IPC handle ([`kvlease_gpu_mem::cuda::ipc`]), D opens it
//! and copies out of it with device copies.
//!
//! The tests that need a GPU are `#[ignore]`d (`tests/shm.rs`); they passed on one H200
//! (2026-12-04, `scripts/gpu-check.sh` runs them with `--include-ignored`).

use std::io::Write;
use std::sync::Arc;

use kvlease_gpu_mem::cuda::ipc::{self, IpcError, IpcExport, IpcHandle, IpcMapping};
use kvlease_gpu_mem::{DmaRegion, MemoryKind};

use super::error::ShmError;
use crate::error::LinkError;
use crate::metadata::RegionDesc;
use crate::tcp::wire::{self, FrameError};

/// Whether P hands `kind` over as a CUDA IPC handle.
pub(super) fn is_device(kind: MemoryKind) -> bool {
    matches!(kind, MemoryKind::CudaDevice { .. })
}

/// P's side: exports each of `regions` (device memory, with its descriptor and grant
/// slot) and writes one `SHM_CUDA_REGION` frame per export. A region the driver will not
/// export is left out (logged): the peer reads it over TCP. The exports are returned to
/// be held while the peer may read: CUDA requires the exporter to keep the memory alive
/// while an importer has it open.
pub(super) fn hand_over(
    out: &mut impl Write,
    peer: &str,
    regions: &[(Arc<dyn DmaRegion>, RegionDesc, u64)],
) -> Result<Vec<IpcExport>, FrameError> {
    let mut exports = Vec::with_capacity(regions.len());
    for (region, desc, slot) in regions {
        let export = match ipc::export(region) {
            Ok(export) => export,
            Err(err) => {
                tracing::warn!(peer, region = desc.id, %err, "CUDA IPC export failed; the peer reads this region over TCP");
                continue;
            }
        };
        out.write_all(&frame(desc, *slot, export.handle()))?;
        exports.push(export);
    }
    tracing::debug!(
        peer,
        regions = exports.len(),
        "CUDA device regions handed over"
    );
    Ok(exports)
}

/// A `SHM_CUDA_REGION` frame.
fn frame(desc: &RegionDesc, slot: u64, handle: &IpcHandle) -> Vec<u8> {
    let mut body = Vec::with_capacity(wire::SHM_CUDA_REGION_LEN);
    body.extend_from_slice(&super::region_body(desc, slot));
    body.extend_from_slice(&handle.to_bytes());
    wire::frame(wire::SHM_CUDA_REGION, &body)
}

/// D's side: parses the handle of the peer's region `region` of `len` bytes and opens
/// it. `Ok(None)` when it cannot be opened here (no driver, the device is not visible,
/// the driver refuses the handle: logged), so the region is read over TCP.
///
/// # Errors
/// [`ShmError::CudaRegion`] for a malformed handle or one that claims more than the
/// allocation the driver mapped; [`ShmError::Malformed`] for a handle whose length
/// is not the descriptor's.
pub(super) fn open(
    peer: &str,
    region: u64,
    len: u64,
    handle: &[u8],
) -> Result<Option<IpcMapping>, LinkError> {
    let refused = |source: IpcError| LinkError::Shm(ShmError::CudaRegion { region, source });
    let handle = IpcHandle::from_bytes(handle).map_err(|e| refused(e.into()))?;
    if handle.region_len() != len {
        return Err(LinkError::Shm(ShmError::Malformed {
            what: "a CUDA region whose handle and descriptor differ in length",
        }));
    }
    match IpcMapping::open(&handle) {
        Ok(mapping) => Ok(Some(mapping)),
        Err(err @ IpcError::BeyondAllocation { .. }) => Err(refused(err)),
        Err(err) => {
            tracing::warn!(peer, region, %err, "cannot open the peer's CUDA IPC handle; this region is read over TCP");
            Ok(None)
        }
    }
}

/// Whether a copy out of device memory opened through IPC can land in memory of `kind`
/// ([`IpcMapping::copy_into`] takes host, pinned, staged and device memory).
pub(super) fn accepts(kind: MemoryKind) -> bool {
    matches!(
        kind,
        MemoryKind::Host
            | MemoryKind::CudaPinned
            | MemoryKind::StagedHost
            | MemoryKind::CudaDevice { .. }
    )
}

/// Copies `len` bytes at `offset` of `mapping` into `dest` at `dest_offset`.
pub(super) fn copy(
    mapping: &IpcMapping,
    offset: u64,
    dest: &dyn DmaRegion,
    dest_offset: u64,
    len: u64,
) -> Result<(), IpcError> {
    let range = |v: u64| {
        usize::try_from(v).map_err(|_| {
            IpcError::Range(kvlease_gpu_mem::RegionAccessError::OutOfBounds {
                offset,
                len,
                region_len: mapping.region_len() as u64,
            })
        })
    };
    mapping.copy_into(range(offset)?, dest, range(dest_offset)?, range(len)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_frame_length_matches_the_handle_wire_form() {
        assert_eq!(wire::SHM_CUDA_REGION_LEN, 32 + IpcHandle::WIRE_LEN);
    }

    #[test]
    fn malformed_handles_are_typed_errors_and_unopenable_ones_are_skipped() {
        let mut bytes = [0u8; IpcHandle::WIRE_LEN];
        // Not a handle at all.
        let err = open("p", 7, 4096, &bytes).expect_err("no magic");
        assert!(
            matches!(
                err,
                LinkError::Shm(ShmError::CudaRegion {
                    region: 7,
                    source: IpcError::Handle(ipc::IpcHandleError::Magic)
                })
            ),
            "{err:?}"
        );
        let err = open("p", 7, 4096, &bytes[..100]).expect_err("short");
        assert!(
            matches!(
                err,
                LinkError::Shm(ShmError::CudaRegion {
                    source: IpcError::Handle(ipc::IpcHandleError::Length { got: 100, .. }),
                    ..
                })
            ),
            "{err:?}"
        );
        // A well-formed handle whose length is not the descriptor's.
        bytes[..4].copy_from_slice(b"KVCI");
        bytes[4] = 1;
        bytes[104..112].copy_from_slice(&4096u64.to_le_bytes());
        let err = open("p", 7, 8192, &bytes).expect_err("length differs");
        assert!(
            matches!(err, LinkError::Shm(ShmError::Malformed { .. })),
            "{err:?}"
        );
        // Well-formed and consistent, but for a device no process here has (the all-zero
        // UUID), or without a driver: skipped, not an error.
        assert!(matches!(open("p", 7, 4096, &bytes), Ok(None)));
    }

    #[test]
    fn only_device_memory_is_handed_over_and_every_kind_can_receive_it() {
        assert!(is_device(MemoryKind::CudaDevice { ordinal: 1 }));
        for kind in [
            MemoryKind::Host,
            MemoryKind::CudaPinned,
            MemoryKind::StagedHost,
        ] {
            assert!(!is_device(kind));
            assert!(accepts(kind));
        }
        assert!(accepts(MemoryKind::CudaDevice { ordinal: 0 }));
    }
}
