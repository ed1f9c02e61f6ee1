"""``Engine.close`` called again on the same thread while its first call starts the
closing thread: a second signal (Ctrl-C, then a supervisor's SIGTERM) whose handler runs
while the first one's ``Thread.start`` waits for the thread to begin. The closer was
already named, not yet started: the second call joined it and raised ``RuntimeError:
cannot join thread before it is started`` through uvicorn, and the server's own close
after it raised again (a traceback, the stage processes left to the atexit reaper). The
second call now returns at once, and the first closes everything."""

from __future__ import annotations

import threading

import pytest

from runtime_cupy.serve.chain import WarmChain
from runtime_cupy.serve.engine import Engine

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process


def test_close_called_again_while_its_thread_starts_returns_and_the_first_closes(
    tiny_chat: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(WarmChain(tiny_chat, stages=2, context=128, max_concurrent=1))
    engine.start()
    start = threading.Thread.start
    again: list[bool] = []

    def start_with_a_signal_first(thread: threading.Thread) -> None:
        if thread.name == "close" and not again:  # the second signal's handler, first
            again.append(engine.close(timeout_s=0))
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_with_a_signal_first)
    assert engine.close(timeout_s=60)
    assert again == [False]
    assert engine.close(timeout_s=0)  # closed: every later call says so
