"""One ``ChainStageController`` holding many runs (CONCURRENT_RUNS.md), driven by
Hypothesis: runs provisioned (some past the KV budget, some with ids already stopped),
records arriving in and out of their runs' order (chunked prefills, forged sequences,
records of unknown and stale runs, more rows than a batch holds), batches, a next stage
that takes records or not (backpressure), step timers running out, runs stopped and
released. One ``@invariant`` per guarantee:

- routing: a step runs only on its own run's record (the worker checks each step's data
  against what was written for that run, sequence and chunk);
- stale runs are never held, and what the stage rejects changes nothing it holds;
- the scheduler: at most one step per run, at most ``max_batch_rows`` rows, each run's
  steps in its order;
- one batch at a time: no worker call while a batch's outputs wait;
- every reservation freed: the worker's reserved bytes are exactly the held runs' that
  reserved, and nothing once every run has stopped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import attrs
import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from runplan import ProvisionStage, WorkerCapabilities, provision_all
from runplan.fsm import stage as s
from runplan.messages import StopReason, StopRun
from runplan.plan import ObjectKind
from runplan.record_header import HeaderDType
from runtime_core.chain_stage import ChainStageController, RunTimerFired
from runtime_core.links import LinkReceiver, LinkSender
from runtime_core.ring import LocalRing
from runtime_core.workers.interface import BatchStep, StepFailure, StepResult
from runtime_core.workers.worker_runs import KvBudget, RunCursor, rows_of
from tests.support.chain_runs import ManualTimers
from tests.support.strategies import ORCHESTRATOR, small_plan

RUNS = [f"run-{k}" for k in range(5)]
MAX_ROWS = 4
BUDGET_RUNS = 3  # the stage's KV budget holds three runs' caches


def _value(run_id: str, sequence: int, chunk: int) -> float:
    """What a record of ``run_id``'s ``sequence`` and ``chunk`` carries in every element."""
    return float(RUNS.index(run_id) * 1000 + sequence * 10 + chunk)


class CheckingWorker:
    """A worker that checks each step's data is its own run's, and records every call."""

    capabilities: ClassVar[WorkerCapabilities] = WorkerCapabilities()

    def __init__(self) -> None:
        self.budget = KvBudget()
        self.cursors: dict[str, RunCursor] = {}
        self.kv_of: dict[str, int] = {}
        self.batches: list[list[tuple[str, int, int, int]]] = []
        self.foreign: list[str] = []
        self.busy_calls = 0  # calls made while a batch's outputs waited
        self.stage: ChainStageController | None = None

    def configure(self, provision: ProvisionStage) -> None:
        self.budget.budget_bytes = provision.kv_budget_bytes

    def bind(self, gguf_source: Any, progress: Any = None) -> None:
        pass

    def open_run(self, provision: ProvisionStage) -> None:
        self.budget.reserve(provision.run_id, provision.kv_bytes)
        self.cursors[provision.run_id] = RunCursor(provision.kv_positions, 64)

    def close_run(self, run_id: str) -> None:
        self.budget.free(run_id)
        self.cursors.pop(run_id, None)

    @property
    def kv_reserved_bytes(self) -> int:
        return self.budget.reserved_bytes

    def execute_batch(self, steps: Sequence[BatchStep]) -> tuple[StepResult, ...]:
        if self.stage is not None and self.stage.output_pending:
            self.busy_calls += 1
        self.batches.append([(x.run_id, x.sequence, x.chunk_index, rows_of(x.data)) for x in steps])
        out: list[StepResult] = []
        for step in steps:
            expected = _value(step.run_id, step.sequence, step.chunk_index)
            if not np.all(step.data == expected):
                self.foreign.append(step.run_id)
            cursor = self.cursors[step.run_id]
            rows = rows_of(step.data)
            placed = cursor.place(step, rows)
            if isinstance(placed, StepFailure):
                out.append(placed)
                continue
            cursor.advance(step, rows)
            out.append(np.asarray(step.data + 0.5, dtype=np.float32))
        return tuple(out)

    def release(self) -> None:
        for run_id in list(self.cursors):
            self.close_run(run_id)

    def execute_step(self, sequence: int, data: Any) -> Any:
        raise AssertionError("a chain's stage runs batches")


