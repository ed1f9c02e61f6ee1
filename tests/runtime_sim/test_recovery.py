"""Re-placement and replay in the simulator (issue 25): the synthetic worker continues a
replayed stream, the runner recovers through the runtime's own policy, re-placement and
replay, and the checker holds every recovered stream to its unbroken tokens, every
stream to one outcome, every stale run id refused and every lost host unused."""

from __future__ import annotations

import attrs

from runplan import RunPlan
from runplan.memory import plan_stage_memory
from runplan.replacement import Replacement, Unplaceable
from runtime_core.recovery import End, EndReason
from runtime_core.replay import Interrupted, Replay, replay_of
from runtime_sim.chain_driver import RunSpec
from runtime_sim.chain_recovery import RecoveryAction, dead_hosts
from runtime_sim.explore import MUTANT_RULES, run_recovering, solo
from runtime_sim.faults import Fault, FaultKind, FaultPlan
from runtime_sim.mutants import RECOVERY_MUTATIONS, Mutation
from runtime_sim.recovery_checker import REPLAY_PROMPT, STREAM_UNBROKEN
from runtime_sim.scenarios import (
    EXPLORE_CAPABILITIES,
    Scenario,
    loss_scenario,
    synthetic_config,
    synthetic_facts,
    synthetic_plan_of,
    synthetic_pool,
)

PROMPT = (11, 12, 13, 14, 15)


def one_run(max_tokens: int = 6, *, stages: int = 3, eos_after: int | None = None) -> Scenario:
    facts = synthetic_facts(6, 64, 512, 10**6, len(PROMPT) + max_tokens + 4)
    config = synthetic_config(
        max_tokens=max_tokens,
        run_id="run-0",
        prompt_tokens=len(PROMPT),
        seed=321,
        capabilities=EXPLORE_CAPABILITIES,
    )
    plan = synthetic_plan_of(facts, config, stages)
    return Scenario(5, (RunSpec(plan, PROMPT),), eos_after, FaultPlan(), facts.block_bytes)


def replay_after(s: Scenario, delivered: tuple[int, ...]) -> tuple[Replay, RunSpec]:
    """The replay of ``s``'s run after it delivered ``delivered``, planned as its run."""
    spec = s.runs[0]
    replay = replay_of(
        Interrupted.of_plan(spec.plan, spec.prompt, delivered),
        "run-0~r1",
        spec.plan.model.max_seq_len,
    )
    assert isinstance(replay, Replay), replay
    facts = synthetic_facts(6, 64, 512, 10**6, spec.plan.model.max_seq_len)
    config = synthetic_config(
        max_tokens=spec.plan.max_tokens,
        run_id="run-0",
        prompt_tokens=len(PROMPT),
        seed=321,
        capabilities=EXPLORE_CAPABILITIES,
    )
    plan = synthetic_plan_of(facts, replay.config(config), spec.plan.stage_count)
    return replay, RunSpec(plan, replay.prompt)


def test_a_synthetic_replay_continues_its_stream_where_the_interrupted_run_stopped() -> None:
    # The synthetic worker's token at sequence k is its stream's token d + k for a
    # replay that resumes after d delivered tokens (SamplingConfig.tokens_delivered).
    s = one_run(6)
    unbroken = solo(s)(s.runs[0])
    assert len(unbroken) == 6
    for k in (1, 3, 5):
        _replay, spec = replay_after(s, unbroken[:k])
        assert spec.plan.sampling.tokens_delivered == k
        assert unbroken[:k] + solo(s)(spec) == unbroken, k


def test_a_synthetic_replay_ends_its_stream_where_the_unbroken_run_ends() -> None:
    # EOS falls at the stream's position 4 (a run's tokens leave it out), not at the
    # replay's own sequence 4.
    s = one_run(8, eos_after=4)
    unbroken = solo(s)(s.runs[0])
    assert len(unbroken) == 4
    _replay, spec = replay_after(s, unbroken[:2])
    assert unbroken[:2] + solo(s)(spec) == unbroken


def recovering(
    runs: int,
    faults: tuple[Fault, ...],
    *,
    stages: int = 3,
    spares: int = 0,
    host_lost: bool = True,
    losses: tuple[Fault, ...] = (),
    max_tokens: int = 6,
) -> Scenario:
    """``runs`` runs of 5-token prompts (seeds 100, 101, ...) on a chain of ``stages``
    that recovers after a loss, on a cluster with ``spares`` spare nodes."""
    facts = synthetic_facts(6, 64, 512, 10**6, 5 + max_tokens + 4)
    configs = tuple(
        synthetic_config(
            max_tokens=max_tokens,
            run_id=f"run-{i}",
            prompt_tokens=5,
            seed=100 + i,
            max_concurrent_runs=runs,
            capabilities=EXPLORE_CAPABILITIES,
        )
        for i in range(runs)
    )
    specs = tuple(
        RunSpec(synthetic_plan_of(facts, c, stages), tuple(range(10 + i, 15 + i)))
        for i, c in enumerate(configs)
    )
    action = RecoveryAction(synthetic_pool(stages, spares), facts, configs, host_lost, losses)
    return Scenario(9, specs, None, FaultPlan(faults), facts.block_bytes, action)


