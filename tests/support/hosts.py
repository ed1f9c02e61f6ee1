"""Hosts for tests, which inject faults through the host port (nothing of them is in
the production launcher, stage or channel):

- ``FaultyHost``: the local-process host whose stages of given indices run
  ``tests.support.faulty_stage`` (a setup or a step that is slow or fails).
- ``GatedHost``: ``FaultyHost`` whose faults play once, and whose stage starts wait
  while the test holds its gate (``started``: every stage handle it started).
- ``TapHost``: any local host with a ``ControlTap`` on every stage's control channel,
  which records the frames both ways and writes what a test gives it, in between
  whole frames, as a writer on the wire would.
- ``LosingHost``: the local-process host as a cluster that loses nodes: it says which
  of the nodes it knows are live (``KnowsLiveNodes``), starts nothing on a lost one
  (``OSError``, as a departed host), and loses a node when the test says so, or the
  moment a stage starts there (``lose_on_start``: a host gone while its stage comes up
  and binds its slice).
- ``UnjoinableHost``: the local-process host whose stages cannot be handed a new
  chain's secret (``OSError``, as a Ray stage's supervisor that does not answer within
  its bound), and which keeps every stage handle it started and notes which were
  closed.
- ``DetourHost``: the local-process host whose orchestrator, producing to one edge over
  TCP, is told a relay's address (``edge_relay.Relay``, holding no key) instead of its
  consumer's: a man in the middle of that edge.
"""

from __future__ import annotations

import contextlib
import select
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from runplan import NodeSpec
from runplan.messages import ControlMessage
from runtime_cupy.edges.port import EdgeMedium, Rendezvous
from runtime_cupy.edges.tcp import TcpMedium, split_address
from runtime_cupy.hosts.local import FileRendezvous, LocalProcessHost, LocalStageHandle
from runtime_cupy.hosts.port import StageLaunch
from runtime_cupy.process.control_channel import (
    Beat,
    ControlChannel,
    FrameError,
    decode_frame,
    encode_frame,
    encode_payload,
)
from runtime_cupy.process.keys import control_key
from tests.support.edge_relay import Relay
from tests.support.faulty_stage import Fault
from tests.support.tree_host import RepoTreeHost


class FaultyHost(RepoTreeHost):
    """``faults[i]``: the faults stage ``i`` plays (``faulty_stage.Fault``)."""

    def __init__(
        self,
        faults: Mapping[int, Sequence[str]],
        *,
        log_dir: Path | None = None,
        log_level: str | None = None,
    ) -> None:
        super().__init__(log_dir=log_dir, log_level=log_level)
        for texts in faults.values():
            for text in texts:
                Fault.parse(text)  # a bad fault fails here, not in a stage
        self.faults = {i: tuple(f) for i, f in faults.items()}

    def command(self, launch: StageLaunch, arguments: Sequence[str]) -> list[str]:
        faults = self.faults.get(launch.stage_index, ())
        if not faults:
            return super().command(launch, arguments)
        extra = [part for fault in faults for part in ("--fault", fault)]
        return [sys.executable, "-m", "tests.support.faulty_stage", *extra, "--", *arguments]


class GatedHost(FaultyHost):
    """``FaultyHost`` whose faults play in the first process of each stage only, and
    whose ``start`` waits while the test holds its gate (``hold()`` / ``release()``):
    a stage started again stays out until the test lets it in, so that what a server
    says meanwhile can be seen for as long as the test looks."""

    def __init__(
        self,
        faults: Mapping[int, Sequence[str]],
        *,
        log_dir: Path | None = None,
        log_level: str | None = None,
    ) -> None:
        super().__init__(faults, log_dir=log_dir, log_level=log_level)
        self._open = threading.Event()
        self._open.set()
        self.waiting = threading.Event()  # a start is held at the gate now
        self._started: set[int] = set()
        self.started: list[LocalStageHandle] = []  # every stage handle, in start order

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def command(self, launch: StageLaunch, arguments: Sequence[str]) -> list[str]:
        if launch.stage_index in self._started:
            return LocalProcessHost.command(self, launch, arguments)
        self._started.add(launch.stage_index)
        return super().command(launch, arguments)

    def start(self, launch: StageLaunch, secret: bytes) -> LocalStageHandle:
        if not self._open.is_set():
            self.waiting.set()
            self._open.wait(120.0)
            self.waiting.clear()
        handle = super().start(launch, secret)
        self.started.append(handle)
        return handle


