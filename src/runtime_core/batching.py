"""Which runs' records a stage computes together (CONCURRENT_RUNS.md §3): the batch
policy of ``ChainStageController``, pure.

Each run that can step offers one candidate, its oldest loaded record (the next in its
run's order); a batch takes at most one candidate per run, up to ``max_batch_rows``
rows. The policy:

1. a prefill record *owed* from the previous batch goes first, unless that batch was
   led by an owed record that left decodes out: then the decodes' turn comes first;
2. then decode records (one row each), in the order they were loaded;
3. then prefill records (a chunk or a whole prompt), in load order, each if it fits the
   rows left (the owed one first).

A prefill record left out of a batch is owed to the next (the oldest one left out, or
the owed one still). So within each kind the first loaded is the first served; while
the decodes fit in a batch, a decode waits behind at most one prefill record (a long
prompt, or a queue of prompts whose chunks fill a batch each, never starves decodes: an
owed record that took the decodes' rows gives them the next batch; with more decodes
than a batch holds, the oldest go first and the others wait their turn too); and a
prefill record is never passed over for good (it leads every other batch at least). A
candidate of more than ``max_batch_rows`` rows is never chosen: the stage refuses such
a record before it is a candidate.
"""

from __future__ import annotations

from collections.abc import Sequence

from attrs import frozen


@frozen
class Candidate:
    """A run's next record: its run, when it was loaded (a counter the stage keeps), its
    rows, and whether it is (a chunk of) the prefill."""

    run_id: str
    loaded: int
    rows: int
    prefill: bool


class BatchScheduler:
    """The policy, with the one thing it remembers between batches: the owed prefill."""

    def __init__(self, max_batch_rows: int) -> None:
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows {max_batch_rows} is not at least 1")
        self.max_batch_rows = max_batch_rows
        self.owed: str | None = None  # the run whose prefill record goes first next time
        self.decodes_first = False  # an owed record left decodes out: theirs is the next turn

    def choose(self, candidates: Sequence[Candidate]) -> tuple[Candidate, ...]:
        """The next batch, in the order it was chosen (empty only when there are no
        candidates of at most ``max_batch_rows`` rows)."""
        limit = self.max_batch_rows
        runs = [c.run_id for c in candidates]
        if len(set(runs)) != len(runs):
            raise ValueError(f"one candidate per run, got {sorted(runs)}")
        pool = sorted((c for c in candidates if c.rows <= limit), key=lambda c: c.loaded)
        batch: list[Candidate] = []
        rows = 0
        owed = next((c for c in pool if c.run_id == self.owed and c.prefill), None)
        lead = owed if not self.decodes_first else None
        if lead is not None:
            batch.append(lead)
            rows += lead.rows
        decodes_left = False
        for c in pool:
            if not c.prefill:
                if rows + c.rows <= limit:
                    batch.append(c)
                    rows += c.rows
                else:
                    decodes_left = True
        prefills = [c for c in pool if c.prefill and c is not lead]
        if owed is not None and lead is None:  # the owed record first among the prefills
            prefills.remove(owed)
            prefills.insert(0, owed)
        left: list[Candidate] = []
        for c in prefills:
            if rows + c.rows <= limit:
                batch.append(c)
                rows += c.rows
            else:
                left.append(c)
        self.owed = left[0].run_id if left else None
        self.decodes_first = lead is not None and decodes_left
        return tuple(batch)

    def forget(self, run_id: str) -> None:
        """A run is gone: it is owed nothing."""
        if self.owed == run_id:
            self.owed = None
