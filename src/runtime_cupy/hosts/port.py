"""Where a stage lives: the port between the launcher and whatever runs stage processes.

A host starts a stage (``start``), hands it its control channel and the stages' secret
(the launcher gets the orchestrator's end of the channel in the handle), tells the
launcher when the stage is gone and how it ended (``StageHandle``), stops it
(``kill``), and frees what a run left on its machines (``cleanup``): everything a
stage or an edge of the run names from ``(run_id, edge_id)``, also what a killed
process made. It also says which nodes share a machine (``same_host``: the launcher
picks each edge's medium from it), provides the rendezvous at which TCP edges find
their consumers, and makes the media of the orchestrator's own token ends.

The launcher, the controllers, the state machines and the workers know nothing of how
a host does any of this: ``hosts.local`` starts OS processes with socket pairs, pipes
and ``CUDA_VISIBLE_DEVICES``; a Ray host would start actors on the nodes its plan
names and rendezvous through Ray's key-value store (``hosts.ray``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from attrs import frozen

from runplan import GgufSource, NodeSpec
from runplan.shards import SliceParts
from runtime_cupy.edges.port import EdgeMedium, Rendezvous
from runtime_cupy.process.control_channel import ControlChannel
from runtime_cupy.process.tracing import Event
from runtime_cupy.slices.fetch import SliceOrigin


@frozen
class StageLaunch:
    """What a host needs to start one stage of a run: who it is, which worker it runs,
    how its two edges move bytes (``"shm"`` or ``"tcp"``), its GPU on its machine
    (``None``: none), how long a stop may take, how long it may be silent (it beats
    four times as often on its control channel). No addresses: the stage finds its
    peers through the host's rendezvous.

    ``warm``: the stage serves one run after another (``run_id`` then names the chain,
    for logs): it keeps its bound weights between runs and ends when its control
    channel closes between runs (``python -m runtime_cupy.process.stage_process --warm``).
    ``encrypt_edges``: its TCP edges encrypt their frames, not only authenticate them
    (``edges.tcp_seal``; shared-memory edges are as they are), and so does its slice's
    transfer (``slices.protocol``: both ends of it must say the same).

    ``source`` and ``parts``: the plan's GGUF source and what of it the stage holds, for
    a host whose stages may lack it (a stage on another machine gets its slice from the
    orchestrator's host); ``slices``: where such a stage gets it, filled in by that host
    (``runtime_cupy.slices``)."""

    run_id: str
    stage_index: int
    stage_count: int
    node_id: str
    orchestrator_id: str
    worker: str
    inbound_medium: str
    outbound_medium: str
    stop_ms: int
    device: int | None = None
    trace: bool = False
    warm: bool = False
    encrypt_edges: bool = False
    heartbeat_ms: int = 5_000  # the orchestrator's bound on the stage's silence
    host_stages: int = 0  # the chain's stages on this stage's machine (0: all of them)
    source: GgufSource | None = None
    parts: SliceParts | None = None
    slices: SliceOrigin | None = None


@frozen
class StageProcessInfo:
    """How a stage ran: its process id on its host, its GPU, how it ended (after
    reaping; negative: the signal that ended it), and its host when that is not this
    machine (``None``: this machine)."""

    stage_index: int
    node_id: str
    pid: int
    device: int | None
    returncode: int | None
    host: str | None = None


class StageHandle(Protocol):
    """The launcher's hold on one started stage."""

    stage_index: int
    node_id: str
    channel: ControlChannel  # the orchestrator's end

    def exited(self) -> bool:
        """Whether the stage is gone (does not wait)."""
        ...

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the stage to be gone; whether it is."""
        ...

    def kill(self) -> None:
        """End the stage now, however it is doing (SIGKILL for a process)."""
        ...

    def exit_reason(self) -> str | None:
        """How the stage ended (``killed by SIGKILL``, ``exited with status 3``), or
        ``None`` while that is not known."""
        ...

    def info(self) -> StageProcessInfo: ...

    def trace_events(self) -> list[Event]:
        """The Chrome trace events the stage wrote since the last call (none if it
        wrote none): once it is gone, or, for a warm stage, once it reported a run's
        ``StageStopped``."""
        ...

    def close(self) -> None:
        """Let go of the handle's resources (channel, lifeline) once the stage is gone."""
        ...


@runtime_checkable
class JoinsChains(Protocol):
    """A handle whose stage can join a new chain (issue 25: its chain was re-placed
    around it; ``runplan.messages.JoinChain``): its host hands the running stage the new
    chain's secret as it handed the first (a local stage: one more line on its standard
    input), never on the wire. The launcher calls it just before it sends the stage
    ``JoinChain`` on its control channel."""

    def hand_secret(self, secret: bytes) -> None:
        """Give the stage ``secret``; ``OSError`` when it cannot be given."""
        ...


@runtime_checkable
class MovesSlices(Protocol):
    """A host that brings its stages their slices of the model over the network
    (``hosts.ray``), from the moment it starts them. The launcher waits for them before
    it provisions the stages, so that no stage's readiness bound runs while its slice
    travels (a stage whose slice did not come tries again as it binds, and reports why
    it cannot)."""

    def wait_for_slices(self, cancelled: Callable[[], bool]) -> None:
        """Return once every started stage's slice is on its host (or failed to come),
        or at once when ``cancelled()`` says so."""
        ...


@runtime_checkable
class KnowsLiveNodes(Protocol):
    """A host that knows which nodes are live now (``hosts.ray``: the cluster's live
    hosts), for a chain re-placed after a loss. A host without it places a chain on the
    nodes it was given, every one taken as live (a lost process starts again where it
    was)."""

    def live_nodes(
        self, known: Sequence[tuple[NodeSpec, int | None]], worker: str
    ) -> tuple[tuple[NodeSpec, int | None], ...]:
        """The nodes a chain of ``worker`` stages may be placed on now, each with its
        GPU (``None``: the CPU); ``known``: the chain's nodes and spares so far."""
        ...


class StageHost(Protocol):
    """Starts stages and cleans up after them."""

    def start(self, launch: StageLaunch, secret: bytes) -> StageHandle:
        """Start one stage with its control channel and ``secret``; raises ``OSError``
        if it cannot be started at all."""
        ...

    def same_host(self, node_a: str, node_b: str) -> bool:
        """Whether two nodes of the plan (stages' or the orchestrator's) share a machine."""
        ...

    def medium(self, name: str, encrypt: bool = False) -> EdgeMedium:
        """The medium ``name`` for the orchestrator's own token ends on this host
        (``encrypt``: a TCP edge's frames encrypted too, not only authenticated)."""
        ...

    def rendezvous(self) -> Rendezvous: ...

    def cleanup(self, run_id: str, edge_ids: Sequence[int]) -> None:
        """Free every resource of the run's edges on every machine of the run."""
        ...
