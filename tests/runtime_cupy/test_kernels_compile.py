"""Every kernel file compiles with nvcc for Hopper (sm_90) and Ampere (sm_80), with no
warning, and the kernels in the PTX are exactly those ``kernels.py`` launches, with the
parameter types it passes. What is compiled is each file as CuPy hands it to NVRTC at
run time: one translation unit with our headers inlined (``kernels.source``).

nvcc is on the CPU hosts and in CI; without it these tests are skipped, saying so.
Each file is compiled once per architecture (two at a time), for all tests of the
module: about 15 s on two cores.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from runtime_cupy.kernels import HEADERS, KERNEL_DIR, KERNELS, SIGNATURES, SOURCES, source

NVCC = shutil.which("nvcc")
ARCHS = ("sm_90", "sm_80")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH: kernels not compiled")

#: PTX parameter type of each code of kernels.SIGNATURES.
PTX_TYPES = {"p": ".u64", "l": ".u64", "i": ".u32", "f": ".f32"}


def _compile(cu: str, arch: str, out_dir: Path) -> tuple[str, str, int, str]:
    """Compile the text CuPy hands to NVRTC (``kernels.source``: headers inlined)."""
    assert NVCC is not None
    unit = out_dir / f"{Path(cu).stem}.{arch}.cu"
    unit.write_text(source(cu))
    ptx = out_dir / f"{Path(cu).stem}.{arch}.ptx"
    proc = subprocess.run(
        [NVCC, "--ptx", f"-arch={arch}", "-o", str(ptx), str(unit)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    text = ptx.read_text() if proc.returncode == 0 else ""
    return cu, arch, proc.returncode, (proc.stdout + proc.stderr).strip() + "\n" + text


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str], str]]:
    """(file, arch) -> PTX text, compiled once; fails on any error or warning."""
    if NVCC is None:
        pytest.skip("nvcc is not on PATH: kernels not compiled")
    out_dir = tmp_path_factory.mktemp("ptx")
    jobs = [(cu, arch) for cu in SOURCES for arch in ARCHS]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda job: _compile(job[0], job[1], out_dir), jobs))
    ptx: dict[tuple[str, str], str] = {}
    failures = []
    for cu, arch, rc, text in results:
        log, _, body = text.partition("\n")
        if rc != 0 or log:
            failures.append(f"{cu} ({arch}): exit {rc}\n{log}")
        ptx[(cu, arch)] = body
    assert not failures, "\n\n".join(failures)
    yield ptx


@needs_nvcc
def test_nvcc_runs() -> None:
    assert NVCC is not None
    proc = subprocess.run([NVCC, "--version"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "Cuda compilation tools" in proc.stdout


def test_every_kernel_file_is_listed() -> None:
    on_disk = {p.name for p in KERNEL_DIR.glob("*.cu")}
    assert on_disk == set(SOURCES)
    assert {p.name for p in KERNEL_DIR.glob("*.cuh")} == set(HEADERS)


def test_sources_are_one_translation_unit_each() -> None:
    for cu in SOURCES:
        text = source(cu)
        assert '#include "' not in text, cu  # every header inlined
        assert "#include <" not in text, cu  # and no system header (NVRTC has none)
        assert text.count("// ---- common.cuh ----") == 1, cu


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cu", SOURCES)
def test_compiles_and_exports_the_launched_kernels(
    compiled: dict[tuple[str, str], str], cu: str, arch: str
) -> None:
    ptx = compiled[(cu, arch)]
    entries = dict(re.findall(r"\.visible \.entry (\w+)\(\s*(.*?)\)", ptx, flags=re.DOTALL))
    assert set(entries) == set(KERNELS[cu]), cu
    for name, params in entries.items():
        types = re.findall(r"\.param (\.\w+)", params)
        expected = [PTX_TYPES[c] for c in SIGNATURES[name].split()]
        assert types == expected, (name, types, expected)


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_no_kernel_uses_local_memory(compiled: dict[tuple[str, str], str], arch: str) -> None:
    """A register array indexed at run time would spill to local memory (slow)."""
    for cu in SOURCES:
        assert "__local_depot" not in compiled[(cu, arch)], cu
