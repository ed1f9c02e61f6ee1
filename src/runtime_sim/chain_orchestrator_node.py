"""The simulation's orchestrator node of a chain (``ChainOrchestratorNode``): a
``ChainOrchestrator`` that adds each run when it arrives, each run with its own caller
(the tokens it gets, its cancel), and exits once every run has ended. The controller is
the production one, subclassed only to trace what its machines handle and do
(``TracedChainOrchestrator``).

Runs that wait for KV memory (CONCURRENT_RUNS.md §5) follow the process runtime's rules,
the same code (``runtime_core.kv_waits``): a run a stage refused (``ProvisionRefused``)
while other runs held cache on it is held (traced ``kv_held``) and offered again under a
new run id (``kv_again``: ``<chain's first run id>-again-<n>``) once another run ends;
one that could never fit ends faulted, naming its size against the stage's whole
budget; a held run its caller cancels, or that a chain fault finds, ends at once
(``kv_held_ended``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from runplan import RunPlan
from runplan.fsm import orchestrator as ofsm
from runplan.messages import StopReason
from runtime_core.chain_orchestrator import ChainOrchestrator, RunHandle, RunRefused
from runtime_core.chain_orchestrator import RunTimerFired as OrchestratorTimerFired
from runtime_core.kv_waits import KvWaits
from runtime_sim.chain_nodes import Node, SimRunTimers
from runtime_sim.clock import Handle
from runtime_sim.faults import FaultKind
from runtime_sim.links import ORCHESTRATOR, ToStages
from runtime_sim.trace import describe

if TYPE_CHECKING:
    from runtime_sim.chain_driver import ChainSimulation, RunSpec


class TracedChainOrchestrator(ChainOrchestrator):
    """The chain's orchestrator, its machines' events and actions traced with their run
    (``("ev" | "act", name, (run_id, *detail))``) and its own trace as ``"ctl"``. The
    self-test's mutants subclass it."""

    def __init__(self, node: ChainOrchestratorNode) -> None:
        sim = node.sim
        self.node = node
        self._sim_trace = sim.trace
        self._clock = sim.clock
        super().__init__(ToStages(sim), sim.links, node.timers, trace=self._trace_ctl)

    def _trace_ctl(self, kind: str, fields: dict[str, Any]) -> None:
        self._sim_trace.add(self._clock.now_us, ORCHESTRATOR, "ctl", kind, fields)

    def _feed(self, handle: RunHandle, event: ofsm.Event) -> None:
        if self._sim_trace.enabled:
            name = type(event).__name__
            self._sim_trace.add(
                self._clock.now_us, ORCHESTRATOR, "ev", name, handle.run_id, *describe(event)
            )
        super()._feed(handle, event)

    def _act(self, handle: RunHandle, action: ofsm.Action) -> None:
        if self._sim_trace.enabled:
            name = type(action).__name__
            self._sim_trace.add(
                self._clock.now_us, ORCHESTRATOR, "act", name, handle.run_id, *describe(action)
            )
        super()._act(handle, action)


class SimRun:
    """One arrival's run on the chain (a ``kv_waits.Waiting``): its plan and handle, both
    new each time it is offered again after waiting for KV memory (``former_ids``: its
    ids before), and its end while held (``ended``: cancelled, or the chain's fault)."""

    def __init__(self, index: int, plan: RunPlan) -> None:
        self.index = index
        self.plan = plan
        self.handle: RunHandle | None = None
        self.former_ids: tuple[str, ...] = ()
        self.held = False  # waits for KV memory
        self.ended: ofsm.RunFinished | None = None

    @property
    def run_id(self) -> str:
        return self.plan.run_id

    @property
    def finished(self) -> ofsm.RunFinished | None:
        """Its outcome (``None`` while it runs or is held)."""
        if self.held:
            return None
        if self.ended is not None or self.handle is None:
            return self.ended
        return self.handle.finished


