"""Which worker a stage process runs: the workers of ``runtime_core``
(``runtime_core.workers.registry.CORE_WORKERS``: ``cpu``, quantized weights and
compiled kernels on any host, the default; ``numpy``, the readable oracle) and ``cuda``
(``runtime_cupy.cuda.worker.CudaWorker``, imported only when asked for, so that nothing
here imports CuPy). A CUDA stage sees one GPU: the launcher sets its
``CUDA_VISIBLE_DEVICES``, so the worker uses device 0 of what it sees; a CPU stage
uses its share of the host's cores (the launcher's ``OMP_NUM_THREADS``). A run's
activations between stages are in ``activation_dtype``'s dtype for its worker and model."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import attrs

from runplan import DTypeFamily, WorkerCapabilities
from runtime_core.workers.interface import TraceEvent, Worker
from runtime_core.workers.registry import CORE_WORKERS, WorkerUnavailable
from runtime_core.workers.stage_worker import KV_OF_WIDTH, KV_WIDTHS

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


def capabilities(name: str, kv_dtype: str | None = None) -> WorkerCapabilities:
    """What the worker runs, for the planner. ``kv_dtype`` (``f32``, ``f16``; None: the
    worker's own, the activations' width for ``cpu`` and ``cuda``): the KV cache in that
    dtype, which the planner then counts (``kv_bytes_per_element``) and every stage's
    worker holds (the plan's ``kv_dtype_width_bytes``). ``ValueError`` for a dtype the
    worker does not hold its cache in (``numpy``: float32 only)."""
    caps = REGISTRY.capabilities(name)
    if kv_dtype is None:
        return caps
    if kv_dtype not in KV_WIDTHS:
        raise ValueError(f"kv_dtype {kv_dtype!r} is not one of {', '.join(KV_WIDTHS)}")
    width = KV_WIDTHS[kv_dtype]
    if caps.kv_bytes_per_element and caps.kv_bytes_per_element != width:
        own = KV_OF_WIDTH.get(caps.kv_bytes_per_element)
        raise ValueError(
            f"the {name} worker holds its KV cache in {own or caps.kv_bytes_per_element}, "
            f"not {kv_dtype}"
        )
    return attrs.evolve(caps, kv_bytes_per_element=width)


#: Architectures whose hidden states pass float16's largest value (65504) in released
#: models (gemma2's and gemma3's residual streams do): on the CUDA worker's 2-byte
#: edges they travel as bfloat16, which holds float32's range.
BFLOAT16_EDGE_ARCHITECTURES = frozenset({"gemma2", "gemma3"})


def activation_dtype(worker: str, architecture: str) -> tuple[DTypeFamily, int]:
    """The dtype of a run's activations between stages (the plan's
    ``activation_dtype_family`` and ``activation_dtype_width_bytes``): float32 for the
    CPU workers; 2 bytes for ``cuda``: bfloat16 for ``BFLOAT16_EDGE_ARCHITECTURES``,
    else float16 (a value past 65504 then fails its run's step: ``ActivationOverflow``)."""
    if worker != "cuda":
        return DTypeFamily.FLOAT, 4
    if architecture in BFLOAT16_EDGE_ARCHITECTURES:
        return DTypeFamily.BFLOAT, 2
    return DTypeFamily.FLOAT, 2


def make_worker(name: str, trace: TraceEvent | None = None) -> Worker:
    """A new worker of kind ``name``, its own events going to ``trace``."""
    return REGISTRY.make_worker(name, trace)


__all__ = [
    "BFLOAT16_EDGE_ARCHITECTURES",
    "DEFAULT_WORKER",
    "INSTALL_CUPY",
    "KV_WIDTHS",
    "REGISTRY",
    "WORKERS",
    "WorkerUnavailable",
    "activation_dtype",
    "capabilities",
    "make_worker",
    "worker_class",
]
