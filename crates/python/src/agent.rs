//! The transport agent for Python: registration, metadata, peers, batched fenced reads,
//! fenced writes (push mode) and notifications. Blocking calls release the GIL.

use std::net::SocketAddr;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant};

use kvlease_transport as transport;
use kvlease_transport::{
    AgentConfig, BackendChoice, BatchStatus, FenceRead, LocalRange, ReadBatch, ReadOp, RegionId,
    RemoteRange, WriteBatch, WriteFence, WriteOp,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::cores::PyEnum;
use crate::errors::{Family, ToPyErr, check_unauthenticated_listen, invalid, raise};
use crate::memory::Described;

/// How long [`Agent::wait`] sleeps between polls at most (it starts shorter).
const MAX_POLL_SLEEP: Duration = Duration::from_millis(1);

fn backend_choice(py: Python<'_>, name: &str) -> PyResult<BackendChoice> {
    match name {
        "auto" => Ok(BackendChoice::Auto),
        "tcp" => Ok(BackendChoice::Tcp),
        "shm" => Ok(BackendChoice::Shm),
        "verbs" => Ok(BackendChoice::Verbs),
        other => Err(invalid(
            py,
            format!("backend must be 'auto', 'tcp', 'shm' or 'verbs', not {other:?}"),
        )),
    }
}

fn seconds(py: Python<'_>, what: &str, secs: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(secs).map_err(|_| {
        invalid(
            py,
            format!("{what} must be a finite number of seconds >= 0, not {secs}"),
        )
    })
}

/// A registered local region: pass it as the destination of reads, or hand its id and
/// key to peers (they find them in this agent's metadata).
#[pyclass(module = "kvlease._kvlease", frozen)]
pub(crate) struct Region {
    /// The region's id in this agent.
    #[pyo3(get)]
    id: u64,
    /// Its length in bytes.
    #[pyo3(get)]
    length: u64,
    /// The key peers present to read it.
    #[pyo3(get)]
    key: u64,
    /// Its start address (host, or CUDA device address).
    #[pyo3(get)]
    base: u64,
    /// `"host"` or `"cuda:<ordinal>"`.
    #[pyo3(get)]
    kind: String,
}

#[pymethods]
impl Region {
    fn __repr__(&self) -> String {
        format!(
            "Region(id={}, length={}, kind={:?})",
            self.id, self.length, self.kind
        )
    }
}

/// A region of a peer, from its metadata: the source of reads.
#[pyclass(module = "kvlease._kvlease", frozen, eq, hash, from_py_object)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct RemoteRegion {
    /// The region's id in the peer.
    #[pyo3(get)]
    id: u64,
    /// Its key.
    #[pyo3(get)]
    key: u64,
    /// Its length in bytes.
    #[pyo3(get)]
    length: u64,
}

#[pymethods]
impl RemoteRegion {
    /// A peer's region as its metadata describes it.
    #[new]
    fn new(id: u64, key: u64, length: u64) -> Self {
        Self { id, key, length }
    }

    fn __repr__(&self) -> String {
        format!("RemoteRegion(id={}, length={})", self.id, self.length)
    }
}

impl RemoteRegion {
    fn at(&self, offset: u64) -> RemoteRange {
        RemoteRange {
            region: self.id,
            key: self.key,
            offset,
        }
    }
}

/// A connected peer (from [`Agent::connect`]).
#[pyclass(module = "kvlease._kvlease", frozen)]
pub(crate) struct Peer {
    id: transport::PeerId,
    /// The peer's name, as its metadata announced it.
    #[pyo3(get)]
    name: String,
    /// The backend that carries its reads: `"tcp"`, `"shm"` or `"verbs"`.
    #[pyo3(get)]
    backend: String,
    /// Why that backend was chosen (for logs).
    #[pyo3(get)]
    backend_reason: String,
    /// Its registered regions, in id order.
    #[pyo3(get)]
    regions: Vec<RemoteRegion>,
}

