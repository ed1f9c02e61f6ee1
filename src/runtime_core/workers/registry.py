"""Which workers a runtime builds, by the names ``--worker`` takes.

``CORE_WORKERS`` holds the workers every host runs, both in ``runtime_core``: ``cpu``
(``workers.cpu.worker.CpuWorker``: quantized weights and compiled kernels; the default)
and ``numpy`` (``workers.reference.worker.ReferenceWorker``, the readable oracle). A
runtime adds its own with ``with_worker`` (``runtime_cupy.workers`` adds ``cuda``), so
``runtime_core`` never imports a runtime. A worker's class is loaded when it is asked
for: a worker this host cannot run is ``WorkerUnavailable`` then, not at import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from attrs import frozen

from runplan import WorkerCapabilities
from runtime_core.workers.interface import TraceEvent, Worker

#: Loads a worker's class (``WorkerUnavailable`` if this host cannot run it).
LoadWorker = Callable[[], Any]


class WorkerUnavailable(RuntimeError):
    """The chosen worker cannot run on this host (the CPU worker's kernels not built, the
    CUDA worker without CuPy or a GPU)."""


@frozen
class WorkerRegistry:
    """Worker names and how to load each, in the order ``names`` lists them."""

    loaders: tuple[tuple[str, LoadWorker], ...]
    default: str

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.loaders)

    def with_worker(self, name: str, load: LoadWorker) -> WorkerRegistry:
        """This registry and one more worker."""
        if name in self.names:
            raise ValueError(f"a worker named {name!r} is registered already")
        return WorkerRegistry((*self.loaders, (name, load)), self.default)

    def worker_class(self, name: str) -> Any:
        """The worker class called ``name``; ``WorkerUnavailable`` if it cannot be loaded."""
        for known, load in self.loaders:
            if known == name:
                return load()
        raise ValueError(f"unknown worker {name!r} (one of {', '.join(self.names)})")

    def capabilities(self, name: str) -> WorkerCapabilities:
        """What the worker runs, for the planner."""
        caps = self.worker_class(name).capabilities
        assert isinstance(caps, WorkerCapabilities)
        return caps

    def make_worker(self, name: str, trace: TraceEvent | None = None) -> Worker:
        """A new worker of kind ``name``, its own events going to ``trace``."""
        worker: Worker = self.worker_class(name)(trace=trace)
        return worker


def _cpu_class() -> Any:
    from runtime_core.workers.cpu.kernels import KernelsUnavailable, load

    try:
        load()
    except KernelsUnavailable as exc:
        raise WorkerUnavailable(str(exc)) from exc
    from runtime_core.workers.cpu.worker import CpuWorker

    return CpuWorker


def _reference_class() -> Any:
    from runtime_core.workers.reference.worker import ReferenceWorker

    return ReferenceWorker


CORE_WORKERS = WorkerRegistry((("cpu", _cpu_class), ("numpy", _reference_class)), "cpu")
