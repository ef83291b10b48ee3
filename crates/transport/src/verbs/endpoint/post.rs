//! Posting work: reads cut into work-request-sized chunks, chained under one doorbell;
//! notifications through the send ring; the receive ring.

use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::queue_pair::{
    PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState, SetScatterGatherEntry,
    WorkRequestFlags,
};

use super::{
    Chunk, Endpoint, EndpointState, Posted, PostedKind, RECV_BIT, RdmaRead, qp_error, random_psn,
    remote_oob,
};
use crate::verbs::VerbsError;

impl Endpoint {
    /// Validates one op and cuts it into work-request-sized chunks.
    pub(super) fn split(
        &self,
        batch: u64,
        op: &RdmaRead,
        fence: bool,
        write: bool,
        out: &mut Vec<Chunk>,
    ) -> Result<(), VerbsError> {
        if !op.local.pd().same(&self.pd) {
            return Err(VerbsError::ForeignRegion);
        }
        let local_addr = op.local.sge_addr(op.local_offset, op.len)?;
        let remote_end = op.remote_offset.checked_add(op.len);
        let remote_addr = op.remote.addr.checked_add(op.remote_offset);
        let (Some(remote_addr), Some(end)) = (remote_addr, remote_end) else {
            return Err(remote_oob(op));
        };
        if end > op.remote.len || remote_addr.checked_add(op.len).is_none() {
            return Err(remote_oob(op));
        }
        let step = u64::from(self.config.max_wr_bytes);
        let mut done = 0u64;
        while done < op.len {
            let len = (op.len - done).min(step);
            out.push(Chunk {
                batch,
                local: op.local.clone(),
                local_addr: local_addr + done,
                remote_addr: remote_addr + done,
                rkey: op.remote.rkey,
                // At most max_wr_bytes (a u32).
                len: u32::try_from(len).unwrap_or(u32::MAX),
                fence,
                write,
            });
            done += len;
        }
        Ok(())
    }

    /// RESET → INIT with a fresh PSN; posts the whole receive ring.
    pub(super) fn enter_init(&mut self) -> Result<(), VerbsError> {
        let port = self.pd.device().inner.port;
        let mut init = QueuePairAttribute::new();
        init.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(port)
            .setup_access_flags(
                // Remote writes are admitted by the queue pair but land only in memory
                // registered with REMOTE_WRITE: the per-reservation grants
                // (`register_remote_write`), never the pools.
                AccessFlags::LocalWrite | AccessFlags::RemoteRead | AccessFlags::RemoteWrite,
            );
        let qpn = self.qpn;
        self.qp_mut()?
            .modify(&init)
            .map_err(|e| qp_error(qpn, "modify to INIT", e))?;
        self.psn = random_psn();
        self.epoch += 1;
        self.post_recvs(0..self.config.recv_slots)
    }

    pub(super) fn post_recvs(&mut self, slots: std::ops::Range<u32>) -> Result<(), VerbsError> {
        let n = slots.len() as u32;
        if n == 0 {
            return Ok(());
        }
        let (lkey, slot_len) = (self.recv.mr.lkey(), self.recv.slot);
        let addrs: Vec<(u32, u64)> = slots.map(|s| (s, self.recv.addr(s))).collect();
        let epoch = self.epoch;
        let qpn = self.qpn;
        let qp = self.qp_mut()?;
        let mut guard = qp.start_post_recv();
        for (slot, addr) in addrs {
            let wr = guard.construct_wr(RECV_BIT | (epoch << 32) | u64::from(slot));
            // SAFETY: the slot lies inside the receive ring's registered buffer (`addr`
            // comes from Ring::addr with slot < recv_slots), which the endpoint owns and
            // keeps alive until the QP is destroyed; the CPU reads a slot only after its
            // receive completed and before it is posted again.
            unsafe { wr.setup_sge(lkey, addr, slot_len) };
        }
        guard
            .post()
            .map_err(|e| qp_error(qpn, "ibv_post_recv", e))?;
        self.recv_posted += n;
        Ok(())
    }

