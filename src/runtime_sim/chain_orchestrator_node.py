"""The simulation's orchestrator node of a chain (``ChainOrchestratorNode``): a
``ChainOrchestrator`` that adds each run when it arrives, each run with its own caller
(the tokens it gets, its cancel), and exits once every run has ended. The controller is
the production one, subclassed only to trace what its machines handle and do
(``TracedChainOrchestrator``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from runplan.fsm import orchestrator as ofsm
from runtime_core.chain_orchestrator import ChainOrchestrator, RunHandle, RunRefused
from runtime_core.chain_orchestrator import RunTimerFired as OrchestratorTimerFired
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


class ChainOrchestratorNode(Node):
    def __init__(self, sim: ChainSimulation) -> None:
        self.sim = sim
        self.node_id = ORCHESTRATOR
        self.alive = True
        self._pump = None
        self.timers = SimRunTimers(self)
        self.handles: dict[int, RunHandle] = {}  # by arrival
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
            try:
                self.handles[i] = self.controller.add_run(
                    spec.plan, spec.prompt, on_token=self.caller(i)
                )
            except (ofsm.PromptError, RunRefused) as exc:
                self.refused[i] = str(exc)
        self.after_event()

    def cancel(self, run_id: str) -> None:
        """The run's caller goes away (a client disconnects)."""
        if self.alive:
            self.controller.cancel(run_id, "the caller cancelled")
            self.after_event()

    def deliver(self, sender: str, message: Any) -> None:
        if self.alive:
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
        if not self._check_finished():
            self.wake()

    def _check_finished(self) -> bool:
        """Note each run's readiness and end; once every run has arrived and ended,
        the orchestrator exits. ``True`` once it has."""
        now = self.sim.clock.now_us
        c = self.controller
        for handle in self.handles.values():
            if handle.finished is not None and handle.run_id not in self.finished_us:
                self.finished_us[handle.run_id] = now
            if handle.run_id not in self.ready_us and handle.machine.state is ofsm.State.RUNNING:
                self.ready_us[handle.run_id] = now
        every = self.arrived == len(self.sim.runs)
        if self.alive and every and all(h.finished is not None for h in self.handles.values()):
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
