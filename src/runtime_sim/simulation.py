"""One run of a plan in one thread on a virtual clock.

Every node runs the real pieces: the orchestrator and stage state machines, their
controllers, the workers and the rings. The simulation supplies the environment:
control links with latency (control messages travel through ``runplan.wire``), ring
records that take a hop's time to arrive, step and load times from the timing model,
timers, process deaths, and the faults of a ``FaultPlan``. Everything is traced.
"""

from __future__ import annotations

import enum
import struct
import time
from collections.abc import Callable
from functools import partial
from operator import attrgetter
from typing import Any

import attrs
from attrs import frozen

from runplan import ProvisionStage, RunPlan, wire
from runplan.fsm import orchestrator as ofsm
from runplan.fsm import stage as sfsm
from runplan.header import EXTENT_OFFSET, SEQUENCE_OFFSET, HeaderDType, ObjectHeader
from runplan.messages import RewireEdge, StopReason, StopRun
from runplan.plan import OBJECT_HEADER_BYTES, EdgePlan, ObjectKind
from runtime_core.controller import StageController
from runtime_core.edges import Record
from runtime_core.local import LocalEdges
from runtime_core.orchestrator import OrchestratorController
from runtime_core.ring import LocalRing, Ring
from runtime_core.worker import Worker, WorkerError
from runtime_sim.clock import Handle, Scheduler, derive_rng
from runtime_sim.faults import FORGERIES, MESSAGE_FAULTS, FaultKind, FaultPlan
from runtime_sim.timing import StageCost, TimingModel
from runtime_sim.trace import Trace

ORCHESTRATOR = "orchestrator"
# The sequence and extent of a record, read straight from its header.
_SEQUENCE = struct.Struct("<Q")
_SEQUENCE_EXTENT = struct.Struct("<QQ")
assert SEQUENCE_OFFSET + _SEQUENCE.size == EXTENT_OFFSET


class Mutation(enum.Enum):
    """Deliberate bugs for ``explore --self-test``: the checker must catch each."""

    INJECT_BEFORE_READY = "INJECT_BEFORE_READY"  # the prompt goes out before the barrier
    SKIP_STOP_RUN = "SKIP_STOP_RUN"  # teardown forgets stage 0
    SEQUENCE_SHIFT = "SEQUENCE_SHIFT"  # stage 0 labels its output with the next sequence
    EARLY_SLOT_REUSE = "EARLY_SLOT_REUSE"  # the last stage frees its slot before the step
    READY_BEFORE_BIND = "READY_BEFORE_BIND"  # stage 0 reports ready before its weights


@frozen
class SimSettings:
    timing: TimingModel = TimingModel()
    control_latency_us: int = 50
    death_notice_us: int = 2_000  # a stage's death reaches the orchestrator
    exit_notice_us: int = 1_000  # the orchestrator's exit reaches a stage
    attach_retry_us: int = 500  # retry attaching to a ring that does not exist yet
    release_us: int = 200  # closing edges, releasing the worker


DEFAULT_SETTINGS = SimSettings()
# Read on every pump: on Python 3.11 ``State.READY`` goes through the slow attribute hook
# of ``EnumType.__getattr__``.
_READY = sfsm.State.READY
NO_FAULTS = FaultPlan()


@frozen
class SimResult:
    finished: ofsm.RunFinished | None
    tokens: tuple[int, ...]
    logits: tuple[Any, ...]
    end_us: int  # when the last simulated event ran
    finished_us: int | None  # when the run reached its terminal outcome
    first_token_us: int | None
    ready_us: int | None
    token_times_us: tuple[int, ...]
    events: int
    trace: Trace
    stage_states: tuple[sfsm.State, ...]
    alive: tuple[bool, ...]


# -- rings that take time --------------------------------------------------------------


class _Quiet:
    """Rings signal through the scheduler here, not through this."""

    def notify(self) -> None:
        pass

    def wait(self, timeout_s: float) -> None:
        pass


