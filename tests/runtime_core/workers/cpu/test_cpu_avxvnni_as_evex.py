"""The AVX-VNNI set's code on this machine, where the processor has AVX-512's VNNI but
not AVX-VNNI (AMD Zen 4, Intel's servers since Ice Lake): the kernels built with
``-DGPP_AVXVNNI_AS_EVEX`` (``csrc/dot_avxvnni.c``: the set's own source, its
``vpdpbusd`` in AVX-512 VL's EVEX encoding instead of the VEX one, the same operation)
offer ``avxvnni`` here, and the tests that take the sets as parameters run in a child
interpreter on that build: every weight type's products at every row count, repacked
and stored, give the portable set's bits, and the worker's tiny models the same logits
on every set. Only the instruction's encoding is left to a processor with AVX-VNNI
(QEMU's TCG emulates none). In ``make test``: a build at -O1 (some 15 s) and the set's
646 test cases; ``make avxvnni-as-evex`` (``GGUF_PIPELINE_AVXVNNI_ALL=1``): an -O2 build
and every case of those tests, the other sets' too (some 4000).

Skipped where the processor has no AVX-512 VNNI (nothing to stand in) or runs AVX-VNNI
itself, where there is no C compiler, and in the sanitized builds (``make sanitize-*``:
their runtime is preloaded into the interpreter, and the set's code is the same in
both builds).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from runtime_core.workers.cpu import _kernels

ROOT = Path(__file__).resolve().parents[4]
CSRC = ROOT / "src" / "runtime_core" / "workers" / "cpu" / "csrc"
CC = shlex.split(os.environ.get("CC", "cc")) or ["cc"]
#: make avxvnni-as-evex: an optimized build, and every case of TESTS
ALL = os.environ.get("GGUF_PIPELINE_AVXVNNI_ALL") == "1"
#: the tests that take the sets as parameters (tests/support/cpu_isas.py)
TESTS = tuple(f"tests/runtime_core/workers/cpu/test_cpu_{name}.py" for name in
              ("kernels", "repack", "worker", "batch_invariance", "arch_kernels"))  # fmt: skip

pytestmark = [
    pytest.mark.skipif("avx512" not in _kernels.isas(),
                       reason=f"no AVX-512 VNNI to stand in for AVX-VNNI ({_kernels.isas()})"),
    pytest.mark.skipif("avxvnni" in _kernels.isas(),
                       reason="this processor runs the avxvnni set itself"),
    pytest.mark.skipif(shutil.which(CC[0]) is None, reason=f"no C compiler {CC[0]}"),
    pytest.mark.skipif(bool(_kernels.POISON), reason="a sanitized build of the kernels"),
]  # fmt: skip


def build(tree: Path) -> Path:
    """runtime_core's Python files linked under ``tree``, the kernels built into it with
    ``-DGPP_AVXVNNI_AS_EVEX`` (setup.py's flags; -O1, or -O2 for ``ALL``)."""
    skip = shutil.ignore_patterns("_kernels*.so", "__pycache__", "csrc")
    shutil.copytree(ROOT / "src" / "runtime_core", tree / "runtime_core", ignore=skip,
                    copy_function=os.symlink)  # fmt: skip
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    out = tree / "runtime_core" / "workers" / "cpu" / f"_kernels{suffix}"
    done = subprocess.run(
        [*CC, "-shared", "-fPIC", "-std=gnu11", "-pthread", "-fwrapv", "-O2" if ALL else "-O1",
         "-ffp-contract=off", "-fno-math-errno", "-DGPP_AVXVNNI_AS_EVEX",
         f"-I{sysconfig.get_paths()['include']}", *map(str, sorted(CSRC.glob("*.c"))), "-lm",
         "-o", str(out)],
        check=False, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def in_child(tree: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT)])}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, check=False, timeout=600)  # fmt: skip


def test_the_avxvnni_sets_kernels_give_the_portable_sets_bits(tmp_path: Path) -> None:
    built = build(tmp_path)
    shown = in_child(tmp_path, "-c", "from runtime_core.workers.cpu import _kernels as k; "
                     "print(k.__file__, k.AVXVNNI_AS_EVEX, ','.join(k.isas()))")  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    file, as_evex, isas = shown.stdout.split()
    assert (Path(file), as_evex) == (built, "1")  # the child runs this build
    assert "avxvnni" in isas.split(",")
    chosen = () if ALL else ("-k", "avxvnni")
    done = in_child(
        tmp_path, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", *chosen, *TESTS
    )
    tail = done.stdout[-3000:]
    assert done.returncode == 0, tail
    assert "does not run avxvnni" not in done.stdout, tail  # none of the set's cases skipped
    counts = tail.strip().splitlines()[-1]
    assert int(counts.split(" passed")[0].split()[-1]) >= 600, counts
