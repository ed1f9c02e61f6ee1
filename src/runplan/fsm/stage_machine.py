"""The stage machine's value: what one run's machine on a stage node holds, and the
states in which it has an active run."""

from __future__ import annotations

from attrs import frozen

from runplan.fsm.stage_actions import Action
from runplan.fsm.stage_events import SetupPart, State
from runplan.messages import FaultReason, ProvisionStage

_ALL_PARTS = frozenset(SetupPart)
_ACTIVE = frozenset({State.PREPARING, State.READY, State.EXECUTING, State.FAULTED, State.STOPPING})


@frozen
class StageMachine:
    state: State
    node_id: str
    orchestrator_node_id: str  # the only sender whose provisioning this node accepts
    provision: ProvisionStage | None = None
    setup: frozenset[SetupPart] = frozenset()
    next_sequence: int = 0
    executing: int | None = None
    stale_runs: frozenset[str] = frozenset()
    fault: FaultReason | None = None
    # The prefill in chunks: the chunk of sequence 0 to load next (while executing: the
    # one running), and the count chunk 0 gave.
    next_chunk: int = 0
    chunk_count: int = 1

    @classmethod
    def new(cls, node_id: str, orchestrator_node_id: str) -> StageMachine:
        return cls(State.UNPROVISIONED, node_id, orchestrator_node_id)

    @property
    def run_id(self) -> str | None:
        return self.provision.run_id if self.provision is not None else None

    def _ident(self) -> tuple[str, int, str]:
        assert self.provision is not None
        return self.provision.run_id, self.provision.stage_index, self.node_id


_Result = tuple[StageMachine, tuple[Action, ...]]
