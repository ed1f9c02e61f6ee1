"""The stage controller of a chain (CONCURRENT_RUNS.md): many runs on one stage.

Skeleton of the interface (issue 22); the implementation follows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from attrs import frozen

from runplan import ProvisionStage
from runplan.fsm import stage as fsm
from runplan.messages import ProvisionRefused, StageFault, StageReady, StageStopped
from runtime_core.links import LinkReceiver, LinkSender
from runtime_core.worker import Progress, Worker

Trace = Callable[[str, dict[str, Any]], None]


class ChainTransport(Protocol):
    """Makes a stage's two links, once per chain: the inbound link (its consumer, this
    stage, makes the ring) and the outbound link (``None`` until the next stage's ring
    exists)."""

    def open_inbound(self, provision: ProvisionStage) -> LinkReceiver: ...

    def open_outbound(self, provision: ProvisionStage) -> LinkSender | None: ...


class ControlChannel(Protocol):
    def send(self, message: StageReady | StageFault | StageStopped | ProvisionRefused) -> None: ...


class RunTimers(Protocol):
    """Timers per run; the runtime feeds ``RunTimerFired(run_id, timer)`` when one runs
    out."""

    def start(self, run_id: str, timer: fsm.Timer, ms: int) -> None: ...

    def cancel(self, run_id: str, timer: fsm.Timer) -> None: ...


@frozen
class RunTimerFired:
    run_id: str
    timer: fsm.Timer


#: What a runtime feeds ``ChainStageController.handle``.
ChainStageEvent = fsm.Received | fsm.OrchestratorLost | RunTimerFired


class ChainStageController:
    """One stage of a chain: a stage machine per held run, the chain's worker and links,
    the batch scheduler. It does no waiting of its own."""

    def __init__(
        self,
        node_id: str,
        orchestrator_node_id: str,
        worker: Worker,
        transport: ChainTransport,
        control: ControlChannel,
        timers: RunTimers,
        trace: Trace | None = None,
        stopped_runs: frozenset[str] = frozenset(),
    ) -> None:
        raise NotImplementedError

    def handle(self, event: ChainStageEvent) -> None:
        raise NotImplementedError

    @property
    def setup_pending(self) -> bool:
        raise NotImplementedError

    def run_setup(self, progress: Progress | None = None) -> None:
        raise NotImplementedError

    @property
    def links_pending(self) -> bool:
        raise NotImplementedError

    def try_attach_links(self) -> bool:
        raise NotImplementedError

    @property
    def wants_input(self) -> bool:
        raise NotImplementedError

    def poll_inbound(self) -> bool:
        raise NotImplementedError

    @property
    def batch_ready(self) -> bool:
        raise NotImplementedError

    def run_batch(self) -> None:
        raise NotImplementedError

    @property
    def output_pending(self) -> bool:
        raise NotImplementedError

    def try_publish_outputs(self) -> bool:
        raise NotImplementedError

    def output_stuck(self) -> None:
        """The runtime's bound on the outbound wait (``edge_wait_ms``) ran out: a chain
        fault."""
        raise NotImplementedError

    @property
    def release_pending(self) -> bool:
        raise NotImplementedError

    def run_release(self) -> None:
        raise NotImplementedError
