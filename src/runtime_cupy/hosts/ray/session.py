"""This process as a driver of a Ray cluster: connecting, and what the cluster says
about its hosts (the query behind the node pool; ``runplan`` stays pure)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from attrs import frozen

from runtime_cupy.hosts.ray.cluster import (
    ClusterError,
    RayHostInfo,
    StageNode,
    cpu_stage_nodes,
    gpu_stage_nodes,
    live_hosts,
)
from runtime_cupy.hosts.ray.stage_handle import _short

log = logging.getLogger("runtime_cupy.hosts.ray")

#: How long connecting to a cluster's head may take before it counts as absent.
PROBE_S = 5.0
#: How long a raylet may take to accept a connection before its node counts as gone.
RAYLET_PROBE_S = 1.0
#: How long a GPU host may take to report its GPUs' memory when a run is first placed
#: (a re-placement after a loss gives it the chain's silence bound instead).
GPU_MEMORY_S = 120.0
#: Why ``--ray-address auto`` found no cluster (``RAY_ADDRESS`` not set), in our flags' terms.
NO_CLUSTER_HERE = (
    "no Ray cluster is running on this machine (--ray-address auto): start one with "
    "`ray start --head`, or give --ray-address HOST:PORT of a running cluster's head"
)


def refuse_own_stage_options(host: object, gpus: object, log_dir: object) -> None:
    """Stages on a cluster take its live hosts and GPUs and log to Ray's worker logs:
    ``ValueError`` for a host, GPUs or a log folder given beside the cluster's address
    (each command, ``generate`` and ``WarmChain``, before it connects: ``--gpus`` was
    dropped without a word by a single run)."""
    if (host, gpus, log_dir) != (None, None, None):
        raise ValueError(
            "the stages on a Ray cluster (--ray-address) take its live hosts and GPUs "
            "and log to Ray's worker logs: give no host, gpus (--gpus) or log_dir "
            "(--log-dir) with it"
        )


def connect(address: str) -> None:
    """Connect this process to the cluster at ``address`` (``auto``: the one this
    machine belongs to; or ``HOST:PORT`` of its head); ``ClusterError`` if there is none."""
    try:
        import ray
    except ImportError:
        raise ClusterError("--ray-address needs Ray: pip install 'gguf-pipeline[ray]'") from None
    if address != "auto":
        _reachable(address)
    if ray.is_initialized():
        return
    try:
        with sigterm_kept():
            ray.init(
                address=address,
                logging_level=logging.WARNING,
                log_to_driver=True,
                namespace="gguf-pipeline",
            )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        found_none = isinstance(exc, ConnectionError) and not os.environ.get("RAY_ADDRESS")
        if address == "auto" and found_none:  # Ray's own text names its CLI's --address
            raise ClusterError(NO_CLUSTER_HERE) from None
        raise ClusterError(f"cannot connect to the Ray cluster at {address!r}: {exc}") from None


@contextlib.contextmanager
def sigterm_kept() -> Iterator[None]:
    """The SIGTERM handler this process had before the block, given back after it
    where it was a Python function or ``SIG_IGN``: ``ray.init`` sets its own
    (``sys.exit``) for the rest of the process, which took SIGTERM from the commands'
    handler (Ctrl-C's ``Cancelled`` object and exit 143: ``runplan.interrupted``), a
    caller's own, or a process that ignored it. A process with the default action (or
    a handler set from C, which Python cannot give back) keeps Ray's."""
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if main and (callable(before) or before == signal.SIG_IGN):
            signal.signal(signal.SIGTERM, before)


@contextlib.contextmanager
def left_at_the_end() -> Iterator[None]:
    """A command that joins a cluster in the ``with`` block leaves it at the block's end
    (``ray.shutdown``: what Ray's driver prints as it goes, such as a dead raylet's
    report, is printed there, not after the command's output); a process connected
    before the block (a caller's) stays connected."""
    ray = sys.modules.get("ray")
    before = ray is not None and ray.is_initialized()
    try:
        yield
    finally:
        ray = sys.modules.get("ray")
        if not before and ray is not None and ray.is_initialized():
            ray.shutdown()