#[pymethods]
impl Peer {
    /// The peer's region with id `id`.
    fn region(&self, py: Python<'_>, id: u64) -> PyResult<RemoteRegion> {
        self.regions
            .iter()
            .find(|r| r.id == id)
            .copied()
            .ok_or_else(|| invalid(py, format!("peer {} has no region {id}", self.name)))
    }

    fn __repr__(&self) -> String {
        format!("Peer(name={:?}, backend={:?})", self.name, self.backend)
    }
}

/// A posted read or write batch (from [`Agent::post_read`] or [`Agent::post_write`]).
#[pyclass(module = "kvlease._kvlease", frozen)]
pub(crate) struct Batch {
    id: transport::BatchId,
    /// The peer it reads from (or writes to).
    #[pyo3(get)]
    peer: String,
}

/// How a batch ended.
#[pyclass(module = "kvlease._kvlease", frozen)]
pub(crate) struct BatchResult {
    /// A `BatchStatus`: `done`, `stale` (the fence word did not match: nothing read may
    /// be used; for a write, the peer's write fence no longer held the generation and
    /// the refused write did not land) or `failed`.
    #[pyo3(get)]
    status: Py<PyAny>,
    /// Data bytes read or written (0 unless done).
    #[pyo3(get)]
    bytes: u64,
    /// The fence word read, when the batch had a fence and got that far.
    #[pyo3(get)]
    fence_word: Option<u64>,
    /// The backend that moved the bytes (done only): `"tcp"`, `"shm"`, `"cma"` (any byte
    /// read with cross-memory attach: a same-host peer's host memory that is not a memfd,
    /// such as buffers and tensors registered from Python) or `"verbs"`.
    #[pyo3(get)]
    backend: Option<&'static str>,
    /// The exception (`StaleFenceError`, `TransferTimeout`, `TransferError`) unless done.
    #[pyo3(get)]
    error: Option<Py<PyAny>>,
}

#[pymethods]
impl BatchResult {
    /// Whether every read completed and the fence matched.
    #[getter]
    fn ok(&self) -> bool {
        // Only a batch that is done carries no exception.
        self.error.is_none()
    }

    /// Raises [`error`](Self::error) unless the batch is done.
    fn raise_for_status(&self, py: Python<'_>) -> PyResult<()> {
        match &self.error {
            Some(e) => Err(PyErr::from_value(e.bind(py).clone())),
            None => Ok(()),
        }
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "BatchResult(status={:?}, bytes={})",
            self.status.bind(py).to_string(),
            self.bytes
        )
    }
}

impl BatchResult {
    fn from_status(py: Python<'_>, status: BatchStatus) -> PyResult<Option<Self>> {
        Ok(match status {
            BatchStatus::Pending => None,
            BatchStatus::Done(stats) => Some(Self {
                status: PyEnum::BatchStatus.member(py, "done")?,
                bytes: stats.bytes,
                fence_word: stats.fence_word,
                backend: Some(stats.backend.as_str()),
                error: None,
            }),
            BatchStatus::Failed(e) => {
                let (status, fence_word) = match &e {
                    transport::TransferError::FenceMismatch { found, .. } => {
                        ("stale", Some(*found))
                    }
                    transport::TransferError::Stale { .. } => ("stale", None),
                    _ => ("failed", None),
                };
                Some(Self {
                    status: PyEnum::BatchStatus.member(py, status)?,
                    bytes: 0,
                    fence_word,
                    backend: None,
                    error: Some(e.to_py(py).into_value(py).into_any()),
                })
            }
        })
    }
}

/// A transfer agent: registers memory, publishes metadata, connects to peers, reads their
/// registered memory in fenced batches and exchanges notifications with them.
///
/// Call order: construct → `register` the memory peers may read → hand `metadata()` to
/// peers out of band → `connect(peer_metadata)` → `post_read` + `poll`/`wait` (or
/// `read`), `send_notif` / `get_new_notifs` at any time after `connect`. Notifications
/// travel over the sender's connection: to send to a peer, connect to it.
#[pyclass(module = "kvlease._kvlease", frozen)]
pub(crate) struct Agent {
    inner: RwLock<Option<Arc<transport::Agent>>>,
    name: String,
}

