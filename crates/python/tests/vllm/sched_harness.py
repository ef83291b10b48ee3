"""Run vLLM's real v1 ``Scheduler`` on CPU, with no GPU and no model download.

The builders below (``create_vllm_config``, ``create_scheduler``, ``create_request``,
``create_model_runner_output``, ``assert_scheduler_empty``) are our own compact versions of
the helpers of the same names in vLLM's ``tests/v1/kv_connector/unit/utils.py`` (Apache-2.0,
the vLLM project), written against the vLLM release pinned in ``scripts/python-test.sh``
(0.33.0). vLLM's test files are not in its wheel and drift from each release, so we keep
ours, and they differ where our connector needs it: ``create_request`` takes the
``kv_transfer_params`` a P engine returned instead of NIXL-shaped placeholders, and
``create_model_runner_output`` can carry a finished/failed set per call.

``prepare_environment()`` must run before anything imports ``huggingface_hub`` or ``vllm``
(the package conftest calls it at import time): vLLM's ``ModelConfig`` looks the model up on
the hub, so we point ``HF_HOME`` at a directory holding fake hub cache entries for
``facebook/opt-125m`` and ``MLA_MODEL`` (tiny configs, no weights, no tokenizer) and set
``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from itertools import count
from pathlib import Path
from typing import Any

MODEL = "facebook/opt-125m"
# Any 40-hex revision works: the offline hub resolves refs/main to this snapshot.
_FAKE_REVISION = "0" * 39 + "1"
# A tiny OPT: vLLM reads the architecture, sizes and limits; nothing is ever loaded.
_FAKE_OPT_CONFIG = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "ffn_dim": 128,
    "vocab_size": 50272,
    "max_position_embeddings": 2048,
    "word_embed_proj_dim": 64,
    "do_layer_norm_before": True,
    "torch_dtype": "float16",
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
}
EOS_TOKEN_ID = 50256
# A tiny DeepSeek-V2 (MLA: one latent KV vector per token, kv_lora_rank 16 + rope 8, the
# same on every TP rank): vLLM's ModelConfig reports use_mla for it. No tokenizer either,
# and unlike OPT's, vLLM cannot make one from nothing ("Couldn't instantiate the backend
# tokenizer ... You need to have sentencepiece or tiktoken installed"), so its configs
# skip tokenizer init (``create_vllm_config``).
MLA_MODEL = "kvlease-test/tiny-deepseek-v2-mla"
_FAKE_MLA_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "q_lora_rank": None,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 2,
    "vocab_size": 50272,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "torch_dtype": "float16",
    "bos_token_id": 2,
    "eos_token_id": 2,
}
# A tiny Gemma-2: its layers alternate sliding-window (``sliding_window`` tokens) and full
# attention, so vLLM keeps the hybrid KV cache manager for it when the connector
# supports it (``SupportsHMA``). No tokenizer (``create_vllm_config`` skips it).
HYBRID_MODEL = "kvlease-test/tiny-gemma-2-hybrid"
_FAKE_HYBRID_CONFIG = {
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "sliding_window": 32,
    "query_pre_attn_scalar": 16,
    "vocab_size": 50272,
    "max_position_embeddings": 2048,
    "torch_dtype": "float16",
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
}
_FAKE_CONFIGS = {
    MODEL: _FAKE_OPT_CONFIG,
    MLA_MODEL: _FAKE_MLA_CONFIG,
    HYBRID_MODEL: _FAKE_HYBRID_CONFIG,
}


def write_fake_hf_cache(hf_home: Path, model: str = MODEL) -> None:
    """Write the offline hub cache entry for ``model`` under ``hf_home`` (idempotent)."""
    repo = hf_home / "hub" / ("models--" + model.replace("/", "--"))
    snapshot = repo / "snapshots" / _FAKE_REVISION
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(_FAKE_REVISION)
    (snapshot / "config.json").write_text(json.dumps(_FAKE_CONFIGS[model]))


def prepare_environment() -> None:
    """Offline hub with the fake model; vLLM's caches in a temporary directory.

    ``KVLEASE_TEST_HF_HOME`` names the directory to use (``scripts/python-test.sh`` sets it
    and removes it afterwards); without it we make one and remove it at exit. A user's real
    ``HF_HOME`` is never written to.
    """
    if os.environ.get("KVLEASE_TEST_ENV_READY") == "1":
        return  # a parent process (the pytest run that spawned us) did it
    given = os.environ.get("KVLEASE_TEST_HF_HOME")
    if given:
        root = Path(given)
        root.mkdir(parents=True, exist_ok=True)
    else:
        root = Path(tempfile.mkdtemp(prefix="kvlease-hf-"))
        atexit.register(shutil.rmtree, root, True)
    for model in _FAKE_CONFIGS:
        write_fake_hf_cache(root / "hf", model)
    os.environ["HF_HOME"] = str(root / "hf")
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("VLLM_CACHE_ROOT", str(root / "vllm-cache"))
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ["KVLEASE_TEST_ENV_READY"] = "1"


def create_vllm_config(
    *,
    kv_connector: str,
    kv_connector_module_path: str,
    kv_role: str,
    kv_connector_extra_config: dict[str, Any] | None = None,
    engine_id: str | None = None,
    block_size: int = 16,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 2048,
    kv_load_failure_policy: str = "recompute",
    kv_cache_layout: str = "LBNHC",
    dtype: str = "float16",
    model: str = MODEL,
    tp_size: int = 1,
    kv_buffer_device: str | None = None,
    attention_backend: str | None = "FLASH_ATTN",
):
    """A ``VllmConfig`` for the fake OPT (or ``model``: ``MLA_MODEL``) on CPU with an
    out-of-tree KV connector, for an engine of ``tp_size`` workers.

    ``attention_backend`` is what the config forces (``attention_config.backend``): the
    workers here run no model, so the connector learns from it which backend's blocks it
    registers. The harness allocates the KV caches as vLLM's logical ``[blocks, heads,
    tokens, K|V]`` views, which FlashAttention reads as they are."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.config import (
        AttentionConfig,
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = ModelConfig(
        model=model, dtype=dtype, seed=42, skip_tokenizer_init=model != MODEL
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=model_config.is_encoder_decoder,
    )
    cache_config = CacheConfig(
        block_size=block_size, gpu_memory_utilization=0.9, enable_prefix_caching=True
    )
    # The engine core resolves the layout before it builds connectors; do it for it.
    # LBNHC is what vLLM picks for FlashAttention-style backends (layer-outer, per block
    # [tokens, heads, 2*head]); block-outer layouts (BLNHC ...) interleave the layers.
    cache_config.kv_cache_layout = kv_cache_layout
    transfer = dict(
        kv_connector=kv_connector,
        kv_connector_module_path=kv_connector_module_path,
        kv_role=kv_role,
        kv_connector_extra_config=kv_connector_extra_config or {},
        kv_load_failure_policy=kv_load_failure_policy,
    )
    if engine_id is not None:
        transfer["engine_id"] = engine_id
    if kv_buffer_device is not None:
        transfer["kv_buffer_device"] = kv_buffer_device
    config = VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        kv_transfer_config=KVTransferConfig(**transfer),
        device_config=DeviceConfig("cpu"),
        attention_config=AttentionConfig(
            backend=None if attention_backend is None else AttentionBackendEnum[attention_backend]
        ),
    )
    # Set after VllmConfig's checks, which would look for tp_size devices.
    config.parallel_config.tensor_parallel_size = tp_size
    return config


