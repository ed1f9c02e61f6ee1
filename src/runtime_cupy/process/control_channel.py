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
verified frame, the next one, whose message does not parse is another matter: only a
holder of the key (the peer itself) could sign it, so the peer speaks something this
end cannot follow (another version, a defect). It takes its number, so the frames after
it are read, and is handed on as ``Unreadable``; the owner ends the peer (a stage: its
orchestrator is lost; the orchestrator: the stage is gone, naming why) rather than wait
for an answer to a message it never read. A verified frame names its sender, which
the state machines check (a stage accepts provisioning only from its orchestrator).
``runplan.wire`` output is one line of JSON, so a frame never holds a line feed, and a
reader resynchronises on the next line feed after any garbage.

A heartbeat is a frame with no message (``<hmac hex> SP <sender> SP <counter> SP LF``)
under a domain tag of its own and numbered in a sequence of its own: authenticated, and
refused when replayed, like any frame, and the numbers of the messages do not depend on
how many beats went between them. ``Heartbeat`` sends one from a thread of its own
every ``1 / BEATS_PER_BOUND`` of the bound, whatever the owner's loop is doing (a long
step, a slow load): liveness is the channel's concern, not a run's, and a warm stage
beats between runs too. The receiving end notes when it last heard an authentic frame
of either kind (``heard_s``) and never hands a beat to its owner; the owner calls the
peer silent once that is longer ago than the bound (``silent_s``).

A kept stage that joins a new chain (``JoinChain``: its chain was re-placed after a
loss) changes keys with it: the new chain's secret gives a new control key, so that
the old secret, which the lost host's processes also held, signs nothing on the
channel any more. The orchestrator sends ``JoinChain`` under the old key and every frame
after it under the new one (``send_join``); the stage's end, once it has accepted a
``JoinChain``, decodes nothing more until its owner hands it the new key (``rekey``,
from the secret the host hands the stage) or keeps the old one (``keep_key``: the join
failed), then decodes what it holds (``buffered``); it sends under the new key from
then on. The orchestrator's end accepts the old key until the first frame signed with
the new one (what the stage sent before it joined), then only the new. The numbering
goes on across the change.

Sending never blocks the loop: what the socket does not take at once waits in an
``Outbox`` for the loop to see the socket writable (``watch()`` asks for it). A peer
that has stopped reading for good shows as a broken channel, not as a stall.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import socket
import threading
import time

from attrs import frozen

from runplan import wire
from runplan.messages import ControlMessage, JoinChain
from runplan.picklable_error import PicklableError
from runplan.plan import RunPlan
from runtime_core.threads import start_thread
from runtime_cupy.process.keys import KEY_BYTES
from runtime_cupy.process.poller import IN, OUT, Entry
from runtime_cupy.process.streams import Outbox, StreamBroken

#: Longest frame a reader accepts (a provision is a few KiB).
MAX_FRAME_BYTES = 1 << 20
#: Bytes of frames a peer may leave unread before the channel counts as broken.
MAX_BACKLOG_BYTES = 16 << 20
#: How long a closing end waits for its last frames to leave.
CLOSE_DRAIN_S = 1.0
#: Beats per heartbeat bound: a peer is silent after missing this many in a row.
BEATS_PER_BOUND = 4
_DOMAIN = b"gguf-pipeline/control/2\x00"
_BEAT_DOMAIN = b"gguf-pipeline/heartbeat/1\x00"
_MAX_COUNTER = 2**64 - 1

log = logging.getLogger("runtime_cupy.process.control_channel")


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


@frozen
class Unreadable:
    """An authentic frame, the next one, whose message does not parse: the peer speaks
    something this end cannot follow."""

    sender: str
    reason: str


class _UnreadableFrame(PicklableError, FrameError):
    def __init__(self, sender: str, counter: int, reason: str) -> None:
        super().__init__(reason)
        self.sender, self.counter = sender, counter


@frozen
class Beat:
    """A verified heartbeat and the node id that signed it."""

    sender: str


