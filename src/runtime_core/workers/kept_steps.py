"""A batch's outputs kept per step.

``KeptSteps`` answers the worker's questions about a batch's steps (their activations,
or their token and logits: ``StageBackend``'s ``activations_of`` .. ``sample_of``) from
the ``Kept`` outputs a backend's ``run_batch`` stored: the CUDA worker's backend
(``runtime_cupy.cuda.backend``) and its NumPy twin (``tests/support/twin_stage.py``)
run a batch as one step of all its rows and keep each run's outputs so.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs
import numpy as np
import numpy.typing as npt

from runplan import SamplingConfig


@attrs.frozen
class Kept:
    """One step's outputs: its activations (a stage before the last), or its token and
    logits (a head step of the last stage); None where the step has none."""

    activations: Any = None
    token: tuple[int, int] | None = None
    logits: Any = None


class KeptBackend(Protocol):
    """A backend that keeps its last batch's outputs per step, and reads them."""

    kept: list[Kept]

    def kept_to_host(self, logits: Any) -> npt.NDArray[np.float32]: ...

    def sample_kept(self, logits: Any, config: SamplingConfig, u: float) -> int: ...


class KeptSteps:
    """Each step's outputs of the last batch (``StageBackend``'s ``activations_of``,
    ``token_of``, ``logits_of``, ``sample_of``), from the backend's ``kept``."""

    def activations_of(self: KeptBackend, index: int) -> Any:
        return self.kept[index].activations

    def token_of(self: KeptBackend, index: int) -> tuple[int, int]:
        token = self.kept[index].token
        if token is None:
            raise RuntimeError(f"step {index} of the batch computed no token")
        return token

    def logits_of(self: KeptBackend, index: int) -> npt.NDArray[np.float32]:
        return self.kept_to_host(self.kept[index].logits)

    def sample_of(self: KeptBackend, index: int, config: SamplingConfig, u: float) -> int:
        return self.sample_kept(self.kept[index].logits, config, u)
