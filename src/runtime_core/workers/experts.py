"""A mixture of experts' routing, as llama.cpp's ``build_moe_ffn`` computes it for the
architectures we run (``llama-graph.cpp``; qwen3moe's and Mixtral's softmax gating with
the chosen weights renormalized), shared by every worker.

Per row: ``p = softmax(router logits)`` (the largest subtracted, the exponentials
(``ieee_math.exp32``: the same bits on every machine, which NumPy's ``np.exp`` is not)
summed in float64 as ggml sums them, each times the float32 reciprocal of the sum),
the ``k`` largest of ``p`` in descending order (the lower expert first among equal
ones), their weights ``p[e_j] / max(sum_j p[e_j], 2^-14)`` (ggml's clamp of the sum).
The block's output is then ``sum_j w_j * expert_{e_j}(row)``: each product rounded,
added in slot order ``j = 0, 1, ...`` (ggml's views of the experts' outputs summed one
after the other), then added to the residual row.

Routing runs on the host, on the router's logits read back from the worker: a row's
experts are a decision (which weights a row reads), so every worker takes the same
one from the same logits.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
from attrs import frozen

from runtime_core.ieee_math import exp32

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]

#: ggml's lower bound on the sum of a row's chosen weights (the smallest normal half)
MIN_WEIGHT_SUM = np.float32(6.103515625e-5)


@frozen
class Routing:
    """Each row's experts, most probable first, and their weights: ``(rows, k)`` each."""

    experts: I64
    weights: F32

    def by_expert(self) -> Iterator[tuple[int, I64, I64]]:
        """For each expert some row chose, in expert order: ``(expert, rows, slots)``,
        the rows that chose it (ascending) and the slot each chose it in."""
        rows, slots = np.nonzero(self.experts >= 0)
        chosen = self.experts[rows, slots]
        order = np.argsort(chosen, kind="stable")  # by expert, rows ascending within
        rows, slots, chosen = rows[order], slots[order], chosen[order]
        starts = np.flatnonzero(np.r_[True, chosen[1:] != chosen[:-1]])
        ends = np.r_[starts[1:], len(chosen)]
        for a, b in zip(starts, ends, strict=True):
            yield int(chosen[a]), rows[a:b].astype(np.int64), slots[a:b].astype(np.int64)


def route(logits: F32, k: int, norm: bool = True) -> Routing:
    """The routing of rows whose router logits are ``logits`` ``(rows, n_experts)``; the
    chosen weights divided by their sum (``norm``) or the softmax's own (qwen2moe)."""
    logits = np.asarray(logits, dtype=np.float32)
    e = exp32(logits - logits.max(axis=1, keepdims=True))
    total = e.sum(axis=1, dtype=np.float64)
    p = e * (1.0 / total).astype(np.float32)[:, None]
    experts = np.argsort(-p, axis=1, kind="stable")[:, :k].astype(np.int64)
    chosen = np.take_along_axis(p, experts, axis=1)
    if not norm:
        return Routing(experts, chosen.astype(np.float32))
    total_chosen = np.maximum(
        chosen.sum(axis=1, dtype=np.float64).astype(np.float32), MIN_WEIGHT_SUM
    )
    return Routing(experts, (chosen / total_chosen[:, None]).astype(np.float32))


def shared_gate(logits: F32) -> F32:
    """qwen2moe's gate of the shared expert, ``sigmoid(g)`` as llama.cpp computes it:
    ``silu(g) / g`` in float32 (``ggml_div(ggml_silu(g), g)``)."""
    g = np.asarray(logits, dtype=np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):  # g = 0: NaN, as llama.cpp's
        silu = g / (np.float32(1) + exp32(-g))
        return (silu / g).astype(np.float32)


def weighted_sum(outputs: F32) -> F32:
    """``outputs`` ``(k, rows, hidden)``, each slot's output already times its weight,
    summed in slot order (each addition rounded, as ggml's)."""
    total: F32 = outputs[0].copy()
    for j in range(1, outputs.shape[0]):
        total += outputs[j]
    return total
