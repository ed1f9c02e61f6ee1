"""Several runs on one chain through the chain controllers (CONCURRENT_RUNS.md), in one
process (``tests/support/chain_runs.py``): each run completes with the tokens it
has alone, whatever runs share its batches and however its prompt is chunked; a run
fault ends that run alone; a chain fault ends every run, each naming the cause; every
KV reservation is freed after every outcome."""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest

from runplan import RunPlan, SamplingConfig, Timeouts, wire
from runplan.fsm import orchestrator as ofsm
from runplan.fsm import stage as sfsm
from runplan.messages import BatchCount, FaultKind, StageStopped, StopReason
from runplan.plan import RingSpec
from runtime_core.batch_reports import BatchReports
from runtime_core.chain_orchestrator import RunHandle, RunRefused
from runtime_core.links import LocalLinks
from runtime_core.ring import Ring, ring_bytes
from runtime_core.workers.interface import (
    BatchStep,
    KvCacheUnavailable,
    Worker,
)
from runtime_core.workers.reference.worker import ReferenceWorker
from tests.fixtures.gguf_models import ModelShape, write_model
from tests.support.chain import Chain, plan_for, provisions
from tests.support.chain_runs import (
    ChainRuns,
    Clock,
    ClockTimers,
    FailingWorker,
    ManualTimers,
    TimedWorker,
)

PROMPTS = [
    [5, 77, 300, 12, 9],
    [1, 2, 3],
    [200, 17, 45, 99, 3, 8, 250, 31, 77, 5, 6],
    [42],
    [7, 7, 7, 7],
    [310, 11, 64, 128, 256, 3],
    [9, 8],
    [100, 101, 102, 103, 104, 105, 106, 107, 108],
]
N = 5  # tokens each run generates
MAX_SEQ = 32


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("chain") / "m.gguf", ModelShape(n_layers=3))


def sampling(k: int) -> SamplingConfig:
    return SamplingConfig() if k % 2 == 0 else SamplingConfig(temperature=0.7, top_k=20, seed=k)


def plan(model: Path, k: int, stages: int = 3, **chain: int) -> RunPlan:
    defaults = {"max_concurrent_runs": 8, "max_tokens": N}
    return plan_for(
        model,
        stages,
        max_seq_len=MAX_SEQ,
        run_id=f"run-{k}",
        sampling=sampling(k),
        **{**defaults, **chain},  # type: ignore[arg-type]
    )


def solo(model: Path, k: int) -> list[int]:
    """Run ``k``'s tokens alone, through the workers one step at a time."""
    provs = provisions(model, 3, max_seq_len=MAX_SEQ, run_id=f"run-{k}", sampling=sampling(k))
    chain = Chain.bind(provs)
    try:
        return [o.token_id for o in chain.generate(PROMPTS[k], N)]
    finally:
        chain.release()


@pytest.fixture(scope="module")
def alone(model: Path) -> dict[str, list[int]]:
    return {f"run-{k}": solo(model, k) for k in range(len(PROMPTS))}


def reference(_: int) -> Worker:
    return ReferenceWorker()


def assert_nothing_held(chain: ChainRuns) -> None:
    """Every run is gone from every live stage and its KV cache freed."""
    for i, stage in enumerate(chain.stages):
        if chain.alive[i]:
            assert stage.runs == {}, f"stage {i} holds {sorted(stage.runs)}"
            assert stage.worker.kv_reserved_bytes == 0  # type: ignore[attr-defined]
    assert chain.orchestrator.runs == {}


# -- runs together ---------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [0, 2])
def test_eight_runs_at_once_each_give_their_tokens_alone(
    model: Path, alone: dict[str, list[int]], chunk: int
) -> None:
    chain = ChainRuns(3, reference)
    handles = [
        chain.add(plan(model, k, prefill_chunk=chunk, max_batch_rows=16), PROMPTS[k])
        for k in range(8)
    ]
    chain.pump()
    for h in handles:
        assert h.finished is not None and h.finished.outcome is StopReason.COMPLETED, h.finished
        assert list(h.tokens) == alone[h.run_id]
        assert [t for _, t in chain.tokens[h.run_id]] == alone[h.run_id]
    assert_nothing_held(chain)
    for stage in chain.stages:
        assert max(stage.batch_counts) > 1  # runs shared batches
        assert max(stage.batch_counts) <= 16
    if chunk:  # prompts travelled in chunks of at most 2 rows
        assert all(f["rows"] <= 2 for f in chain.of("injected") if f["sequence"] == 0)


