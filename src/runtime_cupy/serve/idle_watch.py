"""The warm stages between runs: a thread that reads their control channels while no
run does, so that their heartbeats are heard (and their sockets drained) and a stage
that went silent or away while idle is named within the heartbeat bound, not at the
next request.

A run reads the channels itself (``process.launcher.ProcessRun``); so does the chain while it
starts stages again. Both take the channels with ``paused()``: the watcher lets go of
them at once (a wake-up pipe ends its wait) and waits until they are handed back.

What the watcher finds goes to ``on_lost(stage_index, why)``, once per stage handle:
``stage 1 on 'stage-1': no heartbeat for 5.2 s``, or how it ended (its channel closed,
its process exited). The chain then counts that stage as broken until it is started
again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from collections.abc import Callable, Iterator

from runtime_cupy.hosts.port import StageHandle
from runtime_cupy.process.control_channel import Incoming

log = logging.getLogger("runtime_cupy.serve.idle_watch")

#: The longest wait between two looks at the stages when nothing is heard.
IDLE_LOOK_S = 1.0

#: ``on_lost(stage_index, why)``: a stage went silent or away while idle.
OnLost = Callable[[int, str], None]


class IdleWatch:
    """Watches ``handles()`` (the chain's current stage handles, any thread) with the
    heartbeat bound ``bound_s``."""

    def __init__(
        self, handles: Callable[[], tuple[StageHandle, ...]], bound_s: float, on_lost: OnLost
    ) -> None:
        self._handles = handles
        self.bound_s = bound_s
        self._on_lost = on_lost
        self._cond = threading.Condition()
        self._holders = 0  # runs or restarts that hold the channels now
        self._watching = False  # the watcher is inside a look at the channels
        self._closed = False
        self._reported: set[StageHandle] = set()  # handles already reported lost
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="idle-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the channels: the watcher reads none of them until the block ends."""
        with self._cond:
            self._holders += 1
            try:
                self._wake()
                while self._watching:
                    self._cond.wait()
            except BaseException:  # Ctrl-C while waiting: the channels were not taken
                self._holders -= 1
                self._cond.notify_all()
                raise
        try:
            yield
        finally:
            with self._cond:
                self._holders -= 1
                self._cond.notify_all()

    def close(self) -> None:
        """Stop watching (idempotent); the channels are the caller's again."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._wake()
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"!")

    # -- the thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while self._holders and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                self._watching = True
            try:
                self._look()
            except Exception:  # a bug: logged, and the watch goes on
                log.exception("watching the idle stages failed")
                time.sleep(IDLE_LOOK_S)
            finally:
                with self._cond:
                    self._watching = False
                    self._cond.notify_all()

    def _look(self) -> None:
        """One wait on the channels (until something comes, the next heartbeat is due,
        or a run wants them), then what came and who is silent."""
        current = self._handles()
        self._reported.intersection_update(current)  # those retired are forgotten
        handles = [h for h in current if h not in self._reported]
        by_fd = {h.channel.fileno(): h for h in handles if h.channel.fileno() >= 0}
        now = time.monotonic()
        until = now + IDLE_LOOK_S
        for h in handles:
            heard = h.channel.heard_s
            if heard is not None:
                until = min(until, heard + self.bound_s)
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        for fd in by_fd:
            poller.register(fd, select.POLLIN)
        ready = poller.poll(max(0.0, until - now) * 1000.0)
        for fd, _events in ready:
            if fd == self._wake_r:
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 4096)
                continue
            handle = by_fd[fd]
            for item in handle.channel.receive():
                what = type(item.message).__name__ if isinstance(item, Incoming) else item
                log.warning("stage %d sent between runs: %s", handle.stage_index, what)
        now = time.monotonic()
        for h in handles:
            why = self._lost(h, now)
            if why is not None:
                self._reported.add(h)
                self._on_lost(h.stage_index, why)

    def _lost(self, handle: StageHandle, now: float) -> str | None:
        where = f"stage {handle.stage_index} on {handle.node_id!r}"
        if handle.channel.eof or handle.exited():
            return f"{where}: {handle.exit_reason() or 'its control channel closed'}"
        silent = handle.channel.silent_s(now)
        if silent is not None and silent > self.bound_s:
            return f"{where}: no heartbeat for {silent:.1f} s"
        return None
