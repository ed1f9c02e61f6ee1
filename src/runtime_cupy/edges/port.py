"""How an edge moves bytes: the port between a process's event loop and its edge ends.

A *medium* is one way of moving a ring's records between processes (shared memory on
one host, a TCP stream between hosts). Every medium keeps the ring contract of
EDGES_AND_WORKERS.md §2-§3 behind ``runtime_core``'s ``Ring`` interface, so the edge
ends (``SendEnd``, ``ReceiveEnd``), the controllers and the state machines are the same
whatever the medium: the consumer's end makes the ring (``EdgeMedium.create``), the
producer's end attaches to it once it exists (``EdgeMedium.attach``, ``None`` until
then).

Each ring a medium makes is a ``ProcessRing``: besides the ring's operations it tells
its event loop which descriptors to wait on (``watch``) and takes what poll reported on
them (``ready``): a FIFO to drain, a stream to read, a handshake to finish, bytes to
flush. No loop knows which medium an end uses, and no loop polls an edge on a timer.

``ProcessEdges`` is the controllers' transport
(``runtime_core.stage_controller.Transport`` for a stage,
``runtime_core.orchestrator_controller.OrchestratorTransport`` for the orchestrator): one
medium for the end this process consumes, one for the end it produces to.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import Protocol

from runplan import ProvisionStage, RunPlan
from runplan.plan import RingSpec
from runplan.record_header import HeaderCheck
from runtime_core.edge_ends import ReceiveEnd, SendEnd
from runtime_core.ring import Ring
from runtime_cupy.process.keys import edge_key
from runtime_cupy.process.poller import Entry

#: The media, by the names ``--edges`` takes.
MEDIA = ("shm", "tcp")


class EdgeSetupError(RuntimeError):
    """An end that cannot be set up (a medium this machine cannot run, a peer that
    proves it does not hold the run's secret, ...): a setup fault, named."""


class ProcessRing(Ring, abc.ABC):
    """A ring whose other end is in another process, and what its loop waits on."""

    @abc.abstractmethod
    def watch(self, want: bool) -> tuple[Entry, ...]:
        """The descriptors to wait on now, with their events. ``want``: the owner waits
        for this end to move (a record to load, or a free slot for its output)."""

    @abc.abstractmethod
    def ready(self, fd: int, events: int) -> None:
        """Poll reported ``events`` on ``fd`` (one of ``watch``'s)."""

    @abc.abstractmethod
    def detach(self) -> None:
        """Let go of this process's hold on the ring without closing the edge (the other
        end may still be serving its run); the ring is unusable afterwards."""


class Rendezvous(Protocol):
    """Where the consumer of an edge says how to reach it and its producer looks it
    up, keyed by ``(run_id, edge_id)``: provided by the host port (a file on one host,
    Ray's key-value store across hosts), so that provision messages carry no
    addresses. ``lookup`` never waits: ``None`` until the consumer has published."""

    def publish(self, run_id: str, edge_id: int, address: str) -> None: ...

    def lookup(self, run_id: str, edge_id: int) -> str | None: ...

    def withdraw(self, run_id: str, edge_id: int) -> None: ...


class EdgeMedium(Protocol):
    """One way of moving an edge's bytes."""

    name: str

    def create(self, run_id: str, edge_id: int, spec: RingSpec, key: bytes) -> ProcessRing:
        """The consumer's end: make the ring (``EdgeSetupError`` if it cannot be)."""
        ...

    def attach(self, run_id: str, edge_id: int, spec: RingSpec, key: bytes) -> ProcessRing | None:
        """The producer's end: attach to the consumer's ring, ``None`` until it exists
        (called again until it does, within the run's setup bound)."""
        ...

    def remove(self, run_id: str, edge_id: int) -> None:
        """Free whatever this medium names from ``(run_id, edge_id)`` on this host, whoever
        made it (a killed process's leftovers too); missing ones are fine."""
        ...


class ProcessEdges:
    """The edge ends of one process: its receive end through ``inbound`` (a stage's
    inbound edge, the orchestrator's token-out) and its send end through ``outbound``
    (a stage's outbound edge, the orchestrator's token-in). ``secret`` is the stages'
    secret, from which each edge's key is derived."""

    def __init__(self, inbound: EdgeMedium, outbound: EdgeMedium, secret: bytes) -> None:
        self.inbound_medium = inbound
        self.outbound_medium = outbound
        self._secret = secret
        self._receive: ProcessRing | None = None
        self._send: ProcessRing | None = None
        self._owners: dict[int, ProcessRing] = {}

    def _key(self, run_id: str, edge_id: int) -> bytes:
        return edge_key(self._secret, run_id, edge_id)

    def _receive_end(
        self, run_id: str, edge_id: int, spec: RingSpec, check: HeaderCheck
    ) -> ReceiveEnd:
        ring = self.inbound_medium.create(run_id, edge_id, spec, self._key(run_id, edge_id))
        self._receive = ring
        return ReceiveEnd(ring, check)

    def _send_end(self, run_id: str, edge_id: int, spec: RingSpec) -> ProcessRing | None:
        ring = self.outbound_medium.attach(run_id, edge_id, spec, self._key(run_id, edge_id))
        if ring is not None:
            self._send = ring
        return ring

    # -- a stage (runtime_core.stage_controller.Transport) -------------------------------
    def open_inbound(self, provision: ProvisionStage) -> ReceiveEnd:
        edge = provision.inbound
        check = HeaderCheck.for_edge(
            provision.run_id, edge.edge_id, edge.object_spec, provision.model.hidden_dim
        )
        return self._receive_end(provision.run_id, edge.edge_id, edge.ring_spec, check)

    def open_outbound(self, provision: ProvisionStage) -> SendEnd | None:
        edge = provision.outbound
        ring = self._send_end(provision.run_id, edge.edge_id, edge.ring_spec)
        if ring is None:
            return None
        return SendEnd(ring, provision.run_id, edge.edge_id, edge.object_spec)

    # -- the orchestrator (runtime_core.orchestrator_controller.OrchestratorTransport) -----
    def open_token_out(self, plan: RunPlan) -> ReceiveEnd:
        edge = plan.token_out
        check = HeaderCheck.for_edge(
            plan.run_id, edge.edge_id, edge.object_spec, plan.model.hidden_dim
        )
        return self._receive_end(plan.run_id, edge.edge_id, edge.ring_spec, check)

    def open_token_in(self, plan: RunPlan) -> SendEnd | None:
        edge = plan.token_in
        ring = self._send_end(plan.run_id, edge.edge_id, edge.ring_spec)
        if ring is None:
            return None
        return SendEnd(ring, plan.run_id, edge.edge_id, edge.object_spec)

    # -- the event loop ------------------------------------------------------------------
    def watch(self, *, want_input: bool, want_space: bool) -> tuple[Entry, ...]:
        """What to wait on for both ends: ``want_input`` while the owner waits for a
        record, ``want_space`` while its output waits for a free slot."""
        entries: tuple[Entry, ...] = ()
        owners = self._owners
        owners.clear()
        for ring, want in ((self._receive, want_input), (self._send, want_space)):
            if ring is None:
                continue
            mine = ring.watch(want)
            for fd, _ in mine:
                owners[fd] = ring
            entries += mine
        return entries

    def owns(self, fd: int) -> bool:
        """Whether ``fd`` is one of the descriptors the last ``watch`` returned."""
        return fd in self._owners

    def ready(self, fd: int, events: int) -> None:
        ring = self._owners.get(fd)
        if ring is not None:
            ring.ready(fd, events)

    def detach(self) -> None:
        """Let go of both ends without closing them (a stopping stage closes its inbound
        ring through its receive end first; the outbound ring is the next stage's)."""
        rings, self._receive, self._send = (self._receive, self._send), None, None
        self._owners.clear()
        for ring in rings:
            if ring is not None:
                ring.detach()


def remove_edges(media: Iterable[EdgeMedium], run_id: str, edge_ids: Iterable[int]) -> None:
    """Free what every medium names from the run's edges on this host."""
    ids = tuple(edge_ids)
    for medium in media:
        for edge_id in ids:
            medium.remove(run_id, edge_id)
