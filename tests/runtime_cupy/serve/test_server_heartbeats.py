"""A warm stage stopped by SIGSTOP (alive, silent) under the server, on uvicorn in this
process over a host whose stage starts wait at a gate the test holds
(``GatedHost``), so that what ``/health`` says while a stage is started again can be
read for as long as the test looks:

- mid-decode (stage 1 in a long step): the request fails naming the stage, its node
  and its silence (not a timer: the token timer is a minute away), ``/health`` says 503
  with that reason until the chain (every stage) is back, then 200, and the next
  request is answered;
- between requests: ``/health`` says 503 naming the stopped stage (the chain's loop
  hears no heartbeat), and the next request is answered on the chain started again.

Nothing is left (the conftest checks processes, segments, run folders and ports).
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import httpx2
import pytest

from runplan.config import Timeouts
from runtime_cupy.serve.chain import WarmChain
from runtime_cupy.serve.engine import Engine
from tests.support.hosts import GatedHost
from tests.support.hygiene import wait_gone
from tests.support.servers import InProcessServer, serving, wait_for

pytestmark = pytest.mark.process

TIMEOUTS = Timeouts(step_ms=30_000, heartbeat_ms=2_000)
BODY = {"model": "tiny-chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6}


def _health(server: InProcessServer) -> tuple[int, dict[str, Any]]:
    r = httpx2.get(f"{server.base_url}/health", timeout=30)
    return r.status_code, r.json()


def _ask(server: InProcessServer, answers: list[httpx2.Response]) -> None:
    url = f"{server.base_url}/v1/chat/completions"
    answers.append(httpx2.post(url, json=BODY, timeout=120))


def _recovering_with(server: InProcessServer, host: GatedHost, words: str) -> None:
    """The restart is held at the gate: /health names the cause; then it is let in."""
    wait_for(host.waiting.is_set, 60, "the stage to be started again")
    status, body = _health(server)
    assert status == 503, body
    assert body["status"] == "recovering" and words in body["detail"], body
    host.release()
    wait_for(lambda: _health(server)[0] == 200, 120, "GET /health to say 200 again")


def test_a_stage_stopped_mid_decode_or_idle_is_named_and_started_again(
    tiny_chat: str, tmp_path: Path
) -> None:
    host = GatedHost({1: ["step-delay=3:60"]}, log_dir=tmp_path)
    chain = WarmChain(tiny_chat, stages=2, host=host, context=128, timeouts=TIMEOUTS)
    engine = Engine(chain, max_queue=2)
    with serving(engine) as server:
        try:
            first = chain.pids()
            host.hold()
            answers: list[httpx2.Response] = []
            asking = threading.Thread(target=_ask, args=(server, answers))
            asking.start()
            log = tmp_path / "stage-1.log"
            wait_for(lambda: log.exists() and "step 3 delayed" in log.read_text(), 60,
                     "stage 1 to be in decode step 3")  # fmt: skip
            os.kill(first[1], signal.SIGSTOP)
            asking.join(60)
            assert len(answers) == 1
            error = answers[0].json()["error"]
            assert answers[0].status_code == 500, error
            assert "stage_silent: stage 1 on 'stage-1': no heartbeat for" in error["message"], error
            _recovering_with(server, host, "stage 1 on 'stage-1': no heartbeat for")
            assert not wait_gone([first[1]], 10.0)
            again = httpx2.post(f"{server.base_url}/v1/chat/completions", json=BODY, timeout=120)
            assert again.status_code == 200, again.text
            second = chain.pids()
            assert not set(second) & set(first)  # a chain fault: the whole chain started again

            # Between requests: stage 0 stopped while idle.
            host.hold()
            os.kill(second[0], signal.SIGSTOP)
            _recovering_with(server, host, "stage 0 on 'stage-0': no heartbeat for")
            assert not wait_gone([second[0]], 10.0)
            last = httpx2.post(f"{server.base_url}/v1/chat/completions", json=BODY, timeout=120)
            assert last.status_code == 200, last.text
            assert chain.pids()[0] != second[0]
        finally:
            host.release()
