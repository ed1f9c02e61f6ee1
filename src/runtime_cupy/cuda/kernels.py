"""The CUDA kernels of ``kernels/*.cu``, compiled with ``cupy.RawModule`` on first use.

Nothing here imports CuPy at module import time: ``KernelSet`` imports it when the
first kernel is asked for, so that CPU hosts (and the CPU test suite) can import the
worker, read the kernel table and compile the sources with nvcc for checking.

Every kernel is listed in ``SIGNATURES`` with the types of its parameters, and every
launch goes through ``KernelSet.launch``, which converts each argument to exactly that
type (CuPy would pass a Python int as 64 bits where the kernel takes 32). A CPU test
compares this table with the parameter lists nvcc writes into the PTX.

Parameter codes: ``p`` a device pointer (a CuPy array, or ``None`` for a null pointer),
``l`` a 64-bit integer, ``i`` a 32-bit integer, ``f`` a float32.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from runplan.quant_types import FLOAT_TYPES, Q8_TYPES, QUANT_TYPES

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
HEADERS: tuple[str, ...] = ("common.cuh", "quant.cuh")

_MATVEC_Q8 = "p l i i p p p p p i"
_MATVEC_F = "p l i i p p p i"
_DEQUANT = "p l i p i i p"
_ROPE = "p i p p p i i i i i i f p p i p"
_ATTENTION = "p i p p p i i i i i i f f p p p p"

#: The largest head size ``attention.cu`` handles (``32 * ATT_MAX_PER_LANE``: each of a
#: warp's 32 lanes holds up to 8 dimensions of a head).
ATTENTION_MAX_HEAD_DIM = 256

#: kernel name -> parameter codes, by source file.
KERNELS: dict[str, dict[str, str]] = {
    "matvec.cu": {
        **{f"matvec_q8_{t}": _MATVEC_Q8 for t in Q8_TYPES},
        **{f"matvec_f_{t}": _MATVEC_F for t in QUANT_TYPES},
    },
    "dequant.cu": {f"dequant_rows_{t}": _DEQUANT for t in QUANT_TYPES},
    "norm.cu": {
        "rmsnorm_rows": "p p p i f",
        "rmsnorm_add_rows": "p p p i f",
        "rmsnorm_q8": "p p p i f p p p",
        "head_rmsnorm": "p i p p p i i i i f",
        "swiglu_rows": "p p i i",
        "swiglu_q8": "p p i p p p",
        "geglu_rows": "p p i i",
        "geglu_q8": "p p i p p p",
        "quantize_q8": "p i p p p",
        "add_inplace": "p p l",
        "scale_inplace": "p f l",
        "softcap": "p f f l",
    },
    "rope.cu": {"rope_kv_f32": _ROPE, "rope_kv_f16": _ROPE},
    "attention.cu": {"attention_f32": _ATTENTION, "attention_f16": _ATTENTION},
    "sample.cu": {"argmax_partial": "p i p p p", "argmax_final": "p p p i p"},
    "convert.cu": {
        "f32_to_f16": "p p l p",
        "f16_to_f32": "p p l",
        "f32_to_bf16": "p p l",
        "bf16_to_f32": "p p l",
    },
}
SOURCES: tuple[str, ...] = tuple(KERNELS)
SIGNATURES: dict[str, str] = {k: v for names in KERNELS.values() for k, v in names.items()}
FILE_OF: dict[str, str] = {k: f for f, names in KERNELS.items() for k in names}

assert set(FLOAT_TYPES) | set(Q8_TYPES) == set(QUANT_TYPES)

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


def source(name: str) -> str:
    """The text of kernel file ``name`` with our own ``#include "..."`` lines replaced by
    the headers' text (each header once), as one translation unit: CuPy's compile
    cache then sees every change to a header."""
    seen: set[str] = set()

    def expand(file: str) -> str:
        text = (KERNEL_DIR / file).read_text()
        if file in HEADERS:  # inlined: its guard would be a pragma in the main file
            text = re.sub(r"^\s*#\s*pragma\s+once\s*$", "", text, flags=re.MULTILINE)

        def include(match: re.Match[str]) -> str:
            header = match.group(1)
            if header in seen:
                return f"// {header}: included above"
            seen.add(header)
            return f"// ---- {header} ----\n{expand(header)}\n// ---- end of {header} ----"

        return _INCLUDE.sub(include, text)

    return expand(name)


#: Options for NVRTC (and for nvcc when GGUF_PIPELINE_CUDA_COMPILER=nvcc). ``--fmad=false``:
#: no multiply and add is fused unless the source says ``fmaf``, so a kernel rounds
#: where its source and its NumPy twin round. Both compilers fuse by default; NVRTC 13.5
#: then fuses 52 multiply-adds in matvec.cu (5 or 6 in each 8-bit product, in the
#: block decoders' scale arithmetic that test_kernels_host.py checks bit for bit
#: against the twins on the CPU), 13 in norm.cu and 54 in attention.cu (counted with
#: the default options; test_kernels_compile.py checks that ours fuse only the source's
#: fmaf). No fast math (the twins assume IEEE division and square root), and no language
#: standard (the sources need C++11; CuPy picks its own default and adds ``-ftz=true``,
#: which flushes float32 subnormals: no value the kernels compare is that small).
COMPILE_OPTIONS: tuple[str, ...] = ("--fmad=false",)

_NULL = np.uint64(0)


def _arg(code: str, value: Any) -> Any:
    if code == "p":
        return _NULL if value is None else value
    if code == "i":
        return np.int32(value)
    if code == "l":
        return np.int64(value)
    if code == "f":
        return np.float32(value)
    raise ValueError(f"unknown parameter code {code!r}")


class KernelSet:
    """The kernels of every source file for the current CuPy device, each module
    compiled on first use (NVRTC by default; ``GGUF_PIPELINE_CUDA_COMPILER=nvcc`` asks
    CuPy to run nvcc instead). Thread-safe."""

    def __init__(self, compiler: str | None = None) -> None:
        self.compiler = compiler or os.environ.get("GGUF_PIPELINE_CUDA_COMPILER", "nvrtc")
        if self.compiler not in ("nvrtc", "nvcc"):
            raise ValueError(f"unknown CUDA compiler {self.compiler!r} (nvrtc or nvcc)")
        self._modules: dict[str, Any] = {}
        self._functions: dict[str, Any] = {}
        self._lock = threading.Lock()

    def module(self, file: str) -> Any:
        with self._lock:
            if file not in self._modules:
                import cupy

                self._modules[file] = cupy.RawModule(
                    code=source(file), options=COMPILE_OPTIONS, backend=self.compiler
                )
            return self._modules[file]

    def function(self, name: str) -> Any:
        fn = self._functions.get(name)
        if fn is None:
            fn = self.module(FILE_OF[name]).get_function(name)
            self._functions[name] = fn
        return fn

    def compile_all(self) -> None:
        """Compile every module and look up every kernel (before a graph capture)."""
        for name in SIGNATURES:
            self.function(name)

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
        """Launch kernel ``name`` on ``stream`` (the current stream when None), each
        argument converted to its parameter's type."""
        codes = SIGNATURES[name].split()
        if len(codes) != len(args):
            raise TypeError(f"{name} takes {len(codes)} arguments, got {len(args)}")
        grid3 = (grid,) if isinstance(grid, int) else tuple(grid)
        if any(g < 1 for g in grid3):
            raise ValueError(f"{name}: empty grid {grid3}")
        converted = tuple(_arg(c, a) for c, a in zip(codes, args, strict=True))
        self.function(name)(grid3, (block,), converted, shared_mem=shared_mem, stream=stream)
