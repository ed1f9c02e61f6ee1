"""The chain runner's runs that wait for KV memory: ``runtime_core.kv_waits``'s rules
(CONCURRENT_RUNS.md §5, kept alike by the simulator) over the runner's ``ChainRun``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime_core import kv_waits

if TYPE_CHECKING:
    from runtime_cupy.process.chain_run import ChainRun  # noqa: F401 (the base names it)


class KvWaits(kv_waits.KvWaits["ChainRun"]):
    """The runs a chain runner holds for KV memory (``runtime_core.kv_waits.KvWaits``)."""
