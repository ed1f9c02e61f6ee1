"""The orchestrator's slice server: on the orchestrator's host, it sends each stage on
another host the slice of the model that stage holds (``protocol`` has the wire).

``offer(source)`` makes a source servable and returns its content key (hashed once per
file, ``digests``); ``expect(stage_index, node_id, key, encrypt=...)`` admits a stage
(its slice key, ``keys.slice_key``, and whether its launch encrypts: then its slice
travels encrypted, and a stage that asks otherwise is refused, ``protocol``). Each
connection runs on a thread of its own, as many at once as ``door`` keeps (strangers,
copies of a stage's HELLO, and connections of each admitted stage, each bounded, a
stranger turned away only after a last look at what it sent; an ``accept`` that fails
rests the port, as a TCP edge's door does): the handshake, the
slice's header
(``runplan.shard_file.shard_header``, made once per slice), then the tensors the stage
asked for, read through the source's memory map and handed to the kernel in large
pieces (``sendall`` of the mapped pages: no copy loop of ours; sealed chunks of them
when encrypted), so a transfer runs at what the link takes. What moves is counted per
stage (``transfers()``: bytes, rate, time left), for progress bars and logs.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable

from attrs import evolve, frozen

from runplan import GgufSource
from runplan.content import SourceContent
from runplan.gguf_error import GgufError
from runplan.gguf_files import model_id_for
from runplan.gguf_header import GgufHeader
from runplan.shard_file import padded_data_bytes, shard_header
from runplan.shards import SliceParts, slice_tensor_names
from runtime_cupy.edges.strangers import ACCEPT_PAUSE_S, LISTEN_BACKLOG, StrangerLog
from runtime_cupy.edges.tcp_seal import protection_for
from runtime_cupy.slices.digests import DigestStore
from runtime_cupy.slices.door import SliceDoor
from runtime_cupy.slices.protocol import (
    Admission,
    Link,
    ProtectionMismatch,
    Refused,
    TransferError,
    hello_proves,
    open_as_server,
)
from runtime_cupy.slices.stage_frames import SliceRequest, done_bytes, wanted_tensors

log = logging.getLogger("runtime_cupy.slices")

#: Bytes handed to the kernel per send (and per progress update).
CHUNK = 8 << 20
#: How long the server waits for a stage's next control frame.
FRAME_WAIT_S = 600.0


@frozen
class StageTransfer:
    """What one stage's slice did: ``state`` is ``connected`` (its header sent),
    ``sending``, ``done``, ``local`` (its host had the file, or had every tensor),
    ``failed`` (``error``). Bytes count what this server sent; ``received`` what the
    stage said it read (handshake and frames included)."""

    stage_index: int
    node_id: str
    host: str | None
    state: str
    header_bytes: int = 0
    tensor_bytes: int = 0  # of the tensors it asked for
    sent_bytes: int = 0
    received_bytes: int | None = None
    started_s: float | None = None  # monotonic
    ended_s: float | None = None
    error: str | None = None

    @property
    def total_bytes(self) -> int:
        return self.header_bytes + self.tensor_bytes

    @property
    def seconds(self) -> float:
        if self.started_s is None:
            return 0.0
        return (self.ended_s or time.monotonic()) - self.started_s

    @property
    def rate(self) -> float:
        """Bytes per second so far."""
        return self.sent_bytes / self.seconds if self.seconds > 0 else 0.0

    @property
    def time_left_s(self) -> float | None:
        if self.state != "sending" or self.rate <= 0:
            return None
        return (self.total_bytes - self.sent_bytes) / self.rate

    @property
    def moving(self) -> bool:
        return self.state in ("connected", "sending")


class _Served:
    """A source this server sends slices of."""

    def __init__(self, header: GgufHeader, content: SourceContent, model_id: str) -> None:
        self.header = header
        self.content = content
        self.model_id = model_id
        self._headers: dict[SliceParts, tuple[tuple[str, ...], bytes]] = {}
        self._lock = threading.Lock()

    def slice(self, parts: SliceParts) -> tuple[tuple[str, ...], bytes]:
        """The slice's tensor names and its GGUF header (made once)."""
        with self._lock:
            made = self._headers.get(parts)
            if made is None:
                names = slice_tensor_names(self.header.tensors, parts)
                data = shard_header(
                    self.header,
                    names,
                    parts,
                    self.content.key,
                    self.content.tensor_sha256,
                    self.model_id,
                )
                made = self._headers[parts] = (names, data)
            return made


