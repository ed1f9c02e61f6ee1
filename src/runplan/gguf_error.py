"""``GgufError``: a GGUF source that cannot be read as a model, naming the file and,
where there is one, the key or tensor (raised by ``gguf_header``, ``gguf_files`` and
``gguf_tensors``, and by every reader of a header's metadata)."""

from __future__ import annotations

import os

from runplan.picklable_error import PicklableError


class GgufError(PicklableError, ValueError):
    """A GGUF file that cannot be read as a model: not GGUF, truncated, malformed, or
    lacking a required key. Names the file and, where there is one, the key."""

    def __init__(self, path: str | os.PathLike[str], message: str, key: str | None = None):
        self.path = os.fspath(path)
        self.key = key
        where = f" (key {key!r})" if key is not None else ""
        super().__init__(f"{self.path}{where}: {message}")


class GgufUnmapped(GgufError):
    """A GGUF file that could not be mapped for want of memory or address space
    (``ENOMEM``): a fault of this host's resources, not of the file (every command of
    ``runtime_cupy`` and ``runtime_sim run`` exit 1 for it, not 2 as for bad input).
    Names the address-space limit (``RLIMIT_AS``) where one is set."""
