"""The control channel between the orchestrator and one stage: a stream socket (a Unix
socket pair on one host, TCP between hosts) carrying ``runplan.wire`` messages in
authenticated, numbered frames.

One frame is one line::

    <hmac hex> SP <sender node id, UTF-8 as hex> SP <counter, decimal> SP <runplan.wire bytes> LF

The MAC is HMAC-SHA256 under the stage's control key (``keys.control_key``: derived
from the secret the host port handed the stage, never on a command line or the wire)
over a domain tag, the sender's and the receiver's node ids, the counter and the
message bytes. Each direction numbers its frames 0, 1, 2, ...; a receiver accepts
exactly the next number. So a frame that does not verify (another run's or another
stage's, a stray writer's, a forged or altered one) and a verified frame that is not
the next one (replayed, or out of order) are refused before they are parsed, logged by
the owner, and change nothing: the run goes on (PIPELINE_ORCHESTRATION_MVP.md §10). A
verified frame names its sender, which the state machines check (a stage accepts
provisioning only from its orchestrator). ``runplan.wire`` output is one line of JSON,
so a frame never holds a line feed, and a reader resynchronises on the next line feed
after any garbage.

Sending never blocks the loop: what the socket does not take at once waits in an
``Outbox`` for the loop to see the socket writable (``watch()`` asks for it). A peer
that has stopped reading for good shows as a broken channel, not as a stall.
"""

from __future__ import annotations

import hashlib
import hmac
import socket

from attrs import frozen

from runplan import wire
from runplan.messages import ControlMessage
from runplan.plan import RunPlan
from runtime_cupy.process.keys import KEY_BYTES
from runtime_cupy.process.poller import IN, OUT, Entry
from runtime_cupy.process.streams import Outbox, StreamBroken

#: Longest frame a reader accepts (a provision is a few KiB).
MAX_FRAME_BYTES = 1 << 20
#: Bytes of frames a peer may leave unread before the channel counts as broken.
MAX_BACKLOG_BYTES = 16 << 20
#: How long a closing end waits for its last frames to leave.
CLOSE_DRAIN_S = 1.0
_DOMAIN = b"gguf-pipeline/control/2\x00"
_MAX_COUNTER = 2**64 - 1


class FrameError(ValueError):
    """Bytes on a control channel that are not an authentic frame of this channel."""


class ChannelBroken(ConnectionError):
    """The peer is gone or does not read: nothing more can be sent."""


@frozen
class Incoming:
    """A verified control message and the node id that signed it."""

    sender: str
    message: ControlMessage


@frozen
class Refused:
    """A frame refused before it reached a state machine, and why."""

    reason: str


def _mac(key: bytes, sender: str, receiver: str, counter: int, payload: bytes) -> bytes:
    head = (
        _DOMAIN
        + sender.encode("utf-8")
        + b"\x00"
        + receiver.encode("utf-8")
        + b"\x00"
        + counter.to_bytes(8, "big")
    )
    return hmac.new(key, head + payload, hashlib.sha256).digest()


def encode_frame(
    key: bytes, sender: str, receiver: str, counter: int, message: ControlMessage
) -> bytes:
    """Frame number ``counter`` from ``sender`` to ``receiver``, line feed included."""
    payload = wire.dumps(message)
    mac = _mac(key, sender, receiver, counter, payload).hex()
    return f"{mac} {sender.encode('utf-8').hex()} {counter} ".encode("ascii") + payload + b"\n"


def decode_frame(key: bytes, receiver: str, line: bytes) -> tuple[int, Incoming]:
    """The counter and message of one frame (without its line feed); ``FrameError`` if
    it is not an authentic frame for ``receiver`` holding a control message."""
    parts = line.split(b" ", 3)
    if len(parts) != 4:
        raise FrameError("not a frame (expected: mac sender counter message)")
    mac_hex, sender_hex, counter_text, payload = parts
    try:
        mac = bytes.fromhex(mac_hex.decode("ascii"))
        sender = bytes.fromhex(sender_hex.decode("ascii")).decode("utf-8")
        if not counter_text.isdigit():
            raise ValueError(counter_text)
        counter = int(counter_text)
    except (UnicodeDecodeError, ValueError):
        raise FrameError("not a frame (malformed mac, sender or counter)") from None
    if counter > _MAX_COUNTER or not hmac.compare_digest(
        mac, _mac(key, sender, receiver, counter, payload)
    ):
        raise FrameError(f"bad MAC: a frame claiming sender {sender!r} not signed for this channel")
    try:
        message = wire.loads(payload)
    except wire.WireError as exc:
        raise FrameError(f"authentic frame, malformed message: {exc}") from None
    if isinstance(message, RunPlan):
        raise FrameError("a RunPlan is not a control message")
    return counter, Incoming(sender, message)


