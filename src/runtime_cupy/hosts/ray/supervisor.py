"""The Ray actor of one stage: it lives on the node the plan names, starts the stage
process there and watches it.

Why an actor that supervises a process rather than an actor that is the stage: the stage
process stays the one of a single host (``python -m
runtime_cupy.process.stage_process``'s loop, with no Ray inside it: none of Ray's
threads in its event loop, its own signals, its own exit status), it can be killed like
any process (SIGKILL included), and its supervisor reaps it and says how it ended
(``killed by SIGKILL``), which a dead actor cannot. The supervisor holds the write end
of the stage's lifeline: if Ray ends the actor (its owner, the orchestrator's driver,
died; its node is being removed), the stage process sees its lifeline close and stops on
its own, as it does on one host when the launcher goes.

``prefetch`` brings the stage's slice of the model into this host's cache, when its
host lacks it (``runtime_cupy.slices``), while the stage process starts.

``start`` opens the stage's control connection to the orchestrator (``control_link``)
before the process exists, and hands it over as the process's ``--control-fd``: the
orchestrator has its channel as soon as ``start`` returns, while the process still
imports. ``supervise`` blocks until the process ends and returns its exit status
(negative: the signal): the orchestrator's handle waits on that call's result, which Ray
also resolves, with an error, when the actor or its node dies. ``cleanup`` frees what
a run left on this host (segments, edge folders, addresses), also what a killed
stage made. After a stage that lost its orchestrator has exited, the supervisor ends its
own process: nothing of the run resumes on this host when a cut link comes back.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runtime_cupy.edges.media import every_medium
from runtime_cupy.edges.port import remove_edges
from runtime_cupy.hosts.local import THREAD_VARIABLES, LocalProcessHost
from runtime_cupy.hosts.port import StageLaunch
from runtime_cupy.hosts.ray import control_link
from runtime_cupy.hosts.ray.rendezvous import KvRendezvous, PublishedAddresses, serve_rendezvous
from runtime_cupy.process.keys import control_key, slice_key
from runtime_cupy.slices.fetch import SliceFetcher, SliceTransferFailed

log = logging.getLogger("runtime_cupy.hosts.ray")

#: The stage process's exit status after it lost its orchestrator (``stage_loss.EXIT_LOST``).
EXIT_LOST = 3
#: How long the supervisor waits to connect to the orchestrator.
CONNECT_S = 30.0
#: How long after its lost stage exited the supervisor ends itself.
LINGER_S = 1.0


def _inherited() -> dict[str, str]:
    """This process's environment without the thread counts Ray set in it: a Ray worker
    sets ``OMP_NUM_THREADS`` to the CPUs its actor asked for, or 1 when it asked for
    none, as this one does, where the variable was unset; the stage kept it, and every
    stage on a Ray host ran one thread. A thread count this process started with
    (``/proc/self/environ``: the node's own, from ``ray start``'s environment) stays."""
    env = dict(os.environ)
    try:
        started = Path("/proc/self/environ").read_bytes().split(b"\0")
    except OSError:  # not Linux: nothing tells Ray's from the node's
        return env
    names = {item.split(b"=", 1)[0].decode("utf-8", "replace") for item in started}
    for name in THREAD_VARIABLES:
        if name not in names:
            env.pop(name, None)
    return env


class StageSupervisor:
    """One stage's supervisor (a Ray actor: ``ray.remote(StageSupervisor)``)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._lifeline: int | None = None
        self._published = PublishedAddresses(KvRendezvous())
        self._lock = threading.Lock()

    def where(self) -> dict[str, Any]:
        """This actor's process and host."""
        import ray

        return {
            "pid": os.getpid(),
            "address": ray.util.get_node_ip_address(),
            "ray_node_id": ray.get_runtime_context().get_node_id(),
        }

    def start(
        self,
        launch: StageLaunch,
        secret: bytes,
        control_address: str,
        bind_host: str,
        log_level: str,
        entry: Sequence[str] = ("-m", "runtime_cupy.hosts.ray.stage_entry"),
    ) -> int:
        """Connect the stage's control channel and start its process; its pid."""
        key = control_key(secret, launch.node_id)
        control = control_link.connect(control_address, launch.stage_index, key, CONNECT_S)
        rendezvous, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        life_r, life_w = os.pipe()
        local = LocalProcessHost(log_level=log_level)
        arguments = local.arguments(launch, control.fileno(), life_r, None)
        cmd = [
            sys.executable,
            *entry,
            "--bind-host", bind_host,
            "--rendezvous-fd", str(theirs.fileno()),
            "--", *arguments,
        ]  # fmt: skip
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                pass_fds=(control.fileno(), life_r, theirs.fileno()),
                env=local.environment(launch, _inherited()),
            )
        except BaseException:
            rendezvous.close()
            os.close(life_w)
            raise
        finally:
            control.close()  # the stage's now: its end closes when the process ends
            theirs.close()
            os.close(life_r)
        assert proc.stdin is not None
        with self._lock:
            self._proc, self._lifeline = proc, life_w
        with contextlib.suppress(OSError):  # the pipe stays open for a new chain's secret
            self.hand_secret(secret)
        threading.Thread(
            target=serve_rendezvous, args=(rendezvous, self._published), daemon=True
        ).start()
        return proc.pid

    def prefetch(self, launch: StageLaunch, secret: bytes) -> dict[str, Any]:
        """Bring the stage's slice into this host's cache (``launch.slices``) while the
        stage process starts: what the fetch did (``transfers.jsonl``'s line), with
        ``ok`` false and the ``error`` when it failed (the stage's bind tries again and
        reports it)."""
        if launch.slices is None or launch.source is None or launch.parts is None:
            return {"ok": True, "outcome": "none"}
        key = slice_key(secret, launch.node_id)
        fetcher = SliceFetcher(launch.slices, launch.stage_index, key, encrypt=launch.encrypt_edges)
        try:
            fetcher.resolve(launch.source, launch.parts)
        except SliceTransferFailed as exc:
            return {"ok": False, "error": str(exc)}
        return {"ok": True, **fetcher.last}

    def supervise(self) -> int:
        """Wait for the stage process to end; its exit status (negative: the signal)."""
        proc = self._proc
        if proc is None:
            raise RuntimeError("no stage process was started")
        code = proc.wait()
        threading.Thread(target=self._published.withdraw_all, daemon=True).start()
        if code == EXIT_LOST:
            # The run is over for this host: nothing resumes when a cut link comes back.
            threading.Timer(LINGER_S, os._exit, (0,)).start()
        return code

    def status(self) -> int | None:
        """The stage process's exit status, ``None`` while it runs."""
        proc = self._proc
        return None if proc is None else proc.poll()

    def hand_secret(self, secret: bytes) -> None:
        """A new chain's secret for the stage (it joins that chain: ``JoinChain``), one
        hex line on its standard input, as the first; ``OSError`` once it is gone."""
        proc = self._proc
        if proc is None or proc.stdin is None or proc.stdin.closed:
            raise OSError("the stage's secret pipe is closed")
        proc.stdin.write(secret.hex().encode("ascii") + b"\n")
        proc.stdin.flush()

    def kill_stage(self) -> None:
        proc = self._proc
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

    def cleanup(self, run_id: str, edge_ids: list[int]) -> None:
        """Free what the run's edges left on this host."""
        rendezvous = KvRendezvous()
        remove_edges(every_medium(rendezvous), run_id, edge_ids)
        lifeline, self._lifeline = self._lifeline, None
        if lifeline is not None and self.status() is not None:
            with contextlib.suppress(OSError):
                os.close(lifeline)
