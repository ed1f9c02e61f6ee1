"""The CPU worker's compiled kernels (``csrc/*.c``, built by ``pip install`` as
``runtime_core.workers.cpu._kernels``), and the number of threads a stage uses (``csrc/pool.h``
shares each operation's items out among them).

The extension picks its instruction set at import: AVX2 and F16C where the
processor has them, else the portable C path (``isas()``, ``set_isa(name)``). Every
product of a weight row and an activation row is computed by one thread in an order
the code fixes, so results do not depend on the thread count.
"""

from __future__ import annotations

import os
from types import ModuleType

THREADS_VARIABLE = "OMP_NUM_THREADS"


class KernelsUnavailable(RuntimeError):
    """The compiled kernels are not importable (the package was installed without
    building them)."""


def load() -> ModuleType:
    """The ``_kernels`` extension; ``KernelsUnavailable`` if it was not built."""
    try:
        from runtime_core.workers.cpu import _kernels
    except ImportError as exc:
        raise KernelsUnavailable(
            "the CPU worker's kernels are not built (reinstall gguf-pipeline with a C "
            f"compiler: pip install -e .): {exc}"
        ) from exc
    return _kernels


def default_threads() -> int:
    """The threads of a stage: ``OMP_NUM_THREADS`` when set (the launcher sets each
    stage process's share of the host's cores there), else the cores this process
    may run on."""
    value = os.environ.get(THREADS_VARIABLE, "").strip()
    if value:
        try:
            n = int(value.split(",")[0])
        except ValueError:
            n = 0
        if n >= 1:
            return n
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)
