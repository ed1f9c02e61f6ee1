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
(``runtime_sim`` cannot import ``runtime_cupy``). ``Interrupted`` is
``runplan.interrupted``'s (re-exported here), whose handler each package's ``__main__``
sets first thing (``sigterm_as_ctrl_c``): this one replaces it within the block and
gives it back.

``to_the_end(action, on_interrupt)`` runs a teardown to its end however often the user
interrupts it: after each interrupt ``on_interrupt()`` (stop waiting) and the action
again; the first interrupt is handed back for the caller to raise once it is done.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

from runplan.interrupted import Interrupted

log = logging.getLogger(__name__)

__all__ = [
    "Cancellation",
    "Interrupted",
    "cancellable",
    "signal_named",
    "signal_of",
    "sigterm_interrupts",
    "to_the_end",
]


def signal_of(exc: KeyboardInterrupt) -> str:
    """The signal that raised ``exc``: ``Interrupted``'s, else SIGINT (Ctrl-C)."""
    return exc.signal_name if isinstance(exc, Interrupted) else "SIGINT"


def signal_named(exc: KeyboardInterrupt) -> str | None:
    """The signal that cancelled a command where it is not Ctrl-C (SIGTERM), else
    ``None``: a Ctrl-C's ``Cancelled`` object says ``cancelled``, as it always has."""
    name = signal_of(exc)
    return None if name == "SIGINT" else name


def to_the_end(
    action: Callable[[], None], on_interrupt: Callable[[], None]
) -> BaseException | None:
    """Call ``action()`` until it returns: each interrupt that breaks into it (Ctrl-C's
    ``KeyboardInterrupt``, ``Interrupted``, or whatever else a signal handler raises
    that is no ``Exception``: ``SystemExit``) is held, then ``on_interrupt()`` and
    ``action()`` run again (``action`` does again only what it has not done). The first
    interrupt is returned (``None`` if none came), for the caller to raise once the work
    is done; an ``Exception`` goes on at once, as from a plain call."""
    first: BaseException | None = None
    while True:
        try:
            if first is not None:
                on_interrupt()
            action()
            return first
        except Exception:
            raise
        except BaseException as exc:  # an interrupt: held, the work goes on
            first = first or exc


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


class Cancellation:
    """What ended a ``cancellable()`` block: ``signal_name`` names the signal, Ctrl-C's
    (SIGINT) or SIGTERM, that cancelled it; ``None`` while it runs and once it ran to
    its end."""

    def __init__(self) -> None:
        self.signal_name: str | None = None


@contextlib.contextmanager
def cancellable() -> Iterator[Cancellation]:
    """A block of several runs whose ends a command keeps (``python -m runtime_cupy
    --prompts-file``'s batch, ``python -m runtime_sim run --runs N``): within it SIGTERM
    is Ctrl-C (``sigterm_interrupts``), and either ends the block, its ``finally``
    blocks run, without going further up: the yielded ``Cancellation`` names it, and
    the command prints the runs that ended beside the ``Cancelled`` error."""
    cancellation = Cancellation()
    with sigterm_interrupts():
        try:
            yield cancellation
        except KeyboardInterrupt as exc:
            cancellation.signal_name = signal_of(exc)
