"""Recovery as a property (issue 25), on the in-process chain: streams at once, stages
and hosts lost at any round, with or without spares, any ``max_recoveries``. Every
stream either completes with exactly its unbroken tokens, or ends once, with a reason
(its recoveries spent, no placement, a refused replay), holding a prefix of them; a lost
node never serves again, no run id is used twice, and the old ones stay stale."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from runplan import (
    ModelFacts,
    NodePool,
    NodeSpec,
    Placement,
    RuntimeConfig,
    SamplingConfig,
    model_facts_from_gguf,
)
from runplan.memory import plan_stage_memory
from runtime_core.recovery import End, EndReason, RecoveryPolicy
from runtime_core.workers.interface import Worker
from runtime_core.workers.reference.worker import ReferenceWorker
from tests.fixtures.gguf_models import ModelShape, write_model
from tests.support.recovering_chain import RecoveringChain

N = 5
PROMPTS = [(5, 77, 300, 12, 9, 41, 2), (1, 2, 3), (200, 17, 45, 99, 3, 8, 250, 31, 6), (42,)]
SAMPLINGS = [SamplingConfig(), SamplingConfig(temperature=0.8, top_k=30, seed=7)]
THREE = ["node-0", "node-1", "node-2"]


@pytest.fixture(scope="module")
def facts(tmp_path_factory: pytest.TempPathFactory) -> ModelFacts:
    path: Path = write_model(tmp_path_factory.mktemp("prop") / "m.gguf", ModelShape(n_layers=3))
    return model_facts_from_gguf(path, max_seq_len=32)


def reference(_i: int, _node: str) -> Worker:
    return ReferenceWorker()


BASE = RuntimeConfig(run_id="base", max_tokens=N, max_concurrent_runs=4, prefill_chunk=3)


def runner(
    facts: ModelFacts, spares: int, policy: RecoveryPolicy, memory: int = 2**40
) -> RecoveringChain:
    """Three nodes and ``spares`` spares of ``memory`` bytes each."""
    ids = [*THREE, *(f"spare-{i}" for i in range(spares))]
    pool = NodePool("orch", tuple(NodeSpec(n, memory) for n in ids))
    return RecoveringChain(facts, BASE, pool, Placement.even(THREE), reference, policy)


def one_stage_of_room(facts: ModelFacts) -> int:
    """Memory for the biggest of the three stages, and not one stage's blocks more."""
    plan = runner(facts, 0, RecoveryPolicy()).start("probe", (1,)).plan
    return max(m.total for m in plan_stage_memory(facts, BASE.worker, plan))


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, object]:
    streams = draw(
        st.lists(
            st.tuples(st.integers(0, len(PROMPTS) - 1), st.integers(0, 1)),
            min_size=1,
            max_size=4,
        )
    )
    losses = draw(
        st.lists(
            st.tuples(st.integers(0, 20), st.integers(0, 2), st.booleans()),
            max_size=3,
        )
    )
    return {
        "streams": streams,
        "losses": sorted(losses),
        "spares": draw(st.integers(0, 2)),
        "max_recoveries": draw(st.sampled_from([0, 1, 2, 2])),
        "tight": draw(st.booleans()),  # room for a stage per node, none for more
    }


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_every_stream_completes_exactly_or_ends_once_with_a_reason(
    facts: ModelFacts, scenario: dict[str, object]
) -> None:
    @cache
    def unbroken(prompt: int, sampling: int) -> tuple[int, ...]:
        chain = runner(facts, 0, RecoveryPolicy())
        stream = chain.start("alone", PROMPTS[prompt], sampling=SAMPLINGS[sampling])
        chain.pump()
        assert stream.completed
        return tuple(stream.tokens)

    policy = RecoveryPolicy(max_recoveries=scenario["max_recoveries"])  # type: ignore[arg-type]
    memory = one_stage_of_room(facts) if scenario["tight"] else 2**40
    chain = runner(facts, scenario["spares"], policy, memory)  # type: ignore[arg-type]
    wanted = scenario["streams"]
    assert isinstance(wanted, list)
    streams = [
        chain.start(f"run-{j}", PROMPTS[p], sampling=SAMPLINGS[s])
        for j, (p, s) in enumerate(wanted)
    ]
    round_no = 0
    losses = scenario["losses"]
    assert isinstance(losses, list)
    for at, stage, host in losses:
        while round_no < at:
            chain.pump(rounds=1)
            round_no += 1
        chain.lose(stage % chain.stage_count, f"lost at round {at}", host=host)
    chain.pump()

    used: set[str] = set()
    for j, ((p, s), stream) in enumerate(zip(wanted, streams, strict=True)):
        expected = unbroken(p, s)
        assert stream.ended is not None, j  # one end, decided
        end = stream.ended
        why = end.reason.value if isinstance(end, End) else type(end).__name__
        event(f"recoveries {len(stream.run_ids) - 1}, {why}")
        if stream.completed:
            assert tuple(stream.tokens) == expected, j
        else:
            assert tuple(stream.tokens) == expected[: len(stream.tokens)], j
            assert not isinstance(stream.ended, End) or stream.ended.reason in (
                EndReason.RECOVERIES_SPENT,
            ), (j, stream.ended)
        assert len(stream.run_ids) - 1 <= policy.max_recoveries
        assert not used & set(stream.run_ids)
        used |= set(stream.run_ids)
    for replacement in chain.replacements:  # a node lost by then never serves again
        assert not {s.node_id for s in replacement.plan.stages} & set(replacement.lost_nodes)
    if chain.replacements:  # the chain now up holds every earlier run id as stale
        for stage in chain.chain.stages:
            assert chain.stale <= set(stage.stale_runs)
