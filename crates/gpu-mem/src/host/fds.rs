//! Handing file descriptors over a Unix stream socket (`SCM_RIGHTS`).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// Most descriptors [`send_with_fds`] sends and [`recv_with_fds`] accepts in one message.
pub const MAX_FDS_PER_MESSAGE: usize = 16;

/// Room for `MAX_FDS_PER_MESSAGE` descriptors in a control message, in `u64`s (aligned
/// for `cmsghdr`).
const CMSG_WORDS: usize = 16 + MAX_FDS_PER_MESSAGE / 2;

/// Sends `bytes` on the Unix stream socket `socket` with `fds` attached (`SCM_RIGHTS`, on
/// the first byte), retrying on `EINTR` and after partial sends (the descriptors go with
/// the first part).
///
/// # Errors
/// `InvalidInput` for no bytes or more than [`MAX_FDS_PER_MESSAGE`] descriptors; the OS
/// error of `sendmsg` (`EPIPE` and the like; `SIGPIPE` is suppressed).
pub fn send_with_fds(
    socket: BorrowedFd<'_>,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<()> {
    if bytes.is_empty() || fds.len() > MAX_FDS_PER_MESSAGE {
        return Err(io::ErrorKind::InvalidInput.into());
    }
    let raw: Vec<libc::c_int> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let data_len = size_of_val(raw.as_slice());
    let mut cmsg = [0u64; CMSG_WORDS];
    let mut sent = 0;
    let mut first = true;
    while sent < bytes.len() {
        let rest = &bytes[sent..];
        let mut iov = libc::iovec {
            iov_base: rest.as_ptr().cast_mut().cast(),
            iov_len: rest.len(),
        };
        // SAFETY: an all-zero msghdr is a valid "no name, no iov, no control" value.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &raw mut iov;
        msg.msg_iovlen = 1;
        if first && !raw.is_empty() {
            // `data_len` is at most 16 * 4 bytes.
            // SAFETY: CMSG_SPACE only computes a size.
            let space = unsafe { libc::CMSG_SPACE(data_len as libc::c_uint) } as usize;
            debug_assert!(space <= size_of_val(&cmsg));
            msg.msg_control = cmsg.as_mut_ptr().cast();
            msg.msg_controllen = space as _;
            // SAFETY: `msg.msg_control` points at `space` zeroed, u64-aligned bytes, room
            // for one header (CMSG_SPACE of the payload), so the first header is non-null
            // and inside the buffer.
            let hdr = unsafe { libc::CMSG_FIRSTHDR(&raw const msg) };
            // SAFETY: CMSG_LEN only computes a size.
            let hdr_len = unsafe { libc::CMSG_LEN(data_len as libc::c_uint) } as usize;
            let header = libc::cmsghdr {
                cmsg_len: hdr_len as _,
                cmsg_level: libc::SOL_SOCKET,
                cmsg_type: libc::SCM_RIGHTS,
            };
            // SAFETY: `hdr` is the aligned first header slot inside `cmsg` (see above).
            unsafe { hdr.write(header) };
            // SAFETY: CMSG_DATA of a header inside the buffer points at its payload, which
            // CMSG_SPACE sized for `data_len` bytes.
            let data = unsafe { libc::CMSG_DATA(hdr) };
            // SAFETY: `data..data + data_len` lies inside `cmsg` (sized by CMSG_SPACE);
            // `raw` is a distinct allocation of exactly `data_len` bytes.
            unsafe { std::ptr::copy_nonoverlapping(raw.as_ptr().cast::<u8>(), data, data_len) };
        }
        // SAFETY: `msg` names one iovec over the live borrow `rest` and, on the first
        // send, the control buffer `cmsg` built above; sendmsg only reads them.
        let n = unsafe { libc::sendmsg(socket.as_raw_fd(), &raw const msg, libc::MSG_NOSIGNAL) };
        let Some(n) = byte_count(n)? else {
            continue;
        };
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        first = false;
        sent += n;
    }
    Ok(())
}

/// Receives at most `buf.len()` bytes from the Unix stream socket `socket` (one
/// `recvmsg`, retried on `EINTR`) with the descriptors attached to them (`SCM_RIGHTS`,
/// close-on-exec). Returns the bytes received (0: the peer closed) and the descriptors.
///
/// # Errors
/// `InvalidData` when the control data was truncated (more than
/// [`MAX_FDS_PER_MESSAGE`] descriptors; those that arrived are closed); the OS error of
/// `recvmsg` (`WouldBlock` when a receive timeout expires).
pub fn recv_with_fds(socket: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut cmsg = [0u64; CMSG_WORDS];
    loop {
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: an all-zero msghdr is a valid "no name, no iov, no control" value.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &raw mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cmsg.as_mut_ptr().cast();
        msg.msg_controllen = size_of_val(&cmsg) as _;
        // SAFETY: `msg` names one iovec over the live `&mut buf` and the control buffer
        // `cmsg`, both writable for their lengths; recvmsg writes only inside them.
        let n = unsafe { libc::recvmsg(socket.as_raw_fd(), &raw mut msg, libc::MSG_CMSG_CLOEXEC) };
        let Some(n) = byte_count(n)? else {
            continue;
        };
        let mut fds = Vec::new();
        // SAFETY: `msg` was filled by recvmsg: its control pointer and (kernel-set) length
        // describe headers inside `cmsg`; CMSG_FIRSTHDR returns the first or null.
        let mut hdr = unsafe { libc::CMSG_FIRSTHDR(&raw const msg) };
        while !hdr.is_null() {
            // SAFETY: a non-null header from CMSG_FIRSTHDR/CMSG_NXTHDR lies inside `cmsg`
            // (the kernel wrote it) and is aligned for `cmsghdr`.
            let h = unsafe { hdr.read() };
            if h.cmsg_level == libc::SOL_SOCKET && h.cmsg_type == libc::SCM_RIGHTS {
                // SAFETY: CMSG_LEN only computes a size.
                let head = unsafe { libc::CMSG_LEN(0) } as usize;
                let count = (h.cmsg_len as usize).saturating_sub(head) / 4;
                // SAFETY: the payload of a header inside `cmsg`.
                let data = unsafe { libc::CMSG_DATA(hdr) }.cast::<libc::c_int>();
                for i in 0..count {
                    // SAFETY: the kernel wrote `count` descriptors after the header, inside
                    // `cmsg`; the payload need not be aligned for `c_int`.
                    let fd = unsafe { data.wrapping_add(i).read_unaligned() };
                    // SAFETY: SCM_RIGHTS installed `fd` in this process for us alone.
                    fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                }
            }
            // SAFETY: `hdr` is a header inside `msg`'s control buffer; CMSG_NXTHDR returns
            // the next one inside it or null.
            hdr = unsafe { libc::CMSG_NXTHDR(&raw const msg, hdr) };
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "more descriptors than MAX_FDS_PER_MESSAGE",
            ));
        }
        return Ok((n, fds));
    }
}

/// A `sendmsg`/`recvmsg` return value as a byte count: `None` when the call was
/// interrupted (`EINTR`; call it again), the OS error when it failed.
fn byte_count(ret: isize) -> io::Result<Option<usize>> {
    match usize::try_from(ret) {
        Ok(n) => Ok(Some(n)),
        Err(_) => {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                Ok(None)
            } else {
                Err(err)
            }
        }
    }
}
