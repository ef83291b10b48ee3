//! Sessions bound to peer names: the link between a side-channel registration and the
//! transport connections that speak for it.
//!
//! A peer's name is `{group}/{worker}` (the agents name a worker `{engine}/d0`; see
//! [`name_group`]). Once
//! [`Agent::bind_session`](crate::Agent::bind_session) bound a
//! [`Session`] to a group, every inbound connection (TCP or shared memory) whose name lies
//! in that group must prove the session's key instead of the cluster token, and so comes
//! from the party that ran the side-channel exchange that gave the session; one that
//! proves only the token is refused, counted (`TransportStats::session_refusals`) and
//! logged at warn. Connections that proved a session carry its id
//! ([`Session::id`]) on every notification ([`Sender::session`](crate::Sender)), so that
//! the application can tell them from connections made under another session (or none)
//! under the same name. Without a token there are no sessions and nothing is bound.

use std::collections::HashMap;
use std::sync::Mutex;

use kvlease_proto::auth::{Session, name_group};

use crate::sync::lock;

/// The sessions bound to peer groups.
#[derive(Debug, Default)]
pub(crate) struct Sessions {
    bound: Mutex<HashMap<String, Session>>,
}

impl Sessions {
    /// The session a client called `name` must prove, if its group has one.
    pub(crate) fn of(&self, name: &str) -> Option<Session> {
        lock(&self.bound).get(name_group(name)).cloned()
    }

    pub(crate) fn bind(&self, group: &str, session: Session) {
        lock(&self.bound).insert(group.to_owned(), session);
    }

    pub(crate) fn unbind(&self, group: &str) -> bool {
        lock(&self.bound).remove(group).is_some()
    }
}
