"""Whether this host has a CUDA device CuPy can use: what the GPU tests and benchmarks
ask before they run (a reason to skip, or to measure nothing)."""

from __future__ import annotations

import importlib.util


def cuda_device_problem() -> str | None:
    """Why no kernel can run here (a sentence for a skip or an error), or ``None`` when
    CuPy imports and sees at least one CUDA device. Imports CuPy only if it is installed."""
    if importlib.util.find_spec("cupy") is None:
        return "no CUDA device: cupy is not importable (not installed)"
    try:
        import cupy
    except Exception as exc:  # a broken install: say how it broke
        return f"no CUDA device: cupy is not importable ({type(exc).__name__}: {exc})"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # no driver, no device
        return f"no CUDA device: cupy.cuda.runtime.getDeviceCount() failed ({exc})"
    if count == 0:
        return "no CUDA device: cupy.cuda.runtime.getDeviceCount() == 0"
    return None
