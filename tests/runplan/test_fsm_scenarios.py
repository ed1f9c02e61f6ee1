"""Scripted runs of the two state machines: the paths a reader should see first."""

from __future__ import annotations

from typing import Any

import attrs

from runplan import provision_all
from runplan.fsm import orchestrator as o
from runplan.fsm import stage as s
from runplan.messages import (
    FaultKind,
    FaultReason,
    ProvisionRefused,
    StageFault,
    StageReady,
    StageStopped,
    StopReason,
    StopRun,
)
from tests.support.strategies import ORCHESTRATOR, small_plan


def _of(actions: tuple[Any, ...], cls: type) -> list[Any]:
    return [a for a in actions if isinstance(a, cls)]


def _ready_stage(plan: Any, index: int) -> s.StageMachine:
    msg = provision_all(plan)[index]
    m, actions = s.step(
        s.StageMachine.new(msg.node_id, ORCHESTRATOR), s.Received(ORCHESTRATOR, msg)
    )
    assert m.state is s.State.PREPARING and _of(actions, s.BeginSetup)
    for part in s.SetupPart:
        m, actions = s.step(m, s.SetupDone(part))
    assert m.state is s.State.READY
    assert _of(actions, s.SendToOrchestrator)[0].message == StageReady(
        plan.run_id, index, msg.node_id
    )
    return m


def _running(plan: Any, prompt: tuple[int, ...] = (3, 4)) -> o.OrchestratorMachine:
    m, actions = o.step(o.OrchestratorMachine.for_plan(plan, prompt), o.Start())
    assert len(_of(actions, o.SendProvision)) == plan.stage_count
    m, actions = o.step(m, o.EndpointsReady())
    assert not _of(actions, o.InjectTokens)  # the barrier holds until every stage is ready
    for st_ in plan.stages:
        m, actions = o.step(
            m, o.Received(st_.node_id, StageReady(plan.run_id, st_.stage_index, st_.node_id))
        )
    assert m.state is o.State.RUNNING
    assert _of(actions, o.InjectTokens) == [o.InjectTokens(0, prompt)]
    return m


def test_a_two_stage_run_to_eos() -> None:
    plan = small_plan(2, max_tokens=10, eos=0)
    orch = _running(plan)
    stages = [_ready_stage(plan, 0), _ready_stage(plan, 1)]
    edges = [p.inbound.edge_id for p in provision_all(plan)]
    delivered = []
    for sequence, token in enumerate([5, 6, 0]):
        for i in (0, 1):
            stages[i], actions = s.step(stages[i], s.ObjectLoaded(plan.run_id, edges[i], sequence))
            assert _of(actions, s.ExecuteStep) == [s.ExecuteStep(sequence)]
            stages[i], actions = s.step(stages[i], s.StepCompleted(sequence))
            assert _of(actions, s.ReleaseInput) == [s.ReleaseInput(sequence)]
        orch, actions = o.step(orch, o.TokenConsumed(sequence, token))
        delivered += [a.token_id for a in _of(actions, o.DeliverToken)]
        if token != 0:
            assert _of(actions, o.InjectTokens) == [o.InjectTokens(sequence + 1, (token,))]
    assert orch.state is o.State.TEARING_DOWN and orch.outcome is StopReason.COMPLETED
    assert delivered == [5, 6]  # EOS is not delivered
    stops = _of(actions, o.SendStopRun)
    assert [a.stage_index for a in stops] == [0, 1]
    for i in (0, 1):
        stages[i], actions = s.step(stages[i], s.Received(ORCHESTRATOR, stops[i].message))
        assert stages[i].state is s.State.STOPPING and _of(actions, s.ReleaseRun)
        stages[i], actions = s.step(stages[i], s.Released())
        assert stages[i].state is s.State.STOPPED
        (sent,) = _of(actions, s.SendToOrchestrator)
        orch, finished = o.step(orch, o.Received(sent.message.node_id, sent.message))
    assert orch.state is o.State.DONE
    assert _of(finished, o.RunFinished) == [
        o.RunFinished(StopReason.COMPLETED, (5, 6), None, None, ())
    ]


