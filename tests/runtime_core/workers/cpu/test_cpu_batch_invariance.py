"""Batch invariance of the CPU worker's products (CONCURRENT_RUNS.md §3): a matrix times R
activation rows (``_kernels.linear``, the product a prefill and a batch of several runs'
decode rows share) gives each row the bits that row gets alone, whatever the other rows
(random content), their number (1 to 16 others), the row's place among them, the
thread count (1 to 4) and the instruction set (each a parameter, skipped with the
reason where this processor lacks it).

Matrices are held as the worker holds them (``repack=True``: the types with an x8
layout repacked, the others as stored), 8-bit and float ("f32") activations; 45 rows
of output (a last group of 5 padded rows) and rows of 512 elements (two K-quant
super-blocks, 16 blocks of 32).

A stage's backend (``CpuBackend``) given a prompt in chunks (steps of several rows at
positions past 0, as CONCURRENT_RUNS.md §4 carries a prefill) computes the last row's
logits, bit for bit, that it computes given the prompt whole, on every instruction set
and thread count; and three runs on a 2-stage chain of CPU workers, batched together
through the chain's interface (``open_run``, ``execute_batch``: CONCURRENT_RUNS.md §4)
with their prompts in chunks, give each run's tokens and logits of the portable set
running it alone, whole, bit for bit, on every instruction set (of the random model,
and of two mixtures of experts). Steps of changing row
counts take views of the step buffers the stage made at bind (a longer one its own).
"""

from __future__ import annotations

import weakref
from pathlib import Path

import attrs
import numpy as np
import pytest

from runplan import SamplingConfig
from runtime_core.gguf_slice import open_stage_slice
from runtime_core.workers.cpu import _kernels
from runtime_core.workers.cpu.backend import CpuBackend
from runtime_core.workers.cpu.step_buffers import KEPT_ROWS, PAGE, RowSet
from runtime_core.workers.cpu.worker import CpuWorker
from runtime_core.workers.interface import BatchStep, TokenOutput
from runtime_core.workers.stage_worker import BackendSpec, BackendStep
from tests.fixtures.gguf_models import FIXTURE_SHAPES, write_model
from tests.support.chain import Chain, provisions
from tests.support.cpu_isas import isa_params
from tests.support.kernel_spy import KernelSpy
from tests.support.random_blocks import random_rows
from tests.support.random_model import RandomModel, write_random_model

TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q2_K", "F16")
N_IN, N_OUT = 512, 45


