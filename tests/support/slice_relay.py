"""A man in the middle of a slice transfer (``runtime_cupy.slices.protocol``) that holds
no key, for tests: ``edge_relay.Relay``'s listener and connections, reading the slice
wire instead of an edge's. It forwards the handshake as it is (it cannot answer it
itself; ``downgrade`` changes the protection the stage's HELLO asks for), keeps every
byte the server sent as it crossed (``wire``), and, where the server seals its bytes
in chunks (encrypted), does what ``attack`` says to the chunks, frame by frame:

- ``pass``: nothing;
- ``change@K``: one bit of chunk ``K``'s body flipped;
- ``replay@K``: chunk ``K - 1``'s frame, as it was, sent again in place of chunk ``K``;
- ``drop@K``: chunk ``K`` not forwarded;
- ``reorder@K``: chunks ``K`` and ``K + 1`` swapped;
- ``stall@K``: chunk ``K`` and all after it held back, the connection kept open (a
  link gone silent);
- ``downgrade``: the HELLO's protection byte set to the authenticated one's (its MAC
  then fails: the server refuses the stage).

Chunk 0 is the slice's GGUF header; the tensors follow, each of the test models' in
one chunk.
"""

from __future__ import annotations

import socket

from runtime_cupy.edges import handshake as hs
from runtime_cupy.edges.tcp_seal import AUTHENTICATED, PROTECTIONS, AeadSeal
from runtime_cupy.slices.protocol import CHUNK_FLAG
from tests.support.edge_relay import Relay, _recv_exact

_HEAD = 4


class SliceRelay(Relay):
    __test__ = False
    attacks = ("pass", "change", "replay", "drop", "reorder", "stall", "downgrade")

    def __init__(self, server: str, attack: str = "pass") -> None:
        host, _, port = server.rpartition(":")
        self.wire = bytearray()  # what the server sent, as it crossed
        self.chunks = 0  # chunks of bytes seen
        self._encrypted = False
        super().__init__(lambda: (host, int(port)), attack.replace("downgrade", "downgrade@0"))

    # -- stage -> server ----------------------------------------------------------------
    def _to_consumer(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            hello = bytearray(_recv_exact(src, hs.HELLO_BYTES))
            self._encrypted = PROTECTIONS[hello[5]].encrypts
            if self.kind == "downgrade":
                hello[5] = AUTHENTICATED.code
                self.done.append(f"asked for protection {AUTHENTICATED.code} in the HELLO")
            dst.sendall(hello)
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except (EOFError, OSError, KeyError):
            return
        finally:
            self._close(dst)

    # -- server -> stage ----------------------------------------------------------------
    def _to_producer(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            first = _recv_exact(src, hs.REPLY_HEAD_BYTES)
            rest = hs.reply_bytes(first) - len(first)
            self._forward(dst, first + _recv_exact(src, rest))
            if not self._encrypted:  # raw bytes between the frames: nothing to parse
                while data := src.recv(1 << 16):
                    self._forward(dst, data)
                return
            tag = AeadSeal.tag_bytes
            previous: bytes | None = None
            held: bytes | None = None
            while True:
                head = _recv_exact(src, _HEAD)
                word = int.from_bytes(head, "little")
                frame = head + _recv_exact(src, (word & ~CHUNK_FLAG) + tag)
                if not word & CHUNK_FLAG:
                    self._forward(dst, frame)
                    continue
                index, self.chunks = self.chunks, self.chunks + 1
                if held is not None:
                    self.done.append(f"swapped chunks {index - 1} and {index}")
                    self._forward(dst, frame + held)
                    held = None
                elif index == self.at and self.kind == "reorder":
                    held = frame
                elif index == self.at and self.kind == "stall":
                    self.done.append(f"held back chunk {index} and what followed")
                    while src.recv(1 << 16):  # read and kept, until either end closes
                        pass
                    return
                elif index == self.at and self.kind == "drop":
                    self.done.append(f"dropped chunk {index}")
                elif index == self.at and self.kind == "replay" and previous is not None:
                    self.done.append(f"replayed chunk {index - 1} in place of chunk {index}")
                    self._forward(dst, previous)
                elif index == self.at and self.kind == "change":
                    self.done.append(f"changed chunk {index}")
                    middle = _HEAD + (word & ~CHUNK_FLAG) // 2
                    self._forward(
                        dst, frame[:middle] + bytes([frame[middle] ^ 1]) + frame[middle + 1 :]
                    )
                else:
                    self._forward(dst, frame)
                previous = frame
        except (EOFError, OSError, hs.HandshakeRefused):
            return
        finally:
            self._close(dst)

    def _forward(self, dst: socket.socket, data: bytes) -> None:
        self.wire += data
        dst.sendall(data)

    @property
    def address_text(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"
