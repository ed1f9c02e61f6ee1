"""What every worker keeps per run, written once for all of them: the run's share of
the stage's KV budget (``KvBudget``), where its steps stand (``RunCursor``: sequence,
chunk, position, by the worker interface's rules), and the single-run path of the MVP
over the batched interface (``SingleRunSteps``).

A worker's ``configure`` sets the budget (``ProvisionStage.kv_budget_bytes``) and names
the run of its single-run path; ``open_run`` reserves ``provision.kv_bytes`` of the
budget for the run (the planner's count of the cache the worker makes for
``kv_positions`` positions) and makes its cursor; each step of ``execute_batch`` is
checked and placed by the cursor, which moves only when the step succeeded;
``close_run`` gives the reservation back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs
import numpy as np
import numpy.typing as npt

from runplan import ProvisionStage
from runtime_core.workers.interface import (
    BatchStep,
    KvCacheUnavailable,
    StepFailure,
    StepResult,
    TokenOutput,
    WorkerError,
)


def stage_facts(provision: ProvisionStage) -> tuple[object, ...]:
    """What a provision says of the stage, as opposed to the run: every run a worker
    serves at once is provisioned for the same stage facts."""
    p = provision
    return (
        p.gguf_source,
        p.stage_index,
        p.stage_count,
        p.node_id,
        p.layer_start,
        p.layer_end_exclusive,
        p.model,
        p.kv_budget_bytes,
        p.max_batch_rows,
        p.inbound.kind,
        p.outbound.kind,
    )


def same_stage(a: ProvisionStage, b: ProvisionStage) -> bool:
    """Whether two provisions are for the same stage of one chain."""
    return stage_facts(a) == stage_facts(b)


class KvBudget:
    """A stage's KV-cache budget and the runs' reservations in it."""

    def __init__(self, budget_bytes: int = 0) -> None:
        self.budget_bytes = budget_bytes
        self._reserved: dict[str, int] = {}

    @property
    def reserved_bytes(self) -> int:
        return sum(self._reserved.values())

    @property
    def free_bytes(self) -> int:
        return max(0, self.budget_bytes - self.reserved_bytes)

    @property
    def runs(self) -> frozenset[str]:
        return frozenset(self._reserved)

    def reserve(self, run_id: str, needed_bytes: int) -> None:
        """Reserve ``needed_bytes`` for ``run_id``; ``KvCacheUnavailable`` (nothing
        reserved) when the budget has not the room."""
        if run_id in self._reserved:
            raise WorkerError(f"run {run_id!r} is already open on this stage")
        free = self.free_bytes
        if needed_bytes > free:
            raise KvCacheUnavailable(run_id, needed_bytes, free, self.budget_bytes)
        self._reserved[run_id] = needed_bytes

    def free(self, run_id: str) -> None:
        self._reserved.pop(run_id, None)


@attrs.define
class RunCursor:
    """Where a run's steps stand: the next sequence, the next chunk of the prefill and
    the chunk count its chunk 0 gave, the next position, and the positions its cache
    holds."""

    positions: int
    max_seq_len: int
    next_sequence: int = 0
    next_chunk: int = 0
    chunk_count: int = 1
    next_pos: int = 0

    def place(self, step: BatchStep, rows: int) -> int | StepFailure:
        """Where ``step`` of ``rows`` rows starts in the run's cache, or why it cannot
        run: out of order (sequence or chunk), a decode step of more than one row or
        chunked, an empty step, or one past the run's positions."""
        seq, chunk, count = step.sequence, step.chunk_index, step.chunk_count
        if seq != self.next_sequence:
            expected = "0 (a prefill)" if self.next_sequence == 0 else str(self.next_sequence)
            return StepFailure(f"step {seq} out of order: expected {expected}")
        if seq == 0:
            if chunk != self.next_chunk or (chunk > 0 and count != self.chunk_count):
                return StepFailure(
                    f"prefill chunk {chunk} of {count} out of order: expected chunk "
                    f"{self.next_chunk}" + (f" of {self.chunk_count}" if self.next_chunk else "")
                )
        elif count != 1 or chunk != 0:
            return StepFailure(f"decode step {seq} is chunk {chunk} of {count}, expected 0 of 1")
        elif rows != 1:
            return StepFailure(f"decode step {seq} carries {rows} rows, expected 1")
        if rows < 1:
            return StepFailure(f"step {seq} carries no rows")
        end = self.next_pos + rows
        if end > self.positions:
            return StepFailure(
                f"step {seq} needs positions up to {end}, the run's KV cache holds "
                f"{self.positions} (max_seq_len {self.max_seq_len})"
            )
        return self.next_pos

    def advance(self, step: BatchStep, rows: int) -> None:
        """The step ran: the next chunk of the prefill, or the next sequence."""
        self.next_pos += rows
        if step.sequence == 0 and not step.is_last_chunk:
            self.chunk_count = step.chunk_count
            self.next_chunk = step.chunk_index + 1
        else:
            self.next_sequence = step.sequence + 1
            self.next_chunk = 0
            self.chunk_count = 1


def rows_of(data: object) -> int:
    """The rows of a step's input; ``WorkerError`` for what is not an array of rows."""
    shape = getattr(data, "shape", None)
    if shape is None or len(shape) < 1:
        raise WorkerError(f"a step carries an array of rows, got {type(data).__name__}")
    return int(shape[0])


class _BatchedWorker(Protocol):
    def open_run(self, provision: ProvisionStage) -> None: ...

    def execute_batch(self, steps: Sequence[BatchStep]) -> tuple[StepResult, ...]: ...

    def close_run(self, run_id: str) -> None: ...

    def run_is_open(self, run_id: str) -> bool: ...

    @property
    def single_run(self) -> ProvisionStage | None: ...


class SingleRunSteps:
    """``execute_step``, the MVP's single-run path, over the batched interface: one step
    of the run ``configure`` was given, opened at its prefill (a prefill starts the run
    afresh: its cache and sampler are made again), as a batch of one. A failed step
    raises ``WorkerError``."""

    def execute_step(
        self: _BatchedWorker, sequence: int, data: npt.NDArray[np.generic]
    ) -> npt.NDArray[np.generic] | TokenOutput:
        provision = self.single_run
        if provision is None:
            raise WorkerError(f"execute_step({sequence}) before bind completed")
        run_id = provision.run_id
        if sequence == 0:
            self.close_run(run_id)
            self.open_run(provision)
        elif not self.run_is_open(run_id):
            raise WorkerError(f"step {sequence} out of order: expected 0 (a prefill)")
        (result,) = self.execute_batch((BatchStep(run_id, sequence, 0, 1, data),))
        if isinstance(result, StepFailure):
            raise WorkerError(result.detail)
        if result is None:  # a whole prefill always reaches the head
            raise WorkerError(f"step {sequence} gave no output")
        return result
