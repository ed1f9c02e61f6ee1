"""A stand-in for CuPy on a CPU, and the CUDA worker's device backend running on it.

``FakeCupy``: NumPy arrays as device memory, ``memcpyAsync`` and ``memsetAsync`` as
memory copies and fills (recorded while a graph is captured), streams
that record a graph when they capture and replay it on launch; it refuses what a GPU
would fault on or a capture cannot record. ``EmulatedKernels``: the kernels' real
source (``kernels/*.cu``) run on the SIMT emulator (``tests/support/simt``), in a
thread order of the caller's, with the launch checks of a GPU (grid limits, pointer
alignment). ``DEVICE_STAGE`` is ``runtime_cupy/cuda/backend.py`` (``DEVICE_OPS`` its
``ops.py``) imported with ``FakeCupy`` as ``cupy``, and ``EmulatedCudaWorker`` the CUDA worker on
both. The kernels' NumPy twins (``kernel_twins``) are what tests compare with. Only
tests import this module.
"""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import sys
import types
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from runtime_core.workers.stage_worker import BackendSpec, StageBackend
from runtime_cupy.cuda import kernels as kernels_mod
from runtime_cupy.cuda.worker import CudaWorker
from tests.support.simt.loader import FORWARD, ThreadOrder
from tests.support.simt.project_kernels import SimtKernelSet

# ---- a stand-in for CuPy ---------------------------------------------------------------


class _Recorder:
    """Operations a capturing stream records instead of running."""

    def __init__(self) -> None:
        self.active: list[Callable[[], None]] | None = None

    def run_or_record(self, op: Callable[[], None]) -> None:
        if self.active is not None:
            self.active.append(op)
        else:
            op()


RECORDER = _Recorder()


