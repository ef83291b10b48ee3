//! The TCP backend.
//!
//! The target side (P) runs a listener thread and one thread per inbound connection; each
//! reads request frames and answers a `READ_REQ` by writing the response header and the
//! bytes straight from the registered region to the socket (one vectored write, no
//! staging copy), after checking authentication, the region id, its key and the bounds.
//! A region that is not host-accessible (CUDA device memory, or
//! `MemoryKind::StagedHost` in tests) is served through the connection's pipelined
//! `kvlease_gpu_mem::staging::Stager` instead: pinned bounce buffers, the copy of chunk
//! i+1 overlapping the send of chunk i; the reader fills such a destination the same way
//! (`Stager::recv`). A staged failure after the response header closes the connection, so
//! the reader fails that read as disconnected.
//! The reader side (D) opens `num_connections` connections per peer, each with a writer
//! thread (request frames, coalesced) and a reader thread that receives each response
//! straight into the destination region (its buffer holds response headers only, so a
//! payload is copied once, by the kernel). Chunks of a batch are striped round-robin over
//! the live connections. Notifications travel on one more connection per peer, which no
//! thread of ours reads or writes: see [`notif`]. See [`wire`] for the frames.

pub(crate) mod client;
pub(crate) mod notif;
pub(crate) mod server;
pub(crate) mod wire;

pub(crate) use client::TcpLink;
pub(crate) use notif::NotifHub;
