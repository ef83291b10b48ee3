"""KV compatibility: what makes a KV block's bytes mean the same on P and D
(``_kv_descriptor``, ``_block_format``) and how two engines' descriptors differ
(``_kv_incompatibility``, ``_layer_format_diff``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import _kvlease as native
from ..errors import InvalidArgument
from .layout import _block_format, format_parts

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["_block_format", "_kv_descriptor", "_kv_incompatibility", "_layer_format_diff"]

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
    name -> ``layout.layer_format``) is compared when both sides know their workers'
    formats; with different TP sizes a block's head count differs by the ratio, with
    different block sizes its token count, nothing else. D's workers compare each P
    worker's formats again before they read (``_layer_format_diff``)."""
    if not isinstance(theirs, dict):
        return "P's handshake carries no KV compatibility descriptor (an older kvlease?)"
    diffs = []
    tokens = _block_sizes(ours, theirs)
    # The keys both must agree on, and the rule for a layout one scheduler did not
    # resolve, are kvlease-proto's (``KvDescriptor::mismatches``), as the agents' check.
    try:
        mismatches = native.kv_mismatches(ours, theirs)
    except InvalidArgument as e:
        return f"P's KV compatibility descriptor does not read: {e}"
    for key, p_value, d_value in mismatches:
        what = f"{key}: P {p_value!r}, D {d_value!r}"
        if key == "block_order":
            what += (
                f" (kv_cache_layout P {theirs.get('kv_cache_layout')!r}, "
                f"D {ours.get('kv_cache_layout')!r}; KV layout permutation, "
                "NixlConnector's enable_permute_local_kv, is not supported: run both "
                "with the same kv_cache_layout)"
            )
        diffs.append(what)
    mine, p_layers = ours.get("layers") or {}, theirs.get("layers") or {}
    if tokens is not None and len(diffs) == 1 and diffs[0].startswith("block_size:"):
        # P ≠ D block sizes alone: D reads runs of tokens (``layout.sub_block_runs``)
        # where the layer formats say which dim holds the tokens (below; D's workers
        # compare P's workers' formats again, and refuse a P that names none).
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
    if mine and p_layers and not diffs:
        diff = _layer_format_diff(mine, p_layers, heads=heads, tokens=tokens)
        if diff is not None:
            diffs.append(diff)
    return "; ".join(diffs) or None


def _block_sizes(ours: dict[str, Any], theirs: dict[str, Any]) -> tuple[int, int] | None:
    """``(D's, P's)`` block sizes (tokens per block) from two descriptors when they are
    both known and differ (D then reads P's blocks as runs of tokens), else ``None``."""
    d_bs, p_bs = ours.get("block_size"), theirs.get("block_size")
    if type(d_bs) is not int or type(p_bs) is not int or d_bs <= 0 or p_bs <= 0:
        return None
    return None if d_bs == p_bs else (d_bs, p_bs)


def _format_diff(
    mine: list[Any],
    theirs: list[Any],
    heads: tuple[int, int] | None,
    tokens: tuple[int, int] | None,
) -> str | None:
    """Why P's block of format ``theirs`` cannot be read into D's of format ``mine``
    (``layout.layer_format``), or ``None``. Both name the same attention backend. With
    ``heads`` (D's, P's heads per worker) the ``H`` dims may differ by that, with
    ``tokens`` (D's, P's block sizes) the ``N`` dims, where the axes name such a dim;
    otherwise the blocks are the same."""
    d_dtype, d_shape, d_order, d_axes, d_backend = format_parts(mine)
    p_dtype, p_shape, p_order, p_axes, p_backend = format_parts(theirs)
    if len(theirs) < 5:
        return "P's kvlease does not say what its blocks hold (an older kvlease?)"
    if d_backend is None or p_backend is None:
        who = "D's" if d_backend is None else "P's"
        return f"{who} attention backend is not known, so neither is what its blocks hold"
    if d_backend != p_backend:
        return f"the attention backends differ (P {p_backend}, D {d_backend})"
    if d_axes != p_axes:
        return f"P's blocks hold {p_axes}, D's {d_axes}"
    for letter, rng, what in (("H", heads, "TP sizes"), ("N", tokens, "block sizes")):
        if rng is not None and (d_axes is None or letter not in d_axes):
            where = "heads" if letter == "H" else "tokens"
            return (
                f"different {what} need to know where {d_backend}'s blocks hold their "
                f"{where}, and kvlease does not ({d_backend}'s blocks hold {d_axes})"
            )
    if d_dtype != p_dtype or len(d_shape) != len(p_shape):
        return "the blocks differ"
    sizes = {}
    if heads is not None and d_axes is not None:
        sizes[d_axes.index("H")] = heads
    if tokens is not None and d_axes is not None:
        sizes[d_axes.index("N")] = tokens
    for i, (d, p) in enumerate(zip(d_shape, p_shape)):
        if (d, p) != sizes.get(i, (d, d)):
            return "the blocks differ"
    # A dim listed on one side only has size 1 on the other, where it moves no bytes.
    listed = set(d_order) & set(p_order)
    if [d for d in d_order if d in listed] != [d for d in p_order if d in listed]:
        return "the blocks lay their dims out in another order"
    return None


def _layer_format_diff(
    mine: dict[str, Any],
    theirs: dict[str, Any],
    *,
    heads: tuple[int, int] | None = None,
    tokens: tuple[int, int] | None = None,
) -> str | None:
    """How P's per-layer block formats (layer name -> ``layout.layer_format``) differ
    from ours, or ``None`` when D can read every layer of P's blocks into its own; with
    ``heads`` (D's, P's heads per worker: different TP sizes), each layer's block holds
    that many heads on each side and is otherwise the same; with ``tokens`` (D's, P's
    block sizes), that many tokens (``_format_diff``)."""
    if set(mine) != set(theirs):
        only_p = sorted(set(theirs) - set(mine))[:3]
        only_d = sorted(set(mine) - set(theirs))[:3]
        return f"KV cache layers differ (only P: {only_p}, only D: {only_d})"
    if heads is not None and heads[0] == heads[1]:
        heads = None
    if tokens is not None and tokens[0] == tokens[1]:
        tokens = None
    bad = [
        (n, why)
        for n in sorted(mine)
        if (why := _format_diff(list(mine[n]), list(theirs[n]), heads, tokens)) is not None
    ]
    if not bad:
        return None
    what = "" if heads is None else f" (heads per worker: P {heads[1]}, D {heads[0]})"
    if tokens is not None:
        what += f" (block size: P {tokens[1]}, D {tokens[0]})"
    name, why = bad[0]
    return (
        f"{len(bad)} layer(s) store a block differently{what}, e.g. {name}: {why}; "
        f"P [dtype, shape, order, axes, backend] {list(theirs[name])}, D {list(mine[name])}"
    )
