"""The synthetic worker: no weights, deterministic pseudo-tokens. With the timing model
it lets the simulator run plans for models of any size (80 layers on 16 stages) in
milliseconds of real time. It keeps the worker interface's rules of a chain of runs
(each run's cursor and share of the KV budget, ``runtime_core.workers.worker_runs``): a run's
token at sequence ``k`` depends on its seed, its stream's position ``k`` and the token its
step's last row stands for (the token fed back, or the prompt's last), whatever its batch.
That token travels through every stage: the first writes each row's token id into the
row's first columns, a byte a column (``carry``: exact in every edge dtype), the others
pass what they read on (``carried``). So a batch that hands one run's rows to another
run's step changes that run's tokens, as it would a model's (the checker's batch
invariance, CONCURRENT_RUNS.md §3). A replay (``SamplingConfig.tokens_delivered = d``: the
stream already delivered ``d`` tokens) continues the stream: its token at sequence ``k`` is
the stream's token ``d + k``, as a resumed sampler continues its draws
(``Sampler.resumed``): its prompt ends with the last token delivered, the one the
interrupted run's step ``d`` was fed."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from runplan import GgufSource, ProvisionStage, WorkerCapabilities
from runplan.quant_types import QUANT_TYPES
from runtime_core.activations import edge_dtype
from runtime_core.workers.interface import (
    BatchStep,
    Progress,
    StepFailure,
    StepResult,
    TokenOutput,
    WorkerError,
)
from runtime_core.workers.worker_runs import (
    KvBudget,
    RunCursor,
    SingleRunSteps,
    rows_of,
    same_stage,
)

#: Types no worker runs yet, which the synthetic worker plans all the same.
NO_WORKER_TYPES = ("IQ2_XXS", "IQ3_S")
#: Runs any architecture and quant type: it never looks at the weights. It stands for a
#: worker that keeps weights as stored and its KV cache in the activation dtype.
SYNTHETIC_CAPABILITIES = WorkerCapabilities(
    name="synthetic",
    weight_bytes_per_element=0,
    kv_bytes_per_element=0,
    architectures=("llama", "qwen2", "mistral", "gemma", "phi3", "falcon"),
    quant_types=tuple(sorted({*QUANT_TYPES, *NO_WORKER_TYPES})),
)


#: Columns of a row of activations that carry its token id, a byte each.
ID_COLUMNS = 4


def pseudo_token(seed: int, sequence: int, fed: int, vocab: int) -> int:
    """The token at stream position ``sequence`` of a run of ``seed`` whose step's last
    row stands for token ``fed``."""
    digest = hashlib.blake2b(f"{seed}:{sequence}:{fed}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % vocab


def carry(
    ids: npt.NDArray[np.integer], hidden: int, dtype: np.dtype[np.generic]
) -> npt.NDArray[np.generic]:
    """Rows of activations that stand for token ``ids``: each id's bytes, low first, in
    the row's first ``ID_COLUMNS`` columns (values 0..255, exact in float32, float16 and
    bfloat16 bit patterns), zeros elsewhere."""
    rows = np.zeros((len(ids), hidden), dtype=dtype)
    n = min(ID_COLUMNS, hidden)
    shifts = np.arange(n, dtype=np.uint64) * np.uint64(8)
    rows[:, :n] = (np.asarray(ids, np.uint64)[:, None] >> shifts) & np.uint64(0xFF)
    return rows


def carried(rows: npt.NDArray[np.generic]) -> npt.NDArray[np.uint64]:
    """The token ids rows of activations stand for (``carry``'s inverse)."""
    n = min(ID_COLUMNS, rows.shape[1])
    shifts = np.arange(n, dtype=np.uint64) * np.uint64(8)
    ids: npt.NDArray[np.uint64] = (rows[:, :n].astype(np.uint64) << shifts).sum(
        axis=1, dtype=np.uint64
    )
    return ids


class SyntheticWorker(SingleRunSteps):
    capabilities: ClassVar[WorkerCapabilities] = SYNTHETIC_CAPABILITIES

    def __init__(
        self, vocab_size: int, eos_token_id: int | None = None, eos_after: int | None = None
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.eos_after = eos_after  # the stream position at which to emit EOS, if any
        self._provision: ProvisionStage | None = None
        self._bound = False
        self._rows_of: tuple[int, np.dtype[np.generic]] | None = None
        self._runs: dict[str, tuple[ProvisionStage, RunCursor]] = {}
        self._budget = KvBudget()

    def configure(self, provision: ProvisionStage) -> None:
        same = self._provision is not None and same_stage(self._provision, provision)
        if not same:
            self.release()
        self._provision = provision
        self._budget.budget_bytes = provision.kv_budget_bytes
        self._bound = self._bound and same
        # What every step reads of the provision (the activations' dtype on the first
        # step, where a dtype without one fails as it always did).
        self._rows_of = None

    def bind(self, gguf_source: GgufSource, progress: Progress | None = None) -> None:
        if self._provision is None:
            raise WorkerError("bind before configure")
        self._bound = True

    @property
    def single_run(self) -> ProvisionStage | None:
        return self._provision if self._bound else None

    @property
    def kv_reserved_bytes(self) -> int:
        return self._budget.reserved_bytes

    def open_run(self, provision: ProvisionStage) -> None:
        if self._provision is None or not self._bound:
            raise WorkerError(f"open_run({provision.run_id!r}) before bind completed")
        self._budget.reserve(provision.run_id, provision.kv_bytes)
        cursor = RunCursor(provision.kv_positions, provision.model.max_seq_len)
        self._runs[provision.run_id] = (provision, cursor)

    def run_is_open(self, run_id: str) -> bool:
        return run_id in self._runs

    def close_run(self, run_id: str) -> None:
        self._runs.pop(run_id, None)
        self._budget.free(run_id)

    def execute_batch(self, steps: Sequence[BatchStep]) -> tuple[StepResult, ...]:
        if self._provision is None or not self._bound:
            raise WorkerError("execute_step before bind completed")
        return tuple(self._step(s) for s in steps)

    def _step(self, step: BatchStep) -> StepResult:
        run = self._runs.get(step.run_id)
        if run is None:
            return StepFailure(f"run {step.run_id!r} is not open on this stage")
        p, cursor = run
        try:
            rows = rows_of(step.data)
        except WorkerError as exc:
            return StepFailure(str(exc))
        pos = cursor.place(step, rows)
        if isinstance(pos, StepFailure):
            return pos
        cursor.advance(step, rows)
        fed = np.asarray(step.data, np.uint64) if p.is_first else carried(step.data)
        if not p.is_last:
            if self._rows_of is None:
                model = p.model
                dtype = edge_dtype(model.dtype_family, model.dtype_width_bytes)
                self._rows_of = (model.hidden_dim, dtype)
            hidden, dtype = self._rows_of
            return carry(fed, hidden, dtype)
        if step.sequence == 0 and not step.is_last_chunk:
            return None
        # The stream's position: a replay's sequence 0 is its stream's token d.
        delivered = p.sampling.tokens_delivered if p.sampling is not None else 0
        position = delivered + step.sequence
        if self.eos_after is not None and position >= self.eos_after:
            assert self.eos_token_id is not None
            token = self.eos_token_id
        else:
            seed = p.sampling.seed if p.sampling is not None else 0
            token = pseudo_token(seed, position, int(fed[-1]), self.vocab_size)
            if token == self.eos_token_id:
                token = (token + 1) % self.vocab_size
        logits = None
        if p.return_logits:
            logits = np.zeros(self.vocab_size, dtype=np.float32)
            logits[token] = 1.0
        return TokenOutput(token, logits)

    def release(self) -> None:
        for run_id in list(self._runs):
            self.close_run(run_id)
        self._provision = None
        self._bound = False
