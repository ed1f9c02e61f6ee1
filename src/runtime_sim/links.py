"""The links between the simulation's nodes: rings whose records take a hop's time to
arrive (``SimRing``, in memory, traced), and the control network (``Network``: per
channel in order, with latency, carrying ``runplan.wire`` bytes and the message faults
of the plan), with each node's end of it (``ToOrchestrator``, ``ToStages``)."""

from __future__ import annotations

import struct
from functools import partial
from typing import TYPE_CHECKING, Any

from runplan import wire
from runplan.plan import OBJECT_HEADER_BYTES, EdgePlan
from runplan.record_header import EXTENT_OFFSET, SEQUENCE_OFFSET
from runtime_core.in_process_edges import LocalEdges
from runtime_core.ring import LocalRing, Ring
from runtime_sim.clock import derive_rng
from runtime_sim.faults import MESSAGE_FAULTS, FaultKind

if TYPE_CHECKING:
    from runtime_sim.driver import Simulation

#: The orchestrator's node id on the simulated network.
ORCHESTRATOR = "orchestrator"
# The sequence and extent of a record, read straight from its header.
_SEQUENCE = struct.Struct("<Q")
_SEQUENCE_EXTENT = struct.Struct("<QQ")
assert SEQUENCE_OFFSET + _SEQUENCE.size == EXTENT_OFFSET


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
        # Rings are made while the simulation runs, once its nodes exist.
        self.producer_id = self.edge_producer
        self.consumer_id = self.edge_consumer
        self.producer_node = sim.node(self.producer_id)
        self.consumer_node = sim.node(self.consumer_id)
        self.clock = sim.clock
        self.log = sim.trace.entries if sim.trace.enabled else None  # Trace.add's list
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
        if index is not None and self.log is not None:
            (sequence,) = _SEQUENCE.unpack_from(self.slot(index), SEQUENCE_OFFSET)
            detail = (self.edge.edge_id, n, index, sequence)
            self.log.append((now, self.consumer_id, "ring", "acquire", detail))
        return index

    def release(self, index: int) -> None:
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
        return self.sim.parts.ring(self.sim, self.edges[edge_id])

    def ring(self, edge_id: int) -> SimRing | None:
        ring = self.rings.get((self.sim.plan.run_id, edge_id))
        return ring if isinstance(ring, SimRing) else None


# -- the control network ----------------------------------------------------------------


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


class ToOrchestrator:
    """A stage's control link to the orchestrator: through the network."""

    def __init__(self, sim: Simulation, node_id: str) -> None:
        self.sim = sim
        self.node_id = node_id

    def send(self, message: Any) -> None:
        self.sim.network.send(self.node_id, ORCHESTRATOR, message)


class ToStages:
    """The orchestrator's control links to the stages: through the network."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    def send(self, node_id: str, message: Any) -> None:
        self.sim.network.send(ORCHESTRATOR, node_id, message)
