//! The shared-memory backend: peers on the same host read each other's registered host
//! memory directly (and, with the `cuda` feature, CUDA device memory through CUDA IPC),
//! and send each other notifications through shared rings.
//!
//! # Identity
//! An agent that offers shared memory writes `{"host": <identity>, "socket": <name>}`
//! under the metadata key `"shm"`. The identity is the kernel's boot id
//! (`/proc/sys/kernel/random/boot_id`) and the network namespace
//! (`/proc/self/ns/net`): equal identities mean the same running kernel and the same
//! network namespace, so the abstract Unix socket named in the entry is reachable and a
//! memfd passed over it maps the same pages. The IP address says nothing about that. (The
//! mount namespace does not matter: abstract sockets and passed descriptors ignore it.)
//!
//! # Handshake
//! After D's TCP link to P is up (authenticated as always), D connects to P's abstract
//! Unix socket and runs the TCP handshake again on it (`HELLO`, `CHALLENGE`, `PROOF`,
//! `AUTH_RESULT`, fresh nonces) with the proof roles `shm-client` / `shm-server`, so a
//! proof made for one channel is useless on the other. Only when the proof checks out
//! does P send
//! - a `SHM_GRANTS` frame with P's grant table attached: one word per shareable region
//!   P registered, holding the region's id while it stays registered and 0 once P
//!   deregistered it (a slot freed so is handed to a later region, with its own id). D
//!   maps it read-only;
//! - a `SHM_RING` frame (capacity, largest record) with a fresh memfd attached
//!   (`SCM_RIGHTS`): the notification ring from this D to P, which D maps read-write
//!   ([`RingWriter`](kvlease_gpu_mem::RingWriter)) and P drains
//!   ([`RingReader`](kvlease_gpu_mem::RingReader));
//! - for each registered region whose memory is shareable ([`DmaRegion::shared_fd`](kvlease_gpu_mem::DmaRegion::shared_fd):
//!   host regions, memfd-backed), a `SHM_REGION` frame (id, key, length, grant slot) with
//!   the memfd attached, which D maps read-only
//!   ([`SharedRegionView`](kvlease_gpu_mem::SharedRegionView), which refuses files whose
//!   size is not sealed);
//! - with the `cuda` feature, for each registered CUDA device region, a `SHM_CUDA_REGION`
//!   frame (id, key, length, grant slot, then the region's CUDA IPC handle in the 112-byte
//!   wire form of `kvlease_gpu_mem::cuda::ipc::IpcHandle`; no descriptor). P exports
//!   it for this connection (`cuIpcGetMemHandle`) and holds the export, and with it the
//!   device memory, until D closes the socket: CUDA requires the exporter to keep
//!   memory alive while an importer has it open. A region the driver will not export is
//!   left out (logged) and D reads it over TCP. D parses the handle and opens it
//!   (`IpcMapping`, on the local device with the handle's UUID). A handle it cannot open
//!   (no driver, device not visible here, the driver refuses it) leaves that region to
//!   TCP, logged; a malformed one, one whose length is not the descriptor's, or one
//!   claiming more than the allocation the driver mapped refuses the whole link with a
//!   typed error (`LinkError::Shm(ShmError::CudaRegion)`, `LinkError::Shm(ShmError::Malformed)`). A build
//!   without `cuda` skips these frames; a build from before them refuses the hand-over
//!   as malformed (and `auto` falls back to verbs or TCP);
//! - with cross-memory attach on ([`CmaPolicy`](crate::CmaPolicy), on by default), for
//!   each registered host region that is not memfd-backed (a
//!   [`ForeignRegion`](kvlease_gpu_mem::ForeignRegion): Python buffers and tensors), an
//!   `SHM_CMA_REGION` frame (id, key, length, grant slot, its address in P's process; no
//!   descriptor). Before any, P names D's process as its ptracer
//!   ([`set_ptracer`](kvlease_gpu_mem::set_ptracer), `PR_SET_PTRACER`; D's pid from
//!   `SO_PEERCRED` on the socket, the kernel's word): Yama's `ptrace_scope` 1 lets only a
//!   named process read P's memory, and holds one per process, so with
//!   [`CmaPolicy::LastPeer`](crate::CmaPolicy::LastPeer) the last D to authenticate may
//!   read and earlier ones fall back to TCP (below);
//!   [`CmaPolicy::AnyProcess`](crate::CmaPolicy::AnyProcess) names any process instead.
//!   D reads P's pid from its own end of the socket (`SO_PEERCRED`) and keeps each range
//!   as a [`PeerProcessRange`](kvlease_gpu_mem::PeerProcessRange); with cma off on D, or
//!   P's process not visible in D's pid namespace, it skips them (TCP);
//! - then `SHM_END`.
//!
//! Every memfd P hands over but the ring is sealed against writers other than P's own
//! mapping (`F_SEAL_FUTURE_WRITE`, see `kvlease_gpu_mem::HostRegion`): a peer can read
//! P's memory and never write it.
//!
//! D keeps the Unix socket open for the link's life; P's connection thread waits on it
//! and, when D closes it, lets P's next `get_new_notifs` drain what is left in the ring
//! and drop it. P accepts at most `limits.max_inbound_connections` such connections.
//!
//! # Reads
//! A batch goes over shared memory when every source region (and the fence's) was
//! received in the handshake and every destination is memory its source can copy into:
//! host memory for a memfd or cma source; host, CUDA pinned, staged or CUDA device memory
//! for a device source opened through CUDA IPC (`cuMemcpyDtoH`, `cuMemcpyDtoD` on the
//! same device, a peer copy from another). The fence word must lie in a memfd or cma
//! region (host memory: a `FenceTable` slot, a Python `mmap`). A cma source is copied
//! with `process_vm_readv` (the kernel copies from P's pages straight into D's
//! destination; consecutive cma chunks of a copying thread go in one vectored call of up
//! to 1024 ranges and 64 MiB), a cma fence word with one 8-byte `process_vm_readv`; such a batch
//! reports [`Backend::Cma`](crate::Backend::Cma) (`Backend::Shm` when no byte went that
//! way). Before its copies, a batch with a cma source probes 8 bytes of it: the kernel
//! checks permission on every call, and P may have named another ptracer since. A
//! refusal (`EPERM`: Yama, another user, no `CAP_SYS_PTRACE`; `ESRCH`) turns cma off for
//! the link, logs one warning, and the batch and every later one of the link go over TCP;
//! a refusal between the probe and a later copy fails that batch. Otherwise (a region registered later, a device region
//! not opened here, device memory as the destination of a memfd source) the batch goes
//! over the TCP link, as the verbs link does. Each op is
//! checked against P's descriptor as P's TCP server would check it (still registered:
//! its grant slot still holds its id, loaded with acquire; key; bounds) and refused with
//! the same [`Refusal`](crate::Refusal)s. The copies run on the thread that
//! posts the batch ([`Agent::post_read`](crate::Agent::post_read) returns once they are
//! done, with no thread hand-off), and a batch of more than [`copy::SPLIT_BYTES`] is split
//! with the threads of a small process-wide copy pool (at most
//! [`copy::MAX_COPY_THREADS`] threads in all, never more than the host's cores): the
//! posting thread and the pool's threads claim chunks of about [`copy::CHUNK_BYTES`] until none is
//! left, whichever thread finishes the last chunk completes the batch, and the posting
//! thread returns once it is complete. The fence word is loaded (atomically, acquire, after an
//! acquire fence) only once every data copy finished; a mismatch fails the batch with
//! [`TransferError::FenceMismatch`](crate::TransferError::FenceMismatch) and the
//! notification is not sent.
//!
//! # Notifications
//! Every notification from D to P ([`Agent::send_notif`](crate::Agent::send_notif), a
//! batch's notification, also of a batch the link handed to TCP) goes into D's ring to P:
//! one path, so they stay in order. A batch's notification is pushed after its copies
//! and its fence read finished; the push publishes the record with a release store that
//! P's drain loads with acquire, so D's reads of P's memory happen before whatever P does
//! after seeing the notification. P drains the ring in
//! [`Agent::get_new_notifs`](crate::Agent::get_new_notifs), on the caller's thread (one
//! load when nothing arrived). P treats the ring as hostile input: every index and length
//! is checked against the ring's size and `limits.max_notif_len`, and a ring found
//! corrupt is closed (log line, `notif_rings_corrupt`), its connection shut down, and
//! nothing read past it. A full ring makes the sender wait up to about
//! [`link::RING_FULL_WAIT_MS`] ms for P to drain it, then fail with
//! [`TransferError::NotifRingFull`](crate::TransferError::NotifRingFull) (a batch then
//! fails). The ring holds at least 16 of the largest notifications (at least 1 MiB, at
//! most 64 MiB); a receiver whose `max_notif_len` exceeds what its ring holds refuses
//! the longer ones with
//! [`TransferError::NotifTooLarge`](crate::TransferError::NotifTooLarge).
//! Notifications that arrive in the ring are counted in `notifs_received`; they never
//! sit in the inbox (the ring bounds them), so `max_pending_notifs` does not apply.
//!
//! # Writes
//! Fenced writes ([`Agent::post_write`](crate::Agent::post_write)) go the other way: the
//! agent that connected (P, the writer) sends each chunk on the Unix socket it holds,
//! after the hand-over, and the agent that listens (D) lands it under the fence word's
//! stripe of its write-fence lock once the word holds the write's generation, exactly as
//! its TCP receiver checks it (authenticated peer, destination and fence word registered
//! under their keys, ranges in bounds, at most 16 MiB a chunk), and answers `WRITE_ACK`
//! or `WRITE_ERR`. A chunk gets there one of three ways, chosen by P per chunk:
//! - pulled from a memfd: when D offers it (`"write_pull": true` in its metadata entry)
//!   and the chunk's source is a memfd-backed region of P's, P hands that memfd to D once
//!   per connection (`SHM_WRITE_SRC`, sealed as every memfd handed over is; D maps it
//!   read-only and keeps it until the connection ends) and then sends only a
//!   `WRITE_PULL` naming the source (id, offset), the destination, the length and the
//!   fence word with the generation. D copies the bytes straight from P's pages into the
//!   destination, the copy running entirely under the stripe lock: one copy, no payload
//!   on the socket;
//! - pulled with cross-memory attach: when D offers it (`"write_pull_cma": true`, cma on
//!   in D) and cma is on in P too, a chunk from other host memory of P's (a
//!   [`ForeignRegion`](kvlease_gpu_mem::ForeignRegion)) goes as a `WRITE_PULL` as well:
//!   P names D's process as its ptracer (`SO_PEERCRED`, as its [`CmaPolicy`](crate::CmaPolicy)
//!   says) before the first, names the region by address and length once per connection
//!   (`SHM_WRITE_CMA_SRC`), and D reads the chunk with `process_vm_readv` (P's pid from
//!   `SO_PEERCRED` on its own end) into the destination under the stripe lock. A read
//!   the kernel refuses (P named another ptracer since, another user, no such process)
//!   or that fails part-way is answered `SourceUnreadable`; P sends that chunk again on
//!   the socket, and so every later chunk from such memory on that connection (one
//!   warning);
//! - on the socket: otherwise (D does not offer pulling, cma is off, device memory)
//!   as TCP's `WRITE_REQ` frames, the payload straight from the source region (from a
//!   host bounce buffer it was copied into, for CUDA device or staged memory); D reads
//!   it into a buffer of its own and copies it into place under the lock.
//!
//! Destinations are any memory D registered: host memory (memfd-backed or plain heap
//! memory, the memory D would read with cma), and CUDA device or staged memory, which D
//! fills with a synchronous copy under the lock (a pulled write first lands in a host
//! bounce region of the connection's, then is copied into place). The peer never writes
//! D's memory itself: the memfds are sealed against it, and a write fence that the
//! writer checks in memory both processes share would make D's clear wait on a lock
//! holder it cannot tell from a dead one (see `write.rs`). D reading P's memory keeps
//! that property: only D's process holds the lock, and P's source stays valid until the
//! chunk is answered (the batch is not settled before). D says it serves writes there with `"write":
//! true` in its metadata entry; without it, and once a link's write stream broke (a
//! timeout mid-frame, a malformed answer), writes go over the TCP link. Such a batch
//! reports [`Backend::Shm`](crate::Backend::Shm), either way.
//!
//! # Limits
//! D's mapping keeps P's pages alive until the link closes, and D's reads do not show up
//! in P's counters (`reads_served`). A cma range is named by pid and address only: D
//! holds no reference to P's memory, so a copy already running when P deregisters and
//! frees the region reads whatever P has there then, or fails (`EFAULT`), into D's buffer
//! only. P's deregistration of a region reaches D through the
//! grant table: batches D posts afterwards (and fence words read afterwards) are refused
//! with `UnknownRegion`, as TCP would refuse them; copies already running finish, as a
//! read P's TCP server is serving does. A region P registers after D connected is not
//! handed over (D reads it over TCP) until D connects again. P's lease protocol and
//! fences, not the key, guard the bytes of a region that stays registered for the pool's
//! life. A pulled write is copied from the writer's memory when the receiver serves it:
//! should the receiver serve it only after the writer gave up waiting for its answer
//! (the receiver stalled past the batch's deadline and the write stream's answer grace,
//! the writer's batch failed with `Timeout`), it copies what the writer's source holds
//! then, into blocks of a write that failed, and only while the fence word still holds
//! that write's generation (a chunk sent on the socket would land its old bytes there
//! instead). Blocks a failed write was aimed at are not to be used without writing them
//! again. The receiver keeps the memfds handed over for pulled writes mapped until the
//! connection closes. A cma write source is named by pid and address as a cma read
//! source is: a pull D serves after P gave up on the batch reads whatever P's process
//! holds at that address then (or fails), into the blocks of that failed write only.
//! The CUDA IPC path's end-to-end test
//! (`cuda_device_memory_is_read_over_shm_from_another_process` in `tests/shm.rs`) is
//! `#[ignore]`d (it needs a GPU; `scripts/gpu-check.sh` runs it) and passed on one H200.

