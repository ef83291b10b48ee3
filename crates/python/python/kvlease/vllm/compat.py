"""KV compatibility: what makes a KV block's bytes mean the same on P and D
(``_kv_descriptor``, ``_block_format``) and how two engines' descriptors differ
(``_kv_incompatibility``, ``_layer_format_diff``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

#: The descriptor keys P and D must agree on for P's block bytes to mean the same KV on
#: D (compared by ``_kv_incompatibility``; ``kv_cache_layout`` is carried for the logs:
#: a layer-outer and a block-outer layout with the same order inside a block are
#: compatible, ``block_order`` says that order).
_KV_KEYS = (
    "model",
    "dtype",
    "cache_dtype",
    "num_kv_heads",
    "head_size",
    "num_layers",
    "block_size",
    "block_order",
    "use_mla",
)


def _kv_descriptor(vllm_config: "VllmConfig") -> dict[str, Any]:
    """What makes a KV block's bytes mean the same on two engines, from the config
    (like NixlConnector's ``compute_nixl_compatibility_hash``, plus what NIXL checks at
    its handshake: block size and layout). Plain JSON values."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    try:
        layout: str | None = cache.get_resolved_kv_cache_layout().name
    except (ValueError, KeyError, AttributeError):
        layout = None  # not resolved here: the workers' block formats still decide
    return {
        "model": str(model.model),
        "dtype": str(model.dtype),
        "cache_dtype": str(cache.cache_dtype),
        "num_kv_heads": int(model.get_total_num_kv_heads()),
        "head_size": int(model.get_head_size()),
        "num_layers": int(model.get_total_num_hidden_layers()),
        "block_size": int(cache.block_size),
        "kv_cache_layout": layout,
        # The order of heads (H), tokens (N) and K|V content (C) inside one layer's
        # block: the layout's name without its layer (L) and block (B) axes.
        "block_order": None if layout is None else layout.replace("L", "").replace("B", ""),
        "use_mla": bool(getattr(model, "use_mla", False)),
        "layers": {},
    }


def _block_format(t: "torch.Tensor") -> list[Any]:
    """``[dtype, logical block shape, physical order]`` of one layer's KV cache view:
    the order lists the block's logical dims (1-based, size-1 dims left out: they do not
    move bytes) from the largest stride to the smallest. Two layers whose formats are
    equal store a block's elements at the same byte offsets."""
    dims = [(i, int(t.shape[i]), int(t.stride(i))) for i in range(1, t.dim())]
    order = [i for i, size, stride in sorted(dims, key=lambda d: (-d[2], d[0])) if size != 1]
    return [str(t.dtype).removeprefix("torch."), [size for _, size, _ in dims], order]


def _rank_heads(kv: dict[str, Any], tp: int) -> int | None:
    """KV heads one of an engine's ``tp`` workers holds, as vLLM splits the descriptor
    ``kv``'s model: MLA's latent cache is one "head" on every rank; otherwise
    ``num_kv_heads / tp``. ``None`` when ``tp`` does not split the heads (vLLM then
    replicates heads over ranks, which the plan's head ranges do not describe)."""
    if kv.get("use_mla"):
        return 1
    total = kv.get("num_kv_heads")
    if type(total) is not int or total <= 0 or tp <= 0 or total % tp:
        return None
    return total // tp


def _kv_incompatibility(
    ours: dict[str, Any], theirs: Any, *, d_tp: int = 1, p_tp: int = 1
) -> str | None:
    """Why P's KV (descriptor ``theirs``, from its handshake, over ``p_tp`` workers)
    cannot be loaded as ours (over ``d_tp``), or ``None`` when it can. ``layers`` (layer
    name -> ``_block_format``) is compared when both sides know their workers' formats;
    with different TP sizes a block's head count differs by the ratio, nothing else."""
    if not isinstance(theirs, dict):
        return "P's handshake carries no KV compatibility descriptor (an older kvlease?)"
    diffs = []
    tokens = _block_sizes(ours, theirs)
    for key in _KV_KEYS:
        if key == "block_order" and None in (theirs.get(key), ours.get(key)):
            continue  # a layout not resolved at the scheduler: the layer formats decide
        if theirs.get(key) != ours.get(key):
            what = f"{key}: P {theirs.get(key)!r}, D {ours.get(key)!r}"
            if key == "block_order":
                what += (
                    f" (kv_cache_layout P {theirs.get('kv_cache_layout')!r}, "
                    f"D {ours.get('kv_cache_layout')!r}; KV layout permutation, "
                    "NixlConnector's enable_permute_local_kv, is not supported: run both "
                    "with the same kv_cache_layout)"
                )
            diffs.append(what)
    if tokens is not None and len(diffs) == 1 and diffs[0].startswith("block_size:"):
        # P ≠ D block sizes alone: D reads runs of tokens (the worker's
        # ``_sub_block_runs``); named above only beside another difference.
        diffs = []
    heads = None
    if d_tp != p_tp and not diffs:
        d_heads, p_heads = _rank_heads(ours, d_tp), _rank_heads(theirs, p_tp)
        if d_heads is None or p_heads is None:
            diffs.append(
                f"tp_size: P {p_tp}, D {d_tp}: heterogeneous TP needs both TP sizes to "
                f"divide the model's {ours.get('num_kv_heads')} KV heads (vLLM replicates "
                "heads over the ranks beyond them)"
            )
        else:
            heads = (d_heads, p_heads)
    mine, p_layers = ours.get("layers") or {}, theirs.get("layers") or {}
    if mine and p_layers and not diffs:
        diff = _layer_format_diff(mine, p_layers, heads=heads, tokens=tokens)
        if diff is not None:
            diffs.append(diff)
    return "; ".join(diffs) or None