def test_max_tokens_completes_the_run() -> None:
    plan = small_plan(1, max_tokens=2, eos=0)
    orch = _running(plan)
    orch, actions = o.step(orch, o.TokenConsumed(0, 3))
    assert _of(actions, o.InjectTokens)
    orch, actions = o.step(orch, o.TokenConsumed(1, 4))
    assert not _of(actions, o.InjectTokens)
    assert orch.outcome is StopReason.COMPLETED and orch.tokens == (3, 4)


def test_a_ready_timeout_faults_and_stops_every_provisioned_stage() -> None:
    plan = small_plan(3)
    m, _ = o.step(o.OrchestratorMachine.for_plan(plan, (1,)), o.Start())
    m, actions = o.step(m, o.TimerFired(o.Timer.READY))
    assert m.outcome is StopReason.FAULTED and m.fault.kind is FaultKind.TIMEOUT
    assert [a.stage_index for a in _of(actions, o.SendStopRun)] == [0, 1, 2]
    assert not _of(actions, o.InjectTokens)


def test_the_first_fault_stands_and_injection_stops() -> None:
    plan = small_plan(2)
    orch = _running(plan)
    fault = StageFault(
        plan.run_id, 1, plan.stages[1].node_id, reason=FaultReason(FaultKind.STEP_FAILURE, "boom")
    )
    orch, _ = o.step(orch, o.Received(plan.stages[1].node_id, fault))
    assert orch.outcome is StopReason.FAULTED and orch.fault_stage == 1
    orch, actions = o.step(orch, o.TokenConsumed(0, 3))  # late token
    assert actions == () and orch.outcome is StopReason.FAULTED
    orch, actions = o.step(orch, o.StageDied(0, "gone"))  # late death
    assert orch.fault.kind is FaultKind.STEP_FAILURE
    orch, actions = o.step(
        orch,
        o.Received(plan.stages[1].node_id, StageStopped(plan.run_id, 1, plan.stages[1].node_id)),
    )
    assert orch.state is o.State.DONE  # stage 0 died, stage 1 stopped
    (done,) = _of(actions, o.RunFinished)
    assert done.outcome is StopReason.FAULTED and done.unconfirmed_stages == ()


def test_a_token_out_of_sequence_faults_the_run() -> None:
    orch = _running(small_plan(1))
    orch, _ = o.step(orch, o.TokenConsumed(1, 3))
    assert orch.fault.kind is FaultKind.SEQUENCE_VIOLATION


def test_cancel_is_its_own_outcome() -> None:
    orch = _running(small_plan(2))
    orch, actions = o.step(orch, o.Cancel("ctrl-c"))
    assert orch.outcome is StopReason.CANCELLED
    assert {a.message.reason for a in _of(actions, o.SendStopRun)} == {StopReason.CANCELLED}


def test_stop_timeout_finishes_with_the_stages_that_did_not_confirm() -> None:
    plan = small_plan(2)
    orch, _ = o.step(_running(plan), o.Cancel())
    orch, actions = o.step(orch, o.TimerFired(o.Timer.STOP))
    assert _of(actions, o.RunFinished)[0].unconfirmed_stages == (0, 1)


def test_stop_run_while_executing_releases_and_late_results_are_ignored() -> None:
    plan = small_plan(1)
    stage = _ready_stage(plan, 0)
    edge = provision_all(plan)[0].inbound.edge_id
    stage, _ = s.step(stage, s.ObjectLoaded(plan.run_id, edge, 0))
    stage, actions = s.step(
        stage, s.Received(ORCHESTRATOR, StopRun(plan.run_id, StopReason.CANCELLED))
    )
    assert stage.state is s.State.STOPPING
    assert _of(actions, s.ReleaseInput) == [s.ReleaseInput(0)] and _of(actions, s.ReleaseRun)
    stage, actions = s.step(stage, s.StepCompleted(0))
    assert stage.state is s.State.STOPPING and actions == ()


