"""Which worker a stage process runs: ``cpu`` (``runtime_core.workers.cpu.worker.CpuWorker``:
quantized weights and compiled kernels, any host; the default), ``numpy``
(``runtime_core.ReferenceWorker``, the readable oracle, any host) or ``cuda``
(``runtime_cupy.cuda.worker.CudaWorker``, imported only when asked for, so that nothing here
imports CuPy). A CUDA stage sees one GPU: the launcher sets its
``CUDA_VISIBLE_DEVICES``, so the worker uses device 0 of what it sees; a CPU stage
uses its share of the host's cores (the launcher's ``OMP_NUM_THREADS``)."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from runplan import WorkerCapabilities
from runtime_core.workers.interface import Worker
from runtime_core.workers.reference.worker import ReferenceWorker

WORKERS = ("cpu", "numpy", "cuda")
DEFAULT_WORKER = "cpu"


class WorkerUnavailable(RuntimeError):
    """The chosen worker cannot run on this host (the CUDA worker needs CuPy and a GPU)."""


#: How to get CuPy: gguf-pipeline is not on PyPI, so its extras install from a checkout.
INSTALL_CUPY = (
    "from a checkout of gguf-pipeline: pip install -e '.[cuda12]' on a CUDA 12 host, "
    "or -e '.[cuda13]' on a CUDA 13 host"
)


def _cuda_class() -> Any:
    if importlib.util.find_spec("cupy") is None:
        raise WorkerUnavailable(
            f"the CUDA worker needs CuPy and a GPU; CuPy is not installed ({INSTALL_CUPY})"
        )
    try:
        module = importlib.import_module("runtime_cupy.cuda.worker")
        return module.CudaWorker
    except (ImportError, OSError, RuntimeError) as exc:  # a broken CuPy, no driver, no GPU
        raise WorkerUnavailable(
            f"the CUDA worker needs CuPy and a GPU ({INSTALL_CUPY}): {type(exc).__name__}: {exc}"
        ) from exc


def _cpu_class() -> Any:
    from runtime_core.workers.cpu.kernels import KernelsUnavailable, load

    try:
        load()
    except KernelsUnavailable as exc:
        raise WorkerUnavailable(str(exc)) from exc
    from runtime_core.workers.cpu.worker import CpuWorker

    return CpuWorker


def worker_class(name: str) -> Any:
    """The worker class called ``name``; ``WorkerUnavailable`` if it cannot be loaded."""
    if name == "cpu":
        return _cpu_class()
    if name == "numpy":
        return ReferenceWorker
    if name == "cuda":
        return _cuda_class()
    raise ValueError(f"unknown worker {name!r} (one of {', '.join(WORKERS)})")


def capabilities(name: str) -> WorkerCapabilities:
    """What the worker runs, for the planner."""
    caps = worker_class(name).capabilities
    assert isinstance(caps, WorkerCapabilities)
    return caps


def make_worker(name: str) -> Worker:
    """A new worker of kind ``name``."""
    worker: Worker = worker_class(name)()
    return worker
