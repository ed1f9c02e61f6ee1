"""The error object of every ``--json`` command line of the project (``runplan``,
``runtime_cupy``, ``runtime_sim``): a command that fails prints one JSON object with
an ``error`` key, whatever the cause::

    {"error": {"type": "GgufError", "message": "bad.gguf: not a GGUF file ..."}}

``type`` names the kind of failure (the exception's class, or one of the names
below) and ``message`` is the one line the command prints without ``--json``; some
kinds add typed fields beside them:

- ``PlanRejected`` (the planner refused the run): ``code`` (the rejection's code, such
  as ``insufficient_memory``) and the rejection's values, by field name;
- ``UsageError`` (a flag missing, or a flag's value that does not parse): nothing more;
- ``RunFaulted`` (a run that started and faulted): nothing more; the run's result
  fields (``tokens``, ``text``, ``outcome``, ``fault``, ...) stand beside ``error``;
- ``Cancelled`` (Ctrl-C or SIGTERM ended the command): nothing more; a run's result
  (outcome ``cancelled``, the tokens so far) stands beside it where there is one.
- ``OutOfMemory`` (the command's process ran out of memory, ``MemoryError``, where
  nothing in the command met it: the address-space limit, ``ulimit -v``, named where
  one is set): nothing more;
- ``TraceNotWritten`` (a run's ``--trace`` file could not be written): nothing more;
  the run's result stands beside it.
- ``ContractBroken`` (``runplan check``: a clause of the contract is broken),
  ``Violations`` (``runtime_sim explore``: a scenario broke a rule) and
  ``MutantsMissed`` (``runtime_sim explore --self-test``: a mutant went uncaught):
  nothing more; the command's report stands beside ``error``.

Other keys may stand beside ``error`` in a command's object (a faulted run's result;
``runplan plan`` and ``split`` keep their ``rejection`` object); ``error`` is absent
when the command succeeded. docs/json-output.md is the page users read.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, TextIO

from runplan.rejections import PlanRejection

#: The ``type`` of a refused plan, whoever refused it (``runtime_core.runs.PlanRejected``).
PLAN_REJECTED = "PlanRejected"
#: The ``type`` of a command line that does not parse (a flag missing or its value bad).
USAGE_ERROR = "UsageError"
#: The ``type`` of a run that started and faulted.
RUN_FAULTED = "RunFaulted"
#: The ``type`` of a command that Ctrl-C (or SIGTERM) ended.
CANCELLED = "Cancelled"
#: The ``type`` of a command that ran out of memory where no command met it.
OUT_OF_MEMORY = "OutOfMemory"
#: The ``type`` of a run's ``--trace`` file that could not be written.
TRACE_NOT_WRITTEN = "TraceNotWritten"
#: The ``type`` of a plan ``runplan check`` found breaking a clause of the contract.
CONTRACT_BROKEN = "ContractBroken"
#: The ``type`` of explored scenarios that broke a rule (``runtime_sim explore``).
VIOLATIONS = "Violations"
#: The ``type`` of a self-test that missed a mutant (``runtime_sim explore --self-test``).
MUTANTS_MISSED = "MutantsMissed"


def error_json(kind: str, message: str, **fields: Any) -> dict[str, Any]:
    """``{"error": {"type": kind, "message": message, **fields}}``."""
    return {"error": {"type": kind, "message": message, **fields}}


def rejection_fields(rejection: PlanRejection) -> dict[str, Any]:
    """A rejection's ``code``, ``message`` and values (tuples as lists)."""
    values = {k: list(v) if isinstance(v, tuple) else v for k, v in rejection.values().items()}
    return {"code": rejection.code, "message": str(rejection), **values}


def rejection_json(rejection: PlanRejection) -> dict[str, Any]:
    """The error object of a refused plan: type ``PlanRejected``, its code and values."""
    fields = rejection_fields(rejection)
    return error_json(PLAN_REJECTED, fields.pop("message"), **fields)


def exception_json(exc: BaseException) -> dict[str, Any]:
    """The error object of an exception: its class name and its text, one line; an
    exception carrying a ``rejection`` (``PlanRejected``) as ``rejection_json``."""
    rejection = getattr(exc, "rejection", None)
    if isinstance(rejection, PlanRejection):
        return rejection_json(rejection)
    return error_json(type(exc).__name__, str(exc))


def fault_json(fault: str | None) -> dict[str, Any]:
    """The error object of a run that faulted (``fault``: what the result says)."""
    return error_json(RUN_FAULTED, f"run faulted: {fault or 'no reason given'}")


def cancelled_json(signal_name: str | None = None) -> dict[str, Any]:
    """The error object of a command cancelled (``signal_name``: by that signal)."""
    return error_json(CANCELLED, "cancelled" + (f" by {signal_name}" if signal_name else ""))


