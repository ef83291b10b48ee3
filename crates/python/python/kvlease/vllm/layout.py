"""What a KV cache block's bytes mean, and the byte runs that copy part of P's block into
D's: pure functions of shapes, strides and the attention backend (no transport, no vLLM
state), tested on their own (``tests/test_layout.py``).

vLLM hands a connector each layer's KV cache as a ``[blocks, heads, tokens, content]``
view, but the view's shape does not always say where a token's K and V are: the CPU
attention backend's kernels store each head's K and V in an order of their own, which
depends on the instruction set they run on (``vec``: K with the head's elements outer
and the tokens inner, then V token by token; ``amx``: packed in tiles), so a row of the
handed-out view is not one token's K and V. Copying runs of tokens between blocks of
different sizes, or heads between engines of different TP sizes, needs the real meaning.
So each layer is described by its **format** ``[dtype, shape, order, axes, backend]``
(``layer_format``): the shape and physical dim order of the block in its semantic view,
one letter per dim naming what it holds (``axes``), and the attention backend (with the
CPU backend's instruction set: ``CPU_ATTN:vec``). The letters:

``H``
    KV heads (split over TP ranks).
``N``
    tokens of the block (``block_size`` of them).
``C``
    one token-head's content: its K then its V (or MLA's latent vector).
``X``
    a head's K and V for every token of the block, in an order only the backend's kernel
    knows (whole or not at all).

Engines read each other's blocks only with the same backend (NixlConnector's
compatibility hash names the backend too). A block is cut by heads (different TP sizes)
only along an ``H`` dim and by tokens (different block sizes) only along an ``N`` dim;
``axes`` is ``None`` when kvlease does not know what the backend's bytes mean (a backend
not in ``BACKEND_AXES``, or a KV cache dtype that is not one value per element): such a
block is only ever copied whole, between engines of the same format, block size and TP
size.
"""

from __future__ import annotations

from itertools import product
from math import prod
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, KvleaseError

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

#: What each dim of a layer's block holds, per attention backend, as their sources say
#: (vLLM 0.32 and 0.33):
#:
#: - ``HNC``: FlashAttention, Triton and FlashInfer take vLLM's logical view as it is:
#:   they split one token-head's content into K and V (``kv_cache.transpose(1, 2)
#:   .split(head_size, dim=-1)``) and their cache-write kernels address the view's
#:   strides (``reshape_and_cache_flash``: block, token, head).
#: - ``HX``: the CPU backend writes each head's part of a block (``block * block_stride
#:   + head * head_stride``) in an order that depends on its kernel's instruction set
#:   (``csrc/cpu/cpu_attn_*.hpp``); only the heads are where the view says.
BACKEND_AXES = {
    "FLASH_ATTN": "HNC",
    "TRITON_ATTN": "HNC",
    "FLASHINFER": "HNC",
    "CPU_ATTN": "HX",
}

#: KV cache dtypes that store one value per element in the blocks themselves (``auto``:
#: the model's dtype). Others (packed 4-bit, per-token-head scales kept beside the
#: cache, ...) have no known axes.
PLAIN_CACHE_DTYPES = ("auto", "float16", "bfloat16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")

#: KV cache dtypes whose scales live outside the KV cache blocks: the connector moves
#: blocks only, so D would dequantize P's values with its own scales. Refused at start.
SIDE_SCALE_CACHE_DTYPES = ("int4_per_token_head", "int8_per_token_head", "fp8_per_token_head")


def block_axes(backend: str | None, cache_dtype: str) -> str | None:
    """The axes (module docstring) of a block of ``backend`` (``CPU_ATTN:vec`` is the
    CPU backend) with KV cache dtype ``cache_dtype``, or ``None`` when not known."""
    if backend is None or str(cache_dtype) not in PLAIN_CACHE_DTYPES:
        return None
    return BACKEND_AXES.get(str(backend).partition(":")[0])


def layer_backends(vllm_config: "VllmConfig", names: list[str]) -> dict[str, str | None]:
    """Layer name -> the name of the attention backend that reads its KV cache
    (``FLASH_ATTN``; the CPU backend with its kernel's instruction set, ``CPU_ATTN:vec``,
    ``None`` when that is not known), from the model's attention layers; where vLLM has
    no layer of that name (a worker without a model), the backend ``attention_config``
    forces, else ``None``."""
    found: dict[str, str | None] = {}
    try:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, names)
    except Exception:  # vLLM without these helpers, or no forward context
        layers = {}
    for name, layer in (layers or {}).items():
        try:
            backend: str | None = str(layer.get_attn_backend().get_name())
        except Exception:
            backend = None
        if backend == "CPU_ATTN":
            # Set on every layer by the backend's metadata builder before the KV caches
            # are allocated (``_set_isa_to_layers``): the kernel that lays blocks out.
            isa = getattr(layer, "isa", None)
            backend = None if not isa else f"CPU_ATTN:{isa}"
        found[name] = backend
    forced = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    forced_name = None if forced is None else str(getattr(forced, "name", forced))
    return {name: found.get(name, forced_name) for name in names}


