"""The secrets of a set of stages, and the keys derived from them.

The launcher makes one secret (32 random bytes) for the stages it starts and hands it
to each through the host port (a local process reads it on its standard input; it
never appears on a command line or on the wire). Everything else is derived from it
with HMAC-SHA256, under a label per use, so that a key for one purpose is worthless
for every other:

- ``control_key(secret, node_id)``: the key of the control channel to one stage. A
  frame signed for one stage verifies on no other stage's channel.
- ``edge_key(secret, run_id, edge_id)``: the key with which the two ends of one TCP
  edge of one run prove to each other that both hold the secret (edges/handshake.py).
- ``chain_id(secret)``: the id of the chain the stages of this secret make (128 bits
  of a labelled HMAC): it names the chain's links (one per hop) on every host, so it is
  as hard to guess as a run id, and it travels nowhere: every holder of the secret
  derives it. A chain started again gets a new secret, hence new names.
- ``record_keys(edge_key, protection, nonce_c, nonce_p)``: the two keys of one TCP
  connection of that edge, one per direction, from the edge key and both ends' fresh
  handshake nonces (edges/tcp_seal.py): a frame sealed for one direction, one
  connection, one edge or one run opens on no other.
- ``slice_key(secret, node_id)``: the key with which a stage on another host and the
  orchestrator's slice server prove the same before its slice of the model travels
  (slices/), its frames then sealed as an edge's are.

The stages are trusted (PIPELINE_ORCHESTRATION_MVP.md §10), so each holds the secret
the keys come from; what the keys keep out is everyone else: another run's processes,
a stray writer, a stranger on a port.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

SECRET_BYTES = 32
KEY_BYTES = 32
_CONTROL = b"gguf-pipeline/control-key/1\x00"
_EDGE = b"gguf-pipeline/edge-key/1\x00"
_SLICE = b"gguf-pipeline/slice-key/1\x00"
_RECORDS = b"gguf-pipeline/record-key/1\x00"
_CHAIN = b"gguf-pipeline/chain-id/1\x00"
CHAIN_ID_BYTES = 16
#: The two directions of a TCP edge's stream, as ``record_keys`` orders its keys.
TO_CONSUMER, TO_PRODUCER = 0, 1


class BadSecret(ValueError):
    """A secret of the wrong size (what a host handed a stage is not a secret)."""


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def parse_secret(line: str) -> bytes:
    """The secret from the line a local stage reads on its standard input (the
    launcher writes it in hex); ``BadSecret`` saying what was read instead (its length,
    never its text: it may be most of a secret)."""
    text = line.strip()
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) != SECRET_BYTES:
        got = "an empty line" if not text else f"{len(text)} characters that are not it"
        raise BadSecret(
            f"expected the stage secret on standard input ({2 * SECRET_BYTES} hex digits, "
            f"as the launcher writes it), read {got}"
        )
    return secret


def _check(secret: bytes) -> None:
    if len(secret) != SECRET_BYTES:
        raise BadSecret(f"a stage secret has {SECRET_BYTES} bytes, not {len(secret)}")


def control_key(secret: bytes, node_id: str) -> bytes:
    """The key of the control channel between the orchestrator and stage ``node_id``."""
    _check(secret)
    return hmac.new(secret, _CONTROL + node_id.encode("utf-8"), hashlib.sha256).digest()


def chain_id(secret: bytes) -> str:
    """The id of the chain whose stages hold ``secret``: ``chain-`` and 128 bits in hex."""
    _check(secret)
    return "chain-" + hmac.new(secret, _CHAIN, hashlib.sha256).hexdigest()[: 2 * CHAIN_ID_BYTES]


def edge_key(secret: bytes, run_id: str, edge_id: int) -> bytes:
    """The key of edge ``edge_id`` of run ``run_id``."""
    _check(secret)
    label = _EDGE + run_id.encode("utf-8") + b"\x00" + str(edge_id).encode("ascii")
    return hmac.new(secret, label, hashlib.sha256).digest()


def record_keys(
    edge_key: bytes, protection: int, nonce_c: bytes, nonce_p: bytes
) -> tuple[bytes, bytes]:
    """The keys of the frames the producer sends (``TO_CONSUMER``) and of those the
    consumer sends (``TO_PRODUCER``) on one connection of an edge, for the frame
    protection numbered ``protection``: HMAC-SHA256 of the edge key over a label, the
    protection, the direction and both handshake nonces."""
    if len(edge_key) != KEY_BYTES:
        raise BadSecret(f"an edge key has {KEY_BYTES} bytes, not {len(edge_key)}")
    head = _RECORDS + bytes([protection])

    def key(direction: int) -> bytes:
        data = head + bytes([direction]) + nonce_c + nonce_p
        return hmac.new(edge_key, data, hashlib.sha256).digest()

    return key(TO_CONSUMER), key(TO_PRODUCER)


def slice_key(secret: bytes, node_id: str) -> bytes:
    """The key of the slice transfers of stage ``node_id``."""
    _check(secret)
    return hmac.new(secret, _SLICE + node_id.encode("utf-8"), hashlib.sha256).digest()
