use super::*;
use crate::staging::StagingConfig;

/// `KV_TEST_CUDA=1` turns a missing driver into a failure instead of a skip.
fn cuda_required() -> bool {
    std::env::var_os("KV_TEST_CUDA").is_some_and(|v| v == "1")
}

#[test]
fn no_driver_gives_clean_errors() {
    if driver_present() {
        eprintln!("skipped: a CUDA driver is present (tests/cuda.rs covers this machine)");
        return;
    }
    assert!(
        !cuda_required(),
        "KV_TEST_CUDA=1 but libcuda.so could not be loaded"
    );
    assert_eq!(probe(), CudaAvailability::NoDriver);
    assert!(matches!(
        CudaDeviceRegion::new(0, 4096),
        Err(CudaError::NoDriver)
    ));
    assert!(matches!(
        CudaPinnedRegion::new(0, 4096),
        Err(CudaError::NoDriver)
    ));
    for request in [
        MemoryRequest::Pinned,
        MemoryRequest::Cuda { ordinal: 0 },
        MemoryRequest::Auto,
    ] {
        let err = alloc(request, 1 << 20).expect_err("no driver: no CUDA memory");
        assert!(matches!(err, CudaError::NoDriver), "{request:?}: {err}");
        assert!(err.to_string().contains("libcuda"), "{err}");
    }
}

#[test]
fn auto_falls_back_to_host_and_says_why() {
    let choice = choose_auto(3);
    match probe() {
        CudaAvailability::NoDriver => {
            assert_eq!(choice.kind, MemoryKind::Host);
            assert!(choice.reason.contains("libcuda"), "{}", choice.reason);
        }
        CudaAvailability::Unusable { reason } => {
            assert_eq!(choice.kind, MemoryKind::Host);
            assert!(choice.reason.contains(&reason), "{}", choice.reason);
        }
        CudaAvailability::Available { devices, .. } => {
            let ordinal = devices[3 % devices.len()].ordinal;
            assert_eq!(choice.kind, MemoryKind::CudaDevice { ordinal });
            assert!(choice.reason.contains("rank 3"), "{}", choice.reason);
        }
    }
}

#[test]
fn device_copies_refuse_host_memory_before_touching_the_driver() {
    let host: Arc<dyn DmaRegion> =
        Arc::new(crate::HostRegion::new(4096).expect("a 4 KiB mmap fits any test machine"));
    let err = copy_htod(host.as_ref(), 0, &[1, 2, 3]).expect_err("host memory");
    assert!(matches!(
        err,
        CudaError::NotDeviceMemory {
            kind: MemoryKind::Host
        }
    ));
    let err = copy_dtoh(host.as_ref(), 0, &mut [0; 3]).expect_err("host memory");
    assert!(matches!(err, CudaError::NotDeviceMemory { .. }));
    let err = export_dmabuf(&host).expect_err("host memory");
    assert!(matches!(err, CudaError::NotDeviceMemory { .. }));
    let err = CudaCopier::new(host, StagingConfig::default()).expect_err("host memory");
    assert!(matches!(err, CudaError::NotDeviceMemory { .. }));
}

/// The range check of `CudaCopier::stage_out` / `stage_in` (tests/cuda.rs
/// `bad_requests_are_errors_not_panics` runs the copier itself on a GPU): a copy past the
/// end of a 4096-byte region is a slot refusal carrying the range, not `CudaError::Range`.
#[test]
fn copier_requests_outside_the_region_are_slot_range_refusals() {
    use crate::staging::SlotError;
    let config = StagingConfig::default();
    assert!(matches!(
        copier::check_request(config, 4096, 0, 4000, 100),
        Err(CudaError::Slot(SlotError::Range(
            RegionAccessError::OutOfBounds {
                offset: 4000,
                len: 100,
                region_len: 4096
            }
        )))
    ));
    copier::check_request(config, 4096, 0, 3996, 100).expect("ends at the region's end");
    copier::check_request(config, 4096, 2, 4096, 0).expect("empty, at the end");
    assert!(matches!(
        copier::check_request(config, 4096, 3, 0, 1),
        Err(CudaError::Slot(SlotError::NoSuchSlot { slot: 3, depth: 3 }))
    ));
    assert!(matches!(
        copier::check_request(config, usize::MAX, 0, usize::MAX, 1),
        Err(CudaError::Slot(SlotError::Range(_)))
    ));
    let chunk = config.chunk_len();
    assert!(matches!(
        copier::check_request(config, 4 * chunk, 0, 0, chunk + 1),
        Err(CudaError::Slot(SlotError::TooLong { .. }))
    ));
}
