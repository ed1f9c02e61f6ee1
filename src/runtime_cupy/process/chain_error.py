"""The errors a chain raises to its callers, here so that the chain runner
(``chain_handoffs``) and the warm chain (``serve.chain_errors``, which re-exports
``ChainError``) share them without importing each other: ``ChainError``, the chain
cannot serve; ``ChainClosing``, a ``ChainError`` for a run handed over as its chain
closes (or after it closed), which never ran."""

from __future__ import annotations

__all__ = ["ChainClosing", "ChainError"]


class ChainError(RuntimeError):
    """The chain cannot serve: its stages could not be started or bound."""


class ChainClosing(ChainError):
    """A run handed over as its chain closes (or after it closed): it never ran."""
