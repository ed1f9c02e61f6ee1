"""A chain's stage joins a new chain (issue 25: ``JoinChain``), in one process through
the chain controllers (``tests/support/chain_runs.py``): after the join the stage
serves the new chain's runs on the new chain's links with the weights it bound once;
the old chain's run ids stay stale there (a record or a message of one is rejected and
changes nothing); a join not from the orchestrator, for another node or another place
changes nothing; and the ids a stage keeps as stale are bounded however long it
serves, the most recent still rejected as stale."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from runplan import GgufSource, RunPlan, SamplingConfig, wire
from runplan.fsm import stage as sfsm
from runplan.messages import JoinChain, StopReason, StopRun
from runtime_core.chain_orchestrator import ChainOrchestrator, RunRefused
from runtime_core.links import LocalLinks
from runtime_core.recent_runs import RecentRuns
from runtime_core.workers.interface import Progress, Worker
from runtime_core.workers.reference.worker import ReferenceWorker
from tests.fixtures.gguf_models import ModelShape, write_model
from tests.support.chain import plan_for
from tests.support.chain_runs import ORCHESTRATOR, ChainRuns, _Outbox

PROMPT = [5, 77, 300, 12, 9]
N = 5


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("join") / "m.gguf", ModelShape(n_layers=3))


def plan(model: Path, run_id: str) -> RunPlan:
    return plan_for(
        model,
        3,
        max_seq_len=32,
        run_id=run_id,
        sampling=SamplingConfig(temperature=0.7, top_k=20, seed=3),
        max_concurrent_runs=4,
        max_tokens=N,
    )


class CountingWorker:
    """The reference worker, counting its binds (what the stage reports as ``bind``)."""

    def __init__(self) -> None:
        self.inner = ReferenceWorker()
        self.binds = 0

    def bind(self, gguf_source: GgufSource, progress: Progress | None = None) -> None:
        self.binds += 1
        self.inner.bind(gguf_source, progress)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def counting(_: int) -> Worker:
    return CountingWorker()  # type: ignore[return-value]


def join(stage: int, count: int = 3, node: str | None = None) -> JoinChain:
    return JoinChain(node or f"node-{stage}", stage, count, "shm", "shm", 1)


def rejoin_all(chain: ChainRuns, links: LocalLinks) -> None:
    """Every stage joins a chain on ``links`` (the joins port hands them out), and a new
    orchestrator serves it, as after a re-placement that kept every stage."""
    for stage in chain.stages:
        stage.joins = lambda message: links
    for i in range(len(chain.stages)):
        chain.to_stages.append((chain.node_ids[i], wire.dumps(join(i))))
    chain.links = links
    chain.orchestrator = ChainOrchestrator(
        _Outbox(ORCHESTRATOR, chain.to_stages),
        links,
        chain.orchestrator_timers,
        trace=chain._tracer(ORCHESTRATOR),
    )


def tokens_of(chain: ChainRuns, run_id: str) -> list[int]:
    return [t for _, t in chain.tokens[run_id]]


def test_joined_stages_serve_the_new_chain_on_its_links_with_the_weights_they_bound(
    model: Path,
) -> None:
    chain = ChainRuns(3, counting)
    first = chain.add(plan(model, "old-0"), PROMPT)
    chain.pump()
    assert first.finished is not None and first.finished.outcome is StopReason.COMPLETED
    old_links = chain.links
    new_links = LocalLinks()
    rejoin_all(chain, new_links)
    chain.pump()
    assert [f["weights_kept"] for f in chain.of("joined")] == [True] * 3
    for stage in chain.stages:
        assert stage.transport is new_links and stage.inbound is None and not stage.runs
    again = chain.add(plan(model, "new-0"), PROMPT)
    chain.pump()
    assert again.finished is not None and again.finished.outcome is StopReason.COMPLETED
    assert tokens_of(chain, "new-0") == tokens_of(chain, "old-0")
    assert [w.binds for w in chain.workers] == [1, 1, 1], "no stage bound its slice again"  # type: ignore[attr-defined]
    assert set(new_links.rings) == {0, 1, 2, 3}, "the new chain's every hop"
    assert all(ring.closed for hop, ring in old_links.rings.items() if hop in (1, 2)), (
        "the stages closed the old chain's rings they made"
    )
    # The old chain's run, on the new chain's links and control channel: stale.
    chain.forge(1, "old-0", 2, 1)
    chain.stages[1].handle(sfsm.Received(ORCHESTRATOR, StopRun("old-0", StopReason.CANCELLED)))
    chain.pump()
    reasons = [f["reason"] for f in chain.of("reject", "node-1")]
    assert reasons == ["STALE_RUN", "STALE_RUN"], reasons
    assert chain.stages[1].broken is None and chain.stages[1].wants_input


def test_a_join_with_runs_held_stops_them_first_and_keeps_their_ids_stale(model: Path) -> None:
    chain = ChainRuns(3, counting)
    chain.add(plan(model, "old-1"), PROMPT)
    chain._round()
    chain._round()  # provisioned and set up: held by every stage
    assert all("old-1" in s.runs for s in chain.stages)
    stage = chain.stages[2]
    stage.joins = lambda message: LocalLinks()
    stage.handle(sfsm.Received(ORCHESTRATOR, join(2)))
    assert stage.runs == {} and "old-1" in stage.stale_runs
    assert stage.worker.kv_reserved_bytes == 0  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("sender", "message", "reason"),
    [
        ("node-0", join(1), "UNAUTHORIZED_SENDER"),
        (ORCHESTRATOR, join(1, node="node-2"), "WRONG_NODE"),
        (ORCHESTRATOR, join(2, node="node-1"), "INVALID_JOIN"),  # another place in the pipeline
        (ORCHESTRATOR, join(1, count=4), "INVALID_JOIN"),
        (ORCHESTRATOR, join(3, node="node-1"), "INVALID_JOIN"),  # no stage of a chain of 3
    ],
)
def test_a_join_it_may_not_take_is_rejected_and_changes_nothing(
    model: Path, sender: str, message: JoinChain, reason: str
) -> None:
    chain = ChainRuns(3, counting)
    chain.add(plan(model, "run-a"), PROMPT)
    chain.pump()
    stage = chain.stages[1]
    joined: list[JoinChain] = []
    stage.joins = lambda m: joined.append(m) or LocalLinks()  # type: ignore[func-returns-value]
    links, inbound = stage.transport, stage.inbound
    stage.handle(sfsm.Received(sender, message))
    assert [f["reason"] for f in chain.of("reject", "node-1")] == [reason]
    assert joined == [] and stage.transport is links and stage.inbound is inbound


def test_a_stage_without_a_joins_port_refuses_to_join(model: Path) -> None:
    chain = ChainRuns(3, counting)
    chain.add(plan(model, "run-b"), PROMPT)
    chain.pump()
    chain.stages[0].handle(sfsm.Received(ORCHESTRATOR, join(0)))
    assert [f["detail"] for f in chain.of("reject", "node-0")] == [
        "this stage cannot join another chain"
    ]


def test_a_join_whose_links_cannot_be_made_is_the_chain_s_fault_on_that_stage(
    model: Path,
) -> None:
    chain = ChainRuns(3, counting)
    chain.add(plan(model, "run-c"), PROMPT)
    chain.pump()
    stage = chain.stages[0]

    def no_secret(message: JoinChain) -> LocalLinks:
        raise OSError("no secret from the host")

    stage.joins = no_secret
    stage.handle(sfsm.Received(ORCHESTRATOR, join(0)))
    assert stage.broken is not None and "no secret from the host" in stage.broken.detail


def test_the_stale_ids_are_bounded_and_the_latest_still_rejected(model: Path) -> None:
    chain = ChainRuns(3, counting)
    for stage in chain.stages:
        stage._stale = RecentRuns(kept=2)
    for k in range(4):
        chain.add(plan(model, f"run-{k}"), PROMPT)
        chain.pump()
    for stage in chain.stages:
        assert stage.stale_runs == {"run-2", "run-3"}, "the last two stopped, no more"
    chain.forge(1, "run-3", 2, 1)  # the latest: stale
    chain.forge(1, "run-0", 2, 1)  # long gone: no run of this stage, rejected too
    chain.pump()
    reasons = [f["reason"] for f in chain.of("reject", "node-1")]
    assert reasons == ["STALE_RUN", "UNKNOWN_RUN"], reasons
    assert chain.stages[1].broken is None and chain.stages[1].runs == {}


def test_the_orchestrators_finished_ids_are_bounded_and_the_latest_still_refused(
    model: Path,
) -> None:
    """A chain serving runs for months remembers the ids of its last finished runs
    only, more of them than a stage keeps stale: a reused id among them is refused, one
    older (forgotten by the stages too) runs again."""
    chain = ChainRuns(3, counting)
    for stage in chain.stages:
        stage._stale = RecentRuns(kept=2)
    chain.orchestrator.done = RecentRuns(kept=4)
    for k in range(6):
        chain.add(plan(model, f"run-{k}"), PROMPT)
        chain.pump()
    assert chain.orchestrator.done.stale == {"run-2", "run-3", "run-4", "run-5"}
    with pytest.raises(RunRefused, match="already has a run of this id"):
        chain.add(plan(model, "run-2"), PROMPT)
    again = chain.add(plan(model, "run-0"), PROMPT)  # forgotten: a new run, that id
    chain.pump()
    assert again.finished is not None and again.finished.outcome is StopReason.COMPLETED
    assert chain.orchestrator.runs == {} and len(chain.orchestrator.done) == 4
    assert "run-0" in chain.orchestrator.done and "run-2" not in chain.orchestrator.done


def test_stale_runs_keep_the_most_recent(ids: Sequence[str] = ("a", "b", "c", "b", "d")) -> None:
    stale = RecentRuns(ids, kept=3)
    assert stale.stale == {"b", "c", "d"} and len(stale) == 3
    with pytest.raises(ValueError, match="stale runs kept 0"):
        RecentRuns(kept=0)
