"""A stage worker whose weights stay as the GGUF file stores them, over a backend.

``StageWorker`` holds the worker interface (EDGES_AND_WORKERS.md §4) for every worker
that runs ``forward_program.py``'s forward pass on a backend of its own: the checks of the
interface, the sequence and position, the edges' dtypes, the sampling state. A
``StageBackend`` holds the weights and runs the steps: the CUDA worker's
``runtime_cupy.cuda.backend.DeviceBackend``, and the NumPy twin of its kernels
(``tests/support/twin_stage.py``), which runs the same program on the CPU so that all
of this is tested on any host.

Options common to every backend:

- ``matvec``: ``"q8"`` (default) runs one-row products of quantized matrices on
  8-bit activations with integer dot products, as llama.cpp does; ``"f32"``
  multiplies the dequantized weights with float32 activations (slower, and closest to
  the NumPy reference worker).
- ``kv_dtype``: ``"auto"`` (default: the width the plan counted the cache at,
  ``StageModelFacts.kv_dtype_width_bytes``: float32 for 4 bytes, float16 for 2),
  ``"f16"`` or ``"f32"`` (bind refuses one wider than the plan counted: the stage's KV
  budget would not hold it).

Runs (CONCURRENT_RUNS.md): each run on the chain (``open_run`` .. ``close_run``) has
its own KV cache on the backend (``new_cache`` for its ``kv_positions`` positions),
sampler and cursor. ``execute_batch`` checks each step (order, positions, token ids,
activations: a bad one is that step's ``StepFailure``), then hands the backend the
others in one call, ``run_batch``: each a ``BackendStep`` (its run's cache, input,
first position, whether its last row needs a token). The CPU and CUDA backends run them
as one step of all their rows (``forward_program.py``: each weight read once per
batch), each row's arithmetic independent of the others, so a run's results do not
depend on its batch. Then per step, in order: its activations, or its token (its
run's sampler drawing where it samples) and logits.

Weights outlive a run (``runtime_core.workers.kept_weights``): ``release`` closes every
run and keeps the backend with its weights; a later ``bind`` for the same slice of the
same file, with the same backend settings and rotary length, uses that backend again
(``weights_reused``) instead of loading. ``forget_weights`` releases the backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import attrs
import numpy as np
import numpy.typing as npt

from runplan import GgufSource, ProvisionStage, SamplingConfig, WorkerCapabilities
from runplan.gguf_error import GgufError
from runtime_core import activations
from runtime_core.errors import UnsupportedModel
from runtime_core.gguf_slice import StageSlice, open_provisioned_slice
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
from runtime_core.workers.sampling import Sampler
from runtime_core.workers.worker_runs import (
    KvBudget,
    RunCursor,
    SingleRunSteps,
    rows_of,
    same_stage,
)

MATVEC_MODES = ("q8", "f32")
KV_DTYPES = ("auto", "f16", "f32")


@attrs.frozen
class BackendStep:
    """One run's step in a batch, as a backend runs it: ``data`` (the first stage's
    int32 token ids, else activations of the edge's dtype, ``rows`` rows) at positions
    ``pos ..`` of the run's KV cache ``cache`` (from ``new_cache``); ``head``: the last
    stage computes its last row's logits and token; ``prompt``: the rows are the run's
    prompt (its prefill, or a chunk of it), not a generated token's."""

    cache: Any
    data: Any
    rows: int
    pos: int
    head: bool
    prompt: bool = False


class StageBackend(Protocol):
    """Where a stage's weights live and its steps run: a batch of runs' steps in one
    ``run_batch``, then each step's outputs by its index in the batch."""

    def load(self, stage: StageSlice, max_seq_len: int, progress: Progress | None) -> None: ...

    def new_cache(self, positions: int) -> Any: ...

    def free_cache(self, cache: Any) -> None: ...

    def run_batch(self, steps: Sequence[BackendStep]) -> None: ...

    def activations_of(self, index: int) -> Any:
        """Step ``index``'s output rows (a stage before the last)."""
        ...

    def token_of(self, index: int) -> tuple[int, int]:
        """Step ``index``'s greedy token and its count of non-finite logits (a head step)."""
        ...

    def logits_of(self, index: int) -> npt.NDArray[np.float32]:
        """Step ``index``'s logits, a host copy (a head step)."""
        ...

    def sample_of(self, index: int, config: SamplingConfig, u: float) -> int:
        """Step ``index``'s token drawn from its logits with the uniform ``u``."""
        ...

    def to_host(self, data: Any) -> npt.NDArray[np.generic]: ...

    def release(self) -> None: ...


