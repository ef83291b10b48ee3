"""``KvleaseConnector``: a vLLM (0.33.0) KV connector on kvlease's engine cores.

Load it by module path on both engines::

    --kv-transfer-config '{"kv_connector": "KvleaseConnector",
                           "kv_connector_module_path": "kvlease.vllm",
                           "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"kv_lease_duration": 30,
                                                         "cluster_token": "..."}}'

P (``do_remote_decode`` requests) keeps a finished prompt's KV blocks under a **lease**
and answers with ``kv_transfer_params``; D (``do_remote_prefill`` requests) heartbeats
the lease from the moment the request arrives, reads the blocks with **fenced** one-sided
reads, and reports a stale read as a load error, so vLLM recomputes (or fails the
request) instead of decoding from reused blocks. Every lease and request decision is made
by ``kvlease.PrefillCore`` / ``kvlease.DecodeCore`` (the Rust ``kvlease-engine`` cores,
built with external blocks: vLLM's KV cache manager allocates); this module only moves
their inputs and outputs between vLLM's hooks, the transport and the side channel.

Where the state lives
---------------------
**P's lease table lives in P's scheduler** (the scheduler-side connector owns the
``PrefillCore``), because that is where ``request_finished`` must return the lease's
``kv_transfer_params`` synchronously. Notifications, however, arrive at the **workers**
(D connects to P's workers to read, and notifications ride those connections), so:

- P's workers drain their transport agent every step and forward each notification,
  with its authenticated sender, to the scheduler through
  ``build_connector_worker_meta`` (``KvleaseWorkerMetadata.notifs``); the scheduler feeds
  them to the core in ``update_connector_output``. P keeps stepping while it holds
  delay-freed blocks (vLLM's ``has_finished_requests``), so heartbeats and the reaper
  run without a heartbeat thread.
- The **fence words** (one 8-byte generation word per block, per worker) live in a
  ``memfd`` each worker creates, registers with its agent (D's fenced reads read them)
  and names in its handshake metadata; the scheduler maps every worker's memfd
  (``/proc/<pid>/fd/<fd>``; P's scheduler and workers share a host) and writes the
  words itself: the generation **before** ``request_finished`` returns the params, the
  free word **before** it lets vLLM free the blocks. So neither a D that is faster than
  P's next step nor a step that never comes can make a read look valid.
- A lease released (every reader reported, D aborted, or expired) is cleared, then
  listed in the next metadata's ``finished_sending``; every worker reports it from
  ``get_finished`` and vLLM frees the blocks.

**D's tracking lives in D's scheduler** (the ``DecodeCore``): tracking starts in
``on_new_request``; the handshake with P's side channel runs on a background thread
(``get_num_new_matched_tokens`` answers ``None``, "ask again", until it is done); the
heartbeats due (throttled to ``kv_lease_duration / 6``), aborts, the read plans and P's
engine info go to the workers in ``KvleaseConnectorMetadata``; D's worker 0 sends the
heartbeats and aborts to P's worker 0, every worker posts its fenced batches, with the
read-completion as the batch's notification (sent only when the fence matched). Each
batch's result comes back through ``KvleaseWorkerMetadata.batches`` in the step it ended
and goes to the core at once (with TP > 1, vLLM reports the request ``finished_recving``
only when every worker is done, maybe steps later); a worker reports the request
``finished_recving`` when its batches are done (with its blocks in
``get_block_ids_with_load_errors`` when one failed or was stale).

**KV compatibility.** P's handshake payload (format 2) carries ``kv``, a descriptor of
what its blocks mean (``_kv_descriptor``: model, model and KV cache dtypes, total KV
heads, head size, layers, block size, the order inside a block from
``kv_cache_layout``, MLA) with each worker's per-layer block format (``_block_format``:
tensor dtype, block shape, dim order by stride). D compares it with its own
(``_kv_incompatibility``, whose key-by-key check is kvlease-proto's ``compat``, the one the
agents use) at the handshake; an incompatible P's requests are refused at
``get_num_new_matched_tokens`` (logged with every difference; aborted, so P frees the
lease; vLLM computes the prompt on D), and D's workers check each P worker's layer formats
again before posting a read (a mismatch fails the batch: load errors, vLLM recomputes).

**Roles.** ``kv_producer`` builds only the ``PrefillCore`` and the side channel,
``kv_consumer`` only the ``DecodeCore`` (no side channel), ``kv_both`` all of them.

Metadata
--------
``KvleaseConnectorMetadata`` (scheduler → workers; dataclasses and named tuples of
plain values, which vLLM pickles, in ``metadata``): ``loads`` (a ``LoadSpec`` per
request: D's ``local_blocks``, P's ``remote_blocks`` to read, ``fence_block``,
``generation``, P ``engine``, and its ``batches``, each a ``BatchSpec`` with ``index``,
``d_worker``, ``p_rank``, the ``local_heads`` and ``remote_heads`` it copies within
D's and P's blocks, and the read-completion ``notif``), ``transmits``
(``TransmitSpec``: P engine, ``TransmitKind``, message: heartbeats ``HB:<ids>`` and
aborts), ``engines`` (P's ``EngineInfo`` learned by handshakes since the last step, as
``_engine_info`` validated it: a malformed payload from P fails the handshake),
``failed_loads`` (requests vLLM parked for a load the core refused: reported failed at
once) and ``finished_sending`` (P: leases ended; vLLM may free their blocks).

Push mode adds ``reserves`` (``ReserveSpec``), ``reservation_ends``
(``ReservationEndSpec``) and ``writes`` (``WriteSpec``).

``KvleaseWorkerMetadata`` (workers → scheduler): ``notifs`` (``ReceivedNotif``: sender,
message, received by P's workers), ``batches`` (``{request: {batch index:
BatchOutcome}}``: ``BatchStatus``, bytes, error) and, in push mode, ``writes``
(``{transfer: [WriteOutcome]}``, one per P worker).

``kv_transfer_params`` returned by P: vLLM's keys (``do_remote_prefill``,
``do_remote_decode``, ``remote_block_ids``, ``remote_engine_id``, ``remote_request_id``,
``remote_host``, ``remote_port``, ``tp_size``, ``dcp_size``, ``pp_size``,
``remote_num_tokens``, ``transfer_mode``), which vLLM's proxies pass along unchanged,
plus ``kvlease_generation`` (the lease's fence token), ``kvlease_instance`` (P's start
time in µs: a restarted P is detected), ``kvlease_num_tokens`` (the prompt length P
prefilled) and ``kvlease_lease_ms`` (the lease, in ms). Both sides read and write them
through the one codec, :class:`kvlease.KvTransferParams` (D still reads the old
``kvlease_lease_duration``, in seconds).

Configuration (``kv_connector_extra_config``)
---------------------------------------------
``kv_lease_duration`` (seconds, default 30), ``bidirectional_kv_xfer`` (default false:
the engine that decodes a turn holds it for the next turn's P, which reads it back;
``kv_both`` only) with ``decoder_kv_blocks_ttl`` (seconds a turn is held, default 480),
``symmetric_decoder_lease`` (default true: the next P's heartbeats extend the hold),
``kv_recompute_threshold`` (tokens, default 64) and ``pull_safety_margin`` (seconds,
default 5), ``cluster_token`` (or env ``KVLEASE_CLUSTER_TOKEN``;
authenticates the side channel and every transport connection), ``transport``
(``auto`` | ``tcp`` | ``shm`` | ``verbs``), ``side_channel_host`` (the address P's side
channel listens on, only that one, and D reaches P at; default env
``VLLM_NIXL_SIDE_CHANNEL_HOST`` or ``127.0.0.1``),
``side_channel_port`` (default 0: any free port, published in the params),
``transport_host`` (address of the workers' agents; default the side-channel host),
``read_timeout`` (seconds per read batch, default the lease duration),
``handshake_timeout`` (seconds, default 5), ``force_host_buffer`` (below).

**Host buffer.** ``kv_transfer_config.kv_buffer_device`` is ``cuda`` (the KV caches are
registered with the transport as they are) or ``cpu``: then each worker allocates host
buffers laid out as its KV caches (pinned for CUDA caches), registers those instead,
and uses the block copy vLLM's model runner gives (``set_host_xfer_buffer_ops``). P
copies a request's blocks to them after the step that completes its prompt
(``SaveSpec``, ``wait_for_save``), before that step's output reaches
``request_finished``, which grants the lease only on blocks so copied; D reads into its
host buffers and copies the blocks it read to its caches before it reports the load
done. As NixlConnector, a CPU platform stages nothing (its caches are host memory)
unless ``force_host_buffer`` is true. Any other ``kv_buffer_device`` is refused.

**TP sizes and MLA.** P and D may run different TP sizes when each divides the model's
KV heads (P TP = k·D TP or D TP = k·P TP): the decode core plans which D worker reads
which heads from which P rank (``LoadPlan``: one batch per overlapping pair, each a
consumer of P's one lease per request, ``consumers_total`` counting them all), each batch
fenced by its own P rank's fence word. An MLA model's latent cache (one "head", the same
on every rank) is read once per D worker, from one P rank (``replicated_kv``), and P's
lease waits for exactly those readers.

**Push mode** (``KvleasePushConnector``, or ``transfer_mode: push``; ``push``): both legs
at once with one ``transfer_id`` (``kvlease-proxy --transfer-mode push``), both at once
with one ``X-Request-Id`` (vLLM's push proxy: the legs match by vLLM's request id without
its random suffix, and by a digest of the prompt), or P's leg first (vLLM's older push
proxy). P admits its leg on arrival and keeps the prompt's blocks
once prefilled; D reserves the blocks vLLM allocated (``kvlease.Reservations``), its
workers publish the reservation's generation in their write-fence words, and D's worker 0
registers the blocks with P's worker 0 (``KVL1:PR:``). P's ``kvlease.PushCore`` decides;
P's workers write their blocks into D's workers' of the same rank with fenced one-sided
writes (TCP), P heartbeats the reservation and says written or failed. D clears the fence
before it reports the request (received, or with load errors when P's write failed or no
heartbeat renewed the reservation) or frees its blocks (aborted, and P is told).

Not supported (yet): TP sizes that do not divide the KV heads when P's and D's differ
(vLLM replicates heads there; refused at the handshake), KV layouts whose layer block is not dense (``BHLNC``:
``register_kv_caches`` refuses it), KV cache groups other than full attention and
sliding window (``SupportsHMA`` covers those two: ``hybrid``), pipeline parallelism, P engines spread over several
hosts (the scheduler maps the workers' fence memfds), expiry notices from P to D (D's
fenced read catches a reclaimed lease instead).

The package
-----------
One module per concern: ``config`` (``KvleaseConfig``, names and addresses),
``compat`` (the KV compatibility descriptor and its comparison), ``handshake`` (P's
engine info, validated), ``metadata`` (what crosses between the halves), ``stats``
(counters, and their Prometheus metrics ``vllm:kvlease_*``), ``hybrid`` (hybrid
models' KV cache groups: windows clipped, one lease, pairs per group), ``connector``
(``KvleaseConnector``, vLLM's interface), ``scheduler``
(``KvleaseScheduler``, the scheduler half) and ``worker`` (``KvleaseWorker``, the worker
half).
"""

from __future__ import annotations

from .compat import _block_format, _kv_descriptor, _kv_incompatibility, _layer_format_diff
from .config import VLLM_VERSION, KvleaseConfig, _agent_name, _engine_of
from .connector import KvleaseConnector, KvleasePushConnector
from .handshake import EngineInfo, RemoteLayer, WorkerInfo, _engine_info
from .metadata import (
    BatchOutcome,
    BatchSpec,
    KvleaseConnectorMetadata,
    KvleaseHandshakeMetadata,
    KvleaseWorkerMetadata,
    LoadSpec,
    ReceivedNotif,
    SaveSpec,
    TransmitSpec,
)
from .scheduler import KvleaseScheduler
from .stats import KvleaseConnectorStats, KvleasePromMetrics
from .worker import KvleaseWorker

__all__ = [
    "KvleaseConnector",
    "KvleasePushConnector",
    "KvleaseConnectorMetadata",
    "KvleaseWorkerMetadata",
    "KvleaseHandshakeMetadata",
    "KvleaseConnectorStats",
    "KvleasePromMetrics",
    "KvleaseConfig",
]
