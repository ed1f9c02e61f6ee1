"""The CPU worker's kernels built by clang (as a user with ``CC=clang`` builds them, with
setup.py's flags) import, find the instruction sets gcc's build finds on this host, and
compute gcc's bits on each (the exponential, tanh and SwiGLU: ``ieee32.h``). clang 14
rejected gcc's ``__builtin_cpu_supports("f16c")``; the sets are read by CPUID now.
Skipped where no clang is installed (Debian's ``clang``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from runtime_core.workers.cpu import _kernels
from tests.support.ieee32_kernels import every_set_results

ROOT = Path(__file__).resolve().parents[4]
CSRC = ROOT / "src/runtime_core/workers/cpu/csrc"
#: clang, or Debian's newest versioned one
CLANG = next(
    (c for c in ("clang", *(f"clang-{v}" for v in range(30, 10, -1))) if shutil.which(c)), None
)
pytestmark = pytest.mark.skipif(CLANG is None, reason="no clang installed")

#: every set's results, written by the clang build into OUT (run in its own process: a
#: module of the same name as the installed one)
_RUN = """
import importlib.util, sys
import numpy as np
from tests.support.ieee32_kernels import every_set_results
so, x_path, out = sys.argv[1:4]
spec = importlib.util.spec_from_file_location("clang_build._kernels", so)
k = importlib.util.module_from_spec(spec)
spec.loader.exec_module(k)
np.savez(out, isas=np.array(k.isas()), **every_set_results(k, np.load(x_path)))
"""


def _inputs() -> np.ndarray:
    rng = np.random.default_rng(7)
    x = rng.uniform(-100.0, 100.0, 4099).astype(np.float32)
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 88.72284, -103.97208, 1e-45, -1e-45]
    return np.concatenate([x, np.array(special, np.float32)])


def test_a_clang_build_finds_the_same_sets_and_computes_the_same_bits(tmp_path: Path) -> None:
    so = tmp_path / "_kernels.so"
    include = sysconfig.get_paths()["include"]
    flags = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=gnu11", "-pthread"]
    build = subprocess.run(
        [CLANG, "-shared", "-fPIC", *flags, f"-I{include}", *map(str, sorted(CSRC.glob("*.c"))),
         "-o", str(so), "-lm"],
        capture_output=True, text=True, check=False, timeout=600,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    x = _inputs()
    np.save(tmp_path / "x.npy", x)
    subprocess.run(
        [sys.executable, "-c", _RUN, str(so), str(tmp_path / "x.npy"), str(tmp_path / "out.npz")],
        check=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    got = np.load(tmp_path / "out.npz")
    assert tuple(got["isas"]) == _kernels.isas()
    ours = every_set_results(_kernels, x)
    assert sorted(ours) == sorted(k for k in got.files if k != "isas")
    for name, value in ours.items():
        assert value.tobytes() == got[name].tobytes(), name
