//! Helpers shared by the TCP test binaries (`tcp_data`, `tcp_auth`, `tcp_staged`,
//! `tcp_notif`; `shm` takes its batch waits and byte reads): agents on loopback,
//! deterministic regions, batch waits, and raw wire frames for peers that misbehave on
//! purpose.
//!
//! Each test binary compiles this module on its own and uses only a subset of it, so the
//! items the other binaries use would warn as dead code here.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use kvlease_gpu_mem::{DmaRegion, HostRegion, RegionBytes};
use kvlease_transport::{
    Agent, AgentConfig, BackendChoice, BatchId, BatchStatus, LocalRange, ReadBatch, ReadOp,
    RegionDesc, RegionId,
};

pub(crate) const LIMIT: Duration = Duration::from_secs(20);

pub(crate) fn config(name: &str, token: Option<&[u8]>) -> AgentConfig {
    let mut c = AgentConfig::new(name);
    c.backend = BackendChoice::Tcp;
    c.auth_token = token.map(<[u8]>::to_vec);
    c
}

pub(crate) fn agent(name: &str) -> Agent {
    Agent::new(config(name, None)).expect("agent binds on loopback")
}

/// A deterministic byte stream (xorshift64*).
pub(crate) struct Rng(pub(crate) u64);
impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

pub(crate) fn filled(len: usize, seed: u64) -> Arc<HostRegion> {
    let r = HostRegion::new(len).expect("host memory");
    let mut rng = Rng(seed | 1);
    let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
    r.write_from(0, &bytes).expect("in bounds");
    Arc::new(r)
}

pub(crate) fn bytes_of(r: &dyn DmaRegion, offset: u64, len: u64) -> Vec<u8> {
    let mut v = vec![0; len as usize];
    r.read_into(offset, &mut v).expect("in bounds");
    v
}

pub(crate) fn wait(agent: &Agent, batch: BatchId) -> Result<BatchStatus> {
    let start = Instant::now();
    loop {
        match agent.poll_batch(batch)? {
            BatchStatus::Pending if start.elapsed() < LIMIT => {
                std::thread::sleep(Duration::from_micros(200));
            }
            BatchStatus::Pending => bail!("batch still pending after {LIMIT:?}"),
            other => return Ok(other),
        }
    }
}

pub(crate) fn one_read(
    dst: RegionId,
    len: u64,
    remote: kvlease_transport::RemoteRange,
) -> ReadBatch {
    ReadBatch {
        ops: vec![ReadOp {
            local: LocalRange {
                region: dst,
                offset: 0,
                len,
            },
            remote,
        }],
        notif: None,
        fence: None,
    }
}

pub(crate) fn notifs_from(agent: &Agent, want: usize) -> Vec<(String, Vec<Vec<u8>>)> {
    let start = Instant::now();
    let mut all: Vec<(String, Vec<Vec<u8>>)> = Vec::new();
    while all.iter().map(|(_, m)| m.len()).sum::<usize>() < want && start.elapsed() < LIMIT {
        for (peer, msgs) in agent.get_new_notifs() {
            match all.iter_mut().find(|(p, _)| *p == peer) {
                Some((_, m)) => m.extend(msgs),
                None => all.push((peer, msgs)),
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    all
}

// ---- raw wire helpers (the format is documented in src/tcp/wire.rs) ----

pub(crate) fn frame(ty: u8, body: &[u8]) -> Vec<u8> {
    let mut v = vec![ty];
    v.extend_from_slice(&(body.len() as u32).to_le_bytes());
    v.extend_from_slice(body);
    v
}

pub(crate) fn read_frame(s: &mut TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    let mut h = [0u8; 5];
    s.read_exact(&mut h)?;
    let mut body = vec![0; u32::from_le_bytes([h[1], h[2], h[3], h[4]]) as usize];
    s.read_exact(&mut body)?;
    Ok((h[0], body))
}

pub(crate) fn read_req(req: u64, desc: &RegionDesc, offset: u64, len: u64) -> Vec<u8> {
    let mut b = Vec::new();
    for v in [req, desc.id, desc.key, offset, len] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    frame(5, &b)
}

pub(crate) fn hello(name: &str) -> Vec<u8> {
    let mut b = vec![1, 0, 0, 0];
    b.extend_from_slice(&[9; 32]);
    b.extend_from_slice(&(name.len() as u16).to_le_bytes());
    b.extend_from_slice(name.as_bytes());
    frame(1, &b)
}

pub(crate) fn raw(p: &Agent) -> Result<TcpStream> {
    let s = TcpStream::connect(p.local_addr())?;
    s.set_read_timeout(Some(LIMIT))?;
    Ok(s)
}

/// Whether the peer closed the connection (EOF or reset) within the limit.
pub(crate) fn closed(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 64];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) => {
                return e.kind() != std::io::ErrorKind::WouldBlock
                    && e.kind() != std::io::ErrorKind::TimedOut;
            }
        }
    }
}

