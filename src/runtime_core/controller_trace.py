"""The trace port of a chain's controllers (``ChainStageController``,
``ChainOrchestrator``): ``trace(kind, fields)``, and ``no_trace``, the default, which
traces nothing (a controller that has it does not build the fields of a trace it would
drop)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Trace = Callable[[str, dict[str, Any]], None]


def no_trace(kind: str, fields: dict[str, Any]) -> None:
    pass
