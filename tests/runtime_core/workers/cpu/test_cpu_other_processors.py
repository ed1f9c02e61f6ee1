"""The CPU worker on processors this machine is not: the same interpreter and built
kernels run under QEMU's user-mode emulator (``qemu-x86_64 -cpu MODEL``, Debian's
``qemu-user``; its TCG runs AVX2 since 7.2, never AVX-512), which answers CPUID as that
processor does and stops the process on an instruction the processor lacks.

On a Westmere (no AVX at all, so any AVX instruction on the way stops the process) the
kernels find only the portable set, on a Haswell (AVX2, no AVX-512) the portable and
AVX2 sets; on each, the worker takes
the best, runs every weight type's tiny llama model to llama.cpp's recorded greedy
tokens (an independent reading, ``tests/fixtures/llamacpp/tiny.json``) and gives the
logits' bits this machine's worker gives forced onto that set: the choice at run time
picks what the processor has, and no instruction of a set it lacks runs on the way
(kernels, repacking, activations' quantizer, the pool).

NumPy's OpenBLAS picks its kernels by CPUID too, and under TCG 7.2 its Sandy Bridge
ones stop on an illegal instruction: the emulated interpreters take its generic x86-64
kernels (``OPENBLAS_CORETYPE=Prescott``). (Sandy Bridge, AVX without AVX2, F16C or
FMA, once stood here for the oldest processor, on the belief that NumPy would not run
on the Westmere model: it does, with QEMU 7.2 and NumPy 2, and a Sandy Bridge runs an
AVX instruction that a processor without AVX would stop on; ``make other-cpus`` runs
both.)
Skipped without ``qemu-x86_64`` 7.2 or later (minutes: an emulated interpreter runs the
models some 20 to 50 times slower).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.llamacpp_fixtures import load_doc
from tests.support.isa_greedy import greedy_runs
from tests.support.numpy_vectors import environment

ROOT = Path(__file__).resolve().parents[4]
QEMU = shutil.which("qemu-x86_64")

#: one tiny llama model of every weight type the worker reads, each its own kernels
MODELS = [
    f"tiny-llama-{t}"
    for t in (
        "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
        "Q6_K", "IQ4_NL", "IQ4_XS",
    )
] + ["tiny-llama-moe-Q4_K"]  # fmt: skip

#: QEMU's processor model -> the sets the kernels should find on it
PROCESSORS = {"Westmere": ["portable"], "Haswell-noTSX": ["portable", "avx2"]}


def qemu_problem() -> str | None:
    """Why this machine cannot emulate the processors, or None."""
    if platform.machine() != "x86_64":
        return f"this machine is {platform.machine()}, not x86-64"
    if QEMU is None:
        return "qemu-x86_64 (Debian's qemu-user) is not installed"
    version = subprocess.run([QEMU, "--version"], capture_output=True, text=True, check=False)
    found = re.search(r"version (\d+)\.(\d+)", version.stdout)
    if found is None or (int(found[1]), int(found[2])) < (7, 2):
        return f"qemu-x86_64 runs AVX2 from 7.2 on: {version.stdout.strip()[:80]!r}"
    return None


QEMU_PROBLEM = qemu_problem()
needs_qemu = pytest.mark.skipif(QEMU_PROBLEM is not None, reason=str(QEMU_PROBLEM))


def greedy_child(
    models: list[str], env: dict[str, str], prefix: tuple[str, ...] = (), isa: str | None = None
) -> dict[str, Any]:
    """``tests.support.isa_greedy``'s runs of ``models`` in another interpreter (behind
    ``prefix``: an emulator), with ``env``."""
    forced = ("--isa", isa) if isa else ()
    proc = subprocess.run(
        [*prefix, sys.executable, "-m", "tests.support.isa_greedy", *forced, *models],
        cwd=ROOT, env=dict(env, PYTHONPATH=str(ROOT / "src")), capture_output=True, text=True,
        timeout=1800, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, f"{prefix}: exit {proc.returncode}: {proc.stderr[-3000:]}"
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def emulated(cpu: str) -> dict[str, Any]:
    """The greedy runs of MODELS in an interpreter on QEMU's ``cpu``."""
    assert QEMU is not None
    return greedy_child(MODELS, dict(os.environ, OPENBLAS_CORETYPE="Prescott"), (QEMU, "-cpu", cpu))


@pytest.mark.slow
@needs_qemu
@pytest.mark.parametrize("cpu", list(PROCESSORS))
def test_the_worker_takes_the_sets_the_processor_has_and_gives_their_bits(
    cpu: str, tmp_path: Path
) -> None:
    expected_isas = PROCESSORS[cpu]
    there = emulated(cpu)
    assert there["isas"] == expected_isas
    assert there["chosen"] == expected_isas[-1]
    greedy = {m["name"]: m["greedy"] for m in load_doc("tiny")["models"]}
    here = greedy_runs(MODELS, expected_isas[-1], tmp_path)["runs"]
    for name in MODELS:
        assert there["runs"][name]["tokens"] == greedy[name][: len(there["runs"][name]["tokens"])]
        assert len(there["runs"][name]["tokens"]) == load_doc("tiny")["greedy_tokens"]
        assert there["runs"][name] == here[name], name


def test_numpys_vector_code_changes_no_bit_of_the_worker() -> None:
    """What the emulated Sandy Bridge found, on this machine: the worker's host side
    (a mixture's routing, its shared expert's gate) runs on NumPy, whose own vector code
    (AVX2, AVX-512) gives other bits than its baseline; with it turned off the worker's
    logits must not move (``runtime_core.ieee_math``)."""
    models = ["tiny-llama-moe-Q4_K", "tiny-qwen2moe-Q8_0", "tiny-llama-Q4_K"]
    isa = "portable"  # the kernels' set held fixed: only NumPy's code changes
    with_vectors = greedy_child(models, environment(baseline=False), isa=isa)
    without = greedy_child(models, environment(baseline=True), isa=isa)
    assert with_vectors["runs"] == without["runs"]
