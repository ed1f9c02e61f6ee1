"""What limit of this process a failed system call may have met, for its message: a
descriptor limit (``EMFILE``: ``ulimit -n``) or an address-space limit (``ENOMEM``
under ``RLIMIT_AS``: ``ulimit -v``). "[Errno 24] Too many open files" or "Cannot
allocate memory" alone leaves a user to guess that a limit of theirs, not the machine,
ran out, and which."""

from __future__ import annotations

import errno
import resource


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


def with_limit(text: str, code: int | None) -> str:
    """``text``, followed by ``limit_note(code)`` where there is one: ``"...; the
    descriptor limit (ulimit -n) is 20"``."""
    note = limit_note(code)
    return f"{text}; {note}" if note else text
