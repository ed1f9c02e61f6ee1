"""A signal to the command's whole process group, as a terminal's Ctrl-C or
``kill -- -PGID`` sends it: the run ends ``cancelled`` (130, 143) with no traceback and
no stage process left. Each local stage runs in a process group of its own: before, a
Ctrl-C while the stages imported printed a KeyboardInterrupt traceback from each, and a
group SIGTERM mid-run raced the orchestrator's cancel (3 runs of 6 ended faulted, exit
1). Timing decides which of those a run would have met; the outcome here is the same
for every timing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.gguf_models import ModelShape, write_model
from tests.support.hygiene import wait_gone

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]
#: Tokens a run asks for: with the tiny model's context of 256 a run of 250 could end
#: within the 1.5 s the test waits on a quiet host, and a signal after its end is too
#: late to cancel it (it exits 0; it once killed it, -15, as the interpreter exited).
MAX_TOKENS = 4000


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The 4-block random-weight llama with room for MAX_TOKENS: a run that is still
    running when the signal comes (a few ms a token)."""
    shape = ModelShape(n_layers=4, context_length=MAX_TOKENS + 96)
    return str(write_model(tmp_path_factory.mktemp("signals") / "long.gguf", shape))


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
    return found


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
@pytest.mark.parametrize("when", ["importing", "running"])
def test_a_signal_to_the_process_group_cancels_the_run_cleanly(
    long_tiny: str, tmp_path: Path, sig: signal.Signals, code: int, when: str
) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    err = tmp_path / "err.txt"
    with err.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "runtime_cupy", "--model", long_tiny, "--worker", "cpu",
             "--stages", "2", "--prompt-ids", "1,2,3", "--max-tokens", str(MAX_TOKENS)],
            stdout=subprocess.DEVNULL, stderr=stderr, env=env, start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            stages: list[int] = []
            while len(stages) < 2 and time.monotonic() < deadline and proc.poll() is None:
                stages = _children(proc.pid)
                time.sleep(0.005)
            assert len(stages) == 2, f"the stages did not start: {err.read_text()}"
            if when == "running":  # their first steps: the run has begun
                time.sleep(1.5)
            os.killpg(proc.pid, sig)
            rc = proc.wait(60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    text = err.read_text()
    assert rc == code, (rc, text)
    assert "cancelled" in text, text
    assert "Traceback" not in text and "faulted" not in text, text
    assert not wait_gone(stages, 30), "a stage process outlived the command"