def semantic_view(t: "torch.Tensor", axes: str | None) -> "torch.Tensor":
    """``t`` (one layer's ``[blocks, ...]`` KV cache) viewed with its block dims as
    ``axes`` names them: ``HX`` is ``[blocks, heads, everything else]``; ``HNC`` or
    ``None`` is ``t`` itself."""
    if axes != "HX":
        return t
    try:
        return t.view(int(t.shape[0]), int(t.shape[1]), -1)
    except RuntimeError as e:
        raise ConfigError(
            f"a KV cache of shape {tuple(t.shape)}, stride {tuple(t.stride())}: its "
            f"heads' parts of a block are not dense ({e})"
        ) from None


def _block_format(t: "torch.Tensor") -> list[Any]:
    """``[dtype, block shape, physical order]`` of one layer's KV cache view (no
    meaning attached: ``layer_format`` adds it): the order lists the block's dims
    (1-based, size-1 dims left out: they do not move bytes) from the largest stride to
    the smallest. Two views whose formats are equal store a block's elements at the same
    byte offsets."""
    dims = [(i, int(t.shape[i]), int(t.stride(i))) for i in range(1, t.dim())]
    order = [i for i, size, stride in sorted(dims, key=lambda d: (-d[2], d[0])) if size != 1]
    return [str(t.dtype).removeprefix("torch."), [size for _, size, _ in dims], order]


def layer_format(t: "torch.Tensor", backend: str | None, cache_dtype: str) -> list[Any]:
    """``[dtype, shape, order, axes, backend]`` of one layer's KV cache (module
    docstring): ``_block_format`` of its semantic view, what the dims hold, and the
    backend."""
    axes = block_axes(backend, cache_dtype)
    if (axes == "HNC" and t.dim() != 4) or (axes == "HX" and t.dim() < 3):
        # Not the view this backend hands out: what its bytes mean is not known.
        axes = None
    view = semantic_view(t, axes)
    return [*_block_format(view), axes, backend]


def format_parts(fmt: list[Any]) -> tuple[str, list[int], list[int], str | None, str | None]:
    """``(dtype, shape, order, axes, backend)`` of a format; an older kvlease's
    ``[dtype, shape, order]`` has neither axes nor backend."""
    dtype, shape, order = fmt[0], [int(x) for x in fmt[1]], [int(x) for x in fmt[2]]
    axes = fmt[3] if len(fmt) > 3 else None
    backend = fmt[4] if len(fmt) > 4 else None
    return str(dtype), shape, order, axes, backend


def layer_layout(name: str, t: "torch.Tensor") -> tuple[int, int, int, int]:
    """``(byte offset in its storage, block stride, block bytes, num blocks)`` of one
    layer's KV cache: dim 0 counts blocks, and each block's bytes must be dense."""
    if t.dim() < 2:
        raise ConfigError(f"KV cache {name}: expected a blocks dimension and more")
    elem = t.element_size()
    sizes, strides = list(t.shape[1:]), list(t.stride()[1:])
    page = prod(sizes) * elem
    expected = 1
    for size, stride in sorted(zip(sizes, strides), key=lambda p: p[1]):
        if size != 1 and stride != expected:
            raise ConfigError(
                f"KV cache {name}: a block's bytes are not dense (shape {tuple(t.shape)}, "
                f"stride {tuple(t.stride())})"
            )
        expected *= size
    block_stride = t.stride(0) * elem
    if t.shape[0] > 1 and block_stride < page:
        raise ConfigError(f"KV cache {name}: blocks overlap (stride {block_stride} < {page})")
    storage = t.untyped_storage()
    offset = t.data_ptr() - storage.data_ptr()
    return offset, block_stride, page, int(t.shape[0])


def _block_strides(shape: list[int], page: int, order: list[int]) -> list[int]:
    """Byte strides of a dense block's dims (``shape``; ``page``: its bytes) laid out
    in ``order`` (1-based dims, outermost first, every dim listed)."""
    count = prod(shape)
    if count <= 0 or page % count:
        raise KvleaseError(f"a block of {page} bytes cannot hold a {shape} block")
    strides, acc = [0] * len(shape), page // count
    for dim in reversed(order):
        strides[dim - 1] = acc
        acc *= shape[dim - 1]
    return strides


def selection(
    fmt: list[Any], *, heads: tuple[int, int] | None = None, tokens: tuple[int, int] | None = None
) -> list[tuple[int, int]]:
    """One ``(start, end)`` per block dim of ``fmt``: ``heads`` on its ``H`` dim,
    ``tokens`` on its ``N`` dim, every other dim whole. A block whose axes are not known
    is selected whole whatever ``heads`` says (the compatibility check let it through
    only between engines of the same TP size, so the heads are all of them) and cannot
    be cut by tokens."""
    _, shape, _, axes, _ = format_parts(fmt)
    sel = [(0, size) for size in shape]
    if axes is None:
        if tokens is not None:
            raise KvleaseError("a block whose axes are not known cannot be cut by tokens")
        return sel
    for letter, rng in (("H", heads), ("N", tokens)):
        if rng is None:
            continue
        if letter not in axes:
            raise KvleaseError(f"a block with axes {axes!r} has no {letter} dim to cut")
        sel[axes.index(letter)] = (int(rng[0]), int(rng[1]))
    return sel