class SimRing(LocalRing):
    """A ring whose records reach the consumer a hop after they are published, and
    whose operations are traced."""

    def __init__(self, sim: Simulation, edge: EdgePlan) -> None:
        super().__init__(edge.ring_spec, data=_Quiet(), space=_Quiet())
        self.sim = sim
        self.edge = edge
        self.visible_at: dict[int, int] = {}
        self.released_calls = 0  # releases the consumer asked for
        self.freed_early: set[int] = set()  # EARLY_SLOT_REUSE: records freed on acquire
        # Rings are made while the simulation runs, once its nodes exist.
        self.producer_id = self.edge_producer
        self.consumer_id = self.edge_consumer
        self.producer_node = sim.node(self.producer_id)
        self.consumer_node = sim.node(self.consumer_id)
        self.clock = sim.clock
        self.log = sim.trace.entries if sim.trace.enabled else None  # Trace.add's list
        self.early_reuse = (
            sim.mutation is Mutation.EARLY_SLOT_REUSE
            and edge.edge_id == sim.plan.stages[-1].inbound_edge
        )
        # A record's hop, by payload bytes (the timing model is frozen: a pure function).
        self.hop_us: dict[int, int] = {}

    def publish(self, index: int) -> None:
        n = self._reserved
        super().publish(index)
        assert n is not None
        sequence, extent = _SEQUENCE_EXTENT.unpack_from(self.slot(index), SEQUENCE_OFFSET)
        sim = self.sim
        clock = sim.clock
        delay = self.hop_us.get(extent)
        if delay is None:
            delay = int(sim.settings.timing.hop_us(OBJECT_HEADER_BYTES + extent))
            self.hop_us[extent] = delay
        if sim.stalls:
            delay += sim.stall_for(self.edge, sequence)
        now = clock.now_us
        self.visible_at[n] = now + delay
        if self.log is not None:
            detail = (self.edge.edge_id, n, index, sequence)
            self.log.append((now, self.producer_id, "ring", "publish", detail))
        clock.after(delay, self.consumer_node.wake)

    def try_acquire(self) -> int | None:
        n = self._acquired
        now = self.clock.now_us
        if n < self.published and self.visible_at.get(n, 0) > now:
            return None  # still in flight
        index = super().try_acquire()
        if index is not None:
            if self.log is not None:
                (sequence,) = _SEQUENCE.unpack_from(self.slot(index), SEQUENCE_OFFSET)
                detail = (self.edge.edge_id, n, index, sequence)
                self.log.append((now, self.consumer_id, "ring", "acquire", detail))
            if self.early_reuse:
                # The bug: the last stage's slot is freed before its step reads it.
                self._release(index)
                self.freed_early.add(n)
        return index

    def release(self, index: int) -> None:
        n = self.released_calls
        self.released_calls += 1
        if n in self.freed_early:
            return
        self._release(index)

    def _release(self, index: int) -> None:
        n = self.released
        super().release(index)
        if self.log is not None:
            detail = (self.edge.edge_id, n, index)
            self.log.append((self.clock.now_us, self.consumer_id, "ring", "release", detail))
        producer = self.producer_node
        if producer.waiting_for_space:
            self.clock.after(int(self.sim.settings.timing.link.latency_us), producer.wake)

    def close(self) -> None:
        if not self.closed:
            self.sim.trace.add(self.sim.clock.now_us, "sim", "ring", "close", self.edge.edge_id)
        super().close()
        for node in (self.producer_node, self.consumer_node):
            self.sim.clock.after(0, node.wake)

    @property
    def edge_producer(self) -> str:
        return self.edge.producer.node_id

    @property
    def edge_consumer(self) -> str:
        return self.edge.consumer.node_id


class SimEdges(LocalEdges):
    def __init__(self, sim: Simulation) -> None:
        super().__init__()
        self.sim = sim
        self.edges = {e.edge_id: e for e in sim.plan.edges}

    def new_ring(self, edge_id: int, spec: Any) -> Ring:
        return SimRing(self.sim, self.edges[edge_id])

    def ring(self, edge_id: int) -> SimRing | None:
        ring = self.rings.get((self.sim.plan.run_id, edge_id))
        return ring if isinstance(ring, SimRing) else None


# -- nodes --------------------------------------------------------------------------------


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


def _state_tracer(sim: Simulation, actor: str) -> Callable[[str, dict[str, Any]], None] | None:
    """The controllers' trace callback: a state change is recorded when the machine
    moves, before its actions are carried out. None (no callback) without a trace."""
    if not sim.trace.enabled:
        return None
    log = sim.trace.entries  # Trace.add's list
    clock = sim.clock

    def trace(kind: str, fields: dict[str, Any]) -> None:
        if kind == "state":
            log.append((clock.now_us, actor, "state", fields["to"], ()))

    return trace