class ChainOrchestratorNode(Node):
    def __init__(self, sim: ChainSimulation) -> None:
        self.sim = sim
        self.node_id = ORCHESTRATOR
        self.alive = True
        self._pump = None
        self.timers = SimRunTimers(self)
        self.handles: dict[int, RunHandle] = {}  # by arrival: each run's latest
        self.sim_runs: dict[int, SimRun] = {}  # by arrival: the runs the chain took
        self._settled: set[int] = set()  # runs whose end was seen (held or ended)
        self._again = 0  # run ids given to runs offered again
        self.waits: KvWaits[SimRun] = KvWaits(self._next_run_id)
        self.refused: dict[int, str] = {}  # runs the chain would not take, and why
        self.arrived = 0
        self.finished_us: dict[str, int] = {}
        self.ready_us: dict[str, int] = {}
        self.token_times: dict[str, list[int]] = {}
        self.exited = False
        self._retry: Handle | None = None
        self.controller: TracedChainOrchestrator = sim.parts.orchestrator_controller(self)

    @property
    def waiting_for_space(self) -> bool:
        return self.controller.inject_pending

    def start(self) -> None:
        for i, spec in enumerate(self.sim.runs):
            self.sim.clock.at(spec.arrival_us, lambda i=i: self.arrive(i))  # type: ignore[misc]

    def caller(self, i: int) -> Any:
        """Run ``i``'s caller: the tokens it receives, and its cancel after token ``s``."""
        sim = self.sim
        spec: RunSpec = sim.runs[i]
        run_id = spec.plan.run_id
        delivered = sim.delivered[i]
        times = self.token_times.setdefault(run_id, [])
        cancel_after = {f.sequence for f in sim.faults.of(FaultKind.CALLER_CANCELS) if f.run == i}
        user = sim.on_token

        def on_token(got_run: str, sequence: int, token_id: int) -> None:
            delivered.append((got_run, sequence, token_id))
            times.append(sim.clock.now_us)
            if user is not None:
                user(got_run, sequence, token_id)
            if sequence in cancel_after:
                sim.clock.after(0, lambda: self.cancel(run_id))

        return on_token

    def arrive(self, i: int) -> None:
        spec = self.sim.runs[i]
        self.arrived += 1
        sim = self.sim
        sim.trace.add(sim.clock.now_us, ORCHESTRATOR, "sim", "arrive", spec.plan.run_id)
        if self.alive:
            run = SimRun(i, spec.plan)
            try:
                self._add(run)
            except (ofsm.PromptError, RunRefused) as exc:
                self.refused[i] = str(exc)
        self.after_event()

    def _add(self, run: SimRun) -> None:
        run.held = False
        run.handle = self.controller.add_run(
            run.plan, self.sim.runs[run.index].prompt, on_token=self.caller(run.index)
        )
        self.handles[run.index] = run.handle
        self.sim_runs[run.index] = run
        self._settled.discard(run.index)

    def _next_run_id(self) -> str:
        self._again += 1
        return f"{self.sim.plan.run_id}-again-{self._again}"

    def cancel(self, run_id: str) -> None:
        """The run's caller goes away (a client disconnects): ``run_id`` is the id it
        arrived with; a run held for KV memory ends at once."""
        if not self.alive:
            return
        run = next(
            (
                r
                for r in self.sim_runs.values()
                if r.plan.run_id == run_id or run_id in r.former_ids
            ),
            None,
        )
        current = run.run_id if run is not None else run_id
        held = self.waits.take(current)
        if held is not None:
            self._end_held(held, ofsm.RunFinished(StopReason.CANCELLED, (), None, None, ()))
        else:
            self.controller.cancel(current, "the caller cancelled")
        self.after_event()

    def deliver(self, sender: str, message: Any) -> None:
        if self.alive:
            run_id = str(getattr(message, "run_id", ""))
            run = next(
                (r for r in self.sim_runs.values() if r.handle is not None and r.run_id == run_id),
                None,
            )
            self.waits.heard(message, run, self.controller.kv_reserved())
            self.controller.handle(ofsm.Received(sender, message))
            self.after_event()

    def fire_run(self, run_id: str, timer: Any) -> None:
        if self.alive:
            self.controller.handle(OrchestratorTimerFired(run_id, timer))
            self.after_event()

    def stage_died(self, index: int) -> None:
        if self.alive:
            node_id = self.sim.stages[index].node_id
            self.controller.handle(ofsm.StageDied(index, f"process gone on {node_id}"))
            self.after_event()

    def after_event(self) -> None:
        self._settle()
        if not self._check_finished():
            self.wake()

    def _settle(self) -> None:
        """As the process runtime's chain runner does: each run that ended is held for KV
        memory or ends; the held runs due are offered again (the first alone when no run
        is left to end); a broken chain ends them."""
        if not self.alive:
            return
        trace, now = self.sim.trace, self.sim.clock.now_us
        for i, run in self.sim_runs.items():
            if i in self._settled or run.handle is None or run.handle.finished is None:
                continue
            self._settled.add(i)
            if self.controller.broken is None and self.waits.holds(run):
                run.held = True
                trace.add(now, ORCHESTRATOR, "sim", "kv_held", run.run_id)
                continue
            self.waits.forget(run)
            self.waits.ended()
        broken = self.controller.broken
        if broken is not None:
            for run in self.waits.take_all():
                self._end_held(run, ofsm.RunFinished(StopReason.FAULTED, (), broken, None, ()))
            return
        again = self.waits.due()
        if not again and not any(
            r.handle is not None and r.handle.finished is None for r in self.sim_runs.values()
        ):
            again = self.waits.first()  # nothing left to end and free memory
        for run in again:
            trace.add(now, ORCHESTRATOR, "sim", "kv_again", run.former_ids[-1], run.run_id)
            try:
                self._add(run)
            except (ofsm.PromptError, RunRefused) as exc:  # not for the plan it was added with
                self.refused[run.index] = str(exc)
                self.waits.forget(run)
                self._end_held(run, ofsm.RunFinished(StopReason.FAULTED, (), None, None, ()))

    def _end_held(self, run: SimRun, finished: ofsm.RunFinished) -> None:
        run.held = False
        run.ended = finished
        self.sim.trace.add(
            self.sim.clock.now_us,
            ORCHESTRATOR,
            "sim",
            "kv_held_ended",
            run.run_id,
            finished.outcome.name,
        )

    def _check_finished(self) -> bool:
        """Note each run's readiness and end; once every run has arrived and ended,
        the orchestrator exits. ``True`` once it has."""
        now = self.sim.clock.now_us
        c = self.controller
        for run in self.sim_runs.values():
            if run.finished is not None and run.run_id not in self.finished_us:
                self.finished_us[run.run_id] = now
                if self.sim.on_run_end is not None:
                    self.sim.on_run_end(run.index)
            handle = run.handle
            if handle is None or handle.run_id in self.ready_us:
                continue
            if handle.machine.state is ofsm.State.RUNNING:
                self.ready_us[handle.run_id] = now
        every = self.arrived == len(self.sim.runs)
        if self.alive and every and all(r.finished is not None for r in self.sim_runs.values()):
            self.alive = False  # the caller's process exits once every run is over
            c.close()
            self.sim.orchestrator_exited()
        return not self.alive

    def pump(self) -> None:
        self._pump = None
        if not self.alive:
            return
        c = self.controller
        if c.links_pending and self._retry is None and not c.try_open_links():
            self._retry = self.sim.clock.after(self.sim.settings.attach_retry_us, self._retry_open)
        if c.inject_pending:
            c.try_inject()
        while c.wants_tokens and c.poll_tokens():
            pass
        self._check_finished()

    def _retry_open(self) -> None:
        self._retry = None
        self.wake()