def test_a_stopped_run_is_stale_and_a_new_run_is_accepted() -> None:
    plan = small_plan(1)
    stage = _ready_stage(plan, 0)
    stage, _ = s.step(stage, s.Received(ORCHESTRATOR, StopRun(plan.run_id, StopReason.COMPLETED)))
    stage, _ = s.step(stage, s.Released())
    again = provision_all(plan)[0]
    same, actions = s.step(stage, s.Received(ORCHESTRATOR, again))
    assert same == stage and _of(actions, s.Reject)[0].reason is s.RejectReason.STALE_RUN
    fresh = provision_all(small_plan(1, run_id="run-2"))[0]
    stage, _ = s.step(stage, s.Received(ORCHESTRATOR, fresh))
    assert stage.state is s.State.PREPARING and stage.run_id == "run-2"


def test_losing_the_orchestrator_stops_the_stage_on_its_own() -> None:
    plan = small_plan(1)
    stage, actions = s.step(_ready_stage(plan, 0), s.OrchestratorLost())
    assert stage.state is s.State.STOPPING and _of(actions, s.ReleaseRun)


def test_a_prompt_the_run_cannot_take_is_refused_before_anything_starts() -> None:
    import pytest

    plan = small_plan(1, max_tokens=4, vocab=8)
    for prompt in ((), (8,), (-1,), (1,) * 62, (1.0,)):
        with pytest.raises(o.PromptError):
            o.OrchestratorMachine.for_plan(plan, prompt)  # type: ignore[arg-type]
    o.OrchestratorMachine.for_plan(plan, (1,) * 61)  # 61 + 4 - 1 = 64 positions: fits


# -- several runs on one chain (CONCURRENT_RUNS.md): the rows this adds ----------------


def test_a_prefill_in_chunks_runs_chunk_by_chunk_and_completes_sequence_0_after_the_last() -> None:
    plan = small_plan(2)
    m = _ready_stage(plan, 1)
    edge = provision_all(plan)[1].inbound.edge_id
    for j in range(3):
        m, actions = s.step(m, s.ObjectLoaded(plan.run_id, edge, 0, j, 3))
        assert _of(actions, s.ExecuteStep) == [s.ExecuteStep(0, j, 3)]
        m, actions = s.step(m, s.StepCompleted(0, j))
        assert m.state is s.State.READY and _of(actions, s.ReleaseInput)
        assert (m.next_sequence, m.next_chunk) == ((0, j + 1) if j < 2 else (1, 0))
    m, actions = s.step(m, s.ObjectLoaded(plan.run_id, edge, 1))  # then the decode steps
    assert _of(actions, s.ExecuteStep) == [s.ExecuteStep(1)]


def test_a_chunk_out_of_order_is_a_sequence_violation() -> None:
    plan = small_plan(2)
    edge = provision_all(plan)[1].inbound.edge_id
    run = plan.run_id
    cases = [  # (chunks of 3 done first, the record that breaks the order)
        (0, s.ObjectLoaded(run, edge, 0, 1, 3)),  # chunk 1 before chunk 0
        (1, s.ObjectLoaded(run, edge, 1)),  # sequence 1 before the prefill's last chunk
        (1, s.ObjectLoaded(run, edge, 0, 1, 4)),  # another count than chunk 0 gave
        (1, s.ObjectLoaded(run, edge, 0, 0, 3)),  # chunk 0 again
        (3, s.ObjectLoaded(run, edge, 1, 0, 2)),  # a decode step in chunks
    ]
    for done, bad in cases:
        m = _ready_stage(plan, 1)
        for j in range(done):
            m, _ = s.step(m, s.ObjectLoaded(run, edge, 0, j, 3))
            m, _ = s.step(m, s.StepCompleted(0, j))
        m, actions = s.step(m, bad)
        assert m.state is s.State.FAULTED, bad
        (fault,) = _of(actions, s.SendToOrchestrator)
        assert fault.message.reason.kind is FaultKind.SEQUENCE_VIOLATION