class ControlChannel:
    """One end of a control channel: ``local_id`` writes, ``peer_id`` is the node at the
    other end, ``key`` the stage's control key. The owner's loop waits on ``watch()``,
    then calls ``receive()`` when the socket is readable and ``flush()`` when it is
    writable."""

    def __init__(self, sock: socket.socket, key: bytes, local_id: str, peer_id: str) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a control key has {KEY_BYTES} bytes, not {len(key)}")
        self.sock = sock
        self.key = key
        self.local_id = local_id
        self.peer_id = peer_id
        self._out = Outbox(sock, MAX_BACKLOG_BYTES)  # makes the socket non-blocking
        self._sent = 0  # the next frame's number
        self._expected = 0  # the number of the next frame to accept
        self._buffer = bytearray()
        self._skipping = False  # inside an over-long line, dropping to its end
        self.eof = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def watch(self) -> tuple[Entry, ...]:
        """What the loop waits on: readable (until end of stream), writable while
        frames wait to leave."""
        fd = self.sock.fileno()
        if fd < 0:
            return ()
        events = (0 if self.eof else IN) | (OUT if self._out.wants_write else 0)
        return ((fd, events),) if events else ()

    def send(self, message: ControlMessage) -> None:
        """Queue one frame; ``ChannelBroken`` if the peer is gone or has stopped
        reading."""
        frame = encode_frame(self.key, self.local_id, self.peer_id, self._sent, message)
        self._sent += 1
        try:
            self._out.write(frame)
        except StreamBroken as exc:
            raise ChannelBroken(str(exc)) from None

    def flush(self) -> None:
        """Send what waits (the socket is writable); ``ChannelBroken`` as for send."""
        try:
            self._out.flush()
        except StreamBroken as exc:
            raise ChannelBroken(str(exc)) from None

    @property
    def wants_write(self) -> bool:
        return self._out.wants_write

    def receive(self) -> list[Incoming | Refused]:
        """Read what is available (the socket is readable) and return its frames in
        order. Sets ``eof`` once the peer closed its end."""
        try:
            data = self.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            data = b""
        if not data:
            self.eof = True
            return [Refused("a partial frame at end of stream")] if self._buffer else []
        return self._frames(data)

    def _frames(self, data: bytes) -> list[Incoming | Refused]:
        out: list[Incoming | Refused] = []
        self._buffer += data
        while True:
            end = self._buffer.find(b"\n")
            if end < 0:
                if len(self._buffer) > MAX_FRAME_BYTES:
                    if not self._skipping:
                        out.append(Refused(f"a frame over {MAX_FRAME_BYTES} bytes"))
                    self._skipping = True
                    self._buffer.clear()
                return out
            line = bytes(self._buffer[:end])
            del self._buffer[: end + 1]
            if self._skipping:
                self._skipping = False
                continue
            if len(line) > MAX_FRAME_BYTES:
                out.append(Refused(f"a frame over {MAX_FRAME_BYTES} bytes"))
                continue
            out.append(self._accept(line))

    def _accept(self, line: bytes) -> Incoming | Refused:
        try:
            counter, incoming = decode_frame(self.key, self.local_id, line)
        except FrameError as exc:
            return Refused(str(exc))
        expected = self._expected
        if counter != expected:
            what = "replayed" if counter < expected else "out of order"
            return Refused(f"{what} frame: number {counter}, expected {expected}")
        self._expected = expected + 1
        return incoming

    def close(self) -> None:
        """Send what still waits (bounded by ``CLOSE_DRAIN_S``), then close."""
        if self.sock.fileno() >= 0 and self._out.wants_write:
            self._out.drain(CLOSE_DRAIN_S)
        self.sock.close()
