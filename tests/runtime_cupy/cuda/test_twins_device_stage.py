"""The CUDA worker's device backend (``cuda/backend.py``, ``ops.py``, ``expert_ops.py``) on a CPU.

A stand-in for CuPy (``FakeCupy`` of ``tests/support/emulated_cupy.py``: NumPy arrays
as device memory, ``memcpyAsync`` as a memory copy, streams that record a graph when
they capture and replay it on launch) and the kernels' real source on the SIMT
emulator (``tests/support/simt``) let every line of those modules and of the
kernels run here: buffers, pointer offsets, launch arguments and grids, the prefill
tiles, edges, the graph capture (a captured launch keeps the integer arguments it had;
position and token must come from device memory), device-to-device inputs and
sampling. Emulated runs that must compute the same thing (a graph or eager launches,
host or device edges) agree bit for bit. Against ``TwinWorker`` (the same program on
the kernels' NumPy twins, which sum in float64) they meet the GPU tests' thresholds
for the CUDA worker against its twin (``assert_close``). What this cannot check is
CuPy's own behaviour and a GPU's timing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from gguf import GGUFReader

from runplan import SamplingConfig
from runplan.gguf_header import GgufHeader
from runtime_core.workers.interface import BatchStep, StepFailure, TokenOutput, Worker
from runtime_core.workers.reference.worker import ReferenceWorker
from runtime_cupy.cuda.worker import CUDA_CAPABILITIES
from tests.fixtures.gguf_models import FIXTURE_SHAPES, ModelShape, write_model
from tests.support.chain import Chain, provisions
from tests.support.emulated_cupy import (
    DEFAULT_STREAM_ALLOCATIONS,
    DEVICE_OPS,
    DEVICE_STAGE,
    EmulatedCudaWorker,
    EmulatedKernels,
    FakeArray,
    _dev,
)
from tests.support.kernel_twins import KERNEL_TWINS, LaunchError
from tests.support.numerics import common_prefix, cosine
from tests.support.random_model import RandomModel, write_random_model
from tests.support.twin_stage import TwinWorker

PROMPT = [5, 77, 300, 12, 9, 41]
#: The GPU tests' thresholds for the CUDA worker against the NumPy twin worker
#: (``test_gpu_worker.py``): the kernels and the twins round sums differently (a warp's
#: float32 butterfly against float64), so logits agree to cosine 0.99999, and a step
#: whose twin logits' two best are closer than ``TWIN_NEAR_TIE`` may go either way.
TWIN_COSINE = 0.99999
#: In ``q8`` mode a generated token's row and every head row are rounded to 8 bits
#: (steps of 1/127 of a 32-value chunk's largest) after float16 roundings (the KV cache
#: and the edges of a 2-byte plan). The kernels' float32 sums and the twins' float64 ones
#: differ by a few 2**-24 of a value, which now and then lands it on the other side of a
#: float16 rounding boundary: device and twin then hold values one float16 step apart,
#: at most 2**-11 of the value, so at most 127 * 2**-11 of an 8-bit step (a value is at
#: most its chunk's largest). Rounding such pairs to 8 bits gives different steps for at
#: most that share of them (those within that distance of a boundary), each then one
#: step apart: a mean square difference of at most 127 * 2**-11 step**2, against the
#: 8-bit rounding's own step**2 / 12 (an error uniform within half a step). Both enter at
#: the same roundings and pass through the same blocks, so the device's distance from
#: its twin (1 - cosine) is at most ``Q8_FLIP_SHARE`` of the 8-bit mode's own distance
#: from the float32 mode (the twin's), on top of the float32 mode's bound. (Seen: at most
#: 0.29 of it, qwen2-Q4_K with 2-byte edges and cache; with 4-byte ones the two agree to
#: 1e-13, a flip being then a float32 sum's last bits landing on an 8-bit boundary.)
Q8_FLIP_SHARE = 12 * 127 / 2**11
TWIN_NEAR_TIE = 0.01


class Events(list[str]):
    """A worker's trace events, by name."""

    def __call__(self, name: str, **_fields: Any) -> None:
        self.append(name)


# ---- the tests --------------------------------------------------------------------------

MIXED = RandomModel(
    n_layers=2,
    qtype="Q4_0",
    embed_qtype="Q6_K",
    head_qtype="Q5_K",
    seed=7,
    overrides=(
        ("blk.0.attn_k.weight", "Q6_K"),
        ("blk.0.attn_v.weight", "Q8_0"),
        ("blk.1.ffn_up.weight", "Q5_1"),
        ("blk.1.ffn_down.weight", "Q3_K"),
        ("blk.1.attn_output.weight", "F16"),
        ("blk.1.attn_q.weight", "BF16"),
    ),
)

