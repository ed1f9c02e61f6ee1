"""``run_command``: each package's ``python -m`` entry (``runplan/__main__.py`` says why
it is shaped so). SIGTERM is Ctrl-C from its first line on; then the command's module is
imported and its ``main`` run, and whatever no command met ends it as one line, never a
traceback:

- Ctrl-C or SIGTERM (the modules loading, or past the command's own care): cancelled
  (``runplan.json_errors.cancelled_exit``: 130, 143);
- standard output's reader gone (``| head``): ``READER_GONE`` (141);
- out of memory (``MemoryError``, as under a small ``ulimit -v``): ``error: this process
  ran out of memory; the address-space limit (RLIMIT_AS, ulimit -v) is N bytes`` (the
  limit where one is set), with ``--json`` the ``OutOfMemory`` object, exit 1;
- standard output that cannot be written (a full disk, ``/dev/full``, an I/O error):
  ``error: cannot write standard output: ...``, exit 1 (what the command printed is
  flushed before the exit, so a failed write is seen here and not lost at the
  interpreter's exit: ``--version > /dev/full`` exited 0); another error of a device
  (a full disk, a terminal gone under standard input) is ``error: ...``, naming the
  file where Python does, exit 1;
- any other error after a SIGTERM that C code turned into it (NumPy's import of
  ``datetime`` makes an ``ImportError`` of it): cancelled by SIGTERM.

Once the status is decided (the command returned it, or one of the above, its output
flushed), a Ctrl-C or SIGTERM is too late to cancel anything: the process exits with
that status, at once if the interpreter's exit is still joining threads or running
exit functions, and the modules' teardown, where a signal would take its default
action, is not done (``runplan.late_signals``); before, one during the interpreter's
teardown killed it (-15, -2), a completed run's JSON already printed.

A standard stream whose descriptor is closed (``<&-``, ``2>&-``: Python's ``sys.stdin``
is then ``None``, and the command's first use of it an ``AttributeError`` traceback)
is ``/dev/null`` from before the command starts (``_reopen_closed``); where standard
output is the one closed (``>&-``), the command does not start: ``error: standard
output is closed``, exit 1 (a whole run was made, and its text lost).

Standard library only, as ``runplan.interrupted``: nothing else is imported before the
handler is set.
"""

from __future__ import annotations

import atexit
import errno
import importlib
import os
import sys
from typing import NoReturn

from runplan.interrupted import raised_before, sigterm_as_ctrl_c
from runplan.late_signals import end_after_exit_functions, exit_with

#: errors of a write that the output's device refused (not a fault of the command)
OUTPUT_ERRNOS = frozenset({errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EFBIG})


def output_refused(exc: BaseException) -> bool:
    """Whether ``exc`` is a write that the output refused (its reader gone, a full disk,
    ``/dev/full``, an I/O error: ``OUTPUT_ERRNOS``), not a fault of the command."""
    return isinstance(exc, BrokenPipeError) or (
        isinstance(exc, OSError) and exc.errno in OUTPUT_ERRNOS
    )


def _output_failed() -> bool:
    """Whether standard output is what cannot be written: a write of no bytes to it
    fails (``/dev/full``, a terminal gone); one to a file on a full disk does not, and
    the error is then not named for standard output."""
    try:
        os.write(sys.stdout.fileno(), b"")
    except (OSError, ValueError):  # ValueError: no file descriptor (closed, replaced)
        return True
    return False


#: each standard stream: its descriptor, its ``sys`` name, the mode it is opened in
_STREAMS = ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w"))


def _reopen_closed() -> bool:
    """``/dev/null`` on each standard descriptor that is closed, and as its ``sys``
    stream (``None`` there); whether standard output was one of them."""
    closed = []
    for fd, name, mode in _STREAMS:
        try:
            os.fstat(fd)
        except OSError:  # EBADF: closed
            closed.append(name)
            null = os.open(os.devnull, os.O_RDONLY if mode == "r" else os.O_WRONLY)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            errors = "backslashreplace" if name == "stderr" else None
            stream = open(fd, mode, encoding="utf-8", errors=errors, closefd=False)  # noqa: SIM115
            setattr(sys, name, stream)
            setattr(sys, f"__{name}__", stream)
    return "stdout" in closed


def run_command(module: str) -> NoReturn:
    """Run ``module``'s ``main()`` as ``python -m``'s command and exit with its status."""
    sigterm_as_ctrl_c()  # first: SIGTERM from here on cancels the command as Ctrl-C does
    atexit.register(end_after_exit_functions)  # the first exit function, the last to run
    if _reopen_closed():  # ``>&-``: nothing the command printed could be seen
        sys.stderr.write("error: standard output is closed\n")
        sys.exit(1)
    try:
        try:
            status = importlib.import_module(module).main()
        finally:  # what the command printed, written now (--help, --version: SystemExit)
            sys.stdout.flush()
    except SystemExit as exc:  # --help, --version, a usage error: the status it names
        status = exc.code
    except KeyboardInterrupt as exc:  # while the modules load (or past the command's care)
        from runplan.json_errors import cancelled_exit

        status = cancelled_exit(exc)
    except MemoryError:  # the process ran out of memory (``ulimit -v``) where none met it
        from runplan.json_errors import out_of_memory_exit

        status = out_of_memory_exit()
    except BrokenPipeError:  # standard output's reader went away (``| head``)
        from runplan.json_errors import reader_gone_exit

        status = reader_gone_exit()
    except OSError as exc:
        if exc.errno not in OUTPUT_ERRNOS:
            raise
        from runplan.json_errors import output_failed_exit

        status = output_failed_exit(exc, stdout=_output_failed())
    except Exception:  # after a SIGTERM that C code turned into another error: cancelled
        if (interrupted := raised_before()) is None:
            raise
        from runplan.json_errors import cancelled_exit

        status = cancelled_exit(interrupted)
    exit_with(status)  # a Ctrl-C or SIGTERM from here on is too late: this status stands
