"""The recovery policy (``runtime_core.recovery``): a run ended by a lost stage process,
host or link is re-placed and replayed, at most ``max_recoveries`` times per stream;
every other fault ends runs as today. Decided one by one, and on the in-process chain
(``tests/support/recovering_chain.py``) with stages lost through the test ports."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from runplan import (
    ModelFacts,
    NodePool,
    NodeSpec,
    Placement,
    RuntimeConfig,
    SamplingConfig,
    model_facts_from_gguf,
)
from runplan.fsm.orchestrator_actions import RunFinished
from runplan.memory import plan_stage_memory
from runplan.messages import FaultKind, FaultReason, StopReason
from runplan.plan import ObjectKind
from runplan.record_header import HeaderDType, ObjectHeader
from runplan.rejections import InsufficientMemory
from runplan.replacement import Unplaceable
from runtime_core.recovery import (
    ChainRecovery,
    End,
    EndReason,
    LostLink,
    Recover,
    RecoveryPolicy,
)
from runtime_core.replay import Interrupted
from runtime_core.workers.interface import BatchStep, Worker
from runtime_core.workers.reference.worker import ReferenceWorker
from tests.fixtures.gguf_models import ModelShape, write_model
from tests.support.chain_runs import FailingWorker
from tests.support.recovering_chain import MakeWorker, RecoveringChain

N = 6
SEEDED = SamplingConfig(temperature=0.8, top_k=30, seed=7)
PROMPT = (5, 77, 300, 12, 9, 41, 2)


def interrupted(delivered: int = 2, recoveries: int = 0) -> Interrupted:
    return Interrupted(
        run_id="run-a",
        prompt=(1, 2, 3),
        max_tokens=N,
        eos_token_id=0,
        sampling=SamplingConfig(),
        delivered=tuple(range(10, 10 + delivered)),
        recoveries=recoveries,
    )


def faulted(kind: FaultKind, detail: str = "", stage: int | None = 1) -> RunFinished:
    return RunFinished(StopReason.FAULTED, (10, 11), FaultReason(kind, detail), stage, ())


# -- one run's decision ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", [FaultKind.PROCESS_DIED, FaultKind.STAGE_SILENT])
def test_a_lost_stage_process_or_host_is_recovered(kind: FaultKind) -> None:
    finished = faulted(kind, "stage 1 on 'node-1': gone")
    decision = RecoveryPolicy().decide(interrupted(), finished)
    assert decision == Recover("run-a", 1, finished.fault, 1)  # type: ignore[arg-type]
    assert decision.lost_stages(3) == (1,)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("detail", "stage", "link", "lost"),
    [
        ("inbound link: the ring is closed", 2, LostLink.INBOUND, (1, 2)),
        ("inbound link: the ring is closed", 0, LostLink.INBOUND, (0,)),
        ("outbound link: no free slot within 60000 ms", 1, LostLink.OUTBOUND, (1, 2)),
        ("outbound link: the ring is closed", 2, LostLink.OUTBOUND, (2,)),
    ],
)
def test_a_stage_s_lost_link_is_recovered_with_both_its_ends(
    detail: str, stage: int, link: LostLink, lost: tuple[int, ...]
) -> None:
    decision = RecoveryPolicy().decide(interrupted(), faulted(FaultKind.EDGE_FAULT, detail, stage))
    assert isinstance(decision, Recover) and decision.link is link
    assert decision.lost_stages(3) == lost


def test_a_run_s_own_bad_record_ends_it_unless_the_chain_s_token_links_broke() -> None:
    finished = faulted(FaultKind.EDGE_FAULT, "edge 3: sequence 4, expected 3", 2)
    decision = RecoveryPolicy().decide(interrupted(), finished)
    assert isinstance(decision, End) and decision.reason is EndReason.RUN_FAULT
    assert "edge 3" in decision.detail
    token_out = faulted(FaultKind.EDGE_FAULT, "orchestrator token endpoint: closed", None)
    broken = FaultReason(FaultKind.EDGE_FAULT, "token-out: closed")
    decision = RecoveryPolicy().decide(interrupted(), token_out, chain_fault=broken)
    assert isinstance(decision, Recover) and decision.link is LostLink.TOKEN_LINKS
    assert decision.lost_stages(3) == ()


@pytest.mark.parametrize(
    "kind",
    [
        FaultKind.STEP_FAILURE,
        FaultKind.TIMEOUT,
        FaultKind.KV_CACHE_UNAVAILABLE,
        FaultKind.SEQUENCE_VIOLATION,
        FaultKind.REJECTED_MESSAGE,
        FaultKind.SETUP_FAILURE,
    ],
)
def test_other_faults_end_the_run_as_today(kind: FaultKind) -> None:
    broken = FaultReason(kind, "the chain's")  # even when it is the chain's fault
    decision = RecoveryPolicy().decide(interrupted(), faulted(kind, "x"), chain_fault=broken)
    assert isinstance(decision, End) and decision.reason is EndReason.NOT_A_LOSS
    assert kind.value.lower() in decision.detail


@pytest.mark.parametrize("outcome", [StopReason.COMPLETED, StopReason.CANCELLED])
def test_a_run_that_was_not_faulted_has_nothing_to_recover(outcome: StopReason) -> None:
    finished = RunFinished(outcome, (10, 11), None, None, ())
    decision = RecoveryPolicy().decide(interrupted(), finished)
    assert isinstance(decision, End) and decision.reason is EndReason.NOT_FAULTED


def test_recoveries_are_counted_per_stream_up_to_the_maximum() -> None:
    died = faulted(FaultKind.PROCESS_DIED, "stage 1")
    policy = RecoveryPolicy()
    assert policy.max_recoveries == 2
    assert isinstance(policy.decide(interrupted(recoveries=1), died), Recover)
    assert policy.decide(interrupted(recoveries=1), died).recovery == 2  # type: ignore[union-attr]
    spent = policy.decide(interrupted(recoveries=2), died)
    assert isinstance(spent, End) and spent.reason is EndReason.RECOVERIES_SPENT
    assert "recovered 2 times (max_recoveries 2)" in spent.detail
    never = RecoveryPolicy(max_recoveries=0).decide(interrupted(), died)
    assert isinstance(never, End) and never.reason is EndReason.RECOVERIES_SPENT


def test_a_stream_that_had_ended_is_completed_not_recovered() -> None:
    decision = RecoveryPolicy().decide(interrupted(delivered=N), faulted(FaultKind.PROCESS_DIED))
    assert isinstance(decision, End) and decision.reason is EndReason.ALREADY_ENDED


@pytest.mark.parametrize(
    ("value", "error"), [(-1, ValueError), (2**32, ValueError), (True, TypeError)]
)
def test_a_maximum_that_is_not_a_count_is_refused(value: object, error: type) -> None:
    with pytest.raises(error, match="max_recoveries"):
        RecoveryPolicy(max_recoveries=value)  # type: ignore[arg-type]


def test_a_chain_s_decisions_name_every_stage_it_lost() -> None:
    died = faulted(FaultKind.PROCESS_DIED, "stage 0", 0)
    link = faulted(FaultKind.EDGE_FAULT, "outbound link: closed", 1)
    step = faulted(FaultKind.STEP_FAILURE, "injected", 2)
    spent = interrupted(recoveries=2)
    decision = RecoveryPolicy().decide_chain(
        [(interrupted(), died), (interrupted(), link), (interrupted(), step), (spent, died)], 3
    )
    assert isinstance(decision, ChainRecovery)
    assert decision.lost_stages == (0, 1, 2)  # 0 died; 1's outbound link to 2
    assert len(decision.recover) == 2
    assert [e.reason for e in decision.end] == [EndReason.NOT_A_LOSS, EndReason.RECOVERIES_SPENT]


# -- on the in-process chain -------------------------------------------------------------------


@pytest.fixture(scope="module")
def facts(tmp_path_factory: pytest.TempPathFactory) -> ModelFacts:
    path: Path = write_model(tmp_path_factory.mktemp("recovery") / "m.gguf", ModelShape(n_layers=3))
    return model_facts_from_gguf(path, max_seq_len=32)


def chain_of(
    facts: ModelFacts,
    make: MakeWorker,
    *spares: tuple[str, int],
    policy: RecoveryPolicy | None = None,
    memory: int = 2**40,
) -> RecoveringChain:
    nodes = [*((f"node-{i}", memory) for i in range(3)), *spares]
    pool = NodePool("orch", tuple(NodeSpec(n, m) for n, m in nodes))
    base = RuntimeConfig(run_id="base", max_tokens=N, max_concurrent_runs=4, prefill_chunk=4)
    placement = Placement.even(["node-0", "node-1", "node-2"])
    return RecoveringChain(facts, base, pool, placement, make, policy)


def reference(_i: int, _node: str) -> Worker:
    return ReferenceWorker()


def expected_tokens(facts: ModelFacts, prompt: tuple[int, ...] = PROMPT) -> list[int]:
    chain = chain_of(facts, reference)
    stream = chain.start("run-0", prompt, sampling=SEEDED)
    chain.pump()
    assert stream.completed
    return stream.tokens


def test_a_closed_link_re_places_both_its_ends_and_the_runs_continue(facts: ModelFacts) -> None:
    expected = expected_tokens(facts)
    chain = chain_of(facts, reference, ("spare-0", 2**40), ("spare-1", 2**40))
    streams = [chain.start(f"run-{k}", PROMPT, sampling=SEEDED) for k in range(2)]
    while len(streams[0].tokens) < 2:
        chain.pump(rounds=1)
    chain.chain.links.rings[2].close()  # stage 2's inbound link, from stage 1
    chain.pump()
    for s in streams:
        assert s.completed, (s.ended, s.finished)
        assert s.tokens == expected
    (replacement,) = chain.replacements
    assert replacement.lost_stages == (1, 2) and replacement.lost_nodes == ()
    assert [s.node_id for s in replacement.plan.stages] == ["node-0", "spare-0", "spare-1"]


def test_after_max_recoveries_the_fault_ends_the_run_as_today(facts: ModelFacts) -> None:
    expected = expected_tokens(facts)
    spares = (("spare-0", 2**40), ("spare-1", 2**40))
    chain = chain_of(facts, reference, *spares, policy=RecoveryPolicy(max_recoveries=1))
    stream = chain.start("run-0", PROMPT, sampling=SEEDED)
    while len(stream.tokens) < 1:
        chain.pump(rounds=1)
    chain.lose(1, "node-1: signal 9")
    while len(stream.tokens) < 3:
        chain.pump(rounds=1)
    chain.lose(2, "node-2: signal 9")
    chain.pump()
    assert stream.run_ids == ["run-0", "run-0~r1"]
    assert isinstance(stream.ended, End) and stream.ended.reason is EndReason.RECOVERIES_SPENT
    finished = stream.finished
    assert finished is not None and finished.outcome is StopReason.FAULTED
    assert finished.fault is not None and finished.fault.kind is FaultKind.PROCESS_DIED
    assert "node-2" in finished.fault.detail
    assert stream.tokens == expected[:3]  # what it got stands; nothing else came


def test_a_worker_failing_as_a_whole_ends_every_run_as_today(facts: ModelFacts) -> None:
    def crash(step: BatchStep) -> str | None:
        return "crash" if step.sequence == 2 else None

    def make(i: int, _node: str) -> Worker:
        return FailingWorker(ReferenceWorker(), crash) if i == 0 else ReferenceWorker()  # type: ignore[return-value]

    chain = chain_of(facts, make, ("spare-0", 2**40))
    streams = [chain.start(f"run-{k}", PROMPT) for k in range(2)]
    chain.pump()
    assert chain.replacements == []
    for s in streams:
        assert isinstance(s.ended, End) and s.ended.reason is EndReason.NOT_A_LOSS
        assert s.finished is not None and s.finished.fault is not None
        assert s.finished.fault.kind is FaultKind.STEP_FAILURE


def test_without_a_spare_or_room_the_runs_end_with_the_planner_s_rejection(
    facts: ModelFacts,
) -> None:
    # Room for exactly the chain's three stages: none for a stage more on any node.
    probe = chain_of(facts, reference)
    plan = probe.start("probe", PROMPT).plan
    need = max(m.total for m in plan_stage_memory(facts, probe.base.worker, plan))
    chain = chain_of(facts, reference, ("tiny", 1), memory=need)
    stream = chain.start("run-0", PROMPT, sampling=SEEDED)
    while len(stream.tokens) < 2:
        chain.pump(rounds=1)
    chain.lose(0, "node-0 on host h0: host unreachable")
    chain.pump()
    assert isinstance(stream.ended, Unplaceable), stream.ended
    assert isinstance(stream.ended.rejection, InsufficientMemory)
    assert "node-0" in str(stream.ended)
    assert stream.finished is not None and stream.finished.outcome is StopReason.FAULTED


def _unreadable(chain: RecoveringChain, hop: int, problem: str) -> None:
    """A record on hop ``hop``'s ring its reader cannot read: a header of an unknown
    version, or garbled (its magic not the format's), once the ring has room."""
    ring = chain.chain.links.rings[hop]
    while (slot := ring.try_reserve()) is None:
        chain.pump(rounds=1)
    header = bytearray(
        ObjectHeader("run-0", 2, 5, ObjectKind.ACTIVATION, HeaderDType.F32, 1, 0).pack()
    )
    if problem == "version":
        struct.pack_into("<H", header, 4, 9)
    else:
        header[:4] = b"\x00\xffXY"
    ring.slot(slot)[: len(header)] = header
    ring.publish(slot)


@pytest.mark.parametrize("problem", ["version", "garbled"])
def test_a_record_a_stage_cannot_read_spends_its_link_and_the_chain_is_made_again(
    facts: ModelFacts, problem: str
) -> None:
    """A record on a stage's inbound link it cannot read (a header of another version,
    garbled): the stage's link is spent and the stage refuses every later provision, so
    the chain is placed again, as for a lost link; the runs and a later one complete.
    (Faulting the runs as a protocol violation not recovered left the chain serving no
    run after them.)"""
    chain = chain_of(facts, reference, ("spare-0", 2**40), ("spare-1", 2**40))
    streams = [chain.start(f"run-{k}", PROMPT, sampling=SEEDED) for k in range(2)]
    while len(streams[0].tokens) < 2:
        chain.pump(rounds=1)
    _unreadable(chain, 2, problem)  # stage 2's inbound link
    chain.pump()
    assert chain.replacements != []
    for s in streams:
        assert s.finished is not None and s.finished.outcome is StopReason.COMPLETED, s.ended
    later = chain.start("run-later", PROMPT, sampling=SEEDED)
    chain.pump()
    assert later.finished is not None and later.finished.outcome is StopReason.COMPLETED


def test_a_token_record_the_orchestrator_cannot_read_ends_the_runs_not_recovered(
    facts: ModelFacts,
) -> None:
    chain = chain_of(facts, reference, ("spare-0", 2**40), ("spare-1", 2**40))
    streams = [chain.start(f"run-{k}", PROMPT, sampling=SEEDED) for k in range(2)]
    chain.pump(rounds=1)
    _unreadable(chain, 3, "version")  # token-out, as from the last stage
    chain.pump()
    assert chain.replacements == []
    broken = chain.chain.orchestrator.broken
    assert broken is not None and broken.kind is FaultKind.PROTOCOL_VIOLATION
    assert broken.detail == (
        "token-out (hop 3): a record it cannot read: bad header: version 9, expected one of (1, 2)"
    )
    for s in streams:
        assert isinstance(s.ended, End) and s.ended.reason is EndReason.NOT_A_LOSS, s.ended
        assert s.ended.detail == f"{broken} is not a lost link"
        finished = s.finished
        assert finished is not None and finished.fault is not None
        assert broken.detail in finished.fault.detail


def test_a_stage_whose_control_frame_cannot_be_read_ends_the_runs_not_recovered(
    facts: ModelFacts,
) -> None:
    """The runtime's notice (``stage_unreadable``), then the stage's end: the chain's
    fault is the protocol's, so no run is re-placed, though its stage is gone."""
    chain = chain_of(facts, reference, ("spare-0", 2**40), ("spare-1", 2**40))
    streams = [chain.start(f"run-{k}", PROMPT, sampling=SEEDED) for k in range(2)]
    while len(streams[0].tokens) < 2:
        chain.pump(rounds=1)
    why = "its frame could not be read (authentic frame, malformed message: not JSON)"
    chain.chain.orchestrator.stage_unreadable(1, why)
    chain.lose(1, f"killed: {why}", host=False)
    chain.pump()
    assert chain.replacements == []
    broken = chain.chain.orchestrator.broken
    assert broken == FaultReason(FaultKind.PROTOCOL_VIOLATION, f"stage 1: {why}")
    for s in streams:
        assert isinstance(s.ended, End) and s.ended.reason is EndReason.NOT_A_LOSS, s.ended
        assert s.finished is not None and s.finished.fault is not None
        assert why in s.finished.fault.detail


def test_a_stage_that_really_died_is_still_recovered(facts: ModelFacts) -> None:
    expected = expected_tokens(facts)
    chain = chain_of(facts, reference, ("spare-0", 2**40), ("spare-1", 2**40))
    stream = chain.start("run-0", PROMPT, sampling=SEEDED)
    while len(stream.tokens) < 2:
        chain.pump(rounds=1)
    chain.lose(1, "node-1: signal 9")
    chain.pump()
    assert stream.completed and stream.tokens == expected
    assert len(chain.replacements) == 1
