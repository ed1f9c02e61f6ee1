"""A host that brings stages their slices of the model (``hosts.port.MovesSlices``) is
waited for before the stages are provisioned, so no readiness bound runs while slices
travel; a cancel during that wait ends the run at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from runplan import SamplingConfig
from runplan.config import Timeouts
from runtime_cupy.api import plan_for
from runtime_cupy.process.launcher import ProcessRun
from tests.support.hosts import FaultyHost

pytestmark = pytest.mark.process

#: The readiness bound covers what is left after the wait: the bind, and the end of a
#: stage process's start on a loaded host (1.2 s measured at load 10 on 2 cores, where a
#: process takes 5-6 s from its start to ready); the slices travel longer than the bound,
#: so a bound that ran while they travel would fault the run.
TIMEOUTS = Timeouts(ready_ms=5_000, step_ms=20_000, edge_wait_ms=20_000, stop_ms=5_000)
TRAVEL_S = 8.0


class SlowSlices(FaultyHost):
    """Local stages whose slices take ``TRAVEL_S`` to come (as a slice server's would)."""

    def __init__(self) -> None:
        super().__init__({})
        self.waited: list[float] = []

    def wait_for_slices(self, cancelled: Callable[[], bool]) -> None:
        began = time.monotonic()
        while time.monotonic() - began < TRAVEL_S and not cancelled():
            time.sleep(0.05)
        self.waited.append(time.monotonic() - began)


def _run(tiny: str, host: SlowSlices) -> ProcessRun:
    plan, devices = plan_for(
        tiny, stages=2, prompt_len=2, max_tokens=2, sampling=SamplingConfig(),
        return_logits=False, timeouts=TIMEOUTS,
    )  # fmt: skip
    return ProcessRun(plan, [1, 2], worker="cpu", devices=devices, host=host)


def test_stages_are_provisioned_once_their_slices_came(tiny: str) -> None:
    host = SlowSlices()
    result = _run(tiny, host).run()
    assert host.waited and host.waited[0] >= TRAVEL_S
    assert result.finished is not None and result.finished.outcome.name == "COMPLETED"
    assert result.ready_s is not None and result.ready_s - result.started_s >= TRAVEL_S


def test_a_cancel_while_slices_travel_ends_the_run_at_once(tiny: str) -> None:
    host = SlowSlices()
    run = _run(tiny, host)
    threading.Timer(0.5, run.cancel).start()
    result = run.run()
    assert host.waited and host.waited[0] < TRAVEL_S
    assert result.finished is not None and result.finished.outcome.name == "CANCELLED"
    assert result.tokens == ()