@attrs.frozen
class BackendSpec:
    """What a backend needs to know of the stage beyond its tensors."""

    is_first: bool
    is_last: bool
    edge_dtype: np.dtype[np.generic]  # activations on the edges (runtime_core.activations)
    kv_dtype: str  # "f16" or "f32"
    matvec: str  # "q8" or "f32"


@attrs.frozen
class _Held:
    """A loaded backend, kept across runs."""

    key: WeightsKey
    backend: StageBackend
    vocab_size: int


@attrs.define
class _Run:
    """One run's state over the held backend: its provision, KV cache, sampler (last
    stage) and cursor."""

    provision: ProvisionStage
    cache: Any
    sampler: Sampler | None
    cursor: RunCursor


#: the KV cache's dtypes and their element widths, both ways
KV_WIDTHS = {"f32": 4, "f16": 2}
KV_OF_WIDTH = {width: name for name, width in KV_WIDTHS.items()}


def kv_dtype_for(option: str, counted_width: int) -> str:
    """The KV cache's dtype: the one asked for, or (``"auto"``) the one of the width the
    plan counted. ``WorkerError`` where the plan counted a width no cache has, or fewer
    bytes than the one asked for takes."""
    dtype = KV_OF_WIDTH.get(counted_width)
    if dtype is None:
        raise WorkerError(
            f"the plan counts the KV cache at {counted_width} bytes an element: a worker "
            "holds it in float32 (4) or float16 (2)"
        )
    if option == "auto":
        return dtype
    if KV_WIDTHS[option] > counted_width:
        raise WorkerError(
            f"kv_dtype {option!r} takes {KV_WIDTHS[option]} bytes an element, and the plan "
            f"counts the stage's KV budget at {counted_width} ({dtype}): plan with a worker "
            f"whose kv_bytes_per_element is {KV_WIDTHS[option]}"
        )
    return option


