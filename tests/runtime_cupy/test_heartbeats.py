"""Heartbeats of a run (the launcher, as ``python -m runtime_cupy`` drives it): a
stage stopped by SIGSTOP mid-decode (alive, silent) faults the run as
``stage_silent``, naming the stage, its node and its silence, within the heartbeat
bound and not at the token timer (here 40 s away); it is killed, the others stop,
nothing is left. Until it was stopped, the stage slept in a long step without falling
silent: its heartbeats come from a thread of their own. (``test_step_limits.py``: a
stage busy past the bound in a long prefill is not silent either.) Nor is a stage whose
orchestrator did not run for a while: its beats of that time are heard first.

The test synchronises on the run's events (a stage spawned, a token consumed), not on
sleeps.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import pytest

from runplan.config import Timeouts
from runtime_cupy import generate
from tests.support.hosts import FaultyHost
from tests.support.hygiene import alive, run_resources
from tests.support.servers import wait_for

pytestmark = pytest.mark.process

HEARTBEAT_MS = 2_000
# The token timer of a decode step is 2 x 20 s: far past the heartbeat bound.
TIMEOUTS = Timeouts(
    ready_ms=30_000, step_ms=20_000, edge_wait_ms=20_000, stop_ms=15_000,
    heartbeat_ms=HEARTBEAT_MS,
)  # fmt: skip


class Pids:
    def __init__(self) -> None:
        self.by_stage: dict[int, int] = {}

    def on_event(self, kind: str, fields: dict[str, Any]) -> None:
        if kind == "spawned":
            self.by_stage[int(fields["stage_index"])] = int(fields["pid"])


def test_a_stage_stopped_mid_decode_is_named_silent_within_the_bound(tiny: str) -> None:
    pids = Pids()
    tokens: list[int] = []
    stopped: list[int] = []

    def on_token(token: int) -> None:
        tokens.append(token)
        if len(tokens) == 2:  # decode runs: stage 1 is in (or about to enter) step 2
            os.kill(pids.by_stage[1], signal.SIGSTOP)
            stopped.append(pids.by_stage[1])

    result = generate(
        tiny,
        [1, 2, 3],
        stages=2,
        max_tokens=40,
        timeouts=TIMEOUTS,
        # Stage 1 sleeps in step 2, as a long step would: busy, not silent, until stopped.
        host=FaultyHost({1: ["step-delay=2:30"]}),
        on_event=pids.on_event,
        on_token=on_token,
    )
    assert stopped, "the run never reached decode"
    assert result.outcome == "faulted"
    assert result.fault_stage == 1 and result.fault_node == "stage-1"
    assert result.fault is not None
    assert "stage 1 (node stage-1): stage_silent: stage 1 on 'stage-1': no heartbeat for" in (
        result.fault
    ), result.fault
    assert "timeout" not in result.fault  # named by its silence, not by a timer
    codes = {s.stage_index: s.returncode for s in result.stages}
    assert codes == {0: 0, 1: -signal.SIGKILL}, codes  # the silent one killed, stage 0 stopped
    assert not [s.pid for s in result.stages if alive(s.pid)]
    assert run_resources(result.chain_id) == []


def test_a_pause_of_the_orchestrator_is_not_a_stages_silence(tiny: str) -> None:
    """The orchestrator's process does not run for three bounds (stopped, swapped out;
    here a callback that sleeps as it reads the first ``StageReady``): the stages' beats
    of that time wait in its channels and are heard before any stage is called silent,
    and the run completes (every stage was killed as silent, the run faulted)."""
    bound_ms = 500
    paused: list[str] = []

    def on_event(kind: str, fields: dict[str, Any]) -> None:
        if kind == "received" and not paused:
            paused.append(str(fields["sender"]))
            time.sleep(3 * bound_ms / 1000.0)

    timeouts = Timeouts(ready_ms=30_000, step_ms=20_000, edge_wait_ms=20_000,
                        stop_ms=15_000, heartbeat_ms=bound_ms)  # fmt: skip
    result = generate(tiny, [1, 2, 3], stages=2, max_tokens=4, timeouts=timeouts,
                      on_event=on_event)  # fmt: skip
    assert paused, "no frame was received"
    assert result.outcome == "completed", result.fault
    assert all(s.returncode == 0 for s in result.stages), result.stages
    assert run_resources(result.chain_id) == []


def _continue(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # (killed meanwhile: a failed test)
        os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("stage_0", ["prompt", "late"])
def test_a_stage_stopped_before_its_first_word_is_killed_when_the_run_is_not_ready(
    tiny: str, tmp_path: Path, stage_0: str
) -> None:
    """Stopped the moment it is spawned (before it beats once), stage 1 holds no step:
    when the run's ready timer (4 s) runs out, a stage that has not said a word is
    taken for silent and killed, so the run's teardown does not wait out the stop bound
    (here 15 + 2 x 20 s) for it: the run ends in seconds, where it took a minute. The
    fault names that stage (it blamed the orchestrator: "stages [1] not ready in time").

    The run (and its ready timer) starts once both stages are spawned; the test holds
    it there until stage 0 is about to beat (its log says it started): a stage 0 slow to
    start (a loaded host; ``late``: held stopped past the ready bound) had not said a
    word either when the timer ran out, and was the fault named."""
    stopped: list[int] = []
    silent: list[int] = []
    began: list[float] = []
    log = tmp_path / "stage-0.log"
    ready_ms = 4_000

    def on_event(kind: str, fields: dict[str, Any]) -> None:
        if kind == "stage_silent":
            silent.append(int(fields["stage_index"]))
        if kind != "spawned":
            return
        index, pid = int(fields["stage_index"]), int(fields["pid"])
        if index == 0 and stage_0 == "late":
            os.kill(pid, signal.SIGSTOP)
            threading.Timer(2 * ready_ms / 1000, _continue, (pid,)).start()
        if index == 1:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
            wait_for(lambda: log.exists() and "started (run" in log.read_text(), 60,
                     "stage 0 to start")  # fmt: skip
            began.append(time.monotonic())

    result = generate(
        tiny,
        [1, 2, 3],
        stages=2,
        max_tokens=4,
        timeouts=attrs.evolve(TIMEOUTS, ready_ms=ready_ms),
        host=FaultyHost({}, log_dir=tmp_path),
        on_event=on_event,
    )
    assert stopped, "stage 1 was never spawned"
    took = time.monotonic() - began[0]
    assert result.outcome == "faulted" and result.fault_stage == 1, result.fault
    assert "stage_silent: stage 1 on 'stage-1': not a word since it" in str(result.fault)
    assert silent == [1]  # the stage that never spoke, killed when the ready timer ran out
    assert took < 40, f"the run took {took:.1f} s: it waited out the stop bound"
    codes = {s.stage_index: s.returncode for s in result.stages}
    assert codes[1] == -signal.SIGKILL, codes
    assert not [s.pid for s in result.stages if alive(s.pid)]
    assert run_resources(result.chain_id) == []
