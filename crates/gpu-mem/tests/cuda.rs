//! CUDA memory kinds on a real GPU. Every test that needs one is `#[ignore]`d, so a plain
//! `cargo test` lists it as ignored instead of passing having done nothing;
//! `scripts/gpu-check.sh` runs them with `--include-ignored` (and `KV_TEST_CUDA=1`). Run
//! explicitly, a test fails where no CUDA driver or device exists.
#![cfg(feature = "cuda")]

use std::io::{Cursor, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Command;
use std::sync::Arc;

use kvlease_gpu_mem::cuda::ipc::{self, IpcError, IpcHandle, IpcMapping};
use kvlease_gpu_mem::cuda::{
    self, CudaAvailability, CudaCopier, CudaDeviceRegion, CudaError, CudaPinnedRegion,
};
use kvlease_gpu_mem::staging::{self, Copier, SlotError, StagingConfig, StagingError};
use kvlease_gpu_mem::{
    BlockPool, DmaRegion, HostRegion, KvLayout, MemoryKind, MemoryRequest, RegionAccessError,
    RegionBytes,
};

/// The devices of this machine.
///
/// # Panics
/// Where no CUDA GPU is usable, naming why: these tests run only when asked for.
fn gpu() -> Vec<cuda::CudaDeviceInfo> {
    match cuda::probe() {
        CudaAvailability::Available { devices, .. } => devices,
        CudaAvailability::NoDriver => {
            panic!("no CUDA driver (libcuda.so could not be loaded): this test needs a GPU")
        }
        CudaAvailability::Unusable { reason } => {
            panic!("CUDA unusable: {reason}: this test needs a GPU")
        }
    }
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len as u64)
        .map(|i| {
            let x = (i ^ seed).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            (x >> 56) as u8 ^ (i as u8)
        })
        .collect()
}

fn device(len: usize) -> Arc<dyn DmaRegion> {
    Arc::new(CudaDeviceRegion::new(0, len).expect("device 0 has room for a test region"))
}

