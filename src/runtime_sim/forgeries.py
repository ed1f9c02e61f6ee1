"""Forged input at a ready stage (PIPELINE_ORCHESTRATION_MVP.md §10), as the fault plan
asks: a stale or unknown run id, a provision from the wrong sender, a rewiring request,
a record on an edge the stage was not given. Each must be rejected with the reason the
spec names and change nothing; ``Simulation.forgeries`` records what happened."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from runplan import ProvisionStage
from runplan.fsm import stage as sfsm
from runplan.messages import RewireEdge, StopReason, StopRun
from runplan.plan import OBJECT_HEADER_BYTES, ObjectKind
from runplan.record_header import HeaderDType, ObjectHeader
from runtime_core.ring import Ring
from runtime_sim.faults import FORGERIES, FaultKind
from runtime_sim.links import ORCHESTRATOR

if TYPE_CHECKING:
    from runtime_sim.driver import Simulation
    from runtime_sim.nodes import StageNode


def forge(sim: Simulation, node: StageNode) -> None:
    """Deliver the plan's forgeries to a stage that just became ready; each must be
    rejected without changing its machine."""
    for fault in sim.faults.faults:
        if fault.stage != node.index or fault.kind not in FORGERIES:
            continue
        c = node.controller
        provision = c.provision
        assert provision is not None
        before = c.machine
        kind = fault.kind
        if kind is FaultKind.FORGED_UNKNOWN_EDGE:
            ok, reason = _forge_record(sim, node, provision)
        else:
            sender, message, expected = _forged_message(sim, kind, node, provision)
            sim.trace.add(sim.clock.now_us, node.node_id, "sim", "forged", kind.value)
            rejects_before = len(sim.trace.of("act", "Reject", node.node_id))
            c.handle(sfsm.Received(sender, message))
            rejects = sim.trace.of("act", "Reject", node.node_id)[rejects_before:]
            reason = rejects[0][4][0] if rejects else "none"
            ok = c.machine == before and reason == expected
        sim.forgeries.append((node.node_id, kind.value, ok, str(reason)))


def _forged_message(
    sim: Simulation, kind: FaultKind, node: StageNode, provision: ProvisionStage
) -> tuple[str, Any, str]:
    if kind is FaultKind.FORGED_STALE_RUN:
        return ORCHESTRATOR, StopRun(sim.previous_run, StopReason.CANCELLED), "STALE_RUN"
    if kind is FaultKind.FORGED_UNKNOWN_RUN:
        return ORCHESTRATOR, StopRun("never-provisioned", StopReason.CANCELLED), "UNKNOWN_RUN"
    peer = sim.stages[node.index - 1].node_id if node.index else "rogue-node"
    if kind is FaultKind.FORGED_WRONG_SENDER:
        return peer, attrs.evolve(provision), "UNAUTHORIZED_SENDER"
    return (
        peer,
        RewireEdge(provision.run_id, provision.outbound.edge_id, peer),
        "REWIRE_FORBIDDEN",
    )


def _forge_record(sim: Simulation, node: StageNode, provision: ProvisionStage) -> tuple[bool, str]:
    """A record on the stage's inbound ring naming an edge it was not given."""
    ring = sim.edges.ring(provision.inbound.edge_id)
    c = node.controller
    if ring is None or ring.closed or ring.published != ring.acquired or ring.holding:
        return True, "ring busy: not forged"
    index = ring.try_reserve()
    if index is None:
        return True, "ring busy: not forged"
    n = ring.published
    spec = provision.inbound.object_spec
    kind = spec.kind
    dtype = HeaderDType.of(spec.dtype_family, spec.dtype_width_bytes)
    rows = 1
    payload = bytes(
        4 if kind is ObjectKind.TOKEN else provision.model.hidden_dim * spec.dtype_width_bytes
    )
    header = ObjectHeader(
        provision.run_id, provision.inbound.edge_id + 1000, 0, kind, dtype, rows, len(payload)
    )
    view = ring.slot(index)
    view[:OBJECT_HEADER_BYTES] = header.pack()
    view[OBJECT_HEADER_BYTES : OBJECT_HEADER_BYTES + len(payload)] = payload
    sim.trace.add(sim.clock.now_us, node.node_id, "sim", "forged", "FORGED_UNKNOWN_EDGE")
    ring.visible_at[n] = sim.clock.now_us
    Ring.publish(ring, index)
    sim.trace.add(
        sim.clock.now_us, "forger", "ring", "publish", provision.inbound.edge_id, n, index, 0
    )
    before = c.machine
    rejects_before = len(sim.trace.of("act", "Reject", node.node_id))
    c.poll_inbound()
    rejects = sim.trace.of("act", "Reject", node.node_id)[rejects_before:]
    reason = rejects[0][4][0] if rejects else "none"
    ok = c.machine == before and reason == "UNKNOWN_EDGE" and c.record is None
    return ok, reason