impl Agent {
    fn get(&self, py: Python<'_>) -> PyResult<Arc<transport::Agent>> {
        self.inner
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or_else(|| raise(py, Family::Closed, format!("agent {} is closed", self.name)))
    }

    fn register_described(&self, py: Python<'_>, described: Described) -> PyResult<Region> {
        let agent = self.get(py)?;
        let device = described.device;
        let region = described.into_region(py)?;
        let desc = agent.register(region).map_err(|e| e.to_py(py))?;
        Ok(Region {
            id: desc.id,
            length: desc.len,
            key: desc.key,
            base: desc.base,
            kind: match device {
                None => "host".to_owned(),
                Some(o) => format!("cuda:{o}"),
            },
        })
    }

    fn batch(
        py: Python<'_>,
        ops: &Bound<'_, PyAny>,
        notif: Option<Vec<u8>>,
        fence: Option<(RemoteRegion, u64, u64)>,
    ) -> PyResult<ReadBatch> {
        let ops = Self::ops(py, ops, "a read op's destination")?
            .into_iter()
            .map(|(local, remote)| ReadOp { local, remote })
            .collect();
        let fence = fence.map(|(region, offset, expected)| FenceRead {
            remote: region.at(offset),
            expected,
        });
        Ok(ReadBatch { ops, notif, fence })
    }

    fn write_batch(
        py: Python<'_>,
        ops: &Bound<'_, PyAny>,
        notif: Option<Vec<u8>>,
        fence: (RemoteRegion, u64, u64),
    ) -> PyResult<WriteBatch> {
        let ops = Self::ops(py, ops, "a write op's source")?
            .into_iter()
            .map(|(local, remote)| WriteOp { local, remote })
            .collect();
        let (region, offset, expected) = fence;
        Ok(WriteBatch {
            ops,
            notif,
            fence: WriteFence {
                remote: region.at(offset),
                expected,
            },
        })
    }

    /// A batch's `(local, local_offset, remote, remote_offset, len)` tuples as ranges;
    /// `what` names the local side in errors.
    fn ops(
        py: Python<'_>,
        ops: &Bound<'_, PyAny>,
        what: &str,
    ) -> PyResult<Vec<(LocalRange, RemoteRange)>> {
        let mut out = Vec::new();
        for op in ops.try_iter()? {
            let (local, local_offset, remote, remote_offset, len): (
                Bound<'_, PyAny>,
                u64,
                RemoteRegion,
                u64,
                u64,
            ) = op?.extract()?;
            let local = LocalRange {
                region: region_id(py, &local, what)?,
                offset: local_offset,
                len,
            };
            out.push((local, remote.at(remote_offset)));
        }
        Ok(out)
    }
}

/// The id of a local region passed as a `Region` or its id.
fn region_id(py: Python<'_>, obj: &Bound<'_, PyAny>, what: &str) -> PyResult<RegionId> {
    match obj.cast::<Region>() {
        Ok(r) => Ok(RegionId(r.get().id)),
        Err(_) => obj
            .extract::<u64>()
            .map(RegionId)
            .map_err(|_| invalid(py, format!("{what} is a Region or a region id"))),
    }
}

