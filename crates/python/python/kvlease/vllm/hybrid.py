"""vLLM's hybrid KV cache manager (``SupportsHMA``): a request's KV spread over several
KV cache groups, full attention and sliding window. One lease covers every group's
blocks (one block list, one generation in every block's fence word); a sliding-window
group contributes only the blocks its window still needs, on P (held) and on D (read),
the way NixlConnector clips them (``get_exchange_clipped_blocks``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..errors import ConfigError

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

#: vLLM's null block (``BlockPool.null_block``, the pool's first block): the placeholder
#: of a sliding-window group's out-of-window blocks, never KV.
NULL_BLOCK = 0


def _group_windows(kv_cache_config: "KVCacheConfig | None") -> tuple[int, ...]:
    """Per KV cache group, the blocks a request's KV needs at most (0: all of them): a
    sliding window of ``w`` tokens in blocks of ``b`` needs ``ceil(w / b) + 1`` (the
    window need not start on a block boundary). One group (or no config): ``(0,)``.
    Raises ``ConfigError`` for a group kvlease cannot move (Mamba state, chunked local
    attention, ...): with several groups only full attention and sliding window."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) <= 1:
        return (0,)
    windows = []
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            window = int(spec.sliding_window)
            windows.append(-(-window // int(spec.block_size)) + 1)
        elif isinstance(spec, FullAttentionSpec) and not getattr(spec, "sliding_window", None):
            windows.append(0)
        else:
            raise ConfigError(
                f"KV cache group {index} ({type(spec).__name__}, layers "
                f"{list(group.layer_names)[:3]}): KvleaseConnector moves full-attention "
                "and sliding-window groups only"
            )
    return tuple(windows)


def _layer_groups(kv_cache_config: "KVCacheConfig | None") -> dict[str, int]:
    """Layer name -> its KV cache group's index (empty for one group: every layer reads
    every block)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) <= 1:
        return {}
    return {name: i for i, g in enumerate(groups) for name in g.layer_names}


def _clip_groups(
    block_ids: Sequence[Sequence[int]], windows: Sequence[int]
) -> list[list[int]]:
    """Each group's blocks a request's KV still needs: a sliding-window group's last
    ``window`` blocks, without vLLM's null placeholders. Raises ``ConfigError`` when the
    group counts differ."""
    if len(block_ids) != len(windows):
        raise ConfigError(
            f"{len(block_ids)} KV cache groups of blocks, for {len(windows)} groups"
        )
    clipped = []
    for blocks, window in zip(block_ids, windows):
        kept = [int(b) for b in blocks if int(b) != NULL_BLOCK]
        clipped.append(kept[-window:] if window else kept)
    return clipped


def _pair_groups(
    local: Sequence[Sequence[int]], remote: Sequence[Sequence[int]]
) -> tuple[list[int], list[int], tuple[int, ...]]:
    """D's blocks paired with P's, group by group, from each group's end (the last
    blocks hold the same tokens on both sides; D's first blocks may be a local prefix
    hit, P's first ones out of D's window): the flat local and remote lists, group after
    group, and each group's pair count. Raises ``ConfigError`` when the group counts
    differ (P and D do not split the model into the same groups)."""
    if len(local) != len(remote):
        raise ConfigError(
            f"P sent {len(remote)} KV cache group(s), D has {len(local)}: the engines "
            "do not group the model's layers alike"
        )
    flat_local: list[int] = []
    flat_remote: list[int] = []
    sizes = []
    for mine, theirs in zip(local, remote):
        n = min(len(mine), len(theirs))
        flat_local.extend(int(b) for b in list(mine)[len(mine) - n :])
        flat_remote.extend(int(b) for b in list(theirs)[len(theirs) - n :])
        sizes.append(n)
    return flat_local, flat_remote, tuple(sizes)


def _group_pairs(
    local: list[int], remote: list[int], sizes: Sequence[int], group: int | None
) -> tuple[list[int], list[int]]:
    """The pairs of group ``group`` among a load's flat pairs (``_pair_groups``); all of
    them when the load has no groups (``sizes`` empty) or the layer none (``None``)."""
    if not sizes or group is None:
        return local, remote
    start = sum(sizes[:group])
    end = start + (sizes[group] if group < len(sizes) else 0)
    return local[start:end], remote[start:end]
