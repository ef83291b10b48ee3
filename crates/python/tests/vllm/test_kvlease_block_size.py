"""P's block size ≠ D's (vLLM's ``block_size_ratio`` in NixlConnector): D reads P's
blocks as runs of tokens, straight into its own blocks. In vLLM 0.33.0's real
``Scheduler`` on CPU (the plan D's workers get) and one level down (the byte runs the
worker posts, applied to real ``[B, H, N, C]`` tensors). A KV layout that differs
(NixlConnector's ``enable_permute_local_kv``) stays refused at the handshake, naming
both sides' layouts. tests/worker/test_block_size.py moves the bytes between processes.
"""

from __future__ import annotations

import pytest
from test_kvlease_scheduler import (
    complete_every_batch,
    engines,  # noqa: F401 (a fixture)
    prefill_on_p,
    wait_for_handshake,
)
from sched_harness import create_request, step

from kvlease.vllm import _kv_incompatibility


def _views(layout: str, num_blocks: int, heads: int, block_size: int, seed: int):
    """A layer's KV cache ``[B, H, N, C]`` (vLLM's per-layer view) stored tokens-outer
    (NHC, vLLM's LBNHC) or heads-outer (HNC), random."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if layout == "NHC":
        data = torch.randn(num_blocks, block_size, heads, 8, generator=g).to(torch.float16)
        return data.permute(0, 2, 1, 3)
    return torch.randn(num_blocks, heads, block_size, 8, generator=g).to(torch.float16)


def _read(d, p, local_blocks, remote_blocks, first_token, num_tokens, local_heads,
          remote_heads):
    """What D's worker posts for one layer (``layout.token_segments``,
    ``layout.sub_block_runs``), applied to the tensors' bytes: D's tensor after the
    read. The views are FlashAttention's (``HNC``)."""
    import torch

    from kvlease.vllm.layout import layer_format, selection, sub_block_runs, token_segments

    d_buf, p_buf = bytearray(d.untyped_storage()), bytes(p.untyped_storage())
    d_fmt, p_fmt = layer_format(d, "FLASH_ATTN", "auto"), layer_format(p, "FLASH_ATTN", "auto")
    d_page, p_page = d[0].numel() * 2, p[0].numel() * 2
    segments = token_segments(local_blocks, remote_blocks, (d.shape[2], p.shape[2]),
                              first_token, num_tokens)
    for lb, lt, rb, rt, n in segments:
        runs = sub_block_runs((d_fmt, d_page), (p_fmt, p_page),
                              selection(d_fmt, heads=local_heads, tokens=(lt, lt + n)),
                              selection(p_fmt, heads=remote_heads, tokens=(rt, rt + n)))
        for lo, ro, length in runs:
            dl, pl = lb * d.stride(0) * 2 + lo, rb * p.stride(0) * 2 + ro
            d_buf[dl:dl + length] = p_buf[pl:pl + length]
    flat = torch.frombuffer(d_buf, dtype=torch.float16)
    return flat.as_strided(d.shape, d.stride()), segments


def _token(t, blocks, block_size, first_token=0):
    """(block, offset) of the request's token ``t`` in blocks holding it from
    ``first_token``."""
    i, off = divmod(t - first_token, block_size)
    return blocks[i], off