def scheduler_kv_cache_config(vllm_config, num_blocks: int):
    """One full-attention group; the scheduler only counts blocks, it allocates no memory."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    spec = FullAttentionSpec(
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=1,
        head_size=1,
        dtype=torch.float32,
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )


def create_scheduler(vllm_config, num_blocks: int = 1000, kv_cache_config=None):
    """vLLM's own ``Scheduler`` (its connector built by vLLM's factory, role SCHEDULER)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    if kv_cache_config is None:
        kv_cache_config = scheduler_kv_cache_config(vllm_config, num_blocks)
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=vllm_config.cache_config.block_size,
        log_stats=True,
    )


_ids = count(1)
_none_hash_ready = False


def create_request(
    *,
    request_id: str | None = None,
    num_tokens: int = 40,
    max_tokens: int = 4,
    block_size: int = 16,
    kv_transfer_params: dict[str, Any] | None = None,
    token_base: int | None = None,
    prompt_token_ids: list[int] | None = None,
):
    """A vLLM ``Request`` with distinct prompt tokens (no accidental prefix-cache hits),
    or the given ``prompt_token_ids`` (D gets the prompt P prefilled)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    global _none_hash_ready
    if not _none_hash_ready:
        init_none_hash(sha256)
        _none_hash_ready = True
    n = next(_ids)
    if request_id is None:
        request_id = f"req-{n}"
    base = token_base if token_base is not None else 1000 * n
    sampling = SamplingParams(max_tokens=max_tokens)
    sampling.update_from_generation_config({}, EOS_TOKEN_ID)
    if prompt_token_ids is None:
        prompt_token_ids = [(base + i) % 50000 + 3 for i in range(num_tokens)]
    req = Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=sampling,
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )
    req.kv_transfer_params = kv_transfer_params
    return req


def create_model_runner_output(
    reqs,
    *,
    finished_sending: set[str] | None = None,
    finished_recving: set[str] | None = None,
    invalid_block_ids: set[int] | None = None,
    use_eos: bool = False,
    token_id: int = 0,
):
    """What a model runner would return for ``reqs`` after ``schedule()``: one sampled
    token each (none for a request still inside its prompt)."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    req_ids = [r.request_id for r in reqs]
    connector_output = None
    if finished_sending or finished_recving or invalid_block_ids:
        connector_output = KVConnectorOutput(
            finished_sending=finished_sending,
            finished_recving=finished_recving,
            invalid_block_ids=invalid_block_ids or set(),
        )
    token = EOS_TOKEN_ID if use_eos else token_id
    # A request still inside its prompt (a chunked prefill) samples nothing this step; the
    # scheduler has already counted this step's tokens as computed.
    sampled = [
        [token] if r.num_computed_tokens >= r.num_prompt_tokens else [] for r in reqs
    ]
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=connector_output,
    )