fn read_device(region: &dyn DmaRegion) -> Vec<u8> {
    let mut out = vec![0; region.len()];
    cuda::copy_dtoh(region, 0, &mut out).expect("whole region");
    out
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it"]
fn device_memory_is_zeroed_and_round_trips_at_any_offset() {
    gpu();
    let len = (3 << 20) + 5;
    let region = device(len);
    assert_eq!(region.kind(), MemoryKind::CudaDevice { ordinal: 0 });
    assert_eq!(region.len(), len);
    assert!(read_device(region.as_ref()).iter().all(|&b| b == 0));

    let data = pattern(len, 1);
    cuda::copy_htod(region.as_ref(), 0, &data).unwrap();
    assert_eq!(read_device(region.as_ref()), data);

    let patch = pattern(4099, 2);
    cuda::copy_htod(region.as_ref(), 1_000_001, &patch).unwrap();
    let mut back = vec![0; patch.len() + 2];
    cuda::copy_dtoh(region.as_ref(), 1_000_000, &mut back).unwrap();
    assert_eq!(back[0], data[1_000_000]);
    assert_eq!(back[1..=patch.len()], patch);
    assert_eq!(back[patch.len() + 1], data[1_000_001 + patch.len()]);

    cuda::copy_htod(region.as_ref(), len, &[]).unwrap();
    let err = cuda::copy_htod(region.as_ref(), len - 1, &[1, 2]).unwrap_err();
    assert!(matches!(
        err,
        CudaError::Range(RegionAccessError::OutOfBounds { .. })
    ));
    let err = cuda::copy_dtoh(region.as_ref(), usize::MAX, &mut [0]).unwrap_err();
    assert!(matches!(err, CudaError::Range(_)));
    // Device memory is refused by the host accessors.
    assert!(matches!(
        region.read_into(0, &mut [0; 4]),
        Err(RegionAccessError::NotHostAccessible { .. })
    ));
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it"]
fn pinned_memory_is_host_accessible() {
    gpu();
    let region = CudaPinnedRegion::new(0, 1 << 20).unwrap();
    assert_eq!(region.kind(), MemoryKind::CudaPinned);
    let mut all = vec![1; 1 << 20];
    region.read_into(0, &mut all).unwrap();
    assert!(all.iter().all(|&b| b == 0), "pinned memory starts zeroed");
    let data = pattern(1 << 20, 3);
    region.write_from(0, &data).unwrap();
    region.read_into(0, &mut all).unwrap();
    assert_eq!(all, data);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it"]
fn bad_requests_are_errors_not_panics() {
    let devices = gpu();
    assert!(matches!(
        CudaDeviceRegion::new(0, 0),
        Err(CudaError::ZeroLength)
    ));
    let missing = devices.len() as u32 + 7;
    assert!(matches!(
        CudaDeviceRegion::new(missing, 1),
        Err(CudaError::NoSuchDevice { .. })
    ));
    let host: Arc<dyn DmaRegion> = Arc::new(HostRegion::new(4096).unwrap());
    let mut copier = CudaCopier::new(device(4096), StagingConfig::default()).unwrap();
    assert!(matches!(
        copier.set_region(host),
        Err(CudaError::NotDeviceMemory { .. })
    ));
    // The region is exactly the 4096 bytes asked for (only the allocation behind it is
    // rounded up to DEVICE_ALLOC_GRANULE), and a copier refuses a range outside it as
    // every copier does: a slot refusal, `SlotError::Range` (see `check_request` in
    // src/cuda/copier.rs, whose host test covers this without a GPU).
    assert_eq!(copier.region().len(), 4096);
    assert!(matches!(
        copier.stage_out(0, 4000, 100),
        Err(CudaError::Slot(SlotError::Range(
            RegionAccessError::OutOfBounds {
                offset: 4000,
                len: 100,
                region_len: 4096
            }
        )))
    ));
    assert!(matches!(copier.slot(3), Err(CudaError::Slot(_))));
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it"]
fn block_pools_come_in_every_cuda_kind() {
    gpu();
    let layout = KvLayout::new(2, 16, 4, 16, 128, 2).unwrap();
    let pool = BlockPool::new(layout, MemoryRequest::Cuda { ordinal: 0 }).unwrap();
    assert_eq!(pool.kind(), MemoryKind::CudaDevice { ordinal: 0 });
    assert!(pool.region().len() as u64 >= layout.total_bytes());
    let pool = BlockPool::new(layout, MemoryRequest::Pinned).unwrap();
    assert_eq!(pool.kind(), MemoryKind::CudaPinned);
    let pool = BlockPool::new(layout, MemoryRequest::Auto).unwrap();
    assert_eq!(pool.kind(), MemoryKind::CudaDevice { ordinal: 0 });
    let choice = cuda::choose_auto(0);
    assert_eq!(choice.kind, MemoryKind::CudaDevice { ordinal: 0 });
    assert!(choice.reason.contains("device 0"), "{}", choice.reason);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it"]
fn staging_moves_every_byte_of_device_memory() {
    gpu();
    let len = (5 << 20) + 12_345;
    let data = pattern(len, 4);
    let src = device(len);
    cuda::copy_htod(src.as_ref(), 0, &data).unwrap();
    let dst = device(len);
    for (chunk, depth) in [(4096, 1), (1 << 20, 2), ((2 << 20) + 3, 3), (64 << 20, 2)] {
        let config = StagingConfig::new(chunk, depth).unwrap();
        for (offset, n) in [(0, len), (7, len - 7), (1 << 20, 1), (len, 0)] {
            let mut copier = CudaCopier::new(Arc::clone(&src), config).unwrap();
            let mut wire = Vec::with_capacity(n);
            staging::send(&mut copier, offset, n, &mut wire).unwrap();
            assert_eq!(
                wire,
                data[offset..offset + n],
                "send {offset}+{n} {config:?}"
            );

            cuda::copy_htod(dst.as_ref(), 0, &vec![0; len]).unwrap();
            copier.set_region(Arc::clone(&dst)).unwrap();
            staging::recv(&mut copier, offset, n, &mut Cursor::new(&wire)).unwrap();
            let got = read_device(dst.as_ref());
            assert_eq!(got[offset..offset + n], data[offset..offset + n]);
            assert!(got[..offset].iter().all(|&b| b == 0));
            assert!(got[offset + n..].iter().all(|&b| b == 0));
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it"]
fn staging_errors_mid_way_leave_the_copier_usable() {
    gpu();
    let len = 8 << 20;
    let data = pattern(len, 5);
    let src = device(len);
    cuda::copy_htod(src.as_ref(), 0, &data).unwrap();
    let config = StagingConfig::new(1 << 20, 3).unwrap();
    let mut copier = CudaCopier::new(Arc::clone(&src), config).unwrap();

    struct Broken(usize);
    impl Write for Broken {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if self.0 < buf.len() {
                return Err(std::io::Error::other("peer reset"));
            }
            self.0 -= buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let err = staging::send(&mut copier, 0, len, &mut Broken(3 << 20)).unwrap_err();
    assert!(matches!(err, StagingError::Io { chunk: 3, .. }), "{err:?}");
    let mut wire = Vec::new();
    staging::send(&mut copier, 0, len, &mut wire).unwrap();
    assert_eq!(wire, data);

    let dst = device(len);
    copier.set_region(Arc::clone(&dst)).unwrap();
    let err = staging::recv(&mut copier, 0, len, &mut Cursor::new(&data[..len / 2])).unwrap_err();
    assert!(matches!(err, StagingError::Io { chunk: 4, .. }), "{err:?}");
    assert_eq!(read_device(dst.as_ref())[..len / 2], data[..len / 2]);
    staging::recv(&mut copier, 0, len, &mut Cursor::new(&data)).unwrap();
    assert_eq!(read_device(dst.as_ref()), data);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it"]
fn device_to_device_through_a_loopback_socket() {
    gpu();
    let len = (48 << 20) + 1;
    let data = pattern(len, 6);
    let src = device(len);
    cuda::copy_htod(src.as_ref(), 0, &data).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let sender = std::thread::spawn(move || {
        let (mut socket, _) = listener.accept().unwrap();
        let mut copier = CudaCopier::new(src, StagingConfig::default()).unwrap();
        staging::send(&mut copier, 0, len, &mut socket).unwrap();
        socket.flush().unwrap();
    });
    let mut socket = TcpStream::connect(addr).unwrap();
    let dst = device(len);
    let mut copier = CudaCopier::new(Arc::clone(&dst), StagingConfig::default()).unwrap();
    staging::recv(&mut copier, 0, len, &mut socket).unwrap();
    sender.join().unwrap();
    let mut rest = Vec::new();
    socket.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty(), "send wrote only the payload");
    assert_eq!(read_device(dst.as_ref()), data);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it"]
fn dmabuf_export_follows_the_device_attribute() {
    let devices = gpu();
    let region = device(3 << 20);
    match cuda::export_dmabuf(&region) {
        Ok(handle) => {
            assert!(devices[0].dmabuf_supported);
            assert_eq!(handle.len, 3 << 20);
            assert_eq!(handle.offset, 0);
            let file = std::fs::File::from(handle.fd.try_clone().unwrap());
            file.metadata().expect("the dmabuf fd is open");
            eprintln!("dmabuf export: fd ok, {} bytes", handle.len);
        }
        Err(CudaError::DmabufUnsupported { why, .. }) => {
            // Only the driver's own refusal may contradict the attribute.
            assert!(
                !devices[0].dmabuf_supported || why.contains("CUDA_ERROR_NOT_SUPPORTED"),
                "{why}"
            );
            eprintln!("dmabuf unsupported on this device: {why}");
        }
        Err(other) => panic!("dmabuf export failed: {other}"),
    }
}

#[test]
fn values_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<CudaDeviceRegion>();
    send_sync::<CudaPinnedRegion>();
    send_sync::<cuda::DmabufHandle>();
    send::<CudaCopier>();
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it"]
fn no_free_failed() {
    gpu();
    drop(device(1 << 20));
    drop(CudaPinnedRegion::new(0, 1 << 20).unwrap());
    assert_eq!(cuda::drop_errors(), 0);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it"]
fn stager_and_region_copies_handle_device_memory() {
    gpu();
    let len = (3 << 20) + 77;
    let data = pattern(len, 7);
    let a = device(len);
    staging::write_region(a.as_ref(), 0, &data).unwrap();
    let mut back = vec![0; len - 10];
    staging::read_region(a.as_ref(), 10, &mut back).unwrap();
    assert_eq!(back, data[10..]);
    assert!(matches!(
        staging::write_region(a.as_ref(), len, &[1]),
        Err(StagingError::Range(_))
    ));

    // One stager, three regions: device A → wire → device B → wire → host C.
    let b = device(len);
    let host: Arc<dyn DmaRegion> = Arc::new(HostRegion::new(len).unwrap());
    let mut stager = staging::Stager::new(StagingConfig::new(1 << 20, 2).unwrap());
    let mut wire = Vec::new();
    stager.send(&a, 0, len, &mut wire).unwrap();
    stager.recv(&b, 0, len, &mut Cursor::new(&wire)).unwrap();
    let mut wire2 = Vec::new();
    stager.send(&b, 5, len - 5, &mut wire2).unwrap();
    stager
        .recv(&host, 5, len - 5, &mut Cursor::new(&wire2))
        .unwrap();
    let mut got = vec![0; len];
    host.read_into(0, &mut got).unwrap();
    assert_eq!(got[5..], data[5..]);
    assert_eq!(read_device(b.as_ref()), data);
}

/// Set in the child process of [`ipc_export_is_read_by_another_process`]: the exported
/// handle's wire form, in hex.
const IPC_CHILD_ENV: &str = "KV_TEST_CUDA_IPC_HANDLE";
const IPC_LEN: usize = (5 << 20) + 123;
const IPC_SEED: u64 = 11;

fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn from_hex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("the parent wrote hex"))
        .collect()
}

/// CUDA IPC needs two processes (`cuIpcOpenMemHandle` refuses a handle of its own
/// process): the test exports a region filled with a pattern and runs this same test
/// binary again, filtered to this test, with the handle in [`IPC_CHILD_ENV`]; the child
/// opens it and checks every way of copying out ([`ipc_child`]).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it"]
fn ipc_export_is_read_by_another_process() {
    if let Ok(hex) = std::env::var(IPC_CHILD_ENV) {
        ipc_child(&hex);
        return;
    }
    gpu();
    let region = device(IPC_LEN);
    let data = pattern(IPC_LEN, IPC_SEED);
    cuda::copy_htod(region.as_ref(), 0, &data).unwrap();
    let export = ipc::export(&region).unwrap();
    let handle = *export.handle();
    assert_eq!(handle.region_len(), IPC_LEN as u64);
    assert_eq!(handle.offset_in_allocation(), 0);
    assert_eq!(handle.exporter_ordinal(), 0);
    // In the exporting process the driver refuses the handle: an error, not a panic.
    let err = IpcMapping::open(&handle).expect_err("cuIpcOpenMemHandle in the exporter");
    assert!(
        matches!(err, IpcError::Cuda(CudaError::Driver { .. })),
        "{err}"
    );
    // Host memory cannot be exported.
    let host: Arc<dyn DmaRegion> = Arc::new(HostRegion::new(4096).unwrap());
    assert!(matches!(
        ipc::export(&host),
        Err(IpcError::Cuda(CudaError::NotDeviceMemory { .. }))
    ));

    let exe = std::env::current_exe().expect("the test binary's path");
    let out = Command::new(exe)
        .args([
            "ipc_export_is_read_by_another_process",
            "--exact",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(IPC_CHILD_ENV, to_hex(&handle.to_bytes()))
        .output()
        .expect("spawn the test binary again");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the importing child failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    // The filter matched: the child ran the test rather than nothing.
    assert!(stdout.contains("1 passed"), "{stdout}\n{stderr}");
    assert!(stdout.contains("ipc child: all copies matched"), "{stdout}");
    // The child only read: the exporter's bytes are unchanged.
    assert_eq!(read_device(region.as_ref()), data);
    drop(export);
    assert_eq!(cuda::drop_errors(), 0);
}

/// The importing side of [`ipc_export_is_read_by_another_process`].
fn ipc_child(hex: &str) {
    let data = pattern(IPC_LEN, IPC_SEED);
    let handle = IpcHandle::from_bytes(&from_hex(hex)).expect("the parent sent a valid handle");
    let mapping = IpcMapping::open(&handle).expect("open the parent's handle");
    assert_eq!(mapping.region_len(), IPC_LEN);
    assert_eq!(mapping.device_uuid(), handle.device_uuid());

    // Device → host: all of it, and an unaligned piece.
    let mut all = vec![0; IPC_LEN];
    mapping.copy_to_host(0, &mut all).unwrap();
    assert!(all == data, "device → host copy differs");
    let mut piece = vec![0; 4099];
    mapping.copy_to_host(1_000_001, &mut piece).unwrap();
    assert_eq!(piece, data[1_000_001..1_000_001 + 4099]);

    // Device → device (same device), at an offset in the destination.
    let local = device(IPC_LEN + 7);
    mapping
        .copy_into(3, local.as_ref(), 7, IPC_LEN - 3)
        .unwrap();
    let mut back = vec![0; IPC_LEN - 3];
    cuda::copy_dtoh(local.as_ref(), 7, &mut back).unwrap();
    assert!(back == data[3..], "device → device copy differs");

    // Device → host regions (mmap'd host memory and CUDA pinned memory).
    let host: Arc<dyn DmaRegion> = Arc::new(HostRegion::new(IPC_LEN).unwrap());
    mapping.copy_into(0, host.as_ref(), 0, IPC_LEN).unwrap();
    let mut got = vec![0; IPC_LEN];
    host.read_into(0, &mut got).unwrap();
    assert!(got == data, "device → host region copy differs");
    let pinned = CudaPinnedRegion::new(0, 1 << 20).unwrap();
    mapping
        .copy_into(IPC_LEN - (1 << 20), &pinned, 0, 1 << 20)
        .unwrap();
    let mut got = vec![0; 1 << 20];
    pinned.read_into(0, &mut got).unwrap();
    assert_eq!(got, data[IPC_LEN - (1 << 20)..]);

    // Ranges outside either side are refused before the driver sees them.
    for (offset, len) in [(IPC_LEN, 1), (IPC_LEN - 1, 2), (usize::MAX, 2)] {
        let err = mapping
            .copy_into(offset, local.as_ref(), 0, len)
            .expect_err("outside the mapping");
        assert!(matches!(err, IpcError::Range(_)), "{err}");
    }
    let err = mapping
        .copy_into(0, host.as_ref(), 1, IPC_LEN)
        .expect_err("outside the destination");
    assert!(matches!(err, IpcError::Range(_)), "{err}");
    let err = mapping
        .copy_to_host(IPC_LEN, &mut [0])
        .expect_err("outside the mapping");
    assert!(matches!(err, IpcError::Range(_)), "{err}");

    // A handle that claims more than the parent exported is refused at open (the driver's
    // allocation is 6 MiB: IPC_LEN rounded up to the 2 MiB granule).
    let mut bytes = handle.to_bytes();
    bytes[104..112].copy_from_slice(&(64u64 << 20).to_le_bytes());
    let lying = IpcHandle::from_bytes(&bytes).unwrap();
    drop(mapping);
    let err = IpcMapping::open(&lying).expect_err("beyond the allocation");
    assert!(matches!(err, IpcError::BeyondAllocation { .. }), "{err}");
    // A handle the driver never issued is refused by the driver.
    let mut bytes = handle.to_bytes();
    bytes[8..72].fill(0x5a);
    let forged = IpcHandle::from_bytes(&bytes).unwrap();
    assert!(IpcMapping::open(&forged).is_err());
    assert_eq!(cuda::drop_errors(), 0);
    println!("ipc child: all copies matched");
}
