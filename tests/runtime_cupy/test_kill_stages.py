"""A stage process SIGKILLed before it is ready, during prefill and during decode, with
shared-memory and with TCP edges: the run faults naming that stage, its node and the
signal; every other stage stops on ``StopRun``; every process is reaped and nothing is
left (no segment, no run folder, no listening port: the conftest checks the last)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from runplan.config import Timeouts
from runtime_cupy import GenerateResult, generate
from tests.support.hosts import FaultyHost, TapHost
from tests.support.hygiene import alive, run_resources

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process

# A generous stop bound: on a loaded machine a stage told to stop while it is still
# starting (importing NumPy) answers only seconds later.
TIMEOUTS = Timeouts(ready_ms=30_000, step_ms=20_000, edge_wait_ms=20_000, stop_ms=15_000)
EDGES = pytest.mark.parametrize("edges", ["shm", "tcp"])


class Killer:
    """Kills one stage process with SIGKILL once its log shows ``line``, or (``line``
    None) as soon as it was started."""

    def __init__(self, stage: int, log_dir: Path, line: str | None) -> None:
        self.stage = stage
        self.log = log_dir / f"stage-{stage}.log"
        self.line = line
        self.pids: dict[int, int] = {}
        self.killed_at: float | None = None
        self._thread: threading.Thread | None = None

    def on_event(self, kind: str, fields: dict[str, object]) -> None:
        if kind != "spawned":
            return
        index, pid = int(str(fields["stage_index"])), int(str(fields["pid"]))
        self.pids[index] = pid
        if index == self.stage:
            if self.line is None:
                self._kill(pid)
            else:
                self._thread = threading.Thread(target=self._watch, args=(pid,), daemon=True)
                self._thread.start()

    def _watch(self, pid: int) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.log.exists() and self.line in self.log.read_text():  # type: ignore[operator]
                self._kill(pid)
                return
            time.sleep(0.01)

    def _kill(self, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)
        self.killed_at = time.monotonic()


def _assert_faulted_and_clean(result: GenerateResult, stage: int, killer: Killer) -> None:
    assert killer.killed_at is not None, "the stage was never killed"
    assert result.outcome == "faulted"
    node = result.plan.stages[stage].node_id
    assert result.fault_stage == stage and result.fault_node == node
    assert result.fault is not None
    assert f"stage {stage} (node {node})" in result.fault
    assert "process_died" in result.fault and "killed by SIGKILL" in result.fault
    codes = {s.stage_index: s.returncode for s in result.stages}
    assert codes[stage] == -signal.SIGKILL
    assert all(codes[i] == 0 for i in codes if i != stage), codes  # stopped on StopRun
    assert not [s.pid for s in result.stages if alive(s.pid)]
    assert run_resources(result.chain_id) == []


@EDGES
def test_kill_a_stage_before_it_is_ready(tiny: str, tmp_path: Path, edges: str) -> None:
    # The last stage would take 60 s to set up; it dies as soon as it is started.
    killer = Killer(2, tmp_path, None)
    began = time.monotonic()
    result = generate(
        tiny,
        [1, 2, 3],
        stages=3,
        max_tokens=8,
        timeouts=TIMEOUTS,
        host=FaultyHost({2: ["setup-delay=60"]}, log_dir=tmp_path),
        edges=edges,
        on_event=killer.on_event,
    )
    assert result.tokens == ()  # nothing was injected: the barrier never passed
    assert result.ttft_us is None and result.load_s is None
    assert time.monotonic() - began < 40  # not the 60 s setup
    assert set(result.media) == {edges}
    _assert_faulted_and_clean(result, 2, killer)


@EDGES
def test_kill_a_stage_during_prefill(tiny: str, tmp_path: Path, edges: str) -> None:
    killer = Killer(1, tmp_path, "step 0 begins")
    result = generate(
        tiny,
        [1, 2, 3],
        stages=3,
        max_tokens=8,
        timeouts=TIMEOUTS,
        host=FaultyHost({1: ["step-delay=0:30"]}, log_dir=tmp_path),
        edges=edges,
        on_event=killer.on_event,
    )
    assert result.tokens == ()
    assert result.load_s is not None  # the barrier passed, the prompt went in
    _assert_faulted_and_clean(result, 1, killer)


@EDGES
def test_kill_a_stage_during_decode(tiny: str, tmp_path: Path, edges: str) -> None:
    killer = Killer(0, tmp_path, "step 3 begins")
    result = generate(
        tiny,
        [1, 2, 3],
        stages=3,
        max_tokens=8,
        timeouts=TIMEOUTS,
        host=FaultyHost({0: ["step-delay=3:30"]}, log_dir=tmp_path),
        edges=edges,
        on_event=killer.on_event,
    )
    assert len(result.tokens) == 3  # sequences 0, 1, 2 came back; 3 never did
    _assert_faulted_and_clean(result, 0, killer)


def test_a_killed_stage_is_the_fault_though_its_neighbours_link_broke_first(
    tiny: str, tmp_path: Path
) -> None:
    """Stage 0 killed during decode on TCP edges, its control channel's close reaching
    the runner 3 s late (a tap holds it): stage 1's report of its inbound link reset
    comes first, and the fault is still stage 0's death (it was stage 1's edge_fault
    whenever the report won the race, about one run in twelve without the tap)."""
    killer = Killer(0, tmp_path, "step 3 begins")
    host = TapHost(log_dir=tmp_path, faults={0: ["step-delay=3:30"]}, eof_delay_s=3.0)
    result = generate(
        tiny,
        [1, 2, 3],
        stages=3,
        max_tokens=8,
        timeouts=TIMEOUTS,
        host=host,
        edges="tcp",
        on_event=killer.on_event,
    )
    _assert_faulted_and_clean(result, 0, killer)
