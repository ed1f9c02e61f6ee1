"""The timeouts of a run: a step's limit grows with its rows, and the planner refuses
timeouts no run can have, naming the field (``invalid_config``)."""

from __future__ import annotations

import attrs
import pytest

from runplan import RunPlan, plan_run
from runplan.config import Timeouts
from runplan.rejections import InvalidConfig
from runplan.validate import MIN_HEARTBEAT_MS
from tests.support.strategies import small_plan_inputs


def test_a_steps_limit_is_its_fixed_part_plus_a_budget_per_row() -> None:
    t = Timeouts(step_ms=1_000, step_row_ms=20)
    assert [t.step_limit_ms(rows) for rows in (1, 200, 8192)] == [1_020, 5_000, 164_840]
    assert Timeouts(step_row_ms=0).step_limit_ms(8192) == Timeouts().step_ms


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"heartbeat_ms": MIN_HEARTBEAT_MS - 1}, "timeouts.heartbeat_ms"),
        ({"heartbeat_ms": 0}, "timeouts.heartbeat_ms"),
        ({"heartbeat_ms": 2**32}, "timeouts.heartbeat_ms"),
        ({"step_row_ms": -1}, "timeouts.step_row_ms"),
        ({"step_row_ms": 2**32}, "timeouts.step_row_ms"),
        ({"step_ms": 0}, "timeouts.step_ms"),
    ],
)
def test_timeouts_no_run_can_have_are_refused_naming_the_field(
    changes: dict[str, int], field: str
) -> None:
    facts, config, pool = small_plan_inputs(2)
    timeouts = attrs.evolve(config.timeouts, **changes)
    result = plan_run(facts, attrs.evolve(config, timeouts=timeouts), pool, stage_count=2)
    assert isinstance(result, InvalidConfig), result
    assert result.field == field and result.value == str(next(iter(changes.values())))


def test_the_smallest_heartbeat_and_no_budget_per_row_plan() -> None:
    facts, config, pool = small_plan_inputs(2)
    timeouts = Timeouts(heartbeat_ms=MIN_HEARTBEAT_MS, step_row_ms=0)
    result = plan_run(facts, attrs.evolve(config, timeouts=timeouts), pool, stage_count=2)
    assert isinstance(result, RunPlan), result
