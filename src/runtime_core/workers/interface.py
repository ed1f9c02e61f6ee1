"""The worker interface (EDGES_AND_WORKERS.md §4, CONCURRENT_RUNS.md §3): the
node-local compute engine of one stage. The stage controller is its only caller; every
runtime (the NumPy reference worker, the CPU and CUDA workers, the simulator's synthetic
worker) implements it.

A worker serves a chain: ``configure`` and ``bind`` set up the stage and its weights
once; each run on the chain then has its own KV cache and sampler, from ``open_run``
(which reserves the cache within the stage's KV budget, or raises
``KvCacheUnavailable``) to ``close_run``. ``execute_batch`` runs at most one step of
each of several runs in one call, each at its run's own positions against its run's own
cache, and returns one result per step. ``execute_step`` is the single-run path of the
MVP, one step of the run ``configure`` was given, the same for every worker
(``SingleRunSteps``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar, Protocol

import numpy as np
import numpy.typing as npt
from attrs import frozen

from runplan import GgufSource, ProvisionStage, WorkerCapabilities
from runplan.picklable_error import PicklableError

#: ``progress(done, total)``: bytes of weights loaded so far, for progress bars.
Progress = Callable[[int, int], None]
#: ``trace(name, **fields)``: one of a worker's own events (the CUDA worker's graph
#: capture, say), an instant in its stage's trace. Every worker takes one at
#: construction (``trace=``; ``None``: not traced); the stage process passes its trace's.
TraceEvent = Callable[..., None]


@frozen
class TokenOutput:
    """What the last stage's step produces: one sampled token id, and the raw logits
    (float32, ``n_vocab``, before temperature / top-k / top-p) when the run asks."""

    token_id: int
    logits: npt.NDArray[np.float32] | None = None


class WorkerError(RuntimeError):
    """A worker that cannot set up or cannot run a step. The controller turns it into
    a setup fault or ``StepFailed(reason)``; ``reason`` is ``str(error)``."""


class KvCacheUnavailable(PicklableError, WorkerError):
    """``open_run`` found no room for the run's KV cache in the stage's budget: nothing
    was reserved. ``needed_bytes > budget_bytes`` means the run never fits."""

    def __init__(self, run_id: str, needed_bytes: int, free_bytes: int, budget_bytes: int) -> None:
        self.run_id = run_id
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes
        self.budget_bytes = budget_bytes
        super().__init__(
            f"run {run_id!r}: its KV cache needs {needed_bytes} bytes, {free_bytes} of the "
            f"stage's {budget_bytes} are free"
        )


@frozen
class BatchStep:
    """One run's step in a batch: its run, sequence and chunk (0 of 1 but for a chunked
    prefill) and its input: u32 token ids ``(rows,)`` on the first stage, activations
    ``(rows, hidden_dim)`` in the plan's dtype elsewhere."""

    run_id: str
    sequence: int
    chunk_index: int
    chunk_count: int
    data: npt.NDArray[np.generic]

    @property
    def is_last_chunk(self) -> bool:
        return self.chunk_index + 1 == self.chunk_count


@frozen
class StepFailure:
    """One run's step failed (out of order, past its cache, bad ids, non-finite logits):
    that run is faulted; the batch's other results stand."""

    detail: str


#: One step's result: activations ``(rows, hidden_dim)`` on a stage that is not the
#: last; on the last, a ``TokenOutput`` for a decode step or the last chunk of the
#: prefill, ``None`` for its other chunks (nothing is published); ``StepFailure``.
StepResult = npt.NDArray[np.generic] | TokenOutput | StepFailure | None