class TracedStageController(StageController):
    """A stage's controller whose events and actions are traced, that carries out the
    mutants' bugs, and that tells its node when setup begins (for kills before
    ready). A node without any of these runs a plain ``StageController``."""

    def __init__(self, node: StageNode, worker: Worker, stopped_runs: frozenset[str]) -> None:
        sim = node.sim
        super().__init__(
            node.node_id,
            ORCHESTRATOR,
            worker,
            sim.edges,
            _ToOrchestrator(sim, node.node_id),
            node.timers,
            trace=_state_tracer(sim, node.node_id),
            stopped_runs=stopped_runs,
        )
        self.node = node
        self._clock = sim.clock
        self._log = sim.trace.entries if sim.trace.enabled else None  # Trace.add's list
        self._mutation = sim.mutation

    def handle(self, event: sfsm.Event) -> None:
        log = self._log
        if log is not None:
            cls = type(event)
            detail = (_DESCRIBERS.get(cls) or _learn_describer(cls))(event)
            log.append((self._clock.now_us, self.node.node_id, "ev", cls.__name__, detail))
        super().handle(event)

    def try_publish_output(self) -> bool:
        if (
            self._mutation is not None
            and self._mutation is Mutation.SEQUENCE_SHIFT
            and self.node.index == 0
            and self._output is not None
            and not getattr(self, "_shifted", False)
        ):
            sequence, *rest = self._output
            self._output = (sequence + 1, *rest)  # type: ignore[assignment]
            self._shifted = True  # the bug: the output is labelled with the next sequence
        return super().try_publish_output()

    def _act(self, action: sfsm.Action) -> None:
        node = self.node
        sim = node.sim
        log = self._log
        if log is not None:
            cls = type(action)
            detail = (_DESCRIBERS.get(cls) or _learn_describer(cls))(action)
            log.append((self._clock.now_us, node.node_id, "act", cls.__name__, detail))
        mutation = self._mutation
        if (
            mutation is not None
            and mutation is Mutation.READY_BEFORE_BIND
            and node.index == 0
            and isinstance(action, sfsm.BeginSetup)
        ):
            super()._act(action)
            ready = sfsm.SendToOrchestrator(ofsm_stage_ready(action.provision, node.node_id))
            sim.trace.add(
                sim.clock.now_us, node.node_id, "act", "SendToOrchestrator", *_describe(ready)
            )
            super()._act(ready)
            return
        super()._act(action)
        if isinstance(action, sfsm.BeginSetup):
            node.on_provisioned()


def ofsm_stage_ready(provision: ProvisionStage, node_id: str) -> Any:
    from runplan.messages import StageReady

    return StageReady(provision.run_id, provision.stage_index, node_id)


class TracedOrchestratorController(OrchestratorController):
    """The orchestrator's controller, traced and carrying out the mutants' bugs (a
    plain ``OrchestratorController`` without a trace or a mutant)."""

    def __init__(
        self,
        node: OrchestratorNode,
        prompt_ids: tuple[int, ...],
        on_token: Callable[[int, int], None],
    ) -> None:
        sim = node.sim
        super().__init__(
            sim.plan,
            prompt_ids,
            _ToStages(sim),
            sim.edges,
            node.timers,
            on_token=on_token,
            trace=_state_tracer(sim, ORCHESTRATOR),
        )
        self.node = node
        self._clock = sim.clock
        self._log = sim.trace.entries if sim.trace.enabled else None  # Trace.add's list
        self._mutation = sim.mutation

    def handle(self, event: ofsm.Event) -> None:
        log = self._log
        if log is not None:
            cls = type(event)
            detail = (_DESCRIBERS.get(cls) or _learn_describer(cls))(event)
            log.append((self._clock.now_us, ORCHESTRATOR, "ev", cls.__name__, detail))
        super().handle(event)

    def _act(self, action: ofsm.Action) -> None:
        if (
            self._mutation is not None
            and self._mutation is Mutation.SKIP_STOP_RUN
            and isinstance(action, ofsm.SendStopRun)
            and action.stage_index == 0
        ):
            return  # the bug: stage 0 never hears of the teardown
        log = self._log
        if log is not None:
            cls = type(action)
            detail = (_DESCRIBERS.get(cls) or _learn_describer(cls))(action)
            log.append((self._clock.now_us, ORCHESTRATOR, "act", cls.__name__, detail))
        super()._act(action)