#: The client's first bytes on an HTTP/2 connection (RFC 9113, section 3.4): the preface
#: and an empty SETTINGS frame (length 0, type 4, no flags, stream 0).
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_H2_SETTINGS = 4  # a frame's type, its fourth byte


def _first_frame(conn: socket.socket) -> bytes | None:
    """What the server at the other end of ``conn`` answers to gRPC's HTTP/2 preface: up
    to a frame header's 9 bytes (``TimeoutError`` past the socket's timeout), or ``None``
    where Ray's links use TLS (``RAY_USE_TLS``), whose handshake comes first: not asked."""
    if os.environ.get("RAY_USE_TLS", "0") not in ("", "0"):
        return None
    conn.sendall(_H2_PREFACE)
    frame = b""
    while len(frame) < 9:
        got = conn.recv(9 - len(frame))
        if not got:
            break
        frame += got
    return frame


def _is_settings(frame: bytes) -> bool:
    """Whether ``frame`` begins with the header of an HTTP/2 SETTINGS frame."""
    return len(frame) >= 9 and frame[3] == _H2_SETTINGS


def _reachable(address: str) -> None:
    """Refuse at once an address where no Ray head answers (Ray itself retries for
    minutes): where nothing listens, or where what listens does not speak gRPC, as a
    head's GCS does. A gRPC server answers a client's HTTP/2 preface with its SETTINGS
    frame; a server of another protocol (an HTTP/1 server, a raylet's other port, a
    silent listener) sends something else or nothing within ``PROBE_S``. Not probed where
    Ray's links use TLS (``RAY_USE_TLS``), whose handshake comes first."""
    host, sep, port = address.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not host:
        raise ClusterError(f"bad Ray address {address!r}: write auto or HOST:PORT")
    if not 1 <= int(port) <= 65535:  # the socket took 99999 as port 99999 mod 65536
        raise ClusterError(f"bad Ray address {address!r}: port {port} is not in 1..65535")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_S) as conn:
            frame = _first_frame(conn)
    except TimeoutError:
        raise ClusterError(
            f"no Ray cluster at {address}: what listens there did not answer as a Ray "
            f"head's GCS does (gRPC) within {PROBE_S:.0f} s"
        ) from None
    except OSError as exc:
        raise ClusterError(f"no Ray cluster at {address}: {exc}") from None
    if frame is not None and not _is_settings(frame):
        raise ClusterError(
            f"no Ray cluster at {address}: what listens there is not a Ray head's GCS (it "
            f"answered {frame[:16]!r} to gRPC's HTTP/2 preface)"
        )


def raylet_answers(address: str, port: int, timeout_s: float = RAYLET_PROBE_S) -> bool:
    """Whether the gRPC server at ``address:port`` (a raylet's, a head's GCS) answers
    within ``timeout_s``: it accepts a connection and answers gRPC's HTTP/2 preface with
    its SETTINGS frame (under TLS: it accepts a connection). A paused process (SIGSTOP)
    does not answer, though its port still takes connections: the kernel accepts them.
    A port not known, 0, is taken as answering."""
    if port <= 0:
        return True
    try:
        with socket.create_connection((address.strip("[]"), port), timeout=timeout_s) as conn:
            frame = _first_frame(conn)
    except OSError:  # TimeoutError too: silent within timeout_s
        return False
    return frame is None or _is_settings(frame)


def head_answers(timeout_s: float = RAYLET_PROBE_S) -> bool:
    """Whether the cluster's head (its GCS) answers within ``timeout_s``
    (``raylet_answers``): with the head gone every call of Ray's through it (its
    key-value store, ending an actor) blocks until Ray ends this process, 60 s later."""
    import ray

    host, _, port = str(ray.get_runtime_context().gcs_address).rpartition(":")
    return raylet_answers(host, int(port), timeout_s) if port.isdigit() else True