class Rings:
    """The stage's two links: its inbound ring (written by the test) and its outbound
    ring (read by the test, as the next stage)."""

    def __init__(self) -> None:
        self.inbound: LocalRing | None = None
        self.outbound: LocalRing | None = None

    def open_inbound(self, provision: ProvisionStage) -> LinkReceiver:
        self.inbound = LocalRing(provision.inbound.ring_spec)
        return LinkReceiver(self.inbound)

    def open_outbound(self, provision: ProvisionStage) -> LinkSender | None:
        self.outbound = LocalRing(provision.outbound.ring_spec)
        return LinkSender(self.outbound, ObjectKind.ACTIVATION)


class ChainStage(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        plan = small_plan(3)
        base = provision_all(plan)[1]  # a middle stage: activations in and out
        ring = attrs.evolve(base.inbound.ring_spec, slot_count=6)
        base = attrs.evolve(base, inbound=attrs.evolve(base.inbound, ring_spec=ring))
        budget = BUDGET_RUNS * base.kv_bytes
        self.provisions = {
            r: attrs.evolve(base, run_id=r, kv_budget_bytes=budget, max_batch_rows=MAX_ROWS)
            for r in RUNS
        }
        self.hidden = base.model.hidden_dim
        self.worker = CheckingWorker()
        self.rings = Rings()
        self.sent: list[Any] = []
        self.timers = ManualTimers()
        self.traces: list[tuple[str, dict[str, Any]]] = []
        self.stage = ChainStageController(
            base.node_id,
            ORCHESTRATOR,
            self.worker,  # type: ignore[arg-type]
            self.rings,
            self,
            self.timers,
            trace=lambda kind, fields: self.traces.append((kind, fields)),
        )
        self.worker.stage = self.stage
        self.written: dict[str, list[tuple[int, int]]] = {r: [] for r in RUNS}  # (seq, chunk)
        self.out = LinkReceiver  # the next stage's end, made once the ring exists
        self.reader: LinkReceiver | None = None

    # ControlChannel
    def send(self, message: Any) -> None:
        self.sent.append(message)

    # -- rules ---------------------------------------------------------------------------
    @rule(runs=st.lists(st.sampled_from(RUNS), min_size=1, max_size=3))
    def provision(self, runs: list[str]) -> None:
        """Provisions, and the stage's setup of them (a run past the budget is refused)."""
        for run in runs:
            before = dict(self.stage.runs)
            stale = run in self.stage.stale_runs
            self.stage.handle(s.Received(ORCHESTRATOR, self.provisions[run]))
            if run in before or stale:
                assert self.stage.runs == before  # refused: nothing changes
        self.stage.run_setup()
        self.stage.try_attach_links()
        if self.reader is None and self.rings.outbound is not None:
            self.reader = LinkReceiver(self.rings.outbound)

    @rule(data=st.data(), n=st.integers(1, 4))
    def write(self, data: st.DataObject, n: int) -> None:
        """Records on the inbound link: mostly held runs' next ones."""
        for _ in range(n):
            how = data.draw(st.sampled_from(["next"] * 8 + ["wrong-sequence", "too-many-rows"]))
            self._write_one(
                data, how, data.draw(st.integers(1, 3)), data.draw(st.integers(1, MAX_ROWS))
            )

    def _write_one(self, data: st.DataObject, how: str, chunks: int, rows: int) -> None:
        held = sorted(self.stage.runs)
        others = [*RUNS, "never-provisioned"]
        run = data.draw(
            st.sampled_from(held)
            if held and data.draw(st.integers(0, 4))
            else st.sampled_from(others)
        )
        ring = self.rings.inbound
        if ring is None:
            return
        done = self.written.get(run, [])
        seq, chunk, count = 0, 0, chunks
        if done:
            last_seq, last_chunk = done[-1][0], done[-1][1]
            last_count = done[-1][2] if len(done[-1]) > 2 else 1  # type: ignore[misc]
            if last_seq == 0 and last_chunk + 1 < last_count:
                seq, chunk, count = 0, last_chunk + 1, last_count
            else:
                seq, chunk, count = last_seq + 1, 0, 1
        if seq > 0:
            rows = 1
        if how == "wrong-sequence":
            seq += 5
            chunk, count = 0, 1
        if how == "too-many-rows":
            seq, chunk, count, rows = 0, 0, 1, MAX_ROWS + 1
        data = np.full(
            (rows, self.hidden), _value(run, seq, chunk) if run in RUNS else 0.0, np.float32
        )
        edge = self.provisions[RUNS[0]].inbound.edge_id
        sent = LinkSender(ring, ObjectKind.ACTIVATION).try_send(
            run, edge, seq, rows, HeaderDType.F32, data.tobytes(), chunk, count
        )
        if sent and run in self.stage.runs and how == "next":
            self.written[run].append((seq, chunk, count))  # type: ignore[arg-type]

    @rule()
    def poll_and_batch(self) -> None:
        """The stage's loop: take what arrived, run a batch, publish what fits."""
        while self.stage.poll_inbound():
            pass
        for _ in range(3):
            if self.stage.batch_ready:
                self.stage.run_batch()
            self.stage.try_publish_outputs()

    @rule(n=st.sampled_from([0, 1, 3, 3]))
    def next_stage_takes(self, n: int) -> None:
        """The next stage takes ``n`` records (0: it is slow, the ring stays full)."""
        for _ in range(n):
            if self.reader is None or self.reader.try_take() is None:
                break
        self.stage.try_publish_outputs()

    @rule(run=st.sampled_from(RUNS), now=st.integers(0, 3))
    def stop(self, run: str, now: int) -> None:
        """StopRun (one draw in four: runs mostly get somewhere first)."""
        if now == 0:
            self.stage.handle(s.Received(ORCHESTRATOR, StopRun(run, StopReason.CANCELLED)))

    @rule()
    def release(self) -> None:
        self.stage.run_release()

    @precondition(lambda self: any(t is s.Timer.STEP for _, t in self.timers.running))
    @rule(data=st.data())
    def step_timer(self, data: st.DataObject) -> None:
        running = sorted(r for r, t in self.timers.running if t is s.Timer.STEP)
        run = data.draw(st.sampled_from(running))
        self.stage.handle(RunTimerFired(run, s.Timer.STEP))

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def a_step_runs_only_on_its_own_run_s_record(self) -> None:
        assert self.worker.foreign == []

    @invariant()
    def stale_runs_are_never_held(self) -> None:
        assert not set(self.stage.runs) & self.stage.stale_runs

    @invariant()
    def a_batch_takes_one_step_per_run_within_max_batch_rows(self) -> None:
        for batch in self.worker.batches:
            runs = [r for r, *_ in batch]
            assert len(runs) == len(set(runs))
            assert sum(rows for *_, rows in batch) <= MAX_ROWS

    @invariant()
    def each_run_s_steps_come_in_its_order(self) -> None:
        seen: dict[str, list[tuple[int, int]]] = {}
        for batch in self.worker.batches:
            for run, seq, chunk, _ in batch:
                seen.setdefault(run, []).append((seq, chunk))
        for run, steps in seen.items():
            assert steps == sorted(steps), (run, steps)

    @invariant()
    def one_batch_at_a_time(self) -> None:
        assert self.worker.busy_calls == 0

    @invariant()
    def every_reservation_is_a_held_run_s(self) -> None:
        reserved = self.worker.budget.runs
        assert reserved <= set(self.stage.runs), (reserved, set(self.stage.runs))
        assert self.worker.kv_reserved_bytes <= self.worker.budget.budget_bytes

    def teardown(self) -> None:
        """Every run stopped and released: nothing is reserved, nothing held."""
        for run in RUNS:
            self.stop(run, 0)
        for _ in range(3):
            self.stage.run_release()
        assert self.stage.runs == {}
        assert self.worker.kv_reserved_bytes == 0


ChainStage.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestChainStage = ChainStage.TestCase
