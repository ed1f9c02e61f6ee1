"""The model files a warm chain's stages read (``serve.chain.WarmChain``), as they were
on disk when the stages started: a re-placement after a loss keeps the stages it can,
which hold the weights they bound, and starts the others, which read the files as they
are now. Were a file replaced under the chain since (another GGUF renamed into place,
a file written in place), the new chain would mix two models, and a stream replayed on
it would continue one model's tokens with another's: ``SourceFiles.changes`` says what
changed, and the chain refuses the recovery (``chain_errors.SourceChanged``).
"""

from __future__ import annotations

from collections.abc import Sequence

from attrs import fields, frozen

from runtime_core.workers.kept_weights import FileIdentity

# What of a file's identity is named when it changed (its path is the same).
_NAMED = tuple(f.name for f in fields(FileIdentity) if f.name != "path")


@frozen
class SourceFiles:
    """The identity of each of the source's files (``None``: it could not be looked at)."""

    paths: tuple[str, ...]
    files: tuple[FileIdentity | None, ...]

    @classmethod
    def now(cls, paths: Sequence[str]) -> SourceFiles:
        """The files at ``paths`` as they are on disk now."""
        return cls(tuple(paths), tuple(FileIdentity.of(p) for p in paths))

    def changes(self) -> str | None:
        """What changed in the files since this identity was taken (``None``: nothing),
        each changed file named with what changed: ``PATH changed since the chain's
        stages started: inode 5 -> 9, mtime_ns ...``."""
        said = []
        now_files = SourceFiles.now(self.paths).files
        for path, was, now in zip(self.paths, self.files, now_files, strict=True):
            if was == now:
                continue
            if now is None:
                what = "it can no longer be looked at"
            elif was is None:
                what = "it could not be looked at then"
            else:
                what = ", ".join(
                    f"{name} {getattr(was, name)} -> {getattr(now, name)}"
                    for name in _NAMED
                    if getattr(was, name) != getattr(now, name)
                )
            said.append(f"{path} changed since the chain's stages started: {what}")
        return "; ".join(said) or None