#[pymethods]
impl Agent {
    /// A new agent called `name`, listening on `listen` (`"host:port"`, port 0: any).
    ///
    /// `token` (bytes) is the cluster token: only peers proving it are served and heard.
    /// Without a token, a `listen` address beyond loopback is refused (anyone who reaches
    /// it could read the registered memory and send notifications) unless
    /// `allow_unauthenticated=True` says so. `backend` is `"auto"` (shared memory on one
    /// host, else verbs, else TCP), `"tcp"`, `"shm"` or `"verbs"`. `advertise` is the
    /// address written into the metadata when it differs from the bound one.
    #[new]
    #[pyo3(signature = (name, *, listen = "127.0.0.1:0", advertise = None, token = None, backend = "auto", num_connections = 2, handshake_timeout = 5.0, allow_unauthenticated = false))]
    #[allow(
        clippy::too_many_arguments,
        reason = "a Python constructor's keyword arguments"
    )]
    fn new(
        py: Python<'_>,
        name: String,
        listen: &str,
        advertise: Option<&str>,
        token: Option<Vec<u8>>,
        backend: &str,
        num_connections: usize,
        handshake_timeout: f64,
        allow_unauthenticated: bool,
    ) -> PyResult<Self> {
        let mut config = AgentConfig::new(name.clone());
        config.listen = listen
            .parse::<SocketAddr>()
            .map_err(|e| invalid(py, format!("listen address {listen:?}: {e}")))?;
        check_unauthenticated_listen(
            py,
            config.listen,
            token.is_some(),
            allow_unauthenticated,
            "the registered memory",
        )?;
        config.advertise = advertise
            .map(|a| {
                a.parse::<SocketAddr>()
                    .map_err(|e| invalid(py, format!("advertise address {a:?}: {e}")))
            })
            .transpose()?;
        if token.as_ref().is_some_and(Vec::is_empty) {
            return Err(invalid(py, "the cluster token must not be empty"));
        }
        config.auth_token = token;
        config.backend = backend_choice(py, backend)?;
        config.num_connections = num_connections;
        config.limits.handshake_timeout = seconds(py, "handshake_timeout", handshake_timeout)?;
        let agent = py
            .detach(|| transport::Agent::new(config))
            .map_err(|e| e.to_py(py))?;
        Ok(Self {
            inner: RwLock::new(Some(Arc::new(agent))),
            name,
        })
    }

    /// This agent's name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// The bound TCP address, `"host:port"`.
    #[getter]
    fn address(&self, py: Python<'_>) -> PyResult<String> {
        Ok(self.get(py)?.local_addr().to_string())
    }

    /// Registers the memory of `obj` so that peers may read it: an object with the buffer
    /// protocol (writable and contiguous: `bytearray`, `mmap`, numpy arrays), an
    /// `__array_interface__` / `__cuda_array_interface__`, or a contiguous torch tensor
    /// (CPU or CUDA). The registration keeps `obj` alive; do not resize it meanwhile.
    fn register(&self, py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Region> {
        let described = Described::of(obj)?;
        self.register_described(py, described)
    }

    /// Registers `length` bytes at address `ptr` (host memory, or device memory of CUDA
    /// device `device`).
    ///
    /// Unchecked: the caller keeps those bytes allocated, writable and unmoved until the
    /// region is deregistered and the agent closed (pass the object that owns them as
    /// `owner` and the registration keeps it alive).
    #[pyo3(signature = (ptr, length, *, owner = None, device = None))]
    fn register_memory(
        &self,
        py: Python<'_>,
        ptr: usize,
        length: usize,
        owner: Option<Py<PyAny>>,
        device: Option<u32>,
    ) -> PyResult<Region> {
        let described = Described {
            ptr,
            len: length,
            device,
            owner: owner.unwrap_or_else(|| py.None()),
        };
        self.register_described(py, described)
    }

    /// Removes a registration: later reads of it are refused. The memory's owner is
    /// released once reads being served end.
    fn deregister(&self, py: Python<'_>, region: &Region) -> PyResult<()> {
        self.get(py)?
            .deregister(RegionId(region.id))
            .map_err(|e| e.to_py(py))
    }

    /// This agent's metadata (bytes): hand it to peers so that they can `connect`.
    /// Regions registered later need a fresh copy.
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let meta = self.get(py)?.metadata();
        Ok(PyBytes::new(py, &meta))
    }

    /// Connects to the peer whose metadata this is (authenticated with the cluster
    /// token when set). Releases the GIL while it connects.
    fn connect(&self, py: Python<'_>, metadata: Vec<u8>) -> PyResult<Peer> {
        let agent = self.get(py)?;
        let id = py
            .detach(|| agent.connect(&metadata))
            .map_err(|e| e.to_py(py))?;
        let meta = agent
            .peer_metadata(id)
            .ok_or_else(|| raise(py, Family::Connect, "the peer went away while connecting"))?;
        let (backend, reason) = agent
            .peer_backend(id)
            .unwrap_or((transport::Backend::Tcp, String::new()));
        let mut regions: Vec<RemoteRegion> = meta
            .regions
            .iter()
            .map(|r| RemoteRegion {
                id: r.id,
                key: r.key,
                length: r.len,
            })
            .collect();
        regions.sort_by_key(|r| r.id);
        Ok(Peer {
            id,
            name: meta.name,
            backend: backend.as_str().to_owned(),
            backend_reason: reason,
            regions,
        })
    }

    /// Closes the connections to `peer`; its running batches fail.
    fn disconnect(&self, py: Python<'_>, peer: &Peer) -> PyResult<()> {
        self.get(py)?.disconnect(peer.id).map_err(|e| e.to_py(py))
    }

    /// Posts a batch of reads from `peer`.
    ///
    /// `ops` is an iterable of `(local, local_offset, remote, remote_offset, length)`:
    /// `local` a `Region` (or its id) of this agent, `remote` a `RemoteRegion` of the
    /// peer. `fence` is `(remote_region, offset, expected)`: after every data read, the
    /// 8-byte word there must hold `expected`, else the batch ends `"stale"`. `notif`
    /// is sent to the peer only after every read (and the fence) completed. The batch
    /// fails when it has not completed `timeout` seconds after posting.
    #[pyo3(signature = (peer, ops, *, notif = None, fence = None, timeout = 30.0))]
    fn post_read(
        &self,
        py: Python<'_>,
        peer: &Peer,
        ops: &Bound<'_, PyAny>,
        notif: Option<Vec<u8>>,
        fence: Option<(RemoteRegion, u64, u64)>,
        timeout: f64,
    ) -> PyResult<Batch> {
        let agent = self.get(py)?;
        let batch = Self::batch(py, ops, notif, fence)?;
        let timeout = seconds(py, "timeout", timeout)?;
        let id = py
            .detach(|| agent.post_read(peer.id, batch, timeout))
            .map_err(|e| e.to_py(py))?;
        Ok(Batch {
            id,
            peer: peer.name.clone(),
        })
    }

    /// Posts a batch of fenced writes to `peer` (push mode; TCP and shared-memory peers).
    ///
    /// `ops` is an iterable of `(local, local_offset, remote, remote_offset, length)`:
    /// `local` a `Region` (or its id) of this agent, the source, `remote` a
    /// `RemoteRegion` of the peer, the destination. Keep the source bytes unchanged until
    /// the batch ended. `fence` is `(remote_region, offset, generation)`: the peer lands
    /// each write only if, once its bytes arrived, its write-fence word there (published
    /// with the peer's `set_write_fence`) holds `generation`; otherwise nothing of that
    /// write lands and the batch ends `"stale"` (`StaleFenceError`). `notif` is sent to
    /// the peer only after every write landed. The batch fails when it has not completed
    /// `timeout` seconds after posting. Poll it as a read batch (`poll`, `wait`); writes
    /// that landed before a failure stay landed.
    #[pyo3(signature = (peer, ops, *, fence, notif = None, timeout = 30.0))]
    fn post_write(
        &self,
        py: Python<'_>,
        peer: &Peer,
        ops: &Bound<'_, PyAny>,
        fence: (RemoteRegion, u64, u64),
        notif: Option<Vec<u8>>,
        timeout: f64,
    ) -> PyResult<Batch> {
        let agent = self.get(py)?;
        let batch = Self::write_batch(py, ops, notif, fence)?;
        let timeout = seconds(py, "timeout", timeout)?;
        let id = py
            .detach(|| agent.post_write(peer.id, batch, timeout))
            .map_err(|e| e.to_py(py))?;
        Ok(Batch {
            id,
            peer: peer.name.clone(),
        })
    }

    /// Stores `value` into the write-fence word at `offset` of the registered region
    /// `region` (a `Region` or its id; 8 bytes, 8-aligned, host memory), under the lock
    /// this agent lands peers' writes under. Publish a reservation's generation with it
    /// before peers write, and clear it (store any other value, e.g. 0) when the
    /// reservation ends: once this returns, no write carrying the old generation lands.
    /// Change a write-fence word only through this. Raises `RegisterError` for an
    /// unregistered region or a word outside it, misaligned or not in host memory.
    fn set_write_fence(
        &self,
        py: Python<'_>,
        region: &Bound<'_, PyAny>,
        offset: u64,
        value: u64,
    ) -> PyResult<()> {
        let agent = self.get(py)?;
        let region = region_id(py, region, "the fence's region")?;
        py.detach(|| agent.set_write_fence(region, offset, value))
            .map_err(|e| e.to_py(py))
    }

    /// Where `batch` stands: `None` while it runs, then its `BatchResult` (reported
    /// once; polling it again raises `TransferError`).
    fn poll(&self, py: Python<'_>, batch: &Batch) -> PyResult<Option<BatchResult>> {
        let agent = self.get(py)?;
        let status = agent.poll_batch(batch.id).map_err(|e| e.to_py(py))?;
        BatchResult::from_status(py, status)
    }

    /// Waits, without the GIL, until every batch of `batches` ended, and returns their
    /// results in order. With `timeout` (seconds), returns when it passed, with `None`
    /// for the batches still running (poll or wait for them again; each batch's own
    /// timeout still ends it).
    #[pyo3(signature = (batches, timeout = None))]
    fn wait(
        &self,
        py: Python<'_>,
        batches: Vec<Py<Batch>>,
        timeout: Option<f64>,
    ) -> PyResult<Vec<Option<BatchResult>>> {
        let agent = self.get(py)?;
        let deadline = timeout
            .map(|t| seconds(py, "timeout", t))
            .transpose()?
            // A timeout past what `Instant` can hold is no deadline.
            .and_then(|t| Instant::now().checked_add(t));
        let ids: Vec<transport::BatchId> = batches.iter().map(|b| b.get().id).collect();
        let statuses = py
            .detach(|| wait_all(&agent, &ids, deadline))
            .map_err(|e| e.to_py(py))?;
        statuses
            .into_iter()
            .map(|s| {
                Ok(s.map(|s| BatchResult::from_status(py, s))
                    .transpose()?
                    .flatten())
            })
            .collect()
    }

    /// `post_read` and `wait` in one call: returns the result when the batch is done and
    /// raises its exception (`StaleFenceError`, `TransferTimeout`, `TransferError`)
    /// otherwise.
    #[pyo3(signature = (peer, ops, *, notif = None, fence = None, timeout = 30.0))]
    fn read(
        &self,
        py: Python<'_>,
        peer: &Peer,
        ops: &Bound<'_, PyAny>,
        notif: Option<Vec<u8>>,
        fence: Option<(RemoteRegion, u64, u64)>,
        timeout: f64,
    ) -> PyResult<BatchResult> {
        let agent = self.get(py)?;
        let batch = Self::batch(py, ops, notif, fence)?;
        let timeout = seconds(py, "timeout", timeout)?;
        let status = py
            .detach(|| {
                let id = agent.post_read(peer.id, batch, timeout)?;
                // Without a deadline every slot is filled.
                wait_all(&agent, &[id], None).map(|mut v| v.pop().flatten())
            })
            .map_err(|e| e.to_py(py))?;
        let result = status
            .map(|s| BatchResult::from_status(py, s))
            .transpose()?
            .flatten()
            .ok_or_else(|| raise(py, Family::Transfer, "the batch reported no status"))?;
        result.raise_for_status(py)?;
        Ok(result)
    }

    /// Sends `message` (bytes) to `peer`. Releases the GIL.
    fn send_notif(&self, py: Python<'_>, peer: &Peer, message: Vec<u8>) -> PyResult<()> {
        let agent = self.get(py)?;
        py.detach(|| agent.send_notif(peer.id, message))
            .map_err(|e| match e {
                transport::TransferError::UnknownPeer(_) => {
                    raise(py, Family::Notif, format!("unknown peer {}", peer.name))
                }
                e => crate::errors::raise_err(py, Family::Notif, &e),
            })
    }

    /// The notifications received since the last call: `{sender name: [bytes, ...]}` in
    /// order of each sender's first message, each list in arrival order. Only peers that
    /// proved the cluster token are heard.
    fn get_new_notifs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let agent = self.get(py)?;
        let groups = agent.get_new_notifs();
        let out = PyDict::new(py);
        for (name, msgs) in groups {
            let list = PyList::empty(py);
            for m in msgs {
                list.append(PyBytes::new(py, &m))?;
            }
            out.set_item(name, list)?;
        }
        Ok(out)
    }

    /// The agent's counters (monotonic since it was built), by name.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.get(py)?.stats();
        let out = PyDict::new(py);
        out.set_item("connections_accepted", s.connections_accepted)?;
        out.set_item("malformed_frames", s.malformed_frames)?;
        out.set_item("auth_failures", s.auth_failures)?;
        out.set_item("reads_served", s.reads_served)?;
        out.set_item("bytes_served", s.bytes_served)?;
        out.set_item("reads_refused", s.reads_refused)?;
        out.set_item(
            "reads_refused_unauthenticated",
            s.reads_refused_unauthenticated,
        )?;
        out.set_item("writes_landed", s.writes_landed)?;
        out.set_item("bytes_landed", s.bytes_landed)?;
        out.set_item("writes_refused", s.writes_refused)?;
        out.set_item("writes_stale", s.writes_stale)?;
        out.set_item("writes_pulled", s.writes_pulled)?;
        out.set_item("notifs_received", s.notifs_received)?;
        out.set_item(
            "notifs_dropped_unauthenticated",
            s.notifs_dropped_unauthenticated,
        )?;
        out.set_item("notifs_dropped_overflow", s.notifs_dropped_overflow)?;
        out.set_item("handshake_timeouts", s.handshake_timeouts)?;
        out.set_item("verbs_stall_resets", s.verbs_stall_resets)?;
        Ok(out)
    }

    /// Closes every connection and stops serving (idempotent). Registered memory is
    /// released once reads being served end.
    fn close(&self, py: Python<'_>) {
        let agent = self
            .inner
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        // Dropping the last reference joins the listener thread.
        py.detach(move || drop(agent));
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.inner
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) {
        self.close(py);
    }

    fn __repr__(&self) -> String {
        format!("Agent(name={:?})", self.name)
    }
}

/// Polls every batch until each ended or `deadline` passed (`None` for those still
/// running then), sleeping a little longer each round up to [`MAX_POLL_SLEEP`].
///
/// # Errors
/// The first batch the transport does not know (already reported, never posted).
fn wait_all(
    agent: &transport::Agent,
    ids: &[transport::BatchId],
    deadline: Option<Instant>,
) -> Result<Vec<Option<BatchStatus>>, transport::TransferError> {
    let mut out: Vec<Option<BatchStatus>> = vec![None; ids.len()];
    let mut sleep = Duration::from_micros(20);
    loop {
        let mut pending = false;
        for (slot, id) in out.iter_mut().zip(ids) {
            if slot.is_some() {
                continue;
            }
            match agent.poll_batch(*id)? {
                BatchStatus::Pending => pending = true,
                status => *slot = Some(status),
            }
        }
        if !pending || deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(out);
        }
        std::thread::sleep(sleep);
        sleep = (sleep * 2).min(MAX_POLL_SLEEP);
    }
}
