"""Every CUDA kernel's source on the SIMT emulator under AddressSanitizer, in ``make test``.

``test_simt_kernels.py`` (every kernel against its twin at the worker's launch shapes,
in two thread orders, the same bits in both; and a check that every kernel ran) runs
again in a process of its own, the kernels built with ``-fsanitize=address``
(``GGUF_PIPELINE_SIMT_ASAN=1``) and ASan's runtime preloaded: an access outside a
shared array (each one an allocation of its own in the emulator) or outside the memory
of an array a kernel is given stops that process with ASan's report, naming the source
line, and this test fails showing it. The ASan builds are cached like the others
(``loader.cache_dir``). ``make simt-asan`` runs this and the emulated worker's tests
(the tiny models of every type) under ASan too: minutes more.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.simt import loader

#: Half a minute of CPU without ASan on the development host; ASan's checks add a few
#: times that.
pytestmark = pytest.mark.slow

if shutil.which(loader.CXX) is None or loader.asan_runtime() is None:
    pytest.skip(f"{loader.CXX} with libasan.so is needed for ASan builds", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[3]
KERNEL_TESTS = Path(__file__).with_name("test_simt_kernels.py")

#: The sub-run: it checks that it is one (ASan's runtime in the process, ASan builds
#: asked for) before it runs the kernels' tests.
ASAN_RUN = """
import sys
import pytest
from tests.support.simt.loader import asan_runtime_loaded
from tests.support.simt.project_kernels import asan_requested
if not (asan_runtime_loaded() and asan_requested()):
    sys.exit("not an ASan run: the runtime is not loaded or GGUF_PIPELINE_SIMT_ASAN is not 1")
sys.exit(pytest.main(["-q", "--capture=sys", "-p", "no:cacheprovider", sys.argv[1]]))
"""


def test_every_kernel_against_its_twin_under_address_sanitizer() -> None:
    env = {**loader.asan_environment([str(ROOT)]), "GGUF_PIPELINE_SIMT_ASAN": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", ASAN_RUN, str(KERNEL_TESTS)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200, check=False,
    )  # fmt: skip
    report = f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    if "AddressSanitizer" in proc.stderr or proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}\n{report}", pytrace=False)
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.search(r"\b\d+ passed\b", summary), report
    assert not re.search(r"skipped|deselected|xfail|error", summary), summary