def kill(stage: int, sequence: int = 2) -> Fault:
    return Fault(FaultKind.KILL_MID_DECODE, stage=stage, sequence=sequence)


def unbroken_streams(s: Scenario) -> list[tuple[int, ...]]:
    return [solo(s)(spec) for spec in s.runs]


def nodes(plan: RunPlan) -> list[str]:
    return [st.node_id for st in plan.stages]


def test_a_lost_host_with_a_spare_moves_its_stage_there_and_every_stream_completes() -> None:
    s = recovering(2, (kill(1),), spares=1)
    run, violations = run_recovering(s)
    assert violations == []
    assert len(run.epochs) == 2
    new = run.epochs[0].replacement
    assert isinstance(new, Replacement) and new.on_spares
    assert new.lost_nodes == ("node-1",) and new.kept == (0, 2) and new.fresh == (1,)
    assert nodes(run.epochs[1].sim.plan) == ["node-0", "spare-0", "node-2"]
    assert [st.outcome for st in run.streams] == ["completed", "completed"]
    assert [tuple(st.tokens) for st in run.streams] == unbroken_streams(s)
    for st in run.streams:
        # Interrupted mid-stream: a replay continued it under a new run id.
        assert st.recovered == 1 and 0 < len(st.replays[0].prompt) - 5 < 6
        assert st.run_ids == [st.spec.plan.run_id, f"{st.spec.plan.run_id}~r1"]
    # Every stage of the new chain refused a late provision of a stale run.
    assert [r for _, _, r in run.epochs[1].stale_forgeries] == ["STALE_RUN"] * 3


def test_a_lost_host_without_a_spare_puts_the_model_on_the_remaining_nodes() -> None:
    s = recovering(2, (kill(2),))
    run, violations = run_recovering(s)
    assert violations == []
    new = run.epochs[0].replacement
    assert isinstance(new, Replacement) and not new.on_spares
    assert "node-2" not in nodes(run.epochs[1].sim.plan)
    assert [tuple(st.tokens) for st in run.streams] == unbroken_streams(s)
    assert all(st.outcome == "completed" for st in run.streams)


def test_a_lost_process_without_a_spare_restarts_on_its_own_live_node() -> None:
    s = recovering(1, (kill(0),), host_lost=False)
    run, violations = run_recovering(s)
    assert violations == []
    new = run.epochs[0].replacement
    assert isinstance(new, Replacement) and new.on_spares
    assert nodes(run.epochs[1].sim.plan) == ["node-0", "node-1", "node-2"]
    assert tuple(run.streams[0].tokens) == unbroken_streams(s)[0]


def test_no_node_left_ends_each_stream_once_with_the_planners_rejection() -> None:
    s = recovering(2, (kill(0),), stages=1)
    run, violations = run_recovering(s)
    assert violations == []
    assert len(run.epochs) == 1
    for st, alone in zip(run.streams, unbroken_streams(s), strict=True):
        assert isinstance(st.end, Unplaceable) and st.outcome == "faulted"
        assert st.end.lost_nodes == ("node-0",)
        assert "no placement after losing stages [0]" in str(st.end)
        assert tuple(st.tokens) == alone[: len(st.tokens)]


def test_no_room_on_the_remaining_nodes_ends_each_stream_with_the_memory_rejection() -> None:
    s = recovering(2, (kill(1),))
    assert s.recovery is not None
    largest = max(
        m.total for m in plan_stage_memory(s.recovery.facts, s.recovery.configs[0].worker, s.plan)
    )
    pool = attrs.evolve(
        s.recovery.pool,
        nodes=tuple(attrs.evolve(n, memory_bytes=largest) for n in s.recovery.pool.nodes),
    )
    s = attrs.evolve(s, recovery=attrs.evolve(s.recovery, pool=pool))
    run, violations = run_recovering(s)
    assert violations == []
    for st in run.streams:
        assert isinstance(st.end, Unplaceable) and st.outcome == "faulted"
        assert st.end.rejection.code == "insufficient_memory"
        assert str(st.end).startswith("no placement after losing stages [1] (nodes ['node-1'])")
        assert f"has {largest}" in str(st.end)


