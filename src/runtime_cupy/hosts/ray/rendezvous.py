"""The rendezvous of TCP edges across a Ray cluster: Ray's internal key-value store
(held by the cluster's GCS), keyed by ``(run_id, edge_id)``.

- ``KvRendezvous``: for processes that are part of Ray (the orchestrator, a driver;
  the stage supervisors, actors): ``ray.experimental.internal_kv`` directly.
- A stage process is not part of Ray (it is the supervisor's child, with no Ray in
  it): ``SupervisorRendezvous`` asks its supervisor, over a Unix socket the supervisor
  hands it (``--rendezvous-fd``), one JSON line per request and per answer;
  ``serve_rendezvous`` is the supervisor's side, which does what is asked through
  ``KvRendezvous`` and remembers what its stage published, so that it can withdraw
  it when the stage is gone, however it went.

A lookup never waits for the consumer: ``None`` until it has published. A stage's
producer asks again every few milliseconds while it waits; the stage side answers
``None`` without asking again within ``LOOKUP_EVERY_S`` of its last unanswered
question, so the store is asked at most a hundred times a second per waiting edge.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from typing import Any

from runtime_cupy.edges.port import EdgeSetupError

log = logging.getLogger("runtime_cupy.hosts.ray")

NAMESPACE = "gguf-pipeline"
LOOKUP_EVERY_S = 0.01
#: How long a stage waits for its supervisor's answer.
ASK_TIMEOUT_S = 15.0


def run_prefix(run_id: str) -> bytes:
    return b"edge/" + run_id.encode("utf-8").hex().encode("ascii") + b"/"


def edge_key(run_id: str, edge_id: int) -> bytes:
    return run_prefix(run_id) + str(edge_id).encode("ascii")


class KvRendezvous:
    """``(run_id, edge_id) -> host:port`` in Ray's internal key-value store (in a
    process connected to Ray)."""

    def publish(self, run_id: str, edge_id: int, address: str) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(
            edge_key(run_id, edge_id), address.encode("utf-8"), overwrite=True, namespace=NAMESPACE
        )

    def lookup(self, run_id: str, edge_id: int) -> str | None:
        from ray.experimental import internal_kv

        value = internal_kv._internal_kv_get(edge_key(run_id, edge_id), namespace=NAMESPACE)
        return value.decode("utf-8") if value else None

    def withdraw(self, run_id: str, edge_id: int) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(edge_key(run_id, edge_id), namespace=NAMESPACE)

    def withdraw_run(self, run_id: str) -> None:
        """Every address of the run."""
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(run_prefix(run_id), del_by_prefix=True, namespace=NAMESPACE)


class SupervisorRendezvous:
    """A stage process's rendezvous: its supervisor's, asked over ``sock``."""

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(ASK_TIMEOUT_S)
        self._sock = sock
        self._reader = sock.makefile("rb")
        self._asked: dict[tuple[str, int], float] = {}

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        try:
            self._sock.sendall(json.dumps(request).encode("utf-8") + b"\n")
            line = self._reader.readline()
        except OSError as exc:
            raise EdgeSetupError(f"the stage's supervisor does not answer: {exc}") from None
        if not line:
            raise EdgeSetupError("the stage's supervisor is gone")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise EdgeSetupError(f"the cluster's rendezvous failed: {answer['error']}")
        return answer

    def publish(self, run_id: str, edge_id: int, address: str) -> None:
        self._ask({"op": "publish", "run_id": run_id, "edge_id": edge_id, "address": address})

    def lookup(self, run_id: str, edge_id: int) -> str | None:
        now = time.monotonic()
        if now - self._asked.get((run_id, edge_id), -1.0) < LOOKUP_EVERY_S:
            return None
        address = self._ask({"op": "lookup", "run_id": run_id, "edge_id": edge_id})["address"]
        if address is None:
            self._asked[(run_id, edge_id)] = now
        else:
            self._asked.pop((run_id, edge_id), None)
        return str(address) if address is not None else None

    def withdraw(self, run_id: str, edge_id: int) -> None:
        with contextlib.suppress(EdgeSetupError):  # a stopping stage's supervisor may be gone
            self._ask({"op": "withdraw", "run_id": run_id, "edge_id": edge_id})

    def close(self) -> None:
        self._reader.close()
        self._sock.close()


class PublishedAddresses:
    """What a supervisor's stage published and has not withdrawn."""

    def __init__(self, store: KvRendezvous) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._keys: set[tuple[str, int]] = set()

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op, run_id, edge_id = request["op"], str(request["run_id"]), int(request["edge_id"])
        if op == "publish":
            self.store.publish(run_id, edge_id, str(request["address"]))
            with self._lock:
                self._keys.add((run_id, edge_id))
            return {"ok": True}
        if op == "lookup":
            return {"address": self.store.lookup(run_id, edge_id)}
        if op == "withdraw":
            self.store.withdraw(run_id, edge_id)
            with self._lock:
                self._keys.discard((run_id, edge_id))
            return {"ok": True}
        return {"error": f"unknown request {op!r}"}

    def withdraw_all(self) -> None:
        with self._lock:
            keys, self._keys = self._keys, set()
        for run_id, edge_id in keys:
            with contextlib.suppress(Exception):
                self.store.withdraw(run_id, edge_id)


def serve_rendezvous(sock: socket.socket, published: PublishedAddresses) -> None:
    """Answer a stage's requests on ``sock`` until it closes (a supervisor's thread)."""
    reader = sock.makefile("rb")
    with contextlib.suppress(OSError), sock:
        for line in reader:
            try:
                answer = published.handle(json.loads(line))
            except Exception as exc:  # a store that failed, or a request that is not one
                log.warning("rendezvous request failed: %s", exc)
                answer = {"error": str(exc)}
            sock.sendall(json.dumps(answer).encode("utf-8") + b"\n")
