"""The simulation's nodes of a chain: each stage (``ChainStageNode``: a
``ChainStageController`` over its worker, per-run timers, batches that take the timing
model's time, and the faults of the plan that strike it) and the orchestrator
(``ChainOrchestratorNode``: a ``ChainOrchestrator`` that adds each run when it arrives,
each with its own caller). Each node is pumped by the scheduler when something it waits
for happens. The controllers are the production ones, subclassed only to trace what
their machines handle and do (``TracedChainStage``, ``TracedChainOrchestrator``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from runplan.fsm import orchestrator as ofsm
from runplan.fsm import stage as sfsm
from runplan.messages import StopRun
from runtime_core.chain_orchestrator import ChainOrchestrator, RunHandle, RunRefused
from runtime_core.chain_orchestrator import RunTimerFired as OrchestratorTimerFired
from runtime_core.chain_stage import ChainStageController, RunSlot, RunTimerFired
from runtime_core.workers.interface import Worker
from runtime_sim.chain_forgeries import forge_at_ready
from runtime_sim.clock import Handle
from runtime_sim.faults import FaultKind, FaultyChainWorker
from runtime_sim.links import ORCHESTRATOR, ToOrchestrator, ToStages
from runtime_sim.timing import StageCost
from runtime_sim.trace import describe

if TYPE_CHECKING:
    from runtime_sim.chain_driver import ChainSimulation, RunSpec

_READY = sfsm.State.READY


class Node:
    """A simulated process: pumped by the scheduler when something it waits for happens."""

    node_id: str
    sim: ChainSimulation
    alive: bool = True
    _pump: Handle | None = None

    @property
    def waiting_for_space(self) -> bool:
        """Whether the node has a record to publish and no slot for it."""
        return False

    def wake(self) -> None:
        """Pump soon (once, however many wake it before then)."""
        if self.alive and self._pump is None:
            self._pump = self.sim.clock.after(0, self.pump)

    def pump(self) -> None:
        """Do what the node can do now. It runs only as ``wake`` scheduled it: it
        begins with ``self._pump = None`` and does nothing once the node is dead."""
        raise NotImplementedError

    def fire_run(self, run_id: str, timer: Any) -> None:
        """A run's timer ran out."""
        raise NotImplementedError

    def deliver(self, sender: str, message: Any) -> None:
        """A control message arrived."""
        raise NotImplementedError


class SimRunTimers:
    """A node's running timers, by run and timer."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.handles: dict[tuple[str, str], Handle] = {}

    def start(self, run_id: str, timer: Any, ms: int) -> None:
        key = (run_id, timer._value_)
        handle = self.handles.pop(key, None)
        if handle is not None:
            handle.cancel()
        node = self.node
        self.handles[key] = node.sim.clock.after(ms * 1000, lambda: node.fire_run(run_id, timer))

    def cancel(self, run_id: str, timer: Any) -> None:
        handle = self.handles.pop((run_id, timer._value_), None)
        if handle is not None:
            handle.cancel()

    def cancel_all(self) -> None:
        for handle in self.handles.values():
            handle.cancel()
        self.handles.clear()


def _event_detail(event: Any) -> tuple[Any, ...]:
    if isinstance(event, sfsm.ObjectLoaded):
        return (event.sequence, event.chunk_index, event.chunk_count, event.edge_id, event.run_id)
    if isinstance(event, sfsm.StepCompleted):
        return (event.sequence, event.chunk_index)
    return describe(event)


def _action_detail(action: Any) -> tuple[Any, ...]:
    if isinstance(action, sfsm.ExecuteStep):
        return (action.sequence, action.chunk_index, action.chunk_count)
    return describe(action)


class TracedChainStage(ChainStageController):
    """A chain stage whose machines' events and actions are traced, each with its run
    (``("ev" | "act", name, (run_id, *detail))``), with the controller's own trace
    (``"ctl"``), and whose batch outputs wait until the node's batch has taken its time.
    The self-test's mutants subclass it."""

    def __init__(self, node: ChainStageNode, worker: Worker, stopped_runs: frozenset[str]) -> None:
        sim = node.sim
        self.node = node
        self._sim_trace = sim.trace
        self._clock = sim.clock
        super().__init__(
            node.node_id,
            ORCHESTRATOR,
            worker,
            sim.links,
            ToOrchestrator(sim, node.node_id),
            node.timers,
            trace=self._trace_ctl,
            stopped_runs=stopped_runs,
        )

    def _trace_ctl(self, kind: str, fields: dict[str, Any]) -> None:
        self._sim_trace.add(self._clock.now_us, self.node.node_id, "ctl", kind, fields)

    @staticmethod
    def _run_of(slot: RunSlot, event: Any = None) -> str | None:
        if slot.machine.run_id is not None:
            return slot.machine.run_id
        if slot.provision is not None:
            return slot.provision.run_id
        message = getattr(event, "message", event)
        return getattr(message, "run_id", None)

    def _feed(self, slot: RunSlot, event: sfsm.Event, held: bool = True) -> None:
        detail = (self._run_of(slot, event), *_event_detail(event))
        self._sim_trace.add(
            self._clock.now_us, self.node.node_id, "ev", type(event).__name__, *detail
        )
        super()._feed(slot, event, held)

    def _act(self, slot: RunSlot, action: sfsm.Action) -> None:
        run_id = self._run_of(slot)
        detail = (run_id, *_action_detail(action))
        self._sim_trace.add(
            self._clock.now_us, self.node.node_id, "act", type(action).__name__, *detail
        )
        super()._act(slot, action)
        if isinstance(action, sfsm.BeginSetup):
            self.node.on_provisioned()
        elif isinstance(action, sfsm.ExecuteStep) and run_id is not None:
            self.node.batch_steps.append((run_id, action.sequence, action.chunk_index))

    def try_publish_outputs(self) -> bool:
        if self.node.computing:
            return False  # the batch is still running (in virtual time)
        return super().try_publish_outputs()


