"""Warm stages (``serve.chain.WarmChain``): the stage processes start and bind once and
serve one run of the MVP's state machines after another.

- The same processes serve every run; only the run that bound them has ``bind``
  spans, later runs reuse the weights; their tokens are ``runtime_cupy.generate``'s.
- Each run's KV cache and sampler are its own; cancelling a run leaves the stages warm.
- A stale run's messages are refused across runs (§10) and the next run goes on.
- A stage killed between runs or in a run is a fault of the chain: the run in flight
  ends naming it, and the whole chain is started again before the next run, which
  succeeds; a step that fails ends its run alone and the stages stay; closing the
  chain leaves nothing behind.
"""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runplan.config import SamplingConfig
from runplan.messages import StopReason, StopRun
from runplan.provision import provision_all
from runtime_core.runs import PlanRejected
from runtime_cupy import generate
from runtime_cupy.cli.arguments import add_chain_arguments, chain_from
from runtime_cupy.process.launcher import ProcessRun
from runtime_cupy.serve.chain import WarmChain
from tests.support.hosts import FaultyHost, TapHost
from tests.support.hygiene import alive, wait_gone

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process

PROMPT = [5, 77, 30, 12, 9]


def spans(trace: Any, name: str) -> list[dict[str, Any]]:
    return [e for e in trace or () if e.get("ph") == "X" and e["name"] == name]


def instants(trace: Any, name: str) -> list[dict[str, Any]]:
    return [e for e in trace or () if e.get("ph") == "i" and e["name"] == name]


@pytest.fixture(scope="module")
def chain(tiny: str) -> Iterator[WarmChain]:
    with WarmChain(tiny, stages=2, trace=True, context=128) as c:
        pids = c.pids()
        yield c
    assert not wait_gone(list(pids), 10.0), "a warm stage outlived its chain"


def test_the_same_processes_serve_every_run_and_only_the_first_binds(
    chain: WarmChain, tiny: str
) -> None:
    assert chain.ready
    pids = chain.pids()
    assert chain.bind_run is not None
    first = chain.bind_run.result.trace
    assert len(spans(first, "bind")) == 2, "the run that bound the stages has a bind each"
    cold = generate(tiny, PROMPT, stages=2, max_tokens=12)
    for _ in range(3):
        run = chain.generate(PROMPT, max_tokens=12)
        assert run.result.outcome == "completed", run.result.fault
        assert run.result.tokens == cold.tokens
        assert chain.pids() == pids
        assert tuple(s.pid for s in run.result.stages) == pids
        assert spans(run.result.trace, "bind") == []
        assert len(instants(run.result.trace, "weights reused")) == 2
        assert run.restarted == ()


def test_each_run_has_its_own_cache_and_sampler(chain: WarmChain, tiny: str) -> None:
    sampled = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 11}
    long_prompt = [9, 8, 7, 6, 5, 4, 3, 2, 1, 40, 41, 42, 43, 44, 45]
    expected = generate(tiny, long_prompt, stages=2, max_tokens=10, **sampled)
    chain.generate(PROMPT, max_tokens=20, temperature=0.7, seed=3)  # leaves a cache behind
    run = chain.generate(long_prompt, max_tokens=10, **sampled)
    assert run.result.tokens == expected.tokens
    again = chain.generate(long_prompt, max_tokens=10, **sampled)
    assert again.result.tokens == expected.tokens


def test_a_cancelled_run_leaves_the_stages_warm(chain: WarmChain) -> None:
    pids = chain.pids()
    runs: list[ProcessRun] = []
    seen: list[int] = []

    def on_token(token: int) -> None:
        seen.append(token)
        if len(seen) == 2:
            runs[0].cancel("the client went away")

    run = chain.generate(PROMPT, max_tokens=100, on_token=on_token, on_run=runs.append)
    assert run.result.outcome == "cancelled"
    assert 2 <= len(run.result.tokens) < 100
    assert chain.pids() == pids and chain.ready
    after = chain.generate(PROMPT, max_tokens=4)
    assert after.result.outcome == "completed"
    assert after.result.tokens[:2] == tuple(seen[:2])


