"""The chain runner's part of the KV waits (``process.chain_handoffs``) without
processes: ``RunHandoffs`` over a stand-in orchestrator. A run refused for KV memory in
the loop's turn where the chain broke is not held (it ends with the chain's fault, as in
the simulator); a held run that ends at its offer again (cancelled meanwhile) leaves
nothing of itself in the waits (a later run is not taken for one offered alone). The
runner's waits are ``runtime_core.kv_waits.KvWaits`` itself, over its ``ChainRun``; a
``ChainRun`` says whether it waits for KV memory (serve counts it apart from those
running)."""

from __future__ import annotations

import importlib.util
import threading
from types import SimpleNamespace
from typing import Any

from runplan.fsm import orchestrator as fsm
from runplan.messages import FaultKind, FaultReason, ProvisionRefused, StopReason
from runtime_core.kv_waits import KvWaits
from runtime_cupy.process.chain_handoffs import RunHandoffs
from runtime_cupy.process.chain_run import ChainRun
from runtime_cupy.process.chain_runner import ChainRunner
from tests.support.strategies import small_plan

FULL = FaultReason(FaultKind.KV_CACHE_UNAVAILABLE, "full")


class _Run:
    """A ``ChainRun``'s fields and endings that the hand-offs use."""

    def __init__(self, run_id: str) -> None:
        self.plan = small_plan(2, run_id=run_id)
        self.former_ids: tuple[str, ...] = ()
        self.cancelled: str | None = None
        self.prompt = (1,)
        self.ended: list[tuple[str, object]] = []
        self.handle: Any = SimpleNamespace(
            finished=fsm.RunFinished(StopReason.FAULTED, (), FULL, None, ()), tokens=()
        )

    @property
    def run_id(self) -> str:
        return self.plan.run_id

    def _ended_unstarted(self, finished: fsm.RunFinished) -> None:
        self.ended.append(("unstarted", finished.outcome))

    def _end(self) -> None:
        self.ended.append(("end", self.handle.finished.fault))

    def _refused(self, exc: Exception) -> None:
        self.ended.append(("refused", exc))

    def _token(self, *args: object) -> None:
        pass


def _handoffs(broken: FaultReason | None) -> tuple[Any, list[str]]:
    ids = iter(f"new-{i}" for i in range(10))
    h: Any = RunHandoffs.__new__(RunHandoffs)
    h._lock, h._adds, h._cancels, h._runs = threading.Lock(), [], [], {}
    h._closing, h.dead, h._wake_w = False, None, -1
    h.kv_waits = KvWaits(lambda: next(ids))
    added: list[str] = []

    def add_run(plan: Any, prompt: object, on_token: object) -> Any:
        added.append(plan.run_id)
        return SimpleNamespace(finished=None, tokens=(), queued=False)

    h.orchestrator = SimpleNamespace(runs={}, broken=broken, add_run=add_run)
    return h, added


def test_a_run_refused_as_the_chain_broke_ends_with_the_chain_not_held() -> None:
    lost = FaultReason(FaultKind.EDGE_FAULT, "token-out gone")
    h, added = _handoffs(broken=lost)  # broken, and the loop has not set ``dead`` yet
    run = _Run("A")
    h._runs["A"] = run
    h.kv_waits.heard(ProvisionRefused("A", 1, "n1", 10, 0, 1000), run, {1: 10**6})
    h._end_runs()
    assert len(h.kv_waits) == 0 and added == [] and run.run_id == "A"
    assert run.ended == [("end", FULL)]


def test_a_held_run_cancelled_before_its_offer_leaves_nothing_in_the_waits() -> None:
    h, added = _handoffs(broken=None)
    run = _Run("A")
    h._runs["A"] = run
    h.kv_waits.heard(ProvisionRefused("A", 1, "n1", 10, 0, 1000), run, {1: 10**6})
    h._end_runs()  # held, then offered again alone at once: nothing else in flight
    assert added == ["new-0"]
    run.handle = SimpleNamespace(
        finished=fsm.RunFinished(StopReason.FAULTED, (), FULL, None, ()), tokens=()
    )
    h.kv_waits.heard(ProvisionRefused("new-0", 1, "n1", 10, 0, 1000), run, {1: 10**6})
    h._runs = {"new-0": run, "other": _Run("other")}
    h._runs["other"].handle = SimpleNamespace(finished=None, tokens=())
    h._end_runs()  # refused again while another run holds memory: held again
    assert len(h.kv_waits) == 1
    run.cancelled = "the client went away"
    h.kv_waits.ended()  # a run ended: it is due, and its offer ends it cancelled
    h._runs = {}
    h._end_runs()
    assert run.ended == [("unstarted", StopReason.CANCELLED)]
    assert len(h.kv_waits) == 0 and h.kv_waits._alone == set()


def test_the_runner_holds_its_runs_in_runtime_cores_kv_waits() -> None:
    """No subclass of the process runtime's own (a shim that added nothing) stands
    between the chain runner and the rules the simulator keeps too."""
    runner = ChainRunner(small_plan(2), run_ids=lambda: "again")
    try:
        assert type(runner.kv_waits) is KvWaits
    finally:
        runner.close()
    assert importlib.util.find_spec("runtime_cupy.process.kv_waits") is None


def test_a_run_waits_for_memory_while_held_or_queued_not_once_offered_or_ended() -> None:
    h, added = _handoffs(broken=None)
    run = ChainRun(h, small_plan(2, run_id="A"), (1,), None)
    finished = fsm.RunFinished(StopReason.FAULTED, (), FULL, None, ())
    run.handle = SimpleNamespace(finished=finished, tokens=(), queued=False)
    assert not run.waiting_for_memory
    other = _Run("other")
    other.handle = SimpleNamespace(finished=None, tokens=())
    h._runs = {"A": run, "other": other}
    h.kv_waits.heard(ProvisionRefused("A", 1, "n1", 10, 0, 1000), run, {1: 10**6})
    h._end_runs()  # held: the other run holds memory on stage 1
    assert run.waiting_for_memory and not run.done
    h.kv_waits.ended()  # a run ended: offered again, started by the orchestrator
    h._end_runs()
    assert added == ["new-0"] and not run.waiting_for_memory
    run.handle.queued = True  # held by the orchestrator until the budgets have room
    assert run.waiting_for_memory
    # Held again, then cancelled while held: it ends, and waits for nothing.
    run.handle = SimpleNamespace(finished=finished, tokens=(), queued=False)
    h.kv_waits.heard(ProvisionRefused("new-0", 1, "n1", 10, 0, 1000), run, {1: 10**6})
    h._end_runs()
    assert run.waiting_for_memory
    h.cancel("new-0", "the client went away")
    h._take_handoffs()
    assert run.done and not run.waiting_for_memory
