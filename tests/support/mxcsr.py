"""This thread's MXCSR (the SSE floating-point environment: rounding, flush-to-zero,
denormals-are-zero), read and set through the C library's ``fegetenv`` / ``fesetenv``
(glibc's x86-64 ``fenv_t``: MXCSR at byte 28). Imports no kernels, so that a process
can set its environment before it loads them."""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable, Iterator
from contextlib import contextmanager

LIBM = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")  # fegetenv, fesetenv
FTZ, DAZ = 0x8000, 0x0040
ROUNDING = {"toward zero": 0x6000, "up": 0x4000, "down": 0x2000}
ROUNDING_BITS = 0x6000


def _get_env() -> ctypes.Array[ctypes.c_char]:
    env = ctypes.create_string_buffer(32)
    assert LIBM.fegetenv(env) == 0
    return env


def mxcsr() -> int:
    """This thread's MXCSR."""
    return int.from_bytes(_get_env().raw[28:32], "little")


def set_mxcsr(bits: int, clear: int = 0) -> None:
    """This thread's MXCSR with ``bits`` set and ``clear`` cleared, from now on."""
    env = _get_env()
    value = (int.from_bytes(env.raw[28:32], "little") & ~clear) | bits
    ctypes.memmove(ctypes.addressof(env) + 28, value.to_bytes(4, "little"), 4)
    assert LIBM.fesetenv(env) == 0


@contextmanager
def mxcsr_set(bits: int, clear: int = 0) -> Iterator[Callable[[], int]]:
    """This thread's MXCSR with ``bits`` set (``clear`` cleared) in the block; a function
    that reads it; the caller's given back after."""
    saved = _get_env()
    set_mxcsr(bits, clear)
    try:
        yield mxcsr
    finally:
        assert LIBM.fesetenv(saved) == 0
