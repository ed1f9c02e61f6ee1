"""The checks at a chain's end, over what ``chain_checker``'s one pass gathered from the
trace: each run's one outcome within its time bound, StopRun to and received by every
stage it was provisioned on, isolation, no harm from harmless faults, batch invariance
(against ``Solo``), every stage left holding no run, its batches reported once, and
every forgery rejected."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from runtime_sim.chain_driver import ChainResult, ChainSimulation, RunSpec
from runtime_sim.chain_ring_rules import Fail
from runtime_sim.chain_rules import (
    BATCH_INVARIANCE,
    BATCHES_REPORTED,
    HARMLESS,
    ISOLATION,
    LIVENESS_OUTCOME,
    LIVENESS_STOP_RUN,
    LIVENESS_STOPPED,
    ONE_OUTCOME,
    SECURITY,
    TEARDOWN_TO_ALL,
    chain_bound_us,
)

#: Runs one run alone on a fresh chain (same seed, same kind of worker): its tokens.
Solo = Callable[[RunSpec], tuple[int, ...]]


class EndChecks:
    """The end-of-chain checks of ``chain_checker``'s checker (a mix-in: its one pass
    fills in what they read)."""

    sim: ChainSimulation
    result: ChainResult
    solo: Solo | None
    fail: Fail
    made: dict[str, dict[int, int]]  # run -> sequence -> token its last stage made
    consumed: dict[str, dict[int, int]]  # run -> sequence -> token consumed
    provisioned: dict[str, set[int]]  # run -> stages that took it
    stop_sent: dict[str, set[int]]
    stop_got: dict[str, set[str]]
    finished: dict[str, int]
    ended: dict[str, int]
    stage_faulted: dict[str, set[str]]

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
        """Run ``i``'s caller got exactly its run's tokens (the one that ended it, EOS or
        another end of generation, excluded), each as its last stage made it for that run
        and sequence."""
        run_id = run.last_id
        consumed = self.consumed.get(run_id, {})
        made = self.made.get(run_id, {})
        ends = self.sim.runs[i].plan.model.end_token_ids
        for sequence, token in sorted(consumed.items()):
            if made.get(sequence) != token:
                self.fail(
                    ISOLATION,
                    self.result.end_us,
                    f"{run_id!r} consumed token {token} at {sequence}; its last stage made "
                    f"{made.get(sequence)}",
                )
        expected = [(run_id, s, t) for s, t in sorted(consumed.items()) if t not in ends]
        got = list(run.delivered)
        if got != expected[: len(got)] or (run.outcome == "completed" and got != expected):
            self.fail(
                ISOLATION,
                self.result.end_us,
                f"{run_id!r}'s caller got {got[:6]}; its run consumed {expected[:6]}",
            )
