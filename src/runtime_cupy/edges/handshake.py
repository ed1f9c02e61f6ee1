"""The challenge-response that opens a TCP edge: before any record flows, each end
proves that it holds the edge's key (``keys.edge_key``, derived from the stages' secret
and ``(run_id, edge_id)``); the key itself never crosses the wire.

The producer speaks first, as soon as it is connected, so that a consumer can tell it
from the strangers on its port by its first bytes (``tcp_door``: strangers go
first when the port is crowded)::

    producer -> consumer   HELLO      "GPTH" version:u8 protection:u8 pad:2
                                      edge_id:u64 nonce_p:32 mac_h:32                  80 bytes
    consumer -> producer   CHALLENGE  "GPTC" version:u8 protection:u8 pad:2
                                      nonce_c:32 mac_c:32                              72 bytes
                        or REFUSE     "GPTR" version:u8 refusal:u8 protection:u8 pad:1  8 bytes
    producer -> consumer   CONFIRM    "GPTF" version:u8 pad:3 mac_p:32                 40 bytes

    mac_h = HMAC-SHA256(key, "hello"    | protection | edge_id | nonce_p)
    mac_c = HMAC-SHA256(key, "consumer" | protection | edge_id | nonce_p | nonce_c)
    mac_p = HMAC-SHA256(key, "producer" | protection | edge_id | nonce_c | nonce_p)

A HELLO shows that its sender held the key at some time (it may be a copy of an earlier
one); the CHALLENGE proves the consumer holds it now (over the producer's fresh
nonce), and the CONFIRM that the producer does (over the consumer's). Fresh nonces on
both sides make every proof good for one connection only, and the frames after the
handshake are sealed with keys of that connection (``keys.record_keys``,
``tcp_seal``). ``protection`` says how those frames are sealed (authenticated, or
encrypted too); every MAC covers it, so no one on the path can change it, and a
consumer refuses a producer that seals otherwise than it does.

A HELLO of another edge, with a wrong key or another protection gets a REFUSE that
says which, and may say how the refusing end seals (its protection's code; 0: it does
not say), so that a producer refused for its protection can name both (a producer
that gets one faults its setup, naming the reason; the REFUSE is not authenticated, so
it can only end a connection, never change how one is sealed); anything
else (garbage, a record sent without a handshake, a truncated message) is refused, and
the connection closed, on the first byte that proves it wrong.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
import struct

from attrs import frozen

from runplan.picklable_error import PicklableError
from runtime_cupy.edges.tcp_seal import protection_named

VERSION = 2
NONCE_BYTES = 32
_HELLO = struct.Struct(f"<4sBB2xQ{NONCE_BYTES}s32s")
_CHALLENGE = struct.Struct(f"<4sBB2x{NONCE_BYTES}s32s")
_REFUSE = struct.Struct("<4sBBB1x")
_CONFIRM = struct.Struct("<4sB3x32s")
HELLO_MAGIC, CHALLENGE_MAGIC, REFUSE_MAGIC, CONFIRM_MAGIC = b"GPTH", b"GPTC", b"GPTR", b"GPTF"
HELLO_BYTES = _HELLO.size
CHALLENGE_BYTES = _CHALLENGE.size
REFUSE_BYTES = _REFUSE.size
CONFIRM_BYTES = _CONFIRM.size
#: What a producer reads first: enough to tell a CHALLENGE from a REFUSE.
REPLY_HEAD_BYTES = REFUSE_BYTES


class Refusal(enum.Enum):
    """Why a consumer refused a well-formed HELLO (sent in REFUSE)."""

    OTHER_EDGE = 1
    WRONG_KEY = 2
    OTHER_PROTECTION = 3


class HandshakeRefused(PicklableError, ValueError):
    """What a peer sent does not open this edge; the message says why. ``refusal``:
    what a consumer answers the HELLO with (``None``: nothing, the connection closes);
    ``protection``: for ``OTHER_PROTECTION``, the code of the peer's protection where it
    said it (``None`` otherwise)."""

    def __init__(
        self, message: str, refusal: Refusal | None = None, protection: int | None = None
    ) -> None:
        super().__init__(message)
        self.refusal = refusal
        self.protection = protection


class Dropped(ConnectionError):
    """The consumer closed the connection before the handshake was done without saying
    why (it turned the connection away with the strangers on its port): try again."""


def _mac(key: bytes, role: bytes, protection: int, edge_id: int, *nonces: bytes) -> bytes:
    data = role + bytes([protection]) + struct.pack("<Q", edge_id) + b"".join(nonces)
    return hmac.new(key, data, hashlib.sha256).digest()


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _check_prefix(data: bytes, magic: bytes, what: str) -> None:
    """Refuse as soon as the bytes so far cannot begin ``magic`` and the version."""
    head = data[:5]
    expected = magic + bytes([VERSION])
    if head != expected[: len(head)]:
        raise HandshakeRefused(f"not a {what} of this protocol (first bytes {head!r})")


def check_hello_prefix(data: bytes) -> None:
    _check_prefix(data, HELLO_MAGIC, "producer's handshake")


def check_confirm_prefix(data: bytes) -> None:
    _check_prefix(data, CONFIRM_MAGIC, "producer's confirmation")


def check_reply_prefix(data: bytes) -> None:
    """The first bytes of a consumer's CHALLENGE or REFUSE."""
    head = data[:5]
    for magic in (CHALLENGE_MAGIC, REFUSE_MAGIC):
        if head == (magic + bytes([VERSION]))[: len(head)]:
            return
    raise HandshakeRefused(f"not a consumer's challenge of this protocol (first bytes {head!r})")