#: The fields ``_describe`` reports of any other event or action, in this order.
_DESCRIBED = ("sequence", "part", "timer", "edge_id", "run_id", "reason", "token_id", "stage_index")
Describer = Callable[[Any], tuple[Any, ...]]
#: How ``_describe`` describes each class it met (made once per class by ``_describer``).
_DESCRIBERS: dict[type, Describer] = {}


def _describe(obj: Any) -> tuple[Any, ...]:
    """The fields of an event or action the checker and the trace need."""
    cls = type(obj)
    return (_DESCRIBERS.get(cls) or _learn_describer(cls))(obj)


def _learn_describer(cls: type) -> Describer:
    describer = _DESCRIBERS[cls] = _describer(cls)
    return describer


def _describe_received(obj: Any) -> tuple[Any, ...]:
    m = obj.message
    return (
        obj.sender,
        type(m).__name__,
        getattr(m, "run_id", None),
        getattr(m, "stage_index", None),
        getattr(m, "node_id", None),
    )


def _describe_to_orchestrator(obj: Any) -> tuple[Any, ...]:
    m = obj.message
    return (type(m).__name__, m.stage_index, str(getattr(m, "reason", "")))


def _describe_to_stage(obj: Any) -> tuple[Any, ...]:
    return (obj.stage_index, obj.node_id)


def _describe_inject(obj: Any) -> tuple[Any, ...]:
    return (obj.sequence, len(obj.token_ids))


def _describe_finished(obj: Any) -> tuple[Any, ...]:
    return (obj.outcome.value, len(obj.tokens), str(obj.fault) if obj.fault else None)


def _describe_fields(obj: Any, names: tuple[str, ...]) -> tuple[Any, ...]:
    fields = []
    for name in names:
        value = getattr(obj, name)
        fields.append(value._name_ if isinstance(value, enum.Enum) else value)
    return tuple(fields)


def _describe_any(obj: Any) -> tuple[Any, ...]:
    return _describe_fields(obj, tuple(name for name in _DESCRIBED if hasattr(obj, name)))


def _describer(cls: type) -> Describer:
    """How to describe the instances of ``cls``: the messages and actions the checker
    reads have their own fields; any other event or action reports those of
    ``_DESCRIBED`` it has, enum members by name."""
    if issubclass(cls, (sfsm.Received, ofsm.Received)):
        return _describe_received
    if issubclass(cls, sfsm.SendToOrchestrator):
        return _describe_to_orchestrator
    if issubclass(cls, (ofsm.SendProvision, ofsm.SendStopRun)):
        return _describe_to_stage
    if issubclass(cls, ofsm.InjectTokens):
        return _describe_inject
    if issubclass(cls, ofsm.RunFinished):
        return _describe_finished
    names = _described_fields(cls)
    if names is None:
        return _describe_any
    return _fields_describer(names)


def _plain(value: Any) -> Any:
    return value._name_ if isinstance(value, enum.Enum) else value


def _fields_describer(names: tuple[str, ...]) -> Describer:
    """``_describe_fields(obj, names)`` for one set of names, unrolled for the few
    fields an event or action has (it runs for every one traced)."""
    if not names:
        return lambda obj: ()
    get = attrgetter(*names)
    Enum = enum.Enum
    if len(names) == 1:

        def describe_one(obj: Any) -> tuple[Any, ...]:
            a = get(obj)
            return (a._name_ if isinstance(a, Enum) else a,)

        return describe_one
    if len(names) == 2:

        def describe_two(obj: Any) -> tuple[Any, ...]:
            a, b = get(obj)
            return (
                a._name_ if isinstance(a, Enum) else a,
                b._name_ if isinstance(b, Enum) else b,
            )

        return describe_two
    if len(names) == 3:

        def describe_three(obj: Any) -> tuple[Any, ...]:
            a, b, c = get(obj)
            return (
                a._name_ if isinstance(a, Enum) else a,
                b._name_ if isinstance(b, Enum) else b,
                c._name_ if isinstance(c, Enum) else c,
            )

        return describe_three
    return lambda obj: tuple(map(_plain, get(obj)))


