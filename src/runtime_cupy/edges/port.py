"""How an edge moves bytes: the port between a process's event loop and its edge ends.

A *medium* is one way of moving a ring's records between processes (shared memory on
one host, a TCP stream between hosts). Every medium keeps the ring contract of
EDGES_AND_WORKERS.md §2-§3 behind ``runtime_core``'s ``Ring`` interface, so the link
ends (``LinkSender``, ``LinkReceiver``), the controllers and the state machines are the
same whatever the medium: the consumer's end makes the ring (``EdgeMedium.create``), the
producer's end attaches to it once it exists (``EdgeMedium.attach``, ``None`` until
then).

Each ring a medium makes is a ``ProcessRing``: besides the ring's operations it tells
its event loop which descriptors to wait on (``watch``) and takes what poll reported on
them (``ready``): a FIFO to drain, a stream to read, a handshake to finish, bytes to
flush. No loop knows which medium an end uses, and no loop polls an edge on a timer.

``edges.links.ProcessLinks`` is the chain controllers' transport over the media (a
stage's two links, the orchestrator's token links): one medium for the hop this process
consumes, one for the hop it produces to.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import Protocol

from runplan.plan import RingSpec
from runtime_core.ring import Ring
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


def remove_edges(media: Iterable[EdgeMedium], run_id: str, edge_ids: Iterable[int]) -> None:
    """Free what every medium names from the run's edges on this host."""
    ids = tuple(edge_ids)
    for medium in media:
        for edge_id in ids:
            medium.remove(run_id, edge_id)