#: IQ4_XS block matrices (256-element super-blocks); IQ4_NL (32-element blocks) for the
#: embedding, the head and two block matrices.
IQ4 = RandomModel(
    n_layers=2,
    qtype="IQ4_XS",
    embed_qtype="IQ4_NL",
    head_qtype="IQ4_NL",
    seed=9,
    overrides=(("blk.0.attn_v.weight", "IQ4_NL"), ("blk.1.ffn_down.weight", "IQ4_NL")),
)


QWEN2MOE = ModelShape(
    arch="qwen2moe",
    n_layers=2,
    tied=False,
    experts=4,
    experts_used=2,
    shared_ffn=128,
    quant="Q8_0",
    seed=13,
)


def _one_expert(path: Path, shape: ModelShape, stored: str) -> Path:
    """A mixture of one expert (``shape``): its router and stacked experts' tensors end in
    the expert count's dimension of 1, stored ``"with the 1"`` (as the writer stores a
    stack of one) or ``"without it"`` (as a converter may); the slice holds either with
    the model's shape, and each worker indexes the one expert."""
    written = write_model(path, shape)
    stored_shapes = {
        name: info.shape
        for name, info in GgufHeader.read(written).tensors.items()
        if "_exps" in name or name.endswith("ffn_gate_inp.weight")
    }
    if stored == "without it":
        written = write_model(path, shape, stored_shapes=stored_shapes)
    dims = {t.name: len(t.shape) for t in GGUFReader(written).tensors}
    padded = 1 if stored == "with the 1" else 0
    assert all(dims[name] == len(shape) + padded for name, shape in stored_shapes.items())
    return written


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("emulated")
    rope = ModelShape(n_layers=2, quant="Q8_0", rope_freqs=True, rope_scaling_factor=4.0, seed=6)
    return {
        "llama-F32": write_model(folder / "f32.gguf", ModelShape(n_layers=3, tied=False)),
        "qwen2-Q4_K": write_random_model(
            folder / "qwen2.gguf",
            RandomModel(arch="qwen2", n_layers=2, qtype="Q4_K", tied=True, seed=5),
        ),
        "llama-Q8_0-rope": write_model(folder / "rope.gguf", rope),
        "mixed-types": write_random_model(folder / "mixed.gguf", MIXED),
        "llama-IQ4": write_random_model(folder / "iq4.gguf", IQ4),
        # sliding blocks of 4 positions: the 6-token prefill wraps their ring; soft cap
        "gemma3-window": write_model(
            folder / "gemma3.gguf",
            attrs.evolve(FIXTURE_SHAPES["gemma3"], sliding_window=4, final_logit_softcap=3.0),
        ),
        # the same ring (block 0 slides), capped attention scores (2) and logits (3)
        "gemma2-window": write_model(
            folder / "gemma2.gguf", attrs.evolve(FIXTURE_SHAPES["gemma2"], sliding_window=4)
        ),
        "phi3": write_model(  # partial rotary, fused Q|K|V and gate|up
            folder / "phi3.gguf", attrs.evolve(FIXTURE_SHAPES["phi3"], n_layers=2)
        ),
        # mixtures of experts (each step's routing read back, no captured graph): 4
        # experts, 2 per row, 8-bit and float weights
        "qwen3moe-Q8_0": write_model(
            folder / "qwen3moe.gguf",
            ModelShape(arch="qwen3moe", n_layers=2, experts=4, experts_used=2, quant="Q8_0"),
        ),
        "llama-moe-F32": write_model(
            folder / "llama-moe.gguf", ModelShape(n_layers=2, experts=4, experts_used=2, seed=7)
        ),
        # qwen2moe's gated shared expert beside the mixture, its weights not renormalized
        "qwen2moe-Q8_0": write_model(folder / "qwen2moe.gguf", QWEN2MOE),
        # ... and a shared expert wider than an expert (as Qwen1.5-MoE's, 5632 against
        # 1408): the experts' 8-bit rows lie at their own stride in a buffer sized for the
        # shared expert's (a batch's later rows were read at the wider one's)
        "qwen2moe-wide-Q8_0": write_model(
            folder / "qwen2moe-wide.gguf", attrs.evolve(QWEN2MOE, shared_ffn=256)
        ),
        # mixtures of one expert (the router's softmax weighs it 1), the experts' and
        # router's trailing dimension of 1 stored or not; qwen2moe's with its wider
        # shared expert
        "qwen3moe-one-expert": _one_expert(
            folder / "qwen3moe-1.gguf",
            ModelShape(arch="qwen3moe", n_layers=2, experts=1, experts_used=1, quant="Q8_0"),
            "with the 1",
        ),
        "qwen2moe-one-expert": _one_expert(
            folder / "qwen2moe-1.gguf",
            attrs.evolve(QWEN2MOE, experts=1, experts_used=1, shared_ffn=256),
            "without it",
        ),
    }


