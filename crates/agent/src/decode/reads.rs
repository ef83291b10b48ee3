//! The IO of a load: the handshake with P, the read ops of a batch, and the verification
//! of the bytes read.

use super::*;
use crate::shell::{PeerEngine, PeerWorker, connect_worker, remote_engine};

pub(super) fn verify_worker(
    w: &Worker,
    blocks: &[BlockId],
    hashes: &[u64],
) -> Result<KvDigest, VerifyError> {
    let mut digest = KvDigest::default();
    let mut buf = vec![0u8; w.layout.block_bytes()];
    let mut result = Ok(());
    kv::for_each_block(&w.layout.shape, hashes, |layer, i, first, hs| {
        if result.is_err() {
            return;
        }
        // Host memory directly, device memory through a staged copy.
        let r = w
            .pool
            .read_block(layer, blocks[i], &mut buf)
            .map_err(|source| VerifyError::ReadBack {
                block: blocks[i].0,
                source,
            });
        if let Err(e) = r {
            result = Err(e);
            return;
        }
        if let Some(m) = kv::verify_block(&w.layout, &buf, layer, first, hs) {
            result = Err(VerifyError::Mismatch {
                layer: m.layer,
                pos: m.pos,
                half: if m.kv == 0 { "K" } else { "V" },
                head: m.head,
            });
            return;
        }
        digest.add(kv::digest_block(&w.layout, &buf, layer, first, hs.len()));
    });
    result.map(|()| digest)
}

/// The read ops that copy global heads `heads` of the request's blocks from P worker `pw`
/// (whose first global head is `p_first`) into D worker `w`'s blocks.
pub(super) fn build_ops(
    w: &Worker,
    pw: &PeerWorker,
    info: &PeerEngine,
    d_blocks: &[BlockId],
    p_blocks: &[u32],
    heads: std::ops::Range<u32>,
    p_first: u32,
) -> Result<Vec<ReadOp>, ReadSetupError> {
    let p_layout = KvLayout::new(
        info.shape.num_layers,
        info.num_blocks,
        info.shape.num_kv_heads / info.tp_size.max(1),
        info.shape.block_size,
        info.shape.head_dim,
        kv::DTYPE_BYTES as u32,
    )
    .map_err(|source| ReadSetupError::Layout {
        what: "P's layout",
        source,
    })?;
    let d_first = w.layout.heads.start;
    let d_range = heads.start - d_first..heads.end - d_first;
    let p_range = heads.start - p_first..heads.end - p_first;
    let mut ops = Vec::new();
    for layer in 0..info.shape.num_layers {
        for (&db, &pb) in d_blocks.iter().zip(p_blocks) {
            for half in [KvHalf::K, KvHalf::V] {
                let local = w
                    .pool
                    .layout()
                    .heads_range(layer, db, half, d_range.clone())
                    .map_err(|source| ReadSetupError::Layout {
                        what: "D block",
                        source,
                    })?;
                let remote = p_layout
                    .heads_range(layer, BlockId(pb), half, p_range.clone())
                    .map_err(|source| ReadSetupError::Layout {
                        what: "P block",
                        source,
                    })?;
                ops.push(link::read_op(&w.pool_desc, local, &pw.pool, remote.start));
            }
        }
    }
    Ok(ops)
}

/// What a handshake thread found.
pub(super) enum Handshaken {
    /// D registered with P and every D worker connected to every P worker.
    Connected(Ready),
    /// A check found P at no newer instance than the one D is connected to: nothing was
    /// registered or connected.
    Unchanged(PeerEngine),
}

/// The handshake with P (on a background thread): every D worker connects to every P
/// worker. A check of a connected engine (`check`: the instance D is connected to) first
/// asks P's side channel without registering, and goes on only when P announces a newer
/// instance; D's connections to the old one stay until the core took the answer.
pub(super) fn handshake(
    addr: &str,
    me: &Me<'_>,
    want: &EngineId,
    agents: &[Arc<Agent>],
    allowed: &[crate::config::Cidr],
    check: Option<u64>,
) -> Result<Handshaken, HandshakeFailure> {
    let check_ip = |ip: std::net::IpAddr| {
        if allowed.is_empty() || allowed.iter().any(|n| n.contains(ip)) {
            Ok(())
        } else {
            Err(HandshakeFailure::NotAllowed {
                engine: want.clone(),
                ip,
            })
        }
    };
    if !allowed.is_empty() {
        let ips = std::net::ToSocketAddrs::to_socket_addrs(addr).map_err(|e| {
            HandshakeFailure::SideChannel {
                engine: want.clone(),
                addr: addr.to_owned(),
                source: sidechannel::HandshakeError::Io {
                    addr: addr.to_owned(),
                    source: e,
                },
            }
        })?;
        for a in ips {
            check_ip(a.ip())?;
        }
    }
    if let Some(current) = check {
        // Asking registers nothing: P keeps D's registration and D its connections.
        let ask = Me {
            tp_size: 0,
            metadata: &[],
            instance: 0,
            ..*me
        };
        let info = answered(remote_engine(addr, &ask, want)?, want)?;
        if info.instance <= current {
            return Ok(Handshaken::Unchanged(info));
        }
    }
    let info = answered(remote_engine(addr, me, want)?, want)?;
    if !allowed.is_empty() {
        // The side channel names where the transport connects: check that too.
        for w in &info.workers {
            let md = kvlease_transport::metadata::decode_metadata(&w.metadata)
                .ok()
                .ok_or_else(|| HandshakeFailure::Metadata {
                    engine: want.clone(),
                })?;
            let ip = md
                .tcp_addr
                .parse::<std::net::SocketAddr>()
                .map_err(|_| HandshakeFailure::Metadata {
                    engine: want.clone(),
                })?
                .ip();
            check_ip(ip)?;
        }
    }
    let mut peers = Vec::new();
    for agent in agents {
        let row = (0..info.tp_size)
            .map(|rank| connect_worker(agent, &info, rank, want, info.session.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        peers.push(row);
    }
    Ok(Handshaken::Connected(Ready { info, peers }))
}

/// P's answer, refused when its instance lies further ahead of this host's clock than
/// peers' clocks may differ (it would outrank P's real restarts to come).
fn answered(info: PeerEngine, want: &EngineId) -> Result<PeerEngine, HandshakeFailure> {
    kvlease_engine::instance::check_instance(info.instance, instance_now()).map_err(|source| {
        HandshakeFailure::InstanceAhead {
            engine: want.clone(),
            source,
        }
    })?;
    Ok(info)
}
