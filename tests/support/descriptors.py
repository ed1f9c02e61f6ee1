"""This process with no file descriptor to spare, for tests of what an ``accept`` does
on ``EMFILE``."""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Iterator


@contextlib.contextmanager
def no_descriptor_left() -> Iterator[None]:
    """While the block runs, ``RLIMIT_NOFILE``'s soft limit is the lowest free
    descriptor (the next one opened fails with ``EMFILE``); restored after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.dup(0)
    os.close(lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
