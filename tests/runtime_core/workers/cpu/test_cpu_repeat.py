"""The CPU worker computes a run the same, bit for bit, whatever ran before it in the
process and on whichever instruction set and thread count: SmolLM2's greedy tokens
and logits on one prompt, run first, then again on the portable instruction set on 1
thread, on the best one on 3, and as at first, each after a run of the worker's float
mode (other kernels, other buffers) on 2 threads. (A full-suite process once gave
other greedy tokens than the same test alone: the thread pool could run an item twice,
``test_cpu_pool.py``; this is what the worker promises and that run broke. ``make
sanitize-address`` and ``make sanitize-thread`` run these tests on the kernels built
with sanitizers, their scratch memory poisoned.)"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from runtime_core.workers.cpu.kernels import host_isas
from runtime_core.workers.cpu.worker import CpuWorker
from runtime_core.workers.interface import TokenOutput
from tests.fixtures.llamacpp_fixtures import load_doc
from tests.support.chain import provisions, run

PROMPT = load_doc("smollm2")["prompts"][0]["token_ids"]  # "The capital of France is"
N_TOKENS = 8


@pytest.mark.slow
def test_a_run_is_the_same_after_other_runs_isas_and_thread_counts(smollm2_path: str) -> None:
    provs = provisions(smollm2_path, 1, max_seq_len=64)
    isas = host_isas()

    def greedy(make: Callable[[], CpuWorker]) -> list[TokenOutput]:
        return run(provs, make, PROMPT, N_TOKENS)

    first = greedy(CpuWorker)
    for isa, threads in ((isas[0], 1), (isas[-1], 3), (isas[-1], None)):
        greedy(lambda: CpuWorker(matvec="f32", threads=2))
        outs = greedy(lambda i=isa, t=threads: CpuWorker(isa=i, threads=t))  # type: ignore[misc]
        assert [o.token_id for o in outs] == [o.token_id for o in first], (isa, threads)
        for a, b in zip(outs, first, strict=True):
            assert a.logits is not None and b.logits is not None
            np.testing.assert_array_equal(a.logits.view(np.uint32), b.logits.view(np.uint32))
