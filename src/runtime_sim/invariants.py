"""The invariant checker: every guarantee of PIPELINE_ORCHESTRATION_MVP.md §11, the
ring rules of EDGES_AND_WORKERS.md §2, §10's rejections and liveness, read off a
simulation's trace in one pass. It looks at what happened on the wire and in the
rings (records published, messages sent), not at what a machine meant to do, so a
bug in a controller is caught as surely as one in a state machine.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from attrs import frozen

from runplan import RunPlan, check_plan
from runplan.fsm import stage as sfsm
from runtime_sim.driver import SimResult, Simulation
from runtime_sim.faults import FaultPlan
from runtime_sim.links import ORCHESTRATOR


@frozen
class Violation:
    rule: str
    time_us: int
    detail: str

    def __str__(self) -> str:
        return f"{self.rule} (t={self.time_us} us): {self.detail}"


READY_BEFORE_INJECT = "readiness: prompt injected before every stage reported StageReady"
READY_AFTER_SETUP = "readiness: StageReady before worker, shard and both edges were ready"
PREFILL_IS_ZERO = "execution: prefill is sequence 0"
INCREASING = "execution: decode sequences strictly increasing"
LOADED_BEFORE_EXECUTE = "execution: a stage executes sequence s only after loading it"
SAME_SEQUENCE = "execution: a stage's output uses its input's sequence"
CONSUME_BEFORE_INJECT = "execution: sequence s + 1 injected only after consuming token s"
ONE_OUTCOME = "termination: one terminal outcome"
NO_INJECT_AFTER_END = "termination: no injection after the run's outcome"
TEARDOWN_TO_ALL = "termination: teardown sent to every provisioned stage"
NO_OVERWRITE = "ring: no slot overwritten before release"
PUBLISH_ORDER = "ring: records leave in publish order"
RELEASE_AFTER_STEP = "ring: a slot is released only after its step"
LIVENESS_OUTCOME = "liveness: one terminal outcome within the time bound"
LIVENESS_STOP_RUN = "liveness: StopRun reaches every provisioned stage still alive"
LIVENESS_STOPPED = "liveness: every stage still alive stops"
SECURITY = "security: forged input is rejected and changes nothing"
PLAN = "plan: layer and edge assignment"
HARMLESS = "outcome: a run with only harmless faults completes, no stage faulting"

ALL_RULES = (
    PLAN,
    READY_BEFORE_INJECT,
    READY_AFTER_SETUP,
    PREFILL_IS_ZERO,
    INCREASING,
    LOADED_BEFORE_EXECUTE,
    SAME_SEQUENCE,
    CONSUME_BEFORE_INJECT,
    ONE_OUTCOME,
    NO_INJECT_AFTER_END,
    TEARDOWN_TO_ALL,
    NO_OVERWRITE,
    PUBLISH_ORDER,
    RELEASE_AFTER_STEP,
    LIVENESS_OUTCOME,
    LIVENESS_STOP_RUN,
    LIVENESS_STOPPED,
    SECURITY,
    HARMLESS,
)


# Names of stage states, looked up once (the scan compares every state entry with them).
_FAULTED = sfsm.State.FAULTED.name
_GAVE_UP = (_FAULTED, sfsm.State.STOPPING.name)


def time_bound_us(plan: RunPlan) -> int:
    """When a run must have ended: every stage's setup, one token per allowed token
    (each bounded by the token timeout: the prompt's by its rows, at most the cache's
    length), the stop timeout, and slack for notices."""
    t = plan.timeouts
    prompt_ms = t.step_limit_ms(plan.model.max_seq_len) * plan.stage_count
    token_ms = t.step_limit_ms(1) * plan.stage_count
    return (t.ready_ms + prompt_ms + plan.max_tokens * token_ms + t.stop_ms) * 1000 + 1_000_000


def check(sim: Simulation, result: SimResult) -> list[Violation]:
    """Every violation in the trace of ``sim`` (empty when the run kept every rule).
    The checker reads the trace: a simulation run without one cannot be checked."""
    if not sim.trace.enabled:
        raise ValueError("a simulation without a trace cannot be checked")
    return _Checker(sim, result).run()


class _Checker:
    def __init__(self, sim: Simulation, result: SimResult) -> None:
        self.sim = sim
        self.plan = sim.plan
        self.result = result
        self.faults: FaultPlan = sim.faults
        self.violations: list[Violation] = []
        self.node_index = {s.node_id: s.stage_index for s in self.plan.stages}
        self.token_in = self.plan.token_in.edge_id
        self.token_out = self.plan.token_out.edge_id
        self.consumer_of = {e.edge_id: e.consumer.node_id for e in self.plan.edges}
        self.slots = {e.edge_id: e.ring_spec.slot_count for e in self.plan.edges}
        self.inbound_of = {s.node_id: s.inbound_edge for s in self.plan.stages}

    def fail(self, rule: str, time_us: int, detail: str) -> None:
        self.violations.append(Violation(rule, time_us, detail))

    def run(self) -> list[Violation]:
        plan_check = check_plan(self.plan)
        if plan_check is not self.plan:
            self.fail(PLAN, 0, str(plan_check))
        self._scan()
        self._end()
        return self.violations

    # -- the one pass ---------------------------------------------------------------------
    def _scan(self) -> None:
        n_stages = self.plan.stage_count
        setup: dict[str, set[str]] = defaultdict(set)
        ready_from: set[int] = set()
        injected: list[int] = []
        consumed: set[int] = set()
        executed: dict[str, list[int]] = defaultdict(list)
        executing: dict[str, int | None] = {}
        loaded: dict[str, set[int]] = defaultdict(set)
        # For the release rule, positions in the trace: which record a stage loaded
        # each sequence from, when it released it, when its step ended, when it gave up.
        record_of: dict[tuple[str, int], tuple[int, int]] = {}
        release_pos: dict[tuple[int, int], tuple[int, int]] = {}
        step_end_pos: dict[tuple[str, int], int] = {}
        gave_up_pos: dict[str, int] = {}
        faulted: set[str] = set()
        published: dict[int, list[int]] = defaultdict(list)  # edge -> record numbers
        published_as: dict[tuple[int, int], tuple[int, int]] = {}  # -> (slot, sequence)
        released: dict[int, set[int]] = defaultdict(set)
        acquired: dict[int, int] = defaultdict(int)
        orch_ended_at: int | None = None
        finished = 0
        provisioned: set[int] = set()
        stop_sent: set[int] = set()

        for pos, (time_us, actor, kind, what, d) in enumerate(self.sim.trace.entries):
            # The branches test distinct kinds; ring operations, the most, come first.
            if kind == "ring":
                edge = d[0]
                if what == "publish":
                    n, slot, sequence = d[1], d[2], d[3]
                    slots = self.slots[edge]
                    if n >= slots and (n - slots) not in released[edge]:
                        self.fail(
                            NO_OVERWRITE,
                            time_us,
                            f"edge {edge} record {n} into slot {slot} while record "
                            f"{n - slots} is unreleased",
                        )
                    published[edge].append(n)
                    published_as[(edge, n)] = (slot, sequence)
                    if actor == ORCHESTRATOR and edge == self.token_in:
                        self._injection(
                            time_us, sequence, ready_from, consumed, orch_ended_at, injected
                        )
                    elif actor in self.node_index:
                        s = executing.get(actor)
                        if s is None or s != sequence:
                            self.fail(
                                SAME_SEQUENCE,
                                time_us,
                                f"{actor} published sequence {sequence} while executing {s}",
                            )
                elif what == "acquire":
                    n, slot, sequence = d[1], d[2], d[3]
                    record_of[(actor, sequence)] = (edge, n)
                    # What the consumer read must be the oldest record not yet read,
                    # from the slot it was published into.
                    expected = acquired[edge]
                    if n != expected or published_as.get((edge, n)) != (slot, sequence):
                        self.fail(
                            PUBLISH_ORDER,
                            time_us,
                            f"edge {edge}: read sequence {sequence} from slot {slot} as record "
                            f"{n}; the oldest unread record {expected} was published as "
                            f"{published_as.get((edge, expected))}",
                        )
                    acquired[edge] = expected + 1
                elif what == "release":
                    released[edge].add(d[1])
                    release_pos.setdefault((edge, d[1]), (pos, time_us))
            elif kind == "ev" and actor != ORCHESTRATOR:
                if what == "SetupDone":
                    setup[actor].add(d[0])
                elif what == "ObjectLoaded":
                    sequence, edge, run_id = d
                    if edge == self.inbound_of[actor] and run_id == self.plan.run_id:
                        loaded[actor].add(sequence)
                elif what in ("StepCompleted", "StepFailed"):
                    step_end_pos.setdefault((actor, d[0]), pos)
            elif kind == "act" and actor != ORCHESTRATOR:
                if what == "BeginSetup":
                    setup[actor] = set()
                elif what == "ExecuteStep":
                    s = d[0]
                    seqs = executed[actor]
                    if not seqs and s != 0:
                        self.fail(PREFILL_IS_ZERO, time_us, f"{actor} first executes {s}")
                    if seqs and s <= seqs[-1]:
                        self.fail(INCREASING, time_us, f"{actor} executes {s} after {seqs[-1]}")
                    if s not in loaded[actor]:
                        self.fail(LOADED_BEFORE_EXECUTE, time_us, f"{actor} executes {s}")
                    seqs.append(s)
                    executing[actor] = s
            elif kind == "state" and actor != ORCHESTRATOR:
                if what in _GAVE_UP:
                    gave_up_pos.setdefault(actor, pos)
                if what == _FAULTED:
                    faulted.add(actor)
            elif kind == "ev" and actor == ORCHESTRATOR:
                if what == "Received" and d[1] == "StageReady":
                    sender, _, run_id, index, node_id = d
                    if (
                        run_id == self.plan.run_id
                        and index is not None
                        and index < n_stages
                        and self.plan.stages[index].node_id == sender == node_id
                    ):
                        ready_from.add(index)
                elif what == "TokenConsumed":
                    consumed.add(d[0])
            elif kind == "act" and actor == ORCHESTRATOR:
                if what == "SendProvision":
                    provisioned.add(d[0])
                elif what == "RunFinished":
                    finished += 1
                    if finished > 1:
                        self.fail(ONE_OUTCOME, time_us, "a second RunFinished")
            elif kind == "state" and actor == ORCHESTRATOR:
                if what in ("TEARING_DOWN", "DONE") and orch_ended_at is None:
                    orch_ended_at = time_us
            elif kind == "net" and what == "send":
                dst, mtype, _ = d
                if actor == ORCHESTRATOR and mtype == "StopRun" and dst in self.node_index:
                    stop_sent.add(self.node_index[dst])
                if mtype == "StageReady" and actor in self.node_index:
                    missing = {p.name for p in sfsm.SetupPart} - setup[actor]
                    if missing:
                        self.fail(
                            READY_AFTER_SETUP,
                            time_us,
                            f"{actor} sent StageReady without {sorted(missing)}",
                        )
        for actor, seqs in executed.items():
            for s in seqs:
                record = record_of.get((actor, s))
                if record is None or record not in release_pos:
                    continue
                freed = release_pos[record]
                ended = min(step_end_pos.get((actor, s), 1 << 62), gave_up_pos.get(actor, 1 << 62))
                if freed[0] < ended:
                    self.fail(
                        RELEASE_AFTER_STEP,
                        freed[1],
                        f"{actor} released record {record[1]} (sequence {s}) before its step ended",
                    )
        self.faulted_stages = faulted
        self.provisioned = provisioned
        self.stop_sent = stop_sent
        self.finished = finished
        self.orch_ended_at = orch_ended_at

    def _injection(
        self,
        time_us: int,
        sequence: int,
        ready_from: set[int],
        consumed: set[int],
        ended_at: int | None,
        injected: list[int],
    ) -> None:
        if sequence == 0 and len(ready_from) < self.plan.stage_count:
            self.fail(
                READY_BEFORE_INJECT,
                time_us,
                f"stages {sorted(set(range(self.plan.stage_count)) - ready_from)} not ready",
            )
        if sequence > 0 and sequence - 1 not in consumed:
            self.fail(
                CONSUME_BEFORE_INJECT, time_us, f"sequence {sequence} before token {sequence - 1}"
            )
        if injected and sequence <= injected[-1]:
            self.fail(INCREASING, time_us, f"injected {sequence} after {injected[-1]}")
        if ended_at is not None:
            self.fail(NO_INJECT_AFTER_END, time_us, f"sequence {sequence}")
        injected.append(sequence)

    # -- at the end ----------------------------------------------------------------------------
    def _end(self) -> None:
        r = self.result
        bound = time_bound_us(self.plan)
        if self.finished != 1 or r.finished is None:
            self.fail(ONE_OUTCOME, r.end_us, f"{self.finished} terminal outcomes")
        if r.finished is None or r.finished_us is None or r.finished_us > bound:
            self.fail(
                LIVENESS_OUTCOME, r.end_us, f"run's outcome at {r.finished_us} us, bound {bound} us"
            )
        if self.orch_ended_at is not None:
            for i in sorted(self.provisioned - self.stop_sent):
                self.fail(TEARDOWN_TO_ALL, self.orch_ended_at, f"no StopRun to stage {i}")
        got_stop = {
            entry[1]
            for entry in self.sim.trace.of("net", "deliver")
            if entry[4][1] == "StopRun" and entry[4][0] == ORCHESTRATOR
        }
        dropped = {dst for src, dst, mtype in self.sim.dropped if mtype == "StopRun"}
        for i, stage in enumerate(self.plan.stages):
            if not r.alive[i] or i not in self.provisioned:
                continue
            if stage.node_id not in got_stop and stage.node_id not in dropped:
                self.fail(LIVENESS_STOP_RUN, r.end_us, f"{stage.node_id} never got StopRun")
            if r.stage_states[i] not in (sfsm.State.STOPPED, sfsm.State.UNPROVISIONED):
                self.fail(
                    LIVENESS_STOPPED, r.end_us, f"{stage.node_id} ended {r.stage_states[i].name}"
                )
        for node, kind, ok, reason in self.sim.forgeries:
            if not ok:
                self.fail(SECURITY, 0, f"{kind} at {node}: {reason}")
        if self.faults.harmless and self.sim.parts.mutant is None:
            faults = [f.describe() for f in self.faults.faults]
            if r.finished is None or r.finished.outcome.value != "COMPLETED":
                fault = r.finished.fault if r.finished is not None else None
                self.fail(HARMLESS, r.end_us, f"faults {faults} ended the run: {fault}")
            for node in sorted(self.faulted_stages):
                self.fail(HARMLESS, r.end_us, f"{node} faulted in a run with faults {faults}")


def describe(violations: list[Violation]) -> list[dict[str, Any]]:
    return [{"rule": v.rule, "time_us": v.time_us, "detail": v.detail} for v in violations]
