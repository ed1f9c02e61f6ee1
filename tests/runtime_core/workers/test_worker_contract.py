"""The worker interface (EDGES_AND_WORKERS.md §4), one suite for every worker: the NumPy
reference worker, the CPU worker, the CUDA worker on the emulated CuPy
(``tests/support/emulated_cupy.py``: its device code on a CPU) and on a GPU where there
is one (skipped, saying why, elsewhere). What each worker computes and holds beyond the
interface is in its own tests (``reference/``, ``cpu/``, ``runtime_cupy/cuda/``); what
it does for a chain of runs (batches, chunks, KV budget) in ``test_worker_runs.py``,
over the same workers (``tests/support/every_worker.py``).

- Order: a step before bind or after release, a bind before configure, a step out of
  order, a decode step of more than one row, a step past ``max_seq_len``: each a
  ``WorkerError``.
- Inputs: the first stage takes 1-d token ids inside the vocabulary, later stages the
  plan's activations (dtype, width, 2-d); a stage changes neither its input nor, on a
  later step, what it returned.
- Outputs: logits only when the run asks, the token their argmax when greedy; a new
  prefill starts the sampler afresh; the same seed draws the reference worker's tokens
  however the model is split (a float model: every worker computes the reference's
  logits there), another seed other tokens.
- Binding: progress up to the slice's bytes; a file the worker cannot run is a typed
  bind error (``WorkerError`` caused by ``UnsupportedModel``), after which the worker
  is unbound.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np
import pytest

from runplan import GgufSource, SamplingConfig, WorkerCapabilities
from runtime_core.errors import UnsupportedModel
from runtime_core.workers.interface import TokenOutput, Worker, WorkerError
from runtime_core.workers.reference.worker import ReferenceWorker
from tests.fixtures.gguf_models import ModelShape, write_model
from tests.support.chain import Chain, provisions, run
from tests.support.every_worker import WORKERS, MakeWorker, worker_for

PROMPT = [5, 77, 300, 12, 9]
VOCAB = 323  # ModelShape's
HIDDEN = 64


@pytest.fixture(params=list(WORKERS))
def make(request: pytest.FixtureRequest) -> MakeWorker:
    return worker_for(request.param)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("contract")


@pytest.fixture(scope="module")
def model(folder: Path) -> Path:
    """Four llama blocks of float32 weights: every worker computes the reference
    worker's logits on them (no 8-bit products of float weights)."""
    return write_model(folder / "m.gguf", ModelShape(n_layers=4))


def bound(make: MakeWorker, path: Path, stages: int = 1, index: int = 0, **kw: object) -> Worker:
    p = provisions(path, stages, **kw)[index]  # type: ignore[arg-type]
    w = make()
    w.configure(p)
    w.bind(p.gguf_source)
    return w


def ids(values: list[int]) -> np.ndarray:
    return np.array(values, np.uint32)


def host(a: object) -> np.ndarray:
    """A step's activations as a host array (a device array is copied back)."""
    get = getattr(a, "get", None)
    return np.asarray(get() if callable(get) else a)


def test_it_is_a_worker_with_capabilities_for_the_planner(make: MakeWorker) -> None:
    worker = make()
    assert isinstance(worker.capabilities, WorkerCapabilities)
    assert worker.capabilities is type(worker).capabilities
    assert set(worker.capabilities.architectures) >= {"llama", "qwen2"}


def test_steps_before_bind_or_after_release_are_errors(make: MakeWorker, model: Path) -> None:
    w = make()
    with pytest.raises(WorkerError, match="before bind"):
        w.execute_step(0, ids(PROMPT))
    with pytest.raises(WorkerError, match="before configure"):
        w.bind(provisions(model)[0].gguf_source)
    w.configure(provisions(model)[0])
    with pytest.raises(WorkerError, match="before bind"):
        w.execute_step(0, ids(PROMPT))
    w = bound(make, model)
    w.execute_step(0, ids(PROMPT))
    w.release()
    with pytest.raises(WorkerError, match="before bind"):
        w.execute_step(1, ids([3]))


def test_steps_come_in_order_decode_one_row_and_fit_max_seq_len(
    make: MakeWorker, model: Path
) -> None:
    w = bound(make, model, max_seq_len=7)
    with pytest.raises(WorkerError, match="out of order"):
        w.execute_step(1, ids([3]))  # no prefill yet
    w.execute_step(0, ids(PROMPT))
    with pytest.raises(WorkerError, match="out of order"):
        w.execute_step(2, ids([3]))
    with pytest.raises(WorkerError, match="expected 1"):
        w.execute_step(1, ids([3, 4]))  # a decode step is one row
    w.execute_step(1, ids([3]))
    w.execute_step(2, ids([3]))  # position 6: the last one
    with pytest.raises(WorkerError, match="max_seq_len"):
        w.execute_step(3, ids([3]))
    w.release()


@pytest.mark.parametrize(
    "data",
    [
        np.array([], np.uint32),
        np.array([[1, 2]], np.uint32),
        np.array([1.0, 2.0], np.float32),
        np.array([1, VOCAB], np.uint32),
    ],
    ids=["empty", "2-d", "floats", "outside-vocab"],
)
def test_the_first_stage_refuses_what_is_not_token_ids(
    make: MakeWorker, model: Path, data: np.ndarray
) -> None:
    with pytest.raises(WorkerError):
        bound(make, model).execute_step(0, data)


