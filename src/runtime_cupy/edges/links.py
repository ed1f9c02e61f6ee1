"""A chain's links between processes (CONCURRENT_RUNS.md §1-§2): one ring per hop,
made once when the chain's stages come up, carrying the records of every run.

Hop ``i`` feeds stage ``i`` (hop 0 is token-in, from the orchestrator); hop
``stage_count`` is token-out (to the orchestrator). Each hop moves its bytes through
one medium (``edges.port.EdgeMedium``: a shared-memory ring on one host, a TCP stream
into the consumer's ring between hosts), named from ``(chain_id, hop)`` exactly as a
run's edge is named from ``(run_id, edge_id)``: the chain id (``keys.chain_id``, 128
bits) is as hard to guess as a run id, every resource is made exclusively by its
consumer, and whoever tears the chain down frees all of it by name
(``StageHost.cleanup(chain_id, hops)``), also what a killed process made. A TCP hop
keeps the edges' authenticated (optionally encrypted) record framing with its key
derived from the chain and the hop (``keys.edge_key``), and its counters per link
direction, so a replayed, reordered or injected frame is that link's fault; its
consumer's credit is the ring's free slots (backpressure).

A process lists the hop it makes in its chain's entry of this host's registry of live
chains (``live_chains``), and holds the entry, before it makes the hop's names, until
it lets go of its links (``detach``): a chain all of whose processes on the host were
killed at once leaves its names to the next process that makes a hop here, which frees
them.

``ProcessLinks`` is both ``runtime_core.chain_stage.ChainTransport`` (a stage: its
inbound hop, whose ring it makes, and its outbound hop) and
``runtime_core.token_links.OrchestratorLinks`` (the orchestrator: token-out,
whose ring it makes, and token-in). Every run of a chain has the same stage facts, so
the plan's ring of an edge is the ring of its hop for every run, made by the first run
that needs it; token-out's ring holds a token, or a token and its logits, as the
chain's runs ask (the chain runner refuses a run that asks otherwise than the chain's
ring holds: ``chain_runner.ChainRunner.submit``).
"""

from __future__ import annotations

from collections.abc import Iterable

from runplan import ProvisionStage, RunPlan
from runplan.plan import ObjectKind, RingSpec
from runtime_core.links import LinkReceiver, LinkSender
from runtime_cupy.edges.live_chains import LiveChain
from runtime_cupy.edges.port import EdgeMedium, ProcessRing
from runtime_cupy.edges.shm import remove_edge, segment_name
from runtime_cupy.process.keys import edge_key
from runtime_cupy.process.names import edge_dir
from runtime_cupy.process.poller import Entry


def chain_hops(stage_count: int) -> tuple[int, ...]:
    """Every hop of a chain of ``stage_count`` stages (what its cleanup frees)."""
    return tuple(range(stage_count + 1))


