"""``StageBackend.run_batch`` for a backend that runs one run's step at a time.

The CUDA worker's program (``runtime_cupy.cuda.backend``) and its NumPy twin
(``tests/support/twin_stage.py``) have no batched kernels yet: ``RunsOneAtATime`` gives
them the batched port by running a batch's steps one after another, each against its
run's cache (``use_cache``), and keeping each step's outputs (its activations, or its
token and its logits, copied where the backend keeps them) until the worker asks for
them. Each weight is read once per step, not once per batch; a run's results are
those it gets alone, whatever its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import attrs
import numpy as np
import numpy.typing as npt

from runplan import SamplingConfig
from runtime_core.workers.stage_worker import BackendSpec, BackendStep


@attrs.frozen
class Kept:
    """One step's outputs: its activations (a stage before the last), or its token and
    logits (a head step of the last stage); None where the step has none."""

    activations: Any = None
    token: tuple[int, int] | None = None
    logits: Any = None


class OneRunBackend(Protocol):
    """A backend's one-run step: ``use_cache``, ``put_tokens`` / ``put_activations``,
    ``run``, ``take_activations``, ``token``, ``keep_logits`` (a copy of the logits that
    the next step does not overwrite), ``kept_to_host`` and ``sample_kept``."""

    spec: BackendSpec
    kept: list[Kept]

    def use_cache(self, cache: Any) -> None: ...

    def put_tokens(self, ids: npt.NDArray[np.int32]) -> None: ...

    def put_activations(self, data: Any) -> None: ...

    def run(self, rows: int, pos: int, head: bool = True) -> None: ...

    def take_activations(self, rows: int) -> Any: ...

    def token(self) -> tuple[int, int]: ...

    def keep_logits(self) -> Any: ...

    def kept_to_host(self, logits: Any) -> npt.NDArray[np.float32]: ...

    def sample_kept(self, logits: Any, config: SamplingConfig, u: float) -> int: ...


class RunsOneAtATime:
    """The batched port (``run_batch`` and each step's outputs) over a
    ``OneRunBackend``'s one-run step."""

    def run_batch(self: OneRunBackend, steps: Sequence[BackendStep]) -> None:
        """The steps one after another (a per-run loop: this backend has no kernels
        that take several runs' rows), each step's outputs kept."""
        kept: list[Kept] = []
        for step in steps:
            self.use_cache(step.cache)
            if self.spec.is_first:
                self.put_tokens(step.data)
            else:
                self.put_activations(step.data)
            self.run(step.rows, step.pos, step.head)
            if not self.spec.is_last:
                kept.append(Kept(activations=self.take_activations(step.rows)))
            elif step.head:
                kept.append(Kept(token=self.token(), logits=self.keep_logits()))
            else:
                kept.append(Kept())
        self.kept = kept

    def activations_of(self: OneRunBackend, index: int) -> Any:
        return self.kept[index].activations

    def token_of(self: OneRunBackend, index: int) -> tuple[int, int]:
        token = self.kept[index].token
        if token is None:
            raise RuntimeError(f"step {index} of the batch computed no token")
        return token

    def logits_of(self: OneRunBackend, index: int) -> npt.NDArray[np.float32]:
        return self.kept_to_host(self.kept[index].logits)

    def sample_of(self: OneRunBackend, index: int, config: SamplingConfig, u: float) -> int:
        return self.sample_kept(self.kept[index].logits, config, u)