@pytest.mark.parametrize(
    "data",
    [
        np.zeros((3, HIDDEN), np.float16),  # the plan says f32
        np.zeros((3, HIDDEN + 1), np.float32),
        np.zeros(HIDDEN, np.float32),
    ],
    ids=["dtype", "width", "1-d"],
)
def test_a_later_stage_refuses_activations_the_plan_does_not_carry(
    make: MakeWorker, model: Path, data: np.ndarray
) -> None:
    with pytest.raises(WorkerError):
        bound(make, model, 2, 1).execute_step(0, data)


def test_a_stage_changes_neither_its_input_nor_what_it_returned(
    make: MakeWorker, model: Path
) -> None:
    first, last = bound(make, model, 2, 0), bound(make, model, 2, 1)
    tokens = ids(PROMPT)
    acts = first.execute_step(0, tokens)
    assert not isinstance(acts, TokenOutput)
    assert host(acts).shape == (len(PROMPT), HIDDEN) and host(acts).dtype == np.float32
    kept = host(acts).copy()
    last.execute_step(0, acts)
    again = first.execute_step(0, tokens)  # a new prefill: new output, the old one kept
    np.testing.assert_array_equal(tokens, PROMPT)
    np.testing.assert_array_equal(host(acts), kept)
    np.testing.assert_array_equal(host(again), kept)


def test_logits_come_back_only_when_the_run_asks(make: MakeWorker, model: Path) -> None:
    with_logits = bound(make, model, return_logits=True).execute_step(0, ids(PROMPT))
    without = bound(make, model, return_logits=False).execute_step(0, ids(PROMPT))
    assert isinstance(with_logits, TokenOutput) and isinstance(without, TokenOutput)
    assert without.logits is None
    assert with_logits.logits is not None
    assert with_logits.logits.dtype == np.float32 and with_logits.logits.shape == (VOCAB,)
    assert with_logits.token_id == without.token_id == int(np.argmax(with_logits.logits))


def test_a_new_prefill_starts_the_sequence_afresh(make: MakeWorker, model: Path) -> None:
    chain = Chain.bind(provisions(model, 2, sampling=SamplingConfig(temperature=0.9, seed=3)), make)
    first = [o.token_id for o in chain.generate(PROMPT, 8)]
    assert [o.token_id for o in chain.generate(PROMPT, 8)] == first
    chain.release()


def test_the_same_seed_draws_the_reference_tokens_however_the_model_is_split(
    make: MakeWorker, model: Path
) -> None:
    sampling = SamplingConfig(temperature=1.5, top_k=40, top_p=0.95, seed=11)
    reference = [o.token_id for o in run(provisions(model, sampling=sampling),
                                         ReferenceWorker, PROMPT, 12)]  # fmt: skip
    for stages in (1, 2, 4):
        ours = run(provisions(model, stages, sampling=sampling), make, PROMPT, 12)
        assert [o.token_id for o in ours] == reference, stages
    other = run(provisions(model, 1, sampling=SamplingConfig(temperature=1.5, seed=12)),
                make, PROMPT, 12)  # fmt: skip
    assert [o.token_id for o in other] != reference


@pytest.mark.parametrize("k", [1, 6, 11])
def test_a_replay_after_k_tokens_continues_the_stream(
    make: MakeWorker, model: Path, k: int
) -> None:
    """Issue 25's replay: a run of the stream's prompt and first ``k`` tokens, its
    sampler resumed after them (``sampling.tokens_delivered``), samples the stream's
    tokens from ``k`` on: on every worker a seeded token takes exactly one draw (device
    sampling included) and a greedy one none."""
    seeded = SamplingConfig(temperature=1.5, top_k=40, top_p=0.95, seed=11)
    for sampling in (SamplingConfig(), seeded):
        whole = [o.token_id for o in run(provisions(model, 2, sampling=sampling), make, PROMPT, 12)]
        resumed = attrs.evolve(sampling, tokens_delivered=k)
        rest = run(provisions(model, 2, sampling=resumed), make, PROMPT + whole[:k], 12 - k)
        assert [o.token_id for o in rest] == whole[k:], sampling
    # the count matters: resumed after another number of tokens, the draws differ
    wrong = attrs.evolve(seeded, tokens_delivered=k + 1)
    whole = [o.token_id for o in run(provisions(model, 2, sampling=seeded), make, PROMPT, 12)]
    rest = run(provisions(model, 2, sampling=wrong), make, PROMPT + whole[:k], 12 - k)
    assert [o.token_id for o in rest] != whole[k:]


def test_bind_reports_progress_up_to_the_stage_bytes(make: MakeWorker, model: Path) -> None:
    p = provisions(model, 2)[1]
    seen: list[tuple[int, int]] = []
    w = make()
    w.configure(p)
    w.bind(p.gguf_source, lambda done, total: seen.append((done, total)))
    assert seen, "no progress reported"
    totals = {t for _, t in seen}
    assert len(totals) == 1
    dones = [d for d, _ in seen]
    assert dones == sorted(dones) and dones[-1] == totals.pop()
    w.release()


def test_a_file_the_worker_cannot_run_is_a_typed_bind_error(make: MakeWorker, folder: Path) -> None:
    shape = ModelShape(n_layers=1)
    good = write_model(folder / "good.gguf", shape)
    bad = write_model(folder / "iq.gguf", shape, tensor_types={"blk.0.attn_q.weight": "MXFP4"})
    w = make()
    w.configure(provisions(good)[0])
    with pytest.raises(WorkerError) as info:
        w.bind(GgufSource.single(str(bad)))
    assert isinstance(info.value.__cause__, UnsupportedModel)
    with pytest.raises(WorkerError, match="before bind"):
        w.execute_step(0, ids(PROMPT))
