"""Deterministic replay (``runtime_core.replay``): a run interrupted after ``k`` tokens
and replayed on a re-placed chain continues its caller's stream with, token for token,
what the unbroken run gives; greedy and seeded, on the reference and the CPU worker;
anywhere from provisioning through prefill to its last token; 4 runs at once. And the
replays no chain can take are refused, naming why."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import attrs
import pytest

from runplan import (
    ModelFacts,
    NodePool,
    NodeSpec,
    Placement,
    RunPlan,
    RuntimeConfig,
    SamplingConfig,
    model_facts_from_gguf,
    plan_run,
)
from runplan.placement import StageAssignment
from runtime_core.replay import (
    Interrupted,
    Replay,
    ReplayRefusal,
    ReplayRefused,
    plan_replay,
    replay_of,
)
from tests.fixtures.gguf_models import ModelShape, write_model
from tests.support.every_worker import WORKERS
from tests.support.recovering_chain import MakeWorker, RecoveringChain, Stream

PROMPTS = [
    (5, 77, 300, 12, 9, 41, 2, 18, 250, 6, 13),
    (1, 2, 3),
    (200, 17, 45, 99, 3, 8),
    (42, 7),
]
N = 6  # tokens each stream is to get
MAX_SEQ = 32
BIG = 2**40
GREEDY = SamplingConfig()
SEEDED = SamplingConfig(temperature=0.8, top_k=30, seed=7)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("replay") / "m.gguf", ModelShape(n_layers=3))


@pytest.fixture(scope="module")
def facts(model: Path) -> ModelFacts:
    return model_facts_from_gguf(model, max_seq_len=MAX_SEQ)


def base(**kw: object) -> RuntimeConfig:
    fields: dict[str, object] = {
        "run_id": "base",
        "max_tokens": N,
        "max_concurrent_runs": 4,
        "max_batch_rows": 16,
        "prefill_chunk": 4,
    }
    return RuntimeConfig(**{**fields, **kw})  # type: ignore[arg-type]


def nodes(*spares: str) -> NodePool:
    ids = ["node-0", "node-1", "node-2", *spares]
    return NodePool("orch", tuple(NodeSpec(n, BIG) for n in ids))


EVEN = Placement.even(["node-0", "node-1", "node-2"])


def worker(name: str) -> MakeWorker:
    make = WORKERS[name]
    return lambda _i, _node: make()


def recovering(facts: ModelFacts, name: str, *spares: str, **kw: object) -> RecoveringChain:
    return RecoveringChain(facts, base(**kw), nodes(*spares), EVEN, worker(name))


def unbroken(facts: ModelFacts, name: str, k: int, sampling: SamplingConfig) -> list[int]:
    chain = recovering(facts, name)
    stream = chain.start(f"run-{k}", PROMPTS[k], sampling=sampling)
    chain.pump()
    assert stream.completed, stream.ended
    assert len(stream.tokens) == N
    return stream.tokens


def pump_until(chain: RecoveringChain, done: Callable[[], bool], limit: int = 500) -> None:
    for _ in range(limit):
        if done():
            return
        chain.pump(rounds=1)
    raise AssertionError("the chain never got there")


def in_prefill(chain: RecoveringChain, stream: Stream) -> bool:
    """Stage 0 published a chunk of the prompt, and no token came back yet."""
    published = [
        f
        for f in chain.chain.of("published", "node-0")
        if f["run_id"] == stream.handle.run_id and f["sequence"] == 0
    ]
    return bool(published) and not stream.tokens


# -- one stream, interrupted anywhere --------------------------------------------------------


WHERE = ["setup", "prefill", 1, 3, N - 1]


@pytest.mark.parametrize("name", ["reference", "cpu"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("where", WHERE, ids=[str(w) for w in WHERE])
def test_a_run_interrupted_anywhere_continues_its_stream_exactly(
    facts: ModelFacts, name: str, sampling: SamplingConfig, where: str | int
) -> None:
    expected = unbroken(facts, name, 0, sampling)
    chain = recovering(facts, name, "spare-0")
    stream = chain.start("run-0", PROMPTS[0], sampling=sampling)
    if where == "setup":
        chain.pump(rounds=1)
        assert chain.chain.of("published") == []
    elif where == "prefill":
        pump_until(chain, lambda: in_prefill(chain, stream))
    else:
        assert isinstance(where, int)
        pump_until(chain, lambda: len(stream.tokens) >= where)
        assert len(stream.tokens) == where
    chain.lose(1, "node-1 on host h1: process exited with signal 9")
    chain.pump()
    assert stream.completed, (stream.ended, stream.finished)
    assert stream.tokens == expected
    assert stream.run_ids == ["run-0", "run-0~r1"]
    assert stream.replay is not None and stream.replay.recoveries == 1
    (replacement,) = chain.replacements
    assert [s.node_id for s in replacement.plan.stages] == ["node-0", "spare-0", "node-2"]
    assert replacement.kept == (0, 2) and replacement.fresh == (1,)
    assert "run-0" in chain.chain.stages[0].stale_runs  # the old id stays stale


@pytest.mark.parametrize("name", ["reference", "cpu"])
def test_four_runs_in_flight_interrupted_by_one_fault_all_continue_exactly(
    facts: ModelFacts, name: str
) -> None:
    samplings = [GREEDY, SEEDED, attrs.evolve(SEEDED, seed=99, top_k=0), GREEDY]
    expected = [unbroken(facts, name, k, samplings[k]) for k in range(4)]
    chain = recovering(facts, name, "spare-0")
    streams = [chain.start(f"run-{k}", PROMPTS[k], sampling=samplings[k]) for k in range(4)]
    pump_until(chain, lambda: len(streams[3].tokens) >= 2)
    progress = [len(s.tokens) for s in streams]
    assert all(0 < p < N for p in progress)  # every run was interrupted mid-stream
    chain.lose(1, "node-1 on host h1: host unreachable")
    chain.pump()
    for k, s in enumerate(streams):
        assert s.completed, (k, s.ended, s.finished)
        assert s.tokens == expected[k], k
        assert s.run_ids[-1] == f"run-{k}~r1"
    assert len(chain.replacements) == 1  # one re-placement for all four


def test_a_second_loss_during_the_replay_is_recovered_again(facts: ModelFacts) -> None:
    expected = unbroken(facts, "cpu", 0, SEEDED)
    chain = recovering(facts, "cpu", "spare-0", "spare-1")
    stream = chain.start("run-0", PROMPTS[0], sampling=SEEDED)
    pump_until(chain, lambda: len(stream.tokens) >= 2)
    chain.lose(1)
    pump_until(chain, lambda: len(stream.tokens) >= 4)
    chain.lose(2)
    chain.pump()
    assert stream.completed and stream.tokens == expected
    assert stream.run_ids == ["run-0", "run-0~r1", "run-0~r2"]
    assert [s.node_id for s in chain.replacements[-1].plan.stages] == [
        "node-0",
        "spare-0",
        "spare-1",
    ]


# -- what a replay is ------------------------------------------------------------------------


def plan_of(facts: ModelFacts, config: RuntimeConfig) -> RunPlan:
    plan = plan_run(facts, config, nodes(), stage_count=3, placement=EVEN)
    assert isinstance(plan, RunPlan), plan
    return plan


def test_a_replay_s_prompt_sampler_and_budget_continue_the_interrupted_run(
    facts: ModelFacts,
) -> None:
    plan = plan_of(facts, base(run_id="run-a", sampling=SEEDED))
    interrupted = Interrupted.of_plan(plan, (1, 2, 3), (10, 11), stop=("\n\n",))
    replay = replay_of(interrupted, "run-a~r1", MAX_SEQ)
    assert replay == Replay(
        run_id="run-a~r1",
        interrupted_run_id="run-a",
        prompt=(1, 2, 3, 10, 11),
        max_tokens=N - 2,
        sampling=attrs.evolve(SEEDED, tokens_delivered=2),
        stop=("\n\n",),
        stream_offset=2,
        recoveries=1,
    )
    assert replay.stream_sequence(0) == 2
    config = replay.config(base(prompt_tokens=3))
    assert (config.run_id, config.max_tokens, config.prompt_tokens) == ("run-a~r1", N - 2, 5)
    assert config.sampling.tokens_delivered == 2
    # interrupted again, after one more token: the counts add up
    again_plan = plan_of(facts, replay.config(base()))
    again = replay_of(Interrupted.of_replay(replay, again_plan, (12,)), "run-a~r2", MAX_SEQ)
    assert isinstance(again, Replay)
    assert again.prompt == (1, 2, 3, 10, 11, 12)
    assert (again.max_tokens, again.stream_offset, again.recoveries) == (N - 3, 3, 2)
    assert again.sampling.tokens_delivered == 3


def test_a_stream_that_had_ended_is_not_replayed(facts: ModelFacts) -> None:
    plan = plan_of(facts, base(run_id="run-a"))
    done = Interrupted.of_plan(plan, (1, 2), tuple(range(N)))
    refused = replay_of(done, "run-a~r1", MAX_SEQ)
    assert isinstance(refused, ReplayRefused)
    assert refused.reason is ReplayRefusal.ALREADY_ENDED
    assert f"{N} of max_tokens {N}" in str(refused)


def test_a_replay_longer_than_the_context_is_refused_naming_it(facts: ModelFacts) -> None:
    plan = plan_of(facts, base(run_id="run-a", max_tokens=20))
    interrupted = Interrupted.of_plan(plan, tuple(range(1, 11)), (5, 6, 7))
    refused = replay_of(interrupted, "run-a~r1", 25)  # the new chain's context is shorter
    assert isinstance(refused, ReplayRefused)
    assert refused.reason is ReplayRefusal.EXCEEDS_MAX_SEQ_LEN
    assert "10 prompt + 3 delivered tokens + 17 to generate need 29 positions" in str(refused)
    assert "max_seq_len is 25" in str(refused)
    short = attrs.evolve(facts, max_seq_len=25)
    planned = plan_replay(interrupted, "run-a~r1", short, base(), nodes(), EVEN)
    assert isinstance(planned, ReplayRefused)
    assert planned.reason is ReplayRefusal.EXCEEDS_MAX_SEQ_LEN


def test_a_replay_beyond_the_new_stages_kv_budget_is_refused_naming_it(
    facts: ModelFacts,
) -> None:
    """The budget held one block's cache per stage; re-placed onto one node, the stage
    holds all three blocks, and the replay's cache does not fit its budget."""
    plan = plan_of(facts, base(run_id="run-a"))
    budget = max(s.kv_bytes for s in plan.stages)
    interrupted = Interrupted.of_plan(plan, (1, 2, 3), (4,))
    one_node = Placement(assignments=(StageAssignment(0, "node-0", 0, 3),))
    planned = plan_replay(
        interrupted, "run-a~r1", facts, base(kv_budget_bytes=budget), nodes(), one_node
    )
    assert isinstance(planned, ReplayRefused), planned
    assert planned.reason is ReplayRefusal.EXCEEDS_KV_BUDGET
    assert "kv_budget_bytes" in planned.detail and "stage 0 needs" in planned.detail
    fits = plan_replay(interrupted, "run-a~r1", facts, base(kv_budget_bytes=budget), nodes(), EVEN)
    assert not isinstance(fits, ReplayRefused), fits
    replay, replay_plan = fits
    assert replay.prompt == (1, 2, 3, 4)
    assert replay_plan.run_id == "run-a~r1" and replay_plan.max_tokens == N - 1
    assert replay_plan.sampling.tokens_delivered == 1


def test_a_replay_under_the_interrupted_run_s_id_is_an_error(facts: ModelFacts) -> None:
    plan = plan_of(facts, base(run_id="run-a"))
    with pytest.raises(ValueError, match="'run-a' is the interrupted run's"):
        replay_of(Interrupted.of_plan(plan, (1,), ()), "run-a", MAX_SEQ)


def test_a_replay_the_planner_rejects_names_the_rejection(facts: ModelFacts) -> None:
    plan = plan_of(facts, base(run_id="run-a"))
    interrupted = Interrupted.of_plan(plan, (1,), ())
    planned = plan_replay(interrupted, "x" * 65, facts, base(), nodes(), EVEN)
    assert isinstance(planned, ReplayRefused)
    assert planned.reason is ReplayRefusal.NOT_PLANNED and "run_id" in planned.detail
