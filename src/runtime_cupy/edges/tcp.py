"""Edges over TCP (EDGES_AND_WORKERS.md §2-§3 between hosts): the ring stays with the
consumer and a stream carries records to it; the producer's credit is the consumer's
free slots, returned one by one as slots are released.

So the ring contract holds unchanged across the network:

- a full ring blocks the producer: it sends a record only with credit (``published -
  released < slot_count``, ``released`` counted from the consumer's credits), and a
  producer that sends beyond its credit breaks the stream; nothing is dropped or
  overwritten;
- records arrive, and leave the ring, in publish order (one stream, slots in turn);
- every wait is bounded by the run's timeouts (the ends never wait on their own: the
  owner's loop does, with its bounds), and a silent peer (no FIN: a cut cable, a host
  gone) breaks the connection within ``streams.SILENT_PEER_S`` (kernel keepalive and
  ``TCP_USER_TIMEOUT``), which poll reports as an error even on an end nobody reads;
- either end may close the edge: a CLOSE frame, or the connection's end, wakes the
  other end's loop and its next operation raises ``EdgeClosed``; a producer that lets
  go without closing (its stage stopped; the consumer may still wait for its own
  StopRun) says so with LEAVE;
- the receiving end (``runtime_core.edge_ends.ReceiveEnd``) validates every header before
  a record counts as loaded; the stream itself is checked as it is read (a record
  larger than a slot, or whose header disagrees with its frame, breaks the stream).

The consumer listens on a port of its own and publishes ``host:port`` at the host
port's rendezvous under ``(run_id, edge_id)``; the producer looks it up and connects.
Before a record flows, both prove they hold the edge's key (``handshake``). A stranger
on the port (garbage, a wrong key, a half-finished handshake, a producer of another
edge, any number of idle connections) is refused, logged, and changes nothing: it never
pushes the producer out (``tcp_door``), and a producer turned away before the
handshake was done connects again. Once its producer is in, the consumer stops
listening and withdraws its address.

Every frame after the handshake is sealed (``tcp_seal``): authenticated with a key of
its direction on that connection and its number, and with ``--encrypt-edges``
encrypted too, so a frame changed, replayed, reordered or injected on the way (by a
relay that forwards the handshake, say) closes the edge, which faults naming itself.
Frames are an 8-byte head ``kind:u8 pad:3 value:u32``, the body, the seal's tag:

    producer -> consumer   RECORD value=length, then the record (header + payload)
                           CLOSE, LEAVE
    consumer -> producer   CREDIT value=slots released, CLOSE
"""

from __future__ import annotations

import contextlib
import logging
import socket

from runplan.plan import RingSpec
from runplan.resource_limits import EXHAUSTED
from runtime_cupy.edges import handshake as hs
from runtime_cupy.edges.port import EdgeSetupError, Rendezvous
from runtime_cupy.edges.strangers import LISTEN_BACKLOG
from runtime_cupy.edges.tcp_consumer import TcpReceiveRing
from runtime_cupy.edges.tcp_frames import FRAME, RECORD, split_address
from runtime_cupy.edges.tcp_producer import Connector, TcpSendRing
from runtime_cupy.edges.tcp_seal import AUTHENTICATED, Protection
from runtime_cupy.process.names import NotPrivate
from runtime_cupy.process.streams import StreamBroken

log = logging.getLogger("runtime_cupy.edges.tcp")

__all__ = ["FRAME", "RECORD", "TcpMedium", "TcpReceiveRing", "TcpSendRing", "split_address"]


class TcpMedium:
    """TCP, for an edge whose ends are on different hosts (or forced, on one host).
    The consumer listens on ``bind_host`` (a free port) and publishes
    ``advertise_host:port`` at ``rendezvous``; ``protection`` seals the frames
    (``tcp_seal``: authenticated, or encrypted too)."""

    name = "tcp"

    def __init__(
        self,
        rendezvous: Rendezvous,
        bind_host: str = "127.0.0.1",
        advertise_host: str | None = None,
        protection: Protection = AUTHENTICATED,
    ) -> None:
        self.rendezvous = rendezvous
        self.bind_host = bind_host
        self.advertise_host = advertise_host or bind_host
        self.protection = protection
        self._connecting: dict[tuple[str, int], Connector] = {}

    def create(self, run_id: str, edge_id: int, spec: RingSpec, key: bytes) -> TcpReceiveRing:
        family = socket.AF_INET6 if ":" in self.bind_host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.bind((self.bind_host, 0))
            listener.listen(LISTEN_BACKLOG)
            listener.setblocking(False)
            port = listener.getsockname()[1]
            ring = TcpReceiveRing(
                spec, run_id, edge_id, key, listener, self.rendezvous, self.protection
            )
            host = f"[{self.advertise_host}]" if ":" in self.advertise_host else self.advertise_host
            self.rendezvous.publish(run_id, edge_id, f"{host}:{port}")
            log.debug("edge %d: published %s:%d", edge_id, host, port)
        except BaseException:
            listener.close()
            raise
        return ring

    def attach(self, run_id: str, edge_id: int, spec: RingSpec, key: bytes) -> TcpSendRing | None:
        name = (run_id, edge_id)
        connector = self._connecting.get(name)
        try:
            if connector is None:
                address = self.rendezvous.lookup(run_id, edge_id)
                if address is None:
                    return None
                connector = Connector(address, edge_id, key, self.protection)
                self._connecting[name] = connector
            seals = connector.progress()
        except hs.HandshakeRefused as exc:
            self._drop(name)
            raise EdgeSetupError(f"edge {edge_id}: {exc}") from None
        except NotPrivate as exc:  # where the address would be is not its consumer's
            self._drop(name)
            raise EdgeSetupError(f"edge {edge_id}: {exc}") from None
        except (ConnectionError, OSError, StreamBroken) as exc:
            self._drop(name)
            if isinstance(exc, OSError) and exc.errno in EXHAUSTED:
                # This process's own want (descriptors, memory), which trying again every
                # few milliseconds until the ready bound would not cure, nor name.
                raise EdgeSetupError(f"edge {edge_id}: {type(exc).__name__}: {exc}") from None
            # Not there (yet, or any more), or turned away with strangers: again later.
            log.info("edge %d: consumer not reachable yet: %s", edge_id, exc)
            return None
        except ValueError as exc:  # what the rendezvous holds is no address
            self._drop(name)
            raise EdgeSetupError(f"edge {edge_id}: {exc}") from None
        if seals is None:
            return None
        del self._connecting[name]
        return TcpSendRing(spec, edge_id, connector.out, *seals)

    def _drop(self, name: tuple[str, int]) -> None:
        connector = self._connecting.pop(name, None)
        if connector is not None:
            connector.close()

    def remove(self, run_id: str, edge_id: int) -> None:
        self._drop((run_id, edge_id))
        with contextlib.suppress(OSError):
            self.rendezvous.withdraw(run_id, edge_id)
