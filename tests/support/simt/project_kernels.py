"""The CUDA worker's kernels (``src/runtime_cupy/cuda/kernels/*.cu``) on the SIMT
emulator, behind the interface of ``runtime_cupy.cuda.kernels.KernelSet``.

``SimtKernelSet.launch(name, grid, block, args, stream=None, shared_mem=0)`` runs the
kernel's real source, compiled for the host (``loader.compile_cu``), on NumPy arrays,
in the set's thread order (``order``). Its checks against ``kernels.py``: each source
file has exactly the kernels ``KERNELS`` lists, each with the parameter types its codes
say (``p`` a pointer, ``i`` 32-bit, ``l`` 64-bit integer, ``f`` float32); a Python value
of another type than a launch through ``KernelSet`` would convert is refused.

``GGUF_PIPELINE_SIMT_ASAN=1`` builds them with AddressSanitizer (``make simt-asan``, which
preloads ASan's runtime): a kernel's access outside a shared array or outside the memory
of an array it is given stops the run with ASan's report, naming the source line.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from runtime_cupy.cuda import kernels as kernels_mod
from tests.support.simt.loader import FORWARD, SimtModule, ThreadOrder, compile_cu

#: kernels.py's parameter codes as the emulator reports parameters: (kind, size).
_CODES = {"p": (0, 8), "i": (1, 4), "l": (1, 8), "f": (3, 4)}


class KernelTableMismatch(AssertionError):
    """A source file's kernels or parameters differ from ``kernels.KERNELS``."""


def compile_project(asan: bool = False) -> dict[str, SimtModule]:
    """Every kernel source file compiled for the emulator (in parallel), by file name;
    checked against ``kernels.KERNELS``."""

    def build(file: str) -> SimtModule:
        return compile_cu(kernels_mod.KERNEL_DIR / file, asan=asan)

    workers = max(1, min(len(kernels_mod.SOURCES), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        modules = dict(zip(kernels_mod.SOURCES, pool.map(build, kernels_mod.SOURCES), strict=True))
    for file, module in modules.items():
        listed = kernels_mod.KERNELS[file]
        if set(module.kernels) != set(listed):
            raise KernelTableMismatch(
                f"{file}: the source has {sorted(module.kernels)}, "
                f"kernels.py lists {sorted(listed)}"
            )
        for name, codes in listed.items():
            want = tuple(_CODES[c] for c in codes.split())
            info = module.kernels[name]
            got = tuple(zip(info.kinds, info.sizes, strict=True))
            if got != want:
                raise KernelTableMismatch(
                    f"{name}: parameters {got} in the source, {codes!r} listed"
                )
    return modules


_modules: dict[bool, dict[str, SimtModule] | Exception] = {}


def project_modules(asan: bool = False) -> dict[str, SimtModule]:
    """``compile_project``, once per process (a failure too: every launch raises it)."""
    if asan not in _modules:
        try:
            _modules[asan] = compile_project(asan)
        except Exception as exc:
            _modules[asan] = exc
    built = _modules[asan]
    if isinstance(built, Exception):
        raise built
    return built


def asan_requested() -> bool:
    return os.environ.get("GGUF_PIPELINE_SIMT_ASAN", "") == "1"


class SimtKernelSet:
    """``KernelSet`` over the emulator: the same ``launch``, the kernels' real source
    (built with ASan when ``asan``, by default when ``GGUF_PIPELINE_SIMT_ASAN=1``)."""

    def __init__(self, order: ThreadOrder = FORWARD, *, asan: bool | None = None) -> None:
        self.order = order
        self.asan = asan_requested() if asan is None else asan
        self.launches = 0

    def compile_all(self) -> None:
        project_modules(self.asan)

    def launch(
        self,
        name: str,
        grid: int | tuple[int, ...],
        block: int,
        args: Sequence[Any],
        *,
        stream: Any = None,
        shared_mem: int = 0,
    ) -> None:
        module = project_modules(self.asan)[kernels_mod.FILE_OF[name]]
        self.launches += 1
        module.launch(name, grid, block, args, shared_mem=shared_mem, order=self.order)
