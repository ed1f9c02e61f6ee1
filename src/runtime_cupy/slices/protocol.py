"""The wire of a slice transfer: one TCP connection from a stage's host to the
orchestrator's slice server, its tensor bytes raw (authenticated by their hashes) or,
with ``--encrypt-edges``, in sealed AES-256-GCM chunks.

It opens with the TCP edges' handshake (``edges.handshake``) under the stage's slice
key (``keys.slice_key``), the stage's index as the edge id it claims: the stage speaks
first, as an edge's producer does, and the server answers as a consumer. The
handshake carries the protection (``edges.tcp_seal``: ``AUTHENTICATED``, or
``ENCRYPTED`` for a launch with ``encrypt_edges``) under its MACs, and each end says
its own: a stage that asks for another protection than the server sends its slice
with is refused (``ProtectionMismatch``, naming both), never served otherwise. The
frames after it are sealed as an edge's frames are (keys of this connection and
direction, frames numbered per direction, so a replayed, reordered, dropped or forged
frame is refused: ``BrokenSeal``)::

    frame = head:u32 | body | tag (the seal's)
    head  = length (a control frame: a JSON body) or CHUNK_FLAG | length (a chunk of bytes)

    stage  -> server   REQUEST {source: [paths], source_key, parts}
    server -> stage    HEADER  {header_bytes, header_sha256, tensor_bytes}  then the
                                slice's GGUF header (``runplan.shard_file``) as bytes
    stage  -> server   WANT    {tensors: [names]}   (what it has no copy of on its host)
    server -> stage             each wanted tensor's bytes, in the header's order
    stage  -> server   DONE    {ok, bytes} or {ok: false, error}
    server -> stage    ERROR   {error} instead of any of its messages, when it cannot

The bytes (the header, the tensors: ``Link.send_bytes``) travel as the protection
says:

- authenticated: raw, as they are stored. They need no seal of their own: the
  header's hash is in the sealed HEADER frame, and the header holds each tensor's
  SHA-256 (``gguf_pipeline.shard.tensor_sha256``), which the stage checks before
  anything it received is used. Anyone on the path reads the weights.
- encrypted: in frames of their own, chunks of at most ``SEALED_CHUNK`` bytes (a
  chunk never spans two ``send_bytes``), each encrypted and numbered with the control
  frames, so no byte of a weight crosses the network readable and a chunk changed,
  replayed, reordered, dropped or forged is refused as it arrives (and the stage still
  checks each tensor's SHA-256).
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Callable, Mapping
from typing import Any

from attrs import frozen

from runplan.picklable_error import PicklableError
from runtime_cupy.edges import handshake as hs
from runtime_cupy.edges.handshake_read import (
    HandshakeClosed,
    HandshakeDeadline,
    HandshakeTimeUp,
    await_message,
    peek_waiting,
    read_message,
)
from runtime_cupy.edges.tcp_seal import AUTHENTICATED, FrameSeal, Protection, protection_named
from runtime_cupy.process.streams import keep_alive

#: How long the handshake may take (the whole of it: a peer that trickles its bytes gets
#: no more time than one that sends none), and a control frame.
HANDSHAKE_S = 10.0
#: How long a stage waits for the server's first frame after the handshake (the server
#: may hash a large slice's tensors for its header first).
HEADER_WAIT_S = 600.0
#: How long a stage waits for the next byte once its slice's header came: a server, or
#: a man in the middle, that holds the connection open and sends nothing for longer
#: ends the transfer (``LinkSilent``), rather than leaving the stage waiting for ever.
STALL_S = 60.0
#: A control frame is small; anything longer is not one.
MAX_FRAME = 1 << 20
#: Bytes per sealed chunk sent (``benchmarks/slice_transfer.py --loopback``: chunks of
#: 0.5-4 MiB ran alike, 8 MiB at under half their rate, each chunk's buffers fresh pages;
#: docs/benchmarks.md). Smaller chunks cost more frames, larger ones more memory.
SEALED_CHUNK = 1 << 20
#: The longest chunk a receiver takes (what one chunk it cannot place may hold).
MAX_CHUNK = 16 << 20
#: The head's bit that marks a chunk of bytes (a control frame is under ``MAX_FRAME``).
CHUNK_FLAG = 1 << 31
_LENGTH = struct.Struct("<I")


class TransferError(ConnectionError):
    """The connection broke, a frame was refused, or the peer said it cannot go on."""


class Refused(TransferError):
    """The peer did not prove it holds the key (or sent no handshake at all)."""


class LinkSilent(TransferError):
    """The peer sent nothing (or took nothing) for the link's bound while the
    connection stayed open: it stalled, or something on the path holds the bytes back."""


class ProtectionMismatch(PicklableError, Refused):
    """The two ends protect the connection otherwise (one encrypts, the other does not):
    ``ours`` and ``theirs`` name how (``edges.tcp_seal``); ``stage_index``: the stage."""

    def __init__(self, message: str, stage_index: int, ours: str, theirs: str) -> None:
        super().__init__(message)
        self.stage_index, self.ours, self.theirs = stage_index, ours, theirs


class BrokenSeal(PicklableError, TransferError):
    """A frame from the peer failed its seal: changed, replayed, reordered, dropped or
    forged on the way. ``what``: a control frame, or which chunk of bytes; ``number``:
    its place among the frames of its direction."""

    def __init__(self, what: str, number: int) -> None:
        super().__init__(
            f"{what} (frame {number} from the peer) failed its seal: changed, replayed, "
            f"reordered, dropped or forged on the way"
        )
        self.what, self.number = what, number


@frozen
class Admission:
    """A stage a slice server admits: its slice key (``keys.slice_key``) and how its
    connection is protected (``edges.tcp_seal``; the launch's ``encrypt_edges``)."""

    key: bytes
    protection: Protection = AUTHENTICATED


class Link:
    """One authenticated connection: framed messages both ways and byte streams (raw,
    or sealed chunks when its protection encrypts), with every byte it reads counted
    (``received``)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.protection = AUTHENTICATED
        self._seals: tuple[FrameSeal, FrameSeal] | None = None  # (send, receive)
        self.received = 0  # bytes read from the socket (handshake included)
        self.sent = 0
        self._opened = 0  # frames received (the next one's number)
        self._chunks = 0  # chunks of bytes received
        self._pending = memoryview(b"")  # what a chunk held past what was asked of it

    def start_session(self, protection: Protection, seals: tuple[FrameSeal, FrameSeal]) -> None:
        """The handshake is done: frames are sealed with these ``(send, receive)``."""
        self.protection = protection
        self._seals = seals

    # -- raw -----------------------------------------------------------------------
    def bound_silence(self, seconds: float) -> None:
        """From now on, a read or a write that waits longer than ``seconds`` for the peer
        ends the link (``LinkSilent``)."""
        self.sock.settimeout(seconds)

    def _silent(self, what: str, exc: TimeoutError) -> LinkSilent:
        """The link went silent: the socket's own bound ran out, or (``ETIMEDOUT``,
        which Python raises as ``TimeoutError`` too) the kernel's: the peer acknowledged
        nothing for the connection's user timeout (``keep_alive``), which then names the
        time (the socket's bound, 60 s, was once named for a link cut 6 s before)."""
        if exc.errno is not None:  # the kernel's, not the socket's bound
            return LinkSilent(
                f"the peer {what}: the connection timed out ({exc.strerror}: nothing "
                "acknowledged within its user timeout): the link went silent"
            )
        bound = self.sock.gettimeout()
        return LinkSilent(f"the peer {what} for {bound:g} s: the link went silent")

    def send_raw(self, data: Any) -> None:
        try:
            self.sock.sendall(data)
        except TimeoutError as exc:
            raise self._silent("took nothing of what was sent", exc) from None
        self.sent += len(memoryview(data).cast("B"))

    def recv_some(self, n: int) -> bytes:
        """What one read brings of at most ``n`` bytes (``TransferError`` if the
        connection ends, ``LinkSilent`` if nothing comes within the link's bound)."""
        buf = bytearray(n)
        try:
            got = self.sock.recv_into(buf)
        except TimeoutError as exc:
            raise self._silent(f"sent nothing of {n} bytes", exc) from None
        except OSError as exc:
            raise TransferError(f"the connection broke ({exc})") from exc
        if got == 0:
            raise TransferError(f"the connection closed with {n} bytes due")
        self.received += got
        return bytes(buf[:got])

    def recv_into(self, view: memoryview) -> int:
        """Fill ``view`` (bytes); ``TransferError`` if the connection ends first
        (``LinkSilent`` if nothing comes within the link's bound). The number of bytes
        read."""
        done = 0
        while done < len(view):
            try:
                n = self.sock.recv_into(view[done:])
            except TimeoutError as exc:
                raise self._silent(f"sent nothing after {done} of {len(view)} bytes", exc) from None
            except OSError as exc:
                raise TransferError(
                    f"the connection broke after {done} of {len(view)} bytes ({exc})"
                ) from exc
            if n == 0:
                raise TransferError(f"the connection closed after {done} of {len(view)} bytes")
            done += n
            self.received += n
        return done

    def recv_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        self.recv_into(memoryview(buf))
        return bytes(buf)

    # -- frames --------------------------------------------------------------------
    def _session(self) -> tuple[FrameSeal, FrameSeal]:
        if self._seals is None:
            raise TransferError("no frame before the handshake")
        return self._seals

    def send(self, message: dict[str, Any]) -> None:
        seal = self._session()[0]
        body = json.dumps(message, sort_keys=True).encode("utf-8")
        head = _LENGTH.pack(len(body))
        sealed, tag = seal.seal(head, body)
        self.send_raw(head + bytes(sealed) + tag)

    def _head(self) -> tuple[bytes, bool, int]:
        """The next frame's head: it, whether it is a chunk of bytes, its length."""
        head = self.recv_exact(_LENGTH.size)
        (word,) = _LENGTH.unpack(head)
        chunk, length = bool(word & CHUNK_FLAG), word & ~CHUNK_FLAG
        bound = MAX_CHUNK if chunk else MAX_FRAME
        if length > bound:
            kind = "chunk" if chunk else "frame"
            raise TransferError(f"a {kind} of {length} bytes (at most {bound})")
        return head, chunk, length

    def _open(self, head: bytes, body: memoryview, what: str) -> None:
        """Read the frame's body into ``body`` and its tag, and open it (in place);
        ``BrokenSeal`` naming ``what`` unless it is the next frame, as sealed."""
        opener = self._session()[1]
        self.recv_into(body)
        tag = self.recv_exact(opener.tag_bytes)
        number = self._opened
        if not opener.open(head, body, tag):
            raise BrokenSeal(what, number)
        self._opened += 1

    def _message(self, head: bytes, length: int) -> dict[str, Any]:
        body = bytearray(length)
        self._open(head, memoryview(body), "a control frame")
        try:
            doc = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise TransferError(f"a frame is not JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise TransferError("a frame is not a JSON object")
        if "error" in doc and len(doc) == 1:
            raise TransferError(f"the peer cannot go on: {doc['error']}")
        return doc

    def receive(self) -> dict[str, Any]:
        """The next control frame; ``TransferError`` for a chunk of bytes instead."""
        head, chunk, length = self._head()
        if chunk:
            self._open(head, memoryview(bytearray(length)), f"chunk {self._chunks} of the bytes")
            raise TransferError(f"a chunk of {length} bytes where a control frame was due")
        return self._message(head, length)

    # -- bytes (a slice's header, its tensors) ------------------------------------------
    def send_bytes(self, data: Any) -> None:
        """``data``, raw where the protection only authenticates (the receiver checks
        hashes of it), else in sealed chunks of at most ``SEALED_CHUNK`` bytes."""
        if not self.protection.encrypts:
            self.send_raw(data)
            return
        seal = self._session()[0]
        with memoryview(data) as whole, whole.cast("B") as view:
            for start in range(0, len(view), SEALED_CHUNK):
                piece = view[start : start + SEALED_CHUNK]
                head = _LENGTH.pack(CHUNK_FLAG | len(piece))
                sealed, tag = seal.seal(head, piece)
                self._send_all(head, sealed, tag)

    def _send_all(self, *parts: Any) -> None:
        """``parts`` back to back, in as few system calls as the kernel takes them."""
        views = [memoryview(p).cast("B") for p in parts]
        while views:
            try:
                n = self.sock.sendmsg(views)
            except TimeoutError as exc:
                raise self._silent("took nothing of what was sent", exc) from None
            self.sent += n
            while views and n >= len(views[0]):
                n -= len(views.pop(0))
            if n:
                views[0] = views[0][n:]

    def recv_bytes_into(self, view: memoryview) -> int:
        """Fill ``view`` with what ``send_bytes`` sent: raw, or opened chunk by chunk
        (each decrypted where it lands); ``BrokenSeal`` for a chunk that fails its seal,
        ``TransferError`` if the connection ends or the peer gives up first."""
        if not self.protection.encrypts:
            return self.recv_into(view)
        done = 0
        while done < len(view):
            if not self._pending:
                head, chunk, length = self._head()
                if not chunk:
                    self._message(head, length)  # the peer's ERROR raises
                    raise TransferError(
                        f"a control frame where {len(view) - done} more bytes were due"
                    )
                what = f"chunk {self._chunks} of the bytes"
                if length <= len(view) - done:  # decrypted where it lands
                    with view[done : done + length] as into:  # released, even on a fault
                        self._open(head, into, what)
                    self._chunks += 1
                    done += length
                    continue
                pending = memoryview(bytearray(length))
                self._open(head, pending, what)
                self._chunks += 1
                self._pending = pending
            n = min(len(self._pending), len(view) - done)
            view[done : done + n] = self._pending[:n]
            self._pending = self._pending[n:]
            done += n
        return done

    def recv_bytes(self, n: int) -> bytes:
        buf = bytearray(n)
        self.recv_bytes_into(memoryview(buf))
        return bytes(buf)

    def close(self) -> None:
        self.sock.close()


def _read_message(
    link: Link,
    n: int,
    check: Callable[[bytes], None],
    deadline: HandshakeDeadline,
    read: Callable[..., bytes] = read_message,
) -> bytes:
    """``n`` bytes of the handshake (``edges.handshake_read``), counted as the link's
    (``read``: ``await_message`` leaves them unread, and they count when taken):
    ``LinkSilent`` once ``deadline`` is past or the kernel's bound runs out,
    ``TransferError`` if the connection ends first."""
    try:
        data = read(link.sock, n, check, deadline)
    except HandshakeTimeUp as exc:
        raise LinkSilent(str(exc)) from None
    except TimeoutError as exc:  # the kernel's (the connection's user timeout)
        raise link._silent(f"sent nothing of {n} bytes", exc) from None
    except HandshakeClosed as exc:
        raise TransferError(str(exc)) from None
    except OSError as exc:
        raise TransferError(f"the connection broke ({exc})") from exc
    if read is read_message:
        link.received += len(data)
    return data


def hello_proves(sock: socket.socket, admitted: Mapping[int, Admission]) -> int | None:
    """A last look at a connection whose handshake has not proven a key yet (the slice
    server's door, before it turns the connection away): the index of the stage of
    ``admitted`` whose key the whole HELLO waiting on it proves, else ``None``. It
    reads nothing (``open_as_server`` leaves a HELLO unread until its stage is proven)
    and never waits."""
    data = peek_waiting(sock, hs.HELLO_BYTES)
    if len(data) < hs.HELLO_BYTES:
        return None
    for index, admission in admitted.items():
        try:
            hs.verify_hello(admission.key, index, admission.protection.code, data)
        except hs.HandshakeRefused:
            continue
        return index
    return None


def _mismatch(index: int, stage: str, server: str, address: str = "") -> str:
    """Why a stage asking for protection ``stage`` and a server of ``server`` part."""
    where = f"the slice server at {address}" if address else "this slice server"
    return (
        f"stage {index} asks for its slice {stage}, {where} sends it {server}: both ends "
        f"must be launched alike (--encrypt-edges)"
    )


def open_as_server(
    sock: socket.socket,
    admitted: Mapping[int, Admission],
    on_proven: Callable[[int], None] = lambda index: None,
) -> tuple[Link, int]:
    """The server's end of the handshake with a stage holding one of the ``admitted``
    (stage index -> its key and protection): its link and the stage's index.
    ``ProtectionMismatch`` for one of them that asks for another protection, ``Refused``
    otherwise (the stage told why where the handshake says so). ``on_proven`` is called
    with the stage's index once its HELLO proves its key (which a copy of an earlier
    HELLO does too), before the challenge is sent (it may raise ``Refused`` to end the
    handshake there). The HELLO is left unread on ``sock`` until then, so that a last
    look at the connection (``hello_proves``) sees it while it is a stranger."""
    deadline = HandshakeDeadline(HANDSHAKE_S)
    link = Link(sock)

    def take_hello() -> None:
        _read_message(link, hs.HELLO_BYTES, lambda _data: None, deadline)

    try:
        check = hs.check_hello_prefix
        data = _read_message(link, hs.HELLO_BYTES, check, deadline, await_message)
        refusal = hs.HandshakeRefused("a stage of no slice of this server's", hs.Refusal.OTHER_EDGE)
        for index, admission in admitted.items():
            key, protection = admission.key, admission.protection
            try:
                hello = hs.verify_hello(key, index, protection.code, data)
            except hs.HandshakeRefused as exc:
                if exc.refusal is hs.Refusal.OTHER_PROTECTION:
                    take_hello()
                    link.send_raw(hs.refuse(exc.refusal, protection.code))
                    theirs = protection_named(exc.protection)
                    raise ProtectionMismatch(
                        _mismatch(index, theirs, protection.name),
                        index,
                        protection.name,
                        theirs,
                    ) from exc
                if exc.refusal is not hs.Refusal.OTHER_EDGE:
                    refusal = exc
                continue
            on_proven(index)
            take_hello()
            nonce_c = hs.new_nonce()
            link.send_raw(hs.challenge(key, index, protection.code, hello.nonce_p, nonce_c))
            data = _read_message(link, hs.CONFIRM_BYTES, hs.check_confirm_prefix, deadline)
            hs.verify_confirm(key, index, protection.code, nonce_c, hello.nonce_p, data)
            seals = protection.seals(key, nonce_c, hello.nonce_p, producer=False)
            link.start_session(protection, seals)
            sock.settimeout(None)
            keep_alive(sock)
            return link, index
        take_hello()
        link.send_raw(hs.refuse(refusal.refusal or hs.Refusal.OTHER_EDGE))
        raise refusal
    except Refused:
        raise
    except (OSError, hs.HandshakeRefused, TransferError) as exc:
        raise Refused(str(exc)) from exc


def open_as_stage(
    address: str,
    stage_index: int,
    key: bytes,
    timeout_s: float = HANDSHAKE_S,
    *,
    protection: Protection = AUTHENTICATED,
    header_wait_s: float = HEADER_WAIT_S,
) -> Link:
    """Connect to the slice server at ``address`` (``host:port``) as stage
    ``stage_index``, prove its key and ask for ``protection``; ``ProtectionMismatch``
    if the server sends this stage's slice otherwise, ``Refused`` / ``TransferError``
    otherwise. The link waits ``header_wait_s`` for the peer at most (``LinkSilent``;
    ``bound_silence`` changes it)."""
    host, _, port = address.rpartition(":")
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    except (OSError, ValueError) as exc:
        raise TransferError(f"cannot connect to the slice server at {address}: {exc}") from exc
    deadline = HandshakeDeadline(timeout_s)
    link = Link(sock)
    code = protection.code
    try:
        nonce_p = hs.new_nonce()
        link.send_raw(hs.hello(key, stage_index, code, nonce_p))
        head = _read_message(link, hs.REPLY_HEAD_BYTES, hs.check_reply_prefix, deadline)
        rest = hs.reply_bytes(head) - len(head)
        data = head + _read_message(link, rest, lambda _data: None, deadline)
        nonce_c = hs.read_reply(key, stage_index, code, nonce_p, data)
        link.send_raw(hs.confirm(key, stage_index, code, nonce_c, nonce_p))
    except hs.HandshakeRefused as exc:
        sock.close()
        if exc.refusal is hs.Refusal.OTHER_PROTECTION:
            theirs = protection_named(exc.protection)
            raise ProtectionMismatch(
                _mismatch(stage_index, protection.name, theirs, address),
                stage_index,
                protection.name,
                theirs,
            ) from exc
        raise Refused(
            f"the slice server at {address} refused or failed the handshake: {exc}"
        ) from exc
    except (OSError, TransferError) as exc:
        sock.close()
        raise Refused(
            f"the slice server at {address} refused or failed the handshake: {exc}"
        ) from exc
    link.start_session(protection, protection.seals(key, nonce_c, nonce_p, producer=True))
    link.bound_silence(header_wait_s)
    keep_alive(sock)
    return link
