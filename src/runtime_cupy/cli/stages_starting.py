"""What a command shows on standard error while its stages start (a run's, or the chain
of a prompts file's batch): ``starting N stage processes``, then ``stages ready: k of
N`` as each stage is bound, and each slice's bar as it travels to a Ray host without the
model (one live display at a time: the bars take the line's place). Where the host has
no thread left for the display's refresh, the stages start without it, and the run
meets the shortage where it counts, naming it (it was a ``RuntimeError`` traceback
before any stage started)."""

from __future__ import annotations

from types import TracebackType

from rich.console import Console

from runtime_core.threads import is_thread_refused
from runtime_cupy.cli.arguments import stage_processes
from runtime_cupy.slices.progress import SliceBars
from runtime_cupy.slices.server import StageTransfer


class StagesStarting:
    """The display of ``stages`` starting on ``err``, from ``with`` to its end (or to
    the last stage bound); ``on_load`` and ``on_slice`` are what ``generate`` and
    ``generate_batch`` call."""

    def __init__(self, err: Console, stages: int) -> None:
        self.stages = stages
        self.status = err.status(f"starting {stage_processes(stages)}")
        self.ready: set[int] = set()
        self.bars = SliceBars(err)

    def on_slice(self, transfer: StageTransfer) -> None:
        self.status.stop()  # one live display at a time: the bars
        self.bars(transfer)

    def on_load(self, stage: int, _done: int, _total: int) -> None:
        self.ready.add(stage)
        self.status.update(f"stages ready: {len(self.ready)} of {self.stages}")
        if len(self.ready) == self.stages:
            self.status.stop()

    def __enter__(self) -> StagesStarting:
        try:
            self.status.start()
        except RuntimeError as exc:  # its refresh thread refused: the stages start unseen
            if not is_thread_refused(exc):
                raise
            self.status.stop()  # what the display took back (the thread was never started)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.status.stop()
        self.bars.stop()
