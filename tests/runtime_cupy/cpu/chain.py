"""Workers of every stage of a plan in one process, each stage's output the next one's
input, the way a pipeline drives them (any ``Worker``: the CPU worker, the reference)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import numpy as np
import numpy.typing as npt

from runplan import ProvisionStage
from runtime_core.worker import TokenOutput, Worker


@attrs.define
class Chain:
    workers: list[Worker]

    @classmethod
    def bind(cls, provs: Sequence[ProvisionStage], make: Callable[[], Worker]) -> Chain:
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
        """Prefill ``prompt``, then feed back each token: ``n`` outputs."""
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
