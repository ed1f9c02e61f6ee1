"""A batch's outputs kept per step.

``KeptSteps`` answers the worker's questions about a batch's steps (their activations,
or their token and logits: ``StageBackend``'s ``activations_of`` .. ``sample_of``) from
the ``Kept`` outputs a backend's ``run_batch`` stored: the CUDA worker's backend
(``runtime_cupy.cuda.backend``) and its NumPy twin (``tests/support/twin_stage.py``)
run a batch as one step of all its rows and keep each run's outputs so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import attrs
import numpy as np
import numpy.typing as npt

from runplan import SamplingConfig
from runtime_core import activations


@attrs.frozen
class Kept:
    """One step's outputs: its activations (a stage before the last), or its token and
    logits (a head step of the last stage); None where the step has none. ``error``:
    why the step's activations cannot go on the edge (``activations.ActivationOverflow``),
    raised for the step in place of its activations."""

    activations: Any = None
    token: tuple[int, int] | None = None
    logits: Any = None
    error: ValueError | None = None


def edge_rows(
    x: npt.NDArray[np.float32],
    ranges: Sequence[tuple[int, int]],
    dtype: np.dtype[np.generic],
    converted: Sequence[Any] | None = None,
) -> list[Kept]:
    """Each step's output activations, rows ``ranges`` of the float32 rows ``x`` on an
    edge of ``dtype`` (``activations.encode``; ``converted[i]`` instead, where given:
    those rows as a device converted them), or the ``ActivationOverflow`` that refuses
    them: a step whose rows the edge cannot carry fails alone (CONCURRENT_RUNS.md)."""
    kept = []
    for i, (start, end) in enumerate(ranges):
        try:
            rows = activations.encode(x[start:end], dtype)
        except activations.ActivationOverflow as exc:
            kept.append(Kept(error=exc))
        else:
            kept.append(Kept(activations=rows if converted is None else converted[i]))
    return kept


class KeptBackend(Protocol):
    """A backend that keeps its last batch's outputs per step, and reads them."""

    kept: list[Kept]

    def kept_to_host(self, logits: Any) -> npt.NDArray[np.float32]: ...

    def sample_kept(self, logits: Any, config: SamplingConfig, u: float) -> int: ...


class KeptSteps:
    """Each step's outputs of the last batch (``StageBackend``'s ``activations_of``,
    ``token_of``, ``logits_of``, ``sample_of``), from the backend's ``kept``."""

    def activations_of(self: KeptBackend, index: int) -> Any:
        kept = self.kept[index]
        if kept.error is not None:
            raise kept.error
        return kept.activations

    def token_of(self: KeptBackend, index: int) -> tuple[int, int]:
        token = self.kept[index].token
        if token is None:
            raise RuntimeError(f"step {index} of the batch computed no token")
        return token

    def logits_of(self: KeptBackend, index: int) -> npt.NDArray[np.float32]:
        return self.kept_to_host(self.kept[index].logits)

    def sample_of(self: KeptBackend, index: int, config: SamplingConfig, u: float) -> int:
        return self.sample_kept(self.kept[index].logits, config, u)
