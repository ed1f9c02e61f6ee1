"""A run that a stage cannot reserve the KV cache of (``ProvisionRefused``) waits for
memory while another run on the chain holds it, and is offered again when that run ends
(CONCURRENT_RUNS.md §5, ``runtime_core.kv_waits``); one that could never fit ends faulted
(``KV_CACHE_UNAVAILABLE``), its fault naming what it needs against the stage's whole
budget; one cancelled while it waits ends at once, alone. Stage 1's worker finds no
room for the cache of the N-th run it opens (``kv-full=N``; the run that binds the stages
is the 1st).

The server counts a request whose run waits for memory apart from those running
(``gguf_pipeline_runs_waiting_for_memory``), and it keeps its place among
``--max-concurrent``: a later request waits in the queue meanwhile."""

from __future__ import annotations

import threading

import pytest

from runplan import SamplingConfig
from runplan.messages import StopReason
from runtime_cupy.process.chain_run import ChainRun
from runtime_cupy.serve.chain import WarmChain
from runtime_cupy.serve.engine import Engine
from tests.support.hosts import FaultyHost
from tests.support.servers import idle, metrics, serving, wait_for

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process

GREEDY = SamplingConfig()
LONG = (5, 77, 30, 12, 9)
SHORT = (3, 4)


def test_a_run_refused_while_another_holds_the_memory_waits_and_completes(tiny: str) -> None:
    # Opens on stage 1: the bind run, the short run alone, the long run, the short run
    # again while the long one runs (refused), then the short run offered again.
    host = FaultyHost({1: ["kv-full=4"]})
    with WarmChain(tiny, stages=2, context=64, max_concurrent=2, host=host) as chain:
        alone = chain.result(chain.submit(SHORT, max_tokens=9, sampling=GREEDY))
        assert alone.result.outcome == "completed", alone.result.fault
        later: list[ChainRun] = []
        handed = threading.Event()

        def on_token(token: int) -> None:  # the long run's first token: it holds its cache
            if not later:
                later.append(chain.submit(SHORT, max_tokens=9, sampling=GREEDY))
                handed.set()

        long = chain.submit(LONG, max_tokens=40, sampling=GREEDY, on_token=on_token)
        long_result = chain.result(long)
        assert handed.wait(60)
        short = later[0]
        short_result = chain.result(short)

        assert long_result.result.outcome == "completed", long_result.result.fault
        assert short_result.result.outcome == "completed", short_result.result.fault
        assert short_result.result.tokens == alone.result.tokens
        assert len(short.former_ids) == 1  # refused once, offered again under a new id
        assert short.run_id not in short.former_ids
        # It started once the long run had ended and freed its cache.
        long_outcome, short_outcome = long.wait(), short.wait()
        assert long_outcome is not None and short_outcome is not None
        assert short_outcome.token_times_s[0] > long_outcome.ended_s
        assert chain.in_flight == 0
        assert all(held == 0 for _, held, _ in chain.kv_in_use())


def test_a_run_refused_when_no_other_run_holds_memory_never_fits(tiny: str) -> None:
    # Opens on stage 1: the bind run, then this run, refused with nothing else running,
    # then this run offered again alone, refused again.
    host = FaultyHost({1: ["kv-full=2", "kv-full=3"]})
    with WarmChain(tiny, stages=2, context=64, max_concurrent=2, host=host) as chain:
        run = chain.submit(SHORT, max_tokens=9, sampling=GREEDY)
        result = chain.result(run).result
        assert result.outcome == "faulted"
        assert result.fault_stage == 1
        fault = result.fault or ""
        needed = run.plan.stages[1].kv_bytes
        budget = run.plan.stages[1].kv_budget_bytes
        assert "KV_CACHE_UNAVAILABLE" in fault.upper()
        assert f"needs {needed} bytes" in fault
        assert f"whole budget of {budget}" in fault
        assert "no other run on the chain holds any of it to free: it never fits" in fault
        assert len(run.former_ids) == 1  # offered again once, alone, no more
        # The chain is whole: the next run is served.
        again = chain.result(chain.submit(SHORT, max_tokens=9, sampling=GREEDY)).result
        assert again.outcome == "completed", again.fault


def test_a_run_waiting_for_memory_is_cancelled_alone(tiny: str) -> None:
    # Opens on stage 1: the bind run, the long run, the short run (refused).
    host = FaultyHost({1: ["kv-full=3"]})
    with WarmChain(tiny, stages=2, context=64, max_concurrent=2, host=host) as chain:
        later: list[ChainRun] = []
        waited: list[bool] = []

        def on_token(token: int) -> None:
            if not later:
                later.append(chain.submit(SHORT, max_tokens=9, sampling=GREEDY))
            elif not waited and later[0].handle is not None:
                finished = later[0].handle.finished
                if finished is not None and not later[0].done:  # refused, held
                    waited.append(True)
                    later[0].cancel("the client went away")

        long = chain.submit(LONG, max_tokens=40, sampling=GREEDY, on_token=on_token)
        long_result = chain.result(long).result
        short = later[0]
        short_outcome = short.wait(60)
        assert waited == [True]
        assert short_outcome is not None and short_outcome.finished is not None
        assert short_outcome.finished.outcome is StopReason.CANCELLED
        assert short.former_ids == ()  # never offered again
        assert long_result.outcome == "completed", long_result.fault
        long_outcome = long.wait()
        assert long_outcome is not None and short_outcome.ended_s < long_outcome.ended_s
        assert chain.in_flight == 0