def test_a_stage_without_room_for_the_run_s_cache_refuses_the_provision_and_keeps_nothing() -> None:
    plan = small_plan(2)
    msg = provision_all(plan)[1]
    m, _ = s.step(s.StageMachine.new(msg.node_id, ORCHESTRATOR), s.Received(ORCHESTRATOR, msg))
    m, _ = s.step(m, s.SetupDone(s.SetupPart.WORKER))
    m, actions = s.step(m, s.CacheUnavailable(1000, 200, 800))
    assert m.state is s.State.UNPROVISIONED and m.provision is None
    assert plan.run_id not in m.stale_runs  # the same provision may come again
    assert _of(actions, s.CancelTimer) == [s.CancelTimer(s.Timer.SETUP)]
    (refused,) = _of(actions, s.SendToOrchestrator)
    assert refused.message == ProvisionRefused(plan.run_id, 1, msg.node_id, 1000, 200, 800)
    m, actions = s.step(m, s.Received(ORCHESTRATOR, msg))
    assert m.state is s.State.PREPARING


def test_a_chain_fault_faults_the_run_with_its_reason() -> None:
    plan = small_plan(2)
    reason = FaultReason(FaultKind.EDGE_FAULT, "inbound link: the edge is closed")
    m = _ready_stage(plan, 0)
    m, actions = s.step(m, s.ChainFault(reason))
    assert m.state is s.State.FAULTED
    (fault,) = _of(actions, s.SendToOrchestrator)
    assert fault.message == StageFault(plan.run_id, 0, plan.stages[0].node_id, reason)
    m, actions = s.step(m, s.ChainFault(reason))  # once faulted, nothing more
    assert actions == ()


def test_a_refused_provision_faults_the_run_and_the_refusing_stage_is_not_waited_for() -> None:
    plan = small_plan(3)
    m, _ = o.step(o.OrchestratorMachine.for_plan(plan, (3, 4)), o.Start())
    m, _ = o.step(m, o.EndpointsReady())
    node = plan.stages[1].node_id
    m, actions = o.step(m, o.Received(node, ProvisionRefused(plan.run_id, 1, node, 10, 2, 8)))
    assert m.state is o.State.TEARING_DOWN and m.outcome is StopReason.FAULTED
    assert m.fault is not None and m.fault.kind is FaultKind.KV_CACHE_UNAVAILABLE
    assert "needs 10 bytes, 2 of 8 free (more than its whole budget" in m.fault.detail
    assert [a.stage_index for a in _of(actions, o.SendStopRun)] == [0, 2]
    for i in (0, 2):
        st_ = plan.stages[i]
        m, actions = o.step(m, o.Received(st_.node_id, StageStopped(plan.run_id, i, st_.node_id)))
    assert m.state is o.State.DONE
    assert _of(actions, o.RunFinished)[0].unconfirmed_stages == ()


def test_a_refusal_after_the_run_was_torn_down_ends_the_wait_for_that_stage() -> None:
    plan = small_plan(2)
    m, _ = o.step(o.OrchestratorMachine.for_plan(plan, (3, 4)), o.Start())
    m, _ = o.step(m, o.Cancel())
    st0 = plan.stages[0]
    m, _ = o.step(m, o.Received(st0.node_id, StageStopped(plan.run_id, 0, st0.node_id)))
    assert m.state is o.State.TEARING_DOWN  # stage 1's answer to StopRun is awaited
    st1 = plan.stages[1]
    refusal = ProvisionRefused(plan.run_id, 1, st1.node_id, 10, 0, 20)
    m, _ = o.step(m, o.Received(st1.node_id, refusal))  # it crossed the StopRun
    assert m.state is o.State.DONE and m.outcome is StopReason.CANCELLED


def test_a_prompt_in_chunks_has_the_time_of_every_chunk_through_the_pipeline() -> None:
    plan = attrs.evolve(small_plan(2), prefill_chunk=2)
    prompt = (3, 4, 5, 1, 2)  # 3 chunks
    m, _ = o.step(o.OrchestratorMachine.for_plan(plan, prompt), o.Start())
    m, _ = o.step(m, o.EndpointsReady())
    for st_ in plan.stages:
        m, actions = o.step(
            m, o.Received(st_.node_id, StageReady(plan.run_id, st_.stage_index, st_.node_id))
        )
    assert _of(actions, o.InjectTokens) == [o.InjectTokens(0, prompt, 2)]
    step_ms = plan.timeouts.step_limit_ms(2)  # each step of the prompt: a chunk of 2 rows
    assert o.StartTimer(o.Timer.TOKEN, step_ms * (2 + 3 - 1)) in actions
    m, actions = o.step(m, o.TokenConsumed(0, 5))
    decode_ms = plan.timeouts.step_limit_ms(1)
    assert o.StartTimer(o.Timer.TOKEN, decode_ms * 2) in actions  # a decode token: a step a stage


