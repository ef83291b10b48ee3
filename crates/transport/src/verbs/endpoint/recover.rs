//! Recovery after a queue pair error, and teardown: QP → ERR, drain the flushed
//! completions, RESET.

use sideway::ibverbs::queue_pair::{QueuePair, QueuePairAttribute, QueuePairState};

use super::{DRAIN_POLLS, Endpoint, EndpointState, PostedKind, qp_error};
use crate::verbs::{VerbsError, drop_guarded};

impl Endpoint {
    /// QP → ERR, drain, RESET → INIT; requeues unconfirmed work of healthy batches.
    pub(super) fn recover(&mut self) -> Result<(), VerbsError> {
        tracing::warn!(
            qpn = self.qpn,
            device = self.pd.device().name(),
            "verbs queue pair failed: resetting it"
        );
        self.drain_in_error()?;
        let qpn = self.qpn;
        let mut reset = QueuePairAttribute::new();
        reset.setup_state(QueuePairState::Reset);
        self.qp_mut()?
            .modify(&reset)
            .map_err(|e| qp_error(qpn, "modify to RESET", e))?;
        // The QP is in RESET: the NIC no longer touches anything posted to it.
        let mut requeue = Vec::new();
        for p in std::mem::take(&mut self.send_q) {
            match p.what {
                PostedKind::Read(c) => {
                    let alive = self
                        .batches
                        .get(&c.batch)
                        .is_some_and(|b| b.failed.is_none());
                    if alive {
                        requeue.push(c);
                    }
                }
                PostedKind::Send { slot, len } => {
                    let msg = self.send.buf.read(self.send.offset(slot), len as usize);
                    self.queued_notifs.push_front(msg);
                    self.free_send.push(slot);
                }
            }
        }
        for c in requeue.into_iter().rev() {
            self.pending.push_front(c);
        }
        self.reads_in_flight = 0;
        self.unsignaled = 0;
        self.recv_posted = 0;
        self.state = EndpointState::NeedsReconnect;
        self.enter_init()
    }

    /// Moves the QP to ERR and reaps completions until every posted WR has flushed or the
    /// poll budget is spent. Returns how many work requests did not report back.
    pub(super) fn drain_in_error(&mut self) -> Result<usize, VerbsError> {
        let mut err = QueuePairAttribute::new();
        err.setup_state(QueuePairState::Error);
        let qpn = self.qpn;
        self.qp_mut()?
            .modify(&err)
            .map_err(|e| qp_error(qpn, "modify to ERR", e))?;
        let mut idle = 0;
        // Flushed sends and receives report back (signalled or not, a flush completes
        // each WR on rxe and mlx5); stop when the tables are empty or the budget is gone.
        while idle < DRAIN_POLLS {
            let wcs = self.reap()?;
            if wcs.is_empty() {
                if self.recv_posted == 0 && self.send_q_reported() {
                    break;
                }
                idle += 1;
                std::thread::yield_now();
                continue;
            }
            for (wr_id, status) in wcs {
                self.on_completion(wr_id, status, true);
            }
        }
        Ok(self.recv_posted as usize + self.send_q.len())
    }

    /// Whether every posted send-queue WR reported back. Flushed entries stay in `send_q`
    /// (recovery requeues them); the newest one is always signalled (the last WR of each
    /// chain is), so its report covers all.
    pub(super) fn send_q_reported(&self) -> bool {
        self.send_q
            .back()
            .is_none_or(|p| p.wr_id <= self.last_reported)
    }

    pub(super) fn teardown(&mut self) -> Result<(), VerbsError> {
        if self.state == EndpointState::Closed {
            return Ok(());
        }
        self.state = EndpointState::Closed;
        let left = match self.drain_in_error() {
            Ok(left) => left,
            Err(e) => {
                self.destroy_qp();
                return Err(e);
            }
        };
        self.destroy_qp();
        // The QP is destroyed: the NIC no longer touches the in-flight memory.
        self.send_q.clear();
        self.pending.clear();
        if left > 0 {
            return Err(VerbsError::DrainIncomplete {
                qpn: self.qpn,
                left,
            });
        }
        Ok(())
    }

    pub(super) fn destroy_qp(&mut self) {
        if let Some(qp) = self.qp.take() {
            drop_guarded("ibv_destroy_qp", qp);
        }
    }
}
