"""Forged input at a chain's stage, as the fault plan asks, once a run is READY there.

The MVP's forgeries (PIPELINE_ORCHESTRATION_MVP.md §10: a stale or unknown run id, a
provision from the wrong sender, a rewiring request, a record on an edge the run was not
given) must each be rejected with the reason the spec names and change no held run;
``ChainSimulation.forgeries`` records what happened. A record of one run out of its
order (``FORGED_WRONG_SEQUENCE``) is a fault of that run alone: it must end that run and
no other (the checker's isolation rules)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from runplan import ProvisionStage
from runplan.fsm import stage as sfsm
from runplan.messages import RewireEdge, StopReason, StopRun
from runplan.plan import ObjectKind
from runplan.record_header import HeaderDType, ObjectHeader
from runtime_sim.faults import FORGERIES, FaultKind
from runtime_sim.links import ORCHESTRATOR

if TYPE_CHECKING:
    from runtime_sim.chain_driver import ChainSimulation
    from runtime_sim.chain_nodes import ChainStageNode

#: A forged record's sequence: far past any run's tokens.
FORGED_SEQUENCE = 1_000_000


def forge_at_ready(sim: ChainSimulation, node: ChainStageNode, run_id: str) -> None:
    """Deliver the plan's forgeries for stage ``node`` now that ``run_id`` is READY there:
    the MVP's forgeries with the first run to get there, a wrong-sequence record with the
    run the fault names."""
    slot = node.controller.runs.get(run_id)
    if slot is None or slot.provision is None:
        return
    first = not any(n == node.node_id for n, *_ in sim.forgeries)
    for fault in sim.faults.faults:
        if fault.stage != node.index:
            continue
        if fault.kind is FaultKind.FORGED_WRONG_SEQUENCE and sim.run_id(fault.run) == run_id:
            _forge_record(
                sim, node, slot.provision, slot.provision.inbound.edge_id, FORGED_SEQUENCE
            )
        elif fault.kind in FORGERIES and first:
            ok, reason = _forge(sim, node, fault.kind, slot.provision)
            sim.forgeries.append((node.node_id, fault.kind.value, ok, reason))


def _held(node: ChainStageNode) -> dict[str, Any]:
    return {run_id: slot.machine for run_id, slot in node.controller.runs.items()}


def _forge(
    sim: ChainSimulation, node: ChainStageNode, kind: FaultKind, p: ProvisionStage
) -> tuple[bool, str]:
    c = node.controller
    before = _held(node)
    rejects_before = len(sim.trace.of("ctl", "reject", node.node_id))
    sim.trace.add(sim.clock.now_us, node.node_id, "sim", "forged", kind.value)
    if kind is FaultKind.FORGED_UNKNOWN_EDGE:
        ring = sim.links.ring(p.stage_index)
        if ring is None or ring.closed or ring.published != ring.acquired:
            return True, "ring busy: not forged"
        if not _forge_record(sim, node, p, p.inbound.edge_id + 1000, 0):
            return True, "ring busy: not forged"
        c.poll_inbound()
        expected = "UNKNOWN_EDGE"
    else:
        sender, message, expected = _forged_message(sim, kind, node, p)
        c.handle(sfsm.Received(sender, message))
    rejects = sim.trace.of("ctl", "reject", node.node_id)[rejects_before:]
    reason = str(rejects[0][4][0]["reason"]) if rejects else "none"
    return _held(node) == before and reason == expected, reason


def _forged_message(
    sim: ChainSimulation, kind: FaultKind, node: ChainStageNode, p: ProvisionStage
) -> tuple[str, Any, str]:
    if kind is FaultKind.FORGED_STALE_RUN:
        return ORCHESTRATOR, StopRun(sim.previous_run, StopReason.CANCELLED), "STALE_RUN"
    if kind is FaultKind.FORGED_UNKNOWN_RUN:
        return ORCHESTRATOR, StopRun("never-provisioned", StopReason.CANCELLED), "UNKNOWN_RUN"
    peer = sim.stages[node.index - 1].node_id if node.index else "rogue-node"
    if kind is FaultKind.FORGED_WRONG_SENDER:
        return peer, attrs.evolve(p), "UNAUTHORIZED_SENDER"
    return peer, RewireEdge(p.run_id, p.outbound.edge_id, peer), "REWIRE_FORBIDDEN"


def _forge_record(
    sim: ChainSimulation, node: ChainStageNode, p: ProvisionStage, edge_id: int, sequence: int
) -> bool:
    """A record of ``p``'s run on the stage's inbound link, written by no stage."""
    ring = sim.links.ring(p.stage_index)
    if ring is None or ring.closed:
        return False
    spec = p.inbound.object_spec
    kind = spec.kind
    dtype = HeaderDType.of(spec.dtype_family, spec.dtype_width_bytes)
    width = 4 if kind is ObjectKind.TOKEN else p.model.hidden_dim * spec.dtype_width_bytes
    payload = bytes(width)
    header = ObjectHeader(p.run_id, edge_id, sequence, kind, dtype, 1, len(payload))
    return ring.forge(header, payload, "forger")


def forge_stale_provision(sim: ChainSimulation, node: ChainStageNode, stale: ProvisionStage) -> str:
    """A late provision of a stale run (a run of a chain before a recovery) reaches a
    stage of the re-placed chain, addressed to it and from its orchestrator: the reason
    the stage rejects it with (``"none"`` when it took it). Traced as ``("sim",
    "forged_stale", (run_id, reason))``."""
    c = node.controller
    rejects_before = len(sim.trace.of("ctl", "reject", node.node_id))
    message = attrs.evolve(stale, node_id=node.node_id)
    c.handle(sfsm.Received(ORCHESTRATOR, message))
    rejects = sim.trace.of("ctl", "reject", node.node_id)[rejects_before:]
    reason = str(rejects[0][4][0]["reason"]) if rejects else "none"
    sim.trace.add(sim.clock.now_us, node.node_id, "sim", "forged_stale", stale.run_id, reason)
    node.wake()
    return reason
