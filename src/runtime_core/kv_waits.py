"""Runs that wait for KV memory (CONCURRENT_RUNS.md §5), the rules both runtimes keep: a
stage that cannot reserve a run's KV cache refuses its provision (``ProvisionRefused``)
and keeps nothing; the run's machine ends the run (``KV_CACHE_UNAVAILABLE``), and the
stages that took the provision let go of it. The runtime (the process runtime's chain
runner, the simulator's orchestrator node) does not end it there when memory may yet
free: the run is held, whole, and offered again when another run on the chain ends; it
ends only when it could never fit, its fault naming the sizes.

- It waits when, as the stage refused, other runs on the chain held KV cache on that
  stage (the planner's figures, ``ChainOrchestrator.kv_reserved``, less the run's own):
  their ends free it. It is offered again after the next end of a run on the chain (at
  once when one ended since the refusal), under a new run id: the stages that took its
  first provision keep that id as stale (a stopped run's). First held, first offered,
  each held run on its own (one due does not wait behind one that is not).
- Runs refused together count each other's reservations among the others' (each was
  provisioned when the other was refused), so each may wait for the other: when no run
  is left on the chain to end, the runtime offers the first held run again at once,
  alone (``first``).
- It never fits when its cache needs more than the stage's whole budget, or when no other
  run held any of that stage's cache and it was refused so after being offered again
  alone: nothing will free. (Refused the first time with no other run holding memory, it
  is held, and offered again alone once: a run stopping on the stage may still hold what
  the planner's figures already count as free.) Its fault (still
  ``KV_CACHE_UNAVAILABLE``) then says so and names what it needs, what was free and the
  stage's whole budget.
- A held run is the runtime's own run still (a ``Waiting``: the process runtime's
  ``ChainRun``, with its ``cancel``, ``wait``, ``on_done``); it holds nothing on the
  stages, so a cancel ends it at once, as a chain fault or the chain's close does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from typing import Generic, Protocol, TypeVar

import attrs

from runplan import RunPlan
from runplan.messages import FaultKind, FaultReason, ProvisionRefused, StopReason
from runtime_core.chain_orchestrator import RunHandle


class Waiting(Protocol):
    """A runtime's run as ``KvWaits`` sees it: its plan (renamed when offered again),
    its handle in the ``ChainOrchestrator`` (``None`` while held), its ids before."""

    plan: RunPlan
    handle: RunHandle | None
    former_ids: tuple[str, ...]

    @property
    def run_id(self) -> str: ...


R = TypeVar("R", bound=Waiting)


@attrs.frozen
class _Refusal:
    """A stage's refusal, and what the chain held then: other runs' KV bytes on that
    stage, and how many runs had ended on the chain."""

    message: ProvisionRefused
    others_held: int
    ends: int


@attrs.frozen
class _Held(Generic[R]):
    run: R
    ends: int  # runs ended on the chain when it was refused


def renamed(plan: RunPlan, run_id: str) -> RunPlan:
    """``plan`` under another run id (its stages and edges name it too)."""
    return attrs.evolve(
        plan,
        run_id=run_id,
        stages=tuple(attrs.evolve(s, run_id=run_id) for s in plan.stages),
        edges=tuple(attrs.evolve(e, run_id=run_id) for e in plan.edges),
    )


def never_fits(refusal: ProvisionRefused, others_held: int) -> str | None:
    """Why the run ``refusal`` refused can never fit that stage (``None``: it may, once
    other runs' ``others_held`` bytes there free)."""
    needed, budget = refusal.needed_bytes, refusal.budget_bytes
    where = f"stage {refusal.stage_index} on {refusal.node_id!r}"
    if needed > budget:
        return (
            f"{where}: the run's KV cache needs {needed} bytes, more than the stage's whole "
            f"budget of {budget}: it never fits"
        )
    if others_held <= 0:
        return (
            f"{where}: the run's KV cache needs {needed} bytes, {refusal.free_bytes} of the "
            f"stage's whole budget of {budget} free, and no other run on the chain holds any "
            "of it to free: it never fits"
        )
    return None


class KvWaits(Generic[R]):
    """The runs a runtime holds for KV memory. ``run_ids()``: a new run id."""

    def __init__(self, run_ids: Callable[[], str]) -> None:
        self._run_ids = run_ids
        self._refusals: dict[str, _Refusal] = {}
        self._held: deque[_Held[R]] = deque()
        self._ends = 0  # runs ended on the chain
        self._alone: set[int] = set()  # the runs offered again alone (``first``), by id()

    def __len__(self) -> int:
        return len(self._held)

    def heard(self, message: object, run: R | None, reserved: Mapping[int, int]) -> None:
        """A stage's message, before the run's machine hears it: a ``ProvisionRefused``
        of ``run`` is noted with what the other runs held on that stage then
        (``reserved``: the chain's KV bytes by stage, the run's own included)."""
        if not isinstance(message, ProvisionRefused) or run is None:
            return
        index = message.stage_index
        own = next((s.kv_bytes for s in run.plan.stages if s.stage_index == index), 0)
        others = reserved.get(index, 0) - own
        self._refusals[message.run_id] = _Refusal(message, others, self._ends)

    def holds(self, run: R) -> bool:
        """``run``'s machine ended: whether it is held (the runner does not end it). A
        run refused for memory that never fits gets a fault that says why."""
        handle = run.handle
        refusal = self._refusals.pop(run.run_id, None)
        if handle is None or handle.finished is None or refusal is None:
            return False
        finished = handle.finished
        fault = finished.fault
        if fault is None or fault.kind is not FaultKind.KV_CACHE_UNAVAILABLE:
            return False
        if finished.outcome is not StopReason.FAULTED:
            return False
        why = never_fits(refusal.message, refusal.others_held)
        message = refusal.message
        alone = id(run) in self._alone
        if why is not None and message.needed_bytes <= message.budget_bytes and not alone:
            why = None  # offered once more, alone, before it never fits
        if why is not None:
            self._alone.discard(id(run))
            handle.finished = attrs.evolve(
                finished, fault=FaultReason(FaultKind.KV_CACHE_UNAVAILABLE, why)
            )
            return False
        self._held.append(_Held(run, refusal.ends))
        return True

    def ended(self) -> None:
        """A run on the chain ended (its cache, if it held any, is free)."""
        self._ends += 1

    def forget(self, run: R) -> None:
        """``run`` ended without being held: what was kept of it goes."""
        self._refusals.pop(run.run_id, None)
        self._alone.discard(id(run))

    def due(self) -> list[R]:
        """The held runs to offer again (a run ended since each was refused), first held
        first, each under a new run id."""
        due = [h for h in self._held if h.ends < self._ends]
        for held in due:
            self._held.remove(held)
        return [self._again(h.run) for h in due]

    def first(self) -> list[R]:
        """The first held run alone, to offer again now (no run is left on the chain to
        end and free memory for it), under a new run id; none when none is held."""
        if not self._held:
            return []
        run = self._held.popleft().run
        self._alone.add(id(run))
        return [self._again(run)]

    def _again(self, run: R) -> R:
        run.former_ids += (run.run_id,)
        run.plan = renamed(run.plan, self._run_ids())
        run.handle = None
        return run

    def take(self, run_id: str) -> R | None:
        """The held run of ``run_id`` (its id now or one it had before), no longer held
        (``None``: none is)."""
        for held in self._held:
            if run_id == held.run.run_id or run_id in held.run.former_ids:
                self._held.remove(held)
                self._alone.discard(id(held.run))
                return held.run
        return None

    def take_all(self) -> list[R]:
        """Every held run, no longer held."""
        out = [h.run for h in self._held]
        self._held.clear()
        self._alone.clear()
        return out
