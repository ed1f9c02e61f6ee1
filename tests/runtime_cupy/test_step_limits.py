"""Step limits of a run (the launcher, as ``python -m runtime_cupy`` drives it): a
prompt's step may take as long as its rows allow (``step_row_ms`` each), so a long
prompt finishes where a fixed step limit would have ended it, and a stage busy in it
for longer than the heartbeat bound is not taken for silent; a step past its
row-scaled limit still times out."""

from __future__ import annotations

import pytest

from runplan.config import Timeouts
from runtime_cupy import generate
from tests.support.hosts import FaultyHost
from tests.support.hygiene import run_resources

pytestmark = pytest.mark.process


def test_a_long_prompt_gets_the_time_its_rows_allow_and_a_busy_stage_is_not_silent(
    tiny: str,
) -> None:
    # Stage 1's prefill (200 rows) takes 3 s: longer than the fixed part of a step's limit
    # (1 s: with no per-row part, the run would end with "token 0 not produced in time")
    # and than the heartbeat bound, within what its rows allow (1 s + 200 x 20 ms).
    prompt = [(i % 200) + 3 for i in range(200)]
    timeouts = Timeouts(
        ready_ms=30_000, step_ms=1_000, edge_wait_ms=20_000, stop_ms=15_000,
        step_row_ms=20, heartbeat_ms=1_000,
    )  # fmt: skip
    assert timeouts.step_limit_ms(len(prompt)) == 5_000
    slow = FaultyHost({1: ["step-delay=0:3"]})
    result = generate(tiny, prompt, stages=2, max_tokens=4, timeouts=timeouts, host=slow)
    assert result.outcome == "completed", result.fault
    assert len(result.tokens) == 4
    # The limit still holds: a 3-row prompt's step may take 1.06 s, not 3.
    short = generate(tiny, prompt[:3], stages=2, max_tokens=4, timeouts=timeouts, host=slow)
    assert short.outcome == "faulted"
    assert short.fault is not None and "timeout: token 0 not produced in time" in short.fault
    assert run_resources(short.chain_id) == []
