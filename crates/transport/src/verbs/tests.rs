//! Unit tests of the verbs layer that run without a device.

use super::*;

fn assert_send_sync<T: Send + Sync>() {}

#[test]
fn public_types_are_send_and_sync() {
    assert_send_sync::<Device>();
    assert_send_sync::<ProtectionDomain>();
    assert_send_sync::<MemoryRegion>();
    assert_send_sync::<Endpoint>();
    assert_send_sync::<VerbsError>();
    assert_send_sync::<ConnectionInfo>();
    assert_send_sync::<RemoteRegion>();
    assert_send_sync::<RdmaRead>();
}

fn info() -> ConnectionInfo {
    ConnectionInfo {
        qpn: 0x1234,
        psn: 0xabcdef,
        gid: Gid([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 77, 2, 1]),
        mtu: 5,
        max_rd_atom: 128,
        notif_slot_size: 4096,
        recv_slots: 64,
    }
}

#[test]
fn connection_info_round_trips() {
    let i = info();
    let bytes = i.encode();
    assert_eq!(bytes.len(), 40);
    assert_eq!(ConnectionInfo::decode(&bytes).ok(), Some(i));
    assert_eq!(i.gid.ipv4(), Some(std::net::Ipv4Addr::new(10, 77, 2, 1)));
    assert_eq!(i.gid.to_string(), "::ffff:10.77.2.1");
}

#[test]
fn connection_info_refuses_malformed_input() {
    let good = info().encode();
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (good[..39].to_vec(), "length"),
        (Vec::new(), "length"),
        (
            {
                let mut b = good.clone();
                b[0] = b'X';
                b
            },
            "version",
        ),
        (
            {
                let mut b = good.clone();
                b[4..8].copy_from_slice(&0u32.to_be_bytes());
                b
            },
            "queue pair",
        ),
        (
            {
                let mut b = good.clone();
                b[8..12].copy_from_slice(&0x0100_0000u32.to_be_bytes());
                b
            },
            "PSN",
        ),
        (
            {
                let mut b = good.clone();
                b[28] = 6;
                b
            },
            "MTU",
        ),
        (
            {
                let mut b = good.clone();
                b[28] = 0;
                b
            },
            "MTU",
        ),
        (
            {
                let mut b = good.clone();
                b[32..36].copy_from_slice(&0u32.to_be_bytes());
                b
            },
            "slots",
        ),
    ];
    for (bytes, what) in cases {
        match ConnectionInfo::decode(&bytes) {
            Err(VerbsError::BadConnectionInfo { reason }) => {
                assert!(reason.contains(what), "{what}: got {reason}");
            }
            other => panic!("{what}: expected BadConnectionInfo, got {other:?}"),
        }
    }
}

#[test]
fn completion_status_is_named_and_never_panics() {
    let s = WorkCompletionStatus::new(WorkCompletionStatus::REM_ACCESS_ERR, 0x32, 0);
    assert_eq!(s.name(), "IBV_WC_REM_ACCESS_ERR");
    assert_eq!(
        s.to_string(),
        "IBV_WC_REM_ACCESS_ERR (10, vendor error 0x32)"
    );
    assert!(!s.is_flush());
    assert!(WorkCompletionStatus::new(5, 0, 0).is_flush());
    let unknown = WorkCompletionStatus::new(999, 0, 0);
    assert_eq!(unknown.to_string(), "unknown ibv_wc_status (999)");
}

#[test]
fn memlock_error_names_the_limit_and_the_fix() {
    let e = VerbsError::MemlockLimit {
        device: "rxeP".into(),
        len: 1 << 30,
        source: std::io::Error::from_raw_os_error(libc::ENOMEM),
    };
    let msg = e.to_string();
    assert!(msg.contains("RLIMIT_MEMLOCK"), "{msg}");
    assert!(msg.contains("ulimit -l"), "{msg}");
}

/// On a machine without RDMA (this host, CI), opening a device is a clean error. Where
/// a device exists (the SoftRoCE VM), a device that does not exist is one.
#[test]
fn missing_device_is_a_clean_error() {
    match Device::open(&DeviceConfig::named("kvlease-no-such-device")) {
        Err(VerbsError::NoDevice { reason }) => assert!(!reason.is_empty()),
        other => panic!("expected NoDevice, got {other:?}"),
    }
    if std::path::Path::new("/sys/class/infiniband")
        .read_dir()
        .is_err()
    {
        match Device::open(&DeviceConfig::any()) {
            Err(VerbsError::NoDevice { reason }) => assert!(!reason.is_empty()),
            other => panic!("expected NoDevice on a host without RDMA, got {other:?}"),
        }
    }
}

#[test]
fn mtu_values_map_to_bytes() {
    assert_eq!(device::mtu_bytes(1), 256);
    assert_eq!(device::mtu_bytes(3), 1024);
    assert_eq!(device::mtu_bytes(5), 4096);
}
