"""The challenge-response that opens a TCP edge: before any record flows, each end
proves that it holds the edge's key (``keys.edge_key``, derived from the stages' secret
and ``(run_id, edge_id)``); the key itself never crosses the wire.

The consumer listens and speaks first::

    consumer -> producer   CHALLENGE  "GPTC" version:u8 pad:3  nonce_c:32            40 bytes
    producer -> consumer   PROOF      "GPTP" version:u8 pad:3  edge_id:u64
                                      nonce_p:32  mac_p:32                             80 bytes
    consumer -> producer   ACCEPT     "GPTA" version:u8 pad:3  mac_c:32              40 bytes

    mac_p = HMAC-SHA256(key, "producer" | edge_id | nonce_c | nonce_p)
    mac_c = HMAC-SHA256(key, "consumer" | edge_id | nonce_p | nonce_c)

Fresh random nonces on both sides make every proof good for one connection only: a
recorded handshake replayed to another connection fails. The consumer checks the edge
id (a producer of another edge is told apart from a wrong key in its log), then
``mac_p``; the producer checks ``mac_c``, so a stranger listening where the rendezvous
pointed cannot take an edge's records either. Anything else (garbage, a record sent
without a handshake, a wrong key, a truncated message) is refused, and the connection
closed, on the first byte that proves it wrong.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct

from attrs import frozen

VERSION = 1
NONCE_BYTES = 32
_CHALLENGE = struct.Struct(f"<4sB3x{NONCE_BYTES}s")
_PROOF = struct.Struct(f"<4sB3xQ{NONCE_BYTES}s32s")
_ACCEPT = struct.Struct("<4sB3x32s")
CHALLENGE_MAGIC, PROOF_MAGIC, ACCEPT_MAGIC = b"GPTC", b"GPTP", b"GPTA"
CHALLENGE_BYTES = _CHALLENGE.size
PROOF_BYTES = _PROOF.size
ACCEPT_BYTES = _ACCEPT.size


class HandshakeRefused(ValueError):
    """What a peer sent does not open this edge; the message says why."""


def _mac(key: bytes, role: bytes, edge_id: int, first: bytes, second: bytes) -> bytes:
    data = role + struct.pack("<Q", edge_id) + first + second
    return hmac.new(key, data, hashlib.sha256).digest()


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def challenge(nonce_c: bytes) -> bytes:
    return _CHALLENGE.pack(CHALLENGE_MAGIC, VERSION, nonce_c)


def _check_prefix(data: bytes, magic: bytes, what: str) -> None:
    """Refuse as soon as the bytes so far cannot begin ``magic`` and the version."""
    head = data[:5]
    expected = magic + bytes([VERSION])
    if head != expected[: len(head)]:
        raise HandshakeRefused(f"not a {what} of this protocol (first bytes {head!r})")


def check_proof_prefix(data: bytes) -> None:
    _check_prefix(data, PROOF_MAGIC, "producer's handshake")


def check_challenge_prefix(data: bytes) -> None:
    _check_prefix(data, CHALLENGE_MAGIC, "consumer's challenge")


def check_accept_prefix(data: bytes) -> None:
    _check_prefix(data, ACCEPT_MAGIC, "consumer's acceptance")


@frozen
class Proof:
    edge_id: int
    nonce_p: bytes
    mac_p: bytes


def read_challenge(data: bytes) -> bytes:
    """The consumer's nonce from a whole CHALLENGE."""
    check_challenge_prefix(data)
    _, _, nonce_c = _CHALLENGE.unpack(data)
    return bytes(nonce_c)


def proof(key: bytes, edge_id: int, nonce_c: bytes, nonce_p: bytes) -> bytes:
    """The producer's PROOF for ``edge_id`` after the consumer's ``nonce_c``."""
    mac_p = _mac(key, b"producer", edge_id, nonce_c, nonce_p)
    return _PROOF.pack(PROOF_MAGIC, VERSION, edge_id, nonce_p, mac_p)


def verify_proof(key: bytes, edge_id: int, nonce_c: bytes, data: bytes) -> Proof:
    """The producer's proof, checked; ``HandshakeRefused`` naming what is wrong."""
    check_proof_prefix(data)
    _, _, claimed, nonce_p, mac_p = _PROOF.unpack(data)
    if claimed != edge_id:
        raise HandshakeRefused(f"a producer of edge {claimed} (this is edge {edge_id})")
    if not hmac.compare_digest(mac_p, _mac(key, b"producer", edge_id, nonce_c, nonce_p)):
        raise HandshakeRefused("wrong key: the peer does not hold this run's secret")
    return Proof(claimed, bytes(nonce_p), bytes(mac_p))


def accept(key: bytes, edge_id: int, nonce_c: bytes, nonce_p: bytes) -> bytes:
    """The consumer's ACCEPT of a verified proof."""
    return _ACCEPT.pack(ACCEPT_MAGIC, VERSION, _mac(key, b"consumer", edge_id, nonce_p, nonce_c))


def verify_accept(key: bytes, edge_id: int, nonce_c: bytes, nonce_p: bytes, data: bytes) -> None:
    """``HandshakeRefused`` unless the consumer's ACCEPT proves it holds the key."""
    check_accept_prefix(data)
    _, _, mac_c = _ACCEPT.unpack(data)
    if not hmac.compare_digest(mac_c, _mac(key, b"consumer", edge_id, nonce_p, nonce_c)):
        raise HandshakeRefused(f"the consumer of edge {edge_id} does not hold this run's secret")