    /// Posts queued reads while the outstanding bound allows, one doorbell per chain.
    ///
    /// While reads are in flight it refills in whole chains: it waits until a full chain
    /// fits (or all queued work does) instead of ringing a doorbell for every few
    /// completions. A chain is at most half the outstanding bound, so the next chain is
    /// posted while the previous one is still in flight. Measured on SoftRoCE (64 KiB
    /// reads): doorbells every 16 completions made rxe retry reads (duplicate requests,
    /// completer retries) and ran at 0.6× `ib_read_bw`; whole-chain refills did not.
    pub(super) fn post_pending(&mut self) -> Result<(), VerbsError> {
        let chain = self
            .config
            .wrs_per_doorbell
            .min((self.config.max_outstanding_reads / 2).max(1));
        while self.state == EndpointState::Connected && !self.pending.is_empty() {
            let room = self
                .config
                .max_outstanding_reads
                .saturating_sub(self.reads_in_flight);
            let n = (self.pending.len() as u32).min(room).min(chain) as usize;
            if n == 0 || (self.reads_in_flight > 0 && n < chain as usize && n < self.pending.len())
            {
                break;
            }
            let chunks: Vec<Chunk> = self.pending.drain(..n).collect();
            let first_id = self.next_wr_id;
            let mut unsignaled = self.unsignaled;
            let mut flags = Vec::with_capacity(n);
            for (i, c) in chunks.iter().enumerate() {
                // The last WR of a batch is signalled too, so that a batch sharing a chain
                // with later ones is reported as soon as it completed.
                let batch_end = chunks.get(i + 1).is_none_or(|next| next.batch != c.batch);
                let signal = batch_end || unsignaled + 1 >= self.config.signal_every;
                let mut f = WorkRequestFlags::none();
                if signal {
                    f |= WorkRequestFlags::Signaled;
                    unsignaled = 0;
                } else {
                    unsignaled += 1;
                }
                if c.fence {
                    f |= WorkRequestFlags::Fence;
                }
                flags.push(f);
            }
            let qpn = self.qpn;
            let qp = self.qp_mut()?;
            let mut guard = qp.start_post_send();
            for (i, c) in chunks.iter().enumerate() {
                let wr = guard.construct_wr(first_id + i as u64, flags[i]);
                let wr = if c.write {
                    wr.setup_write(c.rkey, c.remote_addr)
                } else {
                    wr.setup_read(c.rkey, c.remote_addr)
                };
                // SAFETY: local_addr..+len was bounds-checked against `c.local` (a
                // registered region of this PD) in `split`, and `c` (holding an Arc of
                // that MemoryRegion) moves into the in-flight table below, where it stays
                // until this work request's completion is reaped or the QP is reset or
                // destroyed: the destination of a read (the source of a write) stays
                // registered and alive while the NIC may touch it.
                unsafe { wr.setup_sge(c.local.lkey(), c.local_addr, c.len) };
            }
            match guard.post() {
                Ok(()) => {
                    self.next_wr_id += n as u64;
                    self.unsignaled = unsignaled;
                    self.reads_in_flight += n as u32;
                    for (i, c) in chunks.into_iter().enumerate() {
                        self.send_q.push_back(Posted {
                            wr_id: first_id + i as u64,
                            what: PostedKind::Read(c),
                        });
                    }
                }
                Err(e) => {
                    // sideway does not say which WR of the chain was bad (nor whether the
                    // ones before it were posted), so every batch in the chain fails; the
                    // chain's memory stays referenced by `chunks` until here, and a WR
                    // that was posted is flushed by the reset below.
                    let msg = format!("{e}");
                    tracing::warn!(qpn, "ibv_post_send of {n} RDMA READs failed: {msg}");
                    let mut seen = Vec::new();
                    for c in &chunks {
                        if !seen.contains(&c.batch) {
                            seen.push(c.batch);
                        }
                    }
                    for b in seen {
                        let err = qp_error(
                            qpn,
                            "ibv_post_send (RDMA READ)",
                            std::io::Error::other(msg.clone()),
                        );
                        self.fail_batch(b, err);
                    }
                    self.errors += 1;
                    // Keep the chain's memory alive until the QP is reset (it may have
                    // accepted a prefix of the chain).
                    for (i, c) in chunks.into_iter().enumerate() {
                        self.send_q.push_back(Posted {
                            wr_id: first_id + i as u64,
                            what: PostedKind::Read(c),
                        });
                    }
                    self.next_wr_id += n as u64;
                    return self.recover();
                }
            }
        }
        Ok(())
    }

    /// Sends queued notifications into free send slots.
    pub(super) fn flush_notifs(&mut self) -> Result<(), VerbsError> {
        while self.state == EndpointState::Connected && !self.queued_notifs.is_empty() {
            let Some(slot) = self.free_send.pop() else {
                break;
            };
            let Some(msg) = self.queued_notifs.pop_front() else {
                self.free_send.push(slot);
                break;
            };
            // Checked against the slot size when queued.
            let len = u32::try_from(msg.len())
                .unwrap_or(u32::MAX)
                .min(self.send.slot);
            self.send
                .buf
                .write(self.send.offset(slot), &msg[..len as usize]);
            let (lkey, addr, wr_id, qpn) = (
                self.send.mr.lkey(),
                self.send.addr(slot),
                self.next_wr_id,
                self.qpn,
            );
            let qp = self.qp_mut()?;
            let mut guard = qp.start_post_send();
            let wr = guard
                .construct_wr(wr_id, WorkRequestFlags::Signaled)
                .setup_send();
            // SAFETY: the slot lies inside the send ring's registered buffer, which the
            // endpoint keeps alive until the QP is destroyed; the slot is off the free
            // list until this send's completion is reaped, so the CPU does not rewrite it
            // while the NIC reads it.
            unsafe { wr.setup_sge(lkey, addr, len) };
            if let Err(e) = guard.post() {
                self.free_send.push(slot);
                self.queued_notifs.push_front(msg);
                return Err(qp_error(qpn, "ibv_post_send (SEND)", e));
            }
            self.next_wr_id += 1;
            self.send_q.push_back(Posted {
                wr_id,
                what: PostedKind::Send { slot, len },
            });
        }
        Ok(())
    }
}