def test_two_runs_refused_at_once_do_not_wait_for_each_other(tiny: str) -> None:
    """Stage 1 refuses the 2nd and 3rd runs it opens, submitted together with no other
    run on the chain: each counted the other's reservation as memory that would free,
    and both waited for ever. With no run left to end, a held run is offered again at
    once (one at a time), and one refused with nothing else holding memory is offered
    again once before it never fits: both complete."""
    host = FaultyHost({1: ["kv-full=2", "kv-full=3"]})
    with WarmChain(tiny, stages=2, context=64, max_concurrent=2, host=host) as chain:
        b = chain.submit(SHORT, max_tokens=9, sampling=GREEDY)
        c = chain.submit(LONG, max_tokens=9, sampling=GREEDY)
        rb, rc = chain.result(b).result, chain.result(c).result
        assert (rb.outcome, rc.outcome) == ("completed", "completed"), (rb.fault, rc.fault)
        assert b.former_ids and c.former_ids  # each was refused and offered again
        assert chain.in_flight == 0


def test_a_cancel_between_the_refusal_and_the_hold_is_not_lost(tiny: str) -> None:
    """The caller cancels (a client gone) after the stage refused the run and before the
    runner held it: the run ends cancelled and is not offered again."""
    host = FaultyHost({1: ["kv-full=3"]})
    with WarmChain(tiny, stages=2, context=64, max_concurrent=2, host=host) as chain:
        o = chain._runner.orchestrator
        later: list[ChainRun] = []
        asked: list[str] = []
        heard = o.handle

        def handle(event: object) -> None:  # the refused run's machine just ended
            heard(event)
            run = later[0] if later else None
            if run is not None and not asked and run.handle and run.handle.finished:
                asked.append(run.run_id)
                run.cancel("client went away")

        o.handle = handle  # type: ignore[method-assign]

        def on_token(token: int) -> None:
            if not later:
                later.append(chain.submit(SHORT, max_tokens=9, sampling=GREEDY))

        long = chain.submit(LONG, max_tokens=40, sampling=GREEDY, on_token=on_token)
        assert chain.result(long).result.outcome == "completed"
        short = chain.result(later[0]).result
        assert asked and short.outcome == "cancelled" and not short.tokens
        assert later[0].former_ids == ()  # never offered again
        assert chain.in_flight == 0


RUNNING = "gguf_pipeline_requests_running"
HELD = "gguf_pipeline_runs_waiting_for_memory"
QUEUED = "gguf_pipeline_queue_length"


def test_the_server_counts_a_request_waiting_for_memory_apart_and_keeps_its_place(
    tiny_chat: str,
) -> None:
    # Opens on stage 1: the bind run, A, then B (refused while A holds its cache). Stage
    # 0 sleeps 2 s in each run's decode steps 1, 2 and 3: B's run ends (and is held) once
    # stage 0 stopped it, between two of A's steps, and waits while A sleeps in the next.
    delays = ["step-delay=1:2", "step-delay=2:2", "step-delay=3:2"]
    host = FaultyHost({0: delays, 1: ["kv-full=3"]})
    chain = WarmChain(tiny_chat, stages=2, context=128, max_concurrent=2, host=host)
    with serving(Engine(chain, max_queue=2)) as server:
        c = server.client()
        msg = [{"role": "user", "content": "Tell me a story."}]
        answers: list[str | None] = []

        def ask() -> None:
            r = c.chat.completions.create(
                model="tiny-chat", messages=msg, max_tokens=4, temperature=0
            )
            answers.append(r.choices[0].finish_reason)

        seen: dict[str, float] = {}

        def scraped(name: str) -> bool:  # one scrape, kept whole: its values agree
            seen.clear()
            seen.update(metrics(server.base_url))
            return seen[name] == 1

        threads = [threading.Thread(target=ask) for _ in range(3)]
        threads[0].start()  # A
        wait_for(lambda: scraped(RUNNING), 30, "A to run")
        threads[1].start()  # B: refused, held for memory
        wait_for(lambda: scraped(HELD), 30, "B to wait for memory")
        assert (seen[RUNNING], seen[HELD], seen[QUEUED]) == (1, 1, 0), seen
        threads[2].start()  # C: B keeps its place, so C waits in the queue
        wait_for(lambda: scraped(QUEUED), 30, "C to be queued")
        assert (seen[RUNNING], seen[HELD], seen[QUEUED]) == (1, 1, 1), seen
        for t in threads:
            t.join(120)
        assert len(answers) == 3 and all(a in ("length", "stop") for a in answers), answers
        wait_for(lambda: idle(server.base_url), 30, "the server to be idle")


def test_one_scrape_reads_running_and_waiting_for_memory_at_once() -> None:
    """The two gauges come from one reading of the started choices: a run held (or
    offered again) between two readings was counted twice, or not at all."""
    from prometheus_client import generate_latest

    from runtime_cupy.serve.metrics import Metrics

    flips = [0]

    def started() -> tuple[int, int]:  # one started choice, held or offered at each reading
        flips[0] += 1
        return (1, 0) if flips[0] % 2 else (0, 1)

    metrics = Metrics(queued=lambda: 0, started=started, ready=lambda: True, restarts=lambda: 0)
    for _ in range(3):
        gauges = {
            line.split()[0]: float(line.split()[1])
            for line in generate_latest(metrics.registry).decode().splitlines()
            if line.startswith(("gguf_pipeline_requests_running ", "gguf_pipeline_runs_waiting"))
        }
        assert sum(gauges.values()) == 1.0, gauges
