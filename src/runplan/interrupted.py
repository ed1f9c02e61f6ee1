"""SIGTERM as Ctrl-C: ``Interrupted``, the ``KeyboardInterrupt`` a signal other than
SIGINT raises (naming it), and ``sigterm_as_ctrl_c``, which each package's
``__main__`` calls first thing so that a SIGTERM from then on (the command's modules
loading, the model being read, any command) ends the command as Ctrl-C does: the
``Cancelled`` object with ``--json`` (``runplan.json_errors.cancelled_exit``), exit 143.

Python turns SIGINT into ``KeyboardInterrupt`` in the main thread; SIGTERM's default
action ends the process at once, with nothing on standard output. The handlers that a
command sets for its own work (``runtime_core.interrupt.sigterm_interrupts``, a process
run's, Ray's driver's) replace this one while they hold and give it back after.
Standard library only: ``runplan``'s command line imports no runtime and the runtimes'
``__main__`` import it before their command's modules.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

from runplan.picklable_error import PicklableError


class Interrupted(PicklableError, KeyboardInterrupt):
    """A signal other than SIGINT interrupted the command (``signal_name``: SIGTERM)."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


#: the signals ``raise_interrupted`` raised in this process, in order
_RAISED: list[str] = []


def raise_interrupted(signum: int, _frame: FrameType | None) -> None:
    """A signal handler: ``Interrupted`` naming the signal ``signum`` (and noted, for
    ``raised_before``)."""
    name = signal.Signals(signum).name
    _RAISED.append(name)
    raise Interrupted(name)


def raised_before() -> Interrupted | None:
    """An ``Interrupted`` for the last signal ``raise_interrupted`` raised in this
    process, None if none: for a ``__main__`` whose command ended with another error
    after one, which C code that caught it put in its place (NumPy's, importing a
    module, turns it into an ``ImportError``)."""
    return Interrupted(_RAISED[-1]) if _RAISED else None


def sigterm_as_ctrl_c() -> None:
    """From now on in this process, SIGTERM raises ``Interrupted("SIGTERM")`` in the
    main thread, as SIGINT raises ``KeyboardInterrupt`` (called from another thread:
    nothing changes, as Python sets handlers in the main thread only)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, raise_interrupted)
