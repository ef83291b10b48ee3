//! The wire form (peer input) and the no-driver paths; these need no GPU. The GPU test,
//! which needs a second process, is in `tests/cuda.rs`.

use proptest::prelude::*;

use super::*;
use crate::HostRegion;
use crate::cuda::driver_present;

fn handle(
    raw: [u8; 64],
    uuid: [u8; 16],
    exporter_ordinal: u32,
    offset: u64,
    len: u64,
) -> IpcHandle {
    IpcHandle {
        raw,
        uuid: DeviceUuid(uuid),
        exporter_ordinal,
        offset,
        len,
    }
}

fn sample() -> IpcHandle {
    let mut raw = [0; 64];
    for (i, b) in raw.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(37) ^ 0x5a;
    }
    handle(raw, [0xab; 16], 3, 4096, 1 << 30)
}

#[test]
fn wire_form_has_the_documented_layout() {
    let h = sample();
    let bytes = h.to_bytes();
    assert_eq!(bytes.len(), IpcHandle::WIRE_LEN);
    assert_eq!(&bytes[..4], b"KVCI");
    assert_eq!(bytes[4], 1);
    assert_eq!(bytes[8..72], h.raw);
    assert_eq!(bytes[72..88], [0xab; 16]);
    assert_eq!(bytes[88..92], 3u32.to_le_bytes());
    assert_eq!(bytes[96..104], 4096u64.to_le_bytes());
    assert_eq!(bytes[104..112], (1u64 << 30).to_le_bytes());
    assert!(bytes[5..8].iter().chain(&bytes[92..96]).all(|&b| b == 0));
    assert_eq!(IpcHandle::from_bytes(&bytes), Ok(h));
    assert_eq!(h.region_len(), 1 << 30);
    assert_eq!(h.offset_in_allocation(), 4096);
    assert_eq!(h.exporter_ordinal(), 3);
    assert_eq!(h.device_uuid(), DeviceUuid([0xab; 16]));
}

#[test]
fn malformed_handles_are_refused_with_the_reason() {
    let good = sample().to_bytes();
    for len in [0, 1, IpcHandle::WIRE_LEN - 1, IpcHandle::WIRE_LEN + 1, 4096] {
        let mut bytes = good.to_vec();
        bytes.resize(len, 0);
        assert_eq!(
            IpcHandle::from_bytes(&bytes),
            Err(IpcHandleError::Length {
                got: len,
                expected: IpcHandle::WIRE_LEN
            })
        );
    }
    let mut bytes = good;
    bytes[0] = b'X';
    assert_eq!(IpcHandle::from_bytes(&bytes), Err(IpcHandleError::Magic));
    let mut bytes = good;
    bytes[4] = 2;
    assert_eq!(
        IpcHandle::from_bytes(&bytes),
        Err(IpcHandleError::Version { got: 2, known: 1 })
    );
    for index in [5, 7, 92, 95] {
        let mut bytes = good;
        bytes[index] = 1;
        assert_eq!(
            IpcHandle::from_bytes(&bytes),
            Err(IpcHandleError::Reserved { index, value: 1 })
        );
    }
    let mut bytes = good;
    bytes[104..112].fill(0);
    assert_eq!(
        IpcHandle::from_bytes(&bytes),
        Err(IpcHandleError::ZeroLength)
    );
    for (offset, len) in [
        (u64::MAX, 1),
        (1, u64::MAX),
        (1 << 62, 1 << 62),
        (0, 1 << 63),
    ] {
        let bytes = handle([0; 64], [0; 16], 0, offset, len).to_bytes();
        assert_eq!(
            IpcHandle::from_bytes(&bytes),
            Err(IpcHandleError::TooLarge { offset, len })
        );
    }
    // The largest range that still fits is accepted.
    let max = isize::MAX as u64;
    let bytes = handle([0; 64], [0; 16], 0, 1, max - 1).to_bytes();
    assert!(IpcHandle::from_bytes(&bytes).is_ok());
}