def assert_scheduler_empty(scheduler) -> None:
    """No request, queue entry or block is left behind (every block back in the pool)."""
    assert not scheduler.requests
    assert not scheduler.waiting
    assert not scheduler.running
    assert not scheduler.finished_req_ids
    assert not scheduler.finished_recving_kv_req_ids
    assert not scheduler._inflight_prefills
    manager = scheduler.kv_cache_manager
    single = manager.coordinator.single_type_managers[0]
    assert not single.req_to_blocks
    assert not single.num_cached_block
    pool = manager.block_pool
    # Block 0 is vLLM's null block, never free.
    assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1
    assert all(block.ref_cnt == 0 for block in pool.blocks)


def step(scheduler, output_for=None, **runner_kwargs):
    """One engine step: schedule, then feed back a model-runner output.

    ``output_for`` picks the requests that get a sampled token (default: every scheduled
    one). Returns the ``SchedulerOutput`` (its ``kv_connector_metadata`` is what the
    workers would get this step) and the engine-core outputs.
    """
    sched_out = scheduler.schedule()
    if output_for is None:
        output_for = [scheduler.requests[rid] for rid in sched_out.num_scheduled_tokens]
    runner_out = create_model_runner_output(output_for, **runner_kwargs)
    engine_out = scheduler.update_from_output(sched_out, runner_out)
    return sched_out, engine_out