/// A hand-written peer speaking the wire format, to misbehave on purpose. Accepts one
/// data connection and the notification connection, completes their handshakes without
/// a token, then runs `behave` on the data connection.
pub(crate) fn fake_peer(
    name: &'static str,
    behave: impl FnOnce(TcpStream) + Send + 'static,
) -> Result<(Vec<u8>, RegionDesc, std::thread::JoinHandle<()>)> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let desc = RegionDesc {
        id: 1,
        base: 0,
        len: 1 << 20,
        key: 5,
    };
    let meta = serde_json::json!({
        "format": 1, "name": name, "tcp_addr": listener.local_addr()?.to_string(),
        "auth": false, "regions": [desc],
    });
    let h = std::thread::spawn(move || {
        let accept = || -> Option<TcpStream> {
            let (mut s, _) = listener.accept().ok()?;
            let Ok((1, _hello)) = read_frame(&mut s) else {
                return None;
            };
            let mut b = vec![1, 0, 0];
            b.extend_from_slice(&[3; 32]);
            b.extend_from_slice(&(name.len() as u16).to_le_bytes());
            b.extend_from_slice(name.as_bytes());
            s.write_all(&frame(2, &b)).ok()?;
            let Ok((3, _proof)) = read_frame(&mut s) else {
                return None;
            };
            s.write_all(&frame(4, &[1, 0])).ok()?;
            Some(s)
        };
        let Some(data) = accept() else {
            return;
        };
        let Some(_notif) = accept() else {
            return;
        };
        behave(data);
    });
    Ok((serde_json::to_vec(&meta)?, desc, h))
}

pub(crate) fn single_conn(name: &str) -> Result<Agent> {
    let mut c = config(name, None);
    c.num_connections = 1;
    Ok(Agent::new(c)?)
}

/// Reads one READ_REQ and answers with a header for its full length but only half the
/// bytes.
pub(crate) fn half_answer(s: &mut TcpStream) -> Option<()> {
    let (ty, body) = read_frame(s).ok()?;
    if ty != 5 {
        return None;
    }
    let req = u64::from_le_bytes(body[..8].try_into().ok()?);
    let len = u64::from_le_bytes(body[32..40].try_into().ok()?);
    let mut resp = Vec::new();
    resp.extend_from_slice(&req.to_le_bytes());
    resp.extend_from_slice(&len.to_le_bytes());
    s.write_all(&frame(6, &resp)).ok()?;
    s.write_all(&vec![0xEE; len as usize / 2]).ok()
}

// ---- the notification connection ----

/// A `HELLO` for connection `index` (`0xFFFF`: the notification connection).
pub(crate) fn hello_at(name: &str, index: u16) -> Vec<u8> {
    let mut b = vec![1, 0];
    b.extend_from_slice(&index.to_le_bytes());
    b.extend_from_slice(&[9; 32]);
    b.extend_from_slice(&(name.len() as u16).to_le_bytes());
    b.extend_from_slice(name.as_bytes());
    frame(1, &b)
}

pub(crate) const NOTIF_CONN: u16 = 0xFFFF;

/// Completes the handshake on `s` as `name` with an agent that has no token.
pub(crate) fn handshake_raw(s: &mut TcpStream, name: &str, index: u16) -> Result<()> {
    s.write_all(&hello_at(name, index))?;
    let (ty, _) = read_frame(s)?;
    ensure!(ty == 2, "CHALLENGE");
    s.write_all(&frame(3, &[0]))?;
    let (ty, body) = read_frame(s)?;
    ensure!(ty == 4 && body[0] == 1, "AUTH_RESULT ok");
    Ok(())
}

/// Polls `agent` until `want` notifications came (or the limit passed), as one list
/// per sender.
pub(crate) fn poll_for(agent: &Agent, want: usize) -> Vec<(String, Vec<Vec<u8>>)> {
    notifs_from(agent, want)
}
