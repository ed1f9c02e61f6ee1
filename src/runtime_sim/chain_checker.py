"""The checker of a chain's runs, read off a simulation's trace in one pass.

Each run keeps the MVP's guarantees (PIPELINE_ORCHESTRATION_MVP.md §11: readiness,
execution order, one outcome, teardown, liveness, §10's rejections); the runs keep
CONCURRENT_RUNS.md's: isolation (no record or token crosses runs, a run's tokens reach
only its caller), batch invariance (each run's tokens equal its tokens alone: the
checker reruns it alone, on the same seed, through the same worker), every KV
reservation freed, one batch at a time per stage, at most one step per run in a batch,
each run's records run in the order they were loaded (chunks in order), each batch
reported once in the stage's ``StageStopped`` messages. The rings keep
the ring rules of a chain's links (``chain_ring_rules``). The checker looks at what
happened on the wire and in the rings, not at what a machine meant to do, so a bug in a
controller is caught as surely as one in a machine.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from runplan import RunPlan, check_plan
from runplan.fsm import stage as sfsm
from runtime_sim.chain_driver import ChainResult, ChainSimulation
from runtime_sim.chain_end_checks import EndChecks, Solo
from runtime_sim.chain_ring_rules import RingRules
from runtime_sim.chain_rules import (
    CONSUME_BEFORE_INJECT,
    INCREASING,
    KV_FREED,
    KV_HELD_ENDS,
    KV_WITHIN_BUDGET,
    LOADED_BEFORE_EXECUTE,
    NO_INJECT_AFTER_END,
    ONE_BATCH,
    ONE_OUTCOME,
    ONE_STEP_PER_RUN,
    PLAN,
    PREFILL_IS_ZERO,
    READY_AFTER_SETUP,
    READY_BEFORE_INJECT,
    SAME_SEQUENCE,
    STEP_ORDER,
    Violation,
)
from runtime_sim.links import ORCHESTRATOR

_FAULTED = sfsm.State.FAULTED.name
_SETUP_PARTS = frozenset(p.name for p in sfsm.SetupPart)


def check(sim: ChainSimulation, result: ChainResult, solo: Solo | None = None) -> list[Violation]:
    """Every violation in the trace of ``sim`` (empty when the runs kept every rule);
    with ``solo``, each run's tokens are also compared with its tokens alone. The checker
    reads the trace: a simulation run without one cannot be checked (``ValueError``)."""
    if not sim.trace.enabled:
        raise ValueError("a simulation without a trace cannot be checked")
    return _Checker(sim, result, solo).run()


class _Checker(EndChecks):
    def __init__(self, sim: ChainSimulation, result: ChainResult, solo: Solo | None) -> None:
        self.sim = sim
        self.result = result
        self.solo = solo
        self.violations: list[Violation] = []
        plan = sim.plan
        self.n_stages = plan.stage_count
        self.node_index = {s.node_id: s.stage_index for s in plan.stages}
        self.slots = {i: e.ring_spec.slot_count for i, e in enumerate(_hops(plan))}
        # every run id a run had on the chain (a run offered again after waiting for KV
        # memory has several), to its run by arrival
        self.run_index = {spec.plan.run_id: i for i, spec in enumerate(sim.runs)}
        for i, r in enumerate(result.runs):
            self.run_index.update(dict.fromkeys(r.chain_ids, i))
        self.budget = {s.node_id: s.kv_budget_bytes for s in plan.stages}

    def fail(self, rule: str, time_us: int, detail: str) -> None:
        self.violations.append(Violation(rule, time_us, detail))

    def run(self) -> list[Violation]:
        for spec in self.sim.runs:
            plan_check = check_plan(spec.plan)
            if plan_check is not spec.plan:
                self.fail(PLAN, 0, f"{spec.plan.run_id}: {plan_check}")
        self._scan()
        self._end()
        return self.violations

    # -- the one pass -----------------------------------------------------------------------
    def _scan(self) -> None:
        fail = self.fail
        last_hop = self.n_stages
        setup: dict[tuple[str, str], set[str]] = defaultdict(set)  # (stage, run) -> parts
        ready_from: dict[str, set[int]] = defaultdict(set)  # run -> stages ready
        injected: dict[str, list[int]] = defaultdict(list)
        consumed: dict[str, dict[int, int]] = defaultdict(dict)  # run -> sequence -> token
        made: dict[str, dict[int, int]] = defaultdict(dict)  # token-out records: run -> seq -> id
        executed: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)
        unpublished: dict[str, set[tuple[str, int, int]]] = defaultdict(set)  # stage -> steps
        acquired_by: dict[tuple[str, str], list[tuple[int, int, int]]] = defaultdict(list)
        fed: dict[tuple[str, str], int] = defaultdict(int)  # records fed to each run's machine
        unordered: set[tuple[str, str]] = set()  # runs whose order is no longer followed
        in_batch: dict[str, set[str] | None] = {}  # stage -> runs of its running batch
        open_steps: dict[str, set[str]] = defaultdict(set)  # stage -> runs stepping
        rings = RingRules(self.slots, fail)
        ended: dict[str, int] = {}  # run -> when its orchestrator machine gave up or finished
        finished: dict[str, int] = defaultdict(int)  # outcomes: the orchestrator retired it
        machine_finished: dict[str, int] = defaultdict(int)
        refused: dict[str, set[int]] = defaultdict(set)  # run -> stages that refused its cache
        provisioned: dict[str, set[int]] = defaultdict(set)
        stop_sent: dict[str, set[int]] = defaultdict(set)
        stop_got: dict[str, set[str]] = defaultdict(set)
        stage_faulted: dict[str, set[str]] = defaultdict(set)  # run -> stages it faulted on
        held: dict[str, int] = {}  # runs held for KV memory -> since when
        for time_us, actor, kind, what, d in self.sim.trace.entries:
            if kind == "ring":
                if what == "close":
                    continue
                hop = d[0]
                if what == "publish":
                    n, slot, run_id, sequence, chunk, token = d[1:7]
                    rings.publish(time_us, hop, n, slot, run_id, sequence, chunk)
                    if actor == ORCHESTRATOR and hop == 0:
                        self._injection(
                            time_us, run_id, sequence, chunk, ready_from, consumed, ended, injected
                        )
                    elif actor in self.node_index:
                        step = (run_id, sequence, chunk)
                        if step not in unpublished[actor]:
                            fail(
                                SAME_SEQUENCE,
                                time_us,
                                f"{actor} published run {run_id!r} sequence {sequence} chunk "
                                f"{chunk}, no step of its batch",
                            )
                        unpublished[actor].discard(step)
                        if hop == last_hop and token is not None:
                            made[run_id][sequence] = token
                elif what == "acquire":
                    n, slot, run_id, sequence, chunk = d[1:6]
                    rings.acquire(time_us, hop, n, slot, run_id, sequence, chunk)
                    if actor in self.node_index:
                        acquired_by[(actor, run_id)].append((sequence, chunk, 0))
                elif what == "release":
                    rings.release(time_us, hop, d[1])
            elif kind == "ev" and actor != ORCHESTRATOR:
                run_id = d[0]
                if what == "SetupDone":
                    setup[(actor, run_id)].add(d[1])
                elif what == "ObjectLoaded":
                    sequence, chunk, _count, _edge, record_run = d[1:6]
                    key = (actor, run_id)
                    if record_run == run_id and key not in unordered:
                        order = acquired_by[key]
                        i = fed[key]
                        if i >= len(order) or order[i][:2] != (sequence, chunk):
                            next_one = order[i][:2] if i < len(order) else None
                            fail(
                                STEP_ORDER,
                                time_us,
                                f"{actor} fed run {run_id!r} sequence {sequence} chunk {chunk}; "
                                f"its next loaded record was {next_one}",
                            )
                            unordered.add(key)
                        fed[key] = i + 1
                elif what == "EdgeFault":
                    unordered.add((actor, run_id))  # a record refused before it was fed
                elif what in ("StepCompleted", "StepFailed"):
                    open_steps[actor].discard(run_id)
                elif what == "Received" and d[2] == "StopRun":
                    stop_got[run_id].add(actor)
            elif kind == "act" and actor != ORCHESTRATOR:
                run_id = d[0]
                if what == "BeginSetup":
                    setup[(actor, run_id)] = set()
                elif what == "ExecuteStep":
                    at = (d[1], d[2])
                    steps = executed[(actor, run_id)]
                    if not steps and at != (0, 0):
                        fail(PREFILL_IS_ZERO, time_us, f"{actor} first runs {run_id!r} at {at}")
                    if steps and at <= steps[-1]:
                        fail(INCREASING, time_us, f"{actor} runs {run_id!r} {at} after {steps[-1]}")
                    if steps and at[0] == 0 and at[1] != steps[-1][1] + 1:
                        fail(
                            INCREASING,
                            time_us,
                            f"{actor} runs {run_id!r} chunk {at} after {steps[-1]}",
                        )
                    if (at[0], at[1], 0) not in acquired_by[(actor, run_id)]:
                        fail(LOADED_BEFORE_EXECUTE, time_us, f"{actor} runs {run_id!r} {at}")
                    steps.append(at)
                    batch = in_batch.get(actor)
                    if batch is not None:
                        if run_id in batch:
                            fail(
                                ONE_STEP_PER_RUN,
                                time_us,
                                f"{actor}: run {run_id!r} twice in a batch",
                            )
                        batch.add(run_id)
                    open_steps[actor].add(run_id)
                    unpublished[actor].add((run_id, d[1], d[2]))
                elif what == "SendToOrchestrator" and d[1] == "StageReady":
                    missing = _SETUP_PARTS - setup[(actor, run_id)]
                    if missing:
                        fail(
                            READY_AFTER_SETUP,
                            time_us,
                            f"{actor} sent StageReady of {run_id!r} without {sorted(missing)}",
                        )
            elif kind == "sim" and actor in self.node_index:
                if what == "batch_begin":
                    if open_steps[actor]:
                        fail(
                            ONE_BATCH,
                            time_us,
                            f"{actor} began a batch while {sorted(open_steps[actor])} still step",
                        )
                    in_batch[actor] = set()
                elif what == "batch_end":
                    in_batch[actor] = None
                elif what == "kv_reserved" and d[0] > self.budget[actor]:
                    fail(
                        KV_WITHIN_BUDGET,
                        time_us,
                        f"{actor}'s runs reserve {d[0]} KV bytes, its budget {self.budget[actor]}",
                    )
                elif what == "chain_closed" and d and d[0]:
                    fail(
                        KV_FREED, time_us, f"{actor} closed its chain with {d[0]} KV bytes reserved"
                    )
            elif kind == "state" and actor != ORCHESTRATOR:
                pass
            elif kind == "ctl" and actor in self.node_index and what == "state":
                fields = d[0]
                if fields["to"] == _FAULTED:
                    stage_faulted[fields["run_id"]].add(actor)
                if fields["to"] in (_FAULTED, "STOPPING", "STOPPED"):
                    # records still waiting for the run are dropped, later ones discarded
                    unordered.add((actor, fields["run_id"]))
                    open_steps[actor].discard(fields["run_id"])
                    for step in [s for s in unpublished[actor] if s[0] == fields["run_id"]]:
                        unpublished[actor].discard(step)
            elif kind == "ev" and actor == ORCHESTRATOR:
                run_id = d[0]
                if what == "Received" and d[2] == "StageReady":
                    sender, _, msg_run, index, node_id = d[1:6]
                    plan = self._plan(run_id)
                    if (
                        plan is not None
                        and msg_run == run_id
                        and index is not None
                        and index < self.n_stages
                        and plan.stages[index].node_id == sender == node_id
                    ):
                        ready_from[run_id].add(index)
                elif what == "Received" and d[2] == "ProvisionRefused" and d[4] is not None:
                    refused[run_id].add(d[4])
                elif what == "TokenConsumed":
                    consumed[run_id][d[1]] = d[2]
            elif kind == "act" and actor == ORCHESTRATOR:
                run_id = d[0]
                if what == "SendProvision":
                    provisioned[run_id].add(d[1])
                elif what == "SendStopRun":
                    stop_sent[run_id].add(d[1])
                elif what == "RunFinished":
                    machine_finished[run_id] += 1
                    if machine_finished[run_id] > 1:
                        fail(ONE_OUTCOME, time_us, f"a second RunFinished of {run_id!r}")
            elif kind == "sim" and actor == ORCHESTRATOR and what == "kv_held":
                held[d[0]] = time_us
            elif kind == "sim" and actor == ORCHESTRATOR and what in ("kv_again", "kv_held_ended"):
                if held.pop(d[0], None) is None:
                    fail(KV_HELD_ENDS, time_us, f"{what} of {d[0]!r}, not held")
                elif what == "kv_held_ended" and d[1] not in ("CANCELLED", "FAULTED"):
                    fail(KV_HELD_ENDS, time_us, f"{d[0]!r} ended {d[1]} while held")
            elif kind == "ctl" and actor == ORCHESTRATOR:
                fields = d[0]
                if what == "state" and fields["to"] in ("TEARING_DOWN", "DONE"):
                    ended.setdefault(fields["run_id"], time_us)
                elif what == "finished":
                    finished[fields["run_id"]] += 1
        rings.finish()
        for run_id, since in sorted(held.items()):
            self.fail(
                KV_HELD_ENDS, since, f"{run_id!r}, held for KV memory, neither offered nor ended"
            )
        self.made = made
        self.consumed = consumed
        self.provisioned: dict[str, set[int]] = defaultdict(set)
        for run, stages in provisioned.items():
            self.provisioned[run] = stages - refused[run]
        self.stop_sent = stop_sent
        self.stop_got = stop_got
        self.finished = finished
        self.ended = ended
        self.stage_faulted = stage_faulted

    def _plan(self, run_id: str) -> RunPlan | None:
        i = self.run_index.get(run_id)
        return None if i is None else self.sim.runs[i].plan

    def _injection(
        self,
        time_us: int,
        run_id: str,
        sequence: int,
        chunk: int,
        ready_from: dict[str, set[int]],
        consumed: dict[str, dict[int, int]],
        ended: dict[str, int],
        injected: dict[str, list[int]],
    ) -> None:
        if sequence == 0 and len(ready_from[run_id]) < self.n_stages:
            missing = sorted(set(range(self.n_stages)) - ready_from[run_id])
            self.fail(READY_BEFORE_INJECT, time_us, f"{run_id!r}: stages {missing} not ready")
        if sequence > 0 and sequence - 1 not in consumed[run_id]:
            self.fail(
                CONSUME_BEFORE_INJECT,
                time_us,
                f"{run_id!r}: sequence {sequence} before token {sequence - 1}",
            )
        done = injected[run_id]
        if done and sequence <= done[-1] and not (sequence == 0 and chunk > 0):
            self.fail(INCREASING, time_us, f"{run_id!r}: injected {sequence} after {done[-1]}")
        if run_id in ended:
            self.fail(NO_INJECT_AFTER_END, time_us, f"{run_id!r}: sequence {sequence}")
        done.append(sequence)


def _hops(plan: RunPlan) -> list[Any]:
    """The chain's edges in hop order: token-in, each stage's outbound."""
    by_id = {e.edge_id: e for e in plan.edges}
    return [by_id[plan.stages[0].inbound_edge]] + [by_id[s.outbound_edge] for s in plan.stages]
