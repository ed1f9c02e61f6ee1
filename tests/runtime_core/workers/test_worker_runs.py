"""The worker interface of a chain of runs (CONCURRENT_RUNS.md §3-§5), over every worker
of the worker-contract suite (``tests/support/every_worker.py``: the NumPy reference
worker, the CPU worker, the CUDA worker on the emulated CuPy and on a GPU where there
is one) and the CUDA worker's program on its NumPy twins (``TwinWorker``).

- Batch invariance: a run's tokens and logits are the same alone and beside seven other
  runs in every batch, also when the runs join one batch after another (prefill chunks
  beside decode rows at other positions) (bit for bit on the compiled workers; the
  reference worker within 1e-5: it is the oracle, and BLAS may sum in another order
  over other row counts).
- Chunked prefill: a run's tokens and logits are the same whatever ``prefill_chunk`` is
  (bit for bit on the CPU and CUDA workers and the CUDA program's twin, whose products
  and attention compute each row the same way whatever rows it is computed with; within
  1e-5 on the reference worker on these tiny models: BLAS sums other row counts in
  another order, which grows with the logits, so that on SmolLM2-135M, whose logits
  reach 30-34, chunks of 1 or 3 rows measured up to 8e-5 from the whole prompt).
- Each run's KV cache is reserved at ``open_run`` within the stage's budget: no room is
  ``KvCacheUnavailable`` naming the bytes, and changes nothing; ``close_run`` frees it.
- One run's failed step is its ``StepFailure``; the batch's other runs go on unchanged.
  A batch the backend fails as a whole is each of its steps' ``StepFailure``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runplan import ProvisionStage, SamplingConfig
from runtime_core.workers.cpu.worker import CpuWorker
from runtime_core.workers.interface import (
    BatchStep,
    KvCacheUnavailable,
    StepFailure,
    TokenOutput,
)
from runtime_core.workers.reference.worker import ReferenceWorker
from runtime_core.workers.stage_worker import BackendSpec, StageBackend
from tests.fixtures.gguf_models import ModelShape, write_model
from tests.support.chain import Chain, provisions
from tests.support.every_worker import COMPILED, WORKERS, MakeWorker, worker_for
from tests.support.twin_stage import TwinWorker

#: The contract's workers and the CUDA program on the kernels' twins.
RUN_WORKERS: dict[str, MakeWorker] = {**WORKERS, "twin": TwinWorker}
#: The reference worker against itself over other row counts: float32 sums of at most a
#: few hundred terms of values near 1, reordered (a relative 2**-23 per term, far below).
REFERENCE_ATOL = 1e-5

PROMPTS = [
    [5, 77, 300, 12, 9],
    [1, 2, 3],
    [200, 17, 45, 99, 3, 8, 250],
    [42],
    [7, 7, 7, 7],
    [310, 11, 64, 128, 256, 3],
    [9, 8],
    [100, 101, 102, 103, 104, 105, 106, 107, 108],
]
SAMPLING = [
    SamplingConfig(),
    *(SamplingConfig(temperature=0.8, top_k=40, seed=k) for k in range(7)),
]
N = 5
MAX_SEQ = 32


@pytest.fixture(params=sorted(RUN_WORKERS))
def worker_name(request: pytest.FixtureRequest) -> str:
    worker_for(request.param, RUN_WORKERS)  # skips the GPU's where there is none
    return str(request.param)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("runs") / "m.gguf", ModelShape(n_layers=3))


def _chain(
    model: Path, make: MakeWorker, runs: int
) -> tuple[Chain, list[tuple[ProvisionStage, ...]]]:
    """A 2-stage chain of ``make`` workers and the provisions of ``runs`` runs on it."""
    provs = [
        provisions(
            model,
            2,
            max_seq_len=MAX_SEQ,
            run_id=f"run-{k}",
            sampling=SAMPLING[k],
            max_concurrent_runs=8,
        )
        for k in range(runs)
    ]
    return Chain.bind(provs[0], make), provs


def _generate(
    model: Path, make: MakeWorker, together: list[int], chunk: int = 0, staggered: bool = False
) -> dict[str, list[TokenOutput]]:
    """``N`` outputs of each run of ``together`` batched on one chain; ``staggered``: run
    ``k`` joins at batch ``k``, its prefill chunks beside the others' decode rows."""
    chain, provs = _chain(model, make, 8)
    join = {f"run-{k}": k for k in together} if staggered else None
    try:
        for k in together:
            chain.open(provs[k])
        prompts = {f"run-{k}": PROMPTS[k] for k in together}
        return chain.generate_batched(prompts, N, chunk, join)
    finally:
        chain.release()


