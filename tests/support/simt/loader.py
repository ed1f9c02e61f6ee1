"""Compile a CUDA ``.cu`` file for the host with ``simt.h`` and launch its kernels.

``compile_cu(path)`` returns a ``SimtModule`` whose ``launch(name, grid, block, args,
shared_mem=0, order=FORWARD)`` runs kernel ``name`` on NumPy arrays (a pointer
parameter takes an array, whose memory the kernel reads and writes, or ``None``),
Python ints and floats, each converted to its parameter's C type (which the module
reports: ``SimtModule.kernels``). A launch that breaks CUDA's rules (a divergent
barrier, a bad shuffle mask, a deadlock, too much shared memory, a block beyond the
kernel's ``__launch_bounds__``) raises ``SimtError`` with what happened where.

Compiling: the file and the headers it includes with ``#include "..."`` are rewritten
(``rewrite.rewrite_shared``) into a build folder, the kernels are found (``g++ -E``,
``rewrite.find_kernels``), and one shared library is built from the file and a small
entry per kernel (``simt_invoke_<name>``, ``simt_params_<name>``). The result is cached
by the sha256 of everything that goes into it (the rewritten texts, ``simt.h``, the
compiler's version and flags) under ``$GGUF_PIPELINE_SIMT_CACHE`` (default
``~/.cache/gguf-pipeline/simt``), so a file is compiled once per change; several
processes may build one entry at once (the first rename wins).

``asan=True`` builds with ``-fsanitize=address``: every access outside a shared array
(each is an allocation of its own) or outside a NumPy array's memory is reported by
ASan, which then stops the process. Such a module loads only into a process started
with the ASan runtime preloaded (``LD_PRELOAD=$(g++ -print-file-name=libasan.so)``;
``make simt-asan`` does).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from attrs import frozen

from tests.support.simt.rewrite import find_kernels, rewrite_shared

HEADER = Path(__file__).resolve().with_name("simt.h")
#: simt.h and the parts it includes: all of them go into the cache key.
HEADERS = tuple(sorted(HEADER.parent.glob("simt*.h")))
#: Bumped when what the loader writes around a source changes.
ABI = 1
CXX = os.environ.get("GGUF_PIPELINE_SIMT_CXX") or shutil.which("g++") or "g++"
#: -O1: kernels run as fast as at -O2 on the emulator (the time goes to switching
#: fibers at barriers and shuffles), and a build takes less: 6.5 against 7.5 CPU seconds
#: for every kernel source, the ASan builds 20 against 27 (measured under load).
FLAGS: tuple[str, ...] = (
    "-std=c++17", "-O1", "-fPIC", "-shared", "-fvisibility=hidden",
    "-ffp-contract=off",  # no fused multiply-add the source does not write (--fmad=false)
    "-fno-strict-aliasing",  # the kernels read GGUF bytes as 16- and 32-bit words
    "-Wall", "-Werror", "-Wno-unknown-pragmas", "-Wno-unused-function",
)  # fmt: skip
ASAN_FLAGS: tuple[str, ...] = ("-fsanitize=address", "-fno-omit-frame-pointer", "-g")
MAX_CACHED = 64
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


class SimtError(RuntimeError):
    """A launch that broke CUDA's rules, or that the emulator refused."""


class SimtCompileError(RuntimeError):
    """A source that the host compiler or the loader could not build."""


@frozen
class ThreadOrder:
    """Which thread runs next: ``forward`` (lowest index first), ``reverse``, or
    ``random`` (a permutation per scheduling round, from ``seed``); blocks likewise."""

    kind: str
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        if self.kind not in ("forward", "reverse", "random"):
            raise ValueError(f"thread order {self.kind!r}: forward, reverse or random")
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"seed {self.seed} is not a 64-bit unsigned integer")

    @property
    def code(self) -> int:
        return ("forward", "reverse", "random").index(self.kind)

    def __str__(self) -> str:
        return self.kind if self.kind != "random" else f"random({self.seed})"


FORWARD = ThreadOrder("forward")
REVERSE = ThreadOrder("reverse")


def random_order(seed: int) -> ThreadOrder:
    return ThreadOrder("random", seed)


