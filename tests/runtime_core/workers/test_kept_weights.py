"""Weights outlive a run (warm reuse), in the shared worker code every worker has: the
NumPy reference worker (``runtime_core.workers.reference.worker``) and ``StageWorker``, the base of
the CUDA and CPU workers: over the NumPy twins of the CUDA kernels, and the CPU worker
itself (its weights mapped from the file).

A worker provisioned again for the same slice of the same file reuses its weights
(nothing is read: no progress is reported) and gives the tokens a fresh worker gives;
another slice, another file, or the same name rewritten, loads again."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from runplan import ProvisionStage, SamplingConfig
from runtime_core.workers.cpu.worker import CpuWorker
from runtime_core.workers.interface import TokenOutput, Worker
from runtime_core.workers.kept_weights import KeepsWeights
from runtime_core.workers.reference.worker import ReferenceWorker
from tests.fixtures.gguf_models import ModelShape, write_model
from tests.support.chain import provisions
from tests.support.twin_stage import TwinWorker

MakeWorker = Callable[[], Worker]
WORKERS: dict[str, MakeWorker] = {
    "reference": ReferenceWorker,
    "stage-worker": TwinWorker,
    "cpu": lambda: CpuWorker(threads=1),
}


@pytest.fixture(params=sorted(WORKERS))
def make(request: pytest.FixtureRequest) -> MakeWorker:
    return WORKERS[request.param]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("kw") / "m.gguf", ModelShape(n_layers=4))


def bind(w: Worker, p: ProvisionStage) -> list[tuple[int, int]]:
    """Configure and bind ``w`` for ``p``; the progress it reported."""
    seen: list[tuple[int, int]] = []
    w.configure(p)
    w.bind(p.gguf_source, lambda done, total: seen.append((done, total)))
    return seen


def greedy(w: Worker, prompt: list[int], n: int) -> list[int]:
    """``n`` tokens of one run of a whole-model stage (then released)."""
    out = w.execute_step(0, np.array(prompt, np.uint32))
    tokens = []
    for k in range(1, n + 1):
        assert isinstance(out, TokenOutput)
        tokens.append(out.token_id)
        if k < n:
            out = w.execute_step(k, np.array([out.token_id], np.uint32))
    w.release()
    return tokens


def fresh(make: MakeWorker, p: ProvisionStage, prompt: list[int], n: int) -> list[int]:
    w = make()
    bind(w, p)
    return greedy(w, prompt, n)


def test_a_second_run_of_the_same_slice_reads_nothing_and_starts_afresh(
    make: MakeWorker, model: Path
) -> None:
    (p,) = provisions(model, 1, return_logits=False)
    w = make()
    assert isinstance(w, KeepsWeights)
    assert bind(w, p), "the first bind reads the slice"
    assert not w.weights_reused
    first = greedy(w, [5, 77, 300, 12, 9], 8)
    # A later run, a longer and different prompt: the KV cache is the run's own.
    assert bind(w, p) == []
    assert w.weights_reused
    second = greedy(w, [9, 8, 7, 6, 5, 4, 3, 2, 1, 40, 41], 8)
    assert second == fresh(make, p, [9, 8, 7, 6, 5, 4, 3, 2, 1, 40, 41], 8)
    assert bind(w, p) == []
    assert greedy(w, [5, 77, 300, 12, 9], 8) == first


def test_the_sampler_is_the_run_s_own(make: MakeWorker, model: Path) -> None:
    sampling = SamplingConfig(temperature=0.9, top_k=20, seed=7)
    (p,) = provisions(model, 1, sampling=sampling, return_logits=False)
    w = make()
    bind(w, p)
    a = greedy(w, [1, 2, 3], 10)
    bind(w, p)
    assert w.weights_reused
    assert greedy(w, [1, 2, 3], 10) == a == fresh(make, p, [1, 2, 3], 10)


def test_another_slice_loads_again(make: MakeWorker, model: Path) -> None:
    first, second = provisions(model, 2, return_logits=False)
    w = make()
    bind(w, first)
    w.release()
    assert bind(w, second), "another layer range is read from the file"
    assert not w.weights_reused
    w.release()
    assert bind(w, second) == []
    assert w.weights_reused


def test_a_file_rewritten_under_the_same_name_is_read_again(
    make: MakeWorker, tmp_path: Path
) -> None:
    path = write_model(tmp_path / "m.gguf", ModelShape(n_layers=2, seed=1))
    (p,) = provisions(path, 1, return_logits=False)
    w = make()
    bind(w, p)
    greedy(w, [3, 4, 5], 4)
    other = write_model(tmp_path / "other.gguf", ModelShape(n_layers=2, seed=2))
    os.replace(other, path)
    assert bind(w, p), "a replaced file is read again"
    assert not w.weights_reused
    assert greedy(w, [3, 4, 5], 6) == fresh(make, p, [3, 4, 5], 6)


def test_forget_weights_lets_them_go(make: MakeWorker, model: Path) -> None:
    (p,) = provisions(model, 1, return_logits=False)
    w = make()
    bind(w, p)
    w.release()
    assert isinstance(w, KeepsWeights)
    w.forget_weights()
    assert bind(w, p)
    assert not w.weights_reused


def test_a_later_run_of_a_longer_sequence_computes_what_a_fresh_worker_computes(
    make: MakeWorker, model: Path
) -> None:
    """A warm stage's next run may reserve more positions than the one before (its
    plan's ``max_seq_len``): its rotary tables are that long."""
    (short,) = provisions(model, 1, max_seq_len=16, return_logits=False)
    (long,) = provisions(model, 1, max_seq_len=48, return_logits=False)
    w = make()
    bind(w, short)
    greedy(w, [5, 77, 300], 4)
    bind(w, long)
    prompt = list(range(3, 33))  # positions past the first run's 16
    assert greedy(w, prompt, 8) == fresh(make, long, prompt, 8)
