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
from collections.abc import Callable
from typing import Any

from attrs import frozen

from runplan import RunPlan, check_plan
from runplan.config import batch_runs, shared_batch_rows, shared_batches
from runplan.fsm import stage as sfsm
from runtime_sim.chain_driver import ChainResult, ChainSimulation, RunSpec
from runtime_sim.chain_ring_rules import NO_OVERWRITE, PUBLISH_ORDER, RELEASE_AT_LOAD, RingRules
from runtime_sim.links import ORCHESTRATOR


@frozen
class Violation:
    rule: str
    time_us: int
    detail: str

    def __str__(self) -> str:
        return f"{self.rule} (t={self.time_us} us): {self.detail}"


PLAN = "plan: layer and edge assignment"
READY_BEFORE_INJECT = "readiness: a run's prompt injected before every stage reported StageReady"
READY_AFTER_SETUP = "readiness: StageReady before worker, shard and both links were ready"
PREFILL_IS_ZERO = "execution: a run's first step is sequence 0"
INCREASING = "execution: a run's steps strictly increasing (sequence, then chunk)"
LOADED_BEFORE_EXECUTE = "execution: a stage executes a record only after loading it"
SAME_SEQUENCE = "execution: a stage's output is its step's (run, sequence, chunk)"
CONSUME_BEFORE_INJECT = "execution: sequence s + 1 injected only after consuming token s"
ONE_OUTCOME = "termination: one terminal outcome per run"
NO_INJECT_AFTER_END = "termination: no injection after the run's outcome"
TEARDOWN_TO_ALL = "termination: teardown sent to every provisioned stage"
LIVENESS_OUTCOME = "liveness: one terminal outcome within the time bound"
LIVENESS_STOP_RUN = "liveness: StopRun reaches every provisioned stage still alive"
LIVENESS_STOPPED = "liveness: every stage still alive ends holding no run"
SECURITY = "security: forged input is rejected and changes nothing"
HARMLESS = "outcome: a run struck by no harmful fault completes, no stage faulting it"
ISOLATION = "isolation: a run's tokens reach only its caller, as its last stage made them"
BATCH_INVARIANCE = "batch invariance: a run's tokens equal its tokens when it runs alone"
KV_FREED = "memory: every KV reservation is freed at the chain's end"
ONE_BATCH = "batching: one batch at a time per stage"
ONE_STEP_PER_RUN = "batching: at most one step per run in a batch"
STEP_ORDER = "batching: a stage feeds each run's records in the order it loaded them"
KV_WITHIN_BUDGET = "memory: a stage's runs never reserve more KV cache than its budget"
KV_HELD_ENDS = "memory: a run held for KV memory is offered again or ends cancelled or faulted"
BATCHES_REPORTED = "batching: a stage's StageStopped messages report each of its batches once"

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
    RELEASE_AT_LOAD,
    LIVENESS_OUTCOME,
    LIVENESS_STOP_RUN,
    LIVENESS_STOPPED,
    SECURITY,
    HARMLESS,
    ISOLATION,
    BATCH_INVARIANCE,
    KV_FREED,
    KV_WITHIN_BUDGET,
    KV_HELD_ENDS,
    ONE_BATCH,
    ONE_STEP_PER_RUN,
    STEP_ORDER,
    BATCHES_REPORTED,
)

#: Runs one run alone on a fresh chain (same seed, same kind of worker): its tokens.
Solo = Callable[[RunSpec], tuple[int, ...]]
_FAULTED = sfsm.State.FAULTED.name
_SETUP_PARTS = frozenset(p.name for p in sfsm.SetupPart)


