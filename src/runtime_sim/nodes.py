"""The simulation's nodes: each stage (``StageNode``: its controller, worker, timers,
and the faults of the plan that strike it) and the orchestrator (``OrchestratorNode``),
each pumped by the scheduler when something it waits for happens."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from runplan.fsm import orchestrator as ofsm
from runplan.fsm import stage as sfsm
from runplan.messages import StopRun
from runtime_core.edge_ends import Record
from runtime_core.orchestrator_controller import OrchestratorController
from runtime_core.stage_controller import StageController
from runtime_core.workers.interface import Worker
from runtime_sim.clock import Handle
from runtime_sim.faults import FaultKind, FaultyWorker
from runtime_sim.forgeries import forge
from runtime_sim.links import ORCHESTRATOR, ToOrchestrator, ToStages
from runtime_sim.timing import StageCost

if TYPE_CHECKING:
    from runtime_sim.driver import Simulation

# Read on every pump: on Python 3.11 ``State.READY`` goes through the slow attribute hook
# of ``EnumType.__getattr__``.
_READY = sfsm.State.READY


class NodeTimers:
    """A node's running timers, by the timer's value (a dict keyed by an Enum member
    would run the member's Python-level ``__hash__`` on every start and cancel)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.handles: dict[Any, Handle] = {}

    def start(self, timer: Any, ms: int) -> None:
        key = timer._value_
        handle = self.handles.pop(key, None)
        if handle is not None:
            handle.cancel()
        self.handles[key] = self.node.sim.clock.after(ms * 1000, lambda: self.node.fire(timer))

    def cancel(self, timer: Any) -> None:
        handle = self.handles.pop(timer._value_, None)
        if handle is not None:
            handle.cancel()

    def cancel_all(self) -> None:
        for handle in self.handles.values():
            handle.cancel()
        self.handles.clear()


class Node:
    node_id: str
    sim: Simulation
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

    def fire(self, timer: Any) -> None:
        raise NotImplementedError

    def deliver(self, sender: str, message: Any) -> None:
        raise NotImplementedError


class StageNode(Node):
    def __init__(
        self,
        sim: Simulation,
        index: int,
        worker: Worker,
        cost: StageCost,
        stopped_runs: frozenset[str],
    ) -> None:
        self.sim = sim
        self.index = index
        self.node_id = sim.plan.stages[index].node_id
        self.cost = cost
        self.step_us: dict[int, int] = {}  # a step's time by rows (the model is frozen)
        self.alive = True
        self._pump = None
        self.timers = NodeTimers(self)
        fail_at = {f.sequence for f in sim.faults.of(FaultKind.STEP_FAILS) if f.stage == index}
        if fail_at:
            worker = FaultyWorker(worker, fail_at)  # type: ignore[assignment]
        self.controller: StageController
        kill_before_ready = any(
            f.stage == index for f in sim.faults.of(FaultKind.KILL_BEFORE_READY)
        )
        if sim.trace.enabled or sim.parts.mutant is not None or kill_before_ready:
            self.controller = sim.parts.stage_controller(self, worker, stopped_runs)
        else:  # nothing to watch between its actions: the controller as it is
            self.controller = StageController(
                self.node_id,
                ORCHESTRATOR,
                worker,
                sim.edges,
                ToOrchestrator(sim, self.node_id),
                self.timers,
                stopped_runs=stopped_runs,
            )
        self._setup: Handle | None = None
        self._step: Handle | None = None
        self._release: Handle | None = None
        self._attach: Handle | None = None
        self._forged = False

    @property
    def waiting_for_space(self) -> bool:
        return self.controller.output_pending

    # -- events in ------------------------------------------------------------------------
    def deliver(self, sender: str, message: Any) -> None:
        if not self.alive:
            return
        self.controller.handle(sfsm.Received(sender, message))
        if isinstance(message, StopRun) and self.controller.state is sfsm.State.STOPPING:
            for fault in self.sim.faults.of(FaultKind.KILL_IN_TEARDOWN):
                if fault.stage == self.index:
                    self.sim.clock.after(self.sim.settings.release_us // 2, self.die)
        self.wake()

    def fire(self, timer: Any) -> None:
        if self.alive:
            self.controller.handle(sfsm.TimerFired(timer))
            self.wake()

    def orchestrator_lost(self) -> None:
        if self.alive:
            self.controller.handle(sfsm.OrchestratorLost())
            self.wake()

    def on_provisioned(self) -> None:
        for fault in self.sim.faults.of(FaultKind.KILL_BEFORE_READY):
            if fault.stage == self.index:
                load = self.sim.settings.timing.load_us(self.cost)
                self.sim.clock.after(int(fault.fraction * load), self.die)

    def die(self) -> None:
        if not self.alive:
            return
        self.alive = False
        sim = self.sim
        sim.trace.add(sim.clock.now_us, self.node_id, "sim", "died")
        for handle in (self._setup, self._step, self._release, self._attach, self._pump):
            if handle is not None:
                handle.cancel()
        self.timers.cancel_all()
        sim.clock.after(
            sim.settings.death_notice_us, lambda: sim.orchestrator.stage_died(self.index)
        )

    # -- work -----------------------------------------------------------------------------
    def pump(self) -> None:
        self._pump = None
        # The node's own handles are read before the controller's (side-effect free)
        # properties: most passes schedule nothing.
        c = self.controller
        sim = self.sim
        progress = True
        while progress and self.alive:
            progress = False
            if self._setup is None and c.setup_pending:
                load = int(sim.settings.timing.load_us(self.cost))
                self._setup = sim.clock.after(load, self._run_setup)
            if self._attach is None and c.outbound_pending and not c.setup_pending:
                if c.try_attach_outbound():
                    progress = True
                else:
                    self._attach = sim.clock.after(sim.settings.attach_retry_us, self._retry)
            if c.wants_input and c.poll_inbound():
                progress = True
            if self._step is None and c.step_pending and c.record is not None:
                self._start_step(c.record)
            if c.output_pending and c.try_publish_output():
                progress = True
            if self._release is None and c.release_pending:
                self._release = sim.clock.after(sim.settings.release_us, self._run_release)
            if not self._forged and c.state is _READY:
                self._forged = True
                forge(sim, self)

    def _retry(self) -> None:
        self._attach = None
        self.wake()

    def _run_setup(self) -> None:
        self._setup = None
        if self.alive:
            start = self.sim.clock.now_us
            on_load = self.sim.on_load
            index = self.index
            progress = (lambda done, total: on_load(index, done, total)) if on_load else None
            self.controller.run_setup(progress)
            load = int(self.sim.settings.timing.load_us(self.cost))
            self.sim.trace.add(start - load, self.node_id, "span", "load", load)
            self.wake()

    def _start_step(self, record: Record) -> None:
        sim = self.sim
        header = record.header
        sequence = header.sequence
        rows = header.rows
        duration = self.step_us.get(rows)
        if duration is None:
            duration = self.step_us[rows] = int(sim.settings.timing.step_us(self.cost, rows))
        for fault in sim.faults.faults:
            if fault.stage != self.index:
                continue
            if fault.kind is FaultKind.SLOW_STEP and fault.sequence == sequence:
                provision = self.controller.provision
                assert provision is not None
                duration += 2 * provision.timeouts.step_limit_ms(rows) * 1000
            if (fault.kind is FaultKind.KILL_MID_PREFILL and sequence == 0) or (
                fault.kind is FaultKind.KILL_MID_DECODE and fault.sequence == sequence
            ):
                sim.clock.after(duration // 2, self.die)
            if fault.kind is FaultKind.EDGE_CLOSE and fault.sequence == sequence:
                inbound = self.controller.inbound
                if inbound is not None:
                    sim.clock.after(duration // 2, inbound.close)
        if sim.trace.enabled:
            sim.trace.add(
                sim.clock.now_us, self.node_id, "span", f"step {sequence}", duration, sequence, rows
            )
        self._step = sim.clock.after(duration, self._run_step)

    def _run_step(self) -> None:
        self._step = None
        if not self.alive:
            return
        c = self.controller
        if self.sim.wall_clock and c.record is not None:
            sequence = c.record.header.sequence
            began = time.perf_counter()
            c.run_step()
            spent = time.perf_counter() - began
            self.sim.step_wall_s[sequence] = self.sim.step_wall_s.get(sequence, 0.0) + spent
        else:
            c.run_step()
        self.wake()

    def _run_release(self) -> None:
        self._release = None
        if self.alive:
            self.controller.run_release()
            self.wake()


class OrchestratorNode(Node):
    def __init__(
        self,
        sim: Simulation,
        prompt_ids: tuple[int, ...],
        on_token: Callable[[int, int], None] | None,
    ) -> None:
        self.sim = sim
        self.node_id = ORCHESTRATOR
        self.alive = True
        self._pump = None
        self.timers = NodeTimers(self)
        self.token_times: list[int] = []

        cancel_after = {f.sequence for f in sim.faults.of(FaultKind.CALLER_CANCELS)}

        def token(sequence: int, token_id: int) -> None:
            self.token_times.append(sim.clock.now_us)
            if on_token is not None:
                on_token(sequence, token_id)
            if sequence in cancel_after:
                sim.clock.after(0, self.cancel)

        self.controller: OrchestratorController
        if sim.trace.enabled or sim.parts.mutant is not None:
            self.controller = sim.parts.orchestrator_controller(self, prompt_ids, token)
        else:  # nothing to watch between its actions: the controller as it is
            self.controller = OrchestratorController(
                sim.plan, prompt_ids, ToStages(sim), sim.edges, self.timers, on_token=token
            )
        self._retry: Handle | None = None
        self.finished_us: int | None = None
        self.ready_us: int | None = None
        self.first_token_us: int | None = None

    @property
    def waiting_for_space(self) -> bool:
        return self.controller.inject_pending

    def start(self) -> None:
        self.controller.start()
        self.wake()

    def deliver(self, sender: str, message: Any) -> None:
        if not self.alive:
            return
        before = self.controller.state
        self.controller.handle(ofsm.Received(sender, message))
        if before is ofsm.State.WAITING_READY and self.controller.state is ofsm.State.RUNNING:
            self.ready_us = self.sim.clock.now_us
        self.after_event()

    def fire(self, timer: Any) -> None:
        if self.alive:
            self.controller.handle(ofsm.TimerFired(timer))
            self.after_event()

    def cancel(self) -> None:
        """The caller tears the run down (Ctrl-C)."""
        if self.alive:
            self.controller.handle(ofsm.Cancel("the caller cancelled"))
            self.after_event()

    def stage_died(self, index: int) -> None:
        if self.alive:
            self.controller.handle(ofsm.StageDied(index, "process gone"))
            self.after_event()

    def after_event(self) -> None:
        if not self._check_finished():
            self.wake()

    def _check_finished(self) -> bool:
        if self.controller.finished is not None and self.alive:
            self.finished_us = self.sim.clock.now_us
            self.alive = False  # the launcher exits once the run is over
            self.sim.orchestrator_exited()
        return not self.alive

    def pump(self) -> None:
        self._pump = None
        if not self.alive:
            return
        c = self.controller
        if c.endpoints_pending and self._retry is None:
            before = c.state
            if not c.try_open_endpoints():
                self._retry = self.sim.clock.after(
                    self.sim.settings.attach_retry_us, self._retry_open
                )
            elif before is ofsm.State.WAITING_READY and c.state is ofsm.State.RUNNING:
                self.ready_us = self.sim.clock.now_us
        if c.inject_pending:
            c.try_inject()
        while c.wants_tokens and c.poll_tokens():
            if self.first_token_us is None:
                self.first_token_us = self.sim.clock.now_us
        self._check_finished()

    def _retry_open(self) -> None:
        self._retry = None
        self.wake()
