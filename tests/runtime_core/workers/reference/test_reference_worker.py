"""The reference worker keeps the worker interface (EDGES_AND_WORKERS.md §4)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from runplan import SamplingConfig, WorkerCapabilities
from runtime_core.workers.interface import TokenOutput, Worker, WorkerError
from runtime_core.workers.reference.worker import ReferenceWorker
from tests.fixtures.gguf_models import ModelShape, write_model
from tests.support.chain import Chain, provisions

PROMPT = np.array([5, 77, 300, 12, 9], dtype=np.uint32)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("w") / "m.gguf", ModelShape(n_layers=4))


def bound(model: Path, stages: int = 1, index: int = 0, **kwargs: object) -> ReferenceWorker:
    p = provisions(model, stages, **kwargs)[index]  # type: ignore[arg-type]
    w = ReferenceWorker()
    w.configure(p)
    w.bind(p.gguf_source)
    return w


def test_it_is_a_worker_with_the_reference_capabilities() -> None:
    worker: Worker = ReferenceWorker()
    assert worker.capabilities == WorkerCapabilities()
    archs = ("llama", "qwen2", "qwen3", "gemma3", "phi3")
    assert ReferenceWorker.capabilities.architectures == archs
    assert len(ReferenceWorker.capabilities.quant_types) == 13


def test_a_step_before_bind_is_an_error(model: Path) -> None:
    w = ReferenceWorker()
    with pytest.raises(WorkerError, match="before bind"):
        w.execute_step(0, PROMPT)
    w.configure(provisions(model)[0])
    with pytest.raises(WorkerError, match="before bind"):
        w.execute_step(0, PROMPT)


def test_a_step_after_release_is_an_error(model: Path) -> None:
    w = bound(model)
    w.execute_step(0, PROMPT)
    w.release()
    with pytest.raises(WorkerError, match="before bind"):
        w.execute_step(1, np.array([3], dtype=np.uint32))


def test_bind_reports_progress_up_to_the_stage_bytes(model: Path) -> None:
    p = provisions(model, 2)[1]
    seen: list[tuple[int, int]] = []
    w = ReferenceWorker()
    w.configure(p)
    w.bind(p.gguf_source, lambda done, total: seen.append((done, total)))
    totals = {t for _, t in seen}
    assert len(totals) == 1
    dones = [d for d, _ in seen]
    assert dones == sorted(dones) and dones[-1] == totals.pop()


def test_steps_must_come_in_order(model: Path) -> None:
    w = bound(model)
    with pytest.raises(WorkerError, match="out of order"):
        w.execute_step(1, np.array([3], dtype=np.uint32))  # no prefill yet
    w.execute_step(0, PROMPT)
    with pytest.raises(WorkerError, match="out of order"):
        w.execute_step(2, np.array([3], dtype=np.uint32))
    w.execute_step(1, np.array([3], dtype=np.uint32))
    with pytest.raises(WorkerError, match="expected 1"):
        w.execute_step(2, np.array([3, 4], dtype=np.uint32))  # a decode step is one row


def test_a_sequence_longer_than_max_seq_len_is_an_error(model: Path) -> None:
    w = bound(model, max_seq_len=6)
    w.execute_step(0, PROMPT)
    w.execute_step(1, np.array([3], dtype=np.uint32))  # position 5: the last one
    with pytest.raises(WorkerError, match="max_seq_len"):
        w.execute_step(2, np.array([3], dtype=np.uint32))


@pytest.mark.parametrize(
    "data",
    [
        np.array([], dtype=np.uint32),
        np.array([[1, 2]], dtype=np.uint32),
        np.array([1.0, 2.0], dtype=np.float32),
        np.array([1, 323], dtype=np.uint32),  # the vocabulary is 0..322
    ],
    ids=["empty", "2-d", "floats", "outside-vocab"],
)
def test_the_first_stage_refuses_what_is_not_token_ids(model: Path, data: np.ndarray) -> None:
    with pytest.raises(WorkerError):
        bound(model).execute_step(0, data)


@pytest.mark.parametrize(
    "data",
    [
        np.zeros((3, 64), dtype=np.float16),  # the plan says f32
        np.zeros((3, 65), dtype=np.float32),
        np.zeros(64, dtype=np.float32),
    ],
    ids=["dtype", "width", "1-d"],
)
def test_a_later_stage_refuses_activations_the_plan_does_not_carry(
    model: Path, data: np.ndarray
) -> None:
    with pytest.raises(WorkerError):
        bound(model, 2, 1).execute_step(0, data)


def test_a_stage_never_changes_its_input(model: Path) -> None:
    first, last = bound(model, 2, 0), bound(model, 2, 1)
    ids = PROMPT.copy()
    acts = first.execute_step(0, ids)
    assert isinstance(acts, np.ndarray)
    kept = acts.copy()
    last.execute_step(0, acts)
    np.testing.assert_array_equal(ids, PROMPT)
    np.testing.assert_array_equal(acts, kept)


def test_logits_come_back_only_when_the_run_asks(model: Path) -> None:
    with_logits = bound(model, return_logits=True).execute_step(0, PROMPT)
    without = bound(model, return_logits=False).execute_step(0, PROMPT)
    assert isinstance(with_logits, TokenOutput) and isinstance(without, TokenOutput)
    assert without.logits is None
    assert with_logits.logits is not None
    assert with_logits.logits.dtype == np.float32 and with_logits.logits.shape == (323,)
    assert with_logits.token_id == without.token_id == int(np.argmax(with_logits.logits))


def test_a_new_prefill_starts_the_sequence_afresh(model: Path) -> None:
    chain = Chain.bind(provisions(model, 2, sampling=SamplingConfig(temperature=0.9, seed=3)))
    first = [o.token_id for o in chain.generate(PROMPT.tolist(), 8)]
    again = [o.token_id for o in chain.generate(PROMPT.tolist(), 8)]
    assert first == again


def test_the_same_seed_samples_the_same_tokens_however_the_model_is_split(
    model: Path,
) -> None:
    sampling = SamplingConfig(temperature=1.5, top_k=40, top_p=0.95, seed=11)
    runs = []
    for stages in (1, 2, 4, 1):
        chain = Chain.bind(provisions(model, stages, sampling=sampling))
        runs.append([o.token_id for o in chain.generate(PROMPT.tolist(), 12)])
    assert all(r == runs[0] for r in runs)
    other = Chain.bind(provisions(model, 1, sampling=SamplingConfig(temperature=1.5, seed=12)))
    assert [o.token_id for o in other.generate(PROMPT.tolist(), 12)] != runs[0]