def generate(path: Path, make: Callable[[], Worker], stages: int, dtype: str, n: int = 6,
             **kwargs: Any) -> list[TokenOutput]:  # fmt: skip
    # planned as the runtime plans the CUDA worker: its KV caches in the activations' width
    kwargs.setdefault("worker", CUDA_CAPABILITIES)
    chain = Chain.bind(provisions(path, stages, max_seq_len=32, dtype=dtype, **kwargs), make)
    try:
        return chain.generate(PROMPT, n)
    finally:
        chain.release()


def assert_same(a: list[TokenOutput], b: list[TokenOutput]) -> None:
    assert [o.token_id for o in a] == [o.token_id for o in b]
    for x, y in zip(a, b, strict=True):
        assert x.logits is not None and y.logits is not None
        np.testing.assert_array_equal(x.logits, y.logits)


def assert_close(
    device: list[TokenOutput], twin: list[TokenOutput], bounds: Sequence[float] = ()
) -> None:
    """The twin's tokens up to its first near-tie (every token when there is none), and
    logits within cosine ``TWIN_COSINE`` of its at every step with the same inputs (or
    ``bounds[i]`` at step ``i``, where given)."""
    tokens = [o.token_id for o in device]
    expected = [o.token_id for o in twin]
    n = common_prefix(tokens, expected)
    gaps = [float(np.diff(np.sort(logits(o))[-2:])[0]) for o in twin]
    tie = next((i for i, gap in enumerate(gaps) if gap < TWIN_NEAR_TIE), len(gaps))
    assert n >= tie, (n, tie, tokens, expected)
    for i, (a, b) in enumerate(zip(device[: n + 1], twin[: n + 1], strict=False)):
        bound = bounds[i] if i < len(bounds) else TWIN_COSINE
        assert cosine(logits(a), logits(b)) >= bound, (i, bound)


def q8_bounds(twin_q8: list[TokenOutput], twin_f32: list[TokenOutput]) -> list[float]:
    """Per step, the cosine the device in ``q8`` mode keeps to its twin:
    ``TWIN_COSINE``'s distance plus ``Q8_FLIP_SHARE`` of the 8-bit mode's own distance
    from the float32 mode (the twin's two modes must give the same tokens: the same
    inputs at every step)."""
    assert [o.token_id for o in twin_q8] == [o.token_id for o in twin_f32]
    moved = [1.0 - cosine(logits(a), logits(b)) for a, b in zip(twin_q8, twin_f32, strict=True)]
    return [TWIN_COSINE - Q8_FLIP_SHARE * max(d, 0.0) for d in moved]


def logits(out: TokenOutput) -> np.ndarray:
    assert out.logits is not None
    return out.logits


@pytest.mark.parametrize("split", [(1, "f32"), (2, "f16")], ids=["1-stage", "2-stage-f16"])
@pytest.mark.parametrize("mode", ["q8", "f32"])
@pytest.mark.parametrize(
    "name",
    [
        "llama-F32",
        "qwen2-Q4_K",
        "llama-Q8_0-rope",
        "mixed-types",
        "llama-IQ4",
        "gemma3-window",
        "gemma2-window",
        "phi3",
        "qwen3moe-Q8_0",
        "llama-moe-F32",
        "qwen2moe-Q8_0",
        "qwen3moe-one-expert",
        "qwen2moe-one-expert",
    ],
)
def test_the_device_backend_computes_what_the_twin_worker_computes(
    models: dict[str, Path], name: str, mode: str, split: tuple[int, str]
) -> None:
    """A captured graph with device edges and eager launches with host edges compute the
    same bits; both meet the twin worker's thresholds."""
    stages, dtype = split
    twin = generate(models[name], lambda: TwinWorker(matvec=mode), stages, dtype)
    graph = generate(
        models[name],
        lambda: EmulatedCudaWorker(matvec=mode, use_graph=True, device_io=True),
        stages,
        dtype,
    )
    eager = generate(
        models[name],
        lambda: EmulatedCudaWorker(matvec=mode, use_graph=False, device_io=False),
        stages,
        dtype,
    )
    assert_same(graph, eager)
    if mode == "f32":
        assert_close(graph, twin)
        return
    twin_f32 = generate(models[name], lambda: TwinWorker(matvec="f32"), stages, dtype)
    assert_close(graph, twin, q8_bounds(twin, twin_f32))


