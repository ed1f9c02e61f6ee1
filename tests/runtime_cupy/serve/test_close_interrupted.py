"""``WarmChain(recover=True).close()`` interrupted (Ctrl-C) while it waits for a stage
that does not answer (SIGSTOPped, a run in flight): it once forgot the chain before it
waited, so the interrupt left the stage processes, their descriptors and the links'
segments for the life of the process, and a second ``close()`` did nothing. Now the
interrupted close stops waiting, kills and reaps the stages and frees the links before
the interrupt goes on."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest

from runplan import SamplingConfig
from runtime_cupy.serve.chain import WarmChain
from tests.support.hygiene import run_resources, wait_gone

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process


def _a_chain_whose_last_stage_is_stopped(
    tiny: str, recover: bool
) -> tuple[WarmChain, list[int], str]:
    """A warm chain of 2 stages whose last one was SIGSTOPped at a run's first token
    (alive and silent: its stop never comes), the run in flight; its stages' pids and
    its chain id."""
    chain = WarmChain(tiny, stages=2, context=64, max_concurrent=1, recover=recover)
    chain.start()
    pids = list(chain.pids())
    stopped = threading.Event()

    def stop_the_last_stage(_token: int) -> None:
        if not stopped.is_set():
            os.kill(pids[1], signal.SIGSTOP)
            stopped.set()

    chain.submit([1, 2], max_tokens=40, sampling=SamplingConfig(), on_token=stop_the_last_stage)
    assert stopped.wait(30)
    return chain, pids, chain.chain_id


@pytest.mark.parametrize("recover", [False, True], ids=["plain", "recover"])
def test_ctrl_c_during_close_still_reaps_the_stages_and_frees_the_links(
    tiny: str, recover: bool
) -> None:
    chain, pids, chain_id = _a_chain_whose_last_stage_is_stopped(tiny, recover)
    ctrl_c = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    try:
        ctrl_c.start()
        with pytest.raises(KeyboardInterrupt):
            chain.close()
        assert wait_gone(pids, 0) == []  # reaped before the interrupt went on
        assert run_resources(chain_id) == []
        chain.close()  # again: nothing left to do
    finally:
        ctrl_c.cancel()
        for pid in wait_gone(pids, 0):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("recover", [False, True], ids=["plain", "recover"])
def test_ctrl_c_again_during_the_interrupted_close_still_reaps_everything(
    tiny: str, recover: bool
) -> None:
    """A second Ctrl-C 1.5 s after the first, while the interrupted close stopped the
    stages: it once escaped the stop part-way (the stage that did not answer waited
    3 s for, never killed; with ``recover=True`` for the life of the process), and the
    chain had forgotten its runner, so a later ``close()`` did nothing. Now no wait
    outlasts the first interrupt, more are held until the stages are reaped, and a
    second ``close()`` has nothing left to do."""
    chain, pids, chain_id = _a_chain_whose_last_stage_is_stopped(tiny, recover)
    timers = [threading.Timer(s, os.kill, (os.getpid(), signal.SIGINT)) for s in (1.0, 2.5)]
    try:
        for timer in timers:
            timer.start()
        with pytest.raises(KeyboardInterrupt):
            chain.close()
        while any(t.is_alive() for t in timers):  # the Ctrl-Cs after it: the user's
            with contextlib.suppress(KeyboardInterrupt):
                time.sleep(0.05)
        chain.close()  # again: nothing left to do
        assert wait_gone(pids, 0) == []
        assert run_resources(chain_id) == []
    finally:
        for timer in timers:
            timer.cancel()
        for pid in wait_gone(pids, 0):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
