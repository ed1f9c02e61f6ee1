"""Re-placement and replay in the simulator (issue 25): the synthetic worker continues a
replayed stream, the runner recovers through the runtime's own policy, re-placement and
replay, and the checker holds every recovered stream to its unbroken tokens, every
stream to one outcome, every stale run id refused and every lost host unused."""

from __future__ import annotations

from runtime_core.replay import Interrupted, Replay, replay_of
from runtime_sim.chain_driver import RunSpec
from runtime_sim.explore import (
    EXPLORE_CAPABILITIES,
    Scenario,
    solo,
    synthetic_config,
    synthetic_facts,
    synthetic_plan_of,
)
from runtime_sim.faults import FaultPlan

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
