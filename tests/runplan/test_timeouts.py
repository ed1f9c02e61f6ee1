"""The timeouts of a run: a step's limit grows with its rows, and the planner refuses
timeouts no run can have, naming the field (``invalid_config``)."""

from __future__ import annotations

import attrs
import pytest

from runplan import RunPlan, plan_run
from runplan.config import Timeouts, batch_runs, shared_batches
from runplan.fsm import orchestrator as ofsm
from runplan.fsm import stage as sfsm
from runplan.provision import provision_all
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


def test_a_step_that_shares_its_batches_has_the_limit_of_shared_batches() -> None:
    t = Timeouts(step_ms=1_000, step_row_ms=20)
    assert t.batch_step_limit_ms(3, 0, 5) == t.step_limit_ms(3)  # a run alone: its rows
    assert t.batch_step_limit_ms(3, 64, 3) == 3 * t.step_limit_ms(64)
    assert t.batch_step_limit_ms(100, 64, 5) == 5 * t.step_limit_ms(100)
    # a prompt in 4 chunks of 16 rows through 2 stages: 5 steps, each of its batch
    assert t.token_limit_ms(2, 4, 16, 0, 3) == 5 * t.step_limit_ms(16)
    assert t.token_limit_ms(2, 4, 16, 64, 3) == 5 * 3 * t.step_limit_ms(64)
    assert t.token_limit_ms(2, 1, 1, 64, 6) == 2 * 6 * t.step_limit_ms(64)


def test_shared_batches_count_the_next_stage_s_batches_that_take_a_batch_s_outputs() -> None:
    """A step waits through a batch it was left out of, and the next stage takes its
    batch's outputs over ``ceil(runs / slots)`` of its batches."""
    assert shared_batches(1, 2) == 3
    assert shared_batches(2, 2) == 3
    assert shared_batches(3, 2) == 4
    assert shared_batches(8, 2) == 6  # the overrun issue 22's report names
    assert shared_batches(8, 8) == 3
    with pytest.raises(ValueError, match="ring_slots 0"):
        shared_batches(2, 0)
    # the most runs of a batch: the rows (a row at least each), this run and what the
    # rest of the budget holds of the smallest cache (a position on each block)
    assert batch_runs(16, 100, 800, 1) == 8
    assert batch_runs(4, 100, 800, 1) == 4
    assert batch_runs(16, 100, 50, 1) == 1
    assert batch_runs(16, 0, 800, 1) == 16
    assert batch_runs(128, 100, 800, 10) == 1 + 70  # runs of 10 bytes beside one of 100
    assert batch_runs(128, 95, 800, 10) == 1 + 70  # at least ceil(95 / 10) bytes each
    assert batch_runs(16, 100, 800, 10) == 16


def test_a_long_run_shares_its_batches_with_the_short_runs_its_budget_leaves_room_for() -> None:
    """A run of 32 positions on stages whose budget holds two such caches: one more of
    its size, or 32 of one position beside it, each a batch's run."""
    assert batch_runs(512, 32 * 256, 64 * 256, 32) == 33
    assert shared_batches(batch_runs(512, 32 * 256, 64 * 256, 32), 2) == 2 + 17


@pytest.mark.parametrize("runs", [1, 4])
def test_a_stage_and_the_orchestrator_time_a_step_by_the_batches_it_may_share(runs: int) -> None:
    """The stage machine's STEP timer and the orchestrator machine's TOKEN timer of a
    decoded token: a record's own rows for a run alone, else ``shared_batches`` batches
    of ``max_batch_rows`` rows a step (the stage's KV budget holds other runs): 8 runs
    a batch at most (its rows; shorter runs may fill the budget beside full-length
    ones), their outputs over 4 of the next stage's batches (2-slot rings)."""
    facts, config, pool = small_plan_inputs(2)
    config = attrs.evolve(config, max_concurrent_runs=runs, max_batch_rows=8)
    plan = plan_run(facts, config, pool, stage_count=2)
    assert isinstance(plan, RunPlan), plan
    t = plan.timeouts
    provisions = provision_all(plan)
    assert {p.batch_rows for p in provisions} == {0 if runs == 1 else 8}
    stage = sfsm.StageMachine.new(provisions[0].node_id, plan.orchestrator_node_id)
    stage, _ = sfsm.step(stage, sfsm.Received(plan.orchestrator_node_id, provisions[0]))
    for part in sfsm.SetupPart:
        stage, _ = sfsm.step(stage, sfsm.SetupDone(part))
    assert stage.state is sfsm.State.READY
    edge = provisions[0].inbound.edge_id
    loaded = sfsm.ObjectLoaded(plan.run_id, edge, 0, 0, 1, rows=2)
    _, actions = sfsm.step(stage, loaded)
    step_ms = [a.ms for a in actions if isinstance(a, sfsm.StartTimer)]
    alone = runs == 1
    assert config.ring_slot_count == 2
    assert {p.shared_batches for p in provisions} == {3 if alone else 6}
    assert step_ms == [t.step_limit_ms(2) if alone else 6 * t.step_limit_ms(8)]
    machine = ofsm.OrchestratorMachine.for_plan(plan, (1, 2))
    decode = t.step_limit_ms(1) if alone else 6 * t.step_limit_ms(8)
    assert machine._token_ms(1) == 2 * decode


@pytest.mark.parametrize("runs", [1, 4])
def test_the_orchestrator_times_a_teardown_by_the_batches_a_stage_may_finish_first(
    runs: int,
) -> None:
    """The orchestrator machine's STOP timer: a stage reads ``StopRun`` after the worker
    call in progress and may begin one more before it releases the run, so the bound is
    ``stop_ms`` and ``STOP_BATCHES`` steps of the run's longest record (a run alone) or
    batches of ``max_batch_rows`` rows (its stages hold other runs too)."""
    facts, config, pool = small_plan_inputs(2)
    config = attrs.evolve(config, max_concurrent_runs=runs, max_batch_rows=8)
    plan = plan_run(facts, config, pool, stage_count=2)
    assert isinstance(plan, RunPlan), plan
    t = plan.timeouts
    assert t.step_ms > 0 and t.stop_ms > 0
    machine = ofsm.OrchestratorMachine.for_plan(plan, (1, 2, 3))
    machine, _ = ofsm.step(machine, ofsm.Start())
    _, actions = ofsm.step(machine, ofsm.Cancel("the client went away"))
    stop = [a.ms for a in actions if isinstance(a, ofsm.StartTimer) and a.timer is ofsm.Timer.STOP]
    rows = 3 if runs == 1 else 8  # the prompt's record, or a batch of 8 rows
    assert stop == [t.stop_ms + t.STOP_BATCHES * t.step_limit_ms(rows)]
    assert stop[0] > t.stop_ms + t.step_limit_ms(rows)  # two worker calls, not one
