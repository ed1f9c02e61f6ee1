"""Run-wide choices: the single source of dtype, sampling, timeouts, rings and the
worker's capabilities. Every field but ``run_id`` and ``max_tokens`` has a default."""

from __future__ import annotations

from attrs import frozen

from runplan._fields import (
    bool_field,
    float_field,
    int_field,
    str_field,
    tuple_field,
    typed_field,
)
from runplan.dtypes import DTypeFamily
from runplan.quant_types import QUANT_TYPES

#: Quant types the NumPy reference worker runs: every type of the project's table
#: (``runplan.quant_types``; what it dequantizes through the gguf package and what
#: llama.cpp's fixtures cover), in name order.
REFERENCE_QUANT_TYPES: tuple[str, ...] = tuple(sorted(QUANT_TYPES))
#: Architectures the NumPy reference worker runs (``runtime_core.architectures``).
REFERENCE_ARCHITECTURES: tuple[str, ...] = (
    "llama",
    "qwen2",
    "qwen3",
    "gemma3",
    "gemma2",
    "gemma",
    "smollm3",
    "mistral3",
    "granite",
    "exaone",
    "qwen3moe",
    "qwen2moe",
    "granitemoe",
    "phi3",
)


@frozen
class WorkerCapabilities:
    """What the chosen worker can run, and how it holds a model in memory; the runtime
    fills it in for its worker. The defaults are the NumPy reference worker's: weights
    dequantized to float32, a float32 KV cache."""

    name: str = str_field(default="numpy-reference")
    architectures: tuple[str, ...] = tuple_field(str, default=REFERENCE_ARCHITECTURES)
    quant_types: tuple[str, ...] = tuple_field(str, default=REFERENCE_QUANT_TYPES)
    # Bytes per weight element in memory; 0: as stored in the file (kept quantized).
    weight_bytes_per_element: int = int_field(default=4)
    # Bytes per KV-cache element; 0: the run's activation dtype.
    kv_bytes_per_element: int = int_field(default=4)
    # Runs a mixture of experts (a model whose facts have an expert_count).
    experts: bool = bool_field(default=True)
    # A matrix's rows must hold a multiple of this many elements (the compiled workers
    # make activations 8-bit 32 elements at a time); 1: any length. The runtime checks
    # it against the file's tensors (runtime_core.gguf_slice).
    row_multiple: int = int_field(default=1)


@frozen
class SamplingConfig:
    """How the last stage picks a token. ``temperature == 0`` is greedy; ``top_k == 0``
    and ``top_p == 1`` disable those filters. The same seed and inputs give the same
    tokens.

    ``tokens_delivered``: tokens of the same stream that an earlier, interrupted run
    already sampled and delivered (0 for a fresh run). A replay (``runtime_core.replay``)
    continues that stream: its sampler starts where the interrupted one stood after
    those tokens (``Sampler.for_run``: seeded sampling takes one draw per token, greedy
    none)."""

    temperature: float = float_field(default=0.0)
    top_k: int = int_field(default=0)
    top_p: float = float_field(default=1.0)
    seed: int = int_field(default=0)
    tokens_delivered: int = int_field(default=0)


