"""One wait on a full ring, as ``Timeouts.edge_wait_ms`` bounds it ("one wait on a
ring", either end): it begins when a write is refused and ends when a record is
written. A queue of records (a long prompt's chunks, a batch's outputs) that goes out
a few at a time as the consumer frees slots is so many waits, each bounded alone: the
bound runs out only when no record at all was written for that long."""

from __future__ import annotations


class RingWait:
    """The wait of one producer on one ring: the runtime tells it of each refused write
    with the count of records written so far (the controller's, which grows with every
    record out, whoever wrote it)."""

    def __init__(self) -> None:
        self.since: float | None = None  # when the wait began; ``None``: no wait
        self._written = 0

    def clear(self) -> None:
        """Nothing waits (everything was written, or nothing is to be)."""
        self.since = None

    def refused(self, now: float, written: int, bound_s: float) -> bool:
        """A write was refused at ``now`` with ``written`` records written so far;
        ``True`` when the wait has lasted past ``bound_s`` without a record written (the
        wait then ends: the caller faults)."""
        if self.since is None or written != self._written:
            self.since, self._written = now, written
            return False
        if now - self.since > bound_s:
            self.since = None
            return True
        return False

    def due(self, bound_s: float) -> float | None:
        """When the bound runs out if no record is written first (``None``: no wait)."""
        return None if self.since is None else self.since + bound_s
