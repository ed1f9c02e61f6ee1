"""The stage machine's checks of what it receives: why a provision, a ``StopRun``, an
object or a ``JoinChain`` is refused (a ``RejectReason`` and a detail), or why an
object is out of order; ``None`` when it is taken."""

from __future__ import annotations

from runplan.fsm.stage_actions import RejectReason
from runplan.fsm.stage_events import ObjectLoaded, Received
from runplan.fsm.stage_machine import _ACTIVE, StageMachine
from runplan.messages import JoinChain, ProvisionStage, StopRun


def _run_problem(m: StageMachine, run_id: str) -> tuple[RejectReason, str] | None:
    """Why ``run_id`` is not this node's active run, or None if it is."""
    if run_id == m.run_id and m.state in _ACTIVE:
        return None
    if run_id in m.stale_runs:
        return RejectReason.STALE_RUN, f"run {run_id!r} has stopped on this node"
    return RejectReason.UNKNOWN_RUN, f"run {run_id!r} was never provisioned on this node"


def _provision_problem(m: StageMachine, e: Received) -> tuple[RejectReason, str] | None:
    msg = e.message
    assert isinstance(msg, ProvisionStage)
    if e.sender != m.orchestrator_node_id:
        return RejectReason.UNAUTHORIZED_SENDER, f"{e.sender!r} is not this node's orchestrator"
    if msg.node_id != m.node_id:
        return RejectReason.WRONG_NODE, f"provision for {msg.node_id!r}, this is {m.node_id!r}"
    if msg.run_id in m.stale_runs:
        return RejectReason.STALE_RUN, f"run {msg.run_id!r} has stopped on this node"
    if m.state in _ACTIVE:
        if msg.run_id == m.run_id:
            return RejectReason.DUPLICATE_PROVISION, f"run {msg.run_id!r} is already active"
        return RejectReason.RUN_ALREADY_ACTIVE, f"run {m.run_id!r} is active"
    if not (
        0 <= msg.stage_index < msg.stage_count
        and 0 <= msg.layer_start < msg.layer_end_exclusive
        and msg.inbound.edge_id != msg.outbound.edge_id
        and (msg.sampling is not None) == msg.is_last
    ):
        return RejectReason.INVALID_PROVISION, "stage index, layer range or edges contradict"
    for end, edge in (("inbound", msg.inbound), ("outbound", msg.outbound)):
        ring = edge.ring_spec
        if min(ring.slot_count, ring.slot_bytes, ring.alignment) < 1:
            # (a ring of no slot once passed here and raised ValueError from a later step)
            return RejectReason.INVALID_PROVISION, (
                f"its {end} ring has {ring.slot_count} slots of {ring.slot_bytes} bytes, "
                f"aligned to {ring.alignment}: each must be at least 1"
            )
    return None


def join_problem(
    node_id: str,
    orchestrator_node_id: str,
    sender: str,
    join: JoinChain,
    place: tuple[int, int] | None,
) -> tuple[RejectReason, str] | None:
    """Why a stage (``node_id``, serving the chain's stage ``place``: its index and the
    chain's stage count, ``None`` before any provision said it) refuses ``join``, or
    ``None`` if it takes it. A join is about the stage, not a run, so no run machine
    takes it (``UNEXPECTED_MESSAGE`` there): the stage's controller checks it here."""
    if sender != orchestrator_node_id:
        return RejectReason.UNAUTHORIZED_SENDER, f"{sender!r} is not this node's orchestrator"
    if join.node_id != node_id:
        return RejectReason.WRONG_NODE, f"a join for {join.node_id!r}, this is {node_id!r}"
    if not 0 <= join.stage_index < join.stage_count:
        return RejectReason.INVALID_JOIN, (
            f"stage {join.stage_index} of {join.stage_count} is no stage of a chain"
        )
    if place is not None and place != (join.stage_index, join.stage_count):
        return RejectReason.INVALID_JOIN, (
            f"a join as stage {join.stage_index} of {join.stage_count}; this stage holds the "
            f"layers of stage {place[0]} of {place[1]} (a stage whose place changes starts anew)"
        )
    return None


def _stop_problem(m: StageMachine, e: Received) -> tuple[RejectReason, str] | None:
    assert isinstance(e.message, StopRun)
    if e.sender != m.orchestrator_node_id:
        return RejectReason.UNAUTHORIZED_SENDER, f"{e.sender!r} is not this node's orchestrator"
    return _run_problem(m, e.message.run_id)


def _object_problem(m: StageMachine, e: ObjectLoaded) -> tuple[RejectReason, str] | None:
    problem = _run_problem(m, e.run_id)
    if problem:
        return problem
    assert m.provision is not None
    if e.edge_id != m.provision.inbound.edge_id:
        return RejectReason.UNKNOWN_EDGE, f"edge {e.edge_id} is not this stage's inbound edge"
    return None


def _order_problem(m: StageMachine, e: ObjectLoaded) -> str | None:
    """Why the object is not the next of the run: its sequence, or (sequence 0) its
    chunk: chunk ``j`` only after chunk ``j - 1``, each of the count chunk 0 gave."""
    if e.sequence != m.next_sequence:
        return f"sequence {e.sequence}, expected {m.next_sequence}"
    if e.sequence > 0:
        return f"sequence {e.sequence} in chunks ({e.chunk_count}): only a prefill is chunked"
    if e.chunk_index == m.next_chunk and (e.chunk_index == 0 or e.chunk_count == m.chunk_count):
        return None
    expected = f"chunk {m.next_chunk}" + (f" of {m.chunk_count}" if m.next_chunk else "")
    return f"sequence {e.sequence} chunk {e.chunk_index} of {e.chunk_count}, expected {expected}"
