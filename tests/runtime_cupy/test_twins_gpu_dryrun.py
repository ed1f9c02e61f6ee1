"""The GPU tests' own code, run on a CPU, so that it runs as written on a GPU.

``test_gpu_kernels.py`` and ``test_gpu_worker.py`` can only run on a CUDA device. Here
their test functions are called directly (past their skip marks) with the stand-in
for CuPy and the emulated kernels of ``test_twins_device_stage.py`` in place of the
device, on small shapes and a small model: every launch, copy, index and assertion
of their code runs. The kernels are their own twins here, so agreement is expected;
what these runs catch is test code that could not run (wrong arguments, shapes,
fixture keys) or that asserts something false of a correct worker. The SmolLM2 tests
run with the reference worker standing in for the CUDA worker (whose thresholds the
reference meets by the reference's own tests).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import tests.runtime_cupy.test_gpu_kernels as gk
import tests.runtime_cupy.test_gpu_worker as gw
from runtime_core.reference import ReferenceWorker
from tests.fixtures.gguf_models import ModelShape, write_model
from tests.fixtures.llamacpp_fixtures import load_doc
from tests.runtime_cupy.test_twins_device_stage import DEVICE_STAGE, EmulatedKernels, FakeCupy


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> Iterator[EmulatedKernels]:
    kernels = EmulatedKernels()
    monkeypatch.setitem(sys.modules, "cupy", FakeCupy())
    monkeypatch.setitem(sys.modules, "runtime_cupy.device_stage", DEVICE_STAGE)
    monkeypatch.setitem(DEVICE_STAGE._KERNELS, 0, kernels)
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
    "test_interface_rules_hold_on_the_device",
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


@pytest.mark.parametrize("mode", ["q8", "f32"])
def test_gpu_tiny_fixture_test_runs(emulated: EmulatedKernels, mode: str, tmp_path: Path) -> None:
    models = load_doc("tiny")["models"]
    for entry in (models[0], models[-2]):
        gw.test_tiny_fixtures_in_every_type(entry, mode, tmp_path)


@pytest.mark.slow
def test_gpu_smollm2_tests_run(monkeypatch: pytest.MonkeyPatch, smollm2_path: str) -> None:
    """With the reference worker as the CUDA worker: the SmolLM2 tests' code and
    thresholds hold for a worker that computes what the reference computes."""
    monkeypatch.setattr(gw, "CudaWorker", lambda **options: ReferenceWorker())
    reference = gw.generate_all(smollm2_path, ReferenceWorker)
    names = tuple(p["name"] for p in gw.PROMPTS)
    monkeypatch.setattr(  # both modes' runs are the reference's: one run of SmolLM2
        gw,
        "_cache",
        {(smollm2_path, mode, "1", "f32", names, ()): reference for mode in ("q8", "f32")},
    )
    gw.test_smollm2_float_mode_gives_the_reference_workers_tokens(smollm2_path, reference)
    gw.test_smollm2_against_llamacpp(smollm2_path, "q8")
    gw.test_smollm2_8bit_mode_keeps_the_reference_tokens_up_to_a_near_tie(smollm2_path, reference)
