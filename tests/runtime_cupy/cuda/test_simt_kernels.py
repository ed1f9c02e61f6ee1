"""Every CUDA kernel's real source, run on the SIMT emulator, against its NumPy twin.

The tests of ``test_gpu_kernels.py`` (each kernel of ``kernels.SIGNATURES`` against its
twin on random inputs, with the launch geometry the worker uses: 4 warps a block for the
products, 256 threads for attention, 1024 for a one-row norm, 128 partial blocks for
argmax, ...) run here with every parameter set they have, on the emulator
(``EmulatedKernels``) instead of a GPU, in two thread orders: reverse, and a seeded random
order. Their checks are the GPU's: exact where the twin reproduces the arithmetic
(decoding, conversions, quantizing a given row, rotary, argmax), within a few float32
roundings of the sum of the terms' magnitudes where the kernel sums in its own order
(products, norms, attention), as ``test_gpu_kernels.py`` derives them.

Shapes: the products at SmolLM2's widths (576, 1536) and odd ones (one row, one chunk,
rows not a multiple of a block's, chunk counts not a multiple of the warp); the 8B
widths of the GPU run take minutes here and add no path through the kernels.

On top of the twins' checks: the memory every launch leaves (outputs and inputs) is
the same, bit for bit, in both orders. A kernel whose result depends on the order in
which its threads run has a race (a missing ``__syncthreads``); and every kernel is
launched by some test.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
from typing import Any

import numpy as np
import pytest

import tests.runtime_cupy.cuda.test_gpu_kernels as gk
from runtime_cupy.cuda.kernels import SIGNATURES
from tests.runtime_cupy.cuda.test_twins_gpu_dryrun import parameter_sets
from tests.support.emulated_cupy import DEVICE_STAGE, EmulatedKernels, FakeArray, FakeCupy
from tests.support.simt.loader import REVERSE, ThreadOrder, random_order
from tests.support.simt.project_kernels import asan_requested

#: Minutes: every parameter set of every kernel test, twice.
pytestmark = pytest.mark.slow

if shutil.which("g++") is None:
    pytest.skip("the SIMT emulator needs a host C++ compiler (g++)", allow_module_level=True)

#: Two orders, whose launches must leave the same bits. Under ASan (``test_simt_asan.py``:
#: accesses outside an array, not races) one: a kernel that leaves the same bits in
#: every order (this file's run without ASan checks it) touches the same addresses.
ORDERS = (REVERSE,) if asan_requested() else (REVERSE, random_order(24))
KERNEL_TESTS = sorted(name for name in dir(gk) if name.startswith("test_"))
SHAPES_32 = [(1, 32), (7, 96), (577, 576), (33, 1536)]
SHAPES_K = [(1, 256), (5, 768), (35, 1536)]


class RecordingKernels(EmulatedKernels):
    """The emulated kernels, recording a digest of every pointer argument's memory after
    each launch (and which kernels ran)."""

    def __init__(self, order: ThreadOrder) -> None:
        super().__init__(order)
        self.digests: list[str] = []

    def launch(self, name: str, grid: Any, block: int, args: Any, **kw: Any) -> None:
        super().launch(name, grid, block, args, **kw)
        h = hashlib.sha256(name.encode())
        for a in args:
            if isinstance(a, FakeArray):
                h.update(np.ascontiguousarray(a).view(np.uint8).tobytes())
        self.digests.append(h.hexdigest())


@pytest.fixture(scope="module")
def launched() -> set[str]:
    """The kernels the module's tests launched (test_every_kernel_ran_on_the_emulator,
    last in file order, checks that they are all of them)."""
    return set()


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", FakeCupy())
    monkeypatch.setitem(sys.modules, "runtime_cupy.cuda.backend", DEVICE_STAGE)
    monkeypatch.setattr(gk, "SHAPES_32", SHAPES_32)
    monkeypatch.setattr(gk, "SHAPES_K", SHAPES_K)


@pytest.mark.parametrize("name", KERNEL_TESTS)
def test_kernels_against_their_twins_in_two_thread_orders(
    emulated: None, launched: set[str], name: str
) -> None:
    fn = getattr(gk, name)
    uses_ks = "ks" in fn.__code__.co_varnames[: fn.__code__.co_argcount]
    runs = []
    for order in ORDERS:
        k = RecordingKernels(order)
        for params in parameter_sets(fn, limit=10**6) or [{}]:
            fn(**({"ks": k} if uses_ks else {}), **params)
        runs.append(k.digests)
        launched.update(k.launched)
    for order, run in zip(ORDERS[1:], runs[1:], strict=True):
        assert run == runs[0], f"{name}: launches left other bits in {order} than {ORDERS[0]}"
    if uses_ks:
        assert runs[0], f"{name} launched nothing"


def test_every_kernel_ran_on_the_emulator(emulated: None, launched: set[str]) -> None:
    """Runs after the tests above (file order): together they launched every kernel."""
    if not launched:
        pytest.skip("run with the tests above (it checks what they launched)")
    assert launched == set(SIGNATURES), sorted(set(SIGNATURES) - launched)
