"""NVRTC, the compiler CuPy's ``RawModule`` runs on GPU hosts, called through ctypes so
that the kernels are compiled by it on CPU hosts too (NVRTC needs no GPU).

The library comes from the ``nvidia-cuda-nvrtc`` wheel of the ``test`` extra (CUDA 13,
as on the GPU host image), or else from the system. The options are those CuPy adds
for a RawModule (``-arch`` and ``-ftz=true``) after ours (``kernels.COMPILE_OPTIONS``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
from pathlib import Path

from runtime_cupy.cuda.kernels import COMPILE_OPTIONS


class NvrtcError(Exception):
    """A compile that failed, with NVRTC's log."""


def find_library() -> Path | str | None:
    """The NVRTC shared library: the wheel's, or the system's, or ``None``."""
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or ()) if spec is not None else []
    for root in roots:
        found = sorted(Path(root).glob("cu*/lib/libnvrtc.so.*")) + sorted(
            Path(root).glob("cuda_nvrtc/lib/libnvrtc.so.*")
        )
        found = [p for p in found if "builtins" not in p.name]
        if found:
            return found[-1]
    return ctypes.util.find_library("nvrtc")


class Nvrtc:
    def __init__(self, path: Path | str) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        self._lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def version(self) -> tuple[int, int]:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self._lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)))
        return major.value, minor.value

    def _check(self, code: int, log: str = "") -> None:
        if code != 0:
            name = self._lib.nvrtcGetErrorString(code).decode()
            raise NvrtcError(f"{name}\n{log}".strip())

    def compile_ptx(
        self, text: str, name: str, arch: str, extra: tuple[str, ...] = ()
    ) -> tuple[str, str]:
        """(PTX, log) of ``text`` compiled for ``compute_XX`` architecture ``arch``, with
        options ``extra`` after CuPy's."""
        lib = self._lib
        prog = ctypes.c_void_p()
        self._check(
            lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), name.encode(), 0, None, None)
        )
        try:
            options = [*COMPILE_OPTIONS, f"-arch={arch}", "-ftz=true", *extra]
            argv = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
            code = lib.nvrtcCompileProgram(prog, len(options), argv)
            size = ctypes.c_size_t()
            self._check(lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)))
            buf = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetProgramLog(prog, buf))
            log = buf.value.decode(errors="replace").strip()
            self._check(code, log)
            self._check(lib.nvrtcGetPTXSize(prog, ctypes.byref(size)))
            ptx = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetPTX(prog, ptx))
            return ptx.value.decode(), log
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))
