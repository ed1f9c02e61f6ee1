"""The Ray host: every stage of a run is a process on the node its plan names, started
and watched by a Ray actor there (``supervisor.StageSupervisor``); the orchestrator
runs in this process, a driver of the cluster.

- **Placement**: each supervisor is pinned to its node's Ray node
  (``NodeAffinitySchedulingStrategy``, not soft). It asks Ray for no CPU or GPU: the
  planner has already sized the stages against the memory Ray reports, and a CUDA
  stage sees the GPU its plan names (``CUDA_VISIBLE_DEVICES``), as on one host.
  ``prepare`` creates every stage's actor at once, so that their start-up overlaps.
- **Control**: a TCP connection per stage, from its supervisor to this process
  (``control_link``: authenticated, keepalive), then ``ControlChannel``'s frames.
- **Gone**: the stage's control connection closes when its process ends (however it
  ends); its supervisor's ``supervise`` call returns the exit status, or fails when Ray
  finds the actor or its node dead. ``exited`` and ``wait`` look at that call's result,
  nothing else; ``exit_reason`` asks Ray once more, briefly, when it is not in
  (``stage_handle``).
- **Edges**: shared memory between nodes of one machine (one address), TCP between
  machines; consumers listen on their host's address and publish it in Ray's key-value
  store under ``(run_id, edge_id)`` (``rendezvous``).
- **Cleanup**: every supervisor still there frees what the run left on its host; this
  process frees its own machine's and every address of the run; then the actors of the
  run's stages are killed, and the control port closes once no supervisor is left.
- **Slices**: a stage on another machine than the orchestrator's gets its slice of the
  model from this process (``slices``: a slice server on the orchestrator's address,
  started with the first such stage and closed with the control port), unless its host
  has it already: in its cache, or a file at the plan's path that holds what the plan's
  source holds. Its supervisor fetches it while the stage process starts
  (``prefetch``); the launcher waits for that before provisioning (``wait_for_slices``),
  and the stage's bind then finds it in the cache (or tries again, and reports why not).
- **Warm stages** (``StageLaunch(warm=True)``, ``serve.chain.WarmChain``): what is the
  chain's lives as long as its stage process: the supervisor and its stage process,
  their control connection, and this process's control port (while any warm stage is
  there). The chain's links are freed at the chain's cleanup (``cleanup(chain_id,
  hops)``, as a cold run's edges at its own): their segments and folders on every host,
  and their addresses in the store (keyed by the chain's id). A warm stage's handle,
  closed once its stage is gone (the chain closed its channel, or retired a broken
  stage), kills that stage's supervisor; the stage started again in its place gets a
  new one, on the node its plan names.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from runplan import NodeSpec
from runplan.config import Timeouts
from runtime_cupy.edges.media import every_medium, open_medium
from runtime_cupy.edges.port import EdgeMedium, remove_edges
from runtime_cupy.hosts.port import StageLaunch
from runtime_cupy.hosts.ray.cluster import StageNode, gpu_stage_nodes
from runtime_cupy.hosts.ray.control_link import ControlLinkError, ControlListener
from runtime_cupy.hosts.ray.liveness import HeadProbe, RayletWatch
from runtime_cupy.hosts.ray.rendezvous import KvRendezvous
from runtime_cupy.hosts.ray.stage_handle import RayStageHandle, UnstartedStage, _short
from runtime_cupy.hosts.ray.supervisor import StageSupervisor
from runtime_cupy.process.control_channel import ControlChannel
from runtime_cupy.process.keys import control_key, slice_key
from runtime_cupy.slices.cache import SliceCache
from runtime_cupy.slices.digests import DigestStore
from runtime_cupy.slices.fetch import SliceOrigin
from runtime_cupy.slices.server import SliceServer, StageTransfer

log = logging.getLogger("runtime_cupy.hosts.ray")

#: How long a stage may take to be placed and connect its control channel.
START_TIMEOUT_S = 120.0
#: How long cleanup waits for the supervisors.
CLEANUP_S = 10.0


def _raylet_answers(address: str, port: int) -> bool:
    """``session.raylet_answers`` (looked up at each ask: the tests put a fake there).
    Ray says a node died only once its health checks fail; a stage's start on a node
    whose raylet died would wait out ``start_timeout_s`` meanwhile."""
    from runtime_cupy.hosts.ray import session

    return session.raylet_answers(address, port)


def _head_answers() -> bool:
    """``session.head_answers`` (looked up at each ask: the tests put a fake there)."""
    from runtime_cupy.hosts.ray import session

    return session.head_answers()


class _NoStore:
    """The rendezvous once the cluster's head is gone (its key-value store with it):
    nothing to look up or withdraw."""

    def publish(self, run_id: str, edge_id: int, address: str) -> None:
        raise OSError("the Ray cluster's head is gone: nothing can be published")

    def lookup(self, run_id: str, edge_id: int) -> str | None:
        return None

    def withdraw(self, run_id: str, edge_id: int) -> None:
        return None


class RayHost:
    """Stages on the nodes of a Ray cluster (``nodes``: where each node id of the plan
    is, from ``cluster``); this process (a driver connected to the cluster) runs the
    orchestrator on the machine at ``orchestrator_address``."""

    def __init__(
        self,
        nodes: Sequence[StageNode],
        orchestrator_address: str,
        *,
        log_level: str = "WARNING",
        start_timeout_s: float = START_TIMEOUT_S,
        silence_s: float = Timeouts().heartbeat_ms / 1000,
    ) -> None:
        self.nodes = {n.node_id: n for n in nodes}
        #: How long a host may be silent before a re-placement counts it lost (the
        #: chain's bound on a stage's silence, ``Timeouts.heartbeat_ms``): a GPU host
        #: that does not report its GPUs' memory within it is placed around.
        self.silence_s = silence_s
        self.orchestrator_address = orchestrator_address
        self.log_level = log_level
        self.start_timeout_s = start_timeout_s
        self._actors: dict[str, Any] = {}
        self._warm: set[str] = set()  # nodes whose supervisor outlives a run's cleanup
        self._listener: ControlListener | None = None
        self._rendezvous = KvRendezvous()
        self._slices: SliceServer | None = None
        self._slices_done: tuple[StageTransfer, ...] = ()  # of the server last closed
        self._prefetching: dict[int, Any] = {}  # stage index -> its supervisor's prefetch
        #: Called (on the slice server's threads) as each stage's slice moves.
        self.on_slice_change: Callable[[StageTransfer], None] | None = None
        # Whether the cluster's head answers: asked once for a chain's releases and cleanup.
        self._head = HeadProbe(_head_answers)

    # -- actors --------------------------------------------------------------------------
    def _actor(self, node: StageNode) -> Any:
        actor = self._actors.get(node.node_id)
        if actor is None:
            import ray
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            where = NodeAffinitySchedulingStrategy(node.host.ray_node_id, soft=False)
            actor = (
                ray.remote(StageSupervisor)
                .options(
                    num_cpus=0,
                    max_concurrency=8,
                    max_restarts=0,
                    scheduling_strategy=where,
                    # Ray kills the children of a worker that exits; the stage process
                    # must outlive its supervisor long enough to stop on its own and
                    # free what it owns (its lifeline closes when the supervisor goes).
                    runtime_env={"env_vars": {"RAY_kill_child_processes_on_worker_exit": "0"}},
                )
                .remote()
            )
            self._actors[node.node_id] = actor
        return actor

    def prepare(self, node_ids: Iterable[str]) -> None:
        """Create the supervisors of these nodes now (their start-ups overlap)."""
        for node_id in node_ids:
            self._actor(self._node(node_id))

    def _node(self, node_id: str) -> StageNode:
        node = self.nodes.get(node_id)
        if node is None:
            raise ValueError(f"node {node_id!r} is not a node of this cluster's pool")
        return node

    def machine(self, node_id: str) -> str:
        """The machine (address) of a node; the orchestrator's for a node not a stage's."""
        node = self.nodes.get(node_id)
        return node.host.address if node is not None else self.orchestrator_address

    def live_nodes(
        self, known: Sequence[tuple[NodeSpec, int | None]], worker: str
    ) -> tuple[tuple[NodeSpec, int | None], ...]:
        """The ``known`` nodes whose host is live, then one node per live host of the
        cluster (per GPU for the CUDA worker) as the stages were placed
        (``session.stage_nodes``), each now a node this host can start a stage on. For
        the CUDA worker a host is live once it reported its GPUs' memory within
        ``silence_s`` (``session.gpu_memory``): a paused host, whose raylet's port
        still takes connections, is placed around as a lost one is."""
        from runtime_cupy.hosts.ray import session

        live = session.hosts()
        if worker == "cuda":
            memory = session.gpu_memory(live, self.silence_s)
            live = tuple(h for h in live if h.ray_node_id not in memory.silent)
            slots = sum(h.gpus for h in live)
            found = gpu_stage_nodes(live, slots, memory.of) if slots else ()
        else:
            found = session.stage_nodes(worker, len(live)) if live else ()
        up = {h.ray_node_id for h in live}
        out = [
            (spec, device)
            for spec, device in known
            if spec.node_id in self.nodes and self.nodes[spec.node_id].host.ray_node_id in up
        ]
        # (Ray node, GPU) of each node offered: one under two labels is offered once
        offered = {(self.nodes[spec.node_id].host.ray_node_id, device) for spec, device in out}
        for node in found:
            if node.node_id in {spec.node_id for spec, _ in out}:
                continue
            if (node.host.ray_node_id, node.device) in offered:
                continue
            # A label moves when a node joins below it (labels follow the raylets' ports):
            # one whose first node lives on stays that node's; one whose first node is
            # gone names the live node it names now.
            saved = self.nodes.get(node.node_id)
            moved = saved is not None and saved.host.ray_node_id != node.host.ray_node_id
            if moved and saved is not None and saved.host.ray_node_id in up:
                continue
            self.nodes[node.node_id] = node
            offered.add((node.host.ray_node_id, node.device))
            out.append((node.spec, node.device))
        return tuple(out)

    # -- the port ------------------------------------------------------------------------
    def start(self, launch: StageLaunch, secret: bytes) -> RayStageHandle | UnstartedStage:
        import ray

        node = self._node(launch.node_id)
        actor = self._actor(node)
        if self._listener is None:
            self._listener = ControlListener(self.orchestrator_address)
        listener = self._listener
        if launch.source is not None and node.host.address != self.orchestrator_address:
            launch = self._with_slices(launch, secret, node)
        began = time.monotonic()
        started = actor.start.remote(
            launch, secret, listener.address, node.host.address, self.log_level
        )
        if launch.slices is not None:  # the slice travels while the stage starts
            self._prefetching[launch.stage_index] = actor.prefetch.remote(launch, secret)

        raylet = RayletWatch(node.host.address, node.host.manager_port, _raylet_answers)

        def gone() -> str | None:
            ready, _ = ray.wait([started], timeout=0)
            if not ready:
                return raylet.gone()
            try:
                ray.get(started)
            except Exception as exc:
                return _short(exc)
            return None  # started: its connection is already in the listener's backlog

        key = control_key(secret, launch.node_id)
        try:
            sock = listener.accept(launch.stage_index, key, self.start_timeout_s, gone)
            pid = int(ray.get(started, timeout=self.start_timeout_s))
        except (ControlLinkError, ray.exceptions.RayError, OSError) as exc:
            why = f"could not be started on host {node.host.label}: {_short(exc)}"
            log.warning("stage %d (%s) %s", launch.stage_index, launch.node_id, why)
            return UnstartedStage(launch, node, why)
        log.info(
            "stage %d (%s) started on host %s in %.1f s: pid %d",
            launch.stage_index, launch.node_id, node.host.label, time.monotonic() - began, pid,
        )  # fmt: skip
        channel = ControlChannel(sock, key, launch.orchestrator_id, launch.node_id)
        release = None
        if launch.warm:
            self._warm.add(launch.node_id)

            def release() -> None:
                self._release(launch.node_id, actor)

        done = actor.supervise.remote()
        return RayStageHandle(launch, node, actor, pid, done, channel, release)

    # -- slices -------------------------------------------------------------------------
    def _with_slices(self, launch: StageLaunch, secret: bytes, node: StageNode) -> StageLaunch:
        """``launch`` with where its stage gets its slice: this process's slice server."""
        assert launch.source is not None
        if self._slices is None:
            digests = DigestStore(SliceCache().digests)
            self._slices = SliceServer(self.orchestrator_address, digests)
            self._slices.on_change = self._slice_changed
        key = self._slices.offer(launch.source)
        self._slices.expect(
            launch.stage_index,
            launch.node_id,
            slice_key(secret, launch.node_id),
            node.host.label,
            encrypt=launch.encrypt_edges,
            parts=launch.parts,
        )
        return attrs.evolve(launch, slices=SliceOrigin(self._slices.address, key))

    def _slice_changed(self, transfer: StageTransfer) -> None:
        if self.on_slice_change is not None:
            self.on_slice_change(transfer)

    def wait_for_slices(self, cancelled: Callable[[], bool]) -> None:
        """Until the slices of the stages started since the last wait are on their hosts
        (their supervisors fetch them as they start the stages: ``prefetch``)."""
        import ray

        pending, self._prefetching = dict(self._prefetching), {}
        while pending and not cancelled():
            ready, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=0.2)
            for ref in ready:
                index = next(i for i, r in pending.items() if r is ref)
                del pending[index]
                try:
                    done = ray.get(ref)
                except Exception as exc:  # the supervisor or its host is gone
                    done = {"ok": False, "error": _short(exc)}
                if not done.get("ok"):
                    log.warning(
                        "stage %d's slice did not come before provisioning (it tries again "
                        "as it binds): %s", index, done.get("error"),
                    )  # fmt: skip

    def slice_transfers(self) -> tuple[StageTransfer, ...]:
        """What each stage's slice did since the last ``forget_slice_transfers``."""
        return self._slices.transfers() if self._slices is not None else self._slices_done

    def forget_slice_transfers(self) -> None:
        self._slices_done = ()
        if self._slices is not None:
            self._slices.forget_transfers()

    def _release(self, node_id: str, actor: Any) -> None:
        """A warm stage is gone for good: end its supervisor (unless the cluster's head
        is gone: Ray ends it then, and asking would block) and the control port once no
        supervisor is left."""
        import ray

        if self._actors.get(node_id) is actor:
            del self._actors[node_id]
            self._warm.discard(node_id)
        if self._head():
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        self._close_listener()

    def _head_gone(self, run_id: str, edge_ids: Sequence[int]) -> None:
        """Cleanup without the cluster's head: what this host made of the run is freed
        (its shared memory, its edges' folders); the supervisors, which Ray ends with the
        head's loss, and what they made are left to end on their own (each stage process
        stops as its lifeline closes); the rendezvous went with the head."""
        log.warning("the Ray cluster's head does not answer: the stages' supervisors and "
                    "their hosts' cleanup are left to Ray")  # fmt: skip
        remove_edges(every_medium(_NoStore()), run_id, edge_ids)
        self._actors.clear()
        self._warm.clear()
        self._close_listener()

    def _close_listener(self) -> None:
        if self._listener is not None and not self._actors:
            self._listener.close()
            self._listener = None
        if self._slices is not None and not self._actors:
            self._slices_done = self._slices.transfers()
            self._slices.close()
            self._slices = None

    def same_host(self, node_a: str, node_b: str) -> bool:
        return self.machine(node_a) == self.machine(node_b)

    def medium(self, name: str, encrypt: bool = False) -> EdgeMedium:
        return open_medium(name, self._rendezvous, self.orchestrator_address, encrypt)

    def rendezvous(self) -> KvRendezvous:
        return self._rendezvous

    def cleanup(self, run_id: str, edge_ids: Sequence[int]) -> None:
        import ray

        ids = list(edge_ids)
        if not self._head():
            self._head_gone(run_id, ids)
            return
        actors = list(self._actors.values())
        refs = [actor.cleanup.remote(run_id, ids) for actor in actors]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=CLEANUP_S)
        remove_edges(every_medium(self._rendezvous), run_id, ids)
        with contextlib.suppress(Exception):
            self._rendezvous.withdraw_run(run_id)
        for node_id, actor in list(self._actors.items()):
            if node_id not in self._warm:  # a cold run's stages are done with
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
                del self._actors[node_id]
        self._close_listener()
