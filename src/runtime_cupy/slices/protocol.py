"""The wire of a slice transfer: one TCP connection from a stage's host to the
orchestrator's slice server.

It opens with the TCP edges' challenge-response (``edges.handshake``) under the stage's
slice key (``keys.slice_key``), the stage's index as the id it claims: the server
speaks first, as an edge's consumer does. Both ends then hold a session key,
``HMAC(slice key, label | nonce_c | nonce_p)``, good for this connection only.

Then, each control message a frame, numbered per direction and MAC'd with the session
key (a replayed, reordered or forged frame is refused)::

    frame = length:u32 | JSON body | HMAC-SHA256(session, direction | number:u64 | body)

    stage  -> server   REQUEST {source: [paths], source_key, parts}
    server -> stage    HEADER  {header_bytes, header_sha256, tensor_bytes}  then the
                                slice's GGUF header, raw (runplan.shard_file)
    stage  -> server   WANT    {tensors: [names]}   (what it has no copy of on its host)
    server -> stage             each wanted tensor's bytes, raw, in the header's order
    stage  -> server   DONE    {ok, bytes} or {ok: false, error}
    server -> stage    ERROR   {error} instead of any of its messages, when it cannot

The raw bytes need no MAC: the header's hash is in the MAC'd HEADER frame, and the
header holds each tensor's SHA-256 (``gguf_pipeline.shard.tensor_sha256``), which the
stage checks before anything it received is used.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import struct
from typing import Any

from runtime_cupy.edges import handshake as hs
from runtime_cupy.streams import keep_alive

#: How long the handshake and a control frame may take.
HANDSHAKE_S = 10.0
#: A control frame is small; anything longer is not one.
MAX_FRAME = 1 << 20
_SESSION = b"gguf-pipeline/slice-session/1\x00"
_LENGTH = struct.Struct("<I")
_MAC_BYTES = 32
TO_SERVER, TO_STAGE = b"S", b"C"


class TransferError(ConnectionError):
    """The connection broke, a frame was refused, or the peer said it cannot go on."""


class Refused(TransferError):
    """The peer did not prove it holds the key (or sent no handshake at all)."""


def session_key(key: bytes, nonce_c: bytes, nonce_p: bytes) -> bytes:
    return hmac.new(key, _SESSION + nonce_c + nonce_p, hashlib.sha256).digest()


class Link:
    """One authenticated connection: framed messages both ways and raw byte streams,
    with every byte it reads counted (``received``)."""

    def __init__(self, sock: socket.socket, outgoing: bytes) -> None:
        self.sock = sock
        self._key = b""  # the session's, once the handshake is done
        self._out = outgoing
        self._in = TO_STAGE if outgoing == TO_SERVER else TO_SERVER
        self._sent_frames = 0
        self._read_frames = 0
        self.received = 0  # bytes read from the socket (handshake included)
        self.sent = 0

    def start_session(self, key: bytes, nonce_c: bytes, nonce_p: bytes) -> None:
        """The handshake is done: frames are MAC'd under this connection's session key."""
        self._key = session_key(key, nonce_c, nonce_p)

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
    def _mac(self, direction: bytes, number: int, body: bytes) -> bytes:
        return hmac.new(
            self._key, direction + number.to_bytes(8, "little") + body, "sha256"
        ).digest()

    def send(self, message: dict[str, Any]) -> None:
        if not self._key:
            raise TransferError("no frame before the handshake")
        body = json.dumps(message, sort_keys=True).encode("utf-8")
        mac = self._mac(self._out, self._sent_frames, body)
        self._sent_frames += 1
        self.send_raw(_LENGTH.pack(len(body)) + body + mac)

    def receive(self) -> dict[str, Any]:
        (length,) = _LENGTH.unpack(self.recv_exact(_LENGTH.size))
        if length > MAX_FRAME:
            raise TransferError(f"a frame of {length} bytes (at most {MAX_FRAME})")
        body = self.recv_exact(length)
        mac = self.recv_exact(_MAC_BYTES)
        if not hmac.compare_digest(mac, self._mac(self._in, self._read_frames, body)):
            raise TransferError("a frame failed its MAC (forged, replayed or damaged)")
        self._read_frames += 1
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


def _read_message(link: Link, n: int, check: Any) -> bytes:
    data = b""
    while len(data) < n:
        data += link.recv_exact(1) if not data else link.recv_exact(n - len(data))
        check(data)
    return data


def open_as_server(sock: socket.socket, keys: dict[int, bytes]) -> tuple[Link, int]:
    """The server's end of the handshake with a stage holding one of ``keys`` (stage
    index -> slice key): its link and the stage's index. ``Refused`` otherwise."""
    sock.settimeout(HANDSHAKE_S)
    link = Link(sock, TO_STAGE)
    try:
        nonce_c = hs.new_nonce()
        link.send_raw(hs.challenge(nonce_c))
        data = _read_message(link, hs.PROOF_BYTES, hs.check_proof_prefix)
        why = "no stage of this server's"
        for index, key in keys.items():
            try:
                proof = hs.verify_proof(key, index, nonce_c, data)
            except hs.HandshakeRefused as exc:
                why = str(exc) if "wrong key" in str(exc) else why
                continue
            link.send_raw(hs.accept(key, index, nonce_c, proof.nonce_p))
            link.start_session(key, nonce_c, proof.nonce_p)
            sock.settimeout(None)
            keep_alive(sock)
            return link, index
        raise Refused(why)
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
    link = Link(sock, TO_SERVER)
    try:
        data = _read_message(link, hs.CHALLENGE_BYTES, hs.check_challenge_prefix)
        nonce_c = hs.read_challenge(data)
        nonce_p = hs.new_nonce()
        link.send_raw(hs.proof(key, stage_index, nonce_c, nonce_p))
        data = _read_message(link, hs.ACCEPT_BYTES, hs.check_accept_prefix)
        hs.verify_accept(key, stage_index, nonce_c, nonce_p, data)
    except (OSError, hs.HandshakeRefused, TransferError) as exc:
        sock.close()
        raise Refused(
            f"the slice server at {address} refused or failed the handshake: {exc}"
        ) from exc
    link.start_session(key, nonce_c, nonce_p)
    sock.settimeout(None)
    keep_alive(sock)
    return link
