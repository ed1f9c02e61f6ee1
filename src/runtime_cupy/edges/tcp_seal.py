"""How the frames of a TCP edge are protected after its handshake: every frame, both
ways, is sealed with a key of its direction on that one connection
(``keys.record_keys``, from the edge's key and both ends' handshake nonces) and its
number in that direction (0, 1, 2, ... from the handshake on). So a frame changed on
the way, one sent again (replayed), one out of its place (reordered), one of another
connection, edge or run, or one made up by someone without the key (injected) fails to
open, and the edge faults naming itself; nothing of it is used.

``Protection`` is the port: what a frame's seal is. Two are offered:

- ``AUTHENTICATED`` (the default): HMAC-SHA256 of the frame's number, head and body,
  its 32 bytes after the frame. Anyone on the path still reads the records.
- ``ENCRYPTED`` (``--encrypt-edges``, for links that cross networks one does not
  trust): AES-256-GCM from the ``cryptography`` package (OpenSSL's), the body
  encrypted, the head authenticated with it, a 16-byte tag after the frame; its
  96-bit nonce is the direction (4 bytes) and the frame's number (8 bytes), never used
  twice with one key, since every connection has keys of its own.

Both ends of an edge must seal alike: the handshake carries the protection's code
under its MACs, and a consumer refuses a producer that seals otherwise.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable
from typing import Protocol

from attrs import frozen
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from runtime_cupy.process.keys import TO_CONSUMER, TO_PRODUCER, record_keys

_NUMBER = struct.Struct("<Q")
_DIRECTION = struct.Struct("<I")

#: A frame's body as a seal takes and gives it (the bytes it holds).
Body = bytes | bytearray | memoryview


class FrameSeal(Protocol):
    """The seal of one direction of one connection; frames are numbered as they pass."""

    tag_bytes: int

    def seal(self, head: bytes, body: Body) -> tuple[Body, bytes]:
        """The body to send (as it is, or encrypted) and the tag to send after it; an
        encrypted body is a view of the seal's own buffer, valid until its next seal."""
        ...

    def open(self, head: bytes, body: memoryview, tag: bytes) -> bool:
        """Whether the frame is the next one of this direction, as its sender sealed it;
        its body, decrypted in place where it was encrypted."""
        ...


class MacSeal:
    """HMAC-SHA256 over the frame's number, head and body."""

    tag_bytes = 32

    def __init__(self, key: bytes, _direction: int) -> None:
        self._mac = hmac.new(key, digestmod=hashlib.sha256)
        self._number = 0

    def _tag(self, head: bytes, body: Body) -> bytes:
        mac = self._mac.copy()
        mac.update(_NUMBER.pack(self._number))
        mac.update(head)
        mac.update(body)
        self._number += 1
        return mac.digest()

    def seal(self, head: bytes, body: Body) -> tuple[Body, bytes]:
        return body, self._tag(head, body)

    def open(self, head: bytes, body: memoryview, tag: bytes) -> bool:
        return hmac.compare_digest(self._tag(head, body), tag)


#: ``cryptography`` 47 and later encrypt and decrypt into a caller's buffer; before, every
#: frame's result was a new object (for a 1 MiB frame, seal and open together ran at
#: about 500 MB/s against 5,800 into reused buffers, most of it in allocating them).
_INTO = hasattr(AESGCM, "encrypt_into")
_EMPTY = memoryview(bytearray())


class AeadSeal:
    """AES-256-GCM: the body encrypted, the head authenticated with it. One buffer,
    kept from frame to frame (a new one only for a larger frame), holds what was
    sealed, or a received frame's body and tag for opening."""

    tag_bytes = 16

    def __init__(self, key: bytes, direction: int) -> None:
        self._aead = AESGCM(key)
        self._direction = _DIRECTION.pack(direction)
        self._number = 0
        self._buf = bytearray()

    def _nonce(self) -> bytes:
        nonce = self._direction + _NUMBER.pack(self._number)
        self._number += 1
        return nonce

    def _room(self, size: int) -> memoryview:
        """``size`` bytes of the buffer (a new one where it is smaller: views of the old
        one a caller still holds stay valid)."""
        if len(self._buf) < size:
            self._buf = bytearray(size)
        return memoryview(self._buf)[:size]

    def seal(self, head: bytes, body: Body) -> tuple[Body, bytes]:
        nonce = self._nonce()
        if _INTO:
            sealed = self._room(len(body) + self.tag_bytes)
            self._aead.encrypt_into(nonce, body, head, sealed)
        else:
            sealed = memoryview(self._aead.encrypt(nonce, body, head))
        return sealed[: -self.tag_bytes], bytes(sealed[-self.tag_bytes :])

    def open(self, head: bytes, body: memoryview, tag: bytes) -> bool:
        size = len(body)
        sealed = self._room(size + len(tag))
        sealed[:size] = body
        sealed[size:] = tag
        nonce = self._nonce()
        try:
            if _INTO:  # (a frame without a body may come as a read-only empty view)
                self._aead.decrypt_into(nonce, sealed, head, body if size else _EMPTY)
                return True
            plain = self._aead.decrypt(nonce, sealed, head)
        except InvalidTag:
            if _INTO and size:  # what was decrypted before the tag failed: none kept
                body[:] = bytes(size)
            return False
        if plain:
            body[:] = plain
        return True


@frozen
class Protection:
    """How an edge's frames are sealed: the code the handshake carries, a name for
    messages, the seal of one direction from its key, and whether it hides what it seals
    (``encrypts``: a slice transfer then seals its tensor bytes too, ``slices.protocol``)."""

    code: int
    name: str
    make: Callable[[bytes, int], FrameSeal]
    encrypts: bool = False

    def seals(
        self, edge_key: bytes, nonce_c: bytes, nonce_p: bytes, *, producer: bool
    ) -> tuple[FrameSeal, FrameSeal]:
        """The seals of one connection, for the producer's end or the consumer's:
        ``(what it sends, what it receives)``."""
        to_consumer, to_producer = record_keys(edge_key, self.code, nonce_c, nonce_p)
        sent_by_producer = self.make(to_consumer, TO_CONSUMER)
        sent_by_consumer = self.make(to_producer, TO_PRODUCER)
        if producer:
            return sent_by_producer, sent_by_consumer
        return sent_by_consumer, sent_by_producer


AUTHENTICATED = Protection(1, "authenticated (HMAC-SHA256)", MacSeal)
ENCRYPTED = Protection(2, "encrypted (AES-256-GCM)", AeadSeal, encrypts=True)
PROTECTIONS = {p.code: p for p in (AUTHENTICATED, ENCRYPTED)}


def protection_for(encrypt: bool) -> Protection:
    return ENCRYPTED if encrypt else AUTHENTICATED


def protection_named(code: int | None) -> str:
    """The name of the protection a handshake's ``code`` says (for messages)."""
    known = PROTECTIONS.get(code) if code is not None else None
    return known.name if known is not None else f"an unknown protection ({code})"
