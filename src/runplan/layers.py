"""Layer-splitting rules behind ``Placement.even`` and ``Placement.by_memory``.

Both return ``stage_count`` contiguous non-empty ranges ``(start, end_exclusive)`` that
cover ``0..num_layers``; callers guarantee ``1 <= stage_count <= num_layers``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from itertools import accumulate

Range = tuple[int, int]


def split_even(num_layers: int, stage_count: int) -> list[Range]:
    """As even as whole layers allow; the first ``num_layers % stage_count`` stages get
    one layer more."""
    base, extra = divmod(num_layers, stage_count)
    ranges = []
    start = 0
    for i in range(stage_count):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def split_by_capacity(
    layer_cost: Sequence[int], fixed_cost: Sequence[int], capacity: Sequence[int]
) -> list[Range]:
    """Contiguous ranges whose loads are in proportion to the stages' capacities.

    ``load`` of stage ``i`` is ``fixed_cost[i]`` plus the cost of its layers. Were
    layers divisible, every stage would run at the same ratio
    ``u = total load / total capacity``, so stage ``i``'s layers would cost
    ``u * capacity[i] - fixed_cost[i]``. Each boundary is put at the layer where the
    running layer cost comes nearest to the running target, keeping at least one
    layer per stage.
    """
    n_layers = len(layer_cost)
    n_stages = len(capacity)
    total_capacity = sum(capacity)
    if total_capacity <= 0:
        return split_even(n_layers, n_stages)
    prefix = [0, *accumulate(layer_cost)]
    ratio = (prefix[-1] + sum(fixed_cost)) / total_capacity
    ranges = []
    start = 0
    target = 0.0
    for i in range(n_stages - 1):
        target += ratio * capacity[i] - fixed_cost[i]
        lo, hi = start + 1, n_layers - (n_stages - 1 - i)
        k = min(max(bisect_left(prefix, target, lo, hi + 1), lo), hi)
        if k > lo and abs(prefix[k - 1] - target) <= abs(prefix[k] - target):
            k -= 1
        ranges.append((start, k))
        start = k
    ranges.append((start, n_layers))
    return ranges
