"""SIGTERM as Ctrl-C for a command that tears its work down in ``finally`` blocks
(``python -m runtime_cupy --recover``'s warm chain and ``--prompts-file``'s batch,
``python -m runtime_sim run``).

Python turns SIGINT into ``KeyboardInterrupt`` in the main thread; SIGTERM ends the
process at once, its stages left to find their orchestrator gone and its JSON never
written. Within ``sigterm_interrupts()`` SIGTERM raises ``Interrupted`` instead (a
``KeyboardInterrupt``, so what cleans up after Ctrl-C cleans up after it too), naming
the signal, and a second SIGTERM while that cleanup waits raises again, as a second
Ctrl-C does: the waiting stops. ``signal_of(exc)`` names the signal of either,
``cancelled_status`` (``runplan.json_errors``'s) its exit status. Both runtimes' command
lines use it
(``runtime_sim`` cannot import ``runtime_cupy``).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from types import FrameType

log = logging.getLogger(__name__)


class Interrupted(KeyboardInterrupt):
    """A signal other than SIGINT interrupted the command (``signal_name``: SIGTERM)."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


def signal_of(exc: KeyboardInterrupt) -> str:
    """The signal that raised ``exc``: ``Interrupted``'s, else SIGINT (Ctrl-C)."""
    return exc.signal_name if isinstance(exc, Interrupted) else "SIGINT"


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """For the ``with`` block: SIGTERM raises ``Interrupted("SIGTERM")`` in the main
    thread (elsewhere: nothing changes); the previous handler is given back at its end."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    seen: list[str] = []

    def handler(signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if seen:
            log.warning("%s again: the stages are stopped now, without waiting", name)
        else:
            log.warning("%s: stopping the run (interrupt again to stop waiting)", name)
        seen.append(name)
        raise Interrupted(name)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
