"""The reference sampler's choice, computed where the logits are.

``sample(xp, logits, config, u)`` picks the token that ``runtime_core.workers.sampling.Sampler``
picks for the same logits when its generator draws ``u``, with array module ``xp``:
CuPy on the GPU (the logits never leave the device; only the id comes back), NumPy
for checking on a CPU. The reference orders the kept tokens by descending logit, ties
by id; here one sort of 64-bit keys ``(order-preserving bits of -logit) << 32 | id``
gives that order, then top-k, top-p and the draw follow the reference step by step
in float64, with its exponentials (``ieee_math.exp64``: NumPy's and CuPy's own ``exp``
differ from it, and from each other, in the last bit, which moved a draw next to a
boundary of the cumulative probabilities onto another token).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from runplan import SamplingConfig
from runtime_core.ieee_math import exp64


def _softmax(xp: Any, x: Any) -> Any:
    e = exp64(x - x.max(), xp)  # the reference's bits on every machine (xp.exp's are not)
    return e / e.sum()


def descending_order(xp: Any, logits: Any) -> Any:
    """Token ids by descending logit, ties by ascending id (``int64``)."""
    n = int(logits.size)
    x = logits.astype(xp.float32) + xp.float32(0.0)  # -0.0 sorts as +0.0
    bits = x.view(xp.uint32)
    negative = (bits >> xp.uint32(31)) != 0
    ascending = xp.where(negative, ~bits, bits | xp.uint32(0x80000000))
    key = (~ascending).astype(xp.uint64) << xp.uint64(32)
    key |= xp.arange(n, dtype=xp.uint64)
    return (xp.sort(key) & xp.uint64(0xFFFFFFFF)).astype(xp.int64)


def sample(xp: Any, logits: Any, config: SamplingConfig, u: float) -> int:
    """The id the reference sampler draws with uniform ``u`` (``temperature > 0``;
    the logits must be finite)."""
    if config.temperature <= 0.0:
        raise ValueError("sample() is for temperature > 0; greedy is the argmax")
    n = int(logits.size)
    order = descending_order(xp, logits)
    k = config.top_k if 0 < config.top_k < n else n
    ids = order[:k]
    kept = logits[ids].astype(xp.float64)
    if config.top_p < 1.0:
        cdf = xp.cumsum(_softmax(xp, kept))
        m = int(xp.searchsorted(cdf, xp.asarray(config.top_p, dtype=xp.float64), side="left")) + 1
        ids, kept = ids[:m], kept[:m]
    with np.errstate(over="ignore"):
        scaled = kept / config.temperature
    if not bool(xp.isfinite(scaled).all()):  # so small a temperature that logits over it
        return int(ids[0])  # overflow: its limit, the largest (as ``Sampler.sample``)
    cdf = xp.cumsum(_softmax(xp, scaled))
    target = xp.asarray(u, dtype=xp.float64) * cdf[-1]
    at = int(xp.searchsorted(cdf, target, side="right"))
    return int(ids[min(at, int(ids.size) - 1)])