#[test]
fn device_uuid_prints_as_nvidia_smi_does() {
    let uuid = DeviceUuid([
        0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66,
        0x77,
    ]);
    assert_eq!(uuid.to_string(), "GPU-01234567-89ab-cdef-0011-223344556677");
}

#[test]
fn debug_does_not_dump_the_raw_handle() {
    let text = format!("{:?}", sample());
    assert!(text.contains("offset: 4096"), "{text}");
    assert!(!text.contains("raw"), "{text}");
}

#[test]
fn export_refuses_host_memory_before_touching_the_driver() {
    let host: Arc<dyn DmaRegion> =
        Arc::new(HostRegion::new(4096).expect("a 4 KiB mmap fits any test machine"));
    let err = export(&host).expect_err("host memory");
    assert!(
        matches!(
            err,
            IpcError::Cuda(CudaError::NotDeviceMemory {
                kind: MemoryKind::Host
            })
        ),
        "{err}"
    );
}

#[test]
fn open_without_a_driver_is_an_error() {
    if driver_present() {
        eprintln!("skipped: a CUDA driver is present (tests/cuda.rs covers this machine)");
        return;
    }
    let err = IpcMapping::open(&sample()).expect_err("no driver");
    assert!(matches!(err, IpcError::Cuda(CudaError::NoDriver)), "{err}");
}

fn arb_handle() -> impl Strategy<Value = IpcHandle> {
    let max = isize::MAX as u64;
    (
        prop::array::uniform32(any::<u8>()),
        prop::array::uniform32(any::<u8>()),
        prop::array::uniform16(any::<u8>()),
        any::<u32>(),
        0..max,
    )
        .prop_flat_map(move |(a, b, uuid, ordinal, offset)| {
            (1..=max - offset).prop_map(move |len| {
                let mut raw = [0; 64];
                raw[..32].copy_from_slice(&a);
                raw[32..].copy_from_slice(&b);
                handle(raw, uuid, ordinal, offset, len)
            })
        })
}

proptest! {
    /// Whatever a peer sends, parsing returns a value or an error, never panics, and what
    /// it accepts re-encodes to the same bytes.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        if let Ok(h) = IpcHandle::from_bytes(&bytes) {
            prop_assert_eq!(&h.to_bytes()[..], &bytes[..]);
        }
    }

    /// Valid headers with arbitrary contents: the interesting part of the input space,
    /// which random bytes almost never reach.
    #[test]
    fn arbitrary_fields_behind_a_valid_header(
        mut body in prop::collection::vec(any::<u8>(), IpcHandle::WIRE_LEN),
    ) {
        body[..4].copy_from_slice(b"KVCI");
        body[4] = 1;
        match IpcHandle::from_bytes(&body) {
            Ok(h) => {
                prop_assert!(h.region_len() > 0);
                prop_assert!(h.offset_in_allocation().checked_add(h.region_len()).is_some());
                prop_assert_eq!(&h.to_bytes()[..], &body[..]);
            }
            Err(
                IpcHandleError::Reserved { .. }
                | IpcHandleError::ZeroLength
                | IpcHandleError::TooLarge { .. },
            ) => {}
            Err(other) => prop_assert!(false, "unexpected error {other:?}"),
        }
    }

    #[test]
    fn handles_round_trip(h in arb_handle()) {
        prop_assert_eq!(IpcHandle::from_bytes(&h.to_bytes()), Ok(h));
    }

    /// Flipping any one byte either still parses (a byte of the opaque handle, the UUID,
    /// the ordinal, or a length change that stays valid) to a handle that differs in that
    /// byte, or is refused.
    #[test]
    fn one_corrupted_byte_is_never_silently_ignored(
        h in arb_handle(),
        index in 0..IpcHandle::WIRE_LEN,
        flip in 1..=255u8,
    ) {
        let mut bytes = h.to_bytes();
        bytes[index] ^= flip;
        if let Ok(parsed) = IpcHandle::from_bytes(&bytes) {
            prop_assert_ne!(parsed, h);
            prop_assert_eq!(parsed.to_bytes(), bytes);
        }
    }
}
