//! Reaping completions: each send-queue or receive completion settles its batch or
//! its notification slot.

use sideway::ibverbs::completion::PollCompletionQueueError;

use super::{Endpoint, EndpointState, Posted, PostedKind, RECV_BIT};
use crate::verbs::{VerbsError, WorkCompletionStatus};

impl Endpoint {
    /// Polls the CQ until it is empty: `(wr_id, status)` pairs.
    pub(super) fn reap(&mut self) -> Result<Vec<(u64, WorkCompletionStatus)>, VerbsError> {
        let mut out = Vec::new();
        match self.cq.start_poll() {
            Ok(poller) => {
                // Consume the whole iterator: it polls again when its batch is used up,
                // and a completion left in its buffer would be lost.
                for wc in poller {
                    out.push((
                        wc.wr_id(),
                        WorkCompletionStatus::new(wc.status(), wc.vendor_err(), wc.byte_len()),
                    ));
                }
            }
            Err(PollCompletionQueueError::CompletionQueueEmpty) => {}
            Err(e) => return Err(self.qp_err("ibv_poll_cq", e)),
        }
        Ok(out)
    }

    /// Handles one completion; true if it reports a queue pair error (not a flush).
    pub(super) fn on_completion(
        &mut self,
        wr_id: u64,
        status: WorkCompletionStatus,
        draining: bool,
    ) -> bool {
        if wr_id & RECV_BIT != 0 {
            return self.on_recv(wr_id, status, draining);
        }
        // Send queue: completions arrive in post order; an unsignalled WR completed
        // successfully once a later WR completes.
        self.last_reported = self.last_reported.max(wr_id);
        let Some(front) = self.send_q.front() else {
            return false;
        };
        if wr_id < front.wr_id {
            return false; // from before a reset
        }
        if status.code() == WorkCompletionStatus::SUCCESS {
            while self.send_q.front().is_some_and(|p| p.wr_id <= wr_id) {
                if let Some(p) = self.send_q.pop_front() {
                    self.complete(p);
                }
            }
            return false;
        }
        if status.is_flush() {
            // Left in the table: recovery requeues everything not confirmed.
            return false;
        }
        // A real error on `wr_id`: everything before it completed.
        while self.send_q.front().is_some_and(|p| p.wr_id < wr_id) {
            if let Some(p) = self.send_q.pop_front() {
                self.complete(p);
            }
        }
        let qpn = self.qpn;
        if let Some(p) = self.send_q.front().filter(|p| p.wr_id == wr_id) {
            let (op, batch) = match &p.what {
                PostedKind::Read(c) if c.write => ("WRITE", Some(c.batch)),
                PostedKind::Read(c) => ("READ", Some(c.batch)),
                PostedKind::Send { .. } => ("SEND", None),
            };
            let err = VerbsError::WorkRequest { op, qpn, status };
            tracing::warn!(qpn, "{err}");
            if let Some(b) = batch {
                // Its chunk leaves the table at recovery; the batch fails now.
                self.fail_batch(b, err);
            }
        }
        self.errors += 1;
        true
    }

    pub(super) fn on_recv(
        &mut self,
        wr_id: u64,
        status: WorkCompletionStatus,
        draining: bool,
    ) -> bool {
        let epoch = (wr_id & !RECV_BIT) >> 32;
        if epoch != self.epoch {
            return false;
        }
        self.recv_posted = self.recv_posted.saturating_sub(1);
        let slot = (wr_id & 0xffff_ffff) as u32;
        if status.code() == WorkCompletionStatus::SUCCESS {
            let len = status.byte_len().min(self.recv.slot) as usize;
            if slot < self.recv.slots {
                self.notifs_in
                    .push_back(self.recv.buf.read(self.recv.offset(slot), len));
                if !draining && let Err(e) = self.post_recvs(slot..slot + 1) {
                    tracing::warn!(qpn = self.qpn, "re-posting a receive failed: {e}");
                    self.errors += 1;
                    return true;
                }
            }
            return false;
        }
        if status.is_flush() {
            // Our QP went to ERR (the peer's fault reached us): recover.
            return !draining && self.state == EndpointState::Connected;
        }
        tracing::warn!(qpn = self.qpn, "RDMA RECV failed: {status}");
        self.errors += 1;
        true
    }

    pub(super) fn complete(&mut self, p: Posted) {
        match p.what {
            PostedKind::Read(c) => {
                self.reads_in_flight = self.reads_in_flight.saturating_sub(1);
                let done = match self.batches.get_mut(&c.batch) {
                    Some(b) if b.failed.is_none() => {
                        b.remaining = b.remaining.saturating_sub(1);
                        b.remaining == 0
                    }
                    _ => false,
                };
                if done {
                    self.finish_batch(c.batch);
                }
            }
            PostedKind::Send { slot, .. } => self.free_send.push(slot),
        }
    }

    pub(super) fn finish_batch(&mut self, batch: u64) {
        let notif = self.batches.get_mut(&batch).and_then(|b| b.notif.take());
        if let Some(n) = notif {
            // Length checked when the batch was posted; queued even if the queue is long.
            self.queued_notifs.push_back(n);
        }
    }

    pub(super) fn fail_batch(&mut self, batch: u64, err: VerbsError) {
        if let Some(b) = self.batches.get_mut(&batch)
            && b.failed.is_none()
        {
            b.failed = Some(err);
            b.notif = None;
        }
        self.pending.retain(|c| c.batch != batch);
    }
}
