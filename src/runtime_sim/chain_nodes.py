"""The simulation's stage nodes of a chain: ``ChainStageNode`` (a
``ChainStageController`` over its worker, per-run timers, batches that take the timing
model's time, and the faults of the plan that strike it), and what every node shares
(``Node``, ``SimRunTimers``). Each node is pumped by the scheduler when something it
waits for happens. The controller is the production one, subclassed only to trace what
its machines handle and do (``TracedChainStage``); the orchestrator's node is
``chain_orchestrator_node``."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from runplan.fsm import stage as sfsm
from runplan.messages import StopRun
from runtime_core.chain_stage import ChainStageController, RunSlot, RunTimerFired
from runtime_core.workers.interface import Worker
from runtime_sim.chain_forgeries import forge_at_ready
from runtime_sim.clock import Handle
from runtime_sim.faults import FaultKind, FaultyChainWorker
from runtime_sim.links import ORCHESTRATOR, ToOrchestrator
from runtime_sim.timing import StageCost
from runtime_sim.trace import describe

if TYPE_CHECKING:
    from runtime_sim.chain_driver import ChainSimulation

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
        if self._sim_trace.enabled:
            detail = (self._run_of(slot, event), *_event_detail(event))
            self._sim_trace.add(
                self._clock.now_us, self.node.node_id, "ev", type(event).__name__, *detail
            )
        super()._feed(slot, event, held)

    def _act(self, slot: RunSlot, action: sfsm.Action) -> None:
        run_id = self._run_of(slot)
        if self._sim_trace.enabled:
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
        self._kv_traced = 0  # the KV bytes reserved when last traced
        self._batch: Handle | None = None
        self._release: Handle | None = None
        self._attach: Handle | None = None
        self._stuck: Handle | None = None
        self._stuck_since = 0  # when the outbound ring last refused a record
        self._stuck_published = 0  # the records written then (a record more: a new wait)
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
        reserved = self.worker.kv_reserved_bytes
        if reserved != self._kv_traced:  # what the runs' caches hold of the stage's budget
            self._kv_traced = reserved
            sim.trace.add(sim.clock.now_us, self.node_id, "sim", "kv_reserved", reserved)
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
                elif c.output_pending and (
                    self._stuck is None or c.records_published != self._stuck_published
                ):
                    # one wait on a full ring, begun again by every record written
                    self._unstick()
                    self._stuck_since = sim.clock.now_us
                    self._stuck_published = c.records_published
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
            self.loaded = self.controller.chain is not None
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
        rows = c.last_batch_rows
        duration = self.step_us.get(rows)
        if duration is None:
            duration = self.step_us[rows] = int(sim.settings.timing.step_us(self.cost, rows))
        sequences = {s for _, s, _ in steps}
        runs = {(r, s) for r, s, _ in steps}
        for fault in sim.faults.faults:
            if fault.stage != self.index:
                continue
            slow = sim.run_id(fault.run)
            if fault.kind is FaultKind.SLOW_STEP and (slow, fault.sequence) in runs:
                duration += 2 * self._step_limit_us(slow, rows)
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

    def _step_limit_us(self, run_id: str, rows: int) -> int:
        """The longest step timer this stage armed for a step of ``run_id`` in a batch
        of ``rows`` rows (the step's rows are at most the batch's): its provision's
        ``batch_step_limit_ms``, armed at the record's load, before the batch."""
        provision = self.controller.runs[run_id].provision
        assert provision is not None
        t = provision.timeouts
        return t.batch_step_limit_ms(rows, provision.batch_rows, provision.shared_batches) * 1000

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
