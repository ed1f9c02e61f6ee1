"""A stage process's trace and logs of what its controller does
(``stage_loop.StageProcess``, whose base ``StageTraces`` is): the controller's trace
events as log lines and Chrome trace events (``tracing.TraceLog``), each part of a run's
setup timed (the shard a ``bind`` span only when the worker read weights, a
``weights reused`` instant when a later run reuses them), and the trace written when
each run ends, before its ``StageStopped``, and when the stage exits: for the
orchestrator to read, or, once it is gone (``orchestrator_gone``), removed with its
folder, which no one else would remove (a SIGKILLed orchestrator left one per stage in
the temp folder).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runplan.fsm import stage as fsm
from runtime_core.workers.interface import Worker
from runtime_core.workers.kept_weights import KeepsWeights
from runtime_cupy.process.names import run_label
from runtime_cupy.process.tracing import TraceLog, now_us

# The stage process's: its log lines keep their logger.
log = logging.getLogger("runtime_cupy.process.stage_process")


class StageTraces:
    """The trace and logs of a ``StageProcess``, its base: what the process holds is set
    by ``StageProcess.__init__``."""

    worker: Worker
    trace: TraceLog
    trace_file: Path | None
    _setup_at: int
    _bound: bool
    _batch: list[tuple[str, int, int]]

    if TYPE_CHECKING:

        def orchestrator_gone(self) -> bool: ...

    # -- trace and logs --------------------------------------------------------------
    def _on_trace(self, kind: str, fields: dict[str, Any]) -> None:
        if kind == "batch":
            self._batch = list(
                zip(fields["runs"], fields["sequences"], fields["step_rows"], strict=True)
            )
            if log.isEnabledFor(logging.INFO):
                for run_id, sequence, rows in self._batch:
                    label = run_label(run_id)
                    log.info("step %d begins (run %s, %d rows)", sequence, label, rows)
        if kind in ("loaded", "published", "batch"):
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s %s", kind, fields)
            if self.trace.enabled:
                self.trace.instant(kind, **fields)
        elif kind == "state":
            log.info(
                "run %s: %s -> %s (%s)",
                run_label(fields["run_id"]) if fields["run_id"] else "?",
                fields["from"],
                fields["to"],
                fields["event"],
            )
            if self.trace.enabled:
                self.trace.instant(f"state {fields['to']}", event=fields["event"])
        elif kind == "reject":
            sender = fields.get("sender", "")
            # An object off the inbound edge (no sender) of a run that stopped here: one
            # the stage before sent as the run was cancelled or ended, dropped as the
            # protocol says; a person at the chat's terminal need not see it. A control
            # message of a stopped run, or any other refusal, is a warning.
            late = not sender and fields["reason"] == "STALE_RUN"
            log.log(
                logging.INFO if late else logging.WARNING,
                "rejected from %r: %s: %s",
                sender,
                fields["reason"],
                fields.get("detail", ""),
            )
            self.trace.instant("reject", **{k: str(v) for k, v in fields.items()})
        elif kind == "protocol_violation":
            log.warning("protocol violation: %s in %s", fields["kind"], fields["state"])
        elif kind == "setup_done":
            self._setup_part_done(fields["part"])
        elif kind == "chain_fault":
            log.warning("chain fault: %s", fields["reason"])
            self.trace.instant("chain fault", reason=fields["reason"])
        else:
            log.info("%s %s", kind, fields)

    def _setup_part_done(self, part: str) -> None:
        """Time each part of setup; the shard is a ``bind`` span only when the worker
        read weights (the chain's later runs reuse them)."""
        start, self._setup_at = self._setup_at, now_us()
        if part == fsm.SetupPart.SHARD.value:
            worker = self.worker
            if self._bound or (isinstance(worker, KeepsWeights) and worker.weights_reused):
                log.info("weights reused")
                self.trace.instant("weights reused")
            else:
                log.info("bound weights in %.3f s", (self._setup_at - start) / 1e6)
                self.trace.span("bind", start)
            self._bound = True
        elif self.trace.enabled:
            self.trace.span(part.lower(), start)

    def run_ended(self) -> None:
        """A run is over (its StageStopped about to leave): the trace events so far are
        written now, for the orchestrator to read once it hears."""
        self.save_trace()

    def save_trace(self) -> None:
        """Write the trace events since the last save to the trace file, for the
        orchestrator to read, and forget them; once the orchestrator is gone, no one
        will read them: the file and its folder are removed instead."""
        if not self.trace.enabled or self.trace_file is None:
            return
        try:
            if self.orchestrator_gone():
                self.trace.discard(self.trace_file)
            else:
                self.trace.flush(self.trace_file)
        except OSError as exc:
            log.warning("cannot write the run's trace: %s", exc)