def _not_while_capturing(what: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, refused while a graph is captured: what a stream capture cannot record (a
    host copy, an allocation, a wait) fails the capture on a GPU."""

    def call(*args: Any, **kwargs: Any) -> Any:
        assert RECORDER.active is None, f"{what} while a graph is captured"
        return fn(*args, **kwargs)

    return call


class _Ptr:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class FakeArray(np.ndarray):
    """A NumPy array standing for device memory."""

    @property  # type: ignore[override]
    def data(self) -> _Ptr:
        return _Ptr(int(self.__array_interface__["data"][0]))

    def set(self, arr: Any, stream: Any = None) -> None:
        assert RECORDER.active is None, "a copy from the host while a graph is captured"
        src = np.asarray(arr)
        assert src.shape == self.shape and src.dtype == self.dtype, (src.shape, self.shape)
        np.copyto(self.view(np.ndarray), src)


def _dev(a: Any) -> FakeArray:
    return np.asarray(a).view(FakeArray)


class _Graph:
    def __init__(self, ops: list[Callable[[], None]]) -> None:
        self.ops = ops
        self.launches = 0

    def launch(self, stream: Any = None) -> None:
        self.launches += 1
        for op in self.ops:
            op()


#: The streams made current (``with stream:``), innermost last: none is the default
#: stream, which a stage's non-blocking stream does not wait for.
CURRENT_STREAMS: list[_Stream] = []
#: Allocations made while the default stream was current (``DEFAULT_STREAM_ALLOCATIONS
#: [0]``): on a GPU CuPy takes them from, and clears them on, the default stream's pool,
#: unordered against the stage's stream (memory its kernels still read could be handed
#: out and cleared meanwhile).
DEFAULT_STREAM_ALLOCATIONS = [0]


class _Stream:
    def __init__(self, non_blocking: bool = False) -> None:
        self.ptr = 0

    def __enter__(self) -> _Stream:
        CURRENT_STREAMS.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        CURRENT_STREAMS.remove(self)

    def synchronize(self) -> None:
        assert RECORDER.active is None, "a capturing stream cannot be synchronized"

    def begin_capture(self) -> None:
        assert RECORDER.active is None
        RECORDER.active = []

    def end_capture(self) -> _Graph:
        assert RECORDER.active is not None
        graph = _Graph(RECORDER.active)
        RECORDER.active = None
        return graph


class _Device:
    def __init__(self, index: int = 0) -> None:
        self.index = index

    def __enter__(self) -> _Device:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def synchronize(self) -> None:
        assert RECORDER.active is None


def _memcpy_async(dst: int, src: int, n: int, kind: int, stream: int) -> None:
    assert kind == 3, "only device-to-device copies go through memcpyAsync"
    RECORDER.run_or_record(lambda: ctypes.memmove(dst, src, n))


def _memset_async(ptr: int, value: int, n: int, stream: int) -> None:
    RECORDER.run_or_record(lambda: ctypes.memset(ptr, value, n))


#: Every live "device" allocation, for the memory pool's ``used_bytes``.
ALLOCATIONS: dict[int, weakref.ref[FakeArray]] = {}


def _checked_alloc(fn: Callable[..., Any]) -> Callable[..., FakeArray]:
    def alloc(*args: Any, **kwargs: Any) -> FakeArray:
        assert RECORDER.active is None, "no allocation while a graph is captured"
        if not CURRENT_STREAMS:
            DEFAULT_STREAM_ALLOCATIONS[0] += 1
        arr = _dev(fn(*args, **kwargs))
        key = id(arr)
        ALLOCATIONS[key] = weakref.ref(arr, lambda _: ALLOCATIONS.pop(key, None))
        return arr

    return alloc


class _Pool:
    def free_all_blocks(self) -> None:
        return None

    def used_bytes(self) -> int:
        gc.collect()
        live = (r() for r in list(ALLOCATIONS.values()))
        return sum(a.nbytes for a in live if a is not None)


class FakeCupy(types.ModuleType):
    ndarray = FakeArray

    def __init__(self) -> None:
        super().__init__("cupy")
        self.zeros = _checked_alloc(np.zeros)
        self.empty = _checked_alloc(poisoned)
        self.asarray = _checked_alloc(lambda a, dtype=None: np.array(a, dtype=dtype, copy=True))
        self.ascontiguousarray = lambda a: (
            a if a.flags.c_contiguous else self._copy_while_not_capturing(a)
        )
        self._copy_while_not_capturing = _not_while_capturing(
            "a copy (an allocation)", lambda a: _dev(np.ascontiguousarray(a))
        )
        self.asnumpy = _not_while_capturing(
            "a copy to the host", lambda a, stream=None: np.array(a).view(np.ndarray)
        )
        pool = _Pool()
        self.get_default_memory_pool = lambda: pool
        runtime = types.SimpleNamespace(
            memcpyAsync=_memcpy_async, memsetAsync=_memset_async, deviceSynchronize=lambda: None
        )
        self.cuda = types.SimpleNamespace(Device=_Device, Stream=_Stream, runtime=runtime)

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)


#: NaNs of a payload that neither NumPy nor a GPU computes, to poison memory with:
#: a NaN written over one shows as a change of bits.
POISON_NAN_BITS: dict[np.dtype[Any], tuple[Any, int]] = {
    np.dtype(np.float64): (np.uint64, 0x7FFA5A5A5A5A5A5A),
    np.dtype(np.float32): (np.uint32, 0x7FD5A5A5),
    np.dtype(np.float16): (np.uint16, 0x7E5A),
}


def poisoned(shape: Any, dtype: Any = np.float64) -> np.ndarray:
    """``empty``: NaN (``POISON_NAN_BITS``, or 0x5A bytes) where real memory would hold
    leftovers, so that a read of anything not written shows."""
    dt = np.dtype(dtype)
    if dt in POISON_NAN_BITS:
        bits_type, bits = POISON_NAN_BITS[dt]
        return np.full(shape, bits, bits_type).view(dt)
    if np.issubdtype(dt, np.floating):
        return np.full(shape, np.nan, dt)
    return np.full(shape, 0x5A, dt)


#: The widest load of a type's blocks in quant.cuh (2 bytes for the types not listed):
#: a matrix's rows must start at multiples of it.
BLOCK_LOAD_BYTES = {"F32": 16, "F16": 16, "BF16": 16, "Q4_1": 4, "Q5_1": 4, "Q2_K": 4,
                    "Q4_K": 4, "Q5_K": 4, "IQ4_XS": 4}  # fmt: skip
#: (kernel name prefix, pointer parameter): the 16-byte vectors a kernel reads or writes.
VECTOR_PARAMETERS = {("matvec_q8_", 4), ("matvec_f_", 4), ("dequant_rows_", 6)}


def pointer_alignment(name: str, index: int, array: np.ndarray) -> int:
    """The alignment (bytes) a GPU needs of pointer parameter ``index`` of ``name``."""
    if any(name.startswith(prefix) and index == at for prefix, at in VECTOR_PARAMETERS):
        return 16
    if name.startswith(("matvec_", "dequant_rows_")) and index == 0:  # GGUF rows
        return BLOCK_LOAD_BYTES.get(name.split("_", 2)[2], 2)
    return int(array.dtype.itemsize)


def allocation_offset(array: np.ndarray) -> int:
    """Where view ``array`` starts in the allocation it views (a GPU allocation is 256-byte
    aligned, so this is its alignment there)."""
    owner = array
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    start: int = array.__array_interface__["data"][0]
    return start - int(owner.__array_interface__["data"][0])


class EmulatedKernels:
    """``KernelSet`` on the SIMT emulator (``kernels``: a ``SimtKernelSet`` in thread
    order ``order``). Checks each launch's arguments against the kernel's parameter
    types, as the real launch converts them, and each pointer's alignment
    (``pointer_alignment``) as a GPU needs it. A NaN the emulated kernels compute carries
    an x86 payload, not a GPU's canonical one: what a test compares must not depend on
    NaN payloads."""

    def __init__(self, order: ThreadOrder = FORWARD) -> None:
        self.python_launches = 0
        self.launched: dict[str, int] = {}
        self.kernels: Any = SimtKernelSet(order)

    def compile_all(self) -> None:
        return None

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
        codes = kernels_mod.SIGNATURES[name].split()
        assert len(codes) == len(args), (name, len(codes), len(args))
        for index, (code, value) in enumerate(zip(codes, args, strict=True)):
            if code == "p":
                assert value is None or isinstance(value, FakeArray), (name, type(value))
                if value is not None:
                    need, at = pointer_alignment(name, index, value), allocation_offset(value)
                    assert at % need == 0, f"{name}: argument {index} at {at}, not {need}-aligned"
            elif code in "il":
                assert isinstance(value, int | np.integer) and not isinstance(value, bool), name
            else:
                assert isinstance(value, float | np.floating), (name, value)
        if name.startswith(("matvec_", "dequant_rows_")):  # every row aligned as the first
            need = pointer_alignment(name, 0, args[0])
            assert args[1] % need == 0, f"{name}: rows of {args[1]} bytes, not {need}-aligned"
        grid3 = (grid,) if isinstance(grid, int) else tuple(grid)
        assert all(g >= 1 for g in grid3) and 1 <= block <= 1024, (name, grid3, block)
        # CUDA's limits: x up to 2**31 - 1 blocks, y and z up to 65535
        assert len(grid3) <= 3 and grid3[0] < 2**31, (name, grid3)
        assert all(g <= 65535 for g in grid3[1:]), (name, grid3)
        self.python_launches += 1
        self.launched[name] = self.launched.get(name, 0) + 1
        frozen = tuple(args)

        def run() -> None:
            self.kernels.launch(name, grid3, block, frozen)

        RECORDER.run_or_record(run)


def _load_device_modules() -> dict[str, types.ModuleType]:
    """``runtime_cupy/cuda/``'s modules that import CuPy (``expert_ops.py``, ``ops.py``,
    ``backend.py``, in the order they import each other) executed with FakeCupy as
    ``cupy``, each seen by the next under its real name, then taken out of
    ``sys.modules`` again (the real modules stay what an import finds)."""
    folder = Path(kernels_mod.__file__).parent
    names = ("expert_ops", "ops", "backend")
    real = {n: f"runtime_cupy.cuda.{n}" for n in names}
    saved = {m: sys.modules.get(m) for m in ("cupy", *real.values())}
    sys.modules["cupy"] = FakeCupy()
    loaded: dict[str, types.ModuleType] = {}
    try:
        for n in names:
            spec = importlib.util.spec_from_file_location(f"emulated_cuda_{n}", folder / f"{n}.py")
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[real[n]] = module
            spec.loader.exec_module(module)
            loaded[n] = module
    finally:
        for m, was in saved.items():
            if was is None:
                sys.modules.pop(m, None)
            else:
                sys.modules[m] = was
    return loaded


_DEVICE_MODULES = _load_device_modules()
#: ``cuda/backend.py`` and ``cuda/ops.py`` on FakeCupy
DEVICE_STAGE = _DEVICE_MODULES["backend"]
DEVICE_OPS = _DEVICE_MODULES["ops"]


class EmulatedCudaWorker(CudaWorker):
    """The CUDA worker with FakeCupy and the kernels on the SIMT emulator (in thread
    order ``order``, a class attribute a test may set)."""

    backends: ClassVar[list[Any]] = []
    order: ClassVar[ThreadOrder] = FORWARD

    def _make_backend(self, spec: BackendSpec) -> StageBackend:
        DEVICE_OPS._KERNELS[self.device] = EmulatedKernels(self.order)
        backend = DEVICE_STAGE.DeviceBackend(
            spec,
            use_graph=self.use_graph,
            device_io=self.device_io,
            device=self.device,
            trace=self.trace,
        )
        EmulatedCudaWorker.backends.append(backend)
        return backend
