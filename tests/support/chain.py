"""Workers of every stage of a run, driven in one process the way a pipeline drives
them: a plan with explicit layer ranges (or ``runplan.layers.split_even``'s), every
stage provisioned, each stage's output the next stage's input (device to device when
the workers return device arrays), the first stage taking u32 token ids, the last
returning a ``TokenOutput`` whose token is fed back. Any ``Worker`` works: the
reference worker by default, the CPU worker, the CUDA worker (its tests and
``benchmarks/gpu_decode.py``)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
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
    RuntimeConfig,
    SamplingConfig,
    StageAssignment,
    WorkerCapabilities,
    model_facts_from_gguf,
    plan_run,
    provision_all,
)
from runplan.layers import split_even
from runtime_core.workers.interface import Progress, TokenOutput, Worker
from runtime_core.workers.reference.worker import ReferenceWorker

DTYPES = {
    "f32": (DTypeFamily.FLOAT, 4),
    "f16": (DTypeFamily.FLOAT, 2),
    "bf16": (DTypeFamily.BFLOAT, 2),
}


def provisions(
    path: str | os.PathLike[str],
    ranges: Sequence[tuple[int, int]] | int = 1,
    *,
    dtype: str = "f32",
    max_seq_len: int = 128,
    sampling: SamplingConfig | None = None,
    return_logits: bool = True,
    worker: WorkerCapabilities | None = None,
) -> tuple[ProvisionStage, ...]:
    """One provision per stage for explicit layer ``ranges``, or that many stages split
    as ``Placement.even`` splits them; one node per stage (all may share a device), the
    planner's checks for ``worker`` (default: the reference worker's capabilities).
    ``AssertionError`` if the planner rejects the plan."""
    facts = model_facts_from_gguf(path, max_seq_len=max_seq_len)
    if isinstance(ranges, int):
        ranges = split_even(facts.num_layers, ranges)
    family, width = DTYPES[dtype]
    config = RuntimeConfig(
        run_id="test-run",
        max_tokens=max_seq_len,
        activation_dtype_family=family,
        activation_dtype_width_bytes=width,
        sampling=sampling or SamplingConfig(),
        return_logits=return_logits,
        worker=worker or WorkerCapabilities(),
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
    return provision_all(plan)


@attrs.define
class Chain:
    """Bound workers of every stage, in order."""

    workers: list[Worker]

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


def run(
    provs: Sequence[ProvisionStage], make: Callable[[], Worker], prompt: Sequence[int], n: int
) -> list[TokenOutput]:
    """``n`` greedy (or sampled) outputs of a fresh chain, released after."""
    chain = Chain.bind(provs, make)
    try:
        return chain.generate(prompt, n)
    finally:
        chain.release()
