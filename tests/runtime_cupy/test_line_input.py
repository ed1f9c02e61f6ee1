"""``cli.line_input.read_line``: a line read at a prompt that Ctrl-C or SIGTERM ends at
once, though the signal did not interrupt the wait for a key (it came while readline
wrote: ``tests/runtime_cupy/serve/test_chat.py`` has that on a terminal). Here the
signal is handled by another thread than the main one, which waits in a read that
nothing else ends; each handler runs once, and the handlers are given back after."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from runplan.interrupted import Interrupted, raise_interrupted
from runtime_cupy.cli.line_input import read_line


@pytest.fixture
def keys(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """``input`` as a wait for a key no signal interrupts unless sent to the main thread
    (the signal's handler runs in another thread, as when readline swallowed it); the
    descriptor that types a key. SIGTERM raises ``Interrupted`` meanwhile."""
    read_fd, write_fd = os.pipe()

    def waiting(_prompt: str) -> str:
        def elsewhere() -> None:
            time.sleep(0.3)  # the main thread in its read by now
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

        threading.Thread(target=elsewhere).start()
        return os.read(read_fd, 1).decode()

    monkeypatch.setattr("builtins.input", waiting)
    previous = signal.signal(signal.SIGTERM, raise_interrupted)
    try:
        yield write_fd
    finally:
        signal.signal(signal.SIGTERM, previous)
        os.close(read_fd)
        os.close(write_fd)


def test_a_signal_the_wait_did_not_see_still_ends_it(keys: int) -> None:
    timer = threading.Timer(10.0, os.write, (keys, b"x"))  # else: a key after 10 s
    timer.start()
    began = time.monotonic()
    try:
        with pytest.raises(Interrupted, match="SIGTERM"):
            read_line("> ")
    finally:
        timer.cancel()
    assert time.monotonic() - began < 5.0
    assert signal.getsignal(signal.SIGTERM) is raise_interrupted
    assert signal.set_wakeup_fd(-1) == -1  # none left set
    time.sleep(0.3)  # a copy sent again now would raise here