class ProcessLinks:
    """The link ends of one process of chain ``chain_id``: the hop it consumes through
    ``inbound`` (a stage's inbound hop, the orchestrator's token-out) and the hop it
    produces to through ``outbound``; ``secret`` is the chain's, from which each hop's
    key is derived."""

    def __init__(
        self, inbound: EdgeMedium, outbound: EdgeMedium, secret: bytes, chain_id: str
    ) -> None:
        self.inbound_medium = inbound
        self.outbound_medium = outbound
        self.chain_id = chain_id
        self._secret = secret
        self._receive: ProcessRing | None = None
        self._send: ProcessRing | None = None
        self.inbound_hop: int | None = None  # the hop this process made (it frees it)
        self.outbound_hop: int | None = None
        self._owners: dict[int, ProcessRing] = {}
        self._entry: LiveChain | None = None  # the chain's, held while it has a hop here

    def _key(self, hop: int) -> bytes:
        return edge_key(self._secret, self.chain_id, hop)

    def _receiver(self, hop: int, spec: RingSpec) -> LinkReceiver:
        if self._receive is not None:
            raise RuntimeError(f"hop {self.inbound_hop} is this process's inbound link already")
        if self._entry is None:  # listed and held before any of its names exists
            names = segment_name(self.chain_id, hop), edge_dir(self.chain_id, hop)
            self._entry = LiveChain.hold(self.chain_id, *names)
        ring = self.inbound_medium.create(self.chain_id, hop, spec, self._key(hop))
        self._receive, self.inbound_hop = ring, hop
        return LinkReceiver(ring)

    def _sender(self, hop: int, spec: RingSpec, kind: ObjectKind) -> LinkSender | None:
        ring = self.outbound_medium.attach(self.chain_id, hop, spec, self._key(hop))
        if ring is None:
            return None
        self._send, self.outbound_hop = ring, hop
        return LinkSender(ring, kind)

    # -- a stage (ChainTransport) -------------------------------------------------------
    def open_inbound(self, provision: ProvisionStage) -> LinkReceiver:
        return self._receiver(provision.stage_index, provision.inbound.ring_spec)

    def open_outbound(self, provision: ProvisionStage) -> LinkSender | None:
        edge = provision.outbound
        return self._sender(provision.stage_index + 1, edge.ring_spec, edge.object_spec.kind)

    # -- the orchestrator (OrchestratorLinks) ----------------------------------------------
    def open_token_out(self, plan: RunPlan) -> LinkReceiver:
        return self._receiver(plan.stage_count, plan.token_out.ring_spec)

    def open_token_in(self, plan: RunPlan) -> LinkSender | None:
        return self._sender(0, plan.token_in.ring_spec, ObjectKind.TOKEN)

    # -- the event loop --------------------------------------------------------------------
    def watch(self, *, want_input: bool, want_space: bool) -> tuple[Entry, ...]:
        """What to wait on for both ends: ``want_input`` while a record is awaited,
        ``want_space`` while an output waits for a free slot."""
        entries: tuple[Entry, ...] = ()
        owners = self._owners
        owners.clear()
        for ring, want in ((self._receive, want_input), (self._send, want_space)):
            if ring is None:
                continue
            mine = ring.watch(want)
            for fd, _ in mine:
                owners[fd] = ring
            entries += mine
        return entries

    def owns(self, fd: int) -> bool:
        return fd in self._owners

    def ready(self, fd: int, events: int) -> None:
        ring = self._owners.get(fd)
        if ring is not None:
            ring.ready(fd, events)

    def detach(self) -> None:
        """Let go of both ends without closing them, and of the chain's entry of the
        registry of live chains (the last process of the chain on this host to let go
        frees what it lists)."""
        rings, self._receive, self._send = (self._receive, self._send), None, None
        self._owners.clear()
        for ring in rings:
            if ring is not None:
                ring.detach()
        self.release_entry()

    def release_entry(self) -> None:
        """Let go of the chain's entry of the registry of live chains alone (idempotent,
        any thread): a stage leaving through its watchdog, its names freed."""
        entry, self._entry = self._entry, None
        if entry is not None:
            entry.release()

    def remove_inbound(self) -> None:
        """Free the resources of the hop this process made (idempotent, any thread)."""
        if self.inbound_hop is not None:
            self.inbound_medium.remove(self.chain_id, self.inbound_hop)

    def remove_hops(self, hops: Iterable[int]) -> None:
        """Free what the outbound medium names of ``hops`` on this host (a last stage
        whose orchestrator is gone frees token-out)."""
        for hop in hops:
            self.outbound_medium.remove(self.chain_id, hop)

    def remove_names(self, hops: Iterable[int]) -> None:
        """Free what this host holds of ``hops`` under their names, whatever their
        medium: each hop's segment and folder (a TCP hop's address file is in its
        folder), asking no rendezvous (a cluster's is the orchestrator's host's to
        clear). A stage whose orchestrator is gone frees every hop of the chain so:
        their owners may be gone with it."""
        for hop in hops:
            remove_edge(self.chain_id, hop)
