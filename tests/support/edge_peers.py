"""Peers of a TCP edge that tests play on raw sockets: the producer's side of the
handshake (``as_producer``), frames sealed as a producer seals them (``sealed``), and
strangers on a consumer's port (``Flood``: idle connections, garbage, half handshakes,
copies of nothing, as fast as it can, from a process of its own)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import socket
import subprocess
import sys
import time

from runtime_cupy.edges import handshake as hs
from runtime_cupy.edges.tcp_frames import FRAME
from runtime_cupy.edges.tcp_seal import AUTHENTICATED, FrameSeal, Protection


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError(f"the peer closed after {len(data)} of {n} bytes")
        data += chunk
    return bytes(data)


def as_producer(
    sock: socket.socket, key: bytes, edge_id: int, protection: Protection = AUTHENTICATED
) -> tuple[FrameSeal, FrameSeal]:
    """The producer's handshake on a blocking socket; its seals ``(send, receive)``
    (``hs.HandshakeRefused`` if the consumer refuses)."""
    nonce_p = hs.new_nonce()
    sock.sendall(hs.hello(key, edge_id, protection.code, nonce_p))
    head = recv_exact(sock, hs.REPLY_HEAD_BYTES)
    rest = recv_exact(sock, hs.reply_bytes(head) - len(head))
    nonce_c = hs.read_reply(key, edge_id, protection.code, nonce_p, head + rest)
    sock.sendall(hs.confirm(key, edge_id, protection.code, nonce_c, nonce_p))
    return protection.seals(key, nonce_c, nonce_p, producer=True)


def sealed(seal: FrameSeal, kind: int, value: int = 0, body: bytes = b"") -> bytes:
    """A frame as a producer sends it: head, body, tag."""
    head = FRAME.pack(kind, value)
    out, tag = seal.seal(head, body)
    return head + bytes(out) + tag


#: How long a port refuses connections before a flood takes it for closed.
CLOSED_S = 0.3


def flood(host: str, port: int, seconds: float, keep: int = 512) -> int:
    """Strangers on ``host:port`` for ``seconds``, as fast as one process opens them:
    connections begun without waiting (up to ``keep`` held at once, the oldest let go),
    every third one saying something that is not a HELLO (garbage, half a HELLO), until
    the port has refused them for ``CLOSED_S`` (its consumer got its producer); the
    connections begun."""
    held: list[socket.socket] = []
    made = 0
    deadline = time.monotonic() + seconds
    refused_since: float | None = None
    garbage = (b"GET / HTTP/1.1\r\n\r\n", b"GPTH\x02", b"")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    while time.monotonic() < deadline:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        if sock.connect_ex((host, port)) not in (0, errno.EINPROGRESS):
            sock.close()
            now = time.monotonic()
            refused_since = refused_since or now
            if now - refused_since > CLOSED_S:
                break
            time.sleep(0.001)  # refused: the port closed
            continue
        refused_since = None
        made += 1
        with contextlib.suppress(OSError):
            sock.send(garbage[made % len(garbage)])
        held.append(sock)
        if len(held) > keep:
            held.pop(0).close()
    for sock in held:
        sock.close()
    return made


def made(proc: subprocess.Popen[str]) -> int:
    """The connections a flood process (``main``) made, once it is done."""
    assert proc.stdout is not None
    out = proc.stdout.read()
    proc.wait(60)
    return int(out.strip() or 0)


def main() -> int:
    """``python -m tests.support.edge_peers HOST:PORT|- [--seconds S]``: flood, then
    print the connections made (``-``: the address is the first line of standard input,
    so that the process is up before the port is)."""
    parser = argparse.ArgumentParser(description="flood a port with strangers")
    parser.add_argument("address", help="HOST:PORT, or - to read it from standard input")
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    address = sys.stdin.readline().strip() if args.address == "-" else args.address
    host, _, port = address.rpartition(":")
    print(flood(host.strip("[]"), int(port), args.seconds), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
