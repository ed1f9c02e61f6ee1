"""The CPU worker's compiled kernels (``csrc/*.c``, built by ``pip install`` as
``runtime_core.workers.cpu._kernels``), the instruction set and the number of threads a
stage uses (``csrc/pool.h`` shares each operation's items out among them).

Instruction sets (``_kernels.KNOWN_ISAS``): ``"portable"`` (C, any host), ``"avx2"``
(AVX2 and F16C), ``"avxvnni"`` (AVX2 with AVX-VNNI's 256-bit ``vpdpbusd``), ``"avx512bw"``
(AVX-512 F, BW and VL: 512-bit products without VNNI), ``"avx512"`` (AVX-512 F, BW, VL
and VNNI), ``"avx512-zen4"`` (``"avx512"`` with a decode step's few-row products chosen
on AMD Zen 4, offered on AMD's family 19h only), ``"avx512-intel"`` (``"avx512"`` with
every product on its 512-bit kernels, as measured faster on an Intel Xeon, offered on
Intel's processors only). ``_kernels.isas()`` lists
those this processor runs, the best last; a call of ``linear`` or ``attention`` names
the one it uses (``isa=``; the best by default), so each worker chooses its own
(``CpuWorker(isa=...)``) and nothing is switched for the whole process. Every set
computes the same bits, and every product of a weight row and an activation row is
computed by one thread in an order the code fixes, so results depend neither on the
set nor on the thread count.
"""

from __future__ import annotations

import os
from types import ModuleType

from runplan.cpus import usable_cpus

THREADS_VARIABLE = "OMP_NUM_THREADS"
#: The most threads a product runs on (the kernels' own bound: POOL_MAX_THREADS, csrc/pool.h).
MAX_THREADS = 1024


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
    stage process's share of the host's cores there), else the CPUs this process may
    use (``runplan.cpus.usable_cpus``: its affinity, within its cgroup's CPU quota)."""
    value = os.environ.get(THREADS_VARIABLE, "").strip()
    if value:
        try:
            n = int(value.split(",")[0])
        except ValueError:
            n = 0
        if n >= 1:
            return n
    return usable_cpus()


def host_isas() -> tuple[str, ...]:
    """The instruction sets this processor runs, portable first, the best last."""
    isas: tuple[str, ...] = load().isas()
    return isas


def checked_isa(isa: str | None) -> str | None:
    """``isa`` if this processor runs it (None: the best it runs), or ValueError naming
    it and the sets it runs; None when the kernels are not built (binding says so)."""
    if isa is not None and not isinstance(isa, str):
        raise ValueError(f"isa {isa!r} is not the name of an instruction set")
    try:
        host = host_isas()
    except KernelsUnavailable:
        return isa
    if isa is None:
        return host[-1]
    if isa not in host:
        known = load().KNOWN_ISAS
        what = "one this processor runs" if isa in known else f"one of {', '.join(known)}"
        raise ValueError(f"isa {isa!r} is not {what} (this processor runs {', '.join(host)})")
    return isa
