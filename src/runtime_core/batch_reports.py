"""The batches a chain's stages report (CONCURRENT_RUNS.md §3; ``/metrics``'
``gguf_pipeline_batch_rows``), added up by the chain's orchestrator
(``chain_orchestrator.ChainOrchestrator``), each report once.

A stage counts its batches by rows and reports those run since its previous report in
its next ``StageStopped``, whichever run's stop that is (``chain_stage``); a report it
sent is never sent again. So the orchestrator adds every report that one of a run's
stages sends, once:

- a stop of a held run, when the run's machine takes it (``add``: its sender that
  stage's node, not a copy of a stop already taken);
- a stop that comes after its run ended (``late``): the run's stop bound ran out while
  that stage was still releasing it (a slow stage), and the run ended without it. The
  stages a run still waited for when it ended are kept (``awaiting``), for the last
  ``kept`` runs ended so, and each one's late stop is added once, from that stage's
  node. Such a stop was rejected and its batches lost: the stage had reported them.

``counts`` (stage index -> rows -> batches) is replaced, never changed in place:
another thread may read it whole at any time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

from runplan.messages import StageStopped
from runtime_core.recent_runs import RECENT_RUNS_KEPT


class BatchReports:
    """The batches each stage of a chain reported, by rows; the stages each of the last
    ``kept`` runs that ended without every stop still owe."""

    def __init__(self, kept: int = RECENT_RUNS_KEPT) -> None:
        if kept < 1:
            raise ValueError(f"runs kept {kept} is not at least 1")
        self.kept = kept
        self.counts: dict[int, dict[int, int]] = {}
        self._owed: OrderedDict[str, dict[int, str]] = OrderedDict()

    def add(self, message: StageStopped) -> str | None:
        """Add the batches of a stop already checked as its run's; why not (``None``:
        added): rows or counts below 1."""
        bad = [c for c in message.batches if c.rows < 1 or c.batches < 1]
        if bad:
            return f"batch counts below 1: {bad}"
        counts = dict(self.counts.get(message.stage_index, {}))
        for c in message.batches:
            counts[c.rows] = counts.get(c.rows, 0) + c.batches
        self.counts = {**self.counts, message.stage_index: counts}
        return None

    def awaiting(self, run_id: str, stages: Mapping[int, str]) -> None:
        """Run ``run_id`` ended while these of its stages (index -> node id) had not
        stopped it: each one's stop may still come."""
        if not stages:
            return
        self._owed[run_id] = dict(stages)
        self._owed.move_to_end(run_id)
        while len(self._owed) > self.kept:
            self._owed.popitem(last=False)

    def late(self, sender: str, message: StageStopped) -> str | None:
        """A stop of a run that has ended: its batches added if one of the stages the run
        still waited for sent it, once (``None``: added); else why not."""
        owed = self._owed.get(message.run_id)
        if owed is None:
            return "a finished run's stop it did not wait for"
        node = owed.get(message.stage_index)
        if node is None:
            return f"stage {message.stage_index} stopped this run already, or never ran it"
        if message.node_id != node or sender != node:
            return (
                f"stage {message.stage_index} runs on {node!r}, "
                f"not {message.node_id!r} / {sender!r}"
            )
        problem = self.add(message)
        if problem is None:
            del owed[message.stage_index]
            if not owed:
                del self._owed[message.run_id]
        return problem