def sub_block_runs(
    local: tuple[list[Any], int],
    remote: tuple[list[Any], int],
    local_sel: list[tuple[int, int]],
    remote_sel: list[tuple[int, int]],
) -> list[tuple[int, int, int]]:
    """The byte runs ``(offset in D's block, offset in P's block, length)`` that copy the
    part ``remote_sel`` of P's block into the part ``local_sel`` of D's: one ``(start,
    end)`` per block dim (``selection``), of equal lengths on both sides. Each side is
    ``(format, block bytes)``, dense, its dims in the same order on both sides (the
    compatibility check made sure); the sizes may differ (heads with TP sizes, tokens
    with block sizes). The innermost dims selected whole on both sides, and the next one
    out, make one run; adjacent runs are merged, so a whole block is one run."""
    (d_fmt, d_page), (p_fmt, p_page) = local, remote
    _, d_shape, d_order, _, _ = format_parts(d_fmt)
    _, p_shape, p_order, _, _ = format_parts(p_fmt)
    n = len(d_shape)
    if len(p_shape) != n or len(local_sel) != n or len(remote_sel) != n or not n:
        raise KvleaseError(f"P's {p_shape} block and D's {d_shape} differ in their dims")
    for (a0, a1), (b0, b1), ds, ps in zip(local_sel, remote_sel, d_shape, p_shape):
        if not (0 <= a0 < a1 <= ds and 0 <= b0 < b1 <= ps and a1 - a0 == b1 - b0):
            raise KvleaseError(
                f"{b0}..{b1} of P's {ps} cannot fill {a0}..{a1} of D's {ds} (block "
                f"P {p_shape}, D {d_shape})"
            )
    # One order for both sides: a dim of size 1 is left out of a format's order, so take
    # the side that lists more dims and put any dim neither lists last (size 1 on both).
    order = max(d_order, p_order, key=len)
    order += [d for d in range(1, n + 1) if d not in order]
    d_strides = _block_strides(d_shape, d_page, order)
    p_strides = _block_strides(p_shape, p_page, order)
    if d_page // prod(d_shape) != p_page // prod(p_shape):
        raise KvleaseError("an element holds a different number of bytes on P and D")
    length, k = d_page // prod(d_shape), n
    while k > 0:
        dim = order[k - 1] - 1
        (a0, a1), (b0, b1) = local_sel[dim], remote_sel[dim]
        length *= a1 - a0
        k -= 1
        if not a1 - a0 == d_shape[dim] == p_shape[dim]:
            break
    outer = order[:k]
    lo0 = sum(a * s for (a, _), s in zip(local_sel, d_strides))
    ro0 = sum(b * s for (b, _), s in zip(remote_sel, p_strides))
    runs: list[tuple[int, int, int]] = []
    counts = (local_sel[d - 1][1] - local_sel[d - 1][0] for d in outer)
    for index in product(*(range(c) for c in counts)):
        lo = lo0 + sum(i * d_strides[d - 1] for i, d in zip(index, outer))
        ro = ro0 + sum(i * p_strides[d - 1] for i, d in zip(index, outer))
        if runs and runs[-1][0] + runs[-1][2] == lo and runs[-1][1] + runs[-1][2] == ro:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + length)
        else:
            runs.append((lo, ro, length))
    return runs


def token_segments(
    local_blocks: list[int],
    remote_blocks: list[int],
    block_sizes: tuple[int, int],
    first_token: int,
    num_tokens: int,
) -> list[tuple[int, int, int, int, int]]:
    """``(D block, its first token, P block, its first token, tokens)`` for each run of
    tokens that stays within one block on both sides, when D's blocks hold
    ``block_sizes[0]`` tokens and P's ``block_sizes[1]``: D's ``local_blocks`` hold the
    request's tokens from ``first_token`` (a multiple of D's block size), P's
    ``remote_blocks`` from the start of the P block holding ``first_token``; tokens up
    to ``num_tokens`` are read."""
    d_bs, p_bs = block_sizes
    if d_bs <= 0 or p_bs <= 0 or first_token % d_bs:
        raise KvleaseError(f"cannot map block sizes P {p_bs}, D {d_bs} from token {first_token}")
    p_first = first_token // p_bs
    end = min(num_tokens, first_token + len(local_blocks) * d_bs)
    segments = []
    t = first_token
    while t < end:
        li, lt = divmod(t - first_token, d_bs)
        pi, pt = divmod(t, p_bs)
        pi -= p_first
        if pi >= len(remote_blocks):
            raise KvleaseError(f"token {t} is past P's {len(remote_blocks)} blocks")
        count = min(d_bs - lt, p_bs - pt, end - t)
        segments.append((int(local_blocks[li]), lt, int(remote_blocks[pi]), pt, count))
        t += count
    return segments