def test_prefill_chunks_pipeline_and_decode_rows_join_their_batches(
    model: Path, alone: dict[str, list[int]]
) -> None:
    """Stage 1 runs chunk 0 of a prompt before stage 0 runs its chunk 2, and a batch on
    stage 0 holds a decode row of one run and a prefill chunk of another."""
    chain = ChainRuns(3, reference)
    first = chain.add(plan(model, 0, prefill_chunk=3), PROMPTS[0])
    chain.pump()  # run-0 is done: it decodes no more; start another to overlap
    assert first.finished is not None
    a = chain.add(plan(model, 1, prefill_chunk=3), PROMPTS[1])
    b = chain.add(plan(model, 2, prefill_chunk=3), PROMPTS[2])  # 11 tokens: 4 chunks
    chain.pump()
    assert list(a.tokens) == alone["run-1"] and list(b.tokens) == alone["run-2"]
    batches = [(a, f) for a, k, f in chain.traces if k == "batch"]
    loaded = [(a, f) for a, k, f in chain.traces if k == "loaded" and f["run_id"] == "run-2"]
    order = [(a, f["chunk"]) for a, f in loaded if f["sequence"] == 0]
    assert order.index(("node-1", 0)) < order.index(("node-0", 2))
    mixed = [f for node, f in batches if node == "node-0" and {"run-1", "run-2"} <= set(f["runs"])]
    assert mixed, "no batch of stage 0 held both runs"


class RecordingTimers(ManualTimers):
    """``ManualTimers`` that also keep every timer started, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.started: list[tuple[Any, int]] = []

    def start(self, run_id: str, timer: Any, ms: int) -> None:
        self.started.append((timer, ms))
        super().start(run_id, timer, ms)


@pytest.mark.parametrize("runs", [1, 8])
def test_each_step_s_time_limit_is_that_of_its_batch(model: Path, runs: int) -> None:
    """A run alone: a stage's step timer grows with the rows of the record it runs (a
    chunk's rows in a prefill in chunks), and the orchestrator's token timer of the
    prompt covers one chunk's limit per step through the pipeline. A run whose stages
    hold other runs too: every step's limit is that of a whole batch
    (``max_batch_rows``), and a token waits through ``Timeouts.shared_batches`` batches
    a step: 16 runs a batch at most (its rows: runs shorter than this one may fill what
    its cache leaves of the KV budget), whose outputs the next stage takes over 8 of its
    batches (2-slot rings), 2 + 8."""
    chain = ChainRuns(3, reference)
    chain.stages[0].timers = chain.stage_timers[0] = stage_0 = RecordingTimers()
    chain.orchestrator.timers = chain.orchestrator_timers = orchestrator = RecordingTimers()
    p = plan(model, 2, prefill_chunk=3, max_concurrent_runs=runs, max_batch_rows=16)
    handle = chain.add(p, PROMPTS[2])  # 11 tokens: chunks of 3, 3, 3 and 2 rows
    chain.pump()
    assert handle.finished is not None and handle.finished.outcome is StopReason.COMPLETED
    t = p.timeouts
    assert t.step_row_ms > 0  # else every limit below would be the same
    steps = [ms for timer, ms in stage_0.started if timer is sfsm.Timer.STEP]
    tokens = [ms for timer, ms in orchestrator.started if timer is ofsm.Timer.TOKEN]
    if runs == 1:
        limits = [t.step_limit_ms(rows) for rows in (3, 3, 3, 2)]
        assert steps == limits + [t.step_limit_ms(1)] * (N - 1)
        assert tokens[0] == t.step_limit_ms(3) * (3 + 4 - 1)
        assert set(tokens[1:]) == {t.step_limit_ms(1) * 3}
    else:
        assert set(steps) == {10 * t.step_limit_ms(16)}
        assert len(steps) == 4 + N - 1
        assert tokens[0] == 10 * t.step_limit_ms(16) * (3 + 4 - 1)
        assert set(tokens[1:]) == {10 * t.step_limit_ms(16) * 3}


def _timed_chain(
    model: Path, tight: Timeouts, took: Callable[[int], int]
) -> tuple[ChainRuns, Clock, list[ClockTimers], list[RunHandle]]:
    """Eight runs (batches of up to 16 rows) on 3 stages working in parallel, a batch
    of ``rows`` rows taking ``took(rows)`` ms, every timer against the chain's clock."""
    clock = Clock()
    chain = ChainRuns(3, lambda i: TimedWorker(ReferenceWorker(), clock, i, took))
    timers = [ClockTimers(clock, i) for i in range(3)] + [ClockTimers(clock, None)]
    for stage, stage_timers in zip(chain.stages, timers, strict=False):
        stage.timers = stage_timers
    chain.orchestrator.timers = timers[3]
    handles = [
        chain.add(
            attrs.evolve(plan(model, k, prefill_chunk=2, max_batch_rows=16), timeouts=tight),
            PROMPTS[k],
        )
        for k in range(8)
    ]
    return chain, clock, timers, handles


