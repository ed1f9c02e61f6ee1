"""A run's setup on a chain's stage (``chain_stage.ChainStageController``, whose base
``StageSetup`` is; CONCURRENT_RUNS.md), which the runtime runs when it chooses, each
part reporting back to the run's machine:

- ``run_setup()`` while ``setup_pending``: per new run, the worker configured and bound
  for the chain (at once when it already is), the run's KV cache reserved
  (``open_run``; no room is ``CacheUnavailable``: the stage answers
  ``ProvisionRefused`` and keeps nothing of the run), the inbound link opened (once per
  chain); ``try_attach_links()`` while ``links_pending``, until the next stage's ring
  exists. A run's INBOUND / OUTBOUND parts are done when it is attached to the links.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from runplan import ProvisionStage
from runplan.fsm import stage as fsm
from runplan.messages import FaultReason
from runplan.resource_limits import error_with_limit
from runtime_core.batching import BatchScheduler
from runtime_core.controller_trace import Trace, no_trace
from runtime_core.links import LinkReceiver, LinkSender
from runtime_core.workers.interface import KvCacheUnavailable, Progress, Worker
from runtime_core.workers.worker_runs import same_stage

if TYPE_CHECKING:
    from runtime_core.chain_stage import ChainTransport, RunSlot

_PREPARING = fsm.State.PREPARING


class StageSetup:
    """The setup of a ``ChainStageController``'s runs, its base: what the controller
    holds is set by ``ChainStageController.__init__``."""

    worker: Worker
    transport: ChainTransport
    trace: Trace
    runs: dict[str, RunSlot]
    chain: ProvisionStage | None
    _bound: bool
    scheduler: BatchScheduler | None
    inbound: LinkReceiver | None
    outbound: LinkSender | None
    broken: FaultReason | None

    if TYPE_CHECKING:

        def _feed(self, slot: RunSlot, event: fsm.Event, held: bool = True) -> None: ...

    # -- state the runtime reads -------------------------------------------------------
    @property
    def setup_pending(self) -> bool:
        return any(s.needs_setup for s in self.runs.values())

    @property
    def links_pending(self) -> bool:
        return self.outbound is None and any(
            s.needs_outbound and not s.needs_setup for s in self.runs.values()
        )

    # -- setup ------------------------------------------------------------------------------
    def run_setup(self, progress: Progress | None = None) -> None:
        """Set up every run waiting for it, in the order they were provisioned."""
        for slot in [s for s in self.runs.values() if s.needs_setup]:
            slot.needs_setup = False
            self._setup(slot, progress)

    def _setup(self, slot: RunSlot, progress: Progress | None) -> None:
        p = slot.provision
        assert p is not None
        parts: tuple[tuple[fsm.SetupPart, Callable[[], None]], ...] = (
            (fsm.SetupPart.WORKER, lambda: self._configure(p)),
            (fsm.SetupPart.SHARD, lambda: self._bind_and_open(p, progress)),
            (fsm.SetupPart.INBOUND, lambda: self._open_inbound(p)),
        )
        for part, work in parts:
            if slot.machine.state is not _PREPARING:
                return
            try:
                work()
            except KvCacheUnavailable as exc:
                self._feed(
                    slot, fsm.CacheUnavailable(exc.needed_bytes, exc.free_bytes, exc.budget_bytes)
                )
                return
            except Exception as exc:  # any failure of setup is the run's fault to report
                self._feed(slot, fsm.SetupFailed(part, error_with_limit(exc)))
                return
            if self.trace is not no_trace:
                self.trace("setup_done", {"run_id": p.run_id, "part": part.value})
            self._feed(slot, fsm.SetupDone(part))
        if slot.machine.state is _PREPARING and self.outbound is not None:
            slot.needs_outbound = False
            self._feed(slot, fsm.SetupDone(fsm.SetupPart.OUTBOUND))

    def _configure(self, p: ProvisionStage) -> None:
        if self.broken is not None:
            raise RuntimeError(f"the chain is broken: {self.broken}")
        if self.chain is not None and same_stage(self.chain, p):
            return
        self.worker.configure(p)  # other stage facts: no run is held (_chain_problem)
        self.chain = p
        self._bound = False
        self.scheduler = BatchScheduler(p.max_batch_rows)

    def _bind_and_open(self, p: ProvisionStage, progress: Progress | None) -> None:
        if not self._bound:
            self.worker.bind(p.gguf_source, progress)
            self._bound = True
        self.worker.open_run(p)  # KvCacheUnavailable: no room in the budget now

    def _open_inbound(self, p: ProvisionStage) -> None:
        if self.inbound is None:
            self.inbound = self.transport.open_inbound(p)

    def try_attach_links(self) -> bool:
        """Attach the outbound link once the next stage's ring exists; every run waiting
        for it is then attached."""
        waiting = [s for s in self.runs.values() if s.needs_outbound and not s.needs_setup]
        if not waiting:
            return False
        if self.outbound is None:
            chain = self.chain or waiting[0].provision
            assert chain is not None
            try:
                end = self.transport.open_outbound(chain)
            except Exception as exc:
                for slot in waiting:
                    slot.needs_outbound = False
                    detail = error_with_limit(exc)
                    self._feed(slot, fsm.SetupFailed(fsm.SetupPart.OUTBOUND, detail))
                return False
            if end is None:
                return False
            self.outbound = end
        for slot in waiting:
            slot.needs_outbound = False
            if slot.machine.state is _PREPARING:
                self._feed(slot, fsm.SetupDone(fsm.SetupPart.OUTBOUND))
        return True
