"""Comparisons of logits and greedy tokens with llama.cpp's, and the float32 error
bounds that comparisons of intermediate tensors stand on."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

#: A step where llama.cpp's two largest logits are closer than this is a near-tie:
#: within the measured distance between llama.cpp's logits and an exact float32
#: computation of the same weights (up to ~0.1 on the quantized fixtures, ~1 on SmolLM2
#: Q4_1, where most entries are far from the top), so either token is right.
NEAR_TIE = 0.1


#: float32's unit roundoff: a float32 operation's result is within this of the exact
#: one, relative.
U32 = 2.0**-24


def gamma(k: int) -> float:
    """Higham's ``gamma_k = k u / (1 - k u)``: a float32 sum of ``k`` terms (products,
    with or without fused multiply-adds), added in any order, is within ``gamma_k`` times
    the sum of the terms' magnitudes of the exact sum (Higham, *Accuracy and Stability
    of Numerical Algorithms*, 2nd ed., section 3.1)."""
    return k * U32 / (1 - k * U32)


def product_bound(
    x: npt.NDArray[np.floating], w: npt.NDArray[np.floating]
) -> npt.NDArray[np.float64]:
    """How far two float32 evaluations of ``x @ w`` (``(rows, k) @ (k, n)``), each in
    any order of its sums, can be apart: each is within ``gamma_k * (|x| @ |w|)`` of the
    exact product, elementwise (from the actual magnitudes, in float64)."""
    a = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64))
    return 2 * gamma(x.shape[-1]) * a


def cosine(a: npt.NDArray[np.floating], b: npt.NDArray[np.floating]) -> float:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return float(a64 @ b64 / (np.linalg.norm(a64) * np.linalg.norm(b64)))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def same_pick_up_to_a_near_tie(
    ours: npt.NDArray[np.floating], theirs: npt.NDArray[np.floating]
) -> bool:
    """Whether the token ``ours`` ranks first is the one ``theirs`` does, or one
    ``theirs`` scores within ``NEAR_TIE`` of its best (then either is right)."""
    pick, best = int(np.argmax(ours)), int(np.argmax(theirs))
    return pick == best or float(theirs[best]) - float(theirs[pick]) < NEAR_TIE


def first_near_tie(gaps: Sequence[float], n: int) -> int:
    """The first of the first ``n`` steps whose top-2 gap is below ``NEAR_TIE`` (``n``
    when there is none)."""
    return next((i for i, g in enumerate(gaps[:n]) if g < NEAR_TIE), n)
