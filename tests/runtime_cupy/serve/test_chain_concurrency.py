"""Several runs in flight through one chain of stage processes (CONCURRENT_RUNS.md,
issue 22): ``WarmChain.generate`` from many threads at once.

- Eight concurrent runs on 2 and on 3 stages, greedy and seeded, each give the tokens of
  the same request served alone, and the stages batched rows of several runs together.
- Isolation: one run cancelled mid-stream ends alone, and one whose KV cache a stage
  cannot reserve (``ProvisionRefused``) while the others hold theirs waits for one of
  them to end (``runtime_core.kv_waits``); the others, and it, complete with their solo
  tokens.
- A stage killed with 4 runs in flight: all 4 end naming the stage, its node, its host
  and the cause; nothing is left of the chain (processes, shared memory, edge folders);
  the next requests are served by a chain started again.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import pytest

from runplan import SamplingConfig
from runtime_cupy.serve.chain import WarmChain, WarmResult
from tests.support.hosts import FaultyHost
from tests.support.hygiene import alive, run_resources, wait_gone

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process

#: Eight requests: prompts of different lengths, greedy and seeded sampling.
REQUESTS: list[dict[str, Any]] = [
    {"prompt": [5, 77, 30, 12, 9], "max_tokens": 12},
    {"prompt": [3, 4], "max_tokens": 9},
    {"prompt": [100, 7, 7, 7, 7, 7, 7, 2], "max_tokens": 14},
    {"prompt": [42], "max_tokens": 10},
    {"prompt": [5, 77, 30], "max_tokens": 11, "temperature": 1.3, "top_k": 40, "seed": 5},
    {"prompt": [3, 4], "max_tokens": 9, "temperature": 0.9, "top_p": 0.9, "seed": 11},
    {"prompt": [9, 8, 7, 6], "max_tokens": 13, "temperature": 1.1, "seed": 12},
    {"prompt": [64, 1], "max_tokens": 8, "temperature": 1.3, "top_k": 5, "seed": 7},
]


def _generate(chain: WarmChain, request: dict[str, Any], **more: Any) -> WarmResult:
    kwargs = {k: v for k, v in request.items() if k != "prompt"}
    return chain.generate(request["prompt"], **kwargs, **more)


def _at_once(calls: list[Callable[[], WarmResult]]) -> list[WarmResult]:
    """Run every call in a thread of its own, all released together."""
    results: list[WarmResult | BaseException | None] = [None] * len(calls)
    gate = threading.Barrier(len(calls))

    def work(i: int) -> None:
        gate.wait()
        try:
            results[i] = calls[i]()
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    out: list[WarmResult] = []
    for r in results:
        if isinstance(r, BaseException):
            raise r
        assert r is not None, "a run did not end within two minutes"
        out.append(r)
    return out


def _batched_runs(result: WarmResult) -> list[int]:
    """The runs in each batch the stages ran, from the trace of the chain so far."""
    return [
        int(e["args"]["runs"])
        for e in result.result.trace or ()
        if e.get("ph") == "X" and e["name"] == "batch"
    ]


@pytest.mark.parametrize("stages", [2, 3])
def test_eight_concurrent_runs_each_give_their_solo_tokens(tiny: str, stages: int) -> None:
    with WarmChain(tiny, stages=stages, context=64, max_concurrent=8, trace=True) as chain:
        alone = [_generate(chain, r) for r in REQUESTS]
        for r in alone:
            assert r.result.outcome == "completed", r.result.fault
        together = _at_once([lambda r=r: _generate(chain, r) for r in REQUESTS])  # type: ignore[misc]
        for solo, run in zip(alone, together, strict=True):
            assert run.result.outcome == "completed", run.result.fault
            assert run.result.tokens == solo.result.tokens
        assert len({r.result.plan.run_id for r in together}) == len(REQUESTS)
        runs = [n for r in together for n in _batched_runs(r)]
        # Steps of several runs shared a batch: eight runs decoding at once, each stage
        # running one batch at a time, the records that wait meanwhile go in together
        # (the count of rows alone would depend on how the arrivals interleave).
        assert runs and max(runs) > 1


def test_a_cancelled_run_ends_alone_and_a_refused_cache_waits(tiny: str) -> None:
    # Stage 1's worker finds no room for the cache of the 7th run it opens: the bind run
    # is the 1st, the solo runs the 2nd to 5th, the three concurrent ones the 6th to 8th.
    host = FaultyHost({1: ["kv-full=7"]})
    with WarmChain(tiny, stages=2, context=64, max_concurrent=4, host=host) as chain:
        alone = [_generate(chain, r) for r in REQUESTS[:4]]
        assert all(r.result.outcome == "completed" for r in alone)
        runs: list[Any] = []
        results = _at_once(
            [lambda r=r: _generate(chain, r, on_run=runs.append) for r in REQUESTS[:3]]
        )  # type: ignore[misc]
        # Which request was the 7th depends on the order the runs were provisioned: it
        # waited while the others held their caches, and ran once one of them ended.
        assert sum(len(run.former_ids) for run in runs) == 1
        for solo, run in zip(alone, results, strict=False):
            assert run.result.outcome == "completed", run.result.fault
            assert run.result.tokens == solo.result.tokens
        assert chain.ready

        cancel: list[Any] = []

        def on_token(token: int) -> None:
            if cancel:
                cancel.pop().cancel("the client went away")

        def cancelled() -> WarmResult:
            request = {"prompt": [1, 2, 3], "max_tokens": 40}
            return _generate(chain, request, on_token=on_token, on_run=cancel.append)

        calls: list[Callable[[], WarmResult]] = [
            lambda r=r: _generate(chain, r)  # type: ignore[misc]
            for r in REQUESTS[:3]
        ]
        results = _at_once([*calls, cancelled])
        assert results[3].result.outcome == "cancelled"
        assert 1 <= len(results[3].result.tokens) < 40
        for solo, run in zip(alone[:3], results[:3], strict=True):
            assert run.result.outcome == "completed", run.result.fault
            assert run.result.tokens == solo.result.tokens
        assert chain.ready and chain.restarts == 0


def test_a_stage_killed_with_four_runs_in_flight(tiny: str) -> None:
    with WarmChain(tiny, stages=2, context=64, max_concurrent=4) as chain:
        solo = _generate(chain, REQUESTS[0])
        pids = chain.pids()
        chain_id = chain.chain_id
        killed = threading.Event()
        tokens = [0] * 4

        def counting(i: int) -> Callable[[int], None]:
            def on_token(token: int) -> None:
                tokens[i] += 1
                if min(tokens) >= 2 and not killed.is_set():
                    killed.set()
                    os.kill(pids[1], signal.SIGKILL)

            return on_token

        long = {"prompt": [5, 77, 30, 12, 9], "max_tokens": 60}
        results = _at_once(
            [lambda i=i: _generate(chain, long, on_token=counting(i)) for i in range(4)]  # type: ignore[misc]
        )
        assert killed.is_set()
        for r in results:
            fault = r.result.fault or ""
            assert r.result.outcome == "faulted", fault
            assert r.result.fault_stage == 1
            assert "stage-1" in fault and "this machine" in fault and "SIGKILL" in fault, fault
        assert not wait_gone(list(pids), 10.0)
        again = _generate(chain, REQUESTS[0])  # the chain is started again first
        assert again.result.outcome == "completed", again.result.fault
        assert again.result.tokens == solo.result.tokens
        assert again.restarted == (0, 1)
        assert run_resources(chain_id) == []  # the broken chain's links, by name
        assert not any(alive(p) for p in pids)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt, SystemExit])
def test_a_callers_token_callback_that_raises_ends_its_run_alone(
    tiny: str, error: type[BaseException]
) -> None:
    """A caller's ``on_token`` raised on the loop's thread: the loop ended, every run
    with it (reported cancelled), the chain still said ready and each later run was
    refused as "the chain is closing"; a ``KeyboardInterrupt`` or ``SystemExit`` did so
    after the ``Exception`` case was caught. Now that run alone is cancelled, naming what
    its callback raised, and its caller's ``generate`` raises it in the caller's thread;
    the others and the next run complete."""
    with WarmChain(tiny, stages=2, context=64, max_concurrent=4) as chain:
        alone = [_generate(chain, r) for r in REQUESTS[:2]]
        heard: list[int] = []

        def raising(token: int) -> None:
            heard.append(token)
            raise error("a bug in the caller's callback")

        runs: list[Any] = []
        raised: list[BaseException] = []

        def bad() -> WarmResult:
            request = {"prompt": [1, 2, 3], "max_tokens": 30}
            try:
                _generate(chain, request, on_token=raising, on_run=runs.append)
            except BaseException as exc:  # the callback's, raised in this thread
                raised.append(exc)
            return chain.result(runs[0])

        calls: list[Callable[[], WarmResult]] = [
            lambda r=r: _generate(chain, r)  # type: ignore[misc]
            for r in REQUESTS[:2]
        ]
        results = _at_once([*calls, bad])
        for solo, run in zip(alone, results[:2], strict=True):
            assert run.result.outcome == "completed", run.result.fault
            assert run.result.tokens == solo.result.tokens
        assert [(type(e), str(e)) for e in raised] == [(error, "a bug in the caller's callback")]
        assert results[2].result.outcome == "cancelled"
        assert heard == [results[2].result.tokens[0]]  # no callback after the one that raised
        assert runs[0].callback_failed == (
            f"its on_token raised {error.__name__}: a bug in the caller's callback"
        )
        assert chain.ready and chain.restarts == 0
        again = [_generate(chain, r) for r in REQUESTS[:2]]
        for solo, run_again in zip(alone, again, strict=True):
            assert run_again.result.tokens == solo.result.tokens


def test_runs_waiting_for_kv_memory_name_the_stage_of_the_chains_fault(tiny: str) -> None:
    """A stage killed with 2 runs in flight and 4 waiting for KV memory: every run ends
    faulted naming that stage (the waiting ones named none, and blamed the
    orchestrator)."""
    with WarmChain(tiny, stages=2, context=40, max_concurrent=2) as chain:
        chain.start()
        pids = chain.pids()
        started = threading.Event()
        runs = [
            chain.submit(
                [5 + i] * 10,
                max_tokens=30,
                sampling=SamplingConfig(),
                on_token=lambda t: started.set(),
            )
            for i in range(6)
        ]
        assert started.wait(60)
        assert sum(r.waiting_for_memory for r in runs) == 4
        os.kill(pids[1], signal.SIGKILL)
        for run in runs:
            assert run.wait(60) is not None
            result = chain.result(run).result
            fault = result.fault or ""
            assert result.outcome == "faulted", fault
            assert result.fault_stage == 1, fault
            assert "stage-1" in fault and "SIGKILL" in fault and "orchestrator" not in fault, fault
