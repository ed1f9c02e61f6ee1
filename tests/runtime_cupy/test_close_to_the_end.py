"""A chain's close goes to its end whatever breaks into it: a user who presses Ctrl-C
again and again while an interrupted run is torn down (a stage that does not answer:
SIGSTOPped) once had the first of them escape ``ChainRunner.close`` after it had marked
itself closed, before the kill: the retry returned at once, and the stage process and
its descriptors stayed for the life of the process. Now the close stops waiting at the
first interrupt (the stages killed at once), does each of its steps once to its end,
and raises the first interrupt after; one broken off by an error is finished by the next
``close``."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

import runtime_cupy
from runplan import RunPlan, SamplingConfig
from runplan.config import Timeouts
from runtime_cupy.api import plan_for
from runtime_cupy.process import chain_close
from runtime_cupy.process.chain_runner import ChainRunner
from tests.support.hygiene import run_resources, wait_gone

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process


def _children() -> list[int]:
    """This process's child processes."""
    me, out = os.getpid(), []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{pid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == me:
                    out.append(int(pid))
    return sorted(out)


@contextlib.contextmanager
def _killed_after(pids: list[int]) -> Iterator[None]:
    try:
        yield
    finally:
        for pid in wait_gone(pids, 0):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_ctrl_c_pressed_again_and_again_during_the_teardown_leaves_no_stage(tiny: str) -> None:
    # Ctrl-C at 0.5 s (the run), 1.5 s (the wait for the stages' stops) and 2.5 s (the
    # wait for the stages to exit, which the third once escaped: no kill, no reap).
    stages: list[int] = []
    timers: list[threading.Timer] = []

    def on_token(_token: int) -> None:
        if not stages:
            stages.extend(_children())
            os.kill(stages[-1], signal.SIGSTOP)  # alive and silent
            for k in range(3):
                timer = threading.Timer(0.5 + k, os.kill, (os.getpid(), signal.SIGINT))
                timer.start()
                timers.append(timer)

    with _killed_after(stages):
        try:
            with pytest.raises(KeyboardInterrupt):
                runtime_cupy.generate(tiny, [1, 2], stages=2, max_tokens=200, on_token=on_token)
        finally:
            while any(t.is_alive() for t in timers):  # the Ctrl-Cs after the teardown
                with contextlib.suppress(KeyboardInterrupt):
                    time.sleep(0.05)
        assert len(stages) == 2
        assert wait_gone(stages, 0) == []


def _plan(tiny: str) -> RunPlan:
    bound_ms = 20_000
    timeouts = Timeouts(ready_ms=bound_ms, step_ms=bound_ms, edge_wait_ms=bound_ms, stop_ms=5_000)
    plan, _ = plan_for(
        tiny,
        stages=2,
        prompt_len=2,
        max_tokens=4,
        sampling=SamplingConfig(),
        return_logits=False,
        timeouts=timeouts,
    )
    return plan


def test_interrupts_in_the_close_still_kill_reap_and_free_and_the_first_goes_on(
    tiny: str,
) -> None:
    runner = ChainRunner(_plan(tiny))
    runner.start()
    handles = runner.handles()
    pids = [h.info().pid for h in handles]
    with _killed_after(pids):
        os.kill(pids[1], signal.SIGSTOP)  # it will not exit when its channel closes
        real_wait = handles[1].wait
        waits: list[float] = []

        def wait(timeout_s: float) -> bool:
            waits.append(timeout_s)
            if len(waits) <= 2:  # the exit grace, then the reap after the kill
                raise KeyboardInterrupt(f"Ctrl-C {len(waits)}")
            return real_wait(timeout_s)

        handles[1].wait = wait  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt, match="Ctrl-C 1"):
            runner.close()
        assert runner.closed and len(waits) == 3  # the grace cut short: killed at once
        assert wait_gone(pids, 0) == []
        assert run_resources(runner.chain_id) == []


def test_a_close_broken_off_is_finished_by_the_next(
    tiny: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chain_close, "EXIT_GRACE_S", 0.3)
    runner = ChainRunner(_plan(tiny))
    runner.start()
    handles = runner.handles()
    pids = [h.info().pid for h in handles]
    with _killed_after(pids):
        os.kill(pids[1], signal.SIGSTOP)
        real_kill = handles[1].kill
        kills: list[str] = []

        def kill() -> None:
            kills.append("kill")
            if len(kills) == 1:
                raise RuntimeError("the kill broke")
            real_kill()

        handles[1].kill = kill  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="the kill broke"):
            runner.close()
        assert not runner.closed
        assert wait_gone(pids[1:], 0) == pids[1:]  # left: the next close reaps it
        runner.close()
        assert runner.closed and kills == ["kill", "kill"]
        assert wait_gone(pids, 0) == []
        assert run_resources(runner.chain_id) == []
        runner.close()  # again: nothing left to do
        assert kills == ["kill", "kill"]