pub(crate) mod copy;
#[cfg(feature = "cuda")]
mod cuda;
pub(crate) mod error;
mod link;
mod mapped;
mod server;
mod write;

pub(crate) use link::connect;
pub(crate) use server::Server;

/// The metadata key of this backend's entry.
pub(crate) const METADATA_KEY: &str = "shm";

/// Most regions a peer may hand over in one handshake.
const MAX_REGIONS: usize = 1 << 16;

/// Smallest notification ring.
const RING_MIN: usize = 1 << 20;
/// Largest notification ring.
const RING_MAX: usize = 64 << 20;

/// The ring P creates for a D whose notifications P accepts up to `max_notif_len` bytes:
/// room for 16 of the largest (within `RING_MIN..=RING_MAX`), and the largest record it
/// takes.
fn ring_shape(max_notif_len: usize) -> (usize, usize) {
    let record = max_notif_len.saturating_add(kvlease_gpu_mem::RING_RECORD_HEADER);
    let capacity = record
        .saturating_mul(16)
        .clamp(RING_MIN, RING_MAX)
        .next_power_of_two();
    (
        capacity,
        max_notif_len.min(capacity - kvlease_gpu_mem::RING_RECORD_HEADER),
    )
}

/// The first 32 bytes of an `SHM_REGION` or `SHM_CUDA_REGION` body: id, key, length and
/// grant slot (D parses them with `link::region_words`).
fn region_body(
    desc: &crate::metadata::RegionDesc,
    slot: u64,
) -> [u8; crate::tcp::wire::SHM_REGION_LEN] {
    let mut body = [0u8; crate::tcp::wire::SHM_REGION_LEN];
    for (word, v) in body
        .chunks_exact_mut(8)
        .zip([desc.id, desc.key, desc.len, slot])
    {
        word.copy_from_slice(&v.to_le_bytes());
    }
    body
}

