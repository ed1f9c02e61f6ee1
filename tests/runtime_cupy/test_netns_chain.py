"""Several runs in flight through one chain across test hosts
(``tests/support/netns_hosts.py``: three network and mount namespaces on a bridge, no
Ray): stage ``i`` on host ``i + 1``, the orchestrator on this machine, every link a TCP
stream. Four runs at once give each the tokens it gives alone, and closing the chain
leaves nothing of it on this machine.

Root only (skipped with the reason elsewhere); the hosts go when the module ends."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from runplan import RunPlan, SamplingConfig
from runplan.config import Timeouts
from runtime_cupy.api import plan_for
from runtime_cupy.process.chain_runner import ChainRunner
from tests.support.hygiene import run_resources
from tests.support.netns_hosts import TestHosts, hosts_up, shared_model
from tests.support.netns_stages import NetnsStageHost

#: Test hosts in network namespaces, real stage processes (make fast leaves these out).
pytestmark = [pytest.mark.netns, pytest.mark.process]

TIMEOUTS = Timeouts(ready_ms=60_000, step_ms=30_000, edge_wait_ms=30_000, stop_ms=5_000)
#: Four prompts of one length (the chain's runs share its cache length).
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3], [5, 8, 9, 7, 9], [3, 2, 3, 8, 4]]
SAMPLING = [
    SamplingConfig(),
    SamplingConfig(1.2, 40, 1.0, 7),
    SamplingConfig(),
    SamplingConfig(0.9, 0, 0.9, 3),
]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestHosts]:
    with hosts_up(3, tmp_path_factory.mktemp("netns-chain")) as h:
        yield h


@pytest.fixture(scope="module")
def model(tiny: str) -> Iterator[str]:
    with shared_model(tiny) as path:
        yield path


def _plan(model: str, sampling: SamplingConfig) -> RunPlan:
    plan, _ = plan_for(
        model, stages=3, prompt_len=5, max_tokens=8, sampling=sampling, return_logits=False,
        timeouts=TIMEOUTS, worker="numpy", max_concurrent_runs=4,
    )  # fmt: skip
    return plan


def test_four_concurrent_runs_on_three_hosts_give_their_tokens_alone(
    hosts: TestHosts, model: str
) -> None:
    host = NetnsStageHost(hosts, (1, 2, 3))
    runner = ChainRunner(_plan(model, SamplingConfig()), worker="numpy", host=host, edges="tcp")
    try:
        runner.start()
        alone = []
        for prompt, sampling in zip(PROMPTS, SAMPLING, strict=True):
            run = runner.submit(_plan(model, sampling), prompt)
            runner.loop(until=lambda run=run: run.done)  # type: ignore[misc]
            outcome = run.wait(0)
            assert outcome is not None and outcome.finished is not None
            assert outcome.finished.fault is None, outcome.finished.fault
            alone.append(outcome.tokens)
        runs = [runner.submit(_plan(model, s), p) for p, s in zip(PROMPTS, SAMPLING, strict=True)]
        runner.loop(until=lambda: all(r.done for r in runs))
        together = [r.wait(0) for r in runs]
        for solo, outcome in zip(alone, together, strict=True):
            assert outcome is not None and outcome.finished is not None
            assert outcome.finished.fault is None, outcome.finished.fault
            assert outcome.tokens == solo and len(solo) == 8
        # The four were in flight together: each had its first token before any ended.
        done = [o for o in together if o is not None]
        assert max(o.token_times_s[0] for o in done) < min(o.ended_s for o in done)
    finally:
        runner.close()
        host.close()  # its rendezvous folder under /var/tmp (it was left behind)
    assert run_resources(runner.chain_id) == []
