"""The orchestrator of a chain (CONCURRENT_RUNS.md): many runs over one chain's links.

Skeleton of the interface (issue 22); the implementation follows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
from attrs import frozen

from runplan import RunPlan
from runplan.fsm import orchestrator as fsm
from runplan.messages import ProvisionStage, StopRun
from runtime_core.links import LinkReceiver, LinkSender

Trace = Callable[[str, dict[str, Any]], None]
#: ``on_token(run_id, sequence, token_id)``: a generated token for the caller.
OnToken = Callable[[str, int, int], None]


class OrchestratorLinks(Protocol):
    """The orchestrator's ends of a chain: token-out (it makes the ring) and token-in
    (``None`` until stage 0's ring exists)."""

    def open_token_out(self, plan: RunPlan) -> LinkReceiver: ...

    def open_token_in(self, plan: RunPlan) -> LinkSender | None: ...


class StageChannels(Protocol):
    def send(self, node_id: str, message: ProvisionStage | StopRun) -> None: ...


class RunTimers(Protocol):
    def start(self, run_id: str, timer: fsm.Timer, ms: int) -> None: ...

    def cancel(self, run_id: str, timer: fsm.Timer) -> None: ...


@frozen
class RunTimerFired:
    run_id: str
    timer: fsm.Timer


class RunRefused(ValueError):
    """A run whose KV cache exceeds a stage's whole budget: it could never run."""


class RunHandle:
    """One run on the chain: its machine, its tokens and logits, its end."""

    run_id: str
    finished: fsm.RunFinished | None
    logits: list[npt.NDArray[np.float32]]


class ChainOrchestrator:
    """Many runs over one chain. It does no waiting of its own."""

    def __init__(
        self,
        channels: StageChannels,
        links: OrchestratorLinks,
        timers: RunTimers,
        trace: Trace | None = None,
    ) -> None:
        raise NotImplementedError

    def add_run(
        self, plan: RunPlan, prompt: Sequence[int], *, on_token: OnToken | None = None
    ) -> RunHandle:
        raise NotImplementedError

    def cancel(self, run_id: str, detail: str = "") -> None:
        raise NotImplementedError

    def handle(self, event: fsm.Received | fsm.StageDied | RunTimerFired) -> None:
        raise NotImplementedError

    @property
    def links_pending(self) -> bool:
        raise NotImplementedError

    def try_open_links(self) -> bool:
        raise NotImplementedError

    @property
    def inject_pending(self) -> bool:
        raise NotImplementedError

    def try_inject(self) -> bool:
        raise NotImplementedError

    @property
    def wants_tokens(self) -> bool:
        raise NotImplementedError

    def poll_tokens(self) -> bool:
        raise NotImplementedError