/// The process at the other end of `s` (the kernel's word, `SO_PEERCRED`), whose memory
/// this agent reads with cross-memory attach. `None` when cma is off here, or (logged,
/// with `then`: what happens instead) when the process is not visible in this pid
/// namespace or the lookup failed.
fn cma_peer_pid(
    policy: crate::config::CmaPolicy,
    s: &std::os::unix::net::UnixStream,
    peer: &str,
    then: &str,
) -> Option<u32> {
    use std::os::fd::AsFd;
    if policy == crate::config::CmaPolicy::Off {
        tracing::debug!(peer, then, "cma is off here");
        return None;
    }
    match kvlease_gpu_mem::socket_peer_pid(s.as_fd()) {
        Ok(Some(pid)) => Some(pid),
        Ok(None) => {
            tracing::warn!(
                peer,
                then,
                "the shm peer's process is not visible here (another pid namespace)"
            );
            None
        }
        Err(err) => {
            tracing::warn!(peer, then, %err, "SO_PEERCRED failed on the shm socket");
            None
        }
    }
}

/// This host's identity for shared memory: boot id and network namespace, or `None`
/// where `/proc` does not say.
pub(crate) fn host_identity() -> Option<String> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let net = std::fs::read_link("/proc/self/ns/net").ok()?;
    let boot = boot.trim();
    if boot.is_empty() {
        return None;
    }
    Some(format!("{boot}/{}", net.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rings_hold_sixteen_of_the_largest_within_bounds() {
        assert_eq!(ring_shape(64 * 1024), (2 << 20, 64 * 1024));
        assert_eq!(ring_shape(100), (RING_MIN, 100));
        assert_eq!(ring_shape(1 << 30), (RING_MAX, RING_MAX - 8));
        assert_eq!(ring_shape(usize::MAX), (RING_MAX, RING_MAX - 8));
    }
}
