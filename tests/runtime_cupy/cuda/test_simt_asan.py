"""Every CUDA kernel's source on the SIMT emulator under AddressSanitizer, in ``make test``.

``test_simt_kernels.py`` (every kernel against its twin at the worker's launch shapes,
and a check that every kernel ran) runs again in a process of its own
(``tests/support/simt/asan_run.py``, started when the session has collected this test),
in one thread order (the race check, the same bits in two orders, is that file's own
run; ASan adds what no order shows: an access outside memory), the kernels built with
``-fsanitize=address`` (``GGUF_PIPELINE_SIMT_ASAN=1``) and ASan's runtime preloaded: an
access outside a shared array (each one an allocation of its own in the emulator) or
outside the memory of an array a kernel is given stops that process with ASan's report,
naming the source line, and this test fails showing it. The ASan builds are cached like the others
(``loader.cache_dir``). ``make simt-asan`` runs this and the emulated worker's tests
(the tiny models of every type) under ASan too: minutes more.
"""

from __future__ import annotations

import re
import shutil

import pytest

from tests.support.simt import asan_run, loader

#: About 35 CPU-seconds with a fresh cache (20 of them the ASan builds), 10 with a warm
#: one (measured under load on the 2-core development host).
pytestmark = pytest.mark.slow

if shutil.which(loader.CXX) is None or loader.asan_runtime() is None:
    pytest.skip(f"{loader.CXX} with libasan.so is needed for ASan builds", allow_module_level=True)


def test_every_kernel_against_its_twin_under_address_sanitizer() -> None:
    run = asan_run.start().wait()
    report = f"{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
    if "AddressSanitizer" in run.stderr or run.returncode != 0:
        pytest.fail(f"exit {run.returncode}\n{report}", pytrace=False)
    summary = run.stdout.strip().splitlines()[-1]
    assert re.search(r"\b\d+ passed\b", summary), report
    assert not re.search(r"skipped|deselected|xfail|error", summary), summary
