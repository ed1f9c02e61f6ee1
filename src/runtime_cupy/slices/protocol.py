"""The wire of a slice transfer: one TCP connection from a stage's host to the
orchestrator's slice server.

It opens with the TCP edges' handshake (``edges.handshake``) under the stage's slice
key (``keys.slice_key``), the stage's index as the edge id it claims: the stage speaks
first, as an edge's producer does, and the server answers as a consumer. The control
frames after it are sealed as an edge's frames are (``edges.tcp_seal``: keys of this
connection and direction, frames numbered per direction, so a replayed, reordered or
forged frame is refused)::

    frame = length:u32 | JSON body | tag (the seal's)

    stage  -> server   REQUEST {source: [paths], source_key, parts}
    server -> stage    HEADER  {header_bytes, header_sha256, tensor_bytes}  then the
                                slice's GGUF header, raw (runplan.shard_file)
    stage  -> server   WANT    {tensors: [names]}   (what it has no copy of on its host)
    server -> stage             each wanted tensor's bytes, raw, in the header's order
    stage  -> server   DONE    {ok, bytes} or {ok: false, error}
    server -> stage    ERROR   {error} instead of any of its messages, when it cannot

The raw bytes need no seal: the header's hash is in the sealed HEADER frame, and the
header holds each tensor's SHA-256 (``gguf_pipeline.shard.tensor_sha256``), which the
stage checks before anything it received is used. The frames are authenticated, not
encrypted (the weights travel as they are stored, whatever ``--encrypt-edges`` says).
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Callable
from typing import Any

from runtime_cupy.edges import handshake as hs
from runtime_cupy.edges.tcp_seal import AUTHENTICATED, FrameSeal
from runtime_cupy.process.streams import keep_alive

#: How long the handshake and a control frame may take.
HANDSHAKE_S = 10.0
#: A control frame is small; anything longer is not one.
MAX_FRAME = 1 << 20
#: How the control frames are sealed.
PROTECTION = AUTHENTICATED
_LENGTH = struct.Struct("<I")


class TransferError(ConnectionError):
    """The connection broke, a frame was refused, or the peer said it cannot go on."""


class Refused(TransferError):
    """The peer did not prove it holds the key (or sent no handshake at all)."""


class Link:
    """One authenticated connection: framed messages both ways and raw byte streams,
    with every byte it reads counted (``received``)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._seals: tuple[FrameSeal, FrameSeal] | None = None  # (send, receive)
        self.received = 0  # bytes read from the socket (handshake included)
        self.sent = 0

    def start_session(self, seals: tuple[FrameSeal, FrameSeal]) -> None:
        """The handshake is done: frames are sealed with these ``(send, receive)``."""
        self._seals = seals

    # -- raw -----------------------------------------------------------------------
    def send_raw(self, data: Any) -> None:
        self.sock.sendall(data)
        self.sent += len(memoryview(data).cast("B"))

    def recv_into(self, view: memoryview) -> int:
        """Fill ``view`` (bytes); ``TransferError`` if the connection ends first. The
        number of bytes read."""
        done = 0
        while done < len(view):
            try:
                n = self.sock.recv_into(view[done:])
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

    def receive(self) -> dict[str, Any]:
        opener = self._session()[1]
        head = self.recv_exact(_LENGTH.size)
        (length,) = _LENGTH.unpack(head)
        if length > MAX_FRAME:
            raise TransferError(f"a frame of {length} bytes (at most {MAX_FRAME})")
        body = bytearray(self.recv_exact(length))
        tag = self.recv_exact(opener.tag_bytes)
        if not opener.open(head, memoryview(body), tag):
            raise TransferError("a frame failed its seal (forged, replayed or damaged)")
        try:
            doc = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise TransferError(f"a frame is not JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise TransferError("a frame is not a JSON object")
        if "error" in doc and len(doc) == 1:
            raise TransferError(f"the peer cannot go on: {doc['error']}")
        return doc

    def close(self) -> None:
        self.sock.close()


def _read_message(link: Link, n: int, check: Callable[[bytes], None]) -> bytes:
    """``n`` bytes, refused by ``check`` on the first byte that proves them wrong."""
    data = b""
    while len(data) < n:
        data += link.recv_exact(1) if not data else link.recv_exact(n - len(data))
        check(data)
    return data


def _hello_of(key: bytes, index: int, data: bytes) -> hs.Hello:
    return hs.verify_hello(key, index, PROTECTION.code, data)


def open_as_server(sock: socket.socket, keys: dict[int, bytes]) -> tuple[Link, int]:
    """The server's end of the handshake with a stage holding one of ``keys`` (stage
    index -> slice key): its link and the stage's index. ``Refused`` otherwise (the
    stage told why where the handshake says so)."""
    sock.settimeout(HANDSHAKE_S)
    link = Link(sock)
    try:
        data = _read_message(link, hs.HELLO_BYTES, hs.check_hello_prefix)
        refusal = hs.HandshakeRefused("a stage of no slice of this server's", hs.Refusal.OTHER_EDGE)
        for index, key in keys.items():
            try:
                hello = _hello_of(key, index, data)
            except hs.HandshakeRefused as exc:
                if exc.refusal is not hs.Refusal.OTHER_EDGE:
                    refusal = exc
                continue
            nonce_c = hs.new_nonce()
            link.send_raw(hs.challenge(key, index, PROTECTION.code, hello.nonce_p, nonce_c))
            data = _read_message(link, hs.CONFIRM_BYTES, hs.check_confirm_prefix)
            hs.verify_confirm(key, index, PROTECTION.code, nonce_c, hello.nonce_p, data)
            link.start_session(PROTECTION.seals(key, nonce_c, hello.nonce_p, producer=False))
            sock.settimeout(None)
            keep_alive(sock)
            return link, index
        link.send_raw(hs.refuse(refusal.refusal or hs.Refusal.OTHER_EDGE))
        raise refusal
    except (OSError, hs.HandshakeRefused, TransferError) as exc:
        raise Refused(str(exc)) from exc


def open_as_stage(
    address: str, stage_index: int, key: bytes, timeout_s: float = HANDSHAKE_S
) -> Link:
    """Connect to the slice server at ``address`` (``host:port``) as stage
    ``stage_index`` and prove its key; ``Refused`` / ``TransferError`` otherwise."""
    host, _, port = address.rpartition(":")
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    except (OSError, ValueError) as exc:
        raise TransferError(f"cannot connect to the slice server at {address}: {exc}") from exc
    link = Link(sock)
    code = PROTECTION.code
    try:
        nonce_p = hs.new_nonce()
        link.send_raw(hs.hello(key, stage_index, code, nonce_p))
        head = _read_message(link, hs.REPLY_HEAD_BYTES, hs.check_reply_prefix)
        data = head + link.recv_exact(hs.reply_bytes(head) - len(head))
        nonce_c = hs.read_reply(key, stage_index, code, nonce_p, data)
        link.send_raw(hs.confirm(key, stage_index, code, nonce_c, nonce_p))
    except (OSError, hs.HandshakeRefused, TransferError) as exc:
        sock.close()
        raise Refused(
            f"the slice server at {address} refused or failed the handshake: {exc}"
        ) from exc
    link.start_session(PROTECTION.seals(key, nonce_c, nonce_p, producer=True))
    sock.settimeout(None)
    keep_alive(sock)
    return link
