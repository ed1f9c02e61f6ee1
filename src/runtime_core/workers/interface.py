"""The worker interface (EDGES_AND_WORKERS.md §4): the node-local compute engine of
one stage. The stage controller is its only caller; every runtime (the NumPy
reference worker, the CUDA worker, the simulator's synthetic worker) implements it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Protocol

import numpy as np
import numpy.typing as npt
from attrs import frozen

from runplan import GgufSource, ProvisionStage, WorkerCapabilities

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


class Worker(Protocol):
    """One stage's compute engine.

    - ``configure(provision)``: the stage's model facts, layer range, first / last,
      and (last stage) sampling and ``return_logits``, all from its provision.
    - ``bind(gguf_source, progress)``: load exactly the tensors of the range (plus the
      token embedding on the first stage, the output norm and head on the last).
    - ``execute_step(sequence, data)``: ``data`` is u32 token ids ``(rows,)`` on the
      first stage and activations ``(rows, hidden_dim)`` in the plan's dtype
      elsewhere. Sequence 0 is prefill over all rows at positions ``0..rows-1``;
      sequence ``k > 0`` decodes one row at position ``prompt_len + k - 1``,
      appending to the stage's KV cache. Returns activations ``(rows, hidden_dim)``
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
