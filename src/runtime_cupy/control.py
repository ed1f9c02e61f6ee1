"""The control channel between the orchestrator and one stage process: a Unix stream
socket carrying ``runplan.wire`` messages in authenticated frames.

One frame is one line::

    <hmac hex> SP <sender node id, UTF-8 as hex> SP <runplan.wire bytes> LF

The MAC is HMAC-SHA256 under the run's secret (32 random bytes the launcher hands each
stage on its standard input, never on a command line) over a domain tag, the sender's
and the receiver's node ids and the message bytes. A frame that does not verify was
not written by a holder of this run's secret (another run's orchestrator, a stray
writer): it is refused before it is parsed. A verified frame names its sender, which
the state machines check (a stage accepts provisioning only from its orchestrator).
``runplan.wire`` output is one line of JSON, so a frame never holds a line feed, and a
reader resynchronises on the next line feed after any garbage.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket

from attrs import frozen

from runplan import wire
from runplan.messages import ControlMessage
from runplan.plan import RunPlan

#: Longest frame a reader accepts (a provision is a few KiB).
MAX_FRAME_BYTES = 1 << 20
#: Bound on one send (a peer that stops reading for this long is treated as gone).
SEND_TIMEOUT_S = 5.0
KEY_BYTES = 32
_DOMAIN = b"gguf-pipeline/control/1\x00"


class FrameError(ValueError):
    """Bytes on a control channel that are not an authentic frame of this run."""


@frozen
class Incoming:
    """A verified control message and the node id that signed it."""

    sender: str
    message: ControlMessage


@frozen
class Refused:
    """A frame refused before it reached a state machine, and why."""

    reason: str


def _mac(key: bytes, sender: str, receiver: str, payload: bytes) -> bytes:
    head = _DOMAIN + sender.encode("utf-8") + b"\x00" + receiver.encode("utf-8") + b"\x00"
    return hmac.new(key, head + payload, hashlib.sha256).digest()


def encode_frame(key: bytes, sender: str, receiver: str, message: ControlMessage) -> bytes:
    payload = wire.dumps(message)
    mac = _mac(key, sender, receiver, payload).hex()
    return f"{mac} {sender.encode('utf-8').hex()} ".encode("ascii") + payload + b"\n"


def decode_frame(key: bytes, receiver: str, line: bytes) -> Incoming:
    """The message of one frame (without its line feed); ``FrameError`` if it is not
    an authentic frame for ``receiver`` holding a control message."""
    parts = line.split(b" ", 2)
    if len(parts) != 3:
        raise FrameError("not a frame (expected: mac sender message)")
    mac_hex, sender_hex, payload = parts
    try:
        mac = bytes.fromhex(mac_hex.decode("ascii"))
        sender = bytes.fromhex(sender_hex.decode("ascii")).decode("utf-8")
    except (UnicodeDecodeError, ValueError):
        raise FrameError("not a frame (malformed mac or sender)") from None
    if not hmac.compare_digest(mac, _mac(key, sender, receiver, payload)):
        raise FrameError(f"bad MAC: a frame claiming sender {sender!r} not signed for this run")
    try:
        message = wire.loads(payload)
    except wire.WireError as exc:
        raise FrameError(f"authentic frame, malformed message: {exc}") from None
    if isinstance(message, RunPlan):
        raise FrameError("a RunPlan is not a control message")
    return Incoming(sender, message)


def new_key() -> bytes:
    """A fresh run secret."""
    return secrets.token_bytes(KEY_BYTES)


class ControlChannel:
    """One end of a control channel: ``local_id`` writes, ``peer_id`` is the node at the
    other end. ``receive()`` is for when the socket is readable."""

    def __init__(self, sock: socket.socket, key: bytes, local_id: str, peer_id: str) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a control key has {KEY_BYTES} bytes, not {len(key)}")
        self.sock = sock
        self.key = key
        self.local_id = local_id
        self.peer_id = peer_id
        self.sock.settimeout(SEND_TIMEOUT_S)
        self._buffer = bytearray()
        self._skipping = False  # inside an over-long line, dropping to its end
        self.eof = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: ControlMessage) -> None:
        """Write one frame; ``OSError`` if the peer is gone or stopped reading."""
        self.sock.sendall(encode_frame(self.key, self.local_id, self.peer_id, message))

    def send_raw(self, data: bytes) -> None:
        """Write bytes as they are (tests use it to write what a faulty peer would)."""
        self.sock.sendall(data)

    def receive(self) -> list[Incoming | Refused]:
        """Read what is available (the socket must be readable) and return its frames in
        order. Sets ``eof`` once the peer closed its end."""
        try:
            data = self.sock.recv(1 << 16)
        except (BlockingIOError, TimeoutError):
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
            try:
                out.append(decode_frame(self.key, self.local_id, line))
            except FrameError as exc:
                out.append(Refused(str(exc)))

    def close(self) -> None:
        self.sock.close()