def _run_timed(chain: ChainRuns, clock: Clock, until: Callable[[], bool] = lambda: False) -> None:
    """Rounds of the chain, the clock ticking after each, until nothing runs or
    ``until()``."""
    for _ in range(100_000):
        if until() or not chain._round():
            return
        clock.tick()
    raise AssertionError("the chain still had work")


def _overruns(timers: list[ClockTimers]) -> list[tuple[int | None, Any]]:
    return [(ts.stage_index, o) for ts in timers for o in ts.overruns]


def test_batches_that_take_just_under_their_rows_limit_run_out_no_timer(model: Path) -> None:
    """Eight runs share the batches of 3 stages working in parallel, each batch taking 1
    ms less than a step of all its rows may (tight timeouts): no stage's step timer and
    no orchestrator's token timer runs out (limits of a record's own rows would: a
    decode row shares a batch of up to 16 rows)."""
    tight = Timeouts(step_ms=100, step_row_ms=10)
    chain, clock, timers, handles = _timed_chain(model, tight, lambda r: tight.step_limit_ms(r) - 1)
    _run_timed(chain, clock)
    assert all(h.finished and h.finished.outcome is StopReason.COMPLETED for h in handles)
    assert max(max(stage.batch_counts) for stage in chain.stages) > 1  # runs shared batches
    assert _overruns(timers) == []


def test_a_run_cancelled_while_the_stages_run_shared_batches_stops_in_time(
    model: Path,
) -> None:
    """A run cancelled while the stages run batches of others, each batch from then on
    taking 1 ms less than a batch of 16 rows may: a stage reads its ``StopRun`` only
    after the batch in progress, and runs one more before it releases the run, far
    longer than ``stop_ms``. The orchestrator's stop timer allows for both
    (``stop_limit_ms``): no stop timer runs out (before: every one did), the run ends
    CANCELLED with every stage's stop confirmed, the others complete. No token timer runs
    out either: with every batch as long as a full one, a batch's 8 outputs reach the
    next stage over 4 of its batches (2-slot rings), which ``Timeouts.shared_batches``
    allows for (before: a fixed 3 batches a step, and a decoded token overran it)."""
    tight = Timeouts(step_ms=100, step_row_ms=10, stop_ms=50)
    full = [False]  # every batch as long as a full one may be

    def took(rows: int) -> int:
        return tight.step_limit_ms(16 if full[0] else rows) - 1

    chain, clock, timers, handles = _timed_chain(model, tight, took)
    victim = handles[3]
    _run_timed(chain, clock, until=lambda: len(chain.tokens[victim.run_id]) >= 2)
    assert max(max(stage.batch_counts) for stage in chain.stages) > 1  # runs share batches
    full[0] = True
    chain.orchestrator.cancel(victim.run_id)
    _run_timed(chain, clock)
    assert victim.finished is not None and victim.finished.outcome is StopReason.CANCELLED
    assert victim.finished.unconfirmed_stages == ()
    others = [h for h in handles if h is not victim]
    assert all(h.finished and h.finished.outcome is StopReason.COMPLETED for h in others)
    stops = [m for m in timers[3].measured if m[1] is ofsm.Timer.STOP]
    assert len(stops) == 8  # every run's teardown timed, the victim's amid full batches
    assert [m for m in stops if m[3] > m[2]] == [], stops
    tokens = [m for ts in timers for m in ts.measured if m[1] is ofsm.Timer.TOKEN]
    assert len(tokens) >= 7 * N, len(tokens)  # every token of the 7 others timed
    assert _overruns(timers) == []