class StageWorker(SingleRunSteps):
    """The interface logic of a stage worker over a ``StageBackend``."""

    capabilities: ClassVar[WorkerCapabilities]

    def __init__(
        self, *, matvec: str = "q8", kv_dtype: str = "auto", trace: TraceEvent | None = None
    ) -> None:
        if matvec not in MATVEC_MODES:
            raise ValueError(f"matvec {matvec!r} is not one of {MATVEC_MODES}")
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype {kv_dtype!r} is not one of {KV_DTYPES}")
        self.matvec = matvec
        self.kv_dtype = kv_dtype
        self.trace = trace  # the backend's own events (interface.TraceEvent)
        self._provision: ProvisionStage | None = None  # the stage, from configure
        self._bound = False
        self._held: _Held | None = None
        self._runs: dict[str, _Run] = {}
        self._budget = KvBudget()
        self.weights_reused = False  # the last bind used the backend already held

    def _make_backend(self, spec: BackendSpec) -> StageBackend:
        raise NotImplementedError

    def _check_stage(self, stage: StageSlice) -> None:
        """Refuse, with ``UnsupportedModel``, a checked slice this worker's backend
        cannot run (before anything is loaded). Every slice passes by default."""

    # -- Worker: the chain ---------------------------------------------------------------
    def configure(self, provision: ProvisionStage) -> None:
        if provision.model.architecture not in self.capabilities.architectures:
            refusal = UnsupportedModel(
                str(provision.gguf_source),
                f"architecture {provision.model.architecture!r} is not one the "
                f"{self.capabilities.name} worker runs "
                f"({', '.join(self.capabilities.architectures)})",
                key="general.architecture",
            )
            raise WorkerError(str(refusal)) from refusal
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
        """Load the stage's tensors onto a backend, or use the backend held when it has
        the same slice of the same file with the same settings. A file that cannot be
        run raises ``WorkerError`` whose ``__cause__`` is the typed ``UnsupportedModel``
        or ``GgufError``; the worker then stays unbound."""
        p = self._provision
        if p is None:
            raise WorkerError("bind before configure")
        edge = activations.edge_dtype(p.model.dtype_family, p.model.dtype_width_bytes)
        if p.is_last:
            try:
                # the reference's checks of the settings
                Sampler.for_run(p.sampling or SamplingConfig())
            except ValueError as exc:
                raise WorkerError(f"stage {p.stage_index}: {exc}") from exc
        spec = BackendSpec(
            is_first=p.is_first,
            is_last=p.is_last,
            edge_dtype=edge,
            kv_dtype=kv_dtype_for(self.kv_dtype, p.model.kv_dtype_width_bytes),
            matvec=self.matvec,
        )
        key = weights_key(gguf_source, p, (spec, p.model.max_seq_len))
        held = self._held
        self.weights_reused = held is not None and held.key.reusable_for(key)
        if held is None or not self.weights_reused:
            if self._runs:
                raise WorkerError(f"bind other weights while runs {sorted(self._runs)} are open")
            self._bound = False
            self.forget_weights()  # the old backend goes before a new one loads
            held = self._held = _Held(key, *self._load(gguf_source, p, spec, progress))
        self._bound = True

    def _load(
        self,
        gguf_source: GgufSource,
        p: ProvisionStage,
        spec: BackendSpec,
        progress: Progress | None,
    ) -> tuple[StageBackend, int]:
        backend: StageBackend | None = None
        try:
            with open_provisioned_slice(gguf_source, p, self.capabilities) as stage:
                self._check_stage(stage)
                backend = self._make_backend(spec)
                backend.load(stage, p.model.max_seq_len, progress)
                return backend, stage.vocab_size
        except WorkerError:
            if backend is not None:
                backend.release()
            raise
        except (UnsupportedModel, GgufError, ValueError, OSError, MemoryError, RuntimeError) as exc:
            if backend is not None:
                backend.release()
            raise WorkerError(f"stage {p.stage_index}: {exc}") from exc
        except BaseException:
            if backend is not None:
                backend.release()
            raise

    @property
    def single_run(self) -> ProvisionStage | None:
        """The run of the single-run path: the provision configure was given, once
        bound."""
        return self._provision if self._bound else None

    @property
    def kv_reserved_bytes(self) -> int:
        return self._budget.reserved_bytes

    def release(self) -> None:
        """The chain's end: every run closes (its cache, sequence, sampling state); the
        backend and its weights stay for the next run of the same slice."""
        for run_id in list(self._runs):
            self.close_run(run_id)
        self._provision = None
        self._bound = False

    def forget_weights(self) -> None:
        """Release the held backend (the next ``bind`` loads)."""
        for run_id in list(self._runs):
            self.close_run(run_id)
        self._bound = False
        self.weights_reused = False
        if self._held is not None:
            held, self._held = self._held, None
            held.backend.release()

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
        self._budget.reserve(provision.run_id, provision.kv_bytes)  # KvCacheUnavailable
        try:
            cache = held.backend.new_cache(provision.kv_positions)
        except (MemoryError, RuntimeError, ValueError) as exc:
            self._budget.free(provision.run_id)
            raise WorkerError(f"run {provision.run_id!r}: its KV cache: {exc}") from exc
        cursor = RunCursor(provision.kv_positions, provision.model.max_seq_len)
        self._runs[provision.run_id] = _Run(provision, cache, sampler, cursor)

    def run_is_open(self, run_id: str) -> bool:
        return run_id in self._runs

    def close_run(self, run_id: str) -> None:
        run = self._runs.pop(run_id, None)
        self._budget.free(run_id)
        if run is not None and self._held is not None:
            self._held.backend.free_cache(run.cache)

    def execute_batch(self, steps: Sequence[BatchStep]) -> tuple[StepResult, ...]:
        if self._provision is None or self._held is None or not self._bound:
            raise WorkerError("execute_batch before bind completed")
        runs = [s.run_id for s in steps]
        if len(set(runs)) != len(runs):
            raise WorkerError(f"a batch takes one step per run, got {runs}")
        return self._run_steps(steps)

    def _run_steps(self, steps: Sequence[BatchStep]) -> tuple[StepResult, ...]:
        """The batch's steps: each checked against its run, those that pass run in one
        ``run_batch``, then each one's output in order."""
        held = self._held
        assert held is not None
        results: list[StepResult] = [None] * len(steps)
        ready: list[tuple[int, _Run, BackendStep]] = []
        for i, step in enumerate(steps):
            prepared = self._prepare(step, held)
            if isinstance(prepared, StepFailure):
                results[i] = prepared
            else:
                ready.append((i, *prepared))
        if not ready:
            return tuple(results)
        b = held.backend
        try:
            b.run_batch([backend_step for _, _, backend_step in ready])
        except (ValueError, FloatingPointError, MemoryError, RuntimeError) as exc:
            for i, _, _ in ready:  # one computation: every step of it failed
                results[i] = StepFailure(f"step {steps[i].sequence} failed: {exc}")
            return tuple(results)
        for index, (i, run, backend_step) in enumerate(ready):
            results[i] = self._output(steps[i], run, backend_step, index, b)
        return tuple(results)

    def _prepare(self, step: BatchStep, held: _Held) -> tuple[_Run, BackendStep] | StepFailure:
        """``step`` as its backend runs it, or why it cannot run."""
        run = self._runs.get(step.run_id)
        if run is None:
            return StepFailure(f"run {step.run_id!r} is not open on this stage")
        p, b = run.provision, held.backend
        try:
            rows = rows_of(step.data)
        except WorkerError as exc:
            return StepFailure(str(exc))
        pos = run.cursor.place(step, rows)
        if isinstance(pos, StepFailure):
            return pos
        head = p.is_last and (step.sequence > 0 or step.is_last_chunk)  # only then the head
        data: Any
        try:
            if p.is_first:
                data = checked_token_ids(b.to_host(step.data), held.vocab_size).astype(np.int32)
            else:
                self._check_activations(step.data, p.model.hidden_dim, p)
                data = step.data
        except WorkerError as exc:
            return StepFailure(str(exc))
        return run, BackendStep(run.cache, data, rows, pos, head, prompt=step.sequence == 0)

    def _output(
        self, step: BatchStep, run: _Run, backend_step: BackendStep, index: int, b: StageBackend
    ) -> StepResult:
        """Step ``index`` of the batch that ran: its output; its run's cursor moves on."""
        result: StepResult
        try:
            if not run.provision.is_last:
                result = b.activations_of(index)
            elif not backend_step.head:
                result = None
            else:
                result = self._token(run, b, index)
        except WorkerError as exc:
            return StepFailure(str(exc))
        except (ValueError, FloatingPointError, MemoryError, RuntimeError) as exc:
            return StepFailure(f"step {step.sequence} failed: {exc}")
        run.cursor.advance(step, backend_step.rows)
        return result

    # -- checks ---------------------------------------------------------------------
    @staticmethod
    def _check_activations(data: Any, hidden: int, p: ProvisionStage) -> None:
        edge = activations.edge_dtype(p.model.dtype_family, p.model.dtype_width_bytes)
        if data.ndim != 2 or data.shape[1] != hidden:
            raise WorkerError(f"activations of shape {data.shape}, expected (rows, {hidden})")
        if data.dtype != edge:
            raise WorkerError(f"activations of dtype {data.dtype}, the edge carries {edge}")

    @staticmethod
    def _token(run: _Run, b: StageBackend, index: int) -> TokenOutput:
        token, bad = b.token_of(index)
        if bad:
            raise WorkerError(f"the logits hold {bad} NaN or infinite values")
        sampler = run.sampler
        assert sampler is not None
        if sampler.config.temperature > 0.0:
            token = b.sample_of(index, sampler.config, sampler.uniform())
        return TokenOutput(token, b.logits_of(index) if run.provision.return_logits else None)
