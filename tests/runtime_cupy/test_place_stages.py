"""Where CUDA stages go and how much memory the planner counts for each: the GPU's total
as ``nvidia-smi`` reports it, else as CuPy reads it; never a guess. Runs without a GPU:
``nvidia-smi`` and CuPy are stood in for."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from runtime_cupy.hosts import this_machine
from runtime_cupy.workers import WorkerUnavailable

GIB = 2**30


def fake_cupy(memory: dict[int, int]) -> types.ModuleType:
    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: len(memory),
        getDeviceProperties=lambda i: {"totalGlobalMem": memory[i]},
    )
    module = types.ModuleType("cupy")
    module.cuda = types.SimpleNamespace(runtime=runtime)  # type: ignore[attr-defined]
    return module


@pytest.fixture
def smi(monkeypatch: pytest.MonkeyPatch) -> dict[int, int]:
    """What nvidia-smi reports: set its entries in the test (0: memory not reported)."""
    reported: dict[int, int] = {}
    monkeypatch.setattr(this_machine, "gpu_memory_bytes", lambda: dict(reported))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return reported


def test_nvidia_smis_memory_is_the_nodes(smi: dict[int, int]) -> None:
    smi.update({0: 80 * GIB, 1: 24 * GIB})
    nodes, devices = this_machine.place_stages(3, "cuda", None)
    assert devices == (0, 1, 0)
    assert [(n.memory_bytes, n.device) for n in nodes] == [
        (80 * GIB, "gpu0"), (24 * GIB, "gpu1"), (80 * GIB, "gpu0")
    ]  # fmt: skip


@pytest.mark.parametrize("reported", [{}, {0: 0}])
def test_without_memory_from_nvidia_smi_cupy_tells_it(
    smi: dict[int, int], monkeypatch: pytest.MonkeyPatch, reported: dict[int, int]
) -> None:
    smi.update(reported)
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy({0: 141 * GIB}))
    nodes, _ = this_machine.place_stages(2, "cuda", [0])
    assert [n.memory_bytes for n in nodes] == [141 * GIB] * 2


@pytest.mark.parametrize(
    ("reported", "cupy", "needle"),
    [
        ({}, None, "CuPy cannot read it"),  # no CuPy
        ({0: 0}, {}, "neither nvidia-smi nor CuPy"),  # CuPy sees no device 0
        ({0: 0, 1: 16 * GIB}, None, "GPU [0]"),
    ],
)
def test_a_gpu_whose_memory_nothing_tells_is_refused_not_planned_as_1_tib(
    smi: dict[int, int],
    monkeypatch: pytest.MonkeyPatch,
    reported: dict[int, int],
    cupy: dict[int, int] | None,
    needle: str,
) -> None:
    smi.update(reported)
    module: Any = None if cupy is None else fake_cupy(cupy)
    monkeypatch.setitem(sys.modules, "cupy", module)  # None: ``import cupy`` fails
    with pytest.raises(WorkerUnavailable, match="cannot tell the memory of GPU") as err:
        this_machine.place_stages(1, "cuda", [0])
    assert needle in str(err.value)


def test_cupys_numbers_are_not_trusted_under_cuda_visible_devices(
    smi: dict[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy({0: 8 * GIB}))
    with pytest.raises(WorkerUnavailable, match="CUDA_VISIBLE_DEVICES"):
        this_machine.place_stages(1, "cuda", [0])


def test_nvidia_smi_output_without_memory_keeps_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``[N/A]`` where the memory belongs lists the GPU with no memory (0), so that the
    GPU is not taken for absent and its memory is asked of CuPy."""
    out = "0, [N/A]\n1, 81559\n"
    monkeypatch.setattr(this_machine.shutil, "which", lambda _name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(
        this_machine.subprocess, "run", lambda *a, **k: types.SimpleNamespace(stdout=out)
    )
    assert this_machine.gpu_memory_bytes() == {0: 0, 1: 81559 * 2**20}