def test_a_stale_run_s_messages_are_refused_across_runs(tiny: str, tmp_path: Path) -> None:
    host = TapHost(log_dir=tmp_path)
    with WarmChain(tiny, stages=2, host=host, context=64) as chain:
        old = chain.generate(PROMPT, max_tokens=3)
        assert old.result.outcome == "completed"
        provision = provision_all(old.result.plan)[0]
        # Signed and numbered as the orchestrator's: they pass the channel and reach
        # stage 0's machine, which refuses a provision and a stop of a stopped run.
        host.taps[0].forge_to_stage("orchestrator", provision)
        stop = StopRun(old.result.plan.run_id, StopReason.CANCELLED)
        host.taps[0].forge_to_stage("orchestrator", stop)
        new = chain.generate(PROMPT, max_tokens=3)
        assert new.result.outcome == "completed"
        assert new.result.tokens == old.result.tokens
    log = (tmp_path / "stage-0.log").read_text()
    assert log.count("STALE_RUN") == 2, log


def test_a_stage_killed_between_runs_is_started_again(tiny: str) -> None:
    with WarmChain(tiny, stages=2, context=64) as chain:
        before = chain.generate(PROMPT, max_tokens=6)
        pids = chain.pids()
        os.kill(pids[1], signal.SIGKILL)
        assert not wait_gone([pids[1]], 10.0)
        assert not chain.ready
        after = chain.generate(PROMPT, max_tokens=6)
        assert after.result.outcome == "completed", after.result.fault
        assert after.result.tokens == before.result.tokens
        # A chain fault starts the whole chain again (a new secret, new link names).
        assert after.restarted == (0, 1)
        assert not set(chain.pids()) & set(pids)
        assert not wait_gone([pids[0]], 10.0), "the broken chain's other stage was reaped"
        assert chain.ready and chain.restarts == 2


def test_a_run_handed_to_a_chain_whose_loop_ended_ends_at_once_naming_the_fault(
    tiny: str,
) -> None:
    # A stage dies while no run is in flight: the chain's loop ends (its thread returns).
    # A run handed over after that waited for ever, nothing left to take it (seen when a
    # stage died as a recovering chain came up, before the run that binds it).
    with WarmChain(tiny, stages=2, context=64) as chain:
        pids = chain.pids()
        thread = chain._thread
        assert thread is not None
        os.kill(pids[1], signal.SIGKILL)
        thread.join(30)
        assert not thread.is_alive()
        run = chain.submit(PROMPT, max_tokens=4, sampling=SamplingConfig())
        assert run.wait(30) is not None, "the run waits on a loop that has ended"
        result = chain.result(run).result
        assert result.outcome == "faulted" and result.tokens == ()
        assert "SIGKILL" in (result.fault or ""), result.fault
        assert chain.generate(PROMPT, max_tokens=4).result.outcome == "completed"


def test_a_stage_killed_in_a_run_faults_that_run_alone(tiny: str) -> None:
    with WarmChain(tiny, stages=2, context=64) as chain:
        pids = chain.pids()
        killed: list[int] = []

        def on_token(token: int) -> None:
            if not killed:
                killed.append(pids[1])
                os.kill(pids[1], signal.SIGKILL)

        broken = chain.generate(PROMPT, max_tokens=40, on_token=on_token)
        assert broken.result.outcome == "faulted"
        assert broken.result.fault_stage == 1
        assert "SIGKILL" in (broken.result.fault or ""), broken.result.fault
        assert chain.recover() == (0, 1)  # a chain fault: the whole chain starts again
        assert chain.ready and not set(chain.pids()) & set(pids) and not alive(pids[1])
        assert chain.generate(PROMPT, max_tokens=4).result.outcome == "completed"