@frozen
class Timeouts:
    """Bounds on every wait of a run, in milliseconds.

    A step's limit grows with its rows (``step_limit_ms``): ``step_ms`` for any step
    plus ``step_row_ms`` per row, so a prompt as long as the context admits has as
    much time per row as a decode step. Liveness does not rest on that limit: a stage
    sends a heartbeat on its control channel from a thread of its own, whatever it
    computes, and one silent for ``heartbeat_ms`` is named at once. The step limit is
    the backstop for a stage that is alive but never finishes.

    Runs that share a chain share its stages' batches (CONCURRENT_RUNS.md §3): a step
    of ``rows`` rows then runs in a batch of up to ``max_batch_rows`` rows in all
    (``batch_rows``, 0 for a run alone), and each step's limit is ``batches`` limits of
    such a batch (``batch_step_limit_ms``), ``shared_batches(runs, slots)`` of them for
    batches of at most ``runs`` runs and rings of ``slots`` slots. A step, from its
    record's load on a stage to its output's load on the next:

    - its record may be left out of one batch (its rows did not fit beside a prefill
      record owed the batch) before its own batch runs: 2 batches of this stage;
    - its own batch writes one output per run, ``runs`` in all, in batch order on the
      one ring to the next stage, which holds ``slots``; the next stage takes what the
      ring holds between its batches, so the last output is taken after the next
      stage's batch in progress and ``ceil(runs / slots) - 1`` more of its batches (it
      frees ``slots`` each): ``ceil(runs / slots)`` batches of the next stage.

    That is ``2 + ceil(runs / slots)`` batches a step (3 while a batch's outputs fit
    the ring; seen overrun with a fixed 3: 8 runs on 2-slot rings, 4 batches of the
    next stage to take one batch's outputs). ``runs`` is the most runs one batch may
    hold: at most one record a run, each of at least one row, so at most
    ``max_batch_rows``, and at most this run and the runs the rest of a stage's KV
    budget holds of the smallest cache a run may reserve (``batch_runs``: runs of short
    caches fill what a long run's leaves, and share its batches). The orchestrator's
    token timer counts such steps (``token_limit_ms``), and starts again when it runs out
    after the chain delivered tokens to any run (a record behind other runs' prefill
    chunks, or among more decoding runs than a batch holds, waits through more), at
    most as many times a token as runs were in flight on the chain while it waited
    (``OrchestratorMachine.token_restart_limit``): a record lost while other runs go on
    faults its run within that many bounds and one; a stage's step timer one."""

    #: Worker calls a stage may finish before it releases a run it was told to stop.
    STOP_BATCHES = 2

    ready_ms: int = int_field(default=120_000)  # provisioning to StageReady (weights load)
    step_ms: int = int_field(default=60_000)  # one ExecuteStep, whatever its rows
    edge_wait_ms: int = int_field(default=60_000)  # one wait on a ring (either end)
    stop_ms: int = int_field(default=10_000)  # StopRun to StageStopped (stop_limit_ms)
    step_row_ms: int = int_field(default=100)  # one ExecuteStep, for each of its rows
    heartbeat_ms: int = int_field(default=5_000)  # a stage's longest silence

    def step_limit_ms(self, rows: int) -> int:
        """How long one step of ``rows`` rows may take on one stage."""
        return self.step_ms + max(0, rows) * self.step_row_ms

    def batch_step_limit_ms(self, rows: int, batch_rows: int, batches: int) -> int:
        """How long one step of ``rows`` rows may take on one stage, its batch run and
        its output taken, when its batches may hold ``batch_rows`` rows in all and it
        may wait through ``batches`` batches (``shared_batches``); ``batch_rows`` 0: its
        own rows only, a run alone: ``step_limit_ms(rows)``."""
        if batch_rows <= 0:
            return self.step_limit_ms(rows)
        return max(1, batches) * self.step_limit_ms(max(rows, batch_rows))

    def token_limit_ms(
        self, stages: int, chunks: int, rows: int, batch_rows: int, batches: int
    ) -> int:
        """How long a token may take from its first record's injection to its
        consumption: ``stages + chunks - 1`` steps (a prompt's ``chunks`` records of at
        most ``rows`` rows pipeline through the stages; a decoded token is one record of
        one row), each within ``batch_step_limit_ms``."""
        steps = stages + max(1, chunks) - 1
        return self.batch_step_limit_ms(rows, batch_rows, batches) * steps

    def stop_limit_ms(self, rows: int, batch_rows: int) -> int:
        """How long ``StopRun`` to every stage's ``StageStopped`` may take: a stage reads
        its ``StopRun`` once the worker call in progress ends, and its loop may begin
        one more before it releases the run (it releases after a batch): ``STOP_BATCHES``
        worker calls, each one step of at most ``rows`` rows (a run alone) or one batch
        of at most ``batch_rows`` rows (runs sharing its batches), ``step_limit_ms`` of
        the larger; then the stage stops the run within ``stop_ms``."""
        return self.stop_ms + self.STOP_BATCHES * self.step_limit_ms(max(rows, batch_rows))