def test_a_steps_time_limit_grows_with_its_rows() -> None:
    plan = small_plan(2, max_tokens=10, eos=0)
    t = plan.timeouts
    assert t.step_limit_ms(6) == t.step_ms + 6 * t.step_row_ms > t.step_limit_ms(1)
    prompt = (1, 2, 3, 4, 5, 6)
    m, _ = o.step(o.OrchestratorMachine.for_plan(plan, prompt), o.Start())
    m, _ = o.step(m, o.EndpointsReady())
    for st_ in plan.stages:
        m, actions = o.step(
            m, o.Received(st_.node_id, StageReady(plan.run_id, st_.stage_index, st_.node_id))
        )
    # The prompt's token: one prompt-sized step per stage; a decoded token's: one row's.
    assert o.StartTimer(o.Timer.TOKEN, 2 * t.step_limit_ms(6)) in actions
    m, actions = o.step(m, o.TokenConsumed(0, 5))
    assert o.StartTimer(o.Timer.TOKEN, 2 * t.step_limit_ms(1)) in actions
    stage = _ready_stage(plan, 1)
    edge = provision_all(plan)[1].inbound.edge_id
    _, actions = s.step(stage, s.ObjectLoaded(plan.run_id, edge, 0, rows=6))
    assert s.StartTimer(s.Timer.STEP, t.step_limit_ms(6)) in actions
    # A chunk's step has its own rows' limit.
    stage = _ready_stage(plan, 1)
    _, actions = s.step(stage, s.ObjectLoaded(plan.run_id, edge, 0, 0, 3, rows=2))
    assert s.StartTimer(s.Timer.STEP, t.step_limit_ms(2)) in actions


def test_a_stage_never_heard_is_not_said_to_have_missed_a_heartbeat() -> None:
    """A stage stopped before its first word: the fault says it never spoke (it once
    said "no heartbeat for", as of a stage that had beaten and then stopped)."""
    orch = _running(small_plan(3))
    orch, _ = o.step(orch, o.StageSilent(2, 4_000, heard=False))
    assert orch.fault == FaultReason(
        FaultKind.STAGE_SILENT,
        "stage 2 on 'node-2': not a word since it started, and its run not ready in 4.0 s",
    )


def test_a_silent_stage_faults_the_run_naming_it_and_is_not_waited_for() -> None:
    plan = small_plan(3)
    orch = _running(plan)
    orch, actions = o.step(orch, o.StageSilent(1, 5_250))
    assert orch.outcome is StopReason.FAULTED and orch.fault_stage == 1
    assert orch.fault == FaultReason(
        FaultKind.STAGE_SILENT, "stage 1 on 'node-1': no heartbeat for 5.2 s"
    )
    assert [a.stage_index for a in _of(actions, o.SendStopRun)] == [0, 1, 2]
    for i in (0, 2):  # the silent one is gone: only the others' stops are awaited
        node = plan.stages[i].node_id
        orch, actions = o.step(orch, o.Received(node, StageStopped(plan.run_id, i, node)))
    assert orch.state is o.State.DONE
    (done,) = _of(actions, o.RunFinished)
    assert done.unconfirmed_stages == () and done.fault_stage == 1
    # In teardown, a stage that falls silent is not waited for either.
    orch = _running(plan)
    orch, _ = o.step(orch, o.Cancel())
    orch, actions = o.step(orch, o.StageSilent(0, 9_000))
    assert orch.outcome is StopReason.CANCELLED and orch.state is o.State.TEARING_DOWN
    assert orch.awaiting_stop == frozenset({1, 2})