def time_bound_us(plan: RunPlan) -> int:
    """When a run must have ended once it starts: every stage's setup, one token per
    allowed token (each bounded by the token timeout: the prompt's by its rows, at most
    the cache's length), the stop timeout, and slack for notices."""
    t = plan.timeouts
    batch_rows = max(
        shared_batch_rows(plan.max_batch_rows, s.kv_bytes, s.kv_budget_bytes) for s in plan.stages
    )
    slots = min(e.ring_spec.slot_count for e in plan.edges)
    most, positions = plan.max_batch_rows, plan.kv_positions
    batches = max(
        shared_batches(batch_runs(most, s.kv_bytes, s.kv_budget_bytes, positions), slots)
        for s in plan.stages
    )
    longest, size = plan.model.max_seq_len, plan.prefill_chunk
    chunks, rows = (-(-longest // size), size) if 0 < size < longest else (1, longest)
    prompt_ms = t.token_limit_ms(plan.stage_count, chunks, rows, batch_rows, batches)
    token_ms = t.token_limit_ms(plan.stage_count, 1, 1, batch_rows, batches)
    stop_ms = t.stop_limit_ms(rows, batch_rows)
    return (t.ready_ms + prompt_ms + plan.max_tokens * token_ms + stop_ms) * 1000 + 1_000_000


def chain_bound_us(runs: tuple[RunSpec, ...]) -> int:
    """When every run must have ended: the last arrival, then each run's bound in turn
    (a run may wait for every other to free its cache)."""
    return max(r.arrival_us for r in runs) + sum(time_bound_us(r.plan) for r in runs)


def check(sim: ChainSimulation, result: ChainResult, solo: Solo | None = None) -> list[Violation]:
    """Every violation in the trace of ``sim`` (empty when the runs kept every rule);
    with ``solo``, each run's tokens are also compared with its tokens alone. The checker
    reads the trace: a simulation run without one cannot be checked (``ValueError``)."""
    if not sim.trace.enabled:
        raise ValueError("a simulation without a trace cannot be checked")
    return _Checker(sim, result, solo).run()


class _Checker:
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

    # -- at the end ---------------------------------------------------------------------------
    def _end(self) -> None:
        r = self.result
        sim = self.sim
        bound = chain_bound_us(sim.runs)
        dropped_stop = {dst for src, dst, mtype in sim.dropped if mtype == "StopRun"}
        for i, run in enumerate(r.runs):
            spec = sim.runs[i]
            run_id = run.last_id  # the id it ended under (it had others if it waited for KV)
            if run.refused is None:
                if self.finished[run_id] != 1 or run.finished is None:
                    self.fail(
                        ONE_OUTCOME, r.end_us, f"{run_id!r}: {self.finished[run_id]} outcomes"
                    )
                if run.finished_us is None or run.finished_us > bound:
                    self.fail(
                        LIVENESS_OUTCOME,
                        r.end_us,
                        f"{run_id!r}: outcome at {run.finished_us} us, bound {bound} us",
                    )
            for each in run.chain_ids:
                self._stops(each, spec, dropped_stop)
            self._isolation(i, run)
            if sim.faults.harmless_for(i) and sim.parts.mutant is None:
                faults = [f.describe() for f in sim.faults.faults]
                if run.outcome != "completed":
                    fault = run.finished.fault if run.finished is not None else run.refused
                    self.fail(
                        HARMLESS,
                        r.end_us,
                        f"{run_id!r} ended {run.outcome} ({fault}) with faults {faults}",
                    )
                for node in sorted({n for each in run.chain_ids for n in self.stage_faulted[each]}):
                    self.fail(HARMLESS, r.end_us, f"{node} faulted {run_id!r} with faults {faults}")
            if self.solo is not None and run.tokens:
                alone = self.solo(spec)
                same = (
                    alone == run.tokens
                    if run.outcome == "completed"
                    else (alone[: len(run.tokens)] == run.tokens)
                )
                if not same:
                    self.fail(
                        BATCH_INVARIANCE,
                        r.end_us,
                        f"{run_id!r}: {list(run.tokens)} beside other runs, {list(alone)} alone",
                    )
        for s, stage in enumerate(sim.stages):
            if not r.alive[s]:
                continue
            if r.held[s]:
                self.fail(
                    LIVENESS_STOPPED, r.end_us, f"{stage.node_id} still holds {list(r.held[s])}"
                )
            if not stage.closed and any(self.provisioned.values()):
                self.fail(LIVENESS_STOPPED, r.end_us, f"{stage.node_id} never closed its chain")
        self._batches_reported()
        for node, kind, ok, reason in sim.forgeries:
            if not ok:
                self.fail(SECURITY, 0, f"{kind} at {node}: {reason}")

    def _stops(self, run_id: str, spec: RunSpec, dropped_stop: set[str]) -> None:
        """Every stage ``run_id`` was provisioned on was sent its StopRun, and got it."""
        r = self.result
        if run_id in self.ended:
            for s in sorted(self.provisioned[run_id] - self.stop_sent[run_id]):
                self.fail(
                    TEARDOWN_TO_ALL, self.ended[run_id], f"{run_id!r}: no StopRun to stage {s}"
                )
        for s in sorted(self.provisioned[run_id]):
            node_id = spec.plan.stages[s].node_id
            if not r.alive[s] or node_id in dropped_stop:
                continue
            if node_id not in self.stop_got[run_id]:
                self.fail(LIVENESS_STOP_RUN, r.end_us, f"{node_id} never got StopRun of {run_id!r}")

    def _batches_reported(self) -> None:
        """Once every run ended, each stage still alive, holding no run, whose stops were
        all confirmed and none of whose control messages was lost, reported each batch it
        ran exactly once: the orchestrator's counts are its batches, by rows."""
        r = self.result
        if any(run.finished is None and run.refused is None for run in r.runs):
            return
        for s, stage in enumerate(self.sim.stages):
            node = stage.node_id
            if not r.alive[s] or r.held[s]:
                continue
            if any(node in (src, dst) for src, dst, _ in self.sim.dropped):
                continue
            if any(run.finished and s in run.finished.unconfirmed_stages for run in r.runs):
                continue
            ran = r.batches[s]
            reported = r.batch_counts.get(s, {})
            if reported != ran:
                self.fail(
                    BATCHES_REPORTED,
                    r.end_us,
                    f"{node} ran batches {ran} (rows: batches), reported {reported}",
                )

    def _isolation(self, i: int, run: Any) -> None:
        """Run ``i``'s caller got exactly its run's tokens (EOS excluded), each as its last
        stage made it for that run and sequence."""
        run_id = run.last_id
        consumed = self.consumed.get(run_id, {})
        made = self.made.get(run_id, {})
        eos = self.sim.runs[i].plan.model.eos_token_id
        for sequence, token in sorted(consumed.items()):
            if made.get(sequence) != token:
                self.fail(
                    ISOLATION,
                    self.result.end_us,
                    f"{run_id!r} consumed token {token} at {sequence}; its last stage made "
                    f"{made.get(sequence)}",
                )
        expected = [(run_id, s, t) for s, t in sorted(consumed.items()) if t != eos]
        got = list(run.delivered)
        if got != expected[: len(got)] or (run.outcome == "completed" and got != expected):
            self.fail(
                ISOLATION,
                self.result.end_us,
                f"{run_id!r}'s caller got {got[:6]}; its run consumed {expected[:6]}",
            )


def _hops(plan: RunPlan) -> list[Any]:
    """The chain's edges in hop order: token-in, each stage's outbound."""
    by_id = {e.edge_id: e for e in plan.edges}
    return [by_id[plan.stages[0].inbound_edge]] + [by_id[s.outbound_edge] for s in plan.stages]