def run_positions(prompt_tokens: int, max_tokens: int) -> int:
    """The positions a run's KV cache must hold: its prompt (at least 1 token: a prompt of
    unknown length, 0, has at least one) and every token it generates but the last, which
    is never fed back. The one rule the planner, the runs' state machines, ``generate``,
    offline batches and the server apply to a prompt against a context."""
    return max(prompt_tokens, 1) + max_tokens - 1


def shared_batches(batch_runs: int, ring_slots: int) -> int:
    """Batches a step of a run sharing batches may wait through (``Timeouts``):
    ``2 + ceil(batch_runs / ring_slots)`` for batches of at most ``batch_runs`` runs
    whose outputs go out on rings of ``ring_slots`` slots."""
    if batch_runs < 1 or ring_slots < 1:
        raise ValueError(f"batch_runs {batch_runs} and ring_slots {ring_slots} must be at least 1")
    return 2 + -(-batch_runs // ring_slots)


def batch_runs(max_batch_rows: int, kv_bytes: int, kv_budget_bytes: int, kv_positions: int) -> int:
    """The most runs one batch on a stage may hold beside (and with) a run whose cache
    takes ``kv_bytes`` for ``kv_positions`` positions: a record a run of at least one
    row, so ``max_batch_rows``; and no more than this run and the runs the rest of the
    stage's budget holds of the smallest cache a run may reserve (at least 1).

    That smallest cache holds one position on each of the stage's blocks, at least
    ``ceil(kv_bytes / kv_positions)`` bytes (a block keeps a position per position of a
    run, or its window's when that is shorter): a run of a long cache shares its
    batches with as many short runs as fill what its cache leaves of the budget, not
    only with as many runs as the budget holds of its own size."""
    if kv_bytes <= 0 or kv_positions <= 0:
        return max(1, max_batch_rows)
    smallest = -(-kv_bytes // kv_positions)
    others = max(0, kv_budget_bytes - kv_bytes) // smallest
    return max(1, min(max_batch_rows, 1 + others))


def shared_batch_rows(max_batch_rows: int, kv_bytes: int, kv_budget_bytes: int) -> int:
    """Rows a run's batches on a stage may hold in all: ``max_batch_rows`` when the
    stage's KV budget has room for other runs beside this run's cache, else 0 (its
    records run alone)."""
    return max_batch_rows if kv_budget_bytes > kv_bytes else 0


@frozen
class RuntimeConfig:
    """Run-wide settings. Like every value class it checks field types only; values
    that make no plan come back from ``plan_run`` as rejections."""

    run_id: str = str_field()
    max_tokens: int = int_field()
    # Activations on edges and the KV cache use this dtype. f32 for CPU workers; the
    # CUDA runtime passes f16.
    activation_dtype_family: DTypeFamily = typed_field(DTypeFamily, default=DTypeFamily.FLOAT)
    activation_dtype_width_bytes: int = int_field(default=4)
    ring_slot_count: int = int_field(default=2)
    ring_alignment: int = int_field(default=64)
    sampling: SamplingConfig = typed_field(SamplingConfig, factory=SamplingConfig)
    return_logits: bool = bool_field(default=False)
    timeouts: Timeouts = typed_field(Timeouts, factory=Timeouts)
    worker: WorkerCapabilities = typed_field(WorkerCapabilities, factory=WorkerCapabilities)
    # Several runs on one chain (CONCURRENT_RUNS.md). The run's prompt length when known
    # (0: unknown, the run reserves max_seq_len positions of KV cache on every stage).
    prompt_tokens: int = int_field(default=0)
    # Runs the chain holds at once: each stage's KV budget is this many full-length
    # (max_seq_len) caches, unless ``kv_budget_bytes`` gives the budget itself.
    max_concurrent_runs: int = int_field(default=1)
    # KV-cache bytes each stage may hold for all its runs (0: from max_concurrent_runs).
    kv_budget_bytes: int = int_field(default=0)
    # Rows of one worker call on a stage, every run's step of the batch together.
    max_batch_rows: int = int_field(default=512)
    # Rows per prefill chunk (0: the prompt in one record when it fits max_batch_rows,
    # else chunks of max_batch_rows).
    prefill_chunk: int = int_field(default=0)