def _sizes(stage: object) -> dict[str, int]:
    """The length of each container a stage controller holds, but the ids of the runs it
    stopped (one a run, not a batch)."""
    kinds = (list, dict, deque, set, frozenset)
    return {k: len(v) for k, v in vars(stage).items() if isinstance(v, kinds) and k != "stale_runs"}


def _run_0(model: Path, run_id: str) -> RunPlan:
    """Run 0's plan of 12 tokens under another id."""
    return plan_for(
        model,
        3,
        max_seq_len=MAX_SEQ,
        run_id=run_id,
        sampling=sampling(0),
        max_concurrent_runs=8,
        max_tokens=12,
    )


def test_a_stage_s_batch_records_do_not_grow_with_its_batches(model: Path) -> None:
    """A long-lived stage keeps its batches by size, not one entry per batch: after a
    run, the same run again (the same batch sizes) adds to no container of any stage's
    controller (before: ``batch_rows`` grew by one entry per batch)."""
    chain = ChainRuns(3, reference)
    first = chain.add(_run_0(model, "first"), PROMPTS[0])
    chain.pump()
    assert first.finished is not None and first.finished.outcome is StopReason.COMPLETED
    before = [(_sizes(s), s.batches) for s in chain.stages]
    again = chain.add(_run_0(model, "again"), PROMPTS[0])
    chain.pump()
    assert again.finished is not None and again.finished.outcome is StopReason.COMPLETED
    assert list(again.tokens) == list(first.tokens)  # the same steps, batch for batch
    for (sizes, batches), stage in zip(before, chain.stages, strict=True):
        assert stage.batches >= batches + 12  # a batch per token at least
        assert _sizes(stage) == sizes
    assert sum(chain.stages[0].batch_counts.values()) == chain.stages[0].batches


def test_runs_beyond_the_budget_wait_and_then_run(model: Path, alone: dict[str, list[int]]) -> None:
    chain = ChainRuns(3, reference)
    handles = [chain.add(plan(model, k, max_concurrent_runs=2), PROMPTS[k]) for k in range(4)]
    assert [h.queued for h in handles] == [False, False, True, True]
    most = 0
    for _ in range(10_000):
        most = max(most, *(len(s.runs) for s in chain.stages))
        if not chain._round():
            break
    assert most == 2
    for h in handles:
        assert list(h.tokens) == alone[h.run_id]
    assert_nothing_held(chain)


def test_a_run_that_could_never_fit_is_refused_at_once(model: Path) -> None:
    chain = ChainRuns(3, reference)
    p = plan(model, 0)
    big = attrs.evolve(p.stages[1], kv_bytes=p.stages[1].kv_budget_bytes + 1)
    with pytest.raises(RunRefused, match="stage 1"):
        chain.add(attrs.evolve(p, stages=(p.stages[0], big, p.stages[2])), PROMPTS[0])
    assert chain.orchestrator.runs == {}


# -- a run fault ends that run alone -----------------------------------------------------


def run_all(chain: ChainRuns, model: Path, runs: Sequence[int], **kw: int) -> dict[str, Any]:
    return {f"run-{k}": chain.add(plan(model, k, **kw), PROMPTS[k]) for k in runs}


