"""A stage process that loses its orchestrator (``stage_loop.StageProcess``, whose base
``OrchestratorLoss`` is): its lifeline closed, its control channel closed or broken, its
frame unreadable, SIGTERM or SIGHUP, its parent gone. Any of them is ``OrchestratorLost``
for every run held: the stage stops them and ends, sending nothing more; it logs the
loss once, naming what closed, since when, and when the orchestrator was last heard
from. A watchdog thread waits on the lifeline; if the loop has not finished within the
stop bound after the loss (a batch that runs on), it removes the chain's resources this
stage owns, lets go of the chain's entry of the registry of live chains
(``edges.live_chains``), and exits.

Resources. The stage makes its inbound link's ring once, when the first run comes
(EDGES_AND_WORKERS.md §3), and frees it when it ends, never its outbound link, which
belongs to the next stage. Only when the orchestrator is lost does a stage also free
every other hop of the chain on its host, whose owner may be gone with the
orchestrator (token-out's, the orchestrator; another stage, killed just before it); so
a chain whose orchestrator was killed leaves nothing behind while one of its stages on
the host lives to notice. SIGINT is ignored (Ctrl-C is the orchestrator's to handle); SIGTERM
and SIGHUP (its terminal gone with the orchestrator) stop the stage as a lost
orchestrator does.

Exit status of the loop: ``EXIT_STOPPED`` after the channel closed while no run was
held, ``EXIT_LOST`` after the orchestrator was lost while runs were held (the stage
process's ``EXIT_NO_THREAD`` where it could not start its threads).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from typing import TYPE_CHECKING

from runplan.fsm import stage as fsm
from runtime_core.chain_stage import ChainStageController
from runtime_cupy.edges.links import ProcessLinks, chain_hops
from runtime_cupy.process.control_channel import ControlChannel
from runtime_cupy.process.tracing import TraceLog

EXIT_STOPPED = 0
EXIT_LOST = 3
#: The stage process could not start a thread of its own (``runtime_core.threads``):
#: threads, processes or address space ran out on its host; its log's last line says.
EXIT_NO_THREAD = 4

# The stage process's: its log lines keep their logger.
log = logging.getLogger("runtime_cupy.process.stage_process")


class OrchestratorLoss:
    """The loss of a ``StageProcess``'s orchestrator, its base: what the process holds is
    set by ``StageProcess.__init__``."""

    stage_index: int
    stage_count: int | None
    channel: ControlChannel
    channel_broken: bool
    lifeline_fd: int | None
    stop_s: float
    trace: TraceLog
    parent_pid: int
    links: ProcessLinks
    controller: ChainStageController
    lost: str | None
    _lost_flag: threading.Event
    _lost_why: str
    _lost_since: tuple[float, float] | None
    _done: threading.Event
    _wake_w: int
    _held_when_lost: bool
    _place_when_lost: tuple[int, int] | None

    if TYPE_CHECKING:

        def _drain_control(self) -> None: ...

        def save_trace(self) -> None: ...

    def _check_lost(self) -> None:
        if self._lost_flag.is_set() and self.lost is None:
            # What the orchestrator wrote before it went (a provision, say) is still in
            # the socket: read it first, so that the stage knows what it holds.
            self._drain_control()
            self._lose(self._lost_why)
        if self.channel_broken:
            self._lose("the control channel broke")

    def _lose(self, why: str) -> None:
        if self.lost is not None:
            return
        self.lost = why
        self._held_when_lost = bool(self.controller.runs)
        # Before the runs go (a run's provision may be all that says the chain's length).
        self._place_when_lost = self._place()
        # Said once: the loop loses its orchestrator once, whatever closes after.
        if self._held_when_lost:
            log.warning("orchestrator lost (%s): stopping its runs", self._loss_detail(why))
        else:
            log.info("the chain closed (%s): exiting", self._loss_detail(why))
        self.trace.instant("orchestrator lost", why=why)
        self.controller.handle(fsm.OrchestratorLost())

    # -- the orchestrator's death -------------------------------------------------------------
    def _watch(self) -> None:
        """Wait on the lifeline; once it ends, wake the loop, and exit if the loop has not
        finished within the stop bound (a batch that runs on)."""
        assert self.lifeline_fd is not None
        with contextlib.suppress(OSError):
            while os.read(self.lifeline_fd, 1):
                pass
        if self._done.is_set():
            return
        self.notice_loss(self._lifeline_closed())
        if self._done.wait(self.stop_s):
            return
        if self.lost is None:  # the loop never got to say it (a batch that runs on)
            why = self._loss_detail(self._lost_why)
            log.error("orchestrator lost (%s), not stopped within %.1f s: exiting now",
                      why, self.stop_s)  # fmt: skip
        else:
            log.error("not stopped within %.1f s of the loss: exiting now", self.stop_s)
        self._remove_resources()
        self.links.release_entry()  # the last of the chain here frees it, and the registry
        self.save_trace()  # the orchestrator is gone: removed, with its folder
        with contextlib.suppress(Exception):
            logging.shutdown()
        os._exit(EXIT_LOST)

    def _lifeline_closed(self) -> str:
        """Which lifeline closed: its write end is held by the process that started this
        stage (the orchestrator on one host, the stage's supervisor on a Ray host)."""
        return f"its lifeline closed (its write end held by pid {self.parent_pid})"

    def _loss_detail(self, why: str) -> str:
        """``why``, since when (the first notice of the loss, local time) and when the
        orchestrator was last heard from before it."""
        if self._lost_since is None:  # the channel's end, seen by the loop itself
            self._lost_since = (time.time(), time.monotonic())
        wall, mono = self._lost_since
        since = time.strftime("%H:%M:%S", time.localtime(wall)) + f".{int(wall * 1000) % 1000:03d}"
        heard = self.channel.heard_s
        last = (
            "nothing heard from it before"
            if heard is None
            else f"last heard from it {max(0.0, mono - heard):.1f} s before"
        )
        return f"{why}; since {since}, {last}"

    def orchestrator_gone(self) -> bool:
        """Whether the process that started this stage is gone (any thread): its
        lifeline hangs up (no write end is left open), or this process has another
        parent now. Not the control channel's end: the orchestrator closes that first
        when it closes the chain, and reads the stage's trace once the stage exited."""
        if os.getppid() != self.parent_pid:
            return True
        if self.lifeline_fd is None:
            return False
        poller = select.poll()
        poller.register(self.lifeline_fd, select.POLLIN)
        try:
            return any(events & select.POLLHUP for _, events in poller.poll(0))
        except OSError:
            return False

    def notice_loss(self, why: str) -> None:
        """From another thread or a signal handler: the loop stops at its next turn."""
        if self._lost_since is None:
            self._lost_since = (time.time(), time.monotonic())
        self._lost_why = why
        self._lost_flag.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"!")

    def _remove_resources(self) -> None:
        """Free what this stage owns: its inbound link's resources on this host, and, if
        the orchestrator is lost, those of every hop of the chain on this host, whose
        owners may be gone with it (token-out's, the orchestrator's; another stage's
        inbound ring, when that stage was killed just before the orchestrator: it
        leaked, and no one was left to free it by name). Idempotent, any thread."""
        links = self.links
        links.remove_inbound()
        place = self._place()
        if (self.lost is not None or self._lost_flag.is_set()) and place is not None:
            index, count = place
            links.remove_hops((index + 1,))  # its address withdrawn too (a cluster's)
            links.remove_names(chain_hops(count))

    def _place(self) -> tuple[int, int] | None:
        """This stage's index and the chain's stage count, as the launcher said them, else
        once a provision said them (any thread)."""
        if self.stage_count is not None:
            return self.stage_index, self.stage_count
        if self._place_when_lost is not None:
            return self._place_when_lost
        c = self.controller
        known = c.chain or next(
            (s.provision for s in list(c.runs.values()) if s.provision is not None), None
        )
        return None if known is None else (known.stage_index, known.stage_count)