class ControlTap:
    """Between the launcher and one stage on their control channel: forwards every frame
    both ways and records it (heartbeats are counted and passed on, not recorded);
    ``to_stage`` / ``to_orchestrator`` write bytes of the
    test's in between frames. ``key``: the stage's control key, with which frames that
    pass are renumbered after the test wrote frames that the receiver accepted
    (``accepted_extra``), so that the real sender's numbers still follow; ``rekey``
    gives it the key of a chain the stage joins (the frames after ``JoinChain`` are
    signed with it, those before with the old one)."""

    def __init__(
        self,
        stage_sock: socket.socket,
        key: bytes,
        stage_id: str,
        orch_id: str,
        eof_delay_s: float = 0.0,
    ) -> None:
        stage_sock.setblocking(True)
        self.eof_delay_s = eof_delay_s  # the stage's end of file passed on this much later
        self.keys, self.stage_id, self.orch_id = [key], stage_id, orch_id
        self._stage = stage_sock
        self.launcher_sock, self._launcher = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sent_to_stage: list[bytes] = []  # frames from the orchestrator, as forwarded
        self.sent_to_orchestrator: list[bytes] = []  # frames from the stage
        self.beats = 0  # heartbeats passed on (not in the lists)
        self._shift = {"stage": 0, "orch": 0}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def key(self) -> bytes:
        """The newest key: what a forged frame is signed with."""
        return self.keys[-1]

    def rekey(self, key: bytes) -> None:
        with self._lock:
            self.keys.append(key)

    # -- what a test writes ----------------------------------------------------------------
    def to_stage(self, data: bytes) -> None:
        with self._lock:
            self._stage.sendall(data)

    def to_orchestrator(self, data: bytes) -> None:
        with self._lock:
            self._launcher.sendall(data)

    def forge_to_stage(self, sender: str, message: ControlMessage | bytes) -> None:
        """A frame signed with the stage's key and numbered as the stage expects next:
        it passes the channel and reaches the stage's state machine (``bytes``: message
        bytes as they are, a malformed message among them)."""
        with self._lock:
            counter = len(self.sent_to_stage) + self._shift["stage"]
            self._shift["stage"] += 1
            self._stage.sendall(_frame(self.key, sender, self.stage_id, counter, message))

    def forge_to_orchestrator(self, sender: str, message: ControlMessage | bytes) -> None:
        """``forge_to_stage``'s frame the other way: numbered as the orchestrator
        expects next from this stage."""
        with self._lock:
            counter = len(self.sent_to_orchestrator) + self._shift["orch"]
            self._shift["orch"] += 1
            self._launcher.sendall(_frame(self.key, sender, self.orch_id, counter, message))

    # -- forwarding ------------------------------------------------------------------------
    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._stage, select.POLLIN)
        poller.register(self._launcher, select.POLLIN)
        pending = {self._stage.fileno(): bytearray(), self._launcher.fileno(): bytearray()}
        open_ends = 2
        while open_ends:
            for fd, _ in poller.poll(1000):
                source = self._stage if fd == self._stage.fileno() else self._launcher
                target = self._launcher if source is self._stage else self._stage
                try:
                    data = source.recv(1 << 16)
                except OSError:
                    data = b""
                if not data:
                    if source is self._stage and self.eof_delay_s:
                        time.sleep(self.eof_delay_s)  # a channel whose close comes late
                    poller.unregister(fd)
                    open_ends -= 1
                    with contextlib.suppress(OSError):
                        target.shutdown(socket.SHUT_WR)
                    continue
                buf = pending[fd]
                buf += data
                while b"\n" in buf:
                    end = buf.index(b"\n") + 1
                    line = bytes(buf[:end])
                    del buf[:end]
                    self._forward(source is self._stage, line, target)
        self._stage.close()
        self._launcher.close()

    def _forward(self, from_stage: bool, line: bytes, target: socket.socket) -> None:
        with self._lock:
            receiver = self.orch_id if from_stage else self.stage_id
            for key in reversed(self.keys):  # the newest first
                try:
                    counter, item = decode_frame(key, receiver, line[:-1])
                    break
                except FrameError:
                    continue
            else:  # signed with no key of ours: passed on as it is, unrecorded
                with contextlib.suppress(OSError):
                    target.sendall(line)
                return
            if isinstance(item, Beat):  # numbered on their own: passed on as they are
                self.beats += 1
            else:
                log = self.sent_to_orchestrator if from_stage else self.sent_to_stage
                log.append(line)
                shift = self._shift["orch" if from_stage else "stage"]
                if shift:
                    line = encode_frame(key, item.sender, receiver, counter + shift, item.message)
            with contextlib.suppress(OSError):
                target.sendall(line)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)


def _frame(
    key: bytes, sender: str, receiver: str, counter: int, message: ControlMessage | bytes
) -> bytes:
    if isinstance(message, bytes):
        return encode_payload(key, sender, receiver, counter, message)
    return encode_frame(key, sender, receiver, counter, message)


