"""Which worker a stage process runs: the workers of ``runtime_core``
(``runtime_core.workers.registry.CORE_WORKERS``: ``cpu``, quantized weights and
compiled kernels on any host, the default; ``numpy``, the readable oracle) and ``cuda``
(``runtime_cupy.cuda.worker.CudaWorker``, imported only when asked for, so that nothing
here imports CuPy). A CUDA stage sees one GPU: the launcher sets its
``CUDA_VISIBLE_DEVICES``, so the worker uses device 0 of what it sees; a CPU stage
uses its share of the host's cores (the launcher's ``OMP_NUM_THREADS``)."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from runplan import WorkerCapabilities
from runtime_core.workers.interface import TraceEvent, Worker
from runtime_core.workers.registry import CORE_WORKERS, WorkerUnavailable

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


#: The process runtime's workers: ``cpu``, ``numpy`` and ``cuda``.
REGISTRY = CORE_WORKERS.with_worker("cuda", _cuda_class)
WORKERS = REGISTRY.names
DEFAULT_WORKER = REGISTRY.default


def worker_class(name: str) -> Any:
    """The worker class called ``name``; ``WorkerUnavailable`` if it cannot be loaded."""
    return REGISTRY.worker_class(name)


def capabilities(name: str) -> WorkerCapabilities:
    """What the worker runs, for the planner."""
    return REGISTRY.capabilities(name)


def make_worker(name: str, trace: TraceEvent | None = None) -> Worker:
    """A new worker of kind ``name``, its own events going to ``trace``."""
    return REGISTRY.make_worker(name, trace)


__all__ = [
    "DEFAULT_WORKER",
    "INSTALL_CUPY",
    "REGISTRY",
    "WORKERS",
    "WorkerUnavailable",
    "capabilities",
    "make_worker",
    "worker_class",
]
