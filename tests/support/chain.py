"""Workers of every stage of a run, driven in one process the way a pipeline drives
them: a plan with explicit layer ranges (or ``runplan.layers.split_even``'s), every
stage provisioned, each stage's output the next stage's input (device to device when
the workers return device arrays), the first stage taking u32 token ids, the last
returning a ``TokenOutput`` whose token is fed back. Any ``Worker`` works: the
reference worker by default, the CPU worker, the CUDA worker (its tests and
``benchmarks/gpu_decode.py``).

``Chain`` drives the workers directly: one run step by step (``generate``), or several
runs at once in batches, each batch one step of every run, a prefill whole or in chunks
(``generate_batched``). ``tests/support/chain_runs.py`` drives the same through the
chain controllers."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from runplan import (
    DTypeFamily,
    NodePool,
    NodeSpec,
    Placement,
    PlanRejection,
    ProvisionStage,
    RunPlan,
    RuntimeConfig,
    SamplingConfig,
    StageAssignment,
    WorkerCapabilities,
    model_facts_from_gguf,
    plan_run,
    provision_all,
)
from runplan.layers import split_even
from runtime_core.workers.interface import (
    BatchStep,
    Progress,
    StepFailure,
    StepResult,
    TokenOutput,
    Worker,
)
from runtime_core.workers.reference.worker import ReferenceWorker

DTYPES = {
    "f32": (DTypeFamily.FLOAT, 4),
    "f16": (DTypeFamily.FLOAT, 2),
    "bf16": (DTypeFamily.BFLOAT, 2),
}


def plan_for(
    path: str | os.PathLike[str],
    ranges: Sequence[tuple[int, int]] | int = 1,
    *,
    dtype: str = "f32",
    max_seq_len: int = 128,
    sampling: SamplingConfig | None = None,
    return_logits: bool = True,
    worker: WorkerCapabilities | None = None,
    run_id: str = "test-run",
    max_tokens: int | None = None,
    prompt_tokens: int = 0,
    max_concurrent_runs: int = 1,
    kv_budget_bytes: int = 0,
    max_batch_rows: int = 512,
    prefill_chunk: int = 0,
) -> RunPlan:
    """A plan over nodes ``node-0..`` (orchestrator ``orch``) for explicit layer
    ``ranges``, or that many stages split as ``Placement.even`` splits them; one node per
    stage (all may share a device), the planner's checks for ``worker`` (default: the
    reference worker's capabilities), and the RuntimeConfig fields of a chain of runs as
    given (``max_tokens`` defaults to ``max_seq_len``). ``AssertionError`` if the planner
    rejects the plan."""
    facts = model_facts_from_gguf(path, max_seq_len=max_seq_len)
    if isinstance(ranges, int):
        ranges = split_even(facts.num_layers, ranges)
    family, width = DTYPES[dtype]
    config = RuntimeConfig(
        run_id=run_id,
        max_tokens=max_seq_len if max_tokens is None else max_tokens,
        activation_dtype_family=family,
        activation_dtype_width_bytes=width,
        sampling=sampling or SamplingConfig(),
        return_logits=return_logits,
        worker=worker or WorkerCapabilities(),
        prompt_tokens=prompt_tokens,
        max_concurrent_runs=max_concurrent_runs,
        kv_budget_bytes=kv_budget_bytes,
        max_batch_rows=max_batch_rows,
        prefill_chunk=prefill_chunk,
    )
    nodes = tuple(NodeSpec(f"node-{i}", 2**50) for i in range(len(ranges)))
    placement = Placement(
        assignments=tuple(StageAssignment(i, f"node-{i}", a, b) for i, (a, b) in enumerate(ranges))
    )
    plan = plan_run(
        facts,
        config,
        NodePool(orchestrator_node_id="orch", nodes=nodes),
        stage_count=len(ranges),
        placement=placement,
    )
    if isinstance(plan, PlanRejection):
        raise AssertionError(f"the test plan was rejected: {plan}")
    return plan


def provisions(
    path: str | os.PathLike[str], ranges: Sequence[tuple[int, int]] | int = 1, **kwargs: Any
) -> tuple[ProvisionStage, ...]:
    """One provision per stage of ``plan_for(path, ranges, **kwargs)``."""
    return provision_all(plan_for(path, ranges, **kwargs))


@attrs.define
class Chain:
    """Bound workers of every stage, in order."""

    workers: list[Worker]
    #: every stage's output rows of each run, in order (``step_batch`` appends them:
    #: (stage index, run id) -> arrays), when a test asks for them
    activations: dict[tuple[int, str], list[Any]] | None = None

    @classmethod
    def bind(
        cls,
        provs: Sequence[ProvisionStage],
        make: Callable[[], Worker] = ReferenceWorker,
        progress: Progress | None = None,
    ) -> Chain:
        """A worker per stage, configured and bound (those bound already are released
        if a later one fails)."""
        workers: list[Worker] = []
        try:
            for p in provs:
                w = make()
                workers.append(w)
                w.configure(p)
                w.bind(p.gguf_source, progress)
        except BaseException:
            for w in workers:
                w.release()
            raise
        return cls(workers)

    def step(self, sequence: int, data: Any) -> TokenOutput:
        out: Any = data
        for w in self.workers:
            assert not isinstance(out, TokenOutput)
            out = w.execute_step(sequence, out)
        assert isinstance(out, TokenOutput)
        return out

    def generate(self, prompt: Sequence[int], n: int) -> list[TokenOutput]:
        """Prefill ``prompt``, then feed back each sampled token: ``n`` outputs."""
        return self.timed_generate(prompt, n)[0]

    def timed_generate(
        self, prompt: Sequence[int], n: int
    ) -> tuple[list[TokenOutput], float, list[float]]:
        """``generate`` with wall times: the prefill's seconds and each decode step's.
        A step returns only after its token is on the host, so host timers time it."""
        t0 = time.perf_counter()
        outs = [self.step(0, np.array(prompt, dtype=np.uint32))]
        prefill = time.perf_counter() - t0
        steps = []
        for k in range(1, n):
            t = time.perf_counter()
            outs.append(self.step(k, np.array([outs[-1].token_id], dtype=np.uint32)))
            steps.append(time.perf_counter() - t)
        return outs, prefill, steps

    def release(self) -> None:
        for w in self.workers:
            w.release()

    # -- several runs, in batches ----------------------------------------------------------
    def open(self, provs: Sequence[ProvisionStage]) -> None:
        """Open one run (its provisions, stage by stage) on every stage."""
        for w, p in zip(self.workers, provs, strict=True):
            w.open_run(p)

    def close(self, run_id: str) -> None:
        for w in self.workers:
            w.close_run(run_id)

    def step_batch(self, steps: Sequence[BatchStep]) -> dict[str, StepResult]:
        """One batch through every stage: each stage's outputs are the next one's steps
        (a last stage's prefill chunk before the last ends there). Each run's result on
        the last stage (or its ``StepFailure`` where it failed)."""
        results: dict[str, StepResult] = {}
        for stage, w in enumerate(self.workers):
            outs = w.execute_batch(steps)
            following = []
            for step, out in zip(steps, outs, strict=True):
                if isinstance(out, (StepFailure, TokenOutput)) or out is None:
                    results[step.run_id] = out
                else:
                    if self.activations is not None:
                        got = getattr(out, "get", None)  # a device array, copied back
                        kept = np.array(got() if callable(got) else out, copy=True)
                        self.activations.setdefault((stage, step.run_id), []).append(kept)
                    following.append(attrs.evolve(step, data=out))
            steps = following
        return results

    def generate_batched(
        self,
        prompts: Mapping[str, Sequence[int]],
        n: int,
        chunk: int = 0,
        join_at: Mapping[str, int] | None = None,
    ) -> dict[str, list[TokenOutput]]:
        """``n`` outputs of each open run (by run id), every run in every batch from the
        batch ``join_at[run]`` (default 0) on: first each run's prefill (in chunks of
        ``chunk`` rows, 0: whole), then its decode steps, each fed back its last token.
        Runs that join later put their prefill chunks beside the others' decode rows."""
        join = join_at or {}
        batch = 0
        pending: dict[str, list[BatchStep]] = {}
        for run_id, prompt in prompts.items():
            ids = np.array(prompt, dtype=np.uint32)
            size = chunk or len(ids)
            count = -(-len(ids) // size)
            pending[run_id] = [
                BatchStep(run_id, 0, j, count, ids[j * size : (j + 1) * size]) for j in range(count)
            ]
        outputs: dict[str, list[TokenOutput]] = {run_id: [] for run_id in prompts}
        while pending:
            steps = [queue[0] for r, queue in pending.items() if join.get(r, 0) <= batch]
            batch += 1
            if not steps:
                continue
            results = self.step_batch(steps)
            for step in steps:
                pending[step.run_id].pop(0)
                out = results.get(step.run_id)
                if isinstance(out, StepFailure):
                    raise AssertionError(f"run {step.run_id}: {out.detail}")
                if out is None:
                    continue  # a chunk of the prefill before the last
                assert isinstance(out, TokenOutput)
                outputs[step.run_id].append(out)
                if len(outputs[step.run_id]) < n:
                    token = np.array([out.token_id], dtype=np.uint32)
                    pending[step.run_id].append(
                        BatchStep(step.run_id, step.sequence + 1, 0, 1, token)
                    )
            pending = {run_id: queue for run_id, queue in pending.items() if queue}
        return outputs


def run(
    provs: Sequence[ProvisionStage], make: Callable[[], Worker], prompt: Sequence[int], n: int
) -> list[TokenOutput]:
    """``n`` greedy (or sampled) outputs of a fresh chain, released after."""
    chain = Chain.bind(provs, make)
    try:
        return chain.generate(prompt, n)
    finally:
        chain.release()
