"""The connector's layout math on its own (``kvlease.vllm.layout``) and the comparison of
block formats it feeds (``compat._layer_format_diff``): what a block's dims hold per
attention backend, which P/D pairs D may read from and how, and the byte runs of a cut.
Real-model checks of the same rules are in ``tests/serve/test_layouts.py``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvlease.vllm.compat import _layer_format_diff  # noqa: E402
from kvlease.vllm.layout import (  # noqa: E402
    block_axes,
    layer_format,
    selection,
    sub_block_runs,
    token_segments,
)


def cpu_cache(blocks: int, heads: int, tokens: int, head_size: int) -> "torch.Tensor":
    """The CPU backend's per-layer cache as vLLM hands it out: ``[blocks, heads,
    tokens, 2*head_size]``, dense."""
    return torch.zeros(blocks, heads, tokens, 2 * head_size, dtype=torch.float32)


def test_axes_by_backend_and_cache_dtype():
    assert block_axes("FLASH_ATTN", "auto") == "HNC"
    assert block_axes("TRITON_ATTN", "fp8") == "HNC"
    assert block_axes("CPU_ATTN:vec", "auto") == "HX"
    assert block_axes("CPU_ATTN:amx", "auto") == "HX"
    # Not known: another backend, a packed or side-scaled KV cache dtype, no backend.
    assert block_axes("ROCM_AITER_FA", "auto") is None
    assert block_axes("FLASHINFER", "nvfp4") is None
    assert block_axes("TRITON_ATTN", "int8_per_token_head") is None
    assert block_axes(None, "auto") is None


def test_a_cpu_block_is_its_heads_and_an_order_only_the_kernel_knows():
    t = cpu_cache(8, 2, 32, 64)
    assert layer_format(t, "CPU_ATTN:vec", "auto") == [
        "float32", [2, 32 * 128], [1, 2], "HX", "CPU_ATTN:vec"]
    # FlashAttention's view of the same shape: heads, tokens, a token-head's K|V.
    assert layer_format(t, "FLASH_ATTN", "auto") == [
        "float32", [2, 32, 128], [1, 2, 3], "HNC", "FLASH_ATTN"]
    # A view the backend does not hand out: not known what it holds.
    flat = torch.zeros(8, 4096)
    assert layer_format(flat, "FLASH_ATTN", "auto")[3] is None


def fmts(t, backend):
    return {"l0": layer_format(t, backend, "auto")}


def test_cpu_blocks_of_other_sizes_are_refused_naming_why():
    """The CPU kernels' blocks cannot be cut by tokens: P 32 → D 64 and back are
    refused, naming the backend and its axes; the same sizes read whole."""
    d64, p32 = fmts(cpu_cache(4, 2, 64, 64), "CPU_ATTN:vec"), fmts(cpu_cache(4, 2, 32, 64), "CPU_ATTN:vec")
    why = _layer_format_diff(d64, p32, tokens=(64, 32))
    assert why is not None and "CPU_ATTN:vec" in why and "tokens" in why, why
    assert _layer_format_diff(p32, d64, tokens=(32, 64)) is not None
    assert _layer_format_diff(p32, p32) is None
    assert _layer_format_diff(p32, d64) is not None  # sizes differ, none declared


def test_cpu_blocks_may_differ_in_heads_by_the_tp_ratio():
    d_tp1, p_tp2 = fmts(cpu_cache(4, 2, 32, 64), "CPU_ATTN:vec"), fmts(cpu_cache(4, 1, 32, 64), "CPU_ATTN:vec")
    assert _layer_format_diff(d_tp1, p_tp2, heads=(2, 1)) is None
    assert _layer_format_diff(p_tp2, d_tp1, heads=(1, 2)) is None
    assert _layer_format_diff(d_tp1, p_tp2, heads=(2, 2)) is not None


def test_backends_must_match_even_where_the_shapes_do():
    t = cpu_cache(4, 2, 32, 64)
    vec, amx = fmts(t, "CPU_ATTN:vec"), fmts(t, "CPU_ATTN:amx")
    why = _layer_format_diff(vec, amx)
    assert "backends differ" in why and "CPU_ATTN:amx" in why, why
    # An engine whose backend is not known (no model layers, nothing forced) reads none.
    unknown = {"l0": layer_format(t, None, "auto")}
    assert "not known" in _layer_format_diff(unknown, vec)
    assert "not known" in _layer_format_diff(vec, unknown)
    # An older kvlease's three-part format says nothing of its backend.
    old = {"l0": layer_format(t, "CPU_ATTN:vec", "auto")[:3]}
    assert "older kvlease" in _layer_format_diff(vec, old)


def test_a_backend_kvlease_does_not_know_is_read_only_whole_from_its_twin():
    t = torch.zeros(4, 2, 32, 128)
    mine, same = fmts(t, "ROCM_AITER_FA"), fmts(t, "ROCM_AITER_FA")
    assert _layer_format_diff(mine, same) is None
    half = fmts(torch.zeros(4, 2, 16, 128), "ROCM_AITER_FA")
    why = _layer_format_diff(mine, half, tokens=(32, 16))
    assert "ROCM_AITER_FA" in why and "does not" in why, why
    assert _layer_format_diff(mine, fmts(torch.zeros(4, 1, 32, 128), "ROCM_AITER_FA"),
                              heads=(2, 1)) is not None
    # Selected whole whatever the plan's heads say; never cut by tokens.
    fmt = mine["l0"]
    assert selection(fmt, heads=(0, 2)) == [(0, 2), (0, 32), (0, 128)]
    with pytest.raises(Exception, match="tokens"):
        selection(fmt, tokens=(0, 8))


def test_cpu_heads_cut_is_one_run_per_contiguous_head_range():
    """P TP 2 → D TP 1 on CPU: P rank 1's head lands in D's head 1, one run a block;
    the bytes are the whole head (its K and V, every token, in the kernel's order)."""
    d = cpu_cache(3, 2, 32, 64)
    p = torch.arange(3 * 1 * 32 * 128, dtype=torch.float32).view(3, 1, 32, 128)
    d_fmt, p_fmt = layer_format(d, "CPU_ATTN:vec", "auto"), layer_format(p, "CPU_ATTN:vec", "auto")
    d_page, p_page = d[0].numel() * 4, p[0].numel() * 4
    runs = sub_block_runs((d_fmt, d_page), (p_fmt, p_page),
                          selection(d_fmt, heads=(1, 2)), selection(p_fmt, heads=(0, 1)))
    assert runs == [(p_page, 0, p_page)]
    buf, src = bytearray(d.untyped_storage()), bytes(p.untyped_storage())
    for b in range(3):
        for lo, ro, n in runs:
            buf[b * d_page + lo:b * d_page + lo + n] = src[b * p_page + ro:b * p_page + ro + n]
    got = torch.frombuffer(buf, dtype=torch.float32).view(d.shape)
    assert torch.equal(got[:, 1:], p) and not got[:, :1].any()


def test_token_segments_cover_the_prompt_once():
    segs = token_segments([3, 5], [6, 1, 4, 7], (32, 16), 0, 60)
    assert segs == [(3, 0, 6, 0, 16), (3, 16, 1, 0, 16), (5, 0, 4, 0, 16), (5, 16, 7, 0, 12)]
    assert sum(s[-1] for s in segs) == 60