def test_a_loss_during_a_recovery_is_recovered_in_turn_until_the_policy_says_no() -> None:
    # A second loss strikes the re-placed chain: recovered again (the policy allows 2).
    s = recovering(2, (kill(1, 1),), spares=2, losses=(kill(0, 1),))
    run, violations = run_recovering(s)
    assert violations == []
    assert len(run.epochs) == 3
    assert [st.recovered for st in run.streams] == [2, 2]
    assert [tuple(st.tokens) for st in run.streams] == unbroken_streams(s)
    lost = {n for e in run.epochs[:2] for n in dead_hosts(e)}
    assert not lost & set(nodes(run.epochs[2].sim.plan))
    # The third chain's stages refuse a late provision of each chain before's run.
    forged = run.epochs[2].stale_forgeries
    assert {r for _, r, _ in forged} == {"run-0", "run-0~r1"}
    assert [reason for _, _, reason in forged] == ["STALE_RUN"] * 6
    # A third loss: the streams have spent their recoveries and end with the fault.
    s = recovering(2, (kill(1, 1),), spares=3, losses=(kill(0, 1), kill(2, 1)))
    run, violations = run_recovering(s)
    assert violations == []
    for st in run.streams:
        assert isinstance(st.end, End) and st.end.reason is EndReason.RECOVERIES_SPENT
        assert st.outcome == "faulted" and st.recovered == 2


def test_four_runs_in_flight_all_resume_with_their_unbroken_tokens() -> None:
    s = recovering(4, (kill(1, 3),), spares=1, max_tokens=8)
    run, violations = run_recovering(s)
    assert violations == []
    assert [st.recovered for st in run.streams] == [1, 1, 1, 1]
    assert len(run.epochs[1].sim.runs) == 4
    assert [tuple(st.tokens) for st in run.streams] == unbroken_streams(s)


def test_without_recovery_a_loss_ends_the_runs_as_before() -> None:
    s = attrs.evolve(recovering(2, (kill(1),), spares=1), recovery=None)
    run, violations = run_recovering(s)
    assert violations == []
    assert len(run.epochs) == 1 and all(st.outcome == "faulted" for st in run.streams)


def test_each_recovery_mutant_is_caught_by_the_rule_its_bug_breaks() -> None:
    cases = {
        # the replay restarts its draws: the stream repeats its start
        Mutation.REPLAY_RESTARTS_SAMPLER: recovering(1, (kill(1),), spares=1),
        # the replay is given the run's prompt without the tokens its stream delivered
        Mutation.REPLAY_DROPS_DELIVERED: recovering(1, (kill(1),), spares=1),
        # the new chain's stages take a stale run's late provision
        Mutation.STALE_RUN_ACCEPTED: recovering(1, (kill(1),), spares=1),
        # no spare: the runner puts the stage back on the host it lost
        Mutation.REUSES_LOST_HOST: recovering(1, (kill(1),)),
        # one of two interrupted runs gets no replay and no end
        Mutation.FORGETS_A_RUN: recovering(2, (kill(1),), spares=1),
    }
    assert set(cases) == set(RECOVERY_MUTATIONS)
    for mutation, s in cases.items():
        _run, clean = run_recovering(s)
        assert clean == [], mutation
        _run, violations = run_recovering(s, mutation)
        assert MUTANT_RULES[mutation] in {v.rule for v in violations}, (mutation, violations)


def test_a_replay_given_its_prompt_without_the_delivered_tokens_breaks_the_prompt_rule() -> None:
    # The replay's prompt shows the lost context, and so does its stream: the synthetic
    # worker's tokens follow the token each step's last row stands for (here the
    # prompt's last, not the last delivered), as a model's follow its context.
    s = recovering(2, (kill(1),), spares=1)
    run, clean = run_recovering(s)
    assert clean == []
    replays = run.epochs[1].sim.runs
    assert [len(r.prompt) for r in replays] == [5 + 2, 5 + 2]  # prompt + 2 delivered
    _run, violations = run_recovering(s, Mutation.REPLAY_DROPS_DELIVERED)
    rules = {v.rule for v in violations}
    assert rules == {REPLAY_PROMPT, STREAM_UNBROKEN}, violations
    details = sorted(v.detail for v in violations if v.rule == REPLAY_PROMPT)
    assert len(details) == 2 and "expected 5 + 2 delivered" in details[0], details


def test_the_same_seed_gives_byte_identical_traces_of_every_chain() -> None:
    for seed in (3, 8):  # two chains of 4 runs; three chains of 2
        first, _ = run_recovering(loss_scenario(seed))
        second, _ = run_recovering(loss_scenario(seed))
        assert len(first.epochs) > 1
        assert [e.result.trace.dumps() for e in first.epochs] == [
            e.result.trace.dumps() for e in second.epochs
        ]
