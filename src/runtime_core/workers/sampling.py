"""Picking the next token from the last stage's logits.

``SamplingConfig(temperature, top_k, top_p, seed)``: temperature 0 is greedy (the
first index of the largest logit). Otherwise, in llama.cpp's order (its default
sampler chain): keep the ``top_k`` largest logits (0 = all), then the smallest set of
the most likely of those whose probability (softmax of the raw logits) reaches
``top_p`` (1 = all), then draw from the softmax of the kept logits divided by the
temperature. Ties are ordered by token id. Each draw takes exactly one number from a
``numpy.random.Generator(PCG64(seed))`` made for the run, so the same seed and the
same logits give the same tokens, on every machine (the softmax's exponentials are
``ieee_math.exp64``'s, the same bits everywhere; NumPy's ``np.exp`` is not).

Seeded sampling takes exactly one draw per token; greedy takes none. The draws are
counted (``Sampler.draws``), and ``Sampler(config, draws=k)`` continues exactly where a
sampler that drew ``k`` numbers would (the generator advanced by ``k``). So the state
after ``n`` delivered tokens is known without replaying them:
``Sampler.resumed(config, n)``; a worker makes each run's sampler with
``Sampler.for_run(config)``, which resumes after ``config.tokens_delivered`` (0 for a
fresh run; a replay's count, ``runtime_core.replay``).
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from runplan import SamplingConfig
from runtime_core.ieee_math import exp64


class NonFiniteLogits(ValueError):
    """Logits holding NaN or infinite values: no token can be drawn from them (the
    weights that made them are damaged, or the model overflowed)."""


class Sampler:
    """The sampling state of one run; ``draws`` numbers drawn so far."""

    def __init__(self, config: SamplingConfig, draws: int = 0) -> None:
        if type(draws) is not int or draws < 0:
            raise ValueError(f"draws {draws!r} is not a count >= 0")
        if not (math.isfinite(config.temperature) and config.temperature >= 0.0):
            raise ValueError(f"temperature {config.temperature} is not a finite number >= 0")
        if config.top_k < 0:
            raise ValueError(f"top_k {config.top_k} is negative")
        if not 0.0 < config.top_p <= 1.0:
            raise ValueError(f"top_p {config.top_p} is not in (0, 1]")
        self.config = config
        bits = np.random.PCG64(config.seed)
        if draws:
            bits.advance(draws)  # each draw below takes one 64-bit output
        self._rng = np.random.Generator(bits)
        self.draws = draws

    @classmethod
    def resumed(cls, config: SamplingConfig, tokens_delivered: int) -> Sampler:
        """The sampler of a stream that already delivered ``tokens_delivered`` tokens:
        seeded sampling takes one draw per token (the generator advanced by that many),
        greedy takes none."""
        if type(tokens_delivered) is not int or tokens_delivered < 0:
            raise ValueError(f"tokens_delivered {tokens_delivered!r} is not a count >= 0")
        return cls(config, draws=tokens_delivered if config.temperature > 0.0 else 0)

    @classmethod
    def for_run(cls, config: SamplingConfig) -> Sampler:
        """A run's sampler: resumed after ``config.tokens_delivered`` tokens (a replay),
        fresh when that is 0."""
        return cls.resumed(config, config.tokens_delivered)

    def uniform(self) -> float:
        """The next number in [0, 1) of the run's stream (one draw)."""
        self.draws += 1
        return float(self._rng.random())

    def sample(self, logits: npt.NDArray[np.float32]) -> int:
        """One token id for the raw ``logits`` (length ``n_vocab``)."""
        if logits.ndim != 1 or logits.size == 0:
            raise ValueError(f"logits of shape {logits.shape}, expected (n_vocab,)")
        if not np.isfinite(logits).all():
            nan = int(np.isnan(logits).sum())
            raise NonFiniteLogits(
                f"logits hold NaN or infinite values ({nan} NaN, "
                f"{int(np.isinf(logits).sum())} infinite of {logits.size})"
            )
        c = self.config
        if c.temperature == 0.0:
            return int(np.argmax(logits))
        ids = _top_k(logits, c.top_k)
        kept = logits[ids].astype(np.float64)
        if c.top_p < 1.0:
            probs = _softmax(kept)
            n = int(np.searchsorted(np.cumsum(probs), c.top_p, side="left")) + 1
            ids, kept = ids[:n], kept[:n]
        with np.errstate(over="ignore"):
            scaled = kept / c.temperature
        if not np.isfinite(scaled).all():  # so small a temperature that logits over it
            self.uniform()  # overflow: its limit, the argmax (the token's draw still taken)
            return int(ids[0])
        probs = _softmax(scaled)
        cdf = np.cumsum(probs)
        at = int(np.searchsorted(cdf, self.uniform() * cdf[-1], side="right"))
        return int(ids[min(at, len(ids) - 1)])


def _top_k(logits: npt.NDArray[np.float32], k: int) -> npt.NDArray[np.intp]:
    """Token ids of the ``k`` largest logits (all when ``k`` is 0), largest first,
    ties by id."""
    n = logits.size
    if 0 < k < n:
        part = np.argpartition(-logits, k - 1)[:k]
        # The k-th largest value may be shared by ids argpartition left out: take
        # the lowest ids among equals, so the choice depends on the values alone.
        kth = logits[part].min()
        above = np.flatnonzero(logits > kth)
        ties = np.flatnonzero(logits == kth)[: k - above.size]
        ids = np.concatenate([above, ties])
    else:
        ids = np.arange(n)
    order = np.lexsort((ids, -logits[ids]))
    return ids[order]


def _softmax(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    e = exp64(x - x.max())  # the same bits on every machine (np.exp's are not)
    out: npt.NDArray[np.float64] = e / e.sum()
    return out