def assert_others_complete(handles: dict[str, Any], alone: dict[str, list[int]], but: str) -> None:
    for run_id, h in handles.items():
        if run_id != but:
            assert h.finished.outcome is StopReason.COMPLETED, (run_id, h.finished)
            assert list(h.tokens) == alone[run_id]


def test_a_forged_record_with_a_wrong_sequence_ends_only_its_run(
    model: Path, alone: dict[str, list[int]]
) -> None:
    chain = ChainRuns(3, reference)
    handles = run_all(chain, model, range(4))
    for _ in range(6):
        chain._round()
    # run-1's record 9 on stage 1's inbound link: a sequence no stage sent.
    edge = handles["run-1"].plan.stages[1].inbound_edge
    chain.forge(1, "run-1", edge, 9)
    chain.pump()
    bad = handles["run-1"].finished
    assert bad.outcome is StopReason.FAULTED and bad.fault.kind is FaultKind.SEQUENCE_VIOLATION
    assert bad.fault_stage == 1 and "sequence 9" in bad.fault.detail
    assert_others_complete(handles, alone, "run-1")
    assert_nothing_held(chain)


def test_records_of_unknown_and_finished_runs_are_rejected_and_the_link_stays_up(
    model: Path, alone: dict[str, list[int]]
) -> None:
    chain = ChainRuns(3, reference)
    handles = run_all(chain, model, [0])
    chain.pump()
    handles |= run_all(chain, model, [1, 2])
    chain._round()
    chain.forge(1, "never-provisioned", 2, 0)
    chain.forge(1, "run-0", 2, 1)  # run-0 finished: stale on every stage
    chain.pump()
    rejects = [f for f in chain.of("reject", "node-1")]
    assert [f["reason"] for f in rejects] == ["UNKNOWN_RUN", "STALE_RUN"]
    assert_others_complete(handles, alone, "none")
    assert_nothing_held(chain)


class RefusingWorker:
    """A worker whose budget has no room for ``refuse`` (a port: the stage cannot
    reserve that run's cache, whatever the orchestrator counted)."""

    def __init__(self, inner: Worker, refuse: str) -> None:
        self.inner = inner
        self.refuse = refuse

    def open_run(self, provision: Any) -> None:
        if provision.run_id == self.refuse:
            raise KvCacheUnavailable(provision.run_id, provision.kv_bytes, 0, 1)
        self.inner.open_run(provision)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_run_whose_cache_cannot_be_reserved_is_refused_alone(
    model: Path, alone: dict[str, list[int]]
) -> None:
    chain = ChainRuns(
        3, lambda i: RefusingWorker(ReferenceWorker(), "run-2") if i == 1 else ReferenceWorker()
    )
    handles = run_all(chain, model, range(4))
    chain.pump()
    refused = handles["run-2"].finished
    assert refused.outcome is StopReason.FAULTED
    assert refused.fault.kind is FaultKind.KV_CACHE_UNAVAILABLE and refused.fault_stage == 1
    assert "node-1" in refused.fault.detail and "0 of 1 free" in refused.fault.detail
    assert refused.unconfirmed_stages == ()  # stage 1 was not waited for; 0 and 2 stopped
    assert "run-2" not in chain.stages[1].stale_runs  # nothing of it kept: it may come again
    assert_others_complete(handles, alone, "run-2")
    assert_nothing_held(chain)


def test_a_cancelled_run_ends_alone(model: Path, alone: dict[str, list[int]]) -> None:
    chain = ChainRuns(3, reference)
    handles = run_all(chain, model, range(4))
    for _ in range(8):
        chain._round()
    chain.orchestrator.cancel("run-3")
    chain.pump()
    assert handles["run-3"].finished.outcome is StopReason.CANCELLED
    assert_others_complete(handles, alone, "run-3")
    assert_nothing_held(chain)