def _described_fields(cls: type) -> tuple[str, ...] | None:
    """The names of ``_DESCRIBED`` that every instance of ``cls`` has, when the class
    alone decides it: an attrs class whose fields are all set by ``__init__`` and that
    has no other attribute of those names. None otherwise (ask each instance)."""
    getattribute: Any = cls.__getattribute__
    custom_lookup = hasattr(cls, "__getattr__") or getattribute is not object.__getattribute__
    if not attrs.has(cls) or custom_lookup:
        return None
    fields = {a.name: a for a in attrs.fields(cls)}
    names = []
    for name in _DESCRIBED:
        if name in fields:
            if not fields[name].init:
                return None
            names.append(name)
        elif hasattr(cls, name):
            return None
    return tuple(names)


class FaultyWorker:
    """Wraps a worker so that a step fails where the fault plan says."""

    def __init__(self, worker: Worker, fail_at: set[int]) -> None:
        self.inner = worker
        self.fail_at = fail_at
        self.capabilities = worker.capabilities

    def configure(self, provision: Any) -> None:
        self.inner.configure(provision)

    def bind(self, gguf_source: Any, progress: Any = None) -> None:
        self.inner.bind(gguf_source, progress)

    def execute_step(self, sequence: int, data: Any) -> Any:
        if sequence in self.fail_at:
            raise WorkerError(f"injected failure at sequence {sequence}")
        return self.inner.execute_step(sequence, data)

    def release(self) -> None:
        self.inner.release()


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
        if sim.trace.enabled or sim.mutation is not None or kill_before_ready:
            self.controller = TracedStageController(self, worker, stopped_runs)
        else:  # nothing to watch between its actions: the controller as it is
            self.controller = StageController(
                self.node_id,
                ORCHESTRATOR,
                worker,
                sim.edges,
                _ToOrchestrator(sim, self.node_id),
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
                sim.forge(self)

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


class _ToOrchestrator:
    def __init__(self, sim: Simulation, node_id: str) -> None:
        self.sim = sim
        self.node_id = node_id

    def send(self, message: Any) -> None:
        self.sim.network.send(self.node_id, ORCHESTRATOR, message)


class _ToStages:
    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    def send(self, node_id: str, message: Any) -> None:
        self.sim.network.send(ORCHESTRATOR, node_id, message)


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
        if sim.trace.enabled or sim.mutation is not None:
            self.controller = TracedOrchestratorController(self, prompt_ids, token)
        else:  # nothing to watch between its actions: the controller as it is
            self.controller = OrchestratorController(
                sim.plan, prompt_ids, _ToStages(sim), sim.edges, self.timers, on_token=token
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
        if self.sim.mutation is Mutation.INJECT_BEFORE_READY:
            # The bug: the prompt goes out as soon as token-in exists.
            self.controller._inject = (0, self.controller.machine.prompt)
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


# -- the network ----------------------------------------------------------------------------


class Network:
    """Control links: per (sender, receiver) channel in order (as a stream socket is),
    with latency, and the message faults of the plan by message number."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.sent = 0
        self.last_delivery: dict[tuple[str, str], int] = {}
        rng = derive_rng(sim.seed, "network")
        self.reorder_us = {
            f.message: rng.randrange(1, 20) * sim.settings.control_latency_us
            for f in sim.faults.of(FaultKind.REORDER_MESSAGE)
        }
        self.faults = {f.message: f.kind for f in sim.faults.faults if f.kind in MESSAGE_FAULTS}

    def send(self, src: str, dst: str, message: Any) -> None:
        sim = self.sim
        n = self.sent
        self.sent += 1
        data = wire.dumps(message)
        now = sim.clock.now_us
        sim.trace.add(now, src, "net", "send", dst, type(message).__name__, n)
        fault = self.faults.get(n)
        if fault is FaultKind.DROP_MESSAGE:
            sim.trace.add(now, src, "net", "drop", dst, type(message).__name__, n)
            sim.dropped.append((src, dst, type(message).__name__))
            return
        delay = sim.settings.control_latency_us
        if fault is FaultKind.DELAY_MESSAGE:
            delay += 200 * sim.settings.control_latency_us
        if fault is FaultKind.REORDER_MESSAGE:
            delay += self.reorder_us[n]
        copies = 2 if fault is FaultKind.DUPLICATE_MESSAGE else 1
        channel = (src, dst)
        for _ in range(copies):
            at = max(now + delay, self.last_delivery.get(channel, 0) + 1)
            self.last_delivery[channel] = at
            sim.clock.at(at, partial(self._deliver, src, dst, data, n))

    def _deliver(self, src: str, dst: str, data: bytes, n: int) -> None:
        message = wire.loads(data)
        self.sim.trace.add(
            self.sim.clock.now_us, dst, "net", "deliver", src, type(message).__name__, n
        )
        self.sim.node(dst).deliver(src, message)

    def channel_closed_at(self, src: str, dst: str, earliest: int) -> int:
        """When the receiver notices the sender is gone: after all it sent."""
        return max(earliest, self.last_delivery.get((src, dst), 0) + 1)


# -- the simulation -------------------------------------------------------------------------


class Simulation:
    def __init__(
        self,
        plan: RunPlan,
        prompt_ids: tuple[int, ...],
        workers: list[Worker],
        costs: list[StageCost],
        *,
        seed: int = 0,
        faults: FaultPlan = NO_FAULTS,
        settings: SimSettings = DEFAULT_SETTINGS,
        mutation: Mutation | None = None,
        on_token: Callable[[int, int], None] | None = None,
        on_load: Callable[[int, int, int], None] | None = None,
        trace: bool = True,
        wall_clock: bool = False,
    ) -> None:
        self.plan = plan
        self.costs = costs
        self.seed = seed
        self.faults = faults
        self.stalls = bool(faults.of(FaultKind.EDGE_STALL))
        self.settings = settings
        self.mutation = mutation
        self.clock = Scheduler()
        self.trace = Trace(trace)
        self.dropped: list[tuple[str, str, str]] = []
        self.forgeries: list[tuple[str, str, bool, str]] = []
        self.previous_run = f"{plan.run_id}-previous"
        self.on_load = on_load
        # Real seconds the workers spent per sequence, summed over stages (when measured).
        self.wall_clock = wall_clock
        self.step_wall_s: dict[int, float] = {}
        self.edges = SimEdges(self)
        self.network = Network(self)
        stopped = frozenset({self.previous_run})
        self.stages = [
            StageNode(self, i, w, c, stopped)
            for i, (w, c) in enumerate(zip(workers, costs, strict=True))
        ]
        self.orchestrator = OrchestratorNode(self, prompt_ids, on_token)
        self._nodes: dict[str, Node] = {s.node_id: s for s in self.stages}
        self._nodes[ORCHESTRATOR] = self.orchestrator

    def node(self, node_id: str) -> Node:
        return self._nodes[node_id]

    def wall_decode_tokens_per_s(self) -> float | None:
        """Real decode speed of the workers: decode sequences per second of their
        summed step times (what a pipeline with one token in flight would do)."""
        decode = [t for seq, t in self.step_wall_s.items() if seq > 0]
        return len(decode) / sum(decode) if decode and sum(decode) > 0 else None

    def stall_for(self, edge: EdgePlan, sequence: int) -> int:
        """Extra delay of a record: an edge stall far past every timeout."""
        for fault in self.faults.of(FaultKind.EDGE_STALL):
            consumer = edge.consumer
            if getattr(consumer, "stage_index", None) == fault.stage and sequence == fault.sequence:
                t = self.plan.timeouts
                step_ms = t.step_limit_ms(self.plan.model.max_seq_len)
                return 10 * (step_ms * self.plan.stage_count + t.edge_wait_ms) * 1000
        return 0

    def orchestrator_exited(self) -> None:
        now = self.clock.now_us
        self.trace.add(now, ORCHESTRATOR, "sim", "exited")
        for stage in self.stages:
            at = self.network.channel_closed_at(
                ORCHESTRATOR, stage.node_id, now + self.settings.exit_notice_us
            )
            self.clock.at(at, stage.orchestrator_lost)

    def run(self, *, max_events: int = 2_000_000) -> SimResult:
        self.clock.after(0, self.orchestrator.start)
        self.clock.run(max_events=max_events)
        orch = self.orchestrator.controller
        finished = orch.finished
        tokens = finished.tokens if finished is not None else orch.machine.tokens
        logits = tuple(orch.logits[: len(tokens)])
        return SimResult(
            finished=finished,
            tokens=tokens,
            logits=logits,
            end_us=self.clock.now_us,
            finished_us=self.orchestrator.finished_us,
            first_token_us=self.orchestrator.first_token_us,
            ready_us=self.orchestrator.ready_us,
            token_times_us=tuple(self.orchestrator.token_times),
            events=self.clock.events_run,
            trace=self.trace,
            stage_states=tuple(s.controller.state for s in self.stages),
            alive=tuple(s.alive for s in self.stages),
        )

    # -- forged input (§10) ------------------------------------------------------------------
    def forge(self, node: StageNode) -> None:
        """Deliver the plan's forgeries to a stage that just became ready; each must be
        rejected without changing its machine."""
        for fault in self.faults.faults:
            if fault.stage != node.index or fault.kind not in FORGERIES:
                continue
            c = node.controller
            provision = c.provision
            assert provision is not None
            before = c.machine
            kind = fault.kind
            if kind is FaultKind.FORGED_UNKNOWN_EDGE:
                ok, reason = self._forge_record(node, provision)
            else:
                sender, message, expected = self._forged_message(kind, node, provision)
                self.trace.add(self.clock.now_us, node.node_id, "sim", "forged", kind.value)
                rejects_before = len(self.trace.of("act", "Reject", node.node_id))
                c.handle(sfsm.Received(sender, message))
                rejects = self.trace.of("act", "Reject", node.node_id)[rejects_before:]
                reason = rejects[0][4][0] if rejects else "none"
                ok = c.machine == before and reason == expected
            self.forgeries.append((node.node_id, kind.value, ok, str(reason)))

    def _forged_message(
        self, kind: FaultKind, node: StageNode, provision: ProvisionStage
    ) -> tuple[str, Any, str]:
        if kind is FaultKind.FORGED_STALE_RUN:
            return ORCHESTRATOR, StopRun(self.previous_run, StopReason.CANCELLED), "STALE_RUN"
        if kind is FaultKind.FORGED_UNKNOWN_RUN:
            return ORCHESTRATOR, StopRun("never-provisioned", StopReason.CANCELLED), "UNKNOWN_RUN"
        peer = self.stages[node.index - 1].node_id if node.index else "rogue-node"
        if kind is FaultKind.FORGED_WRONG_SENDER:
            return peer, attrs.evolve(provision), "UNAUTHORIZED_SENDER"
        return (
            peer,
            RewireEdge(provision.run_id, provision.outbound.edge_id, peer),
            "REWIRE_FORBIDDEN",
        )

    def _forge_record(self, node: StageNode, provision: ProvisionStage) -> tuple[bool, str]:
        """A record on the stage's inbound ring naming an edge it was not given."""
        ring = self.edges.ring(provision.inbound.edge_id)
        c = node.controller
        if ring is None or ring.closed or ring.published != ring.acquired or ring.holding:
            return True, "ring busy: not forged"
        index = ring.try_reserve()
        if index is None:
            return True, "ring busy: not forged"
        n = ring.published
        spec = provision.inbound.object_spec
        kind = spec.kind
        dtype = HeaderDType.of(spec.dtype_family, spec.dtype_width_bytes)
        rows = 1
        payload = bytes(
            4 if kind is ObjectKind.TOKEN else provision.model.hidden_dim * spec.dtype_width_bytes
        )
        header = ObjectHeader(
            provision.run_id, provision.inbound.edge_id + 1000, 0, kind, dtype, rows, len(payload)
        )
        view = ring.slot(index)
        view[:OBJECT_HEADER_BYTES] = header.pack()
        view[OBJECT_HEADER_BYTES : OBJECT_HEADER_BYTES + len(payload)] = payload
        self.trace.add(self.clock.now_us, node.node_id, "sim", "forged", "FORGED_UNKNOWN_EDGE")
        ring.visible_at[n] = self.clock.now_us
        Ring.publish(ring, index)
        self.trace.add(
            self.clock.now_us, "forger", "ring", "publish", provision.inbound.edge_id, n, index, 0
        )
        before = c.machine
        rejects_before = len(self.trace.of("act", "Reject", node.node_id))
        c.poll_inbound()
        rejects = self.trace.of("act", "Reject", node.node_id)[rejects_before:]
        reason = rejects[0][4][0] if rejects else "none"
        ok = c.machine == before and reason == "UNKNOWN_EDGE" and c.record is None
        return ok, reason
