"""The control network between the simulation's nodes (``Network``: per channel in
order, with latency, carrying ``runplan.wire`` bytes and the message faults of the
plan), with each node's end of it (``ToOrchestrator``, ``ToStages``). The chain's rings
are ``chain_links``."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from runplan import wire
from runtime_sim.clock import derive_rng
from runtime_sim.faults import MESSAGE_FAULTS, FaultKind

if TYPE_CHECKING:
    from runtime_sim.chain_driver import ChainSimulation

#: The orchestrator's node id on the simulated network.
ORCHESTRATOR = "orchestrator"


# -- the control network ----------------------------------------------------------------


class Network:
    """Control links: per (sender, receiver) channel in order (as a stream socket is),
    with latency, and the message faults of the plan by message number."""

    def __init__(self, sim: ChainSimulation) -> None:
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

    def __init__(self, sim: ChainSimulation, node_id: str) -> None:
        self.sim = sim
        self.node_id = node_id

    def send(self, message: Any) -> None:
        self.sim.network.send(self.node_id, ORCHESTRATOR, message)


class ToStages:
    """The orchestrator's control links to the stages: through the network."""

    def __init__(self, sim: ChainSimulation) -> None:
        self.sim = sim

    def send(self, node_id: str, message: Any) -> None:
        self.sim.network.send(ORCHESTRATOR, node_id, message)
