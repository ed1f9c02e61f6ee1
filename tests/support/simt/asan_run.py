"""The kernels' tests under AddressSanitizer, in a process of their own, started early.

``test_simt_asan.py`` runs ``test_simt_kernels.py`` again in a process whose kernels are
built with ``-fsanitize=address`` and which has ASan's runtime preloaded. Most of that
run is compiling the ASan builds (on a fresh cache) and none of it needs the session's
process, so ``tests/runtime_cupy/cuda/conftest.py`` starts it (``start``) as soon as the
session has collected that test: it compiles and runs beside the session's other tests,
and the test only waits for it (``AsanRun.wait``). Whoever starts it, the same run;
``stop`` ends it with the session (an interrupted session leaves no process behind).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from attrs import frozen

from tests.support.simt import loader

ROOT = Path(__file__).resolve().parents[3]
KERNEL_TESTS = ROOT / "tests" / "runtime_cupy" / "cuda" / "test_simt_kernels.py"
#: The longest the run may take (minutes on a loaded 2-core host; a hung run fails).
TIMEOUT_S = 1200

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


@frozen
class AsanRunResult:
    returncode: int
    stdout: str
    stderr: str


class AsanRun:
    """The sub-run, started on construction; its output goes to temporary files."""

    def __init__(self) -> None:
        env = {**loader.asan_environment([str(ROOT)]), "GGUF_PIPELINE_SIMT_ASAN": "1"}
        # the run outlives this call: its files are closed once it is waited for
        self._out = tempfile.TemporaryFile()  # noqa: SIM115
        self._err = tempfile.TemporaryFile()  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ASAN_RUN, str(KERNEL_TESTS)],
            stdout=self._out, stderr=self._err, env=env, cwd=ROOT,
        )  # fmt: skip

    def wait(self) -> AsanRunResult:
        """Its exit status and output, once it ended (``TimeoutExpired`` after
        ``TIMEOUT_S``, the process killed)."""
        try:
            code = self.proc.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        texts = []
        for f in (self._out, self._err):
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
        return AsanRunResult(code, texts[0], texts[1])

    def stop(self) -> None:
        """Kill the run if it is still running; close its files."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._out.close()
        self._err.close()


#: The session's run, once started.
_RUNS: dict[str, AsanRun] = {}


def start() -> AsanRun:
    """The session's ASan run: started now, or the one started before."""
    if "session" not in _RUNS:
        _RUNS["session"] = AsanRun()
    return _RUNS["session"]


def stop() -> None:
    """End the session's ASan run if it is still running."""
    if "session" in _RUNS:
        _RUNS["session"].stop()
