"""Ctrl-C and SIGTERM once a command's exit status is decided (``run_command``'s): too
late to cancel anything, they no longer change the status or kill the process.

Its output written and flushed, the command's process still has the interpreter's exit
ahead: non-daemon threads joined, exit functions run, then the modules torn down, which
takes a few hundred milliseconds for a run. Python sets every signal it handles back to
its default action as that teardown begins, so a SIGTERM or Ctrl-C there killed the
process (-15, -2: a completed run's JSON was printed, and the caller saw it killed);
one a little earlier raised into a thread's join or an exit function (a traceback on
standard error, ``Exception ignored in: <module 'threading'>``).

- ``exit_with(status)``: from now on a Ctrl-C or SIGTERM ends the process at once with
  ``status``, standard output and error flushed (``os._exit``; the join or exit
  function it broke into goes no further, as when the signal killed it); then
  ``sys.exit(status)``.
- ``end_after_exit_functions()``, registered as the first exit function so that it
  runs last: where ``exit_with`` decided the status, the process ends there with it,
  its standard streams flushed (``os._exit``), and the modules' teardown does not
  happen: no window is left where Python has given the signals their default action
  back, and none where they would have to be ignored (a teardown that hung, a C
  extension's cleanup, would then end on SIGKILL alone). What the teardown would
  have done, objects of the modules finalized, is nothing a command leaves to it: its
  files are closed, its stages reaped, ``weakref.finalize`` and every other exit
  function run before this one.

Standard library only, none of it a module ``runplan.command_main`` does not load
already: that module imports it before SIGTERM's handler is set."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from types import FrameType
from typing import NoReturn

#: The signals that end a command: Ctrl-C's, and SIGTERM (``sigterm_as_ctrl_c``).
ENDING = (signal.SIGINT, signal.SIGTERM)


def _exit_code(status: str | int | None) -> int:
    """The process's exit code for ``sys.exit(status)``: an int as it is, ``None`` 0, any
    other value (a message) 1."""
    if isinstance(status, int):
        return status
    return 0 if status is None else 1


def _flush_standard_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):  # gone, closed, None
            stream.flush()


#: The exit code ``exit_with`` decided, for ``end_after_exit_functions`` (none: the
#: process ends as Python ends it).
_decided: list[int] = []


def exit_with(status: str | int | None) -> NoReturn:
    """``sys.exit(status)``, a Ctrl-C or SIGTERM from now on ending the process at once
    with the same exit code, its standard streams flushed."""
    code = _exit_code(status)
    _decided.append(code)

    def handler(_signum: int, _frame: FrameType | None) -> None:
        _flush_standard_streams()
        os._exit(code)

    try:
        for signum in ENDING:
            if signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, handler)
    except KeyboardInterrupt:  # one came as the handlers were set (the command's raised)
        handler(0, None)
    sys.exit(status)


def end_after_exit_functions() -> None:
    """The process ended with the status ``exit_with`` decided, if it decided one, its
    standard streams flushed (the last exit function: the modules' teardown, where a
    signal would take its default action, does not follow)."""
    if _decided:
        _flush_standard_streams()
        os._exit(_decided[-1])
