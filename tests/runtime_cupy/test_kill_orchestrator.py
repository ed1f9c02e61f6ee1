"""The orchestrator's process SIGKILLed mid-run, with shared-memory and with TCP edges:
its stages notice on their own (the control socket and the lifeline close), stop, free
every resource of the run (segments, FIFOs, rendezvous files; the orchestrator's own
token-out edge too), and exit within the stop timeout, also one stuck in a long step.
No listening port outlives its process."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.hygiene import alive, learn_chain_ids, run_resources, wait_gone

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).parents[1] / "support" / "orchestrator_driver.py"
STOP_MS = 2_000
EDGES = pytest.mark.parametrize("edges", ["shm", "tcp"])


class Driver:
    """``orchestrator_driver.py`` in a process of its own, its JSON lines read by a thread."""

    def __init__(
        self,
        model: str,
        faults: dict[int, list[str]],
        log: Path,
        edges: str = "shm",
        step_ms: int = 20_000,
        trace: bool = False,
    ) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
        self.log = log
        self._err = log.open("w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(DRIVER),
                model,
                "3",
                "8",
                json.dumps(faults),
                str(STOP_MS),
                edges,
                str(step_ms),
                *(["trace"] if trace else []),
            ],
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.run_id = ""
        self.chain_id = ""  # names the run's links
        self.pids: list[int] = []

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def until(self, key: str, count: int = 1, timeout_s: float = 30) -> None:
        """Read lines until ``count`` lines with ``key`` were seen."""
        seen = 0
        deadline = time.monotonic() + timeout_s
        while seen < count:
            try:
                item = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no {key!r} from the driver in {timeout_s} s")
            if "run_id" in item:
                self.run_id = item["run_id"]
            if "chain_id" in item:
                self.chain_id = item["chain_id"]
                learn_chain_ids([self.chain_id])
            if "spawned" in item:
                self.pids.append(item["spawned"])
            seen += key in item

    def until_logged(self, text: str, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.log.read_text():
            if time.monotonic() > deadline:
                pytest.fail(f"{text!r} not logged in {timeout_s} s")
            time.sleep(0.01)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self._err.close()


@EDGES
def test_stages_stop_on_their_own_when_the_orchestrator_is_killed_mid_decode(
    tiny: str, tmp_path: Path, edges: str
) -> None:
    # Stage 1 sleeps 60 s in step 2: the orchestrator dies while it is stuck there.
    driver = Driver(tiny, {1: ["step-delay=2:60"]}, tmp_path / "driver.log", edges)
    driver.until("token", 2)
    driver.until_logged("step 2 delayed")  # stage 1 is in its long step
    assert len(driver.pids) == 3 and all(alive(p) for p in driver.pids)
    killed = time.monotonic()
    driver.kill()
    left = wait_gone(driver.pids, STOP_MS / 1000 + 8)
    assert left == [], f"stage processes still running: {left}"
    # Within the stop bound (plus start-up slack), not after the 60 s step.
    assert time.monotonic() - killed < STOP_MS / 1000 + 8
    assert run_resources(driver.chain_id) == []
    log = (tmp_path / "driver.log").read_text()
    # Each stage says once why it stopped, since when and when it last heard the
    # orchestrator; the stuck one left through its watchdog.
    said = [line for line in log.splitlines() if "orchestrator lost" in line]
    assert sorted(int(line.split(", pid ")[1].split(")")[0]) for line in said) == sorted(
        driver.pids
    ), said
    assert all("; since " in line and " heard from it " in line for line in said), said
    assert "not stopped within" in log


def test_a_killed_orchestrator_s_stages_remove_their_trace_folders(
    tiny: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A traced run: each stage writes its trace into a folder the orchestrator made
    (``gguf-pipeline-trace-*``), which it removes once it has read it. SIGKILLed, it
    removes none: the stages wrote their traces there as they stopped, and the folders
    stayed in the temp folder. A stage whose orchestrator is gone removes its own (stage
    1, stuck in a long step, as its watchdog ends it)."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # the driver's and its stages'
    driver = Driver(tiny, {1: ["step-delay=2:60"]}, tmp_path / "driver.log", trace=True)
    driver.until("token", 2)
    driver.until_logged("step 2 delayed")
    assert len(list(temp.glob("gguf-pipeline-trace-*"))) == 3
    driver.kill()
    assert wait_gone(driver.pids, STOP_MS / 1000 + 8) == []
    assert list(temp.glob("gguf-pipeline-trace-*")) == []
    assert run_resources(driver.chain_id) == []
    assert list(temp.iterdir()) == []  # nothing else either


@EDGES
def test_stages_stop_on_their_own_when_the_orchestrator_is_killed_before_ready(
    tiny: str, tmp_path: Path, edges: str
) -> None:
    # Stage 2 takes 60 s to set up: when the orchestrator dies, stage 0 is ready and idle,
    # stage 1 waits for stage 2's ring, stage 2 sleeps in its setup.
    driver = Driver(tiny, {2: ["setup-delay=60"]}, tmp_path / "driver.log", edges)
    driver.until("ready", 1)
    assert len(driver.pids) == 3
    driver.kill()
    left = wait_gone(driver.pids, STOP_MS / 1000 + 8)
    assert left == [], f"stage processes still running: {left}"
    log = (tmp_path / "driver.log").read_text()
    assert run_resources(driver.chain_id) == [], log


@EDGES
@pytest.mark.parametrize("killed", [(1,), (2,), (0, 2), (1, 2)], ids=str)
def test_stages_killed_just_before_their_orchestrator_leave_nothing_behind(
    tiny: str, tmp_path: Path, edges: str, killed: tuple[int, ...]
) -> None:
    """Stages SIGKILLed, then the orchestrator at once (before it frees the chain by
    name): what they made (a stage's inbound ring; token-out, the orchestrator's) was
    left for good where its neighbour did not free it as its outbound link (the last
    stage killed: token-out; stages 1 and 2: token-out and stage 2's). A stage left
    alive frees every hop of the chain on its host."""
    driver = Driver(tiny, {}, tmp_path / "driver.log", edges)
    driver.until("token", 2)
    assert len(driver.pids) == 3
    for index in killed:
        os.kill(driver.pids[index], signal.SIGKILL)
    driver.kill()
    assert wait_gone(driver.pids, STOP_MS / 1000 + 8) == []
    assert run_resources(driver.chain_id) == []
