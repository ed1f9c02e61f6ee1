"""The errors of a warm chain (``serve.chain.WarmChain``): ``ChainError``, it cannot
serve (``process.chain_error``'s, which the chain runner raises too: ``ChainClosing``, a
run handed over as the chain closes, is one); ``Unplaced``, it lost stages and no
placement is left over the live nodes; and ``SourceChanged``, it lost stages and its
model's files changed since its stages started.
"""

from __future__ import annotations

from collections.abc import Sequence

from runplan.picklable_error import PicklableError
from runplan.replacement import Unplaceable
from runtime_cupy.process.chain_error import ChainClosing, ChainError

__all__ = ["ChainClosing", "ChainError", "SourceChanged", "Unplaced", "unplaced"]


def unplaced(new: Unplaceable, live: Sequence[str]) -> str:
    """Why a chain that lost stages cannot be placed again, naming the live nodes it had
    (none: no live node at all)."""
    if not live:
        over = "no live node is left"
    else:
        over = f"{len(live)} live node{'s' if len(live) > 1 else ''} ({', '.join(live)})"
    return f"the chain lost a stage and cannot be placed again over {over}: {new}"


class Unplaced(PicklableError, ChainError):
    """The chain lost stages and the planner finds no placement over the ``live`` nodes
    (``unplaceable``: its rejection, naming the lost nodes and stages); it is the
    chain's trouble until a later start places it."""

    def __init__(self, unplaceable: Unplaceable, live: Sequence[str]) -> None:
        self.unplaceable = unplaceable
        self.live = tuple(live)
        super().__init__(unplaced(unplaceable, self.live))


class SourceChanged(PicklableError, ChainError):
    """The chain lost stages and its model's files changed since its stages started
    (``changes``: each file and what of it changed, ``chain_source.SourceFiles``): the
    stages a re-placement keeps hold the old weights, a stage started again would read
    the new file, so no stream is replayed on it. The next start of the chain starts
    every stage again, on the files as they are then."""

    def __init__(self, changes: str) -> None:
        self.changes = changes
        super().__init__(f"{changes}: the stages kept would hold the old weights")