@pytest.mark.parametrize("layout", ["NHC", "HNC"])
@pytest.mark.parametrize("p_bs,d_bs", [(16, 32), (32, 16), (16, 48)])
def test_token_runs_land_each_token_and_head_where_d_keeps_it(layout, p_bs, d_bs):
    """A 70-token prompt: P's blocks (scattered) hold it in blocks of ``p_bs`` tokens,
    D's in blocks of ``d_bs``. Every token's every head reaches D's block and offset for
    it, nothing past the prompt is written, and a tokens-outer block reads one run per
    run of tokens (a heads-outer one, one per head)."""
    num_tokens, heads = 70, 4
    p = _views(layout, 8, heads, p_bs, seed=1)
    d = _views(layout, 8, heads, d_bs, seed=2).zero_()
    p_blocks = [6, 1, 4, 7, 2][: -(-num_tokens // p_bs)]
    d_blocks = [3, 5, 0, 7, 1][: -(-num_tokens // d_bs)]
    got, segments = _read(d, p, d_blocks, p_blocks, 0, num_tokens, (0, 4), (0, 4))
    assert sum(n for *_, n in segments) == num_tokens
    for t in range(num_tokens):
        pb, po = _token(t, p_blocks, p_bs)
        db, do = _token(t, d_blocks, d_bs)
        assert torch_equal(got[db, :, do], p[pb, :, po]), f"token {t}"
    # Nothing past the prompt: D's last block's tail and D's other blocks stay zero.
    assert not got[d_blocks[-1], :, (num_tokens - 1) % d_bs + 1:].any()
    others = [b for b in range(8) if b not in d_blocks]
    assert not got[others].any()


@pytest.mark.parametrize("layout", ["NHC", "HNC"])
def test_token_runs_with_heads_split_and_a_prefix_skipped(layout):
    """Heterogeneous TP and block sizes together: D (TP 1, 4 heads, blocks of 32) reads
    heads 2-3 from a P rank holding 2 heads in blocks of 16; D's first block was a local
    prefix hit, so the read starts at token 32, in the middle of P's block list."""
    num_tokens = 80
    p = _views(layout, 8, 2, 16, seed=3)
    d = _views(layout, 8, 4, 32, seed=4).zero_()
    p_blocks = [5, 0, 3, 6, 1]  # tokens 0..80 in blocks of 16
    d_blocks = [2, 4]  # tokens 32..80 in blocks of 32 (block 0's tokens were a hit)
    got, _ = _read(d, p, d_blocks, p_blocks[2:], 32, num_tokens, (2, 4), (0, 2))
    for t in range(32, num_tokens):
        pb, po = _token(t, p_blocks, 16)
        db, do = _token(t, d_blocks, 32, first_token=32)
        assert torch_equal(got[db, 2:, do], p[pb, :, po]), f"token {t}"
        assert not got[db, :2, do].any()


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_block_sizes_alone_are_compatible_a_layout_is_refused_naming_both():
    """The handshake's check: P ≠ D block sizes pass when the layers differ only in
    tokens per block; another difference is still named, block size beside it; a
    different layout is refused naming both layouts and the permutation it would need."""
    base = {
        "model": "m", "dtype": "torch.float16", "cache_dtype": "auto", "num_kv_heads": 4,
        "head_size": 16, "num_layers": 1, "block_size": 32, "block_order": "NHC",
        "kv_cache_layout": "LBNHC", "use_mla": False,
        "layers": {"l0": ["float16", [4, 32, 32], [2, 1, 3], "HNC", "FLASH_ATTN"]},
    }
    p16 = dict(base, block_size=16, layers={"l0": ["float16", [4, 16, 32], [2, 1, 3], "HNC", "FLASH_ATTN"]})
    assert _kv_incompatibility(base, p16) is None
    assert _kv_incompatibility(p16, base) is None
    # With heterogeneous TP too: heads and tokens per block both differ.
    p16_tp2 = dict(p16, layers={"l0": ["float16", [2, 16, 32], [2, 1, 3], "HNC", "FLASH_ATTN"]})
    assert _kv_incompatibility(base, p16_tp2, d_tp=1, p_tp=2) is None
    # The layers must differ in tokens by the block sizes, nothing else.
    bad = dict(p16, layers={"l0": ["float16", [4, 8, 32], [2, 1, 3], "HNC", "FLASH_ATTN"]})
    why = _kv_incompatibility(base, bad)
    assert "block size: P 16, D 32" in why, why
    why = _kv_incompatibility(base, dict(p16, head_size=8))
    assert "block_size: P 16, D 32" in why and "head_size" in why, why
    # A layout permutation (enable_permute_local_kv) is refused, naming both sides.
    hnc = dict(p16, block_order="HNC", kv_cache_layout="LBHNC",
               layers={"l0": ["float16", [4, 16, 32], [1, 2, 3], "HNC", "FLASH_ATTN"]})
    why = _kv_incompatibility(base, hnc)
    assert "LBHNC" in why and "LBNHC" in why and "enable_permute_local_kv" in why, why
    # Known only from the workers' layer formats: still refused.
    why = _kv_incompatibility(base, dict(hnc, block_order=None, kv_cache_layout=None))
    assert why is not None and "[1, 2, 3]" in why and "[2, 1, 3]" in why, why


def prefill(p, block_size: int, num_tokens: int = 40):
    """``prefill_on_p`` for a P whose blocks hold ``block_size`` tokens."""
    return prefill_on_p(p, num_tokens, block_size)


@pytest.mark.parametrize("p_bs,d_bs", [(16, 32), (32, 16)])
def test_d_plans_a_load_from_a_p_of_another_block_size(engines, p_bs, d_bs):  # noqa: F811
    """In vLLM's real schedulers: P (blocks of ``p_bs``) prefills 40 tokens and grants
    its blocks; D (blocks of ``d_bs``) admits the request although P's block count is
    not its own, allocates its own blocks, and plans a load that names both block sizes
    and every one of P's blocks, fenced on P's last; P's lease frees at the read's
    completion and vLLM runs the request from the loaded KV."""
    p, _ = engines("kv_producer", "p0", block_size=p_bs)
    d, _ = engines("kv_consumer", "d0", block_size=d_bs)
    p_req, params = prefill(p, p_bs)
    p_blocks = list(params["remote_block_ids"])
    assert len(p_blocks) == -(-40 // p_bs)
    req = create_request(prompt_token_ids=p_req.prompt_token_ids, max_tokens=3,
                         block_size=d_bs, kv_transfer_params=dict(params))
    d.add_request(req)
    metas = wait_for_handshake(d, req)
    assert d.connector.scheduler.incompatibility("p0") is None
    (load,) = [load for meta in metas for load in meta.loads]
    assert (load.block_size, load.remote_block_size) == (d_bs, p_bs)
    assert (load.first_token, load.num_tokens) == (0, 40)
    assert load.remote_blocks == p_blocks and load.fence_block == p_blocks[-1]
    assert len(load.local_blocks) == -(-40 // d_bs)
    complete_every_batch(p, d, p_req, req, load)
    assert not d.connector.scheduler._p_blocks


def test_a_layout_mismatch_is_refused_at_the_handshake_naming_both_layouts(engines):  # noqa: F811
    """P LBHNC, D LBNHC (and block sizes that differ too): D's handshake check names
    both layouts; nothing is read and vLLM computes the prompt on D."""
    p, _ = engines("kv_producer", "p0", block_size=16, kv_cache_layout="LBHNC")
    d, _ = engines("kv_consumer", "d0", block_size=32, kv_cache_layout="LBNHC")
    p_req, params = prefill(p, 16)
    req = create_request(prompt_token_ids=p_req.prompt_token_ids, max_tokens=3,
                         block_size=32, kv_transfer_params=dict(params))
    d.add_request(req)
    import time

    deadline = time.monotonic() + 30
    while req.request_id not in (sched_out := step(d)[0]).num_scheduled_tokens:
        assert not sched_out.kv_connector_metadata.loads
        assert time.monotonic() < deadline, "D never scheduled the request"
        time.sleep(0.01)
    why = d.connector.scheduler.incompatibility("p0")
    assert why is not None and "LBHNC" in why and "LBNHC" in why, why
    assert "enable_permute_local_kv" in why, why
    assert sched_out.num_scheduled_tokens[req.request_id] == len(req.prompt_token_ids)
