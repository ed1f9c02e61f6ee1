"""What people and programs see of slices while they travel: one progress bar per stage
on standard error (``SliceBars``: bytes, rate, time left), log lines (``SliceLog``, for
``serve``), one sentence per stage (``describe``: what ``/health`` says it waits for)
and the figures of a run's result (``figures``: bytes and seconds per stage)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from runplan.terminal import CommandConsole
from runtime_cupy.slices.server import StageTransfer

log = logging.getLogger("runtime_cupy.slices")

#: How often ``SliceLog`` logs a stage's progress while its slice travels.
LOG_EVERY_S = 2.0


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def describe(t: StageTransfer) -> str:
    """``stage 1's slice (host 10.0.0.2): 40.0 of 100.0 MiB, 12.5 MiB/s, 5 s left``."""
    who = f"stage {t.stage_index}'s slice" + (f" (host {t.host})" if t.host else "")
    if t.state == "failed":
        return f"{who}: failed: {t.error}"
    if t.state == "local":
        return f"{who}: the host had it ({_mib(t.sent_bytes)} sent: the header)"
    rate = f"{_mib(t.rate)}/s"
    if t.state == "done":
        return f"{who}: {_mib(t.sent_bytes)} in {t.seconds:.1f} s ({rate})"
    left = t.time_left_s
    eta = f", {left:.0f} s left" if left is not None else ""
    return f"{who}: {_mib(t.sent_bytes)} of {_mib(t.total_bytes)}, {rate}{eta}"


def figures(transfers: Iterable[StageTransfer]) -> list[dict[str, Any]]:
    """Per stage that asked for its slice: state, bytes (header, tensors, sent, and what
    the stage read off its socket) and seconds."""
    return [
        {
            "stage_index": t.stage_index,
            "node_id": t.node_id,
            "host": t.host,
            "state": t.state,
            "header_bytes": t.header_bytes,
            "tensor_bytes": t.tensor_bytes,
            "sent_bytes": t.sent_bytes,
            "received_bytes": t.received_bytes,
            "seconds": round(t.seconds, 3),
            "error": t.error,
        }
        for t in transfers
    ]


class SliceLog:
    """A slice server's ``on_change``: a log line per stage when its transfer starts
    and ends, and every ``LOG_EVERY_S`` between."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[str, float]] = {}
        self._lock = threading.Lock()

    def __call__(self, t: StageTransfer) -> None:
        now = time.monotonic()
        with self._lock:
            state, at = self._last.get(t.stage_index, ("", 0.0))
            if state == t.state and now - at < LOG_EVERY_S:
                return
            self._last[t.stage_index] = (t.state, now)
        (log.warning if t.state == "failed" else log.info)("%s", describe(t))


class SliceBars:
    """One bar per stage whose slice travels, on standard error (a slice server's
    ``on_change``); ``stop()`` ends the display."""

    def __init__(self, console: Console | None = None) -> None:
        self.progress = Progress(
            TextColumn("{task.description}", markup=False),  # a host's name as it is
            BarColumn(),
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=console or CommandConsole(stderr=True),
        )
        self._tasks: dict[int, TaskID] = {}
        self._lock = threading.Lock()
        self._started = False

    def __call__(self, t: StageTransfer) -> None:
        with self._lock:
            if not self._started:
                self.progress.start()
                self._started = True
            task = self._tasks.get(t.stage_index)
            label = f"stage {t.stage_index} slice" + (f" -> {t.host}" if t.host else "")
            if task is None:
                task = self._tasks[t.stage_index] = self.progress.add_task(label, total=None)
            if t.state == "failed":
                label += " failed"
            elif t.state == "local":
                label += " (had it)"
            self.progress.update(
                task, description=label, completed=t.sent_bytes, total=t.total_bytes or None
            )

    def stop(self) -> None:
        with self._lock:
            if self._started:
                self.progress.stop()
                self._started = False
