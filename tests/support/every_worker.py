"""Every worker the repo has, by name, for the suites that hold each of them to the
worker interface (``tests/runtime_core/workers/``): the NumPy reference worker, the CPU
worker, the CUDA worker on the emulated CuPy (``tests/support/emulated_cupy.py``: its
device code on a CPU) and on a GPU where there is one (``worker_for`` skips it, saying
why, elsewhere)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from runtime_core.workers.cpu.worker import CpuWorker
from runtime_core.workers.interface import Worker
from runtime_core.workers.reference.worker import ReferenceWorker
from tests.support.cuda_device import cuda_device_problem

MakeWorker = Callable[[], Worker]


def _emulated_cuda() -> Worker:
    from tests.support.emulated_cupy import EmulatedCudaWorker

    return EmulatedCudaWorker()


def _gpu_cuda() -> Worker:
    from runtime_cupy.cuda.worker import CudaWorker

    return CudaWorker()


WORKERS: dict[str, MakeWorker] = {
    "reference": ReferenceWorker,
    "cpu": CpuWorker,
    "cuda-emulated": _emulated_cuda,
    "cuda-gpu": _gpu_cuda,
}
#: The workers that run compiled kernels (C, CUDA, or their emulation): their results do
#: not move by a bit with the batch a step shares (the reference worker's may, within
#: what BLAS's summation order over other row counts moves).
COMPILED = frozenset({"cpu", "cuda-emulated", "cuda-gpu"})
#: The CUDA worker's names.
CUDA = frozenset({"cuda-emulated", "cuda-gpu"})


def worker_for(name: str, workers: dict[str, MakeWorker] = WORKERS) -> MakeWorker:
    """The worker ``name`` of ``workers``; a test of the GPU worker is skipped, naming
    why, on a host without a GPU it can use."""
    if name == "cuda-gpu":
        problem = cuda_device_problem()
        if problem is not None:
            pytest.skip(problem)
    return workers[name]