def assert_batched_as_alone(
    provs: dict[str, Any], prompts: dict[str, list[int]], n: int, chunks: Sequence[int]
) -> None:
    """The runs ``prompts`` (by run id, each with its provisions ``provs``) stepped in the
    same batches on the emulated device, prompts in chunks of each of ``chunks`` (0:
    whole), give each run's ``n`` outputs of the run alone, bit for bit."""

    def generate(run_ids: list[str], chunk: int) -> dict[str, list[TokenOutput]]:
        chain = Chain.bind(provs[next(iter(prompts))], EmulatedCudaWorker)
        try:
            for r in run_ids:
                chain.open(provs[r])
            return chain.generate_batched({r: prompts[r] for r in run_ids}, n, chunk)
        finally:
            chain.release()

    for chunk in chunks:
        together = generate(list(prompts), chunk)
        for r in prompts:
            assert_same(generate([r], chunk)[r], together[r])


def test_each_run_keeps_rings_of_its_own_as_the_planner_counts_them(
    models: dict[str, Path],
) -> None:
    """A run's KV cache (``DeviceCache``) is a ring per block of its own, a sliding
    block's its window long: the device holds for a run the bytes the planner counted
    for it, and two gemma3 runs whose prefills wrap the 4-position window, stepped in
    the same batches (whole and in chunks of 3), give what each gives alone, bit for
    bit."""
    path = models["gemma3-window"]
    prompts = {"run-0": PROMPT, "run-1": [9, 8, 7, 6, 5, 4, 3]}
    provs = {
        r: provisions(
            path, 1, max_seq_len=32, run_id=r, max_concurrent_runs=2, worker=CUDA_CAPABILITIES
        )
        for r in prompts
    }

    (p,) = provs["run-0"]
    w = EmulatedCudaWorker()
    w.configure(p)
    w.bind(p.gguf_source)
    cache = EmulatedCudaWorker.backends[-1].new_cache(p.kv_positions)
    assert sorted({k.shape[1] for k in cache.k}) == [4, p.kv_positions]
    assert sum(a.nbytes for a in (*cache.k, *cache.v)) == p.kv_bytes
    w.release()
    assert_batched_as_alone(provs, prompts, 5, (0, 3))


