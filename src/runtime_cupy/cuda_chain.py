"""Workers of every stage of a run, driven in one process the way a pipeline drives
them: each stage's output is the next stage's input (device to device when the
workers return device arrays), the last returns a token, and each token is fed back.
Used by the GPU tests and ``benchmarks/gpu_decode.py``; any ``Worker`` works.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from runplan import ProvisionStage
from runtime_core.worker import Progress, TokenOutput, Worker


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