def reply_bytes(head: bytes) -> int:
    """How long the consumer's reply that begins with ``head`` (``REPLY_HEAD_BYTES``) is."""
    check_reply_prefix(head)
    return REFUSE_BYTES if head[:4] == REFUSE_MAGIC else CHALLENGE_BYTES


# -- the producer's side ------------------------------------------------------------------


def hello(key: bytes, edge_id: int, protection: int, nonce_p: bytes) -> bytes:
    mac_h = _mac(key, b"hello", protection, edge_id, nonce_p)
    return _HELLO.pack(HELLO_MAGIC, VERSION, protection, edge_id, nonce_p, mac_h)


def read_reply(key: bytes, edge_id: int, protection: int, nonce_p: bytes, data: bytes) -> bytes:
    """The consumer's nonce from a whole CHALLENGE that proves it holds the key;
    ``HandshakeRefused`` for a REFUSE (saying why) or a consumer without the key."""
    check_reply_prefix(data)
    if data[:4] == REFUSE_MAGIC:
        _, _, code, theirs = _REFUSE.unpack(data)
        refusal: Refusal | None
        try:
            refusal = Refusal(code)
            why = {
                Refusal.OTHER_EDGE: "it is not the consumer of this edge",
                Refusal.WRONG_KEY: "this producer does not hold its run's secret",
                Refusal.OTHER_PROTECTION: "it seals its records otherwise",
            }[refusal]
        except ValueError:
            refusal, why = None, f"refusal {code}"
        if refusal is Refusal.OTHER_PROTECTION and theirs:
            why += f" (it: {protection_named(theirs)}; this end: {protection_named(protection)})"
        raise HandshakeRefused(
            f"the consumer of edge {edge_id} refused this producer: {why}",
            refusal,
            theirs if refusal is Refusal.OTHER_PROTECTION and theirs else None,
        )
    _, _, claimed, nonce_c, mac_c = _CHALLENGE.unpack(data)
    expected = _mac(key, b"consumer", protection, edge_id, nonce_p, nonce_c)
    if claimed != protection or not hmac.compare_digest(mac_c, expected):
        raise HandshakeRefused(f"the consumer of edge {edge_id} does not hold this run's secret")
    return bytes(nonce_c)


def confirm(key: bytes, edge_id: int, protection: int, nonce_c: bytes, nonce_p: bytes) -> bytes:
    mac_p = _mac(key, b"producer", protection, edge_id, nonce_c, nonce_p)
    return _CONFIRM.pack(CONFIRM_MAGIC, VERSION, mac_p)


# -- the consumer's side -----------------------------------------------------------------


@frozen
class Hello:
    edge_id: int
    protection: int
    nonce_p: bytes


def verify_hello(key: bytes, edge_id: int, protection: int, data: bytes) -> Hello:
    """The producer's whole HELLO, checked; ``HandshakeRefused`` naming what is wrong
    (with the ``Refusal`` to answer)."""
    check_hello_prefix(data)
    _, _, claimed_protection, claimed, nonce_p, mac_h = _HELLO.unpack(data)
    if claimed != edge_id:
        raise HandshakeRefused(
            f"a producer of edge {claimed} (this is edge {edge_id})", Refusal.OTHER_EDGE
        )
    expected = _mac(key, b"hello", claimed_protection, edge_id, nonce_p)
    if not hmac.compare_digest(mac_h, expected):
        raise HandshakeRefused(
            "wrong key: the peer does not hold this run's secret", Refusal.WRONG_KEY
        )
    if claimed_protection != protection:
        raise HandshakeRefused(
            f"a producer that seals its records with protection {claimed_protection} "
            f"(this end: {protection})",
            Refusal.OTHER_PROTECTION,
            claimed_protection,
        )
    return Hello(claimed, claimed_protection, bytes(nonce_p))


def challenge(key: bytes, edge_id: int, protection: int, nonce_p: bytes, nonce_c: bytes) -> bytes:
    mac_c = _mac(key, b"consumer", protection, edge_id, nonce_p, nonce_c)
    return _CHALLENGE.pack(CHALLENGE_MAGIC, VERSION, protection, nonce_c, mac_c)


def refuse(refusal: Refusal, protection: int = 0) -> bytes:
    """A REFUSE saying why, and how this end seals (``protection``; 0: not said)."""
    return _REFUSE.pack(REFUSE_MAGIC, VERSION, refusal.value, protection)


def verify_confirm(
    key: bytes, edge_id: int, protection: int, nonce_c: bytes, nonce_p: bytes, data: bytes
) -> None:
    """``HandshakeRefused`` unless the CONFIRM proves the producer holds the key now."""
    check_confirm_prefix(data)
    _, _, mac_p = _CONFIRM.unpack(data)
    expected = _mac(key, b"producer", protection, edge_id, nonce_c, nonce_p)
    if not hmac.compare_digest(mac_p, expected):
        raise HandshakeRefused("wrong key: the peer's confirmation does not prove the secret")