class SliceServer:
    """Listens on ``bind_host`` (the orchestrator's address the stages reach);
    ``digests``: where the content of served sources is remembered."""

    def __init__(self, bind_host: str, digests: DigestStore) -> None:
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.bind((bind_host, 0))
            self._sock.listen(LISTEN_BACKLOG)
        except BaseException:
            self._sock.close()
            raise
        port = self._sock.getsockname()[1]
        self.address = f"[{bind_host}]:{port}" if ":" in bind_host else f"{bind_host}:{port}"
        self._digests = digests
        self._sources: dict[tuple[str, ...], _Served] = {}
        self._admitted: dict[int, Admission] = {}
        self._who: dict[int, tuple[str, str | None]] = {}
        self._parts: dict[int, SliceParts | None] = {}
        self._generations: dict[int, int] = {}  # admissions of each stage so far
        self._transfers: dict[int, StageTransfer] = {}
        # A last look at a stranger reads the admissions without the lock (each
        # admission makes a new dict): it runs on the accept thread, under the door's.
        self._door = SliceDoor(
            StrangerLog(log, "slice server"), lambda conn: hello_proves(conn, self._admitted)
        )
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._links: set[Link] = set()
        self.on_change: Callable[[StageTransfer], None] | None = None
        self._thread = threading.Thread(target=self._accept, name="slice-server", daemon=True)
        self._thread.start()

    # -- what is served, to whom ---------------------------------------------------------
    def offer(self, source: GgufSource) -> str:
        """Serve ``source``; its content key (``GgufError`` for a file it cannot read)."""
        paths = tuple(source.paths)
        with self._lock:
            served = self._sources.get(paths)
        if served is None:
            header = GgufHeader.read(paths[0])
            began = time.monotonic()
            content = self._digests.content(header)
            log.info(
                "serving slices of %s (%s), keyed in %.2f s",
                paths[0], content.key, time.monotonic() - began,
            )  # fmt: skip
            served = _Served(header, content, header.model_id or model_id_for(paths[0]))
            with self._lock:
                served = self._sources.setdefault(paths, served)
        return served.content.key

    def expect(
        self,
        stage_index: int,
        node_id: str,
        key: bytes,
        host: str | None = None,
        *,
        encrypt: bool = False,
        parts: SliceParts | None = None,
    ) -> None:
        """Admit stage ``stage_index`` (``node_id``, on ``host``) with its slice key;
        ``encrypt``: its slice travels encrypted (its launch's ``encrypt_edges``);
        ``parts``: the slice its plan gives it, the only one it is sent (``None``:
        any). A transfer recorded for an earlier admission of the stage (a host a
        recovery replaced) is dropped: the next one names this node and host, and what
        a connection of an earlier admission still does is no longer recorded."""
        with self._lock:
            admission = Admission(key, protection_for(encrypt))
            self._admitted = {**self._admitted, stage_index: admission}
            self._who[stage_index] = (node_id, host)
            self._parts[stage_index] = parts
            self._generations[stage_index] = self._generations.get(stage_index, 0) + 1
            self._transfers.pop(stage_index, None)

    def transfers(self) -> tuple[StageTransfer, ...]:
        with self._lock:
            return tuple(self._transfers[i] for i in sorted(self._transfers))

    def forget_transfers(self) -> None:
        """Start counting afresh (a warm chain's next bind)."""
        with self._lock:
            self._transfers.clear()

    def last_activity(self) -> float | None:
        """When a byte last moved (monotonic), or ``None`` if none moved."""
        with self._lock:
            times = [t.ended_s or time.monotonic() for t in self._transfers.values() if t.started_s]
            moving = any(t.moving for t in self._transfers.values())
        if moving:
            return time.monotonic()
        return max(times, default=None)

    def _update(self, index: int, generation: int, **fields: object) -> StageTransfer | None:
        """Record what stage ``index``'s transfer did, unless its connection came for an
        earlier admission of the stage (``generation``: a host a recovery replaced, whose
        old connection ends late): that one no longer speaks for the stage."""
        with self._lock:
            if self._generations.get(index) != generation:
                return None
            current = self._transfers.get(index)
            if current is None:
                node_id, host = self._who.get(index, (f"stage {index}", None))
                current = StageTransfer(index, node_id, host, "connected")
            record = self._transfers[index] = evolve(current, **fields)  # type: ignore[arg-type]
        if self.on_change is not None:
            with contextlib.suppress(Exception):
                self.on_change(record)
        return record

    # -- connections ---------------------------------------------------------------------
    def _accept(self) -> None:
        """Take each connection to a thread of its own (the handshake, then the slice),
        as many as the door keeps (``door``: past ``MAX_STRANGERS`` connections that
        have not proven a key the oldest is turned away). An ``accept`` that fails
        (``EMFILE``, ...), or a thread that cannot start, turns the oldest stranger away
        too and rests the port ``ACCEPT_PAUSE_S`` (``edges.strangers``)."""
        poller = select.poll()
        poller.register(self._sock.fileno(), select.POLLIN)
        door = self._door
        while not self._closed.is_set():
            try:
                if not poller.poll(200):
                    continue
                conn, peer = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as exc:
                if self._closed.is_set():
                    return
                door.log.accept_failed(exc)
                door.turn_away_oldest(f"turned away to free a descriptor ({exc.strerror})")
                self._closed.wait(ACCEPT_PAUSE_S)
                continue
            door.knocked(conn, peer)
            try:
                threading.Thread(
                    target=self._serve, args=(conn, peer), name="slice-send", daemon=True
                ).start()
            except RuntimeError as exc:  # no thread left in this process
                if door.left(conn):
                    door.log.refused(peer, f"no thread to serve it ({exc})")
                conn.close()
                door.turn_away_oldest(f"turned away to free a thread ({exc})")
                self._closed.wait(ACCEPT_PAUSE_S)
                continue

    def _serve(self, conn: socket.socket, peer: object) -> None:
        with self._lock:
            admitted = dict(self._admitted)
            generations = dict(self._generations)
        door = self._door
        try:
            link, index = open_as_server(conn, admitted, lambda i: door.proved(conn, i))
        except Refused as exc:
            if door.left(conn):  # else turned away (and logged so) already
                door.log.refused(peer, str(exc))
            conn.close()
            if isinstance(exc, ProtectionMismatch):  # the stage proved its key
                now = time.monotonic()
                generation = generations[exc.stage_index]
                self._update(
                    exc.stage_index, generation, state="failed", error=str(exc), ended_s=now
                )
            return
        generation = generations[index]
        try:
            door.let_in(conn, peer, index, generation)
        except Refused as exc:
            with contextlib.suppress(OSError):
                link.send({"error": f"the slice server refused this connection: {exc}"})
            link.close()
            return
        with self._lock:
            self._links.add(link)
        try:
            self._send_slice(link, index, generation)
        except (TransferError, OSError, GgufError, ValueError, KeyError, TypeError) as exc:
            reason = str(exc) or type(exc).__name__
            log.warning("slice of stage %d: %s", index, reason)
            self._update(index, generation, state="failed", error=reason, ended_s=time.monotonic())
            with contextlib.suppress(OSError):
                link.send({"error": reason})
        finally:
            with self._lock:
                self._links.discard(link)
            door.served_ended(conn, index, generation)
            link.close()

    def _send_slice(self, link: Link, index: int, generation: int) -> None:
        link.sock.settimeout(FRAME_WAIT_S)
        request = SliceRequest.read(link.receive())
        paths, parts = request.paths, request.parts
        with self._lock:
            served = self._sources.get(paths)
            planned = self._parts.get(index)
        if served is None:
            raise TransferError(f"this server does not serve {paths[0] if paths else '-'}")
        if planned is not None and parts != planned:
            raise TransferError(
                f"stage {index} asked for {parts.describe()}; its plan gives it "
                f"{planned.describe()}"
            )  # (each host receives only its slice)
        arch = served.header.string("general.architecture")
        blocks = served.header.integer(f"{arch}.block_count")
        if not 0 <= parts.layer_start < parts.layer_end_exclusive <= blocks:
            raise TransferError(
                f"asked for blocks [{parts.layer_start}, {parts.layer_end_exclusive}) of a "
                f"model of {blocks}"
            )  # (the slice's header holds them as uint32: past that its thread died)
        if request.source_key != served.content.key:
            raise TransferError(
                f"the source changed since the stage was started: it is now "
                f"{served.content.key}, the stage asked for {request.source_key}"
            )
        names, header_data = served.slice(parts)
        tensors = served.header.tensors
        began = time.monotonic()
        self._update(
            index,
            generation,
            state="connected",
            header_bytes=len(header_data),
            tensor_bytes=0,
            sent_bytes=0,
            received_bytes=None,
            started_s=began,
            ended_s=None,
            error=None,
        )
        file_bytes = len(header_data) + padded_data_bytes(served.header, names)
        link.send(
            {
                "header_bytes": len(header_data),
                "header_sha256": hashlib.sha256(header_data).hexdigest(),
                "file_bytes": file_bytes,
                "tensor_bytes": sum(tensors[n].n_bytes for n in names),
            }
        )
        link.send_bytes(header_data)
        self._update(index, generation, sent_bytes=len(header_data))
        answer = link.receive()
        wanted = wanted_tensors(answer)
        if wanted is None:  # the stage refused the slice after its header
            raise TransferError(str(answer.get("error", "the stage gave up")))
        if not wanted <= set(names):
            raise TransferError(
                f"asked for tensors not in its slice: {sorted(wanted - set(names))}"
            )
        self._update(
            index,
            generation,
            state="sending" if wanted else "local",
            tensor_bytes=sum(tensors[n].n_bytes for n in wanted),
        )
        sent = len(header_data)
        for name in names:
            if name not in wanted:
                continue
            view = served.header.tensor_bytes(name).data
            for start in range(0, len(view), CHUNK):
                piece = view[start : start + CHUNK]
                link.send_bytes(piece)
                sent += len(piece)
                self._update(index, generation, sent_bytes=sent)
        done = link.receive()
        ended = time.monotonic()
        received = done_bytes(done)
        if received is None:
            raise TransferError(str(done.get("error", "the stage gave up")))
        state = "local" if done.get("local") or not wanted else "done"
        self._update(index, generation, state=state, received_bytes=received, ended_s=ended)
        log.info("slice of stage %d: %d bytes in %.2f s (%s)", index, sent, ended - began, state)

    def close(self) -> None:
        """Stop listening, turn away every connection not served yet (``door``) and
        end those being served."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.close()
        self._door.close()
        with self._lock:
            links = list(self._links)
        for link in links:
            with contextlib.suppress(OSError):
                link.sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(2.0)
