"""A man in the middle of a TCP edge that holds no key, for tests: it listens on a port
of its own, connects each connection it gets to the edge's consumer (``upstream``),
forwards the handshake as it is (it cannot answer it itself), and then, frame by frame,
does what ``attack`` says to what flows:

- ``pass``: nothing (it still sees every byte: ``records`` keeps the records' bodies as
  they crossed it);
- ``change@K``: record ``K``'s payload changed as an attacker would want it to be: a
  token id made another valid one (its low bit flipped), activations negated (each
  value's sign bit flipped), its header left as it was;
- ``replay@K``: record ``K - 1``'s frame, as it was, sent again in place of record ``K``;
- ``inject@K``: a frame of its own before record ``K``: record ``K``'s head and body with
  the payload changed and a made-up seal;
- ``reorder@K``: records ``K`` and ``K + 1`` swapped (only where the producer sends
  ``K + 1`` before ``K`` is consumed: two in flight);
- ``reorder-credits@K``: the consumer's frames ``K`` and ``K + 1`` (its credits) swapped;
- ``inflate@K``: record ``K``'s head announcing 64 bytes more than its body holds (the
  head is sealed with the body, so the consumer learns of it only once those bytes
  came, which its producer never sends).

It reads the wire as the edge writes it: the producer's HELLO then CONFIRM, the
consumer's CHALLENGE; then frames of an 8-byte head ``kind:u8 pad:3 value:u32``, a
RECORD's body and the seal's tag (32 bytes for HMAC, 16 for AES-GCM, from the HELLO's
protection). It also reads the wire of the edges before frames were sealed (the
consumer's 40-byte CHALLENGE first, then the producer's 80-byte PROOF, the 40-byte
ACCEPT, and frames without tags), so that the same attack runs against that code.

    python -m tests.support.edge_relay --upstream HOST:PORT|- --attack change@2 [--bind ADDR]

prints the relay's ``HOST:PORT`` as a line (with ``--upstream -``, reads the consumer's
``HOST:PORT`` as the first line of standard input, and connects each connection it gets
once it has it), serves until standard input closes, then prints one JSON object:
connections, records seen, what it did.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import sys
import threading
from collections.abc import Callable

from runplan.plan import OBJECT_HEADER_BYTES
from runplan.record_header import HeaderDType, HeaderError, ObjectHeader
from runtime_cupy.edges.tcp_frames import FRAME, RECORD
from tests.support.serving_threads import ServingThreads

#: Seal tags by the HELLO's protection code.
_TAGS = {0: 0, 1: 32, 2: 16}
ATTACKS = ("pass", "change", "replay", "inject", "reorder", "reorder-credits", "inflate")


def _changed(body: bytes) -> bytes:
    """A record with its payload changed (its header, and so its checks, kept): token ids
    another valid id each (low bit flipped), float activations negated; a record it
    cannot read (encrypted), one bit of it flipped."""
    header, payload = body[:OBJECT_HEADER_BYTES], bytearray(body[OBJECT_HEADER_BYTES:])
    try:
        dtype = ObjectHeader.unpack(header).dtype
    except HeaderError:  # encrypted: one bit of it, then
        return body[:-1] + bytes([body[-1] ^ 0x01])
    if dtype is HeaderDType.U32:
        for i in range(0, len(payload), 4):
            payload[i] ^= 0x01
    else:
        width = 4 if dtype is HeaderDType.F32 else 2
        for i in range(width - 1, len(payload), width):
            payload[i] ^= 0x80
    return header + bytes(payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return bytes(data)


class Relay:
    """The relay; ``address`` is where it listens. ``upstream()`` says where the
    consumer is when a connection comes. ``attacks``: the kinds it takes (a relay of
    another wire, ``slice_relay``, has its own)."""

    attacks: tuple[str, ...] = ATTACKS

    def __init__(
        self,
        upstream: Callable[[], tuple[str, int]],
        attack: str = "pass",
        bind: str = "127.0.0.1",
    ) -> None:
        kind, _, at = attack.partition("@")
        if kind not in self.attacks or (kind != "pass" and not at.isdigit()):
            raise ValueError(f"bad attack {attack!r}: pass, or KIND@K with KIND in {self.attacks}")
        self.kind, self.at = kind, int(at or 0)
        self.upstream = upstream
        self.listener = socket.create_server((bind, 0))
        self.address = self.listener.getsockname()[:2]
        self.connections = 0
        self.records: list[bytes] = []  # record bodies as they crossed, in order
        self.done: list[str] = []  # what the attack did
        self._tag = 0
        self._threads = ServingThreads(self.listener)
        self._threads.start(self._accept)

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(self.upstream(), timeout=10)
            except OSError:
                down.close()
                continue
            up.settimeout(None)
            self._threads.keep(down, up)
            self.connections += 1
            self._threads.start(self._to_consumer, down, up)
            self._threads.start(self._to_producer, up, down)

    # -- producer -> consumer -----------------------------------------------------------
    def _to_consumer(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            first = _recv_exact(src, 8)
            if first[:4] == b"GPTH":  # sealed frames: HELLO (80), then CONFIRM (40)
                self._tag = _TAGS.get(first[5], 0)
                dst.sendall(first + _recv_exact(src, 80 - 8))
                dst.sendall(_recv_exact(src, 40))
            else:  # before: a PROOF (80) after the consumer's CHALLENGE, frames untagged
                dst.sendall(first + _recv_exact(src, 80 - 8))
            previous: bytes | None = None
            held: bytes | None = None
            index = 0
            while True:
                head = _recv_exact(src, FRAME.size)
                kind, value = FRAME.unpack(head)
                body = _recv_exact(src, value) if kind == RECORD else b""
                tag = _recv_exact(src, self._tag)
                frame = head + body + tag
                if kind != RECORD:
                    dst.sendall(frame)
                    continue
                self.records.append(body)
                if self.kind == "reorder" and index == self.at:
                    held = frame
                elif held is not None:
                    self.done.append(f"swapped records {index - 1} and {index}")
                    dst.sendall(frame + held)
                    held = None
                else:
                    dst.sendall(self._tamper(index, head, body, tag, previous))
                previous = frame
                index += 1
        except (EOFError, OSError):
            return
        finally:
            self._close(dst)

    def _tamper(
        self, index: int, head: bytes, body: bytes, tag: bytes, previous: bytes | None
    ) -> bytes:
        frame = head + body + tag
        if index != self.at or self.kind not in ("change", "replay", "inject", "inflate"):
            return frame
        if self.kind == "inflate":
            kind, value = FRAME.unpack(head)
            self.done.append(f"announced record {index} with {value + 64} bytes of {value}")
            return FRAME.pack(kind, value + 64) + body + tag
        if self.kind == "change":
            self.done.append(f"changed record {index}")
            return head + _changed(body) + tag
        if self.kind == "replay" and previous is not None:
            self.done.append(f"replayed record {index - 1} in place of record {index}")
            return previous
        if self.kind == "inject":
            forged = body[:OBJECT_HEADER_BYTES] + bytes(len(body) - OBJECT_HEADER_BYTES)
            self.done.append(f"injected a record before record {index}")
            return head + forged + bytes(len(tag)) + frame
        return frame

    # -- consumer -> producer -----------------------------------------------------------
    def _to_producer(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            first = _recv_exact(src, 8)
            if first[4] >= 2:  # a CHALLENGE (72) or a REFUSE (8)
                rest = 72 - 8 if first[:4] == b"GPTC" else 0
                dst.sendall(first + _recv_exact(src, rest))
            else:  # before: CHALLENGE (40), then ACCEPT (40)
                dst.sendall(first + _recv_exact(src, 40 - 8))
                dst.sendall(_recv_exact(src, 40))
            held: bytes | None = None
            index = 0
            while True:
                frame = _recv_exact(src, FRAME.size + self._tag)
                if self.kind == "reorder-credits" and index == self.at:
                    held = frame
                elif held is not None:
                    self.done.append(f"swapped the consumer's frames {index - 1} and {index}")
                    dst.sendall(frame + held)
                    held = None
                else:
                    dst.sendall(frame)
                index += 1
        except (EOFError, OSError):
            return
        finally:
            self._close(dst)

    def _close(self, sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        """Stop listening, end every connection and join every thread of the relay."""
        self._threads.close()

    def report(self) -> dict[str, object]:
        return {
            "connections": self.connections,
            "records": [body.hex() for body in self.records],
            "done": list(self.done),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="the consumer's HOST:PORT")
    parser.add_argument("--attack", default="pass")
    parser.add_argument("--bind", default="127.0.0.1")
    args = parser.parse_args()
    upstream: list[tuple[str, int]] = []
    known = threading.Event()

    def learn(address: str) -> None:
        host, _, port = address.strip().rpartition(":")
        upstream.append((host.strip("[]"), int(port)))
        known.set()

    def where() -> tuple[str, int]:
        known.wait(60)
        return upstream[0]

    if args.upstream != "-":
        learn(args.upstream)
    relay = Relay(where, args.attack, args.bind)
    print(f"{relay.address[0]}:{relay.address[1]}", flush=True)
    if args.upstream == "-":
        learn(sys.stdin.readline())
    sys.stdin.read()
    relay.close()
    print(json.dumps(relay.report()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
