"""Every (state, event kind) pair of both machines: ``step`` never raises, lands in a
state the table names, a pair missing from the table is a typed protocol violation on
the machine's fault path, and a rejection changes nothing."""

from __future__ import annotations

import itertools
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runplan import RunPlan, provision_all
from runplan.fsm import orchestrator as o
from runplan.fsm import stage as s
from runplan.messages import StageReady, StageStopped, StopReason, StopRun
from tests.support.strategies import (
    ORCHESTRATOR,
    orchestrator_event_strategies,
    small_plan,
    stage_event_strategies,
)

PLANS = {n: small_plan(n) for n in (1, 2, 3)}


def _feed(machine: Any, step: Any, *events: Any) -> Any:
    for event in events:
        machine, _ = step(machine, event)
    return machine


def orchestrator_in(state: o.State, plan: RunPlan) -> o.OrchestratorMachine:
    """An orchestrator brought to ``state`` by real events."""
    m = o.OrchestratorMachine.for_plan(plan, (1, 2, 3))
    if state is o.State.PLANNED:
        return m
    m = _feed(m, o.step, o.Start())
    if state is o.State.WAITING_READY:
        return m
    ready = [
        o.Received(st_.node_id, StageReady(plan.run_id, st_.stage_index, st_.node_id))
        for st_ in plan.stages
    ]
    m = _feed(m, o.step, o.EndpointsReady(), *ready)
    if state is o.State.RUNNING:
        return m
    m = _feed(m, o.step, o.Cancel())
    if state is o.State.TEARING_DOWN:
        return m
    stopped = [
        o.Received(st_.node_id, StageStopped(plan.run_id, st_.stage_index, st_.node_id))
        for st_ in plan.stages
    ]
    return _feed(m, o.step, *stopped)


def stage_in(state: s.State, plan: RunPlan, index: int) -> s.StageMachine:
    """Stage ``index`` brought to ``state`` by real events."""
    provision = provision_all(plan)[index]
    m = s.StageMachine.new(provision.node_id, ORCHESTRATOR)
    if state is s.State.UNPROVISIONED:
        return m
    m = _feed(m, s.step, s.Received(ORCHESTRATOR, provision))
    if state is s.State.PREPARING:
        return m
    m = _feed(m, s.step, *(s.SetupDone(p) for p in s.SetupPart))
    if state is s.State.READY:
        return m
    if state is s.State.EXECUTING:
        return _feed(m, s.step, s.ObjectLoaded(plan.run_id, provision.inbound.edge_id, 0))
    if state is s.State.FAULTED:
        return _feed(m, s.step, s.EdgeFault(provision.inbound.edge_id, "closed"))
    m = _feed(m, s.step, s.Received(ORCHESTRATOR, StopRun(plan.run_id, StopReason.COMPLETED)))
    if state is s.State.STOPPING:
        return m
    return _feed(m, s.step, s.Released())


def test_machines_reach_the_states_they_are_built_for() -> None:
    for plan in PLANS.values():
        for state in o.State:
            assert orchestrator_in(state, plan).state is state
        for state, i in itertools.product(s.State, range(plan.stage_count)):
            assert stage_in(state, plan, i).state is state


@pytest.mark.parametrize(("state", "kind"), list(itertools.product(o.State, o.EventKind)))
@settings(max_examples=25)
@given(data=st.data())
def test_every_orchestrator_pair(state: o.State, kind: o.EventKind, data: st.DataObject) -> None:
    plan = PLANS[data.draw(st.sampled_from(sorted(PLANS)))]
    machine = orchestrator_in(state, plan)
    event = data.draw(orchestrator_event_strategies(plan)[kind])
    assert o.event_kind(event) is kind
    new, actions = o.step(machine, event)
    assert isinstance(new, o.OrchestratorMachine) and isinstance(actions, tuple)
    transition = o.TABLE.get((state, kind))
    if transition is not None:
        assert new.state in transition.targets
    else:
        assert any(isinstance(a, o.ProtocolViolation) for a in actions)
        if state in (o.State.WAITING_READY, o.State.RUNNING):
            assert new.state in (o.State.TEARING_DOWN, o.State.DONE)
            assert new.outcome is StopReason.FAULTED
        else:
            assert new == machine
    if any(isinstance(a, o.Rejected) for a in actions):
        assert new == machine
    # Once decided, the outcome never changes.
    if machine.outcome is not None:
        assert new.outcome is machine.outcome


@pytest.mark.parametrize(("state", "kind"), list(itertools.product(s.State, s.EventKind)))
@settings(max_examples=25)
@given(data=st.data())
def test_every_stage_pair(state: s.State, kind: s.EventKind, data: st.DataObject) -> None:
    plan = PLANS[data.draw(st.sampled_from(sorted(PLANS)))]
    index = data.draw(st.integers(0, plan.stage_count - 1))
    machine = stage_in(state, plan, index)
    event = data.draw(stage_event_strategies(plan)[kind])
    assert s.event_kind(event) is kind
    new, actions = s.step(machine, event)
    assert isinstance(new, s.StageMachine) and isinstance(actions, tuple)
    transition = s.TABLE.get((state, kind))
    if transition is not None:
        assert new.state in transition.targets
    else:
        assert any(isinstance(a, s.ProtocolViolation) for a in actions)
        if state in (s.State.PREPARING, s.State.READY, s.State.EXECUTING):
            assert new.state is s.State.FAULTED
            assert any(
                isinstance(a, s.SendToOrchestrator) and type(a.message).__name__ == "StageFault"
                for a in actions
            )
        else:
            assert new == machine
    if any(isinstance(a, s.Reject) for a in actions):
        assert new == machine  # a rejection changes nothing


def test_tables_name_only_states_and_kinds_of_their_machine() -> None:
    for table, states, kinds in (
        (o.TABLE, o.State, o.EventKind),
        (s.TABLE, s.State, s.EventKind),
    ):
        for (state, kind), transition in table.items():
            assert state in states and kind in kinds
            assert transition.targets and all(t in states for t in transition.targets)


def test_the_only_terminal_orchestrator_state_is_done() -> None:
    leaving = {st_ for (st_, _), t in o.TABLE.items() if any(x is not st_ for x in t.targets)}
    assert set(o.State) - leaving == {o.State.DONE}


def test_stage_fault_messages_name_the_stage() -> None:
    plan = PLANS[3]
    m = stage_in(s.State.READY, plan, 1)
    _, actions = s.step(m, s.EdgeFault(99, "closed"))
    (send,) = [a for a in actions if isinstance(a, s.SendToOrchestrator)]
    assert attrs.asdict(send.message, recurse=False)["stage_index"] == 1
    assert send.message.node_id == plan.stages[1].node_id
