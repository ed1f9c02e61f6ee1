"""What both ends of a TCP edge share: the frames after the handshake (an 8-byte head
``kind:u8 pad:3 value:u32``, a RECORD's body, the seal's tag), the ring counters'
places, and the small pieces both ends use (see ``edges.tcp`` for the protocol)."""

from __future__ import annotations

import mmap
import select
import socket
import struct

from runtime_cupy.edges.port import ProcessRing

FRAME = struct.Struct("<BxxxI")
RECORD, CREDIT, CLOSE, LEAVE = 1, 2, 3, 4
U64 = struct.Struct("<Q")
PUBLISHED, RELEASED, CLOSED = 0, 1, 2  # the ring's counters, as runtime_core.ring orders them
#: How long a process letting go of an end waits for its last frames to leave.
DETACH_DRAIN_S = 0.5
#: How long a frame begun may go without a byte more: its producer writes it whole, so
#: only a length changed on the way (the head is sealed with the body, checked once
#: both are in) or a producer stopped mid-frame leaves one waiting.
FRAME_STALL_S = 10.0


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as ``(host, port)``; ``ValueError`` if not."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"not an address: {address!r} (expected host:port)")
    return host.strip("[]"), int(port)


def unauthentic(sender: str, number: int) -> str:
    """Why an edge closed on a frame whose seal does not open."""
    return (
        f"frame {number} from the {sender} failed authentication: changed, replayed, "
        "reordered or injected on the way"
    )


def peer_of(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return "?"
    return f"{host}:{port}"


class SocketWait:
    """The ring's ``Signal`` for blocking waits outside an event loop (``wait_acquire``,
    ``wait_reserve``): poll what the ring watches, and let it take what came."""

    def __init__(self, ring: ProcessRing) -> None:
        self.ring = ring

    def notify(self) -> None:
        pass

    def wait(self, timeout_s: float) -> None:
        poller = select.poll()
        for fd, events in self.ring.watch(True):
            poller.register(fd, events)
        for fd, events in poller.poll(max(0.0, timeout_s) * 1000.0):
            self.ring.ready(fd, events)


class Quiet:
    """The ring's ``Signal`` where a notification has nothing to wake (the TCP ends send
    their frames themselves)."""

    def notify(self) -> None:
        pass

    def wait(self, timeout_s: float) -> None:
        pass


def anonymous(size: int) -> memoryview:
    """Zeroed memory that takes pages only where written (a slot's worth, mostly)."""
    return memoryview(mmap.mmap(-1, max(size, 1)))