def test_a_provision_whose_ring_has_no_slot_is_refused_not_raised_on_later() -> None:
    """A ring of 0 slots passes the wire; the stage machine took it, and its next step
    (an object loaded) raised ``ValueError`` from ``shared_batches``, where ``step``
    never raises."""
    plan = small_plan(2)
    msg = provision_all(plan)[0]
    for end in ("inbound", "outbound"):
        edge = getattr(msg, end)
        bad = attrs.evolve(msg, **{end: attrs.evolve(edge, ring_spec=attrs.evolve(
            edge.ring_spec, slot_count=0))})  # fmt: skip
        m, actions = s.step(
            s.StageMachine.new(bad.node_id, ORCHESTRATOR), s.Received(ORCHESTRATOR, bad)
        )
        assert m.state is s.State.UNPROVISIONED
        (reject,) = _of(actions, s.Reject)
        assert reject.reason is s.RejectReason.INVALID_PROVISION
        assert f"its {end} ring has 0 slots" in reject.detail


def test_a_token_timer_run_out_while_the_chain_delivered_tokens_starts_again() -> None:
    # Other runs' tokens came since the timer started: the chain is alive and this
    # run's record waits behind theirs; the timer starts again with the same bound.
    plan = small_plan(2, max_tokens=10, eos=0)
    m, _ = o.step(_running(plan), o.TokenConsumed(0, 5))
    decode_ms = 2 * plan.timeouts.step_limit_ms(1)
    again, actions = o.step(m, o.TimerFired(o.Timer.TOKEN, delivered=3))
    assert again == attrs.evolve(m, token_restarts=1)
    assert actions == (o.StartTimer(o.Timer.TOKEN, decode_ms),)
    # None came for a whole bound: the chain is stuck, the run faults.
    stuck, actions = o.step(again, o.TimerFired(o.Timer.TOKEN))
    assert stuck.state is o.State.TEARING_DOWN and stuck.outcome is StopReason.FAULTED
    assert stuck.fault == FaultReason(FaultKind.TIMEOUT, "token 1 not produced in time")
    assert _of(actions, o.SendStopRun)


def test_a_token_timer_starts_again_as_many_times_as_runs_were_in_flight() -> None:
    # Each stage's budget holds 100 caches of this run's size, but the runtime saw 3
    # runs in flight while the token waited (TimerFired.runs; the most of any of its
    # bounds counts, 2 later does not lower it): the timer of one token starts again
    # 3 times at most while other runs get tokens; a consumed token resets the count
    # and the runs. Past it the token's record is taken for lost: the run faults.
    small = small_plan(2, max_tokens=10, eos=0)
    stages = tuple(attrs.evolve(st_, kv_budget_bytes=100 * st_.kv_bytes) for st_ in small.stages)
    plan = attrs.evolve(small, stages=stages)
    m = _running(plan)
    assert m.token_restart_limit == 1  # no other run seen yet
    for runs in (3, 2):
        m, actions = o.step(m, o.TimerFired(o.Timer.TOKEN, delivered=1, runs=runs))
        assert _of(actions, o.StartTimer) and m.state is o.State.RUNNING
    assert (m.token_restarts, m.token_runs, m.token_restart_limit) == (2, 3, 3)
    m, _ = o.step(m, o.TokenConsumed(0, 5))
    assert (m.token_restarts, m.token_runs) == (0, 1)
    fired = o.TimerFired(o.Timer.TOKEN, delivered=1, runs=3)
    for _ in range(3):
        m, actions = o.step(m, fired)
        assert _of(actions, o.StartTimer) and m.state is o.State.RUNNING
    lost, actions = o.step(m, fired)
    assert lost.state is o.State.TEARING_DOWN and lost.outcome is StopReason.FAULTED
    detail = (
        "token 1 not produced in time (its timer started again 3 times while other runs got "
        "tokens, 3 runs in flight at most)"
    )
    assert lost.fault == FaultReason(FaultKind.TIMEOUT, detail)
    assert _of(actions, o.SendStopRun)
    assert all(a.timer is not o.Timer.TOKEN for a in _of(actions, o.StartTimer))