def test_the_orchestrator_learns_each_stage_s_batches_once_from_its_stops(
    model: Path, alone: dict[str, list[int]]
) -> None:
    """Eight runs sharing batches, one cancelled on the way: each stage's
    ``StageStopped`` messages (through the wire) carry the batches it ran since its
    previous one, so once every run stopped the orchestrator's counts by rows are
    exactly each stage's batches, each counted once; a stop of another sender adds
    nothing."""
    chain = ChainRuns(3, reference)
    handles = run_all(chain, model, range(8), prefill_chunk=2, max_batch_rows=16)
    for _ in range(8):
        chain._round()
    chain.orchestrator.cancel("run-3")
    chain.pump()
    assert handles["run-3"].finished.outcome is StopReason.CANCELLED
    assert_others_complete(handles, alone, "run-3")
    counts = chain.orchestrator.batch_counts
    for i, stage in enumerate(chain.stages):
        assert max(stage.batch_counts) > 1  # runs shared batches
        assert counts[i] == stage.batch_counts, i
        assert sum(counts[i].values()) == stage.batches
    # A stop naming stage 0 from stage 1's node, for a run still held: rejected,
    # counted nowhere.
    held = chain.add(plan(model, 8), PROMPTS[0])
    chain._round()
    forged = StageStopped(held.run_id, 0, "node-0", (BatchCount(4, 1000),))
    chain.orchestrator.handle(ofsm.Received("node-1", forged))
    assert chain.orchestrator.batch_counts == counts
    assert any("StageStopped" in f["reason"] for f in chain.of("reject", "orch"))


def test_a_stop_that_comes_after_its_run_ended_still_reports_its_batches_once(
    model: Path,
) -> None:
    """A stage slow to stop a run: the run's stop bound runs out and the run ends without
    that stage's ``StageStopped``. When it comes, the batches it reports are counted
    (they were lost: the stage reports each batch once), once however often it is
    delivered; one from another node, or for a stage that stopped in time, adds
    nothing."""
    chain = ChainRuns(3, reference)
    handle = chain.add(plan(model, 0), PROMPTS[0])
    while handle.machine.state is not ofsm.State.TEARING_DOWN:
        assert chain._round()
    chain.paused.add(2)  # stage 2 took its StopRun but does not release the run yet
    chain.pump()
    chain.fire(None, "run-0", ofsm.Timer.STOP)
    assert handle.finished is not None and handle.finished.outcome is StopReason.COMPLETED
    assert chain.orchestrator.runs == {}
    assert 2 not in chain.orchestrator.batch_counts
    forged = StageStopped("run-0", 2, "node-2", (BatchCount(1, 1000),))
    chain.orchestrator.handle(ofsm.Received("node-1", forged))
    stopped_in_time = StageStopped("run-0", 1, "node-1", (BatchCount(1, 1000),))
    chain.orchestrator.handle(ofsm.Received("node-1", stopped_in_time))
    assert 2 not in chain.orchestrator.batch_counts
    assert chain.orchestrator.batch_counts[1] == chain.stages[1].batch_counts
    chain.paused.clear()
    chain.stages[2].run_release()  # stage 2 releases the run and reports its batches
    sender, data = chain.to_orchestrator[-1]
    late = wire.loads(data)
    assert sender == "node-2" and isinstance(late, StageStopped) and late.batches
    chain.pump()
    for i, stage in enumerate(chain.stages):
        assert chain.orchestrator.batch_counts[i] == stage.batch_counts, i
    chain.orchestrator.handle(ofsm.Received("node-2", late))  # delivered twice
    assert chain.orchestrator.batch_counts[2] == chain.stages[2].batch_counts
    assert_nothing_held(chain)


def test_the_stops_ended_runs_still_owe_are_a_bounded_set() -> None:
    """The stages an ended run still waited for are kept for the last ``kept`` runs
    ended so: an older one's late stop is rejected, counted nowhere."""
    reports = BatchReports(kept=2)
    for k in range(3):
        reports.awaiting(f"run-{k}", {1: "node-1"})
    stop = StageStopped("run-0", 1, "node-1", (BatchCount(2, 3),))
    assert reports.late("node-1", stop) is not None and reports.counts == {}
    assert reports.late("node-1", attrs.evolve(stop, run_id="run-2")) is None
    assert reports.counts == {1: {2: 3}}
    with pytest.raises(ValueError, match="at least 1"):
        BatchReports(kept=0)


