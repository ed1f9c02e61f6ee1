"""The GPU tests' own code, run on a CPU, so that it runs as written on a GPU.

``test_gpu_kernels.py`` and ``test_gpu_worker.py`` can only run on a CUDA device. Here
their test functions are called directly (past their skip marks) with the stand-in
for CuPy of ``tests/support/emulated_cupy.py`` and the kernels' real source on the SIMT
emulator in place of the device, on small shapes and a small model: every launch, copy,
index and assertion of their code runs. What these runs catch is test code that could
not run (wrong arguments, shapes, fixture keys) or that asserts something false of a
correct worker. The SmolLM2 tests run on llama.cpp's recorded outputs standing in for
the CUDA worker's. (Every kernel test with all its parameters, in two thread orders,
is ``test_simt_kernels.py``; the tiny fixtures of every type and SmolLM2 on the
emulated worker, ``test_simt_worker.py``.)
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tests.runtime_cupy.cuda.test_gpu_kernels as gk
import tests.runtime_cupy.cuda.test_gpu_worker as gw
from runtime_core.workers.interface import TokenOutput
from tests.fixtures.gguf_models import ModelShape, write_model
from tests.fixtures.llamacpp_fixtures import load_logits
from tests.support.emulated_cupy import DEVICE_OPS, DEVICE_STAGE, EmulatedKernels, FakeCupy


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> Iterator[EmulatedKernels]:
    kernels = EmulatedKernels()
    monkeypatch.setitem(sys.modules, "cupy", FakeCupy())
    monkeypatch.setitem(sys.modules, "runtime_cupy.cuda.backend", DEVICE_STAGE)
    monkeypatch.setitem(DEVICE_OPS._KERNELS, 0, kernels)
    monkeypatch.setattr(gk, "SHAPES_32", [(1, 32), (7, 96), (9, 576)])
    monkeypatch.setattr(gk, "SHAPES_K", [(1, 256), (5, 768)])
    monkeypatch.setattr(gw, "_cache", {})
    yield kernels


def parameter_sets(fn: Callable[..., Any], limit: int) -> list[dict[str, Any]]:
    """Up to ``limit`` of the combinations of ``fn``'s parametrize marks (first, last,
    and evenly between)."""
    axes = []
    for mark in getattr(fn, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names, values = mark.args[0], mark.args[1]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else names
        axes.append([dict(zip(names, v if len(names) > 1 else (v,), strict=True)) for v in values])
    combos = [dict(kv for d in combo for kv in d.items()) for combo in itertools.product(*axes)]
    if len(combos) <= limit:
        return combos
    step = (len(combos) - 1) / (limit - 1)
    return [combos[round(i * step)] for i in range(limit)]


KERNEL_TESTS = sorted(name for name in dir(gk) if name.startswith("test_"))


@pytest.mark.parametrize("name", KERNEL_TESTS)
def test_gpu_kernel_test_runs(emulated: EmulatedKernels, name: str) -> None:
    fn = getattr(gk, name)
    uses_ks = "ks" in fn.__code__.co_varnames[: fn.__code__.co_argcount]
    sets = parameter_sets(fn, limit=3)
    for params in sets or [{}]:
        fn(**({"ks": emulated} if uses_ks else {}), **params)
    if uses_ks:
        assert emulated.python_launches > 0


@pytest.fixture(scope="module")
def small_subject(tmp_path_factory: pytest.TempPathFactory) -> gw.Subject:
    path = write_model(tmp_path_factory.mktemp("dry") / "m.gguf", ModelShape(n_layers=4))
    prompts = (
        {"name": "a", "token_ids": [5, 77, 300, 12, 9]},
        {"name": "b", "token_ids": [1, 2, 3]},
    )
    splits = (("2-even", ((0, 2), (2, 4))), ("3-uneven", ((0, 1), (1, 3), (3, 4))))
    return gw.Subject(str(path), prompts, splits)


GENERIC_WORKER_TESTS = [
    "test_stages_with_f32_edges_compute_what_one_stage_computes",
    "test_stages_with_f16_edges_keep_the_tokens",
    "test_graph_and_eager_launches_agree",
    "test_host_and_device_edges_agree",
    "test_sampling_on_the_device_draws_the_reference_tokens",
    "test_the_weights_live_on_the_device_as_stored_and_outlive_a_run",
]


@pytest.mark.parametrize("name", GENERIC_WORKER_TESTS)
def test_gpu_worker_test_runs(
    emulated: EmulatedKernels, small_subject: gw.Subject, name: str
) -> None:
    getattr(gw, name)(small_subject)
    assert emulated.python_launches > 0


def test_every_gpu_worker_test_is_dry_run() -> None:
    tested = set(GENERIC_WORKER_TESTS) | {
        "test_tiny_fixtures_in_every_type",
        "test_smollm2_float_mode_gives_the_reference_workers_tokens",
        "test_smollm2_against_llamacpp",
        "test_smollm2_8bit_mode_keeps_the_reference_tokens_up_to_a_near_tie",
    }
    assert {n for n in dir(gw) if n.startswith("test_")} == tested


def test_gpu_smollm2_tests_run(monkeypatch: pytest.MonkeyPatch, smollm2_path: str) -> None:
    """The SmolLM2 tests' code on runs made of llama.cpp's own recorded tokens and
    prompt logits (what a worker that computed exactly what llama.cpp computes would
    return): their fixture keys, shapes and thresholds hold for such a worker."""
    logits = load_logits("smollm2")
    runs: gw.Runs = {}
    for p in gw.PROMPTS:
        first = logits[f"q4_1/{p['name']}"]
        runs[p["name"]] = [
            TokenOutput(t, first if i == 0 else np.roll(first, i))
            for i, t in enumerate(p["greedy"][: gw.N])
        ]
    names = tuple(p["name"] for p in gw.PROMPTS)
    monkeypatch.setattr(
        gw, "_cache", {(smollm2_path, mode, "1", "f32", names, ()): runs for mode in ("q8", "f32")}
    )
    gw.test_smollm2_float_mode_gives_the_reference_workers_tokens(smollm2_path, runs)
    for mode in ("q8", "f32"):
        gw.test_smollm2_against_llamacpp(smollm2_path, mode)
    gw.test_smollm2_8bit_mode_keeps_the_reference_tokens_up_to_a_near_tie(smollm2_path, runs)


def test_gpu_benchmark_code_runs(emulated: EmulatedKernels, small_subject: gw.Subject) -> None:
    """``benchmarks/gpu_decode.py``'s measuring code (all but the copy bandwidth) on the
    emulation: binding 1 and 2 stages, switching the graph, timing, the targets."""
    spec = importlib.util.spec_from_file_location(
        "gpu_decode", Path(gw.__file__).parents[3] / "benchmarks" / "gpu_decode.py"
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    path = Path(small_subject.path)
    prompt = list(range(3, 23))
    rows = [
        row | {"model": "smollm2", "of_bound": 0.5}
        for stages in (1, 2)
        for row in bench.run_case(path, stages, prompt, 4, [True, False])
    ]
    assert [(r["stages"], r["graph"]) for r in rows] == [
        (1, True),
        (1, False),
        (2, True),
        (2, False),
    ]
    assert all(r["decode_steps"] == 4 and r["prefill_tok_s"] > 0 for r in rows)
    assert len({tuple(r["tokens"]) for r in rows}) == 1  # the same greedy tokens every way
    assert bench.bytes_per_token(path, 10) > 0
    lines = bench.check_targets(rows)
    assert any("SmolLM2 1-stage decode" in line for line in lines)
    assert any("2 stages / 1 stage" in line for line in lines)


class _DoublingKernels(EmulatedKernels):
    """The emulated kernels with one bug: the 8-bit products store twice the product
    (as a broken ``matvec.cu`` once did, and the store case's check passed it)."""

    def launch(self, name: str, grid: Any, block: int, args: Any, **kw: Any) -> None:
        super().launch(name, grid, block, args, **kw)
        if name.startswith("matvec_q8_"):
            n_out, y = args[3], args[7]
            y.view(np.ndarray)[:n_out] *= 2


@pytest.mark.parametrize("accumulate", [0, 1], ids=["store", "accumulate"])
def test_the_product_check_fails_on_a_kernel_that_doubles(
    emulated: EmulatedKernels, accumulate: int
) -> None:
    """The GPU product test can fail: its NaN-poisoned output once made the store
    case's tolerance NaN, and every comparison with NaN false."""
    broken = _DoublingKernels()
    gk.test_matvec_q8(emulated, "Q4_0", accumulate)  # the faithful emulation passes
    with pytest.raises(AssertionError):
        gk.test_matvec_q8(broken, "Q4_0", accumulate)


@pytest.mark.parametrize(
    "scale", [np.full(3, np.nan), np.array([1.0, np.inf, 1.0]), np.array([1.0, -1.0, 1.0])]
)
def test_within_refuses_a_scale_that_bounds_nothing(scale: np.ndarray) -> None:
    x = np.ones(3, np.float32)
    with pytest.raises(AssertionError, match="scale"):
        gk.within(x, x, scale)
    with pytest.raises(AssertionError):
        gk.within(x + 1, x, np.ones(3))  # and a real difference still fails
    gk.within(x, x, np.ones(3))
