"""A request whose thread the host cannot start (``RuntimeError: can't start new
thread``: ``ulimit -u``, ``ulimit -v`` or a cgroup's ``pids.max`` reached) is answered
503 naming the cause, and the runner goes on: the next request is served and
``GET /health`` stays true. Before, the runner thread died joining the thread that never
started, every later request waited for ever, and ``/health`` still said ok.

``Engine.close`` whose closing thread cannot start closes on the caller's thread: the
chain's stage processes end, and every later call says it is closed. Before, the first
call raised, every later one returned False at once, and the stages were left."""

from __future__ import annotations

import threading

import httpx2
import pytest

from runtime_cupy.serve.chain import WarmChain
from runtime_cupy.serve.engine import Engine
from tests.support.hygiene import wait_gone
from tests.support.servers import metrics, serving

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process

MSG = [{"role": "user", "content": "Tell me a story."}]
FAULTED = "gguf_pipeline_requests_total{endpoint=chat,outcome=faulted}"


def test_a_request_thread_that_cannot_start_is_a_503_and_the_server_goes_on(
    tiny_chat: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    start = threading.Thread.start
    refused: list[str] = []

    def start_once_refused(thread: threading.Thread) -> None:
        # The host's limit, as the first request's thread meets it (the others start).
        if thread.name.startswith("request-") and not refused:
            refused.append(thread.name)
            raise RuntimeError("can't start new thread")
        start(thread)

    chain = WarmChain(tiny_chat, stages=2, context=128, max_concurrent=1)
    with serving(Engine(chain)) as server:
        monkeypatch.setattr(threading.Thread, "start", start_once_refused)
        body = {"model": "tiny-chat", "messages": MSG, "max_tokens": 2, "temperature": 0}
        url = f"{server.base_url}/v1/chat/completions"
        r = httpx2.post(url, json=body, timeout=60)
        assert refused == ["request-1"]
        assert r.status_code == 503, (r.status_code, r.text)
        error = r.json()["error"]
        assert "can't start new thread" in error["message"], error
        assert "ulimit" in error["message"], error
        assert metrics(server.base_url)[FAULTED] == 1
        # The runner serves on: the next request is answered, /health is true.
        r2 = httpx2.post(url, json=body, timeout=60)
        assert r2.status_code == 200, (r2.status_code, r2.text)
        assert r2.json()["choices"][0]["message"]["content"] is not None
        health = httpx2.get(f"{server.base_url}/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "ok"


def test_a_closing_thread_that_cannot_start_closes_on_the_callers_thread(
    tiny_chat: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(WarmChain(tiny_chat, stages=2, context=128, max_concurrent=1))
    engine.start()
    assert engine.wait_started(120), engine.failure
    stages = list(engine.chain.pids())
    assert len(stages) == 2
    start = threading.Thread.start

    def close_refused(thread: threading.Thread) -> None:
        if thread.name == "close":  # the host's limit, met by the closing thread
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", close_refused)
    assert engine.close(timeout_s=0)  # closed here, whatever the timeout
    assert not wait_gone(stages, 10.0), "stage processes outlived the close"
    assert engine.close(timeout_s=0)  # closed: every later call says so