def test_a_step_that_fails_ends_its_run_alone_and_the_stages_stay(tiny: str) -> None:
    host = FaultyHost({1: ["step-fail=3"]})
    with WarmChain(tiny, stages=2, host=host, context=64) as chain:
        pids = chain.pids()
        broken = chain.generate(PROMPT, max_tokens=10)
        assert broken.result.outcome == "faulted"
        assert broken.result.fault_stage == 1
        assert "injected failure at sequence 3" in (broken.result.fault or "")
        ok = chain.generate(PROMPT, max_tokens=3)  # sequences 0..2: the fault never comes
        assert ok.result.outcome == "completed", ok.result.fault
        assert ok.restarted == ()  # a run's own fault: the chain is whole
        assert chain.pids() == pids


def test_max_concurrent_defaults_to_the_full_length_runs_the_smallest_stage_s_budget_holds(
    tiny: str,
) -> None:
    """No process starts: the chain's plan alone. With a KV budget and no
    ``max_concurrent``, runs in flight are the full-length caches the smallest stage's
    budget holds; a budget that holds none is refused naming the stage and its need."""
    probe = WarmChain(tiny, stages=2, context=64, max_concurrent=1)
    needs = [s.kv_bytes for s in probe.template.stages]  # one full-length run a stage
    budget = 3 * max(needs) + 1
    chain = WarmChain(tiny, stages=2, context=64, kv_budget_bytes=budget)
    assert chain.max_concurrent == min(budget // n for n in needs) == 3
    assert {s.kv_budget_bytes for s in chain.template.stages} == {budget}
    given = WarmChain(tiny, stages=2, context=64, kv_budget_bytes=budget, max_concurrent=5)
    assert given.max_concurrent == 5  # given: kept (runs beyond the budget wait for room)
    assert WarmChain(tiny, stages=2, context=64).max_concurrent == 4  # neither: as before
    with pytest.raises(ValueError, match=r"holds no full-length run on stage \d: one needs"):
        WarmChain(tiny, stages=2, context=64, kv_budget_bytes=min(needs) - 1)


def test_a_kv_budget_past_u64_or_any_host_is_refused_naming_it(tiny: str) -> None:
    """No process starts. A budget past 2**64 - 1, or one holding more full-length runs
    than ``max_concurrent_runs`` counts (2**32 - 1), was refused naming
    ``max_concurrent_runs``, which the caller never gave."""
    with pytest.raises(ValueError) as info:
        WarmChain(tiny, stages=1, context=64, kv_budget_bytes=2**80)
    assert str(info.value) == f"kv_budget_bytes {2**80} is past 2**64 - 1"
    for budget in (2**63, 2**64 - 1):
        with pytest.raises(PlanRejected) as refused:
            WarmChain(tiny, stages=1, context=64, kv_budget_bytes=budget)
        assert refused.value.rejection.code == "insufficient_memory", refused.value
        assert refused.value.rejection.bytes_needed > budget


def test_the_chain_flags_give_its_kv_budget_and_prefill_chunk(tiny: str) -> None:
    """``--kv-budget`` and ``--prefill-chunk`` reach the chain's plan (no process starts);
    a budget of no bytes is refused naming the flag."""
    parser = argparse.ArgumentParser()
    add_chain_arguments(parser)
    flags = ["--model", tiny, "--stages", "2", "--context", "64"]
    args = parser.parse_args([*flags, "--kv-budget", "1MiB", "--prefill-chunk", "16"])
    chain = chain_from(args)
    assert chain.template.prefill_chunk == 16
    assert {s.kv_budget_bytes for s in chain.template.stages} == {2**20}
    assert chain.max_concurrent == min(
        2**20 // n for n in (s.kv_bytes for s in chain.template.stages)
    )
    with pytest.raises(SystemExit):
        parser.parse_args([*flags, "--kv-budget", "0"])