@frozen
class KernelInfo:
    name: str
    launch_bounds: int | None
    kinds: tuple[int, ...]  # per parameter: 0 pointer, 1 signed, 2 unsigned, 3 float
    sizes: tuple[int, ...]  # per parameter: bytes


def cache_dir() -> Path:
    env = os.environ.get("GGUF_PIPELINE_SIMT_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gguf-pipeline" / "simt"


def asan_runtime_loaded() -> bool:
    return hasattr(ctypes.CDLL(None), "__asan_init")


def asan_runtime() -> Path | None:
    """ASan's runtime library of the host compiler (``CXX``), to preload into a process
    that loads ASan modules; ``None`` where the compiler has none."""
    try:
        proc = subprocess.run(
            [CXX, "-print-file-name=libasan.so"], capture_output=True, text=True, check=False
        )
    except OSError:
        return None
    path = Path(proc.stdout.strip())
    return path if proc.returncode == 0 and path.is_absolute() and path.exists() else None


def asan_environment(extra_path: Sequence[str] = ()) -> dict[str, str]:
    """This process's environment with ASan's runtime preloaded, leak checks off (an
    interpreter frees little at exit), the symbolizer named where there is one, and
    ``extra_path`` first on ``PYTHONPATH``. ``SimtCompileError`` without a runtime."""
    runtime = asan_runtime()
    if runtime is None:
        raise SimtCompileError(f"{CXX} has no libasan.so: no ASan build of the kernels")
    symbolizer = shutil.which("llvm-symbolizer")
    options = "detect_leaks=0" + (f":external_symbolizer_path={symbolizer}" if symbolizer else "")
    path = [*extra_path, *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "LD_PRELOAD": str(runtime), "ASAN_OPTIONS": options,
            "PYTHONPATH": os.pathsep.join(path)}  # fmt: skip


@functools.cache
def _compiler_version() -> str:
    proc = subprocess.run([CXX, "--version"], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SimtCompileError(f"the host compiler {CXX} does not run: {proc.stderr.strip()}")
    return proc.stdout.splitlines()[0] if proc.stdout else CXX


def _sources(path: Path, include_dirs: Sequence[Path]) -> dict[str, Path]:
    """``path`` and every file it includes with quotes, by file name."""
    found: dict[str, Path] = {}
    todo = [path]
    while todo:
        p = todo.pop()
        if p.name in found:
            if found[p.name] != p:
                raise SimtCompileError(f"two sources named {p.name}: {found[p.name]} and {p}")
            continue
        found[p.name] = p
        for name in _INCLUDE.findall(p.read_text()):
            for d in (p.parent, *include_dirs):
                if (d / name).is_file():
                    todo.append((d / name).resolve())
                    break
            else:
                raise SimtCompileError(f"{p}: included file {name!r} not found")
    return found


def _run(cmd: list[str], what: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SimtCompileError(f"{what} failed ({' '.join(cmd)}):\n{proc.stderr.strip()}")
    return proc.stdout


_locks: dict[str, threading.Lock] = {}
_locks_lock = threading.Lock()
_loaded: dict[str, SimtModule] = {}


def compile_cu(
    path: str | os.PathLike[str],
    *,
    include_dirs: Sequence[str | os.PathLike[str]] = (),
    defines: Sequence[str] = (),
    asan: bool = False,
) -> SimtModule:
    """The kernels of ``path`` built for the emulator (from the cache when built before)."""
    source = Path(path).resolve()
    dirs = [Path(d).resolve() for d in include_dirs]
    files = _sources(source, dirs)
    first_id = 1
    rewritten: dict[str, str] = {}
    for name in sorted(files):
        text, first_id = rewrite_shared(files[name].read_text(), str(files[name]), first_id)
        rewritten[name] = f'#line 1 "{files[name]}"\n{text}'
    flags = [*FLAGS, *(ASAN_FLAGS if asan else ()), *(f"-D{d}" for d in defines)]
    digest = hashlib.sha256()
    headers = "".join(h.name + "\0" + h.read_text() for h in HEADERS)
    for part in (str(ABI), headers, _compiler_version(), " ".join(flags), source.name):
        digest.update(part.encode() + b"\0")
    for name in sorted(rewritten):
        digest.update(name.encode() + b"\0" + rewritten[name].encode() + b"\0")
    key = digest.hexdigest()[:32]
    if asan and not asan_runtime_loaded():
        raise SimtCompileError(
            "an ASan module loads only into a process with the ASan runtime preloaded: "
            "LD_PRELOAD=$(g++ -print-file-name=libasan.so) (make simt-asan does)"
        )
    with _locks_lock:
        lock = _locks.setdefault(key, threading.Lock())
    with lock:
        if key in _loaded:
            return _loaded[key]
        root = cache_dir()
        entry = root / key
        if not (entry / "kernels.json").is_file():
            _build(entry, source.name, rewritten, flags)
        else:
            os.utime(entry)
        module = SimtModule(entry, source)
        _loaded[key] = module
        return module


def _build(entry: Path, main: str, rewritten: dict[str, str], flags: list[str]) -> None:
    root = entry.parent
    root.mkdir(parents=True, exist_ok=True)
    work = root / f".{entry.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    work.mkdir()
    try:
        for name, text in rewritten.items():
            (work / name).write_text(text)
        pre = _run(
            [CXX, "-E", "-x", "c++", "-std=c++17", "-DSIMT_DISCOVER", "-include", str(HEADER),
             "-I", str(work), str(work / main)],
            f"preprocessing {main}",
        )  # fmt: skip
        kernels = find_kernels(pre)
        if not kernels:
            raise SimtCompileError(f"{main} has no __global__ function")
        entries = [f'#include "{main}"']
        for k in kernels:
            entries.append(
                f'extern "C" __attribute__((visibility("default"))) void simt_invoke_{k.name}'
                f"(void** a) {{ ::simt::detail::invoke(&{k.name}, a); }}\n"
                f'extern "C" __attribute__((visibility("default"))) int simt_params_{k.name}'
                f"(int* kinds, int* sizes, int cap) {{ return ::simt::detail::describe("
                f"&{k.name}, kinds, sizes, cap); }}"
            )
        (work / "simt_entries.cpp").write_text("\n".join(entries) + "\n")
        _run(
            [CXX, *flags, "-include", str(HEADER), "-I", str(work),
             str(work / "simt_entries.cpp"), "-o", str(work / "module.so")],
            f"compiling {main} for the SIMT emulator",
        )  # fmt: skip
        # read the parameters from a copy: a process that loaded module.so from this
        # folder would keep it under this path after the rename (ASan's symbolizer then
        # finds no file)
        shutil.copyfile(work / "module.so", work / "probe.so")
        lib = ctypes.CDLL(str(work / "probe.so"))
        (work / "probe.so").unlink()
        table = []
        for k in kernels:
            kinds, sizes = (ctypes.c_int * 64)(), (ctypes.c_int * 64)()
            n = getattr(lib, f"simt_params_{k.name}")(kinds, sizes, 64)
            if n > 64:
                raise SimtCompileError(f"{k.name} has {n} parameters (at most 64)")
            table.append(
                {"name": k.name, "launch_bounds": k.launch_bounds,
                 "kinds": list(kinds[:n]), "sizes": list(sizes[:n])}
            )  # fmt: skip
        (work / "kernels.json").write_text(json.dumps(table, indent=1))
        try:
            work.rename(entry)
        except OSError:  # another process built it first
            shutil.rmtree(work, ignore_errors=True)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    _prune(root)


def _prune(root: Path) -> None:
    entries = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    entries.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[MAX_CACHED:]:
        shutil.rmtree(old, ignore_errors=True)


def _address(value: Any, name: str, index: int) -> int:
    if value is None:
        return 0
    if isinstance(value, np.ndarray):
        return int(value.__array_interface__["data"][0])
    raise TypeError(f"{name}: argument {index} is a pointer; got {type(value).__name__}")


_INT_TYPES = {(1, 1): ctypes.c_int8, (1, 2): ctypes.c_int16, (1, 4): ctypes.c_int32,
              (1, 8): ctypes.c_int64, (2, 1): ctypes.c_uint8, (2, 2): ctypes.c_uint16,
              (2, 4): ctypes.c_uint32, (2, 8): ctypes.c_uint64}  # fmt: skip


def _scalar(kind: int, size: int, value: Any, name: str, index: int) -> Any:
    if kind in (1, 2):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise TypeError(f"{name}: argument {index} is an integer; got {value!r}")
        v = int(value)
        bits = 8 * size
        low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1)) if kind == 1 else (0, 2**bits)
        if not low <= v < high:
            raise TypeError(f"{name}: argument {index} = {v} does not fit {bits} bits")
        return _INT_TYPES[(kind, size)](v)
    if kind == 3:
        if not isinstance(value, float | int | np.floating | np.integer) or isinstance(value, bool):
            raise TypeError(f"{name}: argument {index} is a float; got {value!r}")
        return (ctypes.c_float if size == 4 else ctypes.c_double)(float(value))
    raise TypeError(f"{name}: argument {index} has a type Python cannot pass")


def _dims(v: int | Sequence[int], what: str) -> tuple[int, int, int]:
    t = (v,) if isinstance(v, int | np.integer) else tuple(v)
    if not 1 <= len(t) <= 3 or any(int(x) < 0 for x in t):
        raise SimtError(f"a {what} of {v!r}")
    t = tuple(int(x) for x in t) + (1,) * (3 - len(t))
    return t[0], t[1], t[2]


class SimtModule:
    """One compiled source's kernels."""

    def __init__(self, entry: Path, source: Path) -> None:
        self.source = source
        self.lib = ctypes.CDLL(str(entry / "module.so"))
        self.lib.simt_launch.restype = ctypes.c_int
        self.lib.simt_launch.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_ulonglong, ctypes.c_int, ctypes.c_ulonglong, ctypes.c_char_p,
            ctypes.c_ulonglong,
        ]  # fmt: skip
        table = json.loads((entry / "kernels.json").read_text())
        self.kernels = {
            k["name"]: KernelInfo(
                k["name"], k["launch_bounds"], tuple(k["kinds"]), tuple(k["sizes"])
            )
            for k in table
        }
        self._invoke = {
            name: ctypes.cast(getattr(self.lib, f"simt_invoke_{name}"), ctypes.c_void_p).value
            for name in self.kernels
        }

    def launch(
        self,
        name: str,
        grid: int | Sequence[int],
        block: int | Sequence[int],
        args: Sequence[Any],
        *,
        shared_mem: int = 0,
        order: ThreadOrder = FORWARD,
    ) -> None:
        info = self.kernels.get(name)
        if info is None:
            raise SimtError(f"{self.source.name} has no kernel {name!r}")
        g, b = _dims(grid, "grid"), _dims(block, "block")
        threads = b[0] * b[1] * b[2]
        if info.launch_bounds is not None and threads > info.launch_bounds:
            raise SimtError(
                f"{name}: a block of {threads} threads, beyond its __launch_bounds__"
                f"({info.launch_bounds}) (a GPU refuses the launch)"
            )
        if len(args) != len(info.kinds):
            raise TypeError(f"{name} takes {len(info.kinds)} arguments, got {len(args)}")
        storage: list[Any] = []
        pointers = (ctypes.c_void_p * max(1, len(args)))()
        for i, (kind, size, value) in enumerate(zip(info.kinds, info.sizes, args, strict=True)):
            if kind == 0:
                cell: Any = ctypes.c_void_p(_address(value, name, i))
            else:
                cell = _scalar(kind, size, value, name, i)
            storage.append(cell)
            pointers[i] = ctypes.cast(ctypes.pointer(cell), ctypes.c_void_p)
        grid_c, block_c = (ctypes.c_uint * 3)(*g), (ctypes.c_uint * 3)(*b)
        err = ctypes.create_string_buffer(4096)
        rc = self.lib.simt_launch(
            self._invoke[name], pointers, grid_c, block_c, int(shared_mem), order.code,
            order.seed, err, len(err),
        )  # fmt: skip
        del storage
        if rc != 0:
            raise SimtError(f"{name} (grid {g}, block {b}, {order}): {err.value.decode()}")
