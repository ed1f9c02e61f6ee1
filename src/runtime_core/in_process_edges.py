"""Edges inside one process: rings in memory, keyed by ``(run_id, edge_id)``. The
consumer's end makes the ring (EDGES_AND_WORKERS.md §3); the producer's end attaches
once it exists. Serves the simulator and in-process tests, as both the stages' and
the orchestrator's transport."""

from __future__ import annotations

from runplan import ProvisionStage, RunPlan
from runplan.plan import EdgePlan, RingSpec
from runplan.record_header import HeaderCheck
from runtime_core.edge_ends import ReceiveEnd, SendEnd
from runtime_core.ring import LocalRing, Ring


class LocalEdges:
    def __init__(self) -> None:
        self.rings: dict[tuple[str, int], Ring] = {}

    def _make(self, run_id: str, edge_id: int, spec: RingSpec) -> Ring:
        key = (run_id, edge_id)
        if key in self.rings:
            raise RuntimeError(f"edge {edge_id} of run {run_id!r} already has its consumer")
        ring = self.rings[key] = self.new_ring(edge_id, spec)
        return ring

    def new_ring(self, edge_id: int, spec: RingSpec) -> Ring:
        """The ring of a new edge (a subclass may make its own kind)."""
        return LocalRing(spec)

    # -- stages ----------------------------------------------------------------------
    def open_inbound(self, provision: ProvisionStage) -> ReceiveEnd:
        edge = provision.inbound
        ring = self._make(provision.run_id, edge.edge_id, edge.ring_spec)
        check = HeaderCheck.for_edge(
            provision.run_id, edge.edge_id, edge.object_spec, provision.model.hidden_dim
        )
        return ReceiveEnd(ring, check)

    def open_outbound(self, provision: ProvisionStage) -> SendEnd | None:
        edge = provision.outbound
        ring = self.rings.get((provision.run_id, edge.edge_id))
        if ring is None:
            return None
        return SendEnd(ring, provision.run_id, edge.edge_id, edge.object_spec)

    # -- the orchestrator ------------------------------------------------------------------
    def open_token_out(self, plan: RunPlan) -> ReceiveEnd:
        edge: EdgePlan = plan.token_out
        ring = self._make(plan.run_id, edge.edge_id, edge.ring_spec)
        check = HeaderCheck.for_edge(
            plan.run_id, edge.edge_id, edge.object_spec, plan.model.hidden_dim
        )
        return ReceiveEnd(ring, check)

    def open_token_in(self, plan: RunPlan) -> SendEnd | None:
        edge = plan.token_in
        ring = self.rings.get((plan.run_id, edge.edge_id))
        if ring is None:
            return None
        return SendEnd(ring, plan.run_id, edge.edge_id, edge.object_spec)