def test_a_step_timeout_ends_only_its_run(model: Path, alone: dict[str, list[int]]) -> None:
    """While stage 2 takes nothing, stage 1's outputs wait for room on its ring (2
    slots): their steps' timers run. When one runs out, only that run faults."""
    chain = ChainRuns(3, reference)
    handles = run_all(chain, model, range(4))
    while any(h.machine.state is not ofsm.State.RUNNING for h in handles.values()):
        chain._round()  # every stage set up, the prompts injected
    chain.paused.add(2)
    chain.pump()
    running = [r for (r, t) in chain.stage_timers[1].running if t is sfsm.Timer.STEP]
    assert running, "no step of stage 1 is waiting"
    late_run = running[0]
    chain.fire(1, late_run, sfsm.Timer.STEP)
    chain.paused.clear()
    chain.pump()
    late = handles[late_run].finished
    assert late.outcome is StopReason.FAULTED and late.fault.kind is FaultKind.TIMEOUT
    assert late.fault_stage == 1
    assert_others_complete(handles, alone, late_run)
    assert_nothing_held(chain)


def test_a_step_failing_for_one_run_ends_that_run_alone(
    model: Path, alone: dict[str, list[int]]
) -> None:
    def fail(step: BatchStep) -> str | None:
        return "run" if (step.run_id, step.sequence) == ("run-2", 2) else None

    chain = ChainRuns(
        3, lambda i: FailingWorker(ReferenceWorker(), fail) if i == 2 else ReferenceWorker()
    )
    handles = run_all(chain, model, range(4))
    chain.pump()
    failed = handles["run-2"].finished
    assert failed.outcome is StopReason.FAULTED and failed.fault.kind is FaultKind.STEP_FAILURE
    assert failed.fault_stage == 2 and "injected" in failed.fault.detail
    assert_others_complete(handles, alone, "run-2")
    assert_nothing_held(chain)


# -- a chain fault ends every run ----------------------------------------------------------


def assert_every_run_faulted(handles: dict[str, Any], kind: FaultKind, *words: str) -> None:
    for run_id, h in handles.items():
        assert h.finished is not None, run_id
        assert h.finished.outcome is StopReason.FAULTED, (run_id, h.finished)
        assert h.finished.fault.kind is kind, (run_id, h.finished.fault)
        for word in words:
            assert word in h.finished.fault.detail, (run_id, h.finished.fault)


def test_a_stage_killed_with_four_runs_in_flight_ends_them_all_naming_it(model: Path) -> None:
    chain = ChainRuns(3, reference)
    handles = run_all(chain, model, range(4), max_concurrent_runs=4)
    queued = run_all(chain, model, [4], max_concurrent_runs=4)
    for _ in range(6):
        chain._round()
    chain.kill(1, "node-1 on host h1: process exited with signal 9")
    chain.pump()
    assert_every_run_faulted(handles, FaultKind.PROCESS_DIED, "stage 1", "node-1", "h1", "signal 9")
    assert all(h.finished.fault_stage == 1 for h in handles.values())
    # the run still waiting for room ends with the same cause; nothing starts any more
    assert_every_run_faulted(queued, FaultKind.PROCESS_DIED, "stage 1", "signal 9")
    assert_nothing_held(chain)


def test_a_closed_link_ends_every_run(model: Path) -> None:
    chain = ChainRuns(3, reference)
    handles = run_all(chain, model, range(3))
    for _ in range(5):
        chain._round()
    chain.links.rings[2].close()  # stage 2's inbound link
    chain.pump()
    assert_every_run_faulted(handles, FaultKind.EDGE_FAULT, "link", "closed")
    assert {h.finished.fault_stage for h in handles.values()} <= {1, 2}
    assert_nothing_held(chain)


class _SharedCounterLinks(LocalLinks):
    """A chain's links whose rings keep their counters in their buffers, as a ring in
    shared memory does, where another process of the stages' user can change them."""

    def __init__(self) -> None:
        super().__init__()
        self.buffers: dict[int, bytearray] = {}

    def new_ring(self, hop: int, spec: RingSpec) -> Ring:
        self.buffers[hop] = bytearray(ring_bytes(spec))
        return Ring(spec, self.buffers[hop])