def hosts() -> tuple[RayHostInfo, ...]:
    """The cluster's live hosts, in label order: the nodes Ray calls alive whose raylet
    answers now (asked all at once, each within ``RAYLET_PROBE_S``)."""
    import ray

    nodes = ray.nodes()
    there = {
        (str(n["NodeManagerAddress"]), int(n.get("NodeManagerPort", 0)))
        for n in nodes
        if n.get("Alive")
    }
    with ThreadPoolExecutor(max_workers=max(1, min(32, len(there)))) as pool:
        answering = dict(zip(there, pool.map(lambda at: raylet_answers(*at), there), strict=True))
    return live_hosts(nodes, answers=lambda address, port: answering.get((address, port), False))


def orchestrator_address() -> str:
    """The address of the machine this driver runs on, as the cluster knows it."""
    import ray

    mine = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == mine:
            return str(node["NodeManagerAddress"])
    return str(ray.util.get_node_ip_address())


def _gpu_memory_there() -> dict[int, int]:
    from runtime_cupy.hosts.this_machine import gpu_memory_bytes

    return gpu_memory_bytes()


@frozen
class GpuMemory:
    """What the GPU hosts asked said of their GPUs' memory: ``of[ray_node_id][index]``,
    bytes, of each host that answered; ``silent``: each host that did not (not within
    the bound, or its task failed) and why."""

    of: dict[str, dict[int, int]]
    silent: dict[str, str]  # ray node id -> why it counts as lost (naming its host)


def gpu_memory(of: tuple[RayHostInfo, ...], within_s: float) -> GpuMemory:
    """Each GPU host's GPUs' memory, as ``nvidia-smi`` on that host reports it, asked all
    at once (a Ray task on each, ``_gpu_memory_there``); a host that does not answer
    within ``within_s`` (paused, cut off: its raylet's port still takes connections) or
    whose task failed is ``silent``, and its task is cancelled."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task: Any = ray.remote(_gpu_memory_there)
    gpu_hosts = [h for h in of if h.gpus]
    refs = [
        task.options(
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(h.ray_node_id, soft=False),
        ).remote()
        for h in gpu_hosts
    ]
    ready: list[Any] = []
    if refs:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, within_s))
    answered = {id(r) for r in ready}
    memory: dict[str, dict[int, int]] = {}
    silent: dict[str, str] = {}
    for host, ref in zip(gpu_hosts, refs, strict=True):
        if id(ref) not in answered:
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=True)
            silent[host.ray_node_id] = (
                f"host {host.label} did not report its GPUs' memory within {within_s:g} s"
            )
            continue
        try:
            memory[host.ray_node_id] = dict(ray.get(ref))
        except Exception as exc:  # its worker or its node died
            why = _short(exc)
            silent[host.ray_node_id] = f"host {host.label} could not report its GPUs' memory: {why}"
    for why in silent.values():
        log.warning("%s: taken as lost for this placement", why)
    return GpuMemory(memory, silent)


def stage_nodes(worker: str, stages: int, within_s: float = GPU_MEMORY_S) -> tuple[StageNode, ...]:
    """Where the ``stages`` stages of ``worker`` go in the live cluster (a GPU host that
    does not report its GPUs' memory within ``within_s`` is passed over)."""
    if stages < 1:
        raise ClusterError(f"a run has at least one stage, not {stages}")
    live = hosts()
    if worker != "cuda":
        return cpu_stage_nodes(live, stages)
    memory = gpu_memory(live, within_s)
    answering = tuple(h for h in live if h.ray_node_id not in memory.silent)
    if memory.silent and not any(h.gpus for h in answering):
        raise ClusterError(
            "the CUDA worker needs GPUs; no live node of the cluster that has one answered: "
            + "; ".join(memory.silent.values())
        )
    return gpu_stage_nodes(answering, stages, memory.of)
