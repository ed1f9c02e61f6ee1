"""``serve`` with ``--recover`` (issue 25) through the official ``openai`` client: a
stage SIGKILLed while a request runs does not fail it. A streamed request keeps its
stream open and goes on; a non-streamed one answers once complete; either answer is
the unbroken run's text (greedy here; seeded through the client in
``test_netns_recovery.py``, on the chain in ``test_warm_recovery.py``). ``/metrics``
counts the recovery and its seconds; the log names the lost stage's node, the cause and
the new placement.

On uvicorn in this process over warm stages whose host plays a slow step
(``FaultyHost``: stage 0's step 3 takes 1.5 s), so that the kill lands mid-request;
a server per test, as the stages a recovery starts are the test's own (``no_leftovers``
checks them).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator

import pytest

from runtime_cupy.serve.chain import WarmChain
from runtime_cupy.serve.engine import Engine
from tests.support.hosts import FaultyHost
from tests.support.servers import InProcessServer, idle, metrics, serving, wait_for

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process

SLOW = {0: ["step-delay=3:1.5"]}
RECOVERIES = "gguf_pipeline_recoveries_total"
SECONDS = "gguf_pipeline_recovery_seconds_total"
PROMPT = "Once upon a time"
MAX_TOKENS = 24


@pytest.fixture
def server(tiny_chat: str) -> Iterator[InProcessServer]:
    chain = WarmChain(tiny_chat, stages=2, host=FaultyHost(SLOW), context=128, recover=True)
    with serving(Engine(chain, max_queue=4)) as server:
        yield server


def kill_stage(server: InProcessServer, index: int) -> None:
    os.kill(server.engine.chain.pids()[index], signal.SIGKILL)


def test_a_stream_stays_open_through_a_lost_stage_and_is_the_unbroken_text(
    server: InProcessServer, caplog: pytest.LogCaptureFixture
) -> None:
    c = server.client()
    ask = {"model": "tiny-chat", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    unbroken = c.completions.create(**ask).choices[0].text
    before = metrics(server.base_url)
    pieces: list[str] = []
    with caplog.at_level(logging.WARNING, logger="runtime_cupy.serve"):
        for chunk in c.completions.create(**ask, stream=True):
            if not pieces:  # the first piece came; stage 0 now holds step 3 for 1.5 s
                kill_stage(server, 1)
            pieces.append(chunk.choices[0].text)
    assert "".join(pieces) == unbroken
    after = metrics(server.base_url)
    assert after[RECOVERIES] == before[RECOVERIES] + 1
    assert after[SECONDS] > before[SECONDS]
    log = caplog.text
    assert "lost stages [1] on ['stage-1']" in log and "SIGKILL" in log, log
    assert "new placement: stage 0 on 'stage-0'" in log, log
    wait_for(lambda: server.engine.chain.ready, 60, "the chain to be ready")


def test_a_whole_answer_comes_once_complete(server: InProcessServer) -> None:
    c = server.client()
    ask = {"model": "tiny-chat", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    unbroken = c.completions.create(**ask).choices[0].text
    before = metrics(server.base_url)[RECOVERIES]
    answers: list[str] = []
    thread = threading.Thread(
        target=lambda: answers.append(c.completions.create(**ask).choices[0].text)
    )
    thread.start()
    wait_for(lambda: server.engine.chain.in_flight == 1, 30, "the request to run")
    kill_stage(server, 0)  # before step 3's 1.5 s are over: mid-run
    thread.join(120)
    assert answers == [unbroken]
    assert metrics(server.base_url)[RECOVERIES] == before + 1
    wait_for(lambda: idle(server.base_url), 60, "the server to be idle")
