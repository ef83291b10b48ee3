use super::*;
use crate::region::{RegionAccessError, RegionBytes};

fn explicit_huge_pages_free() -> bool {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("HugePages_Free:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .is_some_and(|n| n > 0)
}

#[test]
fn try_policy_falls_back_when_no_explicit_huge_pages() {
    let region = HostRegion::new(3 << 20).expect("3 MiB of normal pages maps");
    assert_eq!(region.len(), 3 << 20);
    assert_eq!(region.base_ptr() as usize % PAGE_SIZE, 0);
    if explicit_huge_pages_free() {
        assert_eq!(region.pages(), PageKind::Huge2M);
    } else {
        assert_ne!(region.pages(), PageKind::Huge2M);
        let required = HostRegion::with_policy(3 << 20, HugePagePolicy::Require);
        assert!(
            matches!(required, Err(HostAllocError::Mmap { .. })),
            "{required:?}"
        );
    }
}

#[test]
fn normal_pages_round_up_and_are_zeroed_and_writable() {
    let region = HostRegion::with_policy(5000, HugePagePolicy::Never).expect("maps");
    assert_eq!(region.pages(), PageKind::Normal);
    assert_eq!(region.mapped_len(), 8192);
    let mut buf = [1u8; 16];
    region.read_into(4984, &mut buf).expect("in bounds");
    assert_eq!(buf, [0; 16]);
    region.write_from(4990, b"abcdefghij").expect("in bounds");
    region.read_into(4990, &mut buf[..10]).expect("in bounds");
    assert_eq!(&buf[..10], b"abcdefghij");
    assert!(region.write_from(4991, b"abcdefghij").is_err());
}

#[test]
fn a_view_sees_the_owners_writes_through_a_passed_descriptor() {
    let owner = HostRegion::new(3 << 20).expect("maps");
    owner.write_from(4096, b"before").expect("in bounds");
    owner.store_u64(8, 7).expect("aligned");
    // Hand the descriptor over a socket pair, as to another process.
    let (a, b) = std::os::unix::net::UnixStream::pair().expect("socketpair");
    let fd = owner.shared_fd().expect("host regions are shareable");
    send_with_fds(a.as_fd(), b"R", &[fd]).expect("sent");
    let mut buf = [0u8; 4];
    let (n, mut fds) = recv_with_fds(b.as_fd(), &mut buf).expect("received");
    assert_eq!((n, fds.len(), buf[0]), (1, 1, b'R'));
    let view = SharedRegionView::map(fds.pop().expect("one fd"), owner.len() as u64)
        .expect("sealed memfd maps");
    let dst = HostRegion::with_policy(4096, HugePagePolicy::Never).expect("maps");
    view.copy_to(4096, &dst, 10, 6).expect("in bounds");
    let mut got = [0u8; 6];
    dst.read_into(10, &mut got).expect("in bounds");
    assert_eq!(&got, b"before");
    // Later writes by the owner are visible: the same pages.
    owner.write_from(4096, b"after!").expect("in bounds");
    owner.store_u64(8, 8).expect("aligned");
    view.copy_to(4096, &dst, 10, 6).expect("in bounds");
    dst.read_into(10, &mut got).expect("in bounds");
    assert_eq!(&got, b"after!");
    assert_eq!(view.load_u64(8), Ok(8));
    assert!(matches!(
        view.load_u64(4),
        Err(RegionAccessError::Misaligned { .. })
    ));
    // Bounds on both sides; nothing copied then.
    let end = owner.len() as u64;
    assert!(matches!(
        view.copy_to(end - 3, &dst, 0, 4),
        Err(RegionAccessError::OutOfBounds { .. })
    ));
    assert!(matches!(
        view.copy_to(0, &dst, 4093, 4),
        Err(RegionAccessError::OutOfBounds { .. })
    ));
    // The view outlives the owner's mapping.
    drop(owner);
    assert_eq!(view.load_u64(8), Ok(8));
}

#[test]
fn a_peer_holding_the_descriptor_cannot_write_the_owners_memory() {
    use std::os::unix::fs::FileExt;
    let owner = HostRegion::with_policy(8192, HugePagePolicy::Never).expect("maps");
    owner
        .write_from(0, b"owner")
        .expect("the owner still writes");
    let fd = || {
        owner
            .shared_fd()
            .expect("shareable")
            .try_clone_to_owned()
            .expect("dup")
    };
    // No `write` through the descriptor (nor through a reopened one: the seal is on
    // the file).
    let file = File::from(fd());
    let err = file
        .write_at(b"peer", 0)
        .expect_err("sealed against writes");
    assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
    let reopened = std::fs::OpenOptions::new()
        .write(true)
        .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .expect("reopen");
    assert!(reopened.write_at(b"peer", 0).is_err());
    // No writable shared mapping of it either.
    let err = Mapping::new(&file, 8192, libc::PROT_READ | libc::PROT_WRITE)
        .err()
        .expect("sealed against writable mappings");
    assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
    // Read-only views work, and the owner's writes still land.
    let view = SharedRegionView::map(fd(), 8192).expect("read-only view");
    owner
        .write_from(0, b"again")
        .expect("the owner still writes");
    let dst = HostRegion::with_policy(4096, HugePagePolicy::Never).expect("maps");
    view.copy_to(0, &dst, 0, 5).expect("in bounds");
    let mut got = [0u8; 5];
    dst.read_into(0, &mut got).expect("in bounds");
    assert_eq!(&got, b"again");
}

#[test]
fn unsealed_or_short_files_are_refused() {
    let owner = HostRegion::with_policy(8192, HugePagePolicy::Never).expect("maps");
    let fd = owner
        .shared_fd()
        .expect("shareable")
        .try_clone_to_owned()
        .expect("dup");
    assert!(matches!(
        SharedRegionView::map(fd, 8193),
        Err(ShareError::TooShort {
            file_len: 8192,
            len: 8193
        })
    ));
    let fd = owner
        .shared_fd()
        .expect("shareable")
        .try_clone_to_owned()
        .expect("dup");
    assert!(matches!(
        SharedRegionView::map(fd, 0),
        Err(ShareError::BadLength { .. })
    ));
    // A pipe (or any file without seals) is not mapped.
    let (r, _w) = io::pipe().expect("pipe");
    assert!(matches!(
        SharedRegionView::map(OwnedFd::from(r), 10),
        Err(ShareError::NotSealed)
    ));
    // Staged host memory is never shared.
    let staged = StagedHostRegion::new(4096).expect("maps");
    assert!(staged.shared_fd().is_none());
}

#[test]
fn absurd_lengths_are_refused() {
    assert!(matches!(
        HostRegion::new(0),
        Err(HostAllocError::BadLength { len: 0 })
    ));
    assert!(matches!(
        HostRegion::new(MAX_HOST_REGION + 1),
        Err(HostAllocError::BadLength { .. })
    ));
}
