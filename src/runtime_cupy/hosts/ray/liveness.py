"""Whether the parts of a Ray cluster a run leans on still answer, asked so that one
dropped packet, or a raylet busy for a moment, is no loss, and so that a head that does
not answer costs one wait, not one per stage.

- ``RayletWatch``: a starting stage's node, asked while the start waits for the stage's
  control connection (``RayHost.start``'s ``gone``): its raylet asked at most every
  ``ask_s``, and taken for gone only once ``misses`` asks in a row found no answer
  (``RAYLET_MISSES`` over about as many seconds: each ask waits up to
  ``session.RAYLET_PROBE_S``); an answer between them starts the count again.
- ``HeadProbe``: whether the cluster's head answers, for the releases of a chain's warm
  stages and the chain's cleanup that follows them (``RayHost._release``,
  ``RayHost.cleanup``): a head that did not answer is taken as silent for
  ``remember_s``, so that a head whose packets are dropped (each ask waiting its 1 s
  out) is asked once for all of them; a head that answered is asked again each time
  (it answers in milliseconds, and one lost after answering must not be called through:
  Ray blocks each such call until it ends the driver).

Both take what asks (``answers``) and the clock as ports: ``session.raylet_answers``,
``session.head_answers`` and ``time.monotonic`` in the Ray host, fakes in the tests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("runtime_cupy.hosts.ray")

#: How often a stage's start asks whether its node's raylet still answers.
RAYLET_ASK_S = 1.0
#: How many asks in a row a raylet leaves unanswered before its node counts as gone.
RAYLET_MISSES = 3
#: How long a cluster's head that did not answer is taken as silent without asking.
HEAD_REMEMBERED_S = 5.0


class RayletWatch:
    """Whether the node of a stage being started is gone: its raylet at
    ``address:port`` asked by ``answers(address, port)`` at most every ``ask_s``
    (``clock``: the time now, in seconds), gone after ``misses`` unanswered asks in a
    row."""

    def __init__(
        self,
        address: str,
        port: int,
        answers: Callable[[str, int], bool],
        *,
        ask_s: float = RAYLET_ASK_S,
        misses: int = RAYLET_MISSES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if misses < 1:
            raise ValueError(f"misses {misses} is not at least 1")
        if ask_s < 0:
            raise ValueError(f"ask_s {ask_s} is negative")
        self.address = address
        self.port = port
        self._answers = answers
        self._ask_s = ask_s
        self._misses = misses
        self._clock = clock
        self._asked = clock()  # the first ask comes ask_s after the start began
        self._missed = 0

    def gone(self) -> str | None:
        """Why the stage will never start (its raylet left ``misses`` asks in a row
        unanswered), else ``None`` (asked too recently, it answered, or it has not
        missed enough yet)."""
        now = self._clock()
        if now - self._asked < self._ask_s:
            return None
        self._asked = now
        if self._answers(self.address, self.port):
            self._missed = 0
            return None
        self._missed += 1
        where = f"{self.address}:{self.port}"
        if self._missed < self._misses:
            log.info("the raylet at %s did not answer (%d of %d asks): asking again",
                     where, self._missed, self._misses)  # fmt: skip
            return None
        return f"its node is gone: the raylet at {where} does not answer ({self._missed} asks)"


class HeadProbe:
    """Whether the cluster's head answers: ``answers()`` asked, a silence taken for
    ``remember_s`` (``clock``: the time now, in seconds), an answer never kept."""

    def __init__(
        self,
        answers: Callable[[], bool],
        *,
        remember_s: float = HEAD_REMEMBERED_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if remember_s < 0:
            raise ValueError(f"remember_s {remember_s} is negative")
        self._answers = answers
        self._remember_s = remember_s
        self._clock = clock
        self._silent_since: float | None = None  # when the head last did not answer

    def __call__(self) -> bool:
        silent = self._silent_since
        if silent is not None and self._clock() - silent < self._remember_s:
            return False
        answer = self._answers()
        self._silent_since = None if answer else self._clock()
        return answer