def _same_but_heads(mine: list[Any], theirs: list[Any], heads: tuple[int, int]) -> bool:
    """Whether two ``_block_format`` s are the same apart from the head count (block dim
    1), which is ``heads`` (D's, P's): the dtype, the other dims and their order agree
    (a dim of size 1 is left out of an order, so the head dim is compared only where
    both sides list it)."""
    (d_dtype, d_shape, d_order), (p_dtype, p_shape, p_order) = mine, theirs
    if d_dtype != p_dtype or len(d_shape) != len(p_shape) or not d_shape:
        return False
    if (d_shape[0], p_shape[0]) != heads or d_shape[1:] != p_shape[1:]:
        return False
    if 1 in d_order and 1 in p_order:
        return list(d_order) == list(p_order)
    return [d for d in d_order if d != 1] == [d for d in p_order if d != 1]


def _block_sizes(ours: dict[str, Any], theirs: dict[str, Any]) -> tuple[int, int] | None:
    """``(D's, P's)`` block sizes (tokens per block) from two descriptors when they are
    both known and differ (D then reads P's blocks as runs of tokens), else ``None``."""
    d_bs, p_bs = ours.get("block_size"), theirs.get("block_size")
    if type(d_bs) is not int or type(p_bs) is not int or d_bs <= 0 or p_bs <= 0:
        return None
    return None if d_bs == p_bs else (d_bs, p_bs)


def _same_but_sizes(
    mine: list[Any], theirs: list[Any], sizes: dict[int, tuple[int, int]]
) -> bool:
    """Whether two ``_block_format`` s are the same apart from the sizes of the block
    dims in ``sizes`` (0-based dim of the block -> (D's size, P's size)): the dtype, the
    other dims and the order of the dims (those of size 1 on one side compared only
    where both sides list them) agree."""
    (d_dtype, d_shape, d_order), (p_dtype, p_shape, p_order) = mine, theirs
    if d_dtype != p_dtype or len(d_shape) != len(p_shape) or not d_shape:
        return False
    for i, (d, p) in enumerate(zip(d_shape, p_shape)):
        if (d, p) != sizes.get(i, (d, d)):
            return False
    # A dim listed on one side only has size 1 on the other, where it moves no bytes.
    listed = set(d_order) & set(p_order)
    return [d for d in d_order if d in listed] == [d for d in p_order if d in listed]


def _layer_format_diff(
    mine: dict[str, Any],
    theirs: dict[str, Any],
    *,
    heads: tuple[int, int] | None = None,
    tokens: tuple[int, int] | None = None,
) -> str | None:
    """How P's per-layer block formats (layer name -> ``_block_format``) differ from
    ours, or ``None`` when P holds the same layers, each in the same format; with
    ``heads`` (D's, P's heads per worker: different TP sizes), each layer's block holds
    that many heads on each side and is otherwise the same; with ``tokens`` (D's, P's
    block sizes), that many tokens (block dim 2 of vLLM's ``[heads, tokens, ...]``)."""
    if set(mine) != set(theirs):
        only_p = sorted(set(theirs) - set(mine))[:3]
        only_d = sorted(set(mine) - set(theirs))[:3]
        return f"KV cache layers differ (only P: {only_p}, only D: {only_d})"
    if tokens is not None and tokens[0] != tokens[1]:
        sizes = {1: tokens}
        if heads is not None:
            sizes[0] = heads
        bad = [
            n for n in sorted(mine) if not _same_but_sizes(list(mine[n]), list(theirs[n]), sizes)
        ]
    elif heads is None or heads[0] == heads[1]:
        bad = [n for n in sorted(mine) if list(theirs[n]) != list(mine[n])]
    else:
        bad = [
            n
            for n in sorted(mine)
            if not _same_but_heads(list(mine[n]), list(theirs[n]), heads)
        ]
    if not bad:
        return None
    what = "" if heads is None else f" (heads per worker: P {heads[1]}, D {heads[0]})"
    if tokens is not None and tokens[0] != tokens[1]:
        what += f" (block size: P {tokens[1]}, D {tokens[0]})"
    return (
        f"{len(bad)} layer(s) store a block differently{what}, e.g. {bad[0]}: "
        f"P [dtype, shape, order] {list(theirs[bad[0]])}, D {list(mine[bad[0]])}"
    )