def _mac(
    key: bytes, sender: str, receiver: str, counter: int, payload: bytes, domain: bytes = _DOMAIN
) -> bytes:
    head = (
        domain
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
    return encode_payload(key, sender, receiver, counter, wire.dumps(message))


def encode_payload(key: bytes, sender: str, receiver: str, counter: int, payload: bytes) -> bytes:
    """``encode_frame`` of message bytes as they are (``runplan.wire`` bytes, one line)."""
    mac = _mac(key, sender, receiver, counter, payload).hex()
    return f"{mac} {sender.encode('utf-8').hex()} {counter} ".encode("ascii") + payload + b"\n"


def encode_beat(key: bytes, sender: str, receiver: str, counter: int) -> bytes:
    """Heartbeat number ``counter`` from ``sender`` to ``receiver``, line feed included."""
    mac = _mac(key, sender, receiver, counter, b"", _BEAT_DOMAIN).hex()
    return f"{mac} {sender.encode('utf-8').hex()} {counter} \n".encode("ascii")


def decode_frame(key: bytes, receiver: str, line: bytes) -> tuple[int, Incoming | Beat]:
    """The counter and message (or heartbeat) of one frame (without its line feed);
    ``FrameError`` if it is not an authentic frame for ``receiver``."""
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
    if not payload:
        if counter > _MAX_COUNTER or not hmac.compare_digest(
            mac, _mac(key, sender, receiver, counter, b"", _BEAT_DOMAIN)
        ):
            raise FrameError(
                f"bad MAC: a heartbeat claiming sender {sender!r} not signed for this channel"
            )
        return counter, Beat(sender)
    if counter > _MAX_COUNTER or not hmac.compare_digest(
        mac, _mac(key, sender, receiver, counter, payload)
    ):
        raise FrameError(f"bad MAC: a frame claiming sender {sender!r} not signed for this channel")
    try:
        message = wire.loads(payload)
    except wire.WireError as exc:
        raise _UnreadableFrame(
            sender, counter, f"authentic frame, malformed message: {exc}"
        ) from None
    if isinstance(message, RunPlan):
        raise _UnreadableFrame(sender, counter, "a RunPlan is not a control message")
    return counter, Incoming(sender, message)


def _check_key(key: bytes) -> None:
    if len(key) != KEY_BYTES:
        raise ValueError(f"a control key has {KEY_BYTES} bytes, not {len(key)}")


class ControlChannel:
    """One end of a control channel: ``local_id`` writes, ``peer_id`` is the node at the
    other end, ``key`` the stage's control key. The owner's loop waits on ``watch()``,
    then calls ``receive()`` when the socket is readable and ``flush()`` when it is
    writable. ``beat()`` may come from another thread (``Heartbeat``): sending is
    serialised by a lock; receiving is the owner's alone."""

    def __init__(self, sock: socket.socket, key: bytes, local_id: str, peer_id: str) -> None:
        _check_key(key)
        self.sock = sock
        self.key = key  # what this end signs with and verifies first
        self._old_key: bytes | None = None  # the orchestrator's end after send_join
        self._rekey_due = False  # the stage's end after a JoinChain, until rekey
        self.local_id = local_id
        self.peer_id = peer_id
        self._out = Outbox(sock, MAX_BACKLOG_BYTES)  # makes the socket non-blocking
        self._send_lock = threading.Lock()
        self._sent = 0  # the next frame's number
        self._beats_sent = 0  # the next heartbeat's number
        self._expected = 0  # the number of the next frame to accept
        self._beats_expected = 0  # the number of the next heartbeat to accept
        self._buffer = bytearray()
        self._skipping = False  # inside an over-long line, dropping to its end
        self._closed = False
        self.eof = False
        #: When (monotonic) the last authentic frame or beat came; ``None``: none yet.
        self.heard_s: float | None = None

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
        with self._send_lock:
            frame = encode_frame(self.key, self.local_id, self.peer_id, self._sent, message)
            self._sent += 1
            self._write(frame)

    def send_join(self, message: JoinChain, key: bytes) -> None:
        """The orchestrator's end: queue ``message`` under the current key, then sign
        with ``key`` (the new chain's) from the next frame on, and accept it from the
        stage's first frame under it; ``ChannelBroken`` as for send."""
        _check_key(key)
        with self._send_lock:
            frame = encode_frame(self.key, self.local_id, self.peer_id, self._sent, message)
            self._sent += 1
            self._old_key, self.key = self.key, key
            self._write(frame)

    def rekey(self, key: bytes) -> None:
        """The stage's end, after it accepted a ``JoinChain``: sign and verify with
        ``key`` (the new chain's) from now on; ``buffered()`` then holds what came after
        the ``JoinChain``."""
        _check_key(key)
        with self._send_lock:
            self.key = key
            self._rekey_due = False

    def keep_key(self) -> None:
        """The stage's end, after a ``JoinChain`` it could not follow: go on with the
        key it has."""
        self._rekey_due = False

    @property
    def rekey_due(self) -> bool:
        """A ``JoinChain`` was accepted and the frames after it wait for the key."""
        return self._rekey_due

    def buffered(self) -> list[Incoming | Refused | Unreadable]:
        """The frames already read that can be decoded now (after ``rekey`` or
        ``keep_key``), without reading the socket."""
        return self._frames(b"")

    def beat(self) -> None:
        """Queue one heartbeat (any thread); ``ChannelBroken`` as for send. Nothing
        once the channel is closed."""
        with self._send_lock:
            if self._closed:
                return
            frame = encode_beat(self.key, self.local_id, self.peer_id, self._beats_sent)
            self._beats_sent += 1
            self._write(frame)

    def _write(self, frame: bytes) -> None:
        try:
            self._out.write(frame)
        except StreamBroken as exc:
            raise ChannelBroken(str(exc)) from None

    def flush(self) -> None:
        """Send what waits (the socket is writable); ``ChannelBroken`` as for send."""
        with self._send_lock:
            try:
                self._out.flush()
            except StreamBroken as exc:
                raise ChannelBroken(str(exc)) from None

    @property
    def wants_write(self) -> bool:
        return self._out.wants_write

    def silent_s(self, now: float) -> float | None:
        """How long the peer has said nothing at ``now`` (monotonic), counted from its
        first authentic frame or beat; ``None`` before it said anything."""
        return None if self.heard_s is None else now - self.heard_s

    def receive(self) -> list[Incoming | Refused | Unreadable]:
        """Read what is available (the socket is readable) and return its frames in
        order (heartbeats are noted in ``heard_s``, not returned). Sets ``eof`` once the
        peer closed its end."""
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

    def _frames(self, data: bytes) -> list[Incoming | Refused | Unreadable]:
        out: list[Incoming | Refused | Unreadable] = []
        self._buffer += data
        while not self._rekey_due:  # after a JoinChain: held for the new key
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
            accepted = self._accept(line)
            if accepted is not None:
                out.append(accepted)
                if isinstance(accepted, Incoming) and isinstance(accepted.message, JoinChain):
                    self._rekey_due = True
        if len(self._buffer) > MAX_BACKLOG_BYTES:  # held frames a stage never takes
            self._buffer.clear()
            out.append(Refused(f"over {MAX_BACKLOG_BYTES} bytes of frames held for a new key"))
        return out

    def _accept(self, line: bytes) -> Incoming | Refused | Unreadable | None:
        try:
            counter, item = self._decode(line)
        except _UnreadableFrame as exc:
            if exc.counter != self._expected:
                what = "replayed" if exc.counter < self._expected else "out of order"
                return Refused(f"{what} frame: number {exc.counter}, expected {self._expected}")
            self._expected += 1
            self.heard_s = time.monotonic()
            return Unreadable(exc.sender, str(exc))
        except FrameError as exc:
            return Refused(str(exc))
        beat = isinstance(item, Beat)
        expected = self._beats_expected if beat else self._expected
        if counter != expected:
            what = "replayed" if counter < expected else "out of order"
            kind = "heartbeat" if beat else "frame"
            return Refused(f"{what} {kind}: number {counter}, expected {expected}")
        self.heard_s = time.monotonic()
        if isinstance(item, Beat):
            self._beats_expected = expected + 1
            return None
        self._expected = expected + 1
        return item

    def _decode(self, line: bytes) -> tuple[int, Incoming | Beat]:
        """``decode_frame`` under the key; the stage's frames from before it joined: the
        old key too, until the first frame under the new one."""
        try:
            decoded = decode_frame(self.key, self.local_id, line)
        except _UnreadableFrame:
            self._old_key = None  # signed under the new key
            raise
        except FrameError as exc:
            if self._old_key is None:
                raise
            try:
                return decode_frame(self._old_key, self.local_id, line)
            except _UnreadableFrame:
                raise
            except FrameError:
                raise exc from None
        self._old_key = None  # the first frame under the new key: the old one goes
        return decoded

    def close(self) -> None:
        """Send what still waits (bounded by ``CLOSE_DRAIN_S``), then close."""
        with self._send_lock:
            self._closed = True
            if self.sock.fileno() >= 0 and self._out.wants_write:
                self._out.drain(CLOSE_DRAIN_S)
            self.sock.close()


class Heartbeat:
    """Beats on ``channel`` every ``bound_s / BEATS_PER_BOUND`` from a daemon thread of
    its own, until ``stop()`` or the channel breaks. Only a process that cannot run at
    all (stopped, frozen, starved of every CPU) falls silent; one that computes does
    not: the thread needs the interpreter for microseconds, and the workers' kernels
    let go of it while they run."""

    def __init__(self, channel: ControlChannel, bound_s: float) -> None:
        if not bound_s > 0:
            raise ValueError(f"a heartbeat bound of {bound_s} s is not positive")
        self.channel = channel
        self.interval_s = bound_s / BEATS_PER_BOUND
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        """Beats from now on; ``ThreadUnavailable`` where its thread cannot start."""
        start_thread(self._thread, "the heartbeat thread")
        return self

    def _run(self) -> None:
        while True:
            try:
                self.channel.beat()
            except (ChannelBroken, OSError, ValueError) as exc:  # the owner hears of it too
                log.debug("heartbeats end: %s", exc)
                return
            if self._stop.wait(self.interval_s):
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
