//! Notification paths besides a peer's TCP connection.
//!
//! Receiving: [`Agent::get_new_notifs`](crate::Agent::get_new_notifs) drains the inbox
//! (what connection threads delivered with `Context::deliver_notif`) and then every
//! registered [`NotifSource`]: a source is polled on the caller's thread, with no thread
//! hand-off in between (the shared-memory backend's ring is one: a plain load when it is
//! empty). A backend that receives notifications on its own adds a source with
//! [`NotifSources::add`]; the source removes itself by answering [`Drained::Finished`].
//!
//! Sending: a link whose notifications must take another path than its first TCP
//! connection (the shared-memory link's ring) routes them there with a [`NotifSink`], so
//! that every notification to one peer takes one path and keeps its order.

use std::fmt;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::error::TransferError;
use crate::ids::Sender;
use crate::stats::Counters;
use crate::sync::lock;

/// Notifications grouped by sender, in order of each sender's first message; each group
/// in arrival order (what `get_new_notifs` returns).
pub(crate) type Groups = Vec<(Sender, Vec<Vec<u8>>)>;

/// Appends `msg` from `from` to its sender's group (a new group at the end for a new
/// sender).
pub(crate) fn push_grouped(groups: &mut Groups, from: &Sender, msg: Vec<u8>) {
    match groups.iter_mut().find(|(sender, _)| sender == from) {
        Some((_, msgs)) => msgs.push(msg),
        None => groups.push((from.clone(), vec![msg])),
    }
}

/// What a source says after a drain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Drained {
    /// Keep polling it.
    Open,
    /// It will deliver nothing more: remove it.
    Finished,
}

/// A place notifications arrive that `get_new_notifs` drains on the caller's thread.
pub(crate) trait NotifSource: Send + fmt::Debug {
    /// Moves every notification that arrived into `out` (with [`push_grouped`]) and
    /// counts them in `counters`. Runs with the source list locked: it must not
    /// block.
    fn drain(&mut self, counters: &Counters, out: &mut Groups) -> Drained;
}

/// The sources an agent drains besides its inbox.
#[derive(Debug, Default)]
pub(crate) struct NotifSources {
    list: Mutex<Vec<Box<dyn NotifSource>>>,
    /// `list.len()`, readable without the lock (the empty fast path).
    count: AtomicUsize,
}

impl NotifSources {
    pub(crate) fn add(&self, source: Box<dyn NotifSource>) {
        let mut list = lock(&self.list);
        list.push(source);
        self.count.store(list.len(), Ordering::Release);
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.count.load(Ordering::Acquire) == 0
    }

    /// Drains every source into `out`, in the order they were added; removes those that
    /// finished.
    pub(crate) fn drain_into(&self, counters: &Counters, out: &mut Groups) {
        let mut list = lock(&self.list);
        list.retain_mut(|s| s.drain(counters, out) == Drained::Open);
        self.count.store(list.len(), Ordering::Release);
    }
}

/// Where a link sends its notifications instead of its TCP notification connection.
pub(crate) trait NotifSink: Send + Sync + fmt::Debug {
    /// Hands `bytes` (at most `limits.max_notif_len`, checked by the caller) to the peer.
    /// May wait a bounded time for room; never indefinitely.
    fn send(&self, bytes: &[u8]) -> Result<(), TransferError>;
}
