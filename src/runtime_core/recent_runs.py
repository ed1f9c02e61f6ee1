"""A bounded set of the run ids a chain's stage or orchestrator has ended.

A stage rejects a record of a run it stopped as stale (``STALE_RUN``) rather than
unknown, and the orchestrator refuses a new run under the id of one that finished; both
remember only the most recent ids, so that a chain serving runs for months holds a
bounded set, not one id per run it ever served. An id older than the bound is
forgotten: its records (long drained from the rings) are then rejected as unknown, and
its id may be used again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

#: Ended runs whose ids a stage or an orchestrator keeps (the most recent ones).
RECENT_RUNS_KEPT = 1024


class RecentRuns:
    """The ids of the last ``kept`` runs ended, oldest first; ``stale`` the same as a
    frozenset (for the stage's run machines), made again only when it is read after a
    change."""

    def __init__(self, ended: Iterable[str] = (), kept: int = RECENT_RUNS_KEPT) -> None:
        if kept < 1:
            raise ValueError(f"stale runs kept {kept} is not at least 1")
        self.kept = kept
        self._order: deque[str] = deque()
        self._ids: set[str] = set()
        self._frozen: frozenset[str] | None = frozenset()
        for run_id in ended:
            self.add(run_id)

    def add(self, run_id: str) -> None:
        if run_id in self._ids:
            return
        self._order.append(run_id)
        self._ids.add(run_id)
        if len(self._order) > self.kept:
            self._ids.discard(self._order.popleft())
        self._frozen = None

    @property
    def stale(self) -> frozenset[str]:
        if self._frozen is None:
            self._frozen = frozenset(self._ids)
        return self._frozen

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._order))

    def __contains__(self, run_id: object) -> bool:
        return run_id in self._ids

    def __len__(self) -> int:
        return len(self._order)