def test_a_released_counter_changed_by_another_hand_ends_every_run_naming_the_link(
    model: Path,
) -> None:
    """Only a ring's consumer writes its ``released`` counter: one changed under it (by
    another process of the user, in shared memory) made the consumer's next release
    raise ``RingError``, which nothing caught (the stage process's traceback, and a run
    faulted as a stage that died). It is the link's fault, naming it."""
    links = _SharedCounterLinks()
    chain = ChainRuns(3, reference, links=links)
    handles = run_all(chain, model, range(3))
    for _ in range(5):
        chain._round()
    struct.pack_into("<Q", links.buffers[2], 8, 1 << 40)  # stage 2's inbound link
    chain.pump()
    assert_every_run_faulted(
        handles,
        FaultKind.EDGE_FAULT,
        "hop 2",
        "released counter was changed",
        "reads 1099511627776",
    )
    assert {h.finished.fault_stage for h in handles.values()} == {2}
    assert_nothing_held(chain)


def test_a_worker_failing_as_a_whole_ends_every_run(model: Path) -> None:
    def crash(step: BatchStep) -> str | None:
        return "crash" if step.sequence == 2 else None

    chain = ChainRuns(
        3, lambda i: FailingWorker(ReferenceWorker(), crash) if i == 0 else ReferenceWorker()
    )
    handles = run_all(chain, model, range(4))
    chain.pump()
    assert_every_run_faulted(handles, FaultKind.STEP_FAILURE, "the device is gone")
    assert {h.finished.fault_stage for h in handles.values()} == {0}
    assert_nothing_held(chain)


def test_the_same_runs_on_one_stage_and_on_three_give_the_same_tokens(
    model: Path, alone: dict[str, list[int]]
) -> None:
    chain = ChainRuns(1, reference)
    handles = [chain.add(plan(model, k, stages=1, prefill_chunk=4), PROMPTS[k]) for k in range(8)]
    chain.pump()
    for h in handles:
        assert list(h.tokens) == alone[h.run_id]
    assert_nothing_held(chain)


def test_a_long_prompt_s_chunks_do_not_hold_back_decoding_runs(model: Path) -> None:
    """A run decoding while another's long prompt arrives in many chunks: its fed-back
    tokens go onto token-in ahead of the prompt's chunks still waiting there, so stage 0
    runs it every few batches (not after the whole prompt), and both runs give the
    tokens they give alone."""
    long_prompt = [(7 * i) % 300 + 1 for i in range(24)]  # 24 chunks of 1 row
    decoding = plan(model, 0, stages=2, max_tokens=20)
    prefilling = plan(model, 1, stages=2, prefill_chunk=1)

    def alone_tokens(p: RunPlan, prompt: list[int]) -> list[int]:
        chain = ChainRuns(2, reference)
        handle = chain.add(p, prompt)
        chain.pump()
        return list(handle.tokens)

    chain = ChainRuns(2, reference)
    a = chain.add(decoding, PROMPTS[1])
    while len(chain.tokens["run-0"]) < 3:  # run-0 decodes
        assert chain._round()
    b = chain.add(prefilling, long_prompt)
    chain.pump()
    assert list(a.tokens) == alone_tokens(decoding, PROMPTS[1])
    assert list(b.tokens) == alone_tokens(prefilling, long_prompt)
    stage_0 = [f["runs"] for node, k, f in chain.traces if k == "batch" and node == "node-0"]
    first = next(i for i, runs in enumerate(stage_0) if "run-1" in runs)
    last_a = max(i for i, runs in enumerate(stage_0) if "run-0" in runs)
    assert last_a > first + 3  # run-0 decoded while run-1's prompt went in
    without_a, longest = 0, 0
    for runs in stage_0[first : last_a + 1]:
        without_a = 0 if "run-0" in runs else without_a + 1
        longest = max(longest, without_a)
    # run-0's next token is injected the round after its last was consumed: stage 0
    # runs one batch per round, and the token passes 2 stages and the orchestrator.
    assert longest <= 3, stage_0[first : last_a + 1]