def cancelled_status(signal_name: str | None) -> int:
    """The exit status of a command cancelled by ``signal_name`` (``None``: by Ctrl-C or
    by a caller): 128 + the signal's number, as a shell reports a process the signal
    ended: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + signal.Signals[signal_name or "SIGINT"].value


def cancelled_with(
    doc: dict[str, Any] | None,
    signal_name: str | None,
    write: Callable[[dict[str, Any]], None] | None = None,
) -> int:
    """A command of several runs that ``signal_name`` cancelled (``python -m
    runtime_cupy --prompts-file``, ``python -m runtime_sim run --runs N``): with
    ``--json``, ``doc`` (the runs that ended) and the ``Cancelled`` error beside them as
    one object, written by ``write`` (``print_json``); ``None`` without it. ``cancelled``
    on standard error; the exit status."""
    if doc is not None:
        (write or print_json)(doc | cancelled_json(signal_name))
    sys.stderr.write("cancelled\n")
    return cancelled_status(signal_name)


def cancelled_command(
    signal_name: str | None,
    *,
    as_json: bool,
    since: int = 0,
    write: Callable[[dict[str, Any]], None] | None = None,
) -> int:
    """A command that Ctrl-C or ``signal_name`` (SIGTERM) cancelled where no result of
    its own says so: with ``as_json``, the ``Cancelled`` object, written by ``write``
    (``print_json``), unless a JSON document was printed since ``documents_printed()``
    was ``since`` (the command's result, printed just before the signal came: standard
    output stays that one object); ``cancelled`` on standard error; the exit status."""
    if as_json and documents_printed() == since:
        (write or print_json)(cancelled_json(signal_name))
    sys.stderr.write("cancelled\n")
    return cancelled_status(signal_name)


def cancelled_exit(exc: KeyboardInterrupt) -> int:
    """A package's ``__main__`` for a Ctrl-C (or SIGTERM raised as
    ``runplan.interrupted.Interrupted``, named by its ``signal_name``) that no command
    met: with ``--json`` as written on the command line, the ``Cancelled`` object on
    standard output unless a JSON document was printed already; ``cancelled`` on
    standard error; the exit status (``cancelled_command``)."""
    signal_name = getattr(exc, "signal_name", None)
    return cancelled_command(signal_name, as_json="--json" in sys.argv[1:])


def out_of_memory_exit() -> int:
    """A package's ``__main__`` for a ``MemoryError`` no command met (a tokenizer's
    vocabulary read under a small ``ulimit -v``: it was a traceback, and no object with
    ``--json``): with ``--json`` as written on the command line, the ``OutOfMemory``
    object unless a JSON document was printed already; one line on standard error
    naming the address-space limit where one is set; exit status 1, as for the host's
    other shortages."""
    import errno

    from runplan.resource_limits import with_limit

    message = with_limit("this process ran out of memory", errno.ENOMEM)
    if "--json" in sys.argv[1:] and not printed():
        print_json(error_json(OUT_OF_MEMORY, message))
    with contextlib.suppress(OSError):
        sys.stderr.write(f"error: {message}\n")
    return 1


#: The exit status of a command whose standard output's reader went away (``cmd | head``
#: once ``head`` read enough): a shell's status for a process that SIGPIPE ended.
READER_GONE = 128 + 13


def reader_gone_exit() -> int:
    """A package's ``__main__`` for a ``BrokenPipeError`` no command met: standard
    output's reader went away. No traceback, and nothing more written there (it goes to
    ``/dev/null``, so that the interpreter's flush at exit does not fail again); the
    exit status ``READER_GONE``."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return READER_GONE


def output_failed_exit(exc: OSError, *, stdout: bool) -> int:
    """A package's ``__main__`` for an ``OSError`` of a device no command met (a full
    disk, ``/dev/full``, a terminal gone): one line on standard error naming it, no
    traceback; where standard output is what failed (``stdout``), it says so, and
    nothing more is written there (``/dev/null`` from now on, as ``reader_gone_exit``
    does); exit status 1."""
    what = "cannot write standard output" if stdout else (exc.filename or "")
    line = f"error: {what}: {exc.strerror or exc}" if what else f"error: {exc.strerror or exc}"
    with contextlib.suppress(OSError):
        sys.stderr.write(line + "\n")
    if stdout:
        reader_gone_exit()
    return 1


class _Printed:
    """The JSON documents this process printed with ``print_json``, counted (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def add(self) -> None:
        with self._lock:
            self.count += 1


_PRINTED = _Printed()


def print_json(doc: Any, out: TextIO | None = None) -> None:
    """One JSON document and a line feed on ``out`` (standard output, ``sys.stdout``),
    flushed; counted in ``documents_printed()`` from then on, also where a signal
    interrupts it (Python raises its ``KeyboardInterrupt`` as the flush returns: the
    document was written, and no ``Cancelled`` object may follow it). A ``doc`` JSON
    cannot hold raises ``json.dumps``' ``TypeError`` or ``ValueError`` before anything is
    written, and is not counted."""
    stream = sys.stdout if out is None else out
    line = json.dumps(doc, sort_keys=True) + "\n"
    try:
        stream.write(line)
        stream.flush()
    finally:
        _PRINTED.add()


def documents_printed() -> int:
    """How many JSON documents this process printed with ``print_json``: a command that
    notes it as it begins knows whether it printed its own since (``cancelled_command``)."""
    return _PRINTED.count


def printed() -> bool:
    """Whether this process printed a JSON document with ``print_json``: a package's
    ``__main__``, which prints the ``Cancelled`` object for a Ctrl-C that no command
    met (one while the modules load), prints none after the command's own."""
    return documents_printed() > 0
