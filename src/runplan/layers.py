"""Layer-splitting rules behind ``Placement.even`` and ``Placement.by_memory``.

Each returns ``stage_count`` contiguous non-empty ranges ``(start, end_exclusive)`` that
cover ``0..num_layers`` (``fitting_split``: or ``None``); callers guarantee
``1 <= stage_count <= num_layers``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Hashable, Mapping, Sequence
from itertools import accumulate, pairwise
from typing import TypeVar

Range = tuple[int, int]
#: what a stage's memory is counted under (``NodeSpec.device_key``)
Device = TypeVar("Device", bound=Hashable)
#: the most steps (stages times layers squared) ``_least_largest_share`` may take: some
#: 64 stages of 280 layers, far past any model's; past it the nearest split stands
LEAST_SHARE_WORK = 5_000_000


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
    layer per stage. Where that puts a stage's load past its capacity, and another
    split's largest load over capacity is less (``_least_largest_share``), that split
    is taken instead: a split that fits is never passed over for one that does not
    (within ``LEAST_SHARE_WORK``).
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
    if all(c > 0 for c in capacity) and n_stages * n_layers**2 <= LEAST_SHARE_WORK:
        worst = _largest_share(ranges, prefix, fixed_cost, capacity)
        if worst > 1.0:  # a stage past its capacity: the split with the least largest share
            other = _least_largest_share(prefix, fixed_cost, capacity)
            if _largest_share(other, prefix, fixed_cost, capacity) < worst:
                return other
    return ranges


def _largest_share(
    ranges: Sequence[Range], prefix: Sequence[int], fixed: Sequence[int], capacity: Sequence[int]
) -> float:
    """The largest of the stages' loads over their capacities."""
    return max((fixed[i] + prefix[b] - prefix[a]) / capacity[i] for i, (a, b) in enumerate(ranges))


def _least_largest_share(
    prefix: Sequence[int], fixed: Sequence[int], capacity: Sequence[int]
) -> list[Range]:
    """The contiguous split (a layer a stage at least) whose largest load over capacity
    is least, by dynamic programming over (stage, end layer): ``best[j]`` the least
    largest share of the stages so far ending at layer ``j`` (ties: the earliest
    boundary). Layers of unequal cost on nodes of unequal memory defeat a greedy fill:
    taking the most layers early can hand a small node a big one."""
    n_layers, n_stages = len(prefix) - 1, len(capacity)
    inf = float("inf")
    best = [inf] * (n_layers + 1)
    for j in range(1, n_layers - n_stages + 2):
        best[j] = (fixed[0] + prefix[j]) / capacity[0]
    cuts: list[list[int]] = []
    for i in range(1, n_stages):
        nxt, cut = [inf] * (n_layers + 1), [0] * (n_layers + 1)
        for j in range(i + 1, n_layers - (n_stages - 1 - i) + 1):
            for m in range(i, j):
                share = max(best[m], (fixed[i] + prefix[j] - prefix[m]) / capacity[i])
                if share < nxt[j]:
                    nxt[j], cut[j] = share, m
        best = nxt
        cuts.append(cut)
    ends = [n_layers]
    for cut in reversed(cuts):
        ends.append(cut[ends[-1]])
    bounds = [0, *reversed(ends)]
    return list(pairwise(bounds))


#: the most steps ``fitting_split`` may take (ways tried and compared): about a second
#: here; a 128-block model on 16 stages sharing one device takes some 300,000
FIT_WORK = 1_000_000

#: one way to place the stages so far: each shared device's load, then where the stage
#: before began (its end layer) and which of that layer's ways it was
_Way = tuple[tuple[int, ...], int, int]


def fitting_split(
    layer_cost: Sequence[int],
    fixed_cost: Sequence[int],
    device: Sequence[Device],
    device_capacity: Mapping[Device, int],
) -> list[Range] | None:
    """A contiguous split (a layer a stage at least) in which every device holds its
    stages, counted exactly in bytes: stage ``i``'s load ``fixed_cost[i]`` plus its
    layers' cost, summed over the stages on ``device[i]``, at most
    ``device_capacity[device[i]]``; ``None`` when no split fits (or the search passes
    ``FIT_WORK`` steps).

    ``split_by_capacity`` gives each node an equal share of a device it shares and
    compares shares as floats; a split may fit the device as a whole (one stage taking
    more than half of it) or by a byte past 2**53 where no share-wise split does. This
    is dynamic programming over (stage, end layer), keeping for each the loads of the
    shared devices that no other way to get there beats on every device (the least
    load, where one device is shared)."""
    n_layers, n_stages = len(layer_cost), len(fixed_cost)
    prefix = [0, *accumulate(layer_cost)]
    counts: dict[Device, int] = {}
    for d in device:
        counts[d] = counts.get(d, 0) + 1
    slot = {d: k for k, d in enumerate(d for d in counts if counts[d] > 1)}
    ways: dict[int, list[_Way]] = {0: [((0,) * len(slot), -1, -1)]}
    history = []
    budget = FIT_WORK
    for i in range(n_stages):
        cap, k = device_capacity[device[i]], slot.get(device[i])
        first_end = n_layers if i == n_stages - 1 else i + 1
        last_end = n_layers - (n_stages - 1 - i)
        reached: dict[int, list[_Way]] = {}
        for j in range(first_end, last_end + 1):
            found: list[_Way] = []
            for m, before in ways.items():
                load = fixed_cost[i] + prefix[j] - prefix[m]
                if m >= j or load > cap:
                    continue
                budget -= len(before)
                for index, (loads, _, _) in enumerate(before):
                    if k is None:
                        found.append((loads, m, index))
                    elif loads[k] + load <= cap:
                        found.append(((*loads[:k], loads[k] + load, *loads[k + 1 :]), m, index))
            unbeaten = _unbeaten(found, budget)
            if unbeaten is None:
                return None
            kept, budget = unbeaten
            if kept:
                reached[j] = kept
        if not reached:
            return None
        history.append(reached)
        ways = reached
    ends, index = [n_layers], 0
    for reached in reversed(history):
        _, m, index = reached[ends[-1]][index]
        ends.append(m)
    return list(pairwise(reversed(ends)))


def _unbeaten(found: list[_Way], budget: int) -> tuple[list[_Way], int] | None:
    """The ways whose loads no other way's are at most on every device (one of equals),
    and what is left of ``budget`` once they are compared; ``None`` past it."""
    kept: list[_Way] = []
    for way in sorted(found):
        budget -= len(kept) + 1
        if budget < 0:
            return None
        if not any(all(a <= b for a, b in zip(k[0], way[0], strict=True)) for k in kept):
            kept.append(way)
    return kept, budget
