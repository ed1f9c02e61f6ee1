"""Drive reference workers the way a pipeline does, in one process: plan a run with
explicit layer ranges, provision every stage, and pass each stage's output to the
next (the first stage takes u32 token ids, the last returns a ``TokenOutput``)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence

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
    RuntimeConfig,
    SamplingConfig,
    StageAssignment,
    model_facts_from_gguf,
    plan_run,
    provision_all,
)
from runtime_core.workers.interface import TokenOutput, Worker
from runtime_core.workers.reference.worker import ReferenceWorker

DTYPES = {
    "f32": (DTypeFamily.FLOAT, 4),
    "f16": (DTypeFamily.FLOAT, 2),
    "bf16": (DTypeFamily.BFLOAT, 2),
}


def even_cuts(num_layers: int, stages: int) -> list[tuple[int, int]]:
    bounds = [round(i * num_layers / stages) for i in range(stages + 1)]
    return list(itertools.pairwise(bounds))


def provisions(
    path: str | os.PathLike[str],
    ranges: Sequence[tuple[int, int]] | int = 1,
    *,
    dtype: str = "f32",
    max_seq_len: int = 128,
    sampling: SamplingConfig | None = None,
    return_logits: bool = True,
) -> tuple[ProvisionStage, ...]:
    """One provision per stage for explicit ``ranges`` (or that many even stages)."""
    facts = model_facts_from_gguf(path, max_seq_len=max_seq_len)
    if isinstance(ranges, int):
        ranges = even_cuts(facts.num_layers, ranges)
    family, width = DTYPES[dtype]
    config = RuntimeConfig(
        run_id="test-run",
        max_tokens=max_seq_len,
        activation_dtype_family=family,
        activation_dtype_width_bytes=width,
        sampling=sampling or SamplingConfig(),
        return_logits=return_logits,
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
    return provision_all(plan)


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


def run(
    provs: Sequence[ProvisionStage], make: Callable[[], Worker], prompt: Sequence[int], n: int
) -> list[TokenOutput]:
    """``n`` greedy (or sampled) outputs of a fresh chain, released after."""
    chain = Chain.bind(provs, make)
    try:
        return chain.generate(prompt, n)
    finally:
        chain.release()