def linear(m: _kernels.Matrix, x: np.ndarray, use_q8: bool, threads: int, isa: str) -> np.ndarray:
    rows, n = x.shape
    y = np.zeros((rows, m.n_out), np.float32)
    if use_q8 and m.act_format != "f32":
        q, d = np.zeros((rows, n), np.int8), np.zeros((rows, n // 32), np.float32)
        s, g = d.copy(), np.zeros((rows, n // 16), np.int32)
        _kernels.linear(m, rows, x, q, d, s, g, True, True, y, None, False, threads, isa=isa)
    else:
        _kernels.linear(
            m, rows, x, None, None, None, None, False, False, y, None, False, threads, isa=isa
        )
    return y


def activations(rng: np.random.Generator, rows: int) -> np.ndarray:
    x = (rng.standard_normal((rows, N_IN)) * rng.uniform(0.1, 10.0, (rows, 1))).astype(np.float32)
    x[:, :32] *= 20.0  # an outlier block, as real residual streams have
    return x


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("use_q8", [True, False], ids=["q8", "f32"])
@pytest.mark.parametrize("qtype", TYPES)
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(
    qtype: str, use_q8: bool, isa: str
) -> None:
    rng = np.random.default_rng(TYPES.index(qtype))
    raw = random_rows(rng, qtype, N_OUT, N_IN, scale=1 / np.sqrt(N_IN))
    m = _kernels.Matrix([(raw, qtype, N_OUT, N_IN, 0)], repack=True, threads=2)
    row = activations(rng, 1)
    alone = linear(m, row, use_q8, 1, "portable")[0].view(np.uint32)
    for others in range(1, 17):
        batch = activations(rng, others + 1)
        at = int(rng.integers(0, others + 1))
        batch[at] = row[0]
        for threads in (1, 2, 3, 4):
            got = linear(m, batch, use_q8, threads, isa)[at].view(np.uint32)
            np.testing.assert_array_equal(got, alone, err_msg=f"{others} others, {threads} threads")


def test_idle_threads_block_instead_of_spinning() -> None:
    """The pool's workers spin 100 us after an operation (csrc/pool.h), then block: a
    stage waiting for its next step leaves the host's cores to the other stages. Over
    0.5 s of waiting after a product on 4 threads, the process spends under 50 ms of
    CPU time (3 workers spinning 100 us each is 0.3 ms; a worker that spun on would
    spend the 0.5 s, or its share of a busy host's core, far above 50 ms)."""
    import time

    rng = np.random.default_rng(0)
    raw = random_rows(rng, "Q4_0", 512, N_IN, scale=1 / np.sqrt(N_IN))
    m = _kernels.Matrix([(raw, "Q4_0", 512, N_IN, 0)], repack=True)
    x = activations(rng, 4)
    for _ in range(20):
        linear(m, x, True, 4, _kernels.isas()[-1])
    cpu0 = time.process_time()
    time.sleep(0.5)
    assert time.process_time() - cpu0 < 0.05


#: every type with an x8 layout and some without, in one model
CHUNKED = RandomModel(
    n_layers=2,
    qtype="Q4_K",
    embed_qtype="Q8_0",
    head_qtype="Q6_K",
    seed=11,
    overrides=(
        ("blk.0.attn_q.weight", "Q4_0"),
        ("blk.0.attn_v.weight", "Q8_0"),
        ("blk.0.ffn_down.weight", "Q5_K"),
        ("blk.1.ffn_up.weight", "Q4_1"),
        ("blk.1.attn_k.weight", "Q5_0"),
        ("blk.1.attn_output.weight", "Q2_K"),
    ),
)


def bound_backend(
    path: Path, positions: int = 128, threads: int = 2, isa: str | None = None
) -> CpuBackend:
    """A CPU backend (f32 edges and cache, 8-bit products) bound to the first two blocks
    of ``path``, its rotations for ``positions`` positions."""
    backend = CpuBackend(BackendSpec(True, True, np.dtype(np.float32), "f32", "q8"), threads, isa)
    with open_stage_slice(path, 0, 2, is_first=True, is_last=True,
                          capabilities=CpuWorker.capabilities) as stage:  # fmt: skip
        backend.load(stage, positions, None)
    return backend


def prompt_logits(path: Path, chunks: list[int], threads: int, isa: str) -> np.ndarray:
    """The last row's logits after feeding a prompt in chunks of these sizes."""
    backend = bound_backend(path, 64, threads, isa)
    cache = backend.new_cache(64)  # the run's cache (a fresh one per prompt)
    ids = np.random.default_rng(3).integers(0, 512, sum(chunks)).astype(np.int32)
    pos = 0
    for rows in chunks:
        backend.run_batch([BackendStep(cache, ids[pos : pos + rows], rows, pos, True)])
        pos += rows
    logits = backend.logits_of(0)
    backend.release()
    return logits


@pytest.mark.parametrize("isa", isa_params())
def test_a_prompt_in_chunks_computes_the_logits_of_the_prompt_whole(
    tmp_path: Path, isa: str
) -> None:
    path = write_random_model(tmp_path / "chunked.gguf", CHUNKED)
    whole = prompt_logits(path, [23], 1, "portable").view(np.uint32)
    for chunks, threads in (([23], 3), ([1, 7, 3, 12], 2), ([5, 5, 5, 5, 3], 4), ([1] * 23, 1)):
        got = prompt_logits(path, chunks, threads, isa).view(np.uint32)
        np.testing.assert_array_equal(got, whole, err_msg=f"chunks {chunks}, {threads} threads")


def test_steps_of_changing_rows_take_the_buffers_kept_at_bind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bound stage's steps of up to ``KEPT_ROWS`` rows take views of the buffers it made
    at bind, whatever their row counts (nothing made per step); a longer step (an
    unchunked prefill) makes its own, lets them go when it ends but for its output rows,
    and the next steps come back to the kept ones; and a prompt fed in such steps gives
    the logits of the prompt whole, bit for bit."""
    path = write_random_model(tmp_path / "kept.gguf", CHUNKED)

    def logits(chunks: list[int]) -> np.ndarray:
        backend = bound_backend(path)
        ops = backend.ops
        assert ops is not None and ops.logits_kept is not None
        made: list[weakref.ref[RowSet]] = []  # the row sets made after bind
        row_set = ops._row_set

        def watched(cap: int) -> RowSet:
            made.append(weakref.ref(out := row_set(cap)))
            return out

        monkeypatch.setattr(ops, "_row_set", watched)
        # the kept buffers start at different places in their pages (``STAGGER``)
        bufs = [*ops.kept.full.values(), ops.kept.h_flat, ops.kept.act_flat]
        assert len({a.ctypes.data % PAGE for a in bufs}) == len(bufs)
        cache = backend.new_cache(128)
        ids = np.random.default_rng(5).integers(0, 512, sum(chunks)).astype(np.int32)
        pos = 0
        for rows in chunks:
            backend.run_batch([BackendStep(cache, ids[pos : pos + rows], rows, pos, True)])
            pos += rows
            kept = rows <= KEPT_ROWS
            assert len(made) == (not kept)  # a long step made its own row set ...
            assert all(ref() is None for ref in made)  # ... and let it go when it ended
            made.clear()
            assert ops.out.shape[0] == rows
            assert np.shares_memory(ops.out, ops.kept.full["x"]) == kept
            assert ops.buf.base is ops.kept
            if kept:
                assert ops.buf.rows == rows
                for name, full in ops.kept.full.items():
                    assert np.shares_memory(ops.buf.views[name], full), (rows, name)
                assert np.shares_memory(ops.buf.h_flat, ops.kept.h_flat)
                assert all(np.shares_memory(q.q, ops.kept.q8[key].q)
                           for key, q in ops.buf.q8.items())  # fmt: skip
            assert np.shares_memory(ops.logits, ops.logits_kept)  # one head row a step
        out = backend.logits_of(0)
        backend.release()
        return out.view(np.uint32)

    whole = logits([KEPT_ROWS + 42])
    np.testing.assert_array_equal(logits([KEPT_ROWS + 6, 1, KEPT_ROWS - 33, 3, 1]), whole)
    np.testing.assert_array_equal(logits([3, KEPT_ROWS, 1, 2, KEPT_ROWS - 28]), whole)


def test_a_mixtures_long_step_keeps_no_buffers_of_its_own(tmp_path: Path) -> None:
    """A mixture's (row, slot) pair buffers: a step beyond ``KEPT_ROWS`` rows makes its
    own and leaves the ones kept at bind as they were (a long prefill does not grow what
    the stage holds); the prompt whole and in chunks give the same logits, bit for bit."""
    shape = attrs.evolve(FIXTURE_SHAPES["qwen3moe"], quant="Q8_0")
    path = write_model(tmp_path / "moe.gguf", shape)

    def logits(chunks: list[int]) -> np.ndarray:
        backend = bound_backend(path)
        ops = backend.ops
        assert ops is not None and ops.moe
        at_bind = {name: (id(a), a.size) for name, a in ops.moe_bufs.items()}
        kept = ops.kept_bytes
        cache = backend.new_cache(128)
        vocab = ops.w.vocab_size
        ids = np.random.default_rng(6).integers(0, vocab, sum(chunks)).astype(np.int32)
        pos = 0
        for rows in chunks:
            backend.run_batch([BackendStep(cache, ids[pos : pos + rows], rows, pos, True)])
            pos += rows
            assert {name: (id(a), a.size) for name, a in ops.moe_bufs.items()} == at_bind
            assert ops.kept_bytes == kept
        out = backend.logits_of(0)
        backend.release()
        return out.view(np.uint32)

    whole = logits([KEPT_ROWS + 30])
    np.testing.assert_array_equal(logits([20, KEPT_ROWS, 10]), whole)


PROMPTS = {"a": [5, 77, 300, 12, 9, 41, 8], "b": [1, 2, 3], "c": [200, 17, 45, 99, 3, 8, 250, 6]}


def batched_outputs(
    path: Path, isa: str, runs: list[str], chunk: int
) -> dict[str, list[tuple[int, np.ndarray]]]:
    """Each run's 4 (token, logits) on a 2-stage chain of ``CpuWorker(isa=isa)``, the
    ``runs`` batched together; run "b" samples (temperature 0.8), the others are greedy."""
    provs = {
        r: provisions(path, 2, max_seq_len=32, run_id=f"run-{r}", max_concurrent_runs=3,
                      sampling=SamplingConfig(temperature=0.8, seed=4) if r == "b" else None)
        for r in PROMPTS
    }  # fmt: skip
    chain = Chain.bind(provs["a"], lambda: CpuWorker(isa=isa, threads=2))
    try:
        for r in runs:
            chain.open(provs[r])
        outs = chain.generate_batched({f"run-{r}": PROMPTS[r] for r in runs}, 4, chunk)
    finally:
        chain.release()
    assert all(o.logits is not None for got in outs.values() for o in got)
    return {
        r.removeprefix("run-"): [(o.token_id, np.asarray(o.logits).view(np.uint32)) for o in got]
        for r, got in outs.items()
    }


def batched_model(folder: Path, name: str) -> Path:
    """The chunked random model, or a mixture of experts (qwen3moe's, llama's), Q8_0."""
    if name == "dense":
        return write_random_model(folder / "chunked.gguf", CHUNKED)
    return write_model(folder / f"{name}.gguf", attrs.evolve(FIXTURE_SHAPES[name], quant="Q8_0"))


@pytest.mark.parametrize("model", ["dense", "qwen3moe", "llama-moe", "qwen2moe"])
@pytest.mark.parametrize("isa", isa_params())
def test_runs_batched_in_chunks_compute_what_each_computes_alone_whole(
    tmp_path: Path, isa: str, model: str
) -> None:
    """Of a mixture of experts too: each row is routed alone, and the rows that chose an
    expert are one product whose rows each get their bits alone."""
    path = batched_model(tmp_path, model)
    together = batched_outputs(path, isa, list(PROMPTS), 3)
    for r in PROMPTS:
        (alone,) = batched_outputs(path, "portable", [r], 0).values()
        assert [t for t, _ in together[r]] == [t for t, _ in alone], f"run {r}"
        for (_, got), (_, want) in zip(together[r], alone, strict=True):
            np.testing.assert_array_equal(got, want, err_msg=f"run {r}")


EIGHT = [
    [5, 77, 300, 12, 9, 41, 8],
    [1, 2, 3],
    [200, 17, 45, 99, 3, 8, 250, 6],
    [42],
    [7, 7, 7, 7, 7],
    [310, 11, 64, 128, 256, 3],
    [9, 8],
    [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110],
]


def eight_runs(
    path: Path,
    isa: str,
    runs: list[int],
    chunk: int,
    staggered: bool,
    prompts: list[list[int]] = EIGHT,
    tokens: int = 4,
) -> tuple[dict[int, list[tuple[int, np.ndarray]]], dict[int, np.ndarray]]:
    """Each run's ``tokens`` (token, logits) and its first stage's output rows (all its
    steps', stacked) on a 2-stage chain of ``CpuWorker(isa=isa)``; ``staggered``: run k joins at
    batch k, so batches hold prefill chunks of several lengths beside decode rows at
    other positions. Odd runs sample (temperature 0.8), even ones are greedy."""
    provs = {
        k: provisions(path, 2, max_seq_len=48, run_id=f"run-{k}", max_concurrent_runs=8,
                      sampling=SamplingConfig(temperature=0.8, seed=k) if k % 2 else None)
        for k in runs
    }  # fmt: skip
    chain = Chain.bind(provs[runs[0]], lambda: CpuWorker(isa=isa, threads=2))
    chain.activations = {}
    try:
        for k in runs:
            chain.open(provs[k])
        join = {f"run-{k}": k for k in runs} if staggered else None
        outs = chain.generate_batched({f"run-{k}": prompts[k] for k in runs}, tokens, chunk, join)
    finally:
        chain.release()
    tokens = {
        k: [(o.token_id, np.asarray(o.logits).view(np.uint32)) for o in outs[f"run-{k}"]]
        for k in runs
    }
    rows = {k: np.concatenate(chain.activations[(0, f"run-{k}")]).view(np.uint32) for k in runs}
    return tokens, rows


@pytest.mark.parametrize("isa", isa_params())
def test_eight_runs_at_other_steps_compute_what_each_computes_alone_whole(
    tmp_path: Path, isa: str
) -> None:
    """Eight runs joining one batch after another, prefills in chunks of 3 (batches of
    1 to 8 runs mixing chunks and decode rows): each run's activations, tokens and logits
    are those of the portable set running it alone with its prompt whole, bit for bit."""
    path = write_random_model(tmp_path / "chunked.gguf", CHUNKED)
    tokens, rows = eight_runs(path, isa, list(range(8)), 3, staggered=True)
    for k in range(8):
        alone_tokens, alone_rows = eight_runs(path, "portable", [k], 0, staggered=False)
        np.testing.assert_array_equal(rows[k], alone_rows[k], err_msg=f"run {k}")
        assert [t for t, _ in tokens[k]] == [t for t, _ in alone_tokens[k]], f"run {k}"
        for (_, got), (_, want) in zip(tokens[k], alone_tokens[k], strict=True):
            np.testing.assert_array_equal(got, want, err_msg=f"run {k}")


#: gemma3 (block 0 slides over a window of 12, block 1 is global; per-head Q/K norms,
#: post-norms, GELU gating) with a logit soft cap: every optional step, batched
GEMMA3 = attrs.evolve(FIXTURE_SHAPES["gemma3"], final_logit_softcap=30.0)
#: prompts of 14 to 20 tokens: prefills and decodes past the window of 12
LONG = [[(7 * k + 3 * j) % 250 + 1 for j in range(14 + 2 * k)] for k in range(4)]


def test_runs_past_a_sliding_window_batched_compute_what_each_computes_alone(
    tmp_path: Path,
) -> None:
    """Four gemma3 runs joining one batch after another, prompts in chunks of 5 and
    decodes past the window: each run's activations, tokens and logits are those of
    the run alone with its prompt whole, bit for bit (its own ring, at its positions)."""
    path = write_model(tmp_path / "gemma3.gguf", GEMMA3)
    tokens, rows = eight_runs(path, "portable", [0, 1, 2, 3], 5, True, LONG, 6)
    for k in range(4):
        alone_tokens, alone_rows = eight_runs(path, "portable", [k], 0, False, LONG, 6)
        np.testing.assert_array_equal(rows[k], alone_rows[k], err_msg=f"run {k}")
        assert [t for t, _ in tokens[k]] == [t for t, _ in alone_tokens[k]], f"run {k}"
        for (_, got), (_, want) in zip(tokens[k], alone_tokens[k], strict=True):
            np.testing.assert_array_equal(got, want, err_msg=f"run {k}")


def test_a_batch_of_eight_decode_rows_multiplies_each_weight_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU worker reads each weight once per batch: a batch of 8 runs' decode steps
    makes as many product calls (``_kernels.linear``) as a batch of one run's, each over
    the 8 rows (the head's too: every run's last row needs a token). Each shape of step
    is new here, so its calls are recorded into its step program, which makes each once
    per run."""
    import runtime_core.workers.cpu.ops as cpu_ops

    path = write_random_model(tmp_path / "chunked.gguf", CHUNKED)
    provs = [provisions(path, 1, max_seq_len=32, run_id=f"r{k}", max_concurrent_runs=8)[0]
             for k in range(8)]  # fmt: skip
    linear_rows: list[int] = []

    def seen(name: str, args: tuple[object, ...], kw: dict[str, object]) -> None:
        if name == "linear":
            linear_rows.append(int(args[1]))  # type: ignore[call-overload]

    monkeypatch.setattr(cpu_ops, "_kernels", KernelSpy(seen))
    worker = CpuWorker(threads=2)
    worker.configure(provs[0])
    worker.bind(provs[0].gguf_source)
    try:
        for p in provs:
            worker.open_run(p)
        prefill = [BatchStep(p.run_id, 0, 0, 1, np.array([3, 4, 5], np.uint32)) for p in provs]
        assert all(isinstance(o, TokenOutput) for o in worker.execute_batch(prefill))
        linear_rows.clear()
        (one,) = worker.execute_batch([BatchStep("r0", 1, 0, 1, np.array([7], np.uint32))])
        assert isinstance(one, TokenOutput)
        alone = list(linear_rows)
        assert alone and set(alone) == {1}
        linear_rows.clear()
        decode = [BatchStep(p.run_id, 1, 0, 1, np.array([7], np.uint32)) for p in provs[1:]]
        outs = worker.execute_batch([*decode, BatchStep("r0", 2, 0, 1, np.array([9], np.uint32))])
        assert all(isinstance(o, TokenOutput) for o in outs)
        assert linear_rows == [8] * len(alone)
    finally:
        worker.release()


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("use_q8", [True, False], ids=["q8", "f32"])
@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0", "Q6_K", "Q4_0", "F16"])
def test_products_over_spans_of_rows_are_each_spans_own(qtype: str, use_q8: bool, isa: str) -> None:
    """``linear_spans`` (a mixture's experts, each over the rows that chose it, in one
    call): every span's rows get the bits ``linear`` gives them over that span alone,
    whatever the threads, with spans empty, of one row and of many."""
    rng = np.random.default_rng(7)
    experts = [
        _kernels.Matrix(
            [
                (
                    random_rows(rng, qtype, N_OUT, N_IN, scale=1 / np.sqrt(N_IN)),
                    qtype,
                    N_OUT,
                    N_IN,
                    0,
                )
            ],
            repack=True,
            threads=2,
        )
        for _ in range(5)
    ]
    x = activations(rng, 23)
    spans = [(0, 1), (1, 1), (1, 9), (9, 10), (10, 23)]  # one, none, eight, one, thirteen
    want = np.concatenate(
        [
            linear(m, x[a:b], use_q8, 1, isa)
            for m, (a, b) in zip(experts, spans, strict=True)
            if b > a
        ]
    )
    for threads in (1, 2, 3):
        y = np.full((23, N_OUT), np.nan, np.float32)
        if use_q8 and experts[0].act_format != "f32":
            q, d = np.zeros((23, N_IN), np.int8), np.zeros((23, N_IN // 32), np.float32)
            s, g = d.copy(), np.zeros((23, N_IN // 16), np.int32)
            _kernels.linear_spans(experts, spans, x, q, d, s, g, y, threads, isa=isa)
        else:
            _kernels.linear_spans(experts, spans, x, None, None, None, None, y, threads, isa=isa)
        assert np.array_equal(y.view(np.uint32), want.view(np.uint32)), (threads, qtype)


def test_products_over_spans_refuse_what_they_cannot_compute() -> None:
    rng = np.random.default_rng(3)
    m = _kernels.Matrix([(random_rows(rng, "Q8_0", N_OUT, N_IN), "Q8_0", N_OUT, N_IN, 0)])
    other = _kernels.Matrix([(random_rows(rng, "Q8_0", 8, N_IN), "Q8_0", 8, N_IN, 0)])
    x, y = activations(rng, 4), np.zeros((4, N_OUT), np.float32)
    no_q8 = (None, None, None, None)
    with pytest.raises(ValueError, match=r"span 1 is rows 2\.\.5 of 4"):
        _kernels.linear_spans([m, m], [(0, 2), (2, 5)], x, *no_q8, y, 1)
    with pytest.raises(ValueError, match="2 spans for 1 matrices"):
        _kernels.linear_spans([m], [(0, 2), (2, 4)], x, *no_q8, y, 1)
    with pytest.raises(ValueError, match="matrix 1 is not of matrix 0's shape"):
        _kernels.linear_spans([m, other], [(0, 2), (2, 4)], x, *no_q8, y, 1)
    with pytest.raises(ValueError, match="0 matrices"):
        _kernels.linear_spans([], [], x, *no_q8, y, 1)
