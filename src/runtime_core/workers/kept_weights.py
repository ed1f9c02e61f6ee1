"""Weights kept from one run to the next (the spec's warm reuse).

Weights are not per-run state. A worker that has bound a stage's slice keeps it when
the run is released; when it is provisioned for a later run whose GGUF source and
layer range match what it bound, ``bind`` uses them again instead of reading the file.
Everything per run is made afresh for each run: the KV cache, the sampler, the
sequence and position, the provision.

What "match" means is ``WeightsKey``: the files of the source as they are on disk
(path, device, inode, size, modification and change times of each, so a file replaced
under the same name, or written in place, is read again), the layer range, first and
last (the embedding and the head), the architecture and hidden size the plan names, and
whatever else a worker's loaded form depends on (``extra``: the CUDA worker's KV dtype,
cache length and product mode).
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from typing import Protocol, runtime_checkable

from attrs import frozen

from runplan import GgufSource, ProvisionStage


@frozen
class FileIdentity:
    """One file as it is on disk now."""

    path: str
    device: int
    inode: int
    size: int
    mtime_ns: int
    #: The inode's change time: a file written in place and its modification time set
    #: back (``touch -r``, ``os.utime``) keeps size and mtime, but the kernel moves this.
    ctime_ns: int

    @classmethod
    def of(cls, path: str) -> FileIdentity | None:
        """``None`` for a file that cannot be looked at (then nothing matches it and the
        worker's own loading reports why)."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        return cls(
            os.path.abspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns
        )


@frozen
class WeightsKey:
    """What a stage's bound weights were made from."""

    files: tuple[FileIdentity | None, ...]
    layer_start: int
    layer_end_exclusive: int
    is_first: bool
    is_last: bool
    architecture: str
    hidden_dim: int
    extra: tuple[Hashable, ...] = ()

    @property
    def readable(self) -> bool:
        return all(f is not None for f in self.files)

    def reusable_for(self, other: WeightsKey) -> bool:
        """Whether weights bound under ``self`` serve a provision keyed ``other``."""
        return self.readable and self == other


def weights_key(
    source: GgufSource, provision: ProvisionStage, extra: tuple[Hashable, ...] = ()
) -> WeightsKey:
    """The key of the weights ``provision`` asks a worker to bind from ``source``."""
    return WeightsKey(
        files=tuple(FileIdentity.of(p) for p in source.paths),
        layer_start=provision.layer_start,
        layer_end_exclusive=provision.layer_end_exclusive,
        is_first=provision.is_first,
        is_last=provision.is_last,
        architecture=provision.model.architecture,
        hidden_dim=provision.model.hidden_dim,
        extra=extra,
    )


@runtime_checkable
class KeepsWeights(Protocol):
    """A worker that keeps its weights between runs. ``weights_reused`` says whether
    its last ``bind`` used weights it already held (nothing was read from the file);
    ``forget_weights()`` lets them go (the next ``bind`` loads)."""

    weights_reused: bool

    def forget_weights(self) -> None: ...
