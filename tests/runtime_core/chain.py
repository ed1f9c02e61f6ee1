"""Drive workers the way a pipeline does, in one process: plan a run with explicit
layer ranges, provision every stage, and pass each stage's output to the next (the
first stage takes u32 token ids, the last returns a ``TokenOutput``).

``Chain`` drives the workers directly: one run step by step (``generate``), or several
runs at once in batches, each batch one step of every run, a prefill whole or in chunks
(``generate_batched``). ``tests/runtime_core/chain_runs.py`` drives the same through
the chain controllers."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

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
    model_facts_from_gguf,
    plan_run,
    provision_all,
)
from runtime_core.reference import ReferenceWorker
from runtime_core.worker import BatchStep, StepFailure, StepResult, TokenOutput, Worker

DTYPES = {
    "f32": (DTypeFamily.FLOAT, 4),
    "f16": (DTypeFamily.FLOAT, 2),
    "bf16": (DTypeFamily.BFLOAT, 2),
}


def even_cuts(num_layers: int, stages: int) -> list[tuple[int, int]]:
    bounds = [round(i * num_layers / stages) for i in range(stages + 1)]
    return list(itertools.pairwise(bounds))


def plan_for(
    path: str | os.PathLike[str],
    ranges: Sequence[tuple[int, int]] | int = 1,
    *,
    dtype: str = "f32",
    max_seq_len: int = 128,
    sampling: SamplingConfig | None = None,
    return_logits: bool = True,
    run_id: str = "test-run",
    max_tokens: int | None = None,
    prompt_tokens: int = 0,
    max_concurrent_runs: int = 1,
    kv_budget_bytes: int = 0,
    max_batch_rows: int = 512,
    prefill_chunk: int = 0,
) -> RunPlan:
    """A plan over nodes ``node-0..`` (orchestrator ``orch``) for explicit ``ranges``
    (or that many even stages), with the RuntimeConfig fields of a chain of runs as
    given (``max_tokens`` defaults to ``max_seq_len``)."""
    facts = model_facts_from_gguf(path, max_seq_len=max_seq_len)
    if isinstance(ranges, int):
        ranges = even_cuts(facts.num_layers, ranges)
    family, width = DTYPES[dtype]
    config = RuntimeConfig(
        run_id=run_id,
        max_tokens=max_seq_len if max_tokens is None else max_tokens,
        activation_dtype_family=family,
        activation_dtype_width_bytes=width,
        sampling=sampling or SamplingConfig(),
        return_logits=return_logits,
        prompt_tokens=prompt_tokens,
        max_concurrent_runs=max_concurrent_runs,
        kv_budget_bytes=kv_budget_bytes,
        max_batch_rows=max_batch_rows,
        prefill_chunk=prefill_chunk,
    )
    nodes = tuple(NodeSpec(f"node-{i}", 2**40) for i in range(len(ranges)))
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
    """Bound workers of every stage, in order, each stage's output the next one's input,
    the way a pipeline drives them (any ``Worker``: the reference worker by default, the
    CPU worker, ...)."""

    workers: list[Worker]

    @classmethod
    def bind(
        cls, provs: Sequence[ProvisionStage], make: Callable[[], Worker] = ReferenceWorker
    ) -> Chain:
        workers = []
        for p in provs:
            w = make()
            w.configure(p)
            w.bind(p.gguf_source)
            workers.append(w)
        return cls(workers)

    def step(self, sequence: int, data: npt.NDArray[np.generic]) -> TokenOutput:
        out: npt.NDArray[np.generic] | TokenOutput = data
        for w in self.workers:
            assert not isinstance(out, TokenOutput)
            out = w.execute_step(sequence, out)
        assert isinstance(out, TokenOutput)
        return out

    def generate(self, prompt: Sequence[int], n: int) -> list[TokenOutput]:
        """Prefill ``prompt``, then feed back each sampled token: ``n`` outputs."""
        outs = [self.step(0, np.array(prompt, dtype=np.uint32))]
        for k in range(1, n):
            outs.append(self.step(k, np.array([outs[-1].token_id], dtype=np.uint32)))
        return outs

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
        for w in self.workers:
            outs = w.execute_batch(steps)
            following = []
            for step, out in zip(steps, outs, strict=True):
                if isinstance(out, (StepFailure, TokenOutput)) or out is None:
                    results[step.run_id] = out
                else:
                    following.append(attrs.evolve(step, data=out))
            steps = following
        return results

    def generate_batched(
        self, prompts: Mapping[str, Sequence[int]], n: int, chunk: int = 0
    ) -> dict[str, list[TokenOutput]]:
        """``n`` outputs of each open run (by run id), every run in every batch: first
        each run's prefill (in chunks of ``chunk`` rows, 0: whole), then its decode steps,
        each fed back its last token."""
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
            steps = [queue[0] for queue in pending.values()]
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