class StepWorker(Protocol):
    """The single-run path (the MVP's worker interface): what ``StageController`` and
    the wrappers that play faults in tests need.

    - ``configure(provision)``: the stage's model facts, layer range, first / last,
      and (last stage) sampling and ``return_logits``, all from its provision.
    - ``bind(gguf_source, progress)``: load exactly the tensors of the range (plus the
      token embedding on the first stage, the output norm and head on the last).
    - ``execute_step(sequence, data)``: ``data`` is u32 token ids ``(rows,)`` on the
      first stage and activations ``(rows, hidden_dim)`` in the plan's dtype
      elsewhere. Sequence 0 is prefill over all rows at positions ``0..rows-1``;
      sequence ``k > 0`` decodes one row at position ``prompt_len + k - 1``,
      appending to the run's KV cache. Returns activations ``(rows, hidden_dim)``
      in the plan's dtype, or on the last stage a ``TokenOutput`` for the last row.
      Raises ``WorkerError`` if called before ``bind`` completed or if the step fails.
    - ``release()``: frees every per-run object; the worker may be configured again.
    """

    capabilities: ClassVar[WorkerCapabilities]

    def configure(self, provision: ProvisionStage) -> None: ...

    def bind(self, gguf_source: GgufSource, progress: Progress | None = None) -> None: ...

    def execute_step(
        self, sequence: int, data: npt.NDArray[np.generic]
    ) -> npt.NDArray[np.generic] | TokenOutput: ...

    def release(self) -> None: ...


class Worker(StepWorker, Protocol):
    """One stage's compute engine for a chain of runs.

    - ``configure(provision)`` is chain-level: the stage's facts of the provision
      (model, layer range, first / last, dtype, ``max_seq_len``, ``kv_budget_bytes``);
      the run's own fields are not kept. Configuring again with the same stage facts
      keeps the open runs; other facts need every run closed (``WorkerError``).
    - ``bind(gguf_source, progress)``: the weights, kept across runs (``kept_weights``).
    - ``open_run(provision)``: reserve the run's KV cache for ``provision.kv_positions``
      positions (``provision.kv_bytes`` of the budget), make its sampler and cursor
      (sequence 0, chunk 0, position 0). ``KvCacheUnavailable`` when the budget has not
      the room (nothing changes); ``WorkerError`` for a run already open or before bind.
    - ``execute_batch(steps)``: at most one step per run, one result per step in order
      (``StepResult``). Each step runs at its run's next position against its run's
      cache; a run's results do not depend on the other steps of the batch, nor on how
      its prefill is chunked (the reference worker within 1e-5, compiled workers
      bit-identical). A failure of one run's step is its ``StepFailure`` (its cursor
      does not move); an exception means the worker failed as a whole.
    - ``close_run(run_id)``: free the run's cache and sampler (a no-op for a run not
      open); ``release()`` closes every run, the weights stay.
    - ``kv_reserved_bytes``: what the open runs' caches hold of the budget.
    """

    @property
    def kv_reserved_bytes(self) -> int: ...

    def open_run(self, provision: ProvisionStage) -> None: ...

    def execute_batch(self, steps: Sequence[BatchStep]) -> tuple[StepResult, ...]: ...

    def close_run(self, run_id: str) -> None: ...


def step_position(
    sequence: int, next_sequence: int | None, next_pos: int, rows: int, max_seq_len: int
) -> int:
    """Where step ``sequence`` of ``rows`` rows starts in the KV cache, by the worker
    interface's rules; ``WorkerError`` for a step out of order, a decode step of more
    than one row, an empty step, or one past ``max_seq_len``. ``next_sequence`` is
    ``None`` before the first prefill."""
    if sequence == 0:
        pos = 0
    elif sequence != next_sequence:
        expected = "0 (a prefill)" if next_sequence is None else str(next_sequence)
        raise WorkerError(f"step {sequence} out of order: expected {expected}")
    else:
        pos = next_pos
        if rows != 1:
            raise WorkerError(f"decode step {sequence} carries {rows} rows, expected 1")
    if rows < 1:
        raise WorkerError(f"step {sequence} carries no rows")
    if pos + rows > max_seq_len:
        raise WorkerError(
            f"step {sequence} needs positions up to {pos + rows}, the run's "
            f"max_seq_len is {max_seq_len}"
        )
    return pos


def checked_token_ids(data: npt.NDArray[np.generic], vocab: int) -> npt.NDArray[np.int64]:
    """The first stage's input as int64 ids; ``WorkerError`` unless it is a 1-d integer
    array of ids in ``0..vocab - 1``."""
    if data.ndim != 1 or not np.issubdtype(data.dtype, np.integer):
        raise WorkerError(f"the first stage takes token ids (rows,), got {data.dtype} {data.shape}")
    ids = data.astype(np.int64)
    if ((ids < 0) | (ids >= vocab)).any():
        raise WorkerError(f"token ids outside 0..{vocab - 1}: {data.tolist()}")
    return ids