class TapHost(LocalProcessHost):
    """The local-process host (or ``FaultyHost``'s faults, with ``faults``) with a
    ``ControlTap`` on each stage's channel (``taps[i]``); ``secret`` is the stages'.
    ``eof_delay_s``: each tap passes its stage's end of file on that much later."""

    def __init__(
        self,
        *,
        log_dir: Path | None = None,
        faults: Mapping[int, Sequence[str]] | None = None,
        eof_delay_s: float = 0.0,
    ) -> None:
        super().__init__(log_dir=log_dir)
        self.eof_delay_s = eof_delay_s
        self.inner = FaultyHost(faults or {}, log_dir=log_dir)
        self.taps: dict[int, ControlTap] = {}
        self.secret = b""

    def start(self, launch: StageLaunch, secret: bytes) -> LocalStageHandle:
        handle = self.inner.start(launch, secret)
        self.secret = secret
        old = handle.channel
        key = control_key(secret, launch.node_id)
        tap = ControlTap(old.sock, key, launch.node_id, launch.orchestrator_id, self.eof_delay_s)
        handle.channel = ControlChannel(tap.launcher_sock, old.key, old.local_id, old.peer_id)
        self.taps[launch.stage_index] = tap
        hand_secret = handle.hand_secret

        def joins(secret: bytes) -> None:  # a new chain's secret: the tap's key follows
            tap.rekey(control_key(secret, launch.node_id))
            self.secret = secret
            hand_secret(secret)

        handle.hand_secret = joins  # type: ignore[method-assign]
        return handle

    def rendezvous(self) -> FileRendezvous:
        return self.inner.rendezvous()


class LosingHost(LocalProcessHost):
    """Nodes in ``lost`` are gone: not live, nothing starts there; a stage started on a
    node of ``lose_on_start`` starts, then its node is lost and its process killed."""

    def __init__(self, *, log_dir: Path | None = None) -> None:
        super().__init__(log_dir=log_dir)
        self.lost: set[str] = set()
        self.lose_on_start: set[str] = set()
        self.started_on: list[str] = []  # the node of every stage started, in order

    def live_nodes(
        self, known: Sequence[tuple[NodeSpec, int | None]], worker: str
    ) -> tuple[tuple[NodeSpec, int | None], ...]:
        return tuple((spec, gpu) for spec, gpu in known if spec.node_id not in self.lost)

    def start(self, launch: StageLaunch, secret: bytes) -> LocalStageHandle:
        if launch.node_id in self.lost:
            raise OSError(f"node {launch.node_id} is gone")
        handle = super().start(launch, secret)
        self.started_on.append(launch.node_id)
        if launch.node_id in self.lose_on_start:
            self.lost.add(launch.node_id)
            handle.kill()
        return handle


class UnjoinableHost(LocalProcessHost):
    """No stage of this host can join a new chain: ``hand_secret`` raises ``OSError``.
    ``started``: every stage handle, in start order; ``closed``: those closed."""

    def __init__(self, *, log_dir: Path | None = None) -> None:
        super().__init__(log_dir=log_dir)
        self.started: list[LocalStageHandle] = []
        self.closed: list[LocalStageHandle] = []

    def start(self, launch: StageLaunch, secret: bytes) -> LocalStageHandle:
        handle = super().start(launch, secret)
        self.started.append(handle)
        close = handle.close

        def closing() -> None:
            self.closed.append(handle)
            close()

        def refused(secret: bytes) -> None:
            raise OSError(f"stage {launch.stage_index}'s host cannot hand it a secret")

        handle.close = closing  # type: ignore[method-assign]
        handle.hand_secret = refused  # type: ignore[method-assign]
        return handle


class _Detour:
    """A rendezvous that tells the producer of ``host.edge_id`` the relay's address,
    the relay started (towards the real consumer) the moment the consumer published."""

    def __init__(self, inner: Rendezvous, host: DetourHost) -> None:
        self.inner, self.host = inner, host

    def publish(self, run_id: str, edge_id: int, address: str) -> None:
        self.inner.publish(run_id, edge_id, address)

    def lookup(self, run_id: str, edge_id: int) -> str | None:
        real = self.inner.lookup(run_id, edge_id)
        if real is None or edge_id != self.host.edge_id:
            return real
        if self.host.relay is None:
            upstream = split_address(real)
            self.host.relay = Relay(lambda: upstream, self.host.attack)
        host, port = self.host.relay.address
        return f"{host}:{port}"

    def withdraw(self, run_id: str, edge_id: int) -> None:
        self.inner.withdraw(run_id, edge_id)


class DetourHost(LocalProcessHost):
    """The local host; the orchestrator's TCP producer end of ``edge_id`` reaches its
    consumer through a relay playing ``attack`` (``edge_relay``: ``change@K``, ...)."""

    def __init__(self, edge_id: int, attack: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.edge_id, self.attack = edge_id, attack
        self.relay: Relay | None = None

    def medium(self, name: str, *more: Any) -> EdgeMedium:
        medium = super().medium(name, *more)
        if isinstance(medium, TcpMedium):
            medium.rendezvous = _Detour(medium.rendezvous, self)
        return medium

    def close(self) -> None:
        if self.relay is not None:
            self.relay.close()