def _atol(name: str) -> float:
    """Batch invariance: bit for bit on a compiled worker (the twin's kernels are the
    CUDA worker's, in NumPy), 1e-5 on the reference."""
    return 0.0 if name in COMPILED | {"twin"} else REFERENCE_ATOL


def _same(a: list[TokenOutput], b: list[TokenOutput], atol: float) -> None:
    """The same tokens, and logits the same bit for bit (``atol`` 0) or within ``atol``."""
    assert [o.token_id for o in a] == [o.token_id for o in b]
    for x, y in zip(a, b, strict=True):
        assert x.logits is not None and y.logits is not None
        if atol == 0.0:
            assert np.array_equal(x.logits, y.logits)
        else:
            np.testing.assert_allclose(x.logits, y.logits, rtol=0, atol=atol)


def test_a_run_alone_and_beside_seven_others_gives_the_same_outputs(
    model: Path, worker_name: str
) -> None:
    make = RUN_WORKERS[worker_name]
    together = _generate(model, make, list(range(8)))
    for k in range(8):
        alone = _generate(model, make, [k])
        _same(alone[f"run-{k}"], together[f"run-{k}"], _atol(worker_name))


def test_a_run_beside_seven_others_at_other_steps_gives_what_it_gives_alone(
    model: Path, worker_name: str
) -> None:
    """Runs joining one batch after another, prefills in chunks of 3: batches of prefill
    chunks of several lengths beside decode rows at other positions."""
    make = RUN_WORKERS[worker_name]
    together = _generate(model, make, list(range(8)), 3, staggered=True)
    for k in range(8):
        alone = _generate(model, make, [k], 3)
        _same(alone[f"run-{k}"], together[f"run-{k}"], _atol(worker_name))


@pytest.mark.parametrize("chunk", [1, 3])
def test_a_prefill_in_chunks_gives_what_the_whole_prefill_gives(
    model: Path, worker_name: str, chunk: int
) -> None:
    make = RUN_WORKERS[worker_name]
    runs = [0, 2, 7]  # prompts of 5, 7 and 9 tokens: chunks that do and do not divide them
    whole = _generate(model, make, runs)
    chunked = _generate(model, make, runs, chunk)
    for k in runs:
        _same(whole[f"run-{k}"], chunked[f"run-{k}"], _atol(worker_name))


def test_a_run_s_cache_is_reserved_within_the_budget_and_freed_at_close(
    model: Path, worker_name: str
) -> None:
    make = RUN_WORKERS[worker_name]
    provs = [
        provisions(model, 1, max_seq_len=MAX_SEQ, run_id=f"r{k}", max_concurrent_runs=2)
        for k in range(3)
    ]
    need = provs[0][0].kv_bytes
    assert provs[0][0].kv_budget_bytes == 2 * need
    w = make()
    w.configure(provs[0][0])
    w.bind(provs[0][0].gguf_source)
    w.open_run(provs[0][0])
    w.open_run(provs[1][0])
    assert w.kv_reserved_bytes == 2 * need
    with pytest.raises(KvCacheUnavailable) as refused:
        w.open_run(provs[2][0])
    assert (refused.value.needed_bytes, refused.value.free_bytes) == (need, 0)
    assert refused.value.budget_bytes == 2 * need and "r2" in str(refused.value)
    assert w.kv_reserved_bytes == 2 * need  # nothing changed
    (out,) = w.execute_batch([BatchStep("r2", 0, 0, 1, np.array([1, 2], np.uint32))])
    assert isinstance(out, StepFailure) and "not open" in out.detail
    w.close_run("r0")
    assert w.kv_reserved_bytes == need
    w.open_run(provs[2][0])  # the memory r0 gave back
    w.release()
    assert w.kv_reserved_bytes == 0


