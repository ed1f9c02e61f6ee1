"""The NumPy reference worker (EDGES_AND_WORKERS.md §4): runs one stage on the CPU.

Weights are dequantized to float32 at ``bind`` (only the stage's own tensors, see
``gguf_slice``); the residual stream inside the stage is float32; activations leave
and enter the stage in the plan's dtype (``activations``). The KV cache holds
``max_seq_len`` positions of the stage's blocks in float32.

Each run on the chain (``open_run`` .. ``close_run``) has its own KV cache of its
``kv_positions`` positions and its own sampler, over the stage's one copy of the
weights. ``execute_batch`` runs each step of a batch in turn, each at its run's own
positions (the oracle: the loop is the batch); sequence 0 is the prefill at positions
``0..``, whole or in chunks, each chunk after the rows of the one before; sequence
``k > 0`` decodes one row at position ``prompt_len + k - 1``. The last stage samples
from the raw logits of the last row of a decode step or of the prefill's last chunk and
returns a ``TokenOutput`` (with the logits when the run asks for them); the prefill's
other chunks give ``None``.

Weights outlive a run (``kept_weights``): ``release`` closes every run and keeps the
dequantized weights; a later ``bind`` whose source and layer range match uses them
again (``weights_reused``). ``forget_weights`` lets them go.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import attrs
import numpy as np
import numpy.typing as npt

from runplan import GgufSource, ProvisionStage, SamplingConfig, WorkerCapabilities
from runplan.gguf_error import GgufError
from runtime_core import activations
from runtime_core.errors import UnsupportedModel
from runtime_core.gguf_slice import open_provisioned_slice
from runtime_core.workers.interface import (
    BatchStep,
    Progress,
    StepFailure,
    StepResult,
    TokenOutput,
    TraceEvent,
    WorkerError,
    checked_token_ids,
)
from runtime_core.workers.kept_weights import WeightsKey, weights_key
from runtime_core.workers.reference.model import StageModel
from runtime_core.workers.reference.weights import StageWeights
from runtime_core.workers.sampling import Sampler
from runtime_core.workers.worker_runs import (
    KvBudget,
    RunCursor,
    SingleRunSteps,
    rows_of,
    same_stage,
)


@attrs.frozen
class _Held:
    """Weights bound for one stage's slice, kept across runs; ``model`` is their
    forward pass with its rotary tables (each run's model shares them)."""

    key: WeightsKey
    weights: StageWeights
    vocab_size: int
    model: StageModel


@attrs.define
class _Run:
    """One run's state: the model over the held weights with the run's KV cache, its
    sampler (last stage), and where its steps stand."""

    provision: ProvisionStage
    model: StageModel
    sampler: Sampler | None
    cursor: RunCursor


class ReferenceWorker(SingleRunSteps):
    """One stage's compute engine in NumPy. Implements ``runtime_core.workers.interface.Worker``."""

    capabilities: ClassVar[WorkerCapabilities] = WorkerCapabilities()

    def __init__(self, *, trace: TraceEvent | None = None) -> None:
        self.trace = trace  # the reference worker has no events of its own to trace
        self._provision: ProvisionStage | None = None  # the stage, from configure
        self._bound = False  # bind completed for the stage
        self._held: _Held | None = None
        self._runs: dict[str, _Run] = {}
        self._budget = KvBudget()
        self.weights_reused = False  # the last bind used weights already held

    # -- Worker: the chain ---------------------------------------------------------------
    def configure(self, provision: ProvisionStage) -> None:
        if provision.model.architecture not in self.capabilities.architectures:
            raise WorkerError(
                f"architecture {provision.model.architecture!r} is not one the "
                f"{self.capabilities.name} worker runs"
            )
        try:
            activations.edge_dtype(provision.model.dtype_family, provision.model.dtype_width_bytes)
        except ValueError as exc:
            raise WorkerError(str(exc)) from exc
        same = self._provision is not None and same_stage(self._provision, provision)
        if self._runs and not same:
            raise WorkerError(
                f"configure for another stage while runs {sorted(self._runs)} are open"
            )
        self._provision = provision
        self._budget.budget_bytes = provision.kv_budget_bytes
        self._bound = self._bound and same

    def bind(self, gguf_source: GgufSource, progress: Progress | None = None) -> None:
        """Load the stage's tensors, or use those held when they are the same slice of
        the same file. A file that cannot be run raises ``WorkerError`` whose
        ``__cause__`` is the typed ``UnsupportedModel`` or ``GgufError``; the worker
        then stays unbound."""
        p = self._provision
        if p is None:
            raise WorkerError("bind before configure")
        key = weights_key(gguf_source, p)
        held = self._held
        self.weights_reused = held is not None and held.key.reusable_for(key)
        if held is None or not self.weights_reused:
            if self._runs:
                raise WorkerError(f"bind other weights while runs {sorted(self._runs)} are open")
            self._bound = False
            self._held = held = None  # the old weights go before new ones are read
            try:
                with open_provisioned_slice(gguf_source, p, self.capabilities) as stage:
                    weights = StageWeights.load(stage, progress)
                    vocab = stage.vocab_size
            except (UnsupportedModel, GgufError, ValueError, OSError) as exc:
                raise WorkerError(f"stage {p.stage_index}: {exc}") from exc
            model = StageModel(weights, p.model.max_seq_len, positions=0)
            held = self._held = _Held(key, weights, vocab, model)
        elif held.model.max_seq_len != p.model.max_seq_len:  # the rotary tables' length
            model = StageModel(held.weights, p.model.max_seq_len, positions=0)
            held = self._held = attrs.evolve(held, model=model)
        if p.is_last:  # the run's sampler is made at open_run; its settings fail here
            try:
                Sampler.for_run(p.sampling or SamplingConfig())
            except ValueError as exc:
                raise WorkerError(f"stage {p.stage_index}: {exc}") from exc
        self._bound = True

    @property
    def single_run(self) -> ProvisionStage | None:
        """The run of the single-run path: the provision configure was given, once
        bound."""
        return self._provision if self._bound else None

    @property
    def kv_reserved_bytes(self) -> int:
        return self._budget.reserved_bytes

    def release(self) -> None:
        """The chain's end: every run closes, the provision goes; the weights stay."""
        for run_id in list(self._runs):
            self.close_run(run_id)
        self._provision = None
        self._bound = False

    def forget_weights(self) -> None:
        """Let the held weights go (the next ``bind`` reads the file)."""
        if self._runs:
            raise WorkerError(f"forget the weights while runs {sorted(self._runs)} are open")
        self._held = None
        self._bound = False
        self.weights_reused = False

    # -- Worker: the runs ----------------------------------------------------------------
    def open_run(self, provision: ProvisionStage) -> None:
        p, held = self._provision, self._held
        if p is None or held is None or not self._bound:
            raise WorkerError(f"open_run({provision.run_id!r}) before bind completed")
        if not same_stage(p, provision):
            raise WorkerError(f"run {provision.run_id!r} is provisioned for another stage")
        sampler = None
        if provision.is_last:
            try:
                sampler = Sampler.for_run(provision.sampling or SamplingConfig())
            except ValueError as exc:
                raise WorkerError(f"run {provision.run_id!r}: {exc}") from exc
        positions = provision.kv_positions
        self._budget.reserve(provision.run_id, provision.kv_bytes)  # KvCacheUnavailable
        try:
            model = held.model.for_run(positions)
        except MemoryError as exc:
            self._budget.free(provision.run_id)
            raise WorkerError(f"run {provision.run_id!r}: no memory for its cache") from exc
        cursor = RunCursor(positions, provision.model.max_seq_len)
        self._runs[provision.run_id] = _Run(provision, model, sampler, cursor)

    def run_is_open(self, run_id: str) -> bool:
        return run_id in self._runs

    def close_run(self, run_id: str) -> None:
        self._runs.pop(run_id, None)
        self._budget.free(run_id)

    def execute_batch(self, steps: Sequence[BatchStep]) -> tuple[StepResult, ...]:
        """Each step in turn, each against its own run (the oracle's batch is a loop)."""
        if self._provision is None or self._held is None or not self._bound:
            raise WorkerError("execute_batch before bind completed")
        runs = [s.run_id for s in steps]
        if len(set(runs)) != len(runs):
            raise WorkerError(f"a batch takes one step per run, got {runs}")
        return tuple(self._step(s) for s in steps)

    def _step(self, step: BatchStep) -> StepResult:
        run = self._runs.get(step.run_id)
        if run is None:
            return StepFailure(f"run {step.run_id!r} is not open on this stage")
        p, held = run.provision, self._held
        assert held is not None
        try:
            rows = rows_of(step.data)
        except WorkerError as exc:
            return StepFailure(str(exc))
        pos = run.cursor.place(step, rows)
        if isinstance(pos, StepFailure):
            return pos
        edge = activations.edge_dtype(p.model.dtype_family, p.model.dtype_width_bytes)
        try:
            if p.is_first:
                ids = checked_token_ids(step.data, held.vocab_size)
                x = run.model.embed(ids.astype(np.intp))
            else:
                x = activations.decode(self._activation_rows(step.data, p.model.hidden_dim), edge)
            x = run.model.forward(x, pos)
            result: StepResult
            if not p.is_last:
                result = activations.encode(x, edge)
            elif step.sequence == 0 and not step.is_last_chunk:
                result = None  # only the prefill's last row reaches the head
            else:
                assert run.sampler is not None
                logits = run.model.logits(x[-1:])
                token = run.sampler.sample(logits)
                result = TokenOutput(token, logits if p.return_logits else None)
        except WorkerError as exc:
            return StepFailure(str(exc))
        except (ValueError, FloatingPointError, MemoryError) as exc:
            return StepFailure(f"step {step.sequence} failed: {exc}")
        run.cursor.advance(step, rows)
        return result

    # -- checks -------------------------------------------------------------------
    @staticmethod
    def _activation_rows(data: npt.NDArray[np.generic], hidden: int) -> npt.NDArray[np.generic]:
        if data.ndim != 2 or data.shape[1] != hidden:
            raise WorkerError(f"activations of shape {data.shape}, expected (rows, {hidden})")
        return data
