"""Starting a thread where the host may have none left. ``Thread.start`` raises a bare
``RuntimeError("can't start new thread")`` when the kernel refuses one (``EAGAIN`` of
``pthread_create``: the user's process limit, ``ulimit -u``, which counts threads; a
control group's ``pids.max``; the host's ``threads-max``; or no address space left for
the thread's stack, ``ulimit -v``): a traceback that names neither the thread nor what
ran out. ``start_thread`` raises ``ThreadUnavailable`` instead, naming both
(``thread_refused``: the limits that may have been met, with the values of those set,
``runplan.resource_limits``); the server's requests say it so too
(``serve.engine``)."""

from __future__ import annotations

import errno
import threading

from runplan.resource_limits import limit_note, process_limit_note

#: What CPython's ``Thread.start`` says when the kernel refuses a thread.
_REFUSED = "can't start new thread"
#: What a thread refused means.
LIMIT_REACHED = (
    "a limit on threads, processes or address space (ulimit -u, ulimit -v, pids.max) is reached"
)


class ThreadUnavailable(RuntimeError):
    """A thread this process needs could not be started: processes, threads or address
    space ran out."""


def thread_refused(subject: str, exc: RuntimeError) -> str:
    """``subject`` (what could not be done) and why, for a thread refused (``exc``):
    ``"... (can't start new thread): a limit on threads, processes or address space
    (ulimit -u, ulimit -v, pids.max) is reached"``, followed by the value of each of
    those limits that binds this process."""
    text = f"{subject} ({exc}): {LIMIT_REACHED}"
    notes = [n for n in (process_limit_note(), limit_note(errno.ENOMEM)) if n]
    return "; ".join([text, *notes])


def is_thread_refused(exc: RuntimeError) -> bool:
    """Whether ``exc`` is ``Thread.start``'s word that the kernel refused the thread (not
    another ``RuntimeError``: a thread started twice, a defect)."""
    return str(exc) == _REFUSED


def start_thread(thread: threading.Thread, what: str) -> None:
    """Start ``thread`` (``what`` it is, for the message); ``ThreadUnavailable`` where
    the kernel refuses it. Another ``RuntimeError`` (a thread started twice) is raised
    as it is: a defect, not a shortage."""
    try:
        thread.start()
    except RuntimeError as exc:
        if not is_thread_refused(exc):
            raise
        raise ThreadUnavailable(thread_refused(f"cannot start {what}", exc)) from None
