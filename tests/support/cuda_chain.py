"""Workers of every stage of a run, driven in one process the way a pipeline drives
them: each stage's output is the next stage's input (device to device when the
workers return device arrays), the last returns a token, and each token is fed back.
Used by the GPU tests and ``benchmarks/gpu_decode.py``; any ``Worker`` works.
"""

from __future__ import annotations

import itertools
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
    model_facts_from_gguf,
    plan_run,
    provision_all,
)
from runtime_core.workers.interface import Progress, TokenOutput, Worker
from runtime_cupy.cuda.worker import CUDA_CAPABILITIES

DTYPES = {
    "f32": (DTypeFamily.FLOAT, 4),
    "f16": (DTypeFamily.FLOAT, 2),
    "bf16": (DTypeFamily.BFLOAT, 2),
}


def even_ranges(num_layers: int, stages: int) -> list[tuple[int, int]]:
    bounds = [round(i * num_layers / stages) for i in range(stages + 1)]
    return list(itertools.pairwise(bounds))


def provisions_for(
    path: str | os.PathLike[str],
    ranges: Sequence[tuple[int, int]] | int = 1,
    *,
    dtype: str = "f16",
    max_seq_len: int = 256,
    sampling: SamplingConfig | None = None,
    return_logits: bool = False,
) -> tuple[ProvisionStage, ...]:
    """One provision per stage of a plan of ``path`` for the CUDA worker, one node per
    stage (all may share one GPU), with explicit layer ``ranges`` or that many even
    stages. Raises ``ValueError`` if the planner rejects it."""
    facts = model_facts_from_gguf(path, max_seq_len=max_seq_len)
    if isinstance(ranges, int):
        ranges = even_ranges(facts.num_layers, ranges)
    family, width = DTYPES[dtype]
    config = RuntimeConfig(
        run_id="cuda-chain",
        max_tokens=max_seq_len,
        activation_dtype_family=family,
        activation_dtype_width_bytes=width,
        sampling=sampling or SamplingConfig(),
        return_logits=return_logits,
        worker=CUDA_CAPABILITIES,
    )
    nodes = tuple(NodeSpec(f"gpu-stage-{i}", 2**50) for i in range(len(ranges)))
    rows = tuple(StageAssignment(i, f"gpu-stage-{i}", a, b) for i, (a, b) in enumerate(ranges))
    plan = plan_run(
        facts,
        config,
        NodePool(orchestrator_node_id="orch", nodes=nodes),
        stage_count=len(ranges),
        placement=Placement(assignments=rows),
    )
    if isinstance(plan, PlanRejection):
        raise ValueError(f"the plan was rejected: {plan}")
    return provision_all(plan)


@attrs.define
class Chain:
    workers: list[Worker]
    provisions: tuple[ProvisionStage, ...]

    @classmethod
    def bind(
        cls,
        provisions: tuple[ProvisionStage, ...],
        make_worker: Callable[[], Worker],
        progress: Progress | None = None,
    ) -> Chain:
        workers: list[Worker] = []
        try:
            for p in provisions:
                w = make_worker()
                workers.append(w)
                w.configure(p)
                w.bind(p.gguf_source, progress)
        except BaseException:
            for w in workers:
                w.release()
            raise
        return cls(workers, provisions)

    def step(self, sequence: int, data: Any) -> TokenOutput:
        out: Any = data
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