def test_a_failed_step_is_its_run_s_alone(model: Path, worker_name: str) -> None:
    make = RUN_WORKERS[worker_name]
    chain, provs = _chain(model, make, 3)
    try:
        for k in range(3):
            chain.open(provs[k])
        ids = np.array(PROMPTS[0], np.uint32)
        steps = [
            BatchStep("run-0", 0, 0, 1, ids),
            BatchStep("run-1", 1, 0, 1, np.array([3], np.uint32)),  # a decode before its prefill
            BatchStep("run-2", 0, 1, 2, ids),  # chunk 1 before chunk 0
        ]
        results = chain.step_batch(steps)
        assert isinstance(results["run-0"], TokenOutput)
        for run_id, expected in (("run-1", "out of order"), ("run-2", "chunk 1 of 2")):
            failure = results[run_id]
            assert isinstance(failure, StepFailure) and expected in failure.detail
        # The failed runs' cursors did not move: their prefills now run, and compute what
        # run-0's computed (the same prompt).
        again = chain.step_batch(
            [BatchStep("run-1", 0, 0, 1, ids), BatchStep("run-2", 0, 0, 1, ids)]
        )
        first = results["run-0"]
        assert isinstance(first, TokenOutput) and first.logits is not None
        for out in again.values():
            assert isinstance(out, TokenOutput) and out.logits is not None
            np.testing.assert_allclose(out.logits, first.logits, rtol=0, atol=REFERENCE_ATOL)
    finally:
        chain.release()


def test_the_cache_a_run_reserves_is_the_one_the_planner_counts(model: Path) -> None:
    """``kv_bytes`` (the planner's count, what a stage's budget is spent by) is what the
    reference and CPU workers allocate for the run's positions."""
    p = provisions(model, 2, max_seq_len=MAX_SEQ, prompt_tokens=6, max_tokens=4)[1]
    assert p.kv_positions == 10
    reference = ReferenceWorker()
    reference.configure(p)
    reference.bind(p.gguf_source)
    reference.open_run(p)
    assert reference._runs[p.run_id].model.kv_bytes == p.kv_bytes
    cpu = CpuWorker(threads=1)
    cpu.configure(p)
    cpu.bind(p.gguf_source)
    cpu.open_run(p)
    assert cpu._runs[p.run_id].cache.nbytes == p.kv_bytes


class _FailingOnce:
    """A CPU backend whose next ``run_batch`` raises (a fault through the backend port)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.fail_next = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    def run_batch(self, steps: Any) -> None:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("the backend gave up")
        self.backend.run_batch(steps)


class _FaultyCpuWorker(CpuWorker):
    def _make_backend(self, spec: BackendSpec) -> StageBackend:
        self.faulty = _FailingOnce(super()._make_backend(spec))
        return self.faulty  # type: ignore[return-value]


def test_a_batch_the_backend_fails_is_each_of_its_steps_failure(model: Path) -> None:
    """The batch runs as one computation: when the backend raises, every step of it is
    that run's ``StepFailure`` naming the cause, no cursor moves, and the same steps
    run again compute what a worker that never failed computes."""
    provs = [provisions(model, 1, max_seq_len=MAX_SEQ, run_id=f"r{k}", max_concurrent_runs=2)[0]
             for k in range(2)]  # fmt: skip
    steps = [BatchStep(p.run_id, 0, 0, 1, np.array(PROMPTS[k], np.uint32)) for k, p in
             enumerate(provs)]  # fmt: skip
    outputs = []
    for fail in (True, False):
        w = _FaultyCpuWorker(threads=1)
        w.configure(provs[0])
        w.bind(provs[0].gguf_source)
        for p in provs:
            w.open_run(p)
        w.faulty.fail_next = fail
        if fail:
            failed = w.execute_batch(steps)
            assert all(
                isinstance(f, StepFailure) and "the backend gave up" in f.detail for f in failed
            )
        outputs.append(w.execute_batch(steps))
        w.release()
    for again, clean in zip(*outputs, strict=True):
        assert isinstance(again, TokenOutput) and isinstance(clean, TokenOutput)
        assert again.token_id == clean.token_id
        assert again.logits is not None and clean.logits is not None
        assert np.array_equal(again.logits, clean.logits)
