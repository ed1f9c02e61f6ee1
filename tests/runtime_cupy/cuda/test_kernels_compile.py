"""Every kernel file compiles, with nvcc and with NVRTC, for Hopper (sm_90) and Ampere
(sm_80), with no warning, and the kernels in the PTX are exactly those ``kernels.py``
launches, with the parameter types it passes. What is compiled is each file as CuPy
hands it to NVRTC at run time: one translation unit with our headers inlined
(``kernels.source``).

nvcc is on the CPU hosts and in CI; NVRTC comes with the ``test`` extra (the
``nvidia-cuda-nvrtc`` wheel). Without one of them its tests are skipped, saying so.
Each file is compiled once per architecture and compiler, for all tests of the module:
about 25 s on two cores.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from runtime_cupy.cuda.kernels import (
    COMPILE_OPTIONS,
    HEADERS,
    KERNEL_DIR,
    KERNELS,
    SIGNATURES,
    SOURCES,
    source,
)
from tests.support.nvrtc import Nvrtc, NvrtcError, find_library

#: Minutes, not seconds (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.slow

NVCC = shutil.which("nvcc")
NVRTC_LIB = find_library()
ARCHS = ("sm_90", "sm_80")
COMPILERS = ("nvcc", "nvrtc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH: kernels not compiled")
needs_nvrtc = pytest.mark.skipif(
    NVRTC_LIB is None,
    reason="no NVRTC library (pip install nvidia-cuda-nvrtc): kernels not compiled by NVRTC",
)

#: PTX parameter type of each code of kernels.SIGNATURES.
PTX_TYPES = {"p": ".u64", "l": ".u64", "i": ".u32", "f": ".f32"}


def _compile(cu: str, arch: str, out_dir: Path) -> tuple[str, str, int, str]:
    """Compile the text CuPy hands to NVRTC (``kernels.source``: headers inlined)."""
    assert NVCC is not None
    unit = out_dir / f"{Path(cu).stem}.{arch}.cu"
    unit.write_text(source(cu))
    ptx = out_dir / f"{Path(cu).stem}.{arch}.ptx"
    proc = subprocess.run(
        [NVCC, "--ptx", *COMPILE_OPTIONS, f"-arch={arch}", "-o", str(ptx), str(unit)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    text = ptx.read_text() if proc.returncode == 0 else ""
    return cu, arch, proc.returncode, (proc.stdout + proc.stderr).strip() + "\n" + text


def _compile_nvrtc(nvrtc: Nvrtc, cu: str, arch: str) -> tuple[str, str, int, str]:
    """What CuPy's RawModule does with the file, to PTX for ``compute_XX``."""
    try:
        ptx, log = nvrtc.compile_ptx(source(cu), cu, arch.replace("sm_", "compute_"))
    except NvrtcError as exc:
        return cu, arch, 1, f"{exc}".replace("\n", " | ") + "\n"
    return cu, arch, 0, log.replace("\n", " | ") + "\n" + ptx


def _nvcc_ptx(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, str, int, str]]:
    if NVCC is None:
        pytest.skip("nvcc is not on PATH: kernels not compiled")
    out_dir = tmp_path_factory.mktemp("ptx")
    jobs = [(cu, arch) for cu in SOURCES for arch in ARCHS]
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda job: _compile(job[0], job[1], out_dir), jobs))


def _nvrtc_ptx() -> list[tuple[str, str, int, str]]:
    if NVRTC_LIB is None:
        pytest.skip("no NVRTC library (pip install nvidia-cuda-nvrtc): kernels not compiled")
    nvrtc = Nvrtc(NVRTC_LIB)
    return [_compile_nvrtc(nvrtc, cu, arch) for cu in SOURCES for arch in ARCHS]


@pytest.fixture(scope="module", params=COMPILERS)
def compiled(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[tuple[str, str], str]]:
    """(file, arch) -> PTX text, compiled once per compiler; fails on any error or
    warning."""
    results = _nvcc_ptx(tmp_path_factory) if request.param == "nvcc" else _nvrtc_ptx()
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


