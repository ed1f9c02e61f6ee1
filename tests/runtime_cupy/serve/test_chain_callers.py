"""What a warm chain's callers may do, and what becomes of a run its caller leaves
(``serve.chain.WarmChain``).

- ``generate``, ``close`` and ``start`` from a run's callback (the chain's own thread)
  are refused at once with ``ChainError``; ``generate`` hung for good, the chain and its
  ``close`` with it.
- A caller that stops waiting in ``generate`` (Ctrl-C, an ``on_run`` that raises) has its
  run cancelled: it went on streaming, in its place and KV memory, to a caller gone.
- ``runtime_cupy.generate`` raises what its ``on_token`` raised once the run is torn
  down, as ``runtime_sim.generate`` does (it returned "cancelled" with no fault).
- A start interrupted (Ctrl-C) stops and reaps its stages, and the next start works: the
  next one returned at once, never ready, the stages left running until ``close``.
- A chain dropped without ``close`` is stopped when it is collected: its stages ran on
  until the interpreter exited.
- A ``generate`` that races ``close`` raises ``ChainClosing``, a ``ChainError`` (it was a
  bare ``RuntimeError`` that a caller's ``except ChainError`` missed).
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from runtime_cupy import generate
from runtime_cupy.serve.chain import ChainClosing, ChainError, WarmChain
from runtime_cupy.serve.chain_plans import new_serve_run_id
from runtime_sim import generate as simulate
from tests.support.hygiene import alive, wait_gone

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process

PROMPT = [5, 77, 30, 12, 9]


@pytest.fixture(scope="module")
def chain(tiny: str) -> Iterator[WarmChain]:
    with WarmChain(tiny, stages=2, context=64) as c:
        yield c


def _in_thread(call: Callable[[], Any], bound_s: float = 60.0) -> Any:
    """``call()`` in a thread of its own: what it returned or raised, failing the test
    (not hanging it) when it has not returned within ``bound_s``."""
    out: list[Any] = []

    def work() -> None:
        try:
            out.append(call())
        except BaseException as exc:
            out.append(exc)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(bound_s)
    assert out, f"the call did not return within {bound_s} s"
    return out[0]


def test_a_callback_that_calls_generate_or_close_is_refused_at_once(chain: WarmChain) -> None:
    refused: list[BaseException] = []

    def on_token(token: int) -> None:
        if refused:
            return
        for call in (
            lambda: chain.generate(PROMPT, max_tokens=2),
            chain.close,
            chain.start,
        ):
            try:
                call()
            except BaseException as exc:
                refused.append(exc)

    result = _in_thread(lambda: chain.generate(PROMPT, max_tokens=4, on_token=on_token))
    assert not isinstance(result, BaseException), result
    assert result.result.outcome == "completed", result.result.fault
    assert [type(e) for e in refused] == [ChainError] * 3
    assert [str(e).split(" (", 1)[0] for e in refused] == [
        "generate() called from the chain's own thread",
        "close() called from the chain's own thread",
        "start() called from the chain's own thread",
    ]
    assert chain.ready
    assert chain.generate(PROMPT, max_tokens=2).result.outcome == "completed"


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_a_caller_that_stops_waiting_has_its_run_cancelled(
    chain: WarmChain, error: type[BaseException]
) -> None:
    """``on_run`` raising stands for a Ctrl-C in the caller's wait: both leave it."""
    runs: list[Any] = []
    heard: list[int] = []

    def on_run(run: Any) -> None:
        runs.append(run)
        raise error("the caller left")

    with pytest.raises(error, match="the caller left"):
        chain.generate(PROMPT, max_tokens=50, on_token=heard.append, on_run=on_run)
    outcome = runs[0].wait(30)
    assert outcome is not None, "the run left by its caller did not end"
    assert outcome.finished is not None and outcome.finished.outcome.value == "CANCELLED"
    assert len(heard) < 50
    assert runs[0].cancelled == f"its caller stopped waiting ({error.__name__})"
    deadline = time.monotonic() + 10.0
    while chain.in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert chain.in_flight == 0


def test_a_callback_that_calls_generate_is_named_not_hung_in_a_callback_error(
    chain: WarmChain,
) -> None:
    """Left to raise, the refusal ends its run and its caller's ``generate`` raises it."""

    def on_token(token: int) -> None:
        chain.generate(PROMPT, max_tokens=2)

    raised = _in_thread(lambda: chain.generate(PROMPT, max_tokens=4, on_token=on_token))
    assert isinstance(raised, ChainError), raised
    assert "from the chain's own thread" in str(raised)
    assert chain.ready


def test_runtime_cupy_generate_raises_what_on_token_raised_as_runtime_sim_does(
    tiny: str,
) -> None:
    def on_token(token: int) -> None:
        raise ZeroDivisionError("the caller's bug")

    for gen in (simulate, generate):
        with pytest.raises(ZeroDivisionError, match="the caller's bug"):
            gen(tiny, PROMPT, stages=2, max_tokens=4, on_token=on_token)


def test_an_interrupted_start_stops_its_stages_and_the_next_start_works(tiny: str) -> None:
    """Ctrl-C comes while the stages bind: here from the chain's ``run_ids``, which the
    run that binds them calls first."""
    calls: list[str] = []

    def run_ids() -> str:
        calls.append("")
        if len(calls) == 1:
            raise KeyboardInterrupt
        return new_serve_run_id()

    chain = WarmChain(tiny, stages=2, context=64, run_ids=run_ids)
    try:
        with pytest.raises(KeyboardInterrupt):
            chain.start()
        assert not chain.ready and chain.handles() == ()
        chain.start()
        assert chain.ready
        assert chain.generate(PROMPT, max_tokens=2).result.outcome == "completed"
    finally:
        chain.close()


def _dropped_chain(tiny: str) -> list[int]:
    """A chain started and dropped without ``close``: its stages' pids."""
    chain = WarmChain(tiny, stages=2, context=64)
    chain.start()
    assert chain.generate(PROMPT, max_tokens=2).result.outcome == "completed"
    pids = list(chain.pids())
    assert all(alive(p) for p in pids)
    return pids


def test_a_chain_dropped_without_close_is_stopped_when_collected(tiny: str) -> None:
    before = set(threading.enumerate())
    pids = _dropped_chain(tiny)  # collected as it returns: no reference is left
    gc.collect()
    assert not wait_gone(pids, 20.0), "the stages of a dropped chain outlived it"
    for thread in set(threading.enumerate()) - before:  # its loop's, and the finalizer's
        thread.join(10.0)
        assert not thread.is_alive(), thread.name


def test_a_generate_that_races_close_raises_a_chain_error(
    tiny: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    chain = WarmChain(tiny, stages=2, context=64, max_concurrent=1)
    chain.start()
    planning, closed = threading.Event(), threading.Event()
    plan = chain.plan

    def plan_as_the_chain_closes(*args: Any, **kwargs: Any) -> Any:
        planning.set()  # the run is being planned: close() now
        assert closed.wait(30)
        return plan(*args, **kwargs)

    monkeypatch.setattr(chain, "plan", plan_as_the_chain_closes)
    raised: list[BaseException] = []

    def call() -> None:
        try:
            chain.generate(PROMPT, max_tokens=2)
        except BaseException as exc:
            raised.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    try:
        assert planning.wait(30)
        chain.close()
    finally:
        closed.set()
        caller.join(30)
        chain.close()
    (exc,) = raised
    assert type(exc) is ChainClosing and isinstance(exc, ChainError), repr(exc)
