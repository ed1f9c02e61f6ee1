"""Seeded fault schedules: what goes wrong in a simulated run, and when.

A ``FaultPlan`` is data, drawn from the run's seed; the simulation consults it at the
points where each fault can strike. Every fault names the stage (or the n-th control
message) and the moment, so a seed reproduces a scenario exactly.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence
from typing import Any

from attrs import frozen

from runtime_core.workers.interface import (
    BatchStep,
    KvCacheUnavailable,
    StepFailure,
    StepResult,
)


class FaultKind(enum.Enum):
    # a stage process dies
    KILL_BEFORE_READY = "KILL_BEFORE_READY"
    KILL_MID_PREFILL = "KILL_MID_PREFILL"
    KILL_MID_DECODE = "KILL_MID_DECODE"
    KILL_IN_TEARDOWN = "KILL_IN_TEARDOWN"
    # a control message (the n-th sent in the run)
    DROP_MESSAGE = "DROP_MESSAGE"
    DELAY_MESSAGE = "DELAY_MESSAGE"
    DUPLICATE_MESSAGE = "DUPLICATE_MESSAGE"
    REORDER_MESSAGE = "REORDER_MESSAGE"
    # an edge (the stage's inbound edge)
    EDGE_STALL = "EDGE_STALL"  # a record arrives far too late
    EDGE_CLOSE = "EDGE_CLOSE"  # the edge is closed under the stage
    # the worker
    STEP_FAILS = "STEP_FAILS"
    SLOW_STEP = "SLOW_STEP"  # the step outlasts the step timeout
    # the caller tears the run down (Ctrl-C) after consuming token ``sequence``
    CALLER_CANCELS = "CALLER_CANCELS"
    # forged input at a stage
    FORGED_STALE_RUN = "FORGED_STALE_RUN"
    FORGED_UNKNOWN_RUN = "FORGED_UNKNOWN_RUN"
    FORGED_WRONG_SENDER = "FORGED_WRONG_SENDER"
    FORGED_UNKNOWN_EDGE = "FORGED_UNKNOWN_EDGE"
    FORGED_REWIRE = "FORGED_REWIRE"
    # faults of one run of a chain (``Fault.run``)
    FORGED_WRONG_SEQUENCE = "FORGED_WRONG_SEQUENCE"  # a record of the run, out of its order
    KV_REFUSED = "KV_REFUSED"  # the stage cannot reserve the run's KV cache


MESSAGE_FAULTS = frozenset(
    {
        FaultKind.DROP_MESSAGE,
        FaultKind.DELAY_MESSAGE,
        FaultKind.DUPLICATE_MESSAGE,
        FaultKind.REORDER_MESSAGE,
    }
)
FORGERIES = frozenset(
    {
        FaultKind.FORGED_STALE_RUN,
        FaultKind.FORGED_UNKNOWN_RUN,
        FaultKind.FORGED_WRONG_SENDER,
        FaultKind.FORGED_UNKNOWN_EDGE,
        FaultKind.FORGED_REWIRE,
    }
)
#: Faults that strike one run of a chain (``Fault.run``): the others must complete. (A
#: slow step is not one: it slows its whole batch, every run in it.)
RUN_FAULTS = frozenset(
    {
        FaultKind.STEP_FAILS,
        FaultKind.CALLER_CANCELS,
        FaultKind.FORGED_WRONG_SEQUENCE,
        FaultKind.KV_REFUSED,
    }
)
#: Faults that change no outcome: a run with only these must complete.
HARMLESS = FORGERIES | {
    FaultKind.DELAY_MESSAGE,
    FaultKind.DUPLICATE_MESSAGE,
    FaultKind.REORDER_MESSAGE,
}


@frozen
class Fault:
    kind: FaultKind
    stage: int = 0  # the stage it strikes (stage faults)
    sequence: int = 0  # the step it strikes (decode faults)
    message: int = 0  # the n-th control message sent (message faults)
    fraction: float = 0.5  # how far into the phase (kills before ready)
    run: int = 0  # the run it strikes, by arrival (run faults of a chain)

    def describe(self) -> str:
        text = self._describe()
        return f"{text} run {self.run}" if self.kind in RUN_FAULTS | {FaultKind.SLOW_STEP} else text

    def _describe(self) -> str:
        if self.kind in MESSAGE_FAULTS:
            return f"{self.kind.value} message #{self.message}"
        if self.kind is FaultKind.CALLER_CANCELS:
            return f"{self.kind.value} after token {self.sequence}"
        if self.kind in (
            FaultKind.KILL_MID_DECODE,
            FaultKind.EDGE_STALL,
            FaultKind.EDGE_CLOSE,
            FaultKind.STEP_FAILS,
            FaultKind.SLOW_STEP,
            FaultKind.FORGED_WRONG_SEQUENCE,
        ):
            return f"{self.kind.value} stage {self.stage} sequence {self.sequence}"
        return f"{self.kind.value} stage {self.stage}"


@frozen
class FaultPlan:
    faults: tuple[Fault, ...] = ()

    def of(self, *kinds: FaultKind) -> list[Fault]:
        return [f for f in self.faults if f.kind in kinds]

    @property
    def harmless(self) -> bool:
        return all(f.kind in HARMLESS for f in self.faults)

    def harmless_for(self, run: int) -> bool:
        """Whether run ``run`` (by arrival) must complete: every fault is harmless or
        strikes another run alone."""
        return all(
            f.kind in HARMLESS or (f.kind in RUN_FAULTS and f.run != run) for f in self.faults
        )


def random_fault_plan(
    rng: random.Random, stages: int, max_tokens: int, max_faults: int = 2, runs: int = 1
) -> FaultPlan:
    """Zero to ``max_faults`` faults, each of a stage, a message or one of ``runs`` runs;
    about a quarter of the plans have none."""
    count = rng.choice([0] + [n for n in range(1, max_faults + 1) for _ in range(3)])
    faults: list[Fault] = []
    struck_messages: set[int] = set()
    for _ in range(count):
        kind = rng.choice(list(FaultKind))
        fault = Fault(
            kind=kind,
            stage=rng.randrange(stages),
            sequence=rng.randrange(1, max(2, max_tokens)),
            message=rng.randrange(0, (3 * stages + 2) * runs),
            fraction=rng.random(),
            run=rng.randrange(runs),
        )
        if kind in MESSAGE_FAULTS:
            if fault.message in struck_messages:
                continue  # one fault per message, so every listed fault strikes
            struck_messages.add(fault.message)
        faults.append(fault)
    return FaultPlan(tuple(faults))


class FaultyChainWorker:
    """Wraps a chain stage's worker so that one run's step fails (a ``StepFailure``, the
    worker itself sound) and one run's KV cache cannot be reserved, where the fault
    plan says; everything else goes to the worker as it is."""

    def __init__(self, worker: Any, fail_at: set[tuple[str, int]], refuse: set[str]) -> None:
        self.inner = worker
        self.fail_at = fail_at
        self.refuse = refuse
        self.capabilities = worker.capabilities

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def open_run(self, provision: Any) -> None:
        if provision.run_id in self.refuse:
            free = provision.kv_budget_bytes - self.inner.kv_reserved_bytes
            raise KvCacheUnavailable(
                provision.run_id, provision.kv_bytes, free, provision.kv_budget_bytes
            )
        self.inner.open_run(provision)

    def execute_batch(self, steps: Sequence[BatchStep]) -> tuple[StepResult, ...]:
        results = self.inner.execute_batch(steps)
        return tuple(
            StepFailure(f"injected failure of run {s.run_id!r} at sequence {s.sequence}")
            if (s.run_id, s.sequence) in self.fail_at
            else r
            for s, r in zip(steps, results, strict=True)
        )
