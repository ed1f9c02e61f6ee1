"""Typed errors of loading a model into a stage."""

from __future__ import annotations

from runplan.picklable_error import PicklableError


class UnsupportedModel(PicklableError, ValueError):
    """A GGUF model that is readable but that this runtime does not run as it is: an
    architecture we do not implement, a tensor of a quant type the worker cannot run,
    a block tensor that is missing, has the wrong shape or is not part of the
    architecture, or a rope scaling we do not implement. Names the file and what is
    wrong; ``tensor`` and ``key`` say where, when there is one."""

    def __init__(
        self,
        path: str,
        message: str,
        *,
        tensor: str | None = None,
        key: str | None = None,
    ) -> None:
        self.path = path
        self.tensor = tensor
        self.key = key
        where = ""
        if tensor is not None:
            where = f" (tensor {tensor!r})"
        elif key is not None:
            where = f" (key {key!r})"
        super().__init__(f"{path}{where}: {message}")
