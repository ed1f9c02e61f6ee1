"""Stages on test hosts without Ray (``netns_hosts.TestHosts.up(..., ray=False)``): a
``StageHost`` for tests whose stage ``i`` runs on test host ``where[i]`` (its own
network and mount namespaces, entered with ``nsenter``) as ``tests.support.netns_stage``,
with TCP edges between hosts over the bridge. The orchestrator is this process, on this
machine, at the bridge's address. The rendezvous stands in for Ray's key-value store: an
in-memory store in this process (``SharedRendezvous``), asked by the stages over a Unix
socket, which a test can make lie (``detours``: the address a producer is told, as a
stranger on the network who can write the store would make it).
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from runplan import NodeSpec
from runtime_cupy.edges.media import every_medium, open_medium
from runtime_cupy.edges.port import EdgeMedium, remove_edges
from runtime_cupy.edges.shm import segment_name
from runtime_cupy.hosts.port import StageLaunch
from runtime_cupy.hosts.ray.rendezvous import PublishedAddresses, serve_rendezvous
from runtime_cupy.process.names import edge_dir
from tests.support.netns_hosts import ROOT, TestHosts
from tests.support.tree_host import RepoTreeHost


class SharedRendezvous:
    """``(run_id, edge_id) -> address`` for every host. ``detours[edge_id](address)``:
    what a producer of that edge is told instead of its consumer's ``address``
    (``None``: nothing yet)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._addresses: dict[tuple[str, int], str] = {}
        self.detours: dict[int, Callable[[str], str | None]] = {}

    def publish(self, run_id: str, edge_id: int, address: str) -> None:
        with self._lock:
            self._addresses[(run_id, edge_id)] = address

    def lookup(self, run_id: str, edge_id: int) -> str | None:
        with self._lock:
            address = self._addresses.get((run_id, edge_id))
        detour = self.detours.get(edge_id)
        if address is None or detour is None:
            return address
        return detour(address)

    def withdraw(self, run_id: str, edge_id: int) -> None:
        with self._lock:
            self._addresses.pop((run_id, edge_id), None)


class NetnsStageHost(RepoTreeHost):
    """Stage ``i`` on test host ``where[i]`` of ``hosts`` (node ``stage-i``), and node
    ``spare-j`` on host ``spares[j]`` (where a re-placed chain may put a lost stage); the
    orchestrator here. ``attach_delay[i]``: stage ``i``'s tries to attach its outbound
    edge take that long more (``netns_stage --attach-delay``); ``faults[i]``: the faults
    stage ``i``'s worker plays (``netns_stage --fault``). ``live_nodes``: the nodes
    of the hosts neither lost (``TestHosts.lose``: every process gone) nor cut off
    (``TestHosts.cut``), as a cluster's membership says once it noticed."""

    def __init__(
        self,
        hosts: TestHosts,
        where: Sequence[int],
        *,
        attach_delay: dict[int, float] | None = None,
        spares: Sequence[int] = (),
        faults: dict[int, Sequence[str]] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.hosts, self.where = hosts, tuple(where)
        self.node_hosts = {f"stage-{i}": h for i, h in enumerate(self.where)}
        self.node_hosts.update({f"spare-{j}": h for j, h in enumerate(spares)})
        self.attach_delay = attach_delay or {}
        self.faults = faults or {}
        self.store = SharedRendezvous()
        self._folder = Path("/var/tmp") / f"gpp-test-{secrets.token_hex(4)}"
        self._folder.mkdir(mode=0o700)
        self.path = self._folder / "rendezvous.sock"
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(self.path))
        self._server.listen(16)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        published = PublishedAddresses(self.store)  # type: ignore[arg-type]
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=serve_rendezvous, args=(conn, published), daemon=True).start()

    def host_of(self, node_id: str) -> int:
        """The test host of a node of the plan (0: this machine, the orchestrator's)."""
        return self.node_hosts.get(node_id, 0)

    def live_nodes(
        self, known: Sequence[tuple[NodeSpec, int | None]], worker: str
    ) -> tuple[tuple[NodeSpec, int | None], ...]:
        return tuple(
            (spec, device)
            for spec, device in known
            if self.hosts.anchors[self.host_of(spec.node_id)].poll() is None
            and self.host_of(spec.node_id) not in self.hosts.cut_off
        )

    def command(self, launch: StageLaunch, arguments: Sequence[str]) -> list[str]:
        i = self.host_of(launch.node_id)
        return [
            "nsenter", "-t", str(self.hosts.anchor(i)), "-m", "-n", f"--wd={ROOT}",
            sys.executable, "-m", "tests.support.netns_stage",
            "--bind-host", self.hosts.address(i), "--rendezvous", str(self.path),
            "--attach-delay", str(self.attach_delay.get(launch.stage_index, 0.0)),
            *(part for f in self.faults.get(launch.stage_index, ()) for part in ("--fault", f)),
            "--", *arguments,
        ]  # fmt: skip

    def same_host(self, node_a: str, node_b: str) -> bool:
        return self.host_of(node_a) == self.host_of(node_b)

    def medium(self, name: str, encrypt: bool = False) -> EdgeMedium:
        return open_medium(name, self.store, self.hosts.root_address, encrypt)

    def rendezvous(self) -> SharedRendezvous:  # type: ignore[override]
        return self.store

    def cleanup(self, run_id: str, edge_ids: Sequence[int]) -> None:
        remove_edges(every_medium(self.store), run_id, edge_ids)
        names = " ".join(
            f"/dev/shm/{segment_name(run_id, e)} {edge_dir(run_id, e)}" for e in edge_ids
        )
        for i in sorted(set(self.node_hosts.values())):
            if self.hosts.anchors[i].poll() is None:  # a lost host took its files along
                self.hosts.on_host(i, f"rm -rf {names}")

    def close(self) -> None:
        self._server.close()
        with contextlib.suppress(OSError):
            shutil.rmtree(self._folder)
