"""What limit of this process a failed system call may have met, for its message: a
descriptor limit (``EMFILE``: ``ulimit -n``) or an address-space limit (``ENOMEM``
under ``RLIMIT_AS``: ``ulimit -v``); a process or thread refused (``EAGAIN``): processes
or threads ran out, under the process limit (``ulimit -u``) where one is set. "[Errno
24] Too many open files" or "Cannot allocate memory" alone leaves a user to guess that
a limit of theirs, not the machine, ran out, and which."""

from __future__ import annotations

import errno
import os
import resource

#: The ``errno`` of a call that failed because the process or host ran out of something
#: (descriptors, memory, buffers), not because of what it was asked.
EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


def limit_note(code: int | None) -> str:
    """A clause naming the limit an error of ``errno`` ``code`` may have met and its
    value: ``"the descriptor limit (ulimit -n) is 20"`` for ``EMFILE``; for ``ENOMEM``,
    ``"the address-space limit (RLIMIT_AS, ulimit -v) is 524288000 bytes"`` where one
    is set; ``""`` otherwise (no such limit, or one that cannot be read)."""
    try:
        if code == errno.EMFILE:
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            if soft != resource.RLIM_INFINITY:
                return f"the descriptor limit (ulimit -n) is {soft}"
        elif code == errno.ENOMEM:
            soft, _ = resource.getrlimit(resource.RLIMIT_AS)
            if soft != resource.RLIM_INFINITY:
                return f"the address-space limit (RLIMIT_AS, ulimit -v) is {soft} bytes"
    except (OSError, ValueError):
        pass
    return ""


def process_limit_note() -> str:
    """``"the process limit (RLIMIT_NPROC, ulimit -u, threads included) is 64"`` where
    one binds this process (root is not held to it), else ``""``."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
        if soft != resource.RLIM_INFINITY and os.geteuid() != 0:
            return f"the process limit (RLIMIT_NPROC, ulimit -u, threads included) is {soft}"
    except (OSError, ValueError):
        pass
    return ""


def processes_note() -> str:
    """What a process refused (``EAGAIN`` of ``fork``) means, and the process limit
    where one binds (``process_limit_note``)."""
    note = process_limit_note()
    ran_out = "this host's or user's processes or threads ran out"
    return f"{ran_out}; {note}" if note else ran_out


def with_limit(text: str, code: int | None, *, spawning: bool = False) -> str:
    """``text``, followed by ``limit_note(code)`` where there is one: ``"...; the
    descriptor limit (ulimit -n) is 20"``; where ``text`` says a process or thread
    could not be made (``spawning``), an ``EAGAIN`` is followed by ``processes_note``."""
    note = processes_note() if spawning and code == errno.EAGAIN else limit_note(code)
    return f"{text}; {note}" if note else text


def error_with_limit(exc: BaseException) -> str:
    """``exc`` as a fault's detail names it, ``"OSError: [Errno 24] Too many open
    files"``, followed for an ``OSError`` by ``limit_note`` of its ``errno`` where there
    is one (``"...; the descriptor limit (ulimit -n) is 18"``)."""
    text = f"{type(exc).__name__}: {exc}"
    return with_limit(text, exc.errno) if isinstance(exc, OSError) else text
