"""A long run beside many short ones on one chain (CONCURRENT_RUNS.md §3, §5): runs of
small caches fill the KV budget a long run's cache leaves, and all of them share its
batches. Its timers must allow for every run the stages admit beside it, not only for
as many runs as the budget holds of its own cache."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from runplan import RunPlan, Timeouts, provision_all
from runplan.config import shared_batches
from runplan.fsm.stage_events import State
from runplan.messages import StopReason
from runtime_core.chain_orchestrator import RunHandle
from runtime_core.workers.reference.worker import ReferenceWorker
from tests.fixtures.gguf_models import ModelShape, write_model
from tests.support.chain import plan_for
from tests.support.chain_runs import ChainRuns, Clock, ClockTimers, TimedWorker

MAX_SEQ = 32
ROWS = 16  # max_batch_rows
SHORT = 8  # short runs beside the long one
READY = State.READY
TIGHT = Timeouts(step_ms=100, step_row_ms=10, stop_ms=50)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("mixed") / "m.gguf", ModelShape(n_layers=3))


def _plan(model: Path, run_id: str, budget: int, **run: int) -> RunPlan:
    planned = plan_for(
        model,
        3,
        max_seq_len=MAX_SEQ,
        run_id=run_id,
        kv_budget_bytes=budget,
        max_batch_rows=ROWS,
        prefill_chunk=2,
        **run,  # type: ignore[arg-type]
    )
    return attrs.evolve(planned, timeouts=TIGHT)


def _mixed(model: Path) -> tuple[RunPlan, list[RunPlan]]:
    """A long run (a full-length cache) and ``SHORT`` runs of a 4-position cache each,
    on stages whose budget holds two full-length caches: the long run's and the room of
    another, which the short runs fill, eight of them."""
    full = plan_for(model, 3, max_seq_len=MAX_SEQ).stages[0].kv_bytes
    budget = 2 * full
    long = _plan(model, "long", budget, max_tokens=6)
    short = [
        _plan(model, f"short-{k}", budget, prompt_tokens=1, max_tokens=3) for k in range(SHORT)
    ]
    assert all(s.kv_bytes == full for s in long.stages)
    assert all(s.kv_bytes * SHORT == full for p in short for s in p.stages)
    return long, short


def test_a_long_run_s_allowance_counts_every_run_its_stages_admit_beside_it(
    model: Path,
) -> None:
    """The long run's cache and the eight short runs' fill the budget together, so one
    batch may hold nine runs, whose outputs a 2-slot ring hands the next stage over 5 of
    its batches: every stage's allowance for the long run is at least 2 + 5 batches
    (before: 3, as if the budget held only two runs of its size)."""
    long, short = _mixed(model)
    chain = ChainRuns(3, lambda _: ReferenceWorker())
    handles = [chain.add(p, [42]) for p in (*short, long)]
    assert not any(h.queued for h in handles)  # all nine admitted at once
    slots = long.edges[0].ring_spec.slot_count
    for p in provision_all(long):
        assert p.shared_batches >= shared_batches(1 + SHORT, slots), p.stage_index


def _ready(stage: object, handles: list[RunHandle]) -> bool:
    runs = stage.runs  # type: ignore[attr-defined]
    return all(h.run_id in runs and runs[h.run_id].machine.state is READY for h in handles)


def test_a_long_run_beside_many_short_ones_runs_out_no_timer(model: Path) -> None:
    """Nine runs on 3 stages working in parallel, each batch taking 1 ms less than a
    batch of ``max_batch_rows`` rows may. Stage 1 sets out late (rounds in which it
    does nothing, and no batch runs), so stage 0 loads every run's prompt while its
    outputs wait for stage 1: its next batch holds seven runs, whose outputs a 2-slot
    ring hands stage 1 over 4 of its batches. Every run completes, and no stage's step
    timer and no orchestrator's token timer runs out (before: the long run's allowed 3
    batches a step, as if its stages held two runs at most, and ran out; the short
    runs' allowed 10)."""
    long, short = _mixed(model)
    clock = Clock()
    took = TIGHT.step_limit_ms(ROWS) - 1
    chain = ChainRuns(3, lambda i: TimedWorker(ReferenceWorker(), clock, i, lambda _: took))
    timers = [ClockTimers(clock, i) for i in range(3)] + [ClockTimers(clock, None)]
    for stage, stage_timers in zip(chain.stages, timers, strict=False):
        stage.timers = stage_timers
    chain.orchestrator.timers = timers[3]
    handles = [chain.add(p, [42]) for p in (*short, long)]
    for _ in range(1_000):
        if len(chain.of("loaded", "node-0")) == 1 + SHORT:
            break
        if not chain.paused and all(_ready(stage, handles) for stage in chain.stages):
            chain.paused.add(1)
        chain._round()
        clock.tick()
    chain.paused.clear()
    for _ in range(100_000):
        if not chain._round():
            break
        clock.tick()
    assert all(h.finished and h.finished.outcome is StopReason.COMPLETED for h in handles), [
        (h.run_id, h.finished) for h in handles
    ]
    assert max(max(stage.batch_counts) for stage in chain.stages) >= 7  # a batch of 7 runs
    overruns = [(ts.stage_index, o) for ts in timers for o in ts.overruns]
    assert overruns == []
