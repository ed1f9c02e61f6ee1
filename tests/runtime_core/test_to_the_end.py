"""``runtime_core.interrupt.to_the_end``: a teardown run to its end however often it is
interrupted (Ctrl-C pressed again and again), the first interrupt handed back."""

from __future__ import annotations

import pytest

from runtime_core.interrupt import Interrupted, to_the_end


def test_each_interrupt_is_held_and_the_work_goes_on_to_its_end() -> None:
    done: list[str] = []
    interrupts = [KeyboardInterrupt("first"), Interrupted("SIGTERM"), KeyboardInterrupt()]

    def work() -> None:
        if interrupts:
            raise interrupts.pop(0)
        done.append("work")

    first = to_the_end(work, lambda: done.append("stop waiting"))
    assert isinstance(first, KeyboardInterrupt) and str(first) == "first"
    assert done == ["stop waiting"] * 3 + ["work"]


def test_an_interrupt_in_the_stop_waiting_is_held_too() -> None:
    calls: list[str] = []

    def on_interrupt() -> None:
        calls.append("on")
        if calls.count("on") == 1:
            raise KeyboardInterrupt("again")

    def work() -> None:
        calls.append("work")
        if calls.count("work") == 1:
            raise KeyboardInterrupt("first")

    first = to_the_end(work, on_interrupt)
    assert str(first) == "first"
    assert calls == ["work", "on", "on", "work"]


def test_no_interrupt_returns_none_and_an_error_goes_on_at_once() -> None:
    assert to_the_end(lambda: None, lambda: None) is None
    calls: list[str] = []

    def broken() -> None:
        calls.append("work")
        raise ValueError("broken")

    with pytest.raises(ValueError, match="broken"):
        to_the_end(broken, lambda: calls.append("on"))
    assert calls == ["work"]
