"""When a loop tries again what another process has not made yet and gives it nothing
to wait on (a neighbour's ring, before that stage has started: no descriptor to poll
until it exists): at once, then after ``FIRST_S``, each wait twice the last, up to
``CEILING_S``, and at once again after a success (``Backoff``). A stage that takes the
whole readiness bound to start (a large model loading) costs its neighbours a try every
``CEILING_S``, not one every 2 ms."""

from __future__ import annotations

#: The first wait after a failed try, and the longest.
FIRST_S = 0.002
CEILING_S = 0.1


class Backoff:
    """The next try's time (``at``, ``time.monotonic()``; 0: at once)."""

    def __init__(self) -> None:
        self.at = 0.0
        self._wait_s = FIRST_S

    def due(self, now: float) -> bool:
        return now >= self.at

    def failed(self, now: float) -> None:
        """A try failed at ``now``: the next waits twice as long as the last."""
        self.at = now + self._wait_s
        self._wait_s = min(self._wait_s * 2, CEILING_S)

    def succeeded(self) -> None:
        """A try succeeded: the next (for something else) is at once, as the first."""
        self.at = 0.0
        self._wait_s = FIRST_S