@needs_nvrtc
def test_nvrtc_loads() -> None:
    assert NVRTC_LIB is not None
    major, _minor = Nvrtc(NVRTC_LIB).version()
    assert major >= 12, NVRTC_LIB


@needs_nvrtc
def test_nvrtc_reports_a_compile_error() -> None:
    """The NVRTC harness can fail: a kernel with a type error is refused, with a log."""
    assert NVRTC_LIB is not None
    bad = 'extern "C" __global__ void broken(float* x) { x[0] = undefined_name; }'
    with pytest.raises(NvrtcError, match="undefined_name"):
        Nvrtc(NVRTC_LIB).compile_ptx(bad, "broken.cu", "compute_90")


@needs_nvrtc
@pytest.mark.parametrize("std", ["c++11", "c++14", "c++17", "c++20"])
def test_nvrtc_compiles_under_every_language_standard(std: str) -> None:
    """Whatever ``-std`` a CuPy version adds (NVRTC 13 defaults to C++17), the sources
    compile without error or warning."""
    assert NVRTC_LIB is not None
    nvrtc = Nvrtc(NVRTC_LIB)
    for cu in SOURCES:
        _ptx, log = nvrtc.compile_ptx(source(cu), cu, "compute_90", (f"-std={std}",))
        assert not log, (cu, std, log)


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


@pytest.mark.parametrize("arch", ARCHS)
def test_no_kernel_uses_local_memory(compiled: dict[tuple[str, str], str], arch: str) -> None:
    """A register array indexed at run time would spill to local memory (slow)."""
    for cu in SOURCES:
        assert "__local_depot" not in compiled[(cu, arch)], cu


#: A fused multiply-add in PTX (``-ftz=true`` writes ``fma.rn.ftz.f32``).
_FMA = re.compile(r"\bfma\.rn(?:\.ftz)?\.f(?:16|32)\b")


def _fma_per_kernel(ptx: str) -> dict[str, int]:
    entries = ptx.split(".visible .entry ")[1:]
    return {e.split("(", 1)[0]: len(_FMA.findall(e)) for e in entries}


@needs_nvrtc
def test_no_multiply_add_is_fused_but_those_the_source_writes(
    compiled: dict[tuple[str, str], str], request: pytest.FixtureRequest
) -> None:
    """The kernels round where their source rounds: compiled as CuPy is asked to compile
    them (``COMPILE_OPTIONS``), each kernel's PTX holds exactly the fused multiply-adds
    of a compile that fuses none (``--fmad=false``): the source's own ``fmaf`` calls. The
    block decoders' bit-for-bit match with their twins (test_kernels_host.py) and the
    GPU tests' exact comparisons rest on this. NVRTC's default (``--fmad=true``) fuses
    more, as the last assertion shows, so the check can fail."""
    if request.node.callspec.params["compiled"] != "nvrtc":
        pytest.skip("counted on what NVRTC, CuPy's run-time compiler, writes")
    assert NVRTC_LIB is not None
    nvrtc = Nvrtc(NVRTC_LIB)

    def ptx(job: tuple[str, str]) -> str:
        cu, fmad = job
        return nvrtc.compile_ptx(source(cu), cu, "compute_90", (f"--fmad={fmad}",))[0]

    jobs = [(cu, "false") for cu in SOURCES] + [("matvec.cu", "true")]
    with ThreadPoolExecutor(max_workers=2) as pool:
        out = dict(zip(jobs, pool.map(ptx, jobs), strict=True))
    for cu in SOURCES:
        ours = _fma_per_kernel(compiled[(cu, "sm_90")])
        assert ours == _fma_per_kernel(out[(cu, "false")]), cu
    default = _fma_per_kernel(out[("matvec.cu", "true")])
    unfused = _fma_per_kernel(out[("matvec.cu", "false")])
    assert default["matvec_q8_Q4_0"] > unfused["matvec_q8_Q4_0"] == 0