def test_a_chunk_far_into_a_run_holds_its_window_not_the_runs_positions(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill chunk that wraps a sliding block's ring takes a ring of its own for
    the step: at most the window's positions before its rows and the rows, not every
    position since the run began (a long run's chunk took memory no one counted). Chunks of 3
    over a 14-token prompt (the last ones at positions 9 and 12, past the 4-position
    window) give what the whole prompt gives, bit for bit."""
    path = models["gemma3-window"]
    lengths: list[int] = []
    wrap = DEVICE_OPS.DeviceOps._wrapping_cache

    def recorded(self: Any, layer: int, seg: Any) -> tuple[Any, Any]:
        k, v = wrap(self, layer, seg)
        lengths.append(k.shape[1])
        assert k.shape[1] <= 4 + seg.rows, (seg.pos, seg.rows, k.shape)
        return k, v

    monkeypatch.setattr(DEVICE_OPS.DeviceOps, "_wrapping_cache", recorded)
    prompt = [5, 77, 300, 12, 9, 41, 9, 8, 7, 6, 5, 4, 3, 2]
    provs = provisions(path, 1, max_seq_len=32, worker=CUDA_CAPABILITIES)
    run_id = provs[0].run_id

    def generate(chunk: int) -> list[TokenOutput]:
        chain = Chain.bind(provs, EmulatedCudaWorker)
        try:
            chain.open(provs)
            return chain.generate_batched({run_id: prompt}, 3, chunk)[run_id]
        finally:
            chain.release()

    whole = generate(0)
    assert max(lengths) == len(prompt)  # the whole prompt's rows
    lengths.clear()
    assert_same(generate(3), whole)
    assert max(lengths) == 4 + 3  # the chunks past the window: 4 held, 3 rows


@pytest.mark.parametrize(
    "name",
    [
        "qwen3moe-Q8_0",
        "llama-moe-F32",
        "qwen2moe-Q8_0",
        "qwen2moe-wide-Q8_0",
        "qwen3moe-one-expert",
        "qwen2moe-one-expert",
    ],
)
def test_a_mixture_of_experts_batched_computes_what_each_run_computes_alone(
    models: dict[str, Path], name: str
) -> None:
    """Three runs stepped in the same batches (prompts whole and in chunks of 2, then
    their 8-bit decode rows side by side): the rows that chose an expert are gathered
    with their 8-bit forms and their groups, so each run gets the bits it gets alone."""
    prompts = {"run-0": PROMPT, "run-1": [9, 8, 7, 6, 5, 4, 3], "run-2": [300, 2]}
    provs = {
        r: provisions(models[name], 1, max_seq_len=32, run_id=r, max_concurrent_runs=3)
        for r in prompts
    }

    assert_batched_as_alone(provs, prompts, 4, (0, 2))


@pytest.mark.parametrize("name", ["qwen2-Q4_K", "qwen2moe-wide-Q8_0"])
def test_a_steps_allocations_are_on_the_stages_stream(models: dict[str, Path], name: str) -> None:
    """Every buffer a run's opening and its steps make (its KV cache, scratch products,
    8-bit rows, token rows) comes while the stage's stream is current: the stream is
    non-blocking, and CuPy hands out and clears memory on the stream current at
    allocation, so one made on the default stream (several were) could take memory a
    queued copy of the stage's stream still reads, or clear what the stream wrote."""
    prompts = {"run-0": PROMPT, "run-1": [9, 8, 7, 6, 5, 4, 3]}
    provs = {
        r: provisions(models[name], 1, max_seq_len=32, run_id=r, max_concurrent_runs=2)
        for r in prompts
    }
    chain = Chain.bind(provs["run-0"], EmulatedCudaWorker)
    try:
        DEFAULT_STREAM_ALLOCATIONS[0] = 0
        for r in prompts:  # each run's cache, zero-filled where it is made
            chain.open(provs[r])
        chain.generate_batched(prompts, 3, 2)
        assert DEFAULT_STREAM_ALLOCATIONS[0] == 0
    finally:
        chain.release()


def test_decode_steps_replay_one_captured_graph(models: dict[str, Path]) -> None:
    p = provisions(models["qwen2-Q4_K"], 1, max_seq_len=32)[0]
    events = Events()
    w = EmulatedCudaWorker(trace=events)
    w.configure(p)
    w.bind(p.gguf_source)
    k = DEVICE_OPS._KERNELS[0]
    w.execute_step(0, np.array(PROMPT, np.uint32))
    assert events == []  # a prefill is launched, never captured
    before = k.python_launches
    w.execute_step(1, np.array([7], np.uint32))  # captures: launches recorded, then replayed
    captured = k.python_launches - before
    assert captured > 10 and events == ["graph captured"]
    tokens = []
    for s in range(2, 7):
        out = w.execute_step(s, np.array([3 + s], np.uint32))
        assert isinstance(out, TokenOutput)
        tokens.append(out.token_id)
    assert k.python_launches - before == captured  # nothing launched from Python
    (run,) = w._runs.values()
    assert run.cache.graph.launches == 6 and events == ["graph captured"]
    # the same steps launched eagerly give the same tokens
    eager = EmulatedCudaWorker(use_graph=False)
    eager.configure(p)
    eager.bind(p.gguf_source)
    eager.execute_step(0, np.array(PROMPT, np.uint32))
    eager.execute_step(1, np.array([7], np.uint32))
    again = [eager.execute_step(s, np.array([3 + s], np.uint32)) for s in range(2, 7)]
    assert [o.token_id for o in again if isinstance(o, TokenOutput)] == tokens


def test_a_new_prefill_reuses_the_graph(models: dict[str, Path]) -> None:
    events = Events()
    chain = Chain.bind(
        provisions(models["llama-F32"], 1, max_seq_len=32), lambda: EmulatedCudaWorker(trace=events)
    )
    first = [o.token_id for o in chain.generate(PROMPT, 5)]
    assert [o.token_id for o in chain.generate(PROMPT, 5)] == first
    assert events == ["graph captured"]


def test_a_prefill_takes_the_decode_rows_arithmetic(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step's rows go through the one-row kernels, a launch per ``MAX_GRID_Y`` rows
    (here 2, so that a 6-row prefill takes 3 launches): the same bits as whole."""
    whole = generate(models["mixed-types"], lambda: EmulatedCudaWorker(use_graph=False), 1, "f32")
    monkeypatch.setattr(DEVICE_OPS, "MAX_GRID_Y", 2)
    split = generate(models["mixed-types"], lambda: EmulatedCudaWorker(use_graph=False), 1, "f32")
    assert_same(whole, split)


def test_a_one_token_prompt_is_a_prompt_row_not_a_decode_row(models: dict[str, Path]) -> None:
    """One row at position 0 of sequence 0 is the prompt's (float32 products, eagerly,
    not the decode graph): the twin's outputs."""
    make = lambda: EmulatedCudaWorker(use_graph=True)  # noqa: E731
    for worker in (make, TwinWorker):
        chain = Chain.bind(provisions(models["qwen2-Q4_K"], 2, max_seq_len=32), worker)
        outs = chain.generate([42], 4)
        chain.release()
        if worker is make:
            device = outs
        else:
            assert_close(device, outs)


def test_device_io_passes_device_arrays_between_stages(models: dict[str, Path]) -> None:
    provs = provisions(
        models["llama-F32"], 3, max_seq_len=32, dtype="f16", worker=CUDA_CAPABILITIES
    )
    workers = []
    for p in provs:
        w = EmulatedCudaWorker(device_io=True)
        w.configure(p)
        w.bind(p.gguf_source)
        workers.append(w)
    out = workers[0].execute_step(0, np.array(PROMPT, np.uint32))
    assert isinstance(out, FakeArray) and out.dtype == np.float16 and out.shape == (6, 64)
    out = workers[1].execute_step(0, out)
    assert isinstance(out, FakeArray)
    last = workers[2].execute_step(0, out)
    assert isinstance(last, TokenOutput)
    host = EmulatedCudaWorker(device_io=False)
    host.configure(provs[0])
    host.bind(provs[0].gguf_source)
    plain = host.execute_step(0, np.array(PROMPT, np.uint32))
    assert type(plain) is np.ndarray and plain.dtype == np.float16


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_edges_and_kv_dtypes(models: dict[str, Path], dtype: str) -> None:
    # a float32 cache planned at 4 bytes an element (a narrower one fits any plan)
    wide = attrs.evolve(CUDA_CAPABILITIES, kv_bytes_per_element=4)
    for kv in ("auto", "f16", "f32"):
        caps = wide if kv == "f32" else CUDA_CAPABILITIES
        path = models["llama-Q8_0-rope"]
        twin = generate(path, lambda kv=kv: TwinWorker(kv_dtype=kv), 2, dtype, worker=caps)
        device = generate(
            path, lambda kv=kv: EmulatedCudaWorker(kv_dtype=kv), 2, dtype, worker=caps
        )
        assert_close(device, twin)


def test_sampling_on_the_device_draws_what_the_reference_draws(models: dict[str, Path]) -> None:
    sampling = SamplingConfig(temperature=1.2, top_k=50, top_p=0.9, seed=5)
    twin = generate(models["llama-F32"], TwinWorker, 1, "f32", n=10, sampling=sampling)
    device = generate(models["llama-F32"], EmulatedCudaWorker, 2, "f32", n=10, sampling=sampling)
    ref = generate(models["llama-F32"], ReferenceWorker, 1, "f32", n=10, sampling=sampling)
    assert [o.token_id for o in device] == [o.token_id for o in twin] == [o.token_id for o in ref]


def test_logits_with_nan_fail_the_step(models: dict[str, Path]) -> None:
    from runtime_core.workers.interface import WorkerError

    p = provisions(models["llama-F32"], 1, max_seq_len=32)[0]
    w = EmulatedCudaWorker()
    w.configure(p)
    w.bind(p.gguf_source)
    backend = EmulatedCudaWorker.backends[-1]
    backend.weights.output_norm[0] = np.nan  # poison the last stage's norm on the "device"
    with pytest.raises(WorkerError, match="NaN or infinite"):
        w.execute_step(0, np.array(PROMPT, np.uint32))


class _GeometryOnly:
    """Kernels that do nothing: the emulated launch's checks of the geometry only."""

    def launch(self, name: str, grid: Any, block: int, args: Any) -> None:
        return None


def test_a_long_prefill_launches_within_cuda_s_grid_limits(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every launch of a 70000-row step (the kernels' work skipped: only the launches'
    geometry is checked) fits CUDA's grid: no dimension but x above 65535 blocks."""
    p = provisions(models["llama-F32"], 1, max_seq_len=32)[0]
    w = EmulatedCudaWorker(use_graph=False)
    w.configure(p)
    w.bind(p.gguf_source)
    backend = EmulatedCudaWorker.backends[-1]
    monkeypatch.setattr(DEVICE_OPS._KERNELS[0], "kernels", _GeometryOnly())
    k = DEVICE_OPS._KERNELS[0]
    segment = DEVICE_STAGE.Segment(0, 70_000, 0, backend.new_cache(32))
    backend.ops.states = {0: backend.ops.state}
    backend._step((segment,), [70_000 - 1], None, [True])
    assert {"attention_f32", "rope_kv_f32", "rmsnorm_q8", "matvec_f_F32"} <= set(k.launched)
    w.release()


class _Recording:
    """The emulated kernels, recording each launch's name, grid and arguments."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[tuple[str, Any, Any]] = []

    def launch(self, name: str, grid: Any, block: int, args: Any) -> None:
        self.calls.append((name, grid, args))
        self.inner.launch(name, grid, block, args)


@pytest.mark.parametrize(
    ("n", "parts"), [(1, 1), (256, 1), (257, 2), (323, 2), (32768, 128), (49152, 128)]
)
def test_argmax_takes_the_blocks_its_logits_fill(n: int, parts: int) -> None:
    """256 logits a block, 128 blocks at most (SmolLM2's 49152 fill all of them)."""
    assert DEVICE_OPS.argmax_parts(n) == parts


def test_a_small_vocabulary_launches_no_argmax_block_that_scans_nothing(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The greedy token of a vocabulary of a few hundred logits: ``argmax_partial`` on
    ``argmax_parts(n)`` blocks (each scans some logits), ``argmax_final`` over as many
    partial results, and the token is the largest logit's."""
    p = provisions(models["llama-F32"], 1, max_seq_len=32)[0]
    w = EmulatedCudaWorker(use_graph=False)
    w.configure(p)
    w.bind(p.gguf_source)
    kernels = DEVICE_OPS._KERNELS[0]
    recording = _Recording(kernels.kernels)
    monkeypatch.setattr(kernels, "kernels", recording)
    out = w.execute_step(0, np.array(PROMPT, np.uint32))
    w.release()
    assert isinstance(out, TokenOutput) and out.logits is not None
    n = out.logits.shape[-1]
    assert 256 < n < 128 * 256  # more than one block, fewer than all of them
    partial = [(grid, args) for name, grid, args in recording.calls if name == "argmax_partial"]
    final = [args for name, _, args in recording.calls if name == "argmax_final"]
    assert [(grid, args[1]) for grid, args in partial] == [((-(-n // 256),), n)]
    assert [args[3] for args in final] == [-(-n // 256)]
    assert out.token_id == int(np.argmax(out.logits))


def test_what_a_capture_cannot_record_is_refused() -> None:
    """The stand-in refuses, while a stream captures, what fails a CUDA graph capture:
    allocations, host copies both ways, synchronizing."""
    fake = DEVICE_STAGE.cupy
    a = fake.zeros((2, 3), np.float32)
    stream = fake.cuda.Stream(non_blocking=True)
    stream.begin_capture()
    try:
        assert fake.ascontiguousarray(a) is a  # no copy, nothing to refuse
        for attempt in (
            lambda: fake.zeros(3, np.float32),
            lambda: fake.empty(3, np.float32),
            lambda: fake.ascontiguousarray(a.T),
            lambda: fake.asnumpy(a),
            lambda: a.set(np.ones((2, 3), np.float32)),
            stream.synchronize,
        ):
            with pytest.raises(AssertionError, match="captur"):
                attempt()
    finally:
        stream.end_capture()


def test_a_misaligned_pointer_or_row_is_refused() -> None:
    """What a GPU would fault on ("misaligned address"): float32 activations read as
    16-byte vectors from a view 4 bytes into its buffer; Q4_1 rows (4-byte loads) 2
    bytes off; the emulated launch refuses both, and takes the aligned ones."""
    k = EmulatedKernels()
    rows, n = 4, 64
    w = _dev(np.zeros((rows, 2 * 20), np.uint8))
    y = _dev(np.zeros(rows, np.float32))
    x = _dev(np.zeros(n + 4, np.float32))
    k.launch("matvec_f_Q4_1", 1, 128, (w, 40, 2, rows, x[:n], y, None, 0))
    with pytest.raises(AssertionError, match="argument 4 at 4, not 16-aligned"):
        k.launch("matvec_f_Q4_1", 1, 128, (w, 40, 2, rows, x[1 : n + 1], y, None, 0))
    odd = _dev(np.zeros(rows * 42, np.uint8))
    with pytest.raises(AssertionError, match="rows of 42 bytes, not 4-aligned"):
        k.launch("matvec_f_Q4_1", 1, 128, (odd, 42, 2, rows, x[:n], y, None, 0))


def test_a_failed_launch_is_reported_not_hidden(models: dict[str, Path]) -> None:
    """The emulated kernels refuse a launch whose grid would leave rows unwritten."""
    with pytest.raises(LaunchError):
        KERNEL_TWINS["matvec_f_F32"]((1,), 128, (None, 256, 2, 9, None, None, None, 0))


def test_graph_use_is_a_construction_option_and_changes_no_bit(models: dict[str, Path]) -> None:
    p = provisions(models["llama-F32"], 1, max_seq_len=32)[0]
    inputs = [PROMPT, [4], [5], [6], [7]]
    runs = {}
    for use_graph in (False, True):
        events = Events()
        w = EmulatedCudaWorker(use_graph=use_graph, trace=events)
        w.configure(p)
        w.bind(p.gguf_source)
        k = DEVICE_OPS._KERNELS[0]
        outs = [w.execute_step(s, np.array(d, np.uint32)) for s, d in enumerate(inputs[:3])]
        launches = k.python_launches
        outs += [w.execute_step(s, np.array(d, np.uint32)) for s, d in enumerate(inputs) if s > 2]
        # replays launch nothing from Python; eager steps launch every kernel
        assert (k.python_launches == launches) is use_graph
        assert events == (["graph captured"] if use_graph else [])
        runs[use_graph] = outs
    for got, want in zip(runs[True], runs[False], strict=True):
        assert isinstance(got, TokenOutput) and isinstance(want, TokenOutput)
        assert got.logits is not None and want.logits is not None
        np.testing.assert_array_equal(got.logits, want.logits)


#: Hidden states past float16's range: granite's embedding scale on a random tiny model
#: (token 3's first-stage row passes 65504 at any position; the others' stay below).
OVERFLOWING = ModelShape(
    arch="granite",
    n_layers=2,
    embedding_scale=2e5,
    logit_scale=1.0,
    residual_scale=1.0,
    attention_scale=0.125,
)


def overflow_script(
    path: Path, make: Callable[[], Worker], after: Callable[[Chain], None] = lambda _: None
) -> list[dict[str, Any]]:
    """Two runs on a 2-stage chain with float16 edges: a batch of both prompts (run-0's
    row of token 3 overflows), then run-1's decode rows alone (a captured graph's
    replays): a row that fits, token 3's, then the same position again with a row that
    fits. Each batch's outcome per run: its failure's message, or its result's type."""
    prompts = {"run-0": [5, 3, 8], "run-1": [305, 177, 126, 54, 8]}
    provs = {
        r: provisions(path, 2, max_seq_len=16, dtype="f16", run_id=r, max_concurrent_runs=2)
        for r in prompts
    }
    chain = Chain.bind(provs["run-0"], make)
    try:
        for r in prompts:
            chain.open(provs[r])
        decodes = ((1, 177), (2, 3), (2, 126))  # (sequence, token)
        batches = [[BatchStep(r, 0, 0, 1, np.array(p, np.uint32)) for r, p in prompts.items()]]
        batches += [[BatchStep("run-1", s, 0, 1, np.array([t], np.uint32))] for s, t in decodes]
        outcomes = []
        for steps in batches:
            results = chain.step_batch(steps)
            outcomes.append(
                {
                    r: out.detail if isinstance(out, StepFailure) else type(out).__name__
                    for r, out in results.items()
                }
            )
        after(chain)
        return outcomes
    finally:
        chain.release()


@pytest.mark.parametrize("device_io", [False, True])
def test_a_float16_edge_refuses_activations_past_its_range(tmp_path: Path, device_io: bool) -> None:
    """A stage's rows past 65504 fail that run's step at the edge with the twin's (every
    worker's) ActivationOverflow message, naming value, row and element, eagerly and in
    the captured graph's replays; the other run of the batch, and the next step (the
    graph clears the conversion's counter), go on. They were sent on as infinities,
    and the last stage failed on "NaN or infinite" logits."""
    path = write_model(tmp_path / "granite.gguf", OVERFLOWING)
    events = Events()

    def cleared(chain: Chain) -> None:  # by the last replay, whose row fit
        backend: Any = chain.workers[0]._held.backend
        assert backend._overflowed.tolist() == [0]

    device = overflow_script(
        path, lambda: EmulatedCudaWorker(device_io=device_io, trace=events), cleared
    )
    assert events == ["graph captured"] * 2  # run-1's decode rows: each stage's graph
    twin = overflow_script(path, TwinWorker)
    overflow = "step {} failed: activation .* is past float16's largest value, 65504"
    assert re.fullmatch(overflow.format(0) + ".*", twin[0]["run-0"])
    assert re.fullmatch(overflow.format(2) + ".*", twin[2]["run-1"])
    assert twin[0]["run-1"] == twin[1]["run-1"] == twin[3]["run-1"] == "TokenOutput"
    assert device == twin