class ChainStageNode(Node):
    def __init__(
        self,
        sim: ChainSimulation,
        index: int,
        worker: Worker,
        cost: StageCost,
        stopped_runs: frozenset[str],
    ) -> None:
        self.sim = sim
        self.index = index
        self.node_id = sim.plan.stages[index].node_id
        self.cost = cost
        self.step_us: dict[int, int] = {}  # a batch's time by rows (the model is frozen)
        self.alive = True
        self._pump = None
        self.timers = SimRunTimers(self)
        fail_at = {
            (sim.run_id(f.run), f.sequence)
            for f in sim.faults.of(FaultKind.STEP_FAILS)
            if f.stage == index
        }
        refuse = {
            sim.run_id(f.run) for f in sim.faults.of(FaultKind.KV_REFUSED) if f.stage == index
        }
        if fail_at or refuse:
            worker = FaultyChainWorker(worker, fail_at, refuse)  # type: ignore[assignment]
        self.worker = worker
        self.computing = False  # a batch is running: its outputs wait
        self.batch_steps: list[tuple[str, int, int]] = []  # (run, sequence, chunk) of the batch
        self.chain_over = False  # the orchestrator is gone: close once no run is held
        self.closed = False
        self.loaded = False  # the weights are bound: later runs set up at once
        self._killed_in_teardown = False
        self._killed_before_ready = False
        self._forged: set[str] = set()  # runs whose first READY brought the forgeries
        self._setup: Handle | None = None
        self._batch: Handle | None = None
        self._release: Handle | None = None
        self._attach: Handle | None = None
        self._stuck: Handle | None = None
        self._doom: list[Handle] = []  # deaths and link cuts scheduled within a batch
        self.controller: TracedChainStage = sim.parts.stage_controller(self, worker, stopped_runs)

    @property
    def waiting_for_space(self) -> bool:
        return self.controller.output_pending and not self.computing

    # -- events in ------------------------------------------------------------------------
    def deliver(self, sender: str, message: Any) -> None:
        if not self.alive:
            return
        self.controller.handle(sfsm.Received(sender, message))
        if isinstance(message, StopRun) and not self._killed_in_teardown:
            for fault in self.sim.faults.of(FaultKind.KILL_IN_TEARDOWN):
                if fault.stage == self.index:
                    self._killed_in_teardown = True
                    self.sim.clock.after(self.sim.settings.release_us // 2, self.die)
        self.wake()

    def fire_run(self, run_id: str, timer: Any) -> None:
        if self.alive:
            self.controller.handle(RunTimerFired(run_id, timer))
            self.wake()

    def orchestrator_lost(self) -> None:
        if self.alive:
            self.chain_over = True
            self.controller.handle(sfsm.OrchestratorLost())
            self.wake()

    def on_provisioned(self) -> None:
        if self._killed_before_ready:
            return
        for fault in self.sim.faults.of(FaultKind.KILL_BEFORE_READY):
            if fault.stage == self.index:
                self._killed_before_ready = True
                load = self.sim.settings.timing.load_us(self.cost)
                self.sim.clock.after(int(fault.fraction * load), self.die)

    def die(self) -> None:
        if not self.alive:
            return
        self.alive = False
        sim = self.sim
        sim.trace.add(sim.clock.now_us, self.node_id, "sim", "died")
        for handle in (self._setup, self._batch, self._release, self._attach, self._stuck):
            if handle is not None:
                handle.cancel()
        if self._pump is not None:
            self._pump.cancel()
        self.timers.cancel_all()
        index = self.index
        sim.clock.after(sim.settings.death_notice_us, lambda: sim.orchestrator.stage_died(index))

    # -- work -----------------------------------------------------------------------------
    def pump(self) -> None:
        self._pump = None
        c = self.controller
        sim = self.sim
        progress = True
        while progress and self.alive:
            progress = False
            if self._setup is None and c.setup_pending:
                wait = sim.settings.timing.load_us(self.cost) if not self.loaded else 0
                self._setup = sim.clock.after(int(wait), self._run_setup)
            if self._attach is None and c.links_pending and not c.setup_pending:
                if c.try_attach_links():
                    progress = True
                else:
                    self._attach = sim.clock.after(sim.settings.attach_retry_us, self._retry)
            while c.wants_input and c.poll_inbound():
                progress = True
            if not self.computing and c.output_pending:
                if c.try_publish_outputs():
                    progress = True
                    self._unstick()
                elif self._stuck is None and c.output_pending:
                    self._stuck_since = sim.clock.now_us
                    wait_ms = sim.plan.timeouts.edge_wait_ms
                    self._stuck = sim.clock.after(wait_ms * 1000, self._run_stuck)
            if not self.computing and c.batch_ready:
                self._start_batch()
                progress = True
            if self._release is None and c.release_pending:
                self._release = sim.clock.after(sim.settings.release_us, self._run_release)
            for run_id, state in list(c.held()):
                if state is _READY and run_id not in self._forged:
                    self._forged.add(run_id)
                    forge_at_ready(sim, self, run_id)
            if self.chain_over and not self.closed and not c.runs and not c.release_pending:
                self.closed = True
                reserved = self.worker.kv_reserved_bytes
                sim.trace.add(sim.clock.now_us, self.node_id, "sim", "chain_closed", reserved)
                c.close()

    def _retry(self) -> None:
        self._attach = None
        self.wake()

    def _unstick(self) -> None:
        if self._stuck is not None:
            self._stuck.cancel()
            self._stuck = None

    def _run_stuck(self) -> None:
        self._stuck = None
        if self.alive and self.controller.output_pending and not self.computing:
            waited = (self.sim.clock.now_us - self._stuck_since) // 1000
            self.controller.output_stuck(int(waited))
            self.wake()

    def _run_setup(self) -> None:
        self._setup = None
        if self.alive:
            sim = self.sim
            on_load = sim.on_load
            index = self.index
            progress = (lambda done, total: on_load(index, done, total)) if on_load else None
            if not self.loaded:
                load = int(sim.settings.timing.load_us(self.cost))
                sim.trace.add(sim.clock.now_us - load, self.node_id, "span", "load", load)
            self.controller.run_setup(progress)
            self.loaded = self.controller._bound
            self.wake()

    def _start_batch(self) -> None:
        sim = self.sim
        c = self.controller
        before = c.batches
        self.batch_steps = []
        now = sim.clock.now_us
        sim.trace.add(now, self.node_id, "sim", "batch_begin")
        self.computing = True
        began = time.perf_counter()
        c.run_batch()
        spent = time.perf_counter() - began
        if c.batches == before:  # every chosen record faulted its run: no batch
            self.computing = False
            sim.trace.add(now, self.node_id, "sim", "batch_end")
            return
        steps = list(self.batch_steps)
        if sim.wall_clock and len(steps) == 1:
            sequence = steps[0][1]
            sim.step_wall_s[sequence] = sim.step_wall_s.get(sequence, 0.0) + spent
        rows = c.batch_rows[-1]
        duration = self.step_us.get(rows)
        if duration is None:
            duration = self.step_us[rows] = int(sim.settings.timing.step_us(self.cost, rows))
        sequences = {s for _, s, _ in steps}
        runs = {(r, s) for r, s, _ in steps}
        for fault in sim.faults.faults:
            if fault.stage != self.index:
                continue
            if (
                fault.kind is FaultKind.SLOW_STEP
                and (sim.run_id(fault.run), fault.sequence) in runs
            ):
                duration += 2 * sim.plan.timeouts.step_limit_ms(rows) * 1000
            if (fault.kind is FaultKind.KILL_MID_PREFILL and 0 in sequences) or (
                fault.kind is FaultKind.KILL_MID_DECODE and fault.sequence in sequences
            ):
                sim.clock.after(duration // 2, self.die)
            if fault.kind is FaultKind.EDGE_CLOSE and fault.sequence in sequences:
                inbound = c.inbound
                if inbound is not None:
                    sim.clock.after(duration // 2, inbound.close)
        if sim.trace.enabled:
            runs_in = {r for r, _, _ in steps}
            if len(runs_in) == 1:
                name = f"step {steps[0][1]}"
            else:
                name = "step " + " ".join(f"{r}:{q}" for r, q, _ in steps)
            sim.trace.add(now, self.node_id, "span", name, duration, rows, steps)
        self._batch = sim.clock.after(duration, self._end_batch)

    def _end_batch(self) -> None:
        self._batch = None
        self.computing = False
        if self.alive:
            self.sim.trace.add(self.sim.clock.now_us, self.node_id, "sim", "batch_end")
            self.wake()

    def _run_release(self) -> None:
        self._release = None
        if self.alive:
            self.controller.run_release()
            self.wake()


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
        name = type(event).__name__
        self._sim_trace.add(
            self._clock.now_us, ORCHESTRATOR, "ev", name, handle.run_id, *describe(event)
        )
        super()._feed(handle, event)

    def _act(self, handle: RunHandle, action: ofsm.Action) -> None:
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
