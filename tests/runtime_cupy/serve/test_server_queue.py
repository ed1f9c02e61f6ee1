"""The server's queue, readiness and cancellation, on uvicorn in this process over warm
stages whose host plays a slow step (``FaultyHost``: stage 1's decode step 1 takes two
seconds), so that a run lasts long enough to act while it runs:

- ``GET /health`` says 503 until every stage is up and bound; a request that came
  meanwhile is served once they are;
- a client that disconnects mid-stream cancels its run (outcome ``cancelled``), the
  stages stay warm (same processes), and the next request is served;
- past ``max_queue`` waiting requests, a request gets 429; a request's choices are
  admitted together or not at all, and any number of them on an idle server;
- requests join the chain in the order they were queued, even where the first one's
  thread is slow to get there.
"""

from __future__ import annotations

import json
import logging
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx2
import openai
import pytest

from runtime_cupy.process.chain_handoffs import ChainClosing
from runtime_cupy.serve.chain import ChainError, WarmChain
from runtime_cupy.serve.engine import Engine
from tests.support.hosts import FaultyHost
from tests.support.servers import InProcessServer, idle, metrics, serving, wait_for

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process

SLOW = {1: ["step-delay=1:2"]}  # every run that reaches decode step 1 waits 2 s there
CANCELLED = "gguf_pipeline_requests_total{endpoint=chat,outcome=cancelled}"
COMPLETED = "gguf_pipeline_requests_total{endpoint=chat,outcome=completed}"
MSG = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def slow(tiny_chat: str) -> Iterator[InProcessServer]:
    # One run in flight at a time: a second request waits in the queue, a third finds it
    # full.
    chain = WarmChain(tiny_chat, stages=2, host=FaultyHost(SLOW), context=128, max_concurrent=1)
    with serving(Engine(chain, max_queue=1)) as server:
        yield server


def test_health_is_503_until_the_stages_are_bound(tiny_chat: str) -> None:
    engine = Engine(WarmChain(tiny_chat, stages=2, context=128))
    server = InProcessServer(engine)
    try:
        r = httpx2.get(f"{server.base_url}/health")
        assert r.status_code == 503 and r.json()["status"] == "starting"
        assert r.json()["waiting_for"] == ["stages to start: 0 of 2 started"]
        answers: list[str | None] = []

        def ask() -> None:
            r = server.client().chat.completions.create(
                model="tiny-chat",
                messages=MSG,
                max_tokens=2,
                temperature=0,
            )
            answers.append(r.choices[0].message.content)

        early = threading.Thread(target=ask)
        early.start()
        wait_for(lambda: metrics(server.base_url)["gguf_pipeline_queue_length"] == 1, 30, "queued")
        assert httpx2.get(f"{server.base_url}/health").status_code == 503
        engine.start()
        early.join(120)
        assert len(answers) == 1 and answers[0] is not None
        assert httpx2.get(f"{server.base_url}/health").json()["status"] == "ok"
    finally:
        server.stop()


def test_a_client_that_disconnects_mid_stream_cancels_its_run(slow: InProcessServer) -> None:
    pids = slow.engine.chain.pids()
    before = metrics(slow.base_url)
    body = {"model": "tiny-chat", "messages": MSG, "max_tokens": 6, "stream": True}
    with httpx2.stream("POST", f"{slow.base_url}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: a dropped iterator would close the stream
        first = next(lines)
        assert first.startswith("data: ")
        wait_for(lambda: metrics(slow.base_url)["gguf_pipeline_requests_running"] == 1, 30,
                 "the run to start")  # fmt: skip
    # The client is gone, its run in the slow step: cancelled, not answered.
    wait_for(lambda: idle(slow.base_url), 30, "the server to be idle")
    after = metrics(slow.base_url)
    assert after[CANCELLED] == before[CANCELLED] + 1
    assert after[COMPLETED] == before[COMPLETED]
    assert slow.engine.chain.pids() == pids, "the stages stay warm"
    r2 = slow.client().chat.completions.create(
        model="tiny-chat",
        messages=MSG,
        max_tokens=1,
        temperature=0,
    )
    assert r2.choices[0].finish_reason in ("length", "stop")
    assert metrics(slow.base_url)[COMPLETED] == before[COMPLETED] + 1


def test_a_client_that_half_closes_after_its_request_has_gone_away(
    slow: InProcessServer,
) -> None:
    """What the docs say of a client that shuts its side for writing once its request
    is sent (``shutdown(SHUT_WR)``): uvicorn reads it as a close, so the request is
    cancelled, counted so, and answered nothing."""
    before = metrics(slow.base_url)
    body = json.dumps({"model": "tiny-chat", "messages": MSG, "max_tokens": 6}).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    host, port = slow.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as client:
        client.sendall(head.encode() + body)
        client.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := client.recv(65536):  # until the server closes
            answer += chunk
    assert answer == b""
    wait_for(lambda: idle(slow.base_url), 30, "the server to be idle")
    after = metrics(slow.base_url)
    assert after[CANCELLED] == before[CANCELLED] + 1
    assert after[COMPLETED] == before[COMPLETED]


def test_a_request_after_the_stop_began_is_answered_503_not_429(tiny_chat: str) -> None:
    """A stopping server admits nothing: 503, as the requests it held are answered.
    Before, 429 with ``Retry-After: 1``, which the ``openai`` client retries."""
    engine = Engine(WarmChain(tiny_chat, stages=2, context=128))
    server = InProcessServer(engine)
    try:
        assert engine.close(30)
        body = {"model": "tiny-chat", "messages": MSG, "max_tokens": 1}
        r = httpx2.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 503 and "Retry-After" not in r.headers, (r.status_code, r.text)
        error = r.json()["error"]
        assert error["code"] == "shutting_down" and "shutting down" in error["message"], error
        counted = metrics(server.base_url)
        assert counted["gguf_pipeline_requests_total{endpoint=chat,outcome=rejected}"] == 1
    finally:
        server.stop()


def test_a_stop_while_a_body_arrives_answers_503_at_once(tiny_chat: str) -> None:
    """SIGTERM while a client still sends its body: the request was held through
    uvicorn's graceful wait (5 s in the command; 30 s here, so that a loaded host's
    slowness is not mistaken for it), then cut: a bare text/plain 500 and an ASGI
    traceback. It is answered 503 ``shutting_down`` at once."""
    engine = Engine(WarmChain(tiny_chat, stages=2, context=128))
    server = InProcessServer(engine, graceful_s=30)
    try:
        host, port = server.sock.getsockname()[:2]
        with socket.create_connection((host, port), timeout=30) as client:
            client.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                b'Content-Type: application/json\r\nContent-Length: 60\r\n\r\n{"model":'
            )
            time.sleep(0.5)  # the handler is reading the body
            began = time.monotonic()
            server.server.handle_exit(signal.SIGTERM, None)
            answer = b""
            while data := client.recv(4096):
                answer += data
            took = time.monotonic() - began
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), answer
        error = json.loads(body)["error"]
        assert error["code"] == "shutting_down" and "shutting down" in error["message"], error
        assert took < 20.0, took  # not after the graceful wait
        server.thread.join(30)
        assert not server.thread.is_alive(), "the server did not end"
    finally:
        server.stop()


def test_a_full_queue_answers_429(slow: InProcessServer) -> None:
    c = slow.client()
    done: list[str] = []

    def long_one() -> None:  # runs through the slow step
        r = c.chat.completions.create(model="tiny-chat", messages=MSG, max_tokens=3)
        done.append(r.id)

    def short_one() -> None:  # waits behind it
        r = c.chat.completions.create(model="tiny-chat", messages=MSG, max_tokens=1)
        done.append(r.id)

    first = threading.Thread(target=long_one)
    first.start()
    wait_for(lambda: metrics(slow.base_url)["gguf_pipeline_requests_running"] == 1, 30, "running")
    second = threading.Thread(target=short_one)
    second.start()
    wait_for(lambda: metrics(slow.base_url)["gguf_pipeline_queue_length"] == 1, 30, "queued")
    with pytest.raises(openai.RateLimitError) as info:
        c.chat.completions.create(model="tiny-chat", messages=MSG, max_tokens=1)
    assert info.value.status_code == 429
    body = info.value.body
    assert isinstance(body, dict) and body["code"] == "queue_full"
    # what waits is counted in choices, as --max-queue counts them (it said "requests")
    assert body["message"].startswith("the server is busy: 1 choice waits (--max-queue 1)"), body
    first.join(60)
    second.join(60)
    assert len(done) == 2


def test_choices_that_start_at_once_do_not_count_as_waiting(tiny_chat: str) -> None:
    """With places free on the chain a request's choices start at once: none waits, so
    ``--max-queue 0`` refuses none of them (a request was a 429 whenever anything ran:
    its choices were counted as waiting); one choice more than the free places would
    wait, and is refused."""
    chain = WarmChain(tiny_chat, stages=2, host=FaultyHost(SLOW), context=128, max_concurrent=4)
    with serving(Engine(chain, max_queue=0)) as server:
        c = server.client()
        long_one = threading.Thread(
            target=lambda: c.chat.completions.create(model="tiny-chat", messages=MSG, max_tokens=3)
        )
        long_one.start()
        wait_for(lambda: metrics(server.base_url)["gguf_pipeline_requests_running"] == 1, 30,
                 "running")  # fmt: skip
        with pytest.raises(openai.RateLimitError):  # 4 choices: one would wait
            c.chat.completions.create(model="tiny-chat", messages=MSG, max_tokens=1, n=4)
        for n in (3, 1):  # 3 places are free (while the first sleeps 2 s in its step 1)
            r = c.chat.completions.create(model="tiny-chat", messages=MSG, max_tokens=1, n=n)
            assert len(r.choices) == n
        long_one.join(60)


def test_no_place_is_free_on_a_chain_that_is_not_up(tiny_chat: str) -> None:
    """While the stages start, every admitted choice waits: ``--max-queue 1`` takes one
    request and refuses the next (the chain's places counted as free let all four of its
    places' worth in past the limit)."""
    engine = Engine(WarmChain(tiny_chat, stages=2, context=128, max_concurrent=4), max_queue=1)
    server = InProcessServer(engine)
    try:
        answered: list[int] = []

        def ask() -> None:
            r = server.client().chat.completions.create(
                model="tiny-chat", messages=MSG, max_tokens=1, temperature=0
            )
            answered.append(len(r.choices))

        first = threading.Thread(target=ask)
        first.start()
        wait_for(lambda: metrics(server.base_url)["gguf_pipeline_queue_length"] == 1, 10, "queued")
        with pytest.raises(openai.RateLimitError):  # at once (admitted, it would wait)
            server.client().with_options(timeout=10, max_retries=0).chat.completions.create(
                model="tiny-chat", messages=MSG, max_tokens=1
            )
        engine.start()
        first.join(120)
        assert answered == [1]
    finally:
        server.stop()


def test_a_request_of_more_choices_than_max_queue_is_admitted_whole(tiny_chat: str) -> None:
    # The stages start only once the request waits: its three choices are in the queue
    # of one place together (they were a 429 on any server, idle or not, the second
    # choice finding the first in the queue), and all three are answered.
    engine = Engine(WarmChain(tiny_chat, stages=2, context=128, max_concurrent=1), max_queue=1)
    server = InProcessServer(engine)
    try:
        answers: list[int] = []
        prompts: list[int] = []

        def ask() -> None:
            r = server.client().chat.completions.create(
                model="tiny-chat", messages=MSG, max_tokens=1, n=3, temperature=0
            )
            answers.append(len(r.choices))
            assert r.usage is not None
            prompts.append(r.usage.prompt_tokens)

        asking = threading.Thread(target=ask)
        asking.start()
        wait_for(lambda: metrics(server.base_url)["gguf_pipeline_queue_length"] == 3, 10, "queued")
        # A busy server refuses a request whose choices do not all fit, whole.
        with pytest.raises(openai.RateLimitError):
            server.client().chat.completions.create(model="tiny-chat", messages=MSG, max_tokens=1)
        assert metrics(server.base_url)["gguf_pipeline_queue_length"] == 3
        engine.start()
        asking.join(120)
        assert answers == [3]
        # The request counts once, its prompt once (they counted a request and a prompt
        # per choice: 3 completed, 3 prompts' tokens).
        m = metrics(server.base_url)
        assert m[COMPLETED] == 1
        assert m["gguf_pipeline_requests_total{endpoint=chat,outcome=rejected}"] == 1
        assert m["gguf_pipeline_prompt_tokens_total"] == prompts[0] > 0
    finally:
        server.stop()


class LateFirstChain(WarmChain):
    """A chain whose first caller takes a while to get to it (as a thread the host
    schedules late does); records the prompts in the order their runs joined."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0
        self.joined: list[tuple[int, ...]] = []

    def generate(self, prompt_ids: Sequence[int], **kwargs: Any) -> Any:
        self.calls += 1  # (the requests' calls: the chain's warm-up submits directly)
        if self.calls == 1:
            time.sleep(0.5)
        return super().generate(prompt_ids, **kwargs)

    def submit(self, prompt: Sequence[int], **kwargs: Any) -> Any:
        self.joined.append(tuple(prompt))
        return super().submit(prompt, **kwargs)


def test_requests_join_the_chain_in_the_order_they_were_queued(tiny_chat: str) -> None:
    # Three requests wait before the stages are up; once up, all three may run at once.
    # The first one's thread reaches the chain half a second late: the others wait for it
    # (they joined before it, and the log said they started in order all the same).
    chain = LateFirstChain(tiny_chat, stages=2, context=128, max_concurrent=3)
    engine = Engine(chain)
    server = InProcessServer(engine)
    try:
        prompts = [f"Request number {i} says" for i in range(3)]
        threads = []
        for i, prompt in enumerate(prompts):
            ask = server.client().completions.create
            kwargs = {"model": "tiny-chat", "prompt": prompt, "max_tokens": 2, "temperature": 0}
            threads.append(threading.Thread(target=ask, kwargs=kwargs))
            threads[-1].start()
            wait_for(lambda n=i + 1: metrics(server.base_url)["gguf_pipeline_queue_length"] == n,
                     30, f"request {i} queued")  # fmt: skip
        engine.start()
        for t in threads:
            t.join(120)
        said = [engine.tokenizer.decode(list(ids)) for ids in chain.joined]
        # (the chain's own warm-up run, of no prompt, joined first)
        order = [p for text in said for p in prompts if p in text]
        assert order == prompts, said
    finally:
        server.stop()


def test_a_stop_answers_every_request_at_once_and_the_server_ends(
    tiny_chat: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Told to exit (SIGTERM's handler, as uvicorn calls it), the server cancels what
    runs and answers what waits at once: the whole request gets a 503, the stream an
    error event and ``[DONE]``, the queued one a 503, each saying the server is shutting
    down; the server then ends without cancelling a request's task (which cut the
    stream and gave a bare 500 after uvicorn's graceful wait, here 5 s as in the
    command, while the runs went on: each of their first ten steps takes 1.5 s)."""
    faults = {1: [f"step-delay={step}:1.5" for step in range(1, 11)]}
    chain = WarmChain(tiny_chat, stages=2, host=FaultyHost(faults), context=128, max_concurrent=2)
    engine = Engine(chain, max_queue=2)
    server = InProcessServer(engine, graceful_s=5)
    answers: dict[str, Any] = {}
    body = {"model": "tiny-chat", "messages": MSG, "max_tokens": 30, "temperature": 0}

    def whole(name: str) -> None:
        r = httpx2.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
        answers[name] = (r.status_code, r.json())

    def streamed() -> None:
        with httpx2.stream(
            "POST", f"{server.base_url}/v1/chat/completions", json={**body, "stream": True},
            timeout=60,
        ) as r:  # fmt: skip
            answers["stream"] = (r.status_code, "".join(r.iter_text()))

    try:
        engine.start()
        assert engine.wait_started(120), engine.failure
        threads = [threading.Thread(target=streamed), threading.Thread(target=whole, args=("a",))]
        for t in threads:
            t.start()
        wait_for(lambda: metrics(server.base_url)["gguf_pipeline_requests_running"] == 2, 30,
                 "both runs to start")  # fmt: skip
        queued = threading.Thread(target=whole, args=("queued",))
        queued.start()
        threads.append(queued)
        wait_for(lambda: metrics(server.base_url)["gguf_pipeline_queue_length"] == 1, 30,
                 "the third request to wait")  # fmt: skip
        time.sleep(1.0)  # the stage's step 0 (a prompt) is done: its run has its first token
        caplog.set_level(logging.INFO, logger="runtime_cupy.serve")
        server.server.handle_exit(signal.SIGTERM, None)
        for t in threads:
            t.join(60)
        server.thread.join(60)
        assert not server.thread.is_alive(), "the server did not end"
    finally:
        server.stop()
    for name in ("a", "queued"):
        status, answer = answers[name]
        assert status == 503 and "shutting down" in answer["error"]["message"], answers
        # The same code for the running request as for the queued one (a running one's
        # said "cancelled", which the docs did not promise)
        assert answer["error"]["code"] == "shutting_down", answers
    status, text = answers["stream"]
    assert status == 200 and text.rstrip().endswith("data: [DONE]"), text
    # Each of the three counted once, cancelled: the queued one too (its tally never
    # closed, so it was never counted)
    counted = [
        line for line in engine.metrics.render().decode().splitlines()
        if line.startswith('gguf_pipeline_requests_total{endpoint="chat",outcome="cancelled"}')
    ]  # fmt: skip
    assert counted and float(counted[0].split()[-1]) == 3.0, counted
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert "shutting down" in events[-1]["error"]["message"], events[-1]
    assert events[-1]["error"]["code"] == "shutting_down", events[-1]
    # The log counts the tokens each cancelled run had (it once said 0 tokens for all): a
    # run whose prompt was in the stage's step 0 had one (the next step is 1.5 s off); the
    # two prompts may share that step (both runs then had one) or not (the other, whose
    # prompt waits in the delayed step 1, had none). On a loaded machine the exit can
    # come after step 1 too (a run then had two, the other one): at most one step more.
    ended = [r.getMessage() for r in caplog.records if "finished: cancelled" in r.getMessage()]
    queued = [line for line in ended if "the run was cancelled" not in line]
    assert len(queued) == 1 and ", 0 tokens (the server is shutting down)" in queued[0], ended
    ended = [line for line in ended if line not in queued]
    assert len(ended) == 2, ended
    had = sorted(int(re.findall(r", (\d+) tokens", line)[-1]) for line in ended)
    assert had[-1] >= 1 and had[-1] - had[0] <= 1 and had[-1] <= 2, ended
    streamed_tokens = sum(
        1 for e in events if e.get("choices") and e["choices"][0]["delta"].get("content")
    )
    assert streamed_tokens <= had[-1], (streamed_tokens, ended)


class ClosingChain(WarmChain):
    """A chain that closed as a request's run was handed over (the runner refuses it
    with ``ChainClosing``: the loop had returned for good)."""

    def generate(self, prompt_ids: Sequence[int], **kwargs: Any) -> Any:
        raise ChainClosing("the chain is closing")


def test_a_run_handed_over_as_the_chain_closes_is_a_503_not_a_500(tiny_chat: str) -> None:
    """The runner's refusal was a bare ``RuntimeError``, which the server did not expect:
    a 500 "internal error" with a traceback in the log."""
    server = InProcessServer(Engine(ClosingChain(tiny_chat, stages=2, context=128)))
    try:
        server.engine.start()
        assert server.engine.wait_started(120), server.engine.failure
        body = {"model": "tiny-chat", "messages": MSG, "max_tokens": 3}
        r = httpx2.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "stages_unavailable", r.text
        assert "the chain is closing" in r.json()["error"]["message"], r.text
    finally:
        server.stop()


class UnrecoverableChain(WarmChain):
    """A chain that, once ``broken``, is not ready and cannot be started again."""

    broken = False

    @property
    def ready(self) -> bool:
        return not self.broken and super().ready

    def recover(self) -> tuple[int, ...]:
        if self.broken:
            raise ChainError("the stages could not be started again")
        return super().recover()


def test_a_request_the_chain_cannot_be_started_again_for_says_when_to_retry(
    tiny_chat: str,
) -> None:
    """While a broken chain cannot be started again (each next try later, up to a
    minute), the requests waiting get a 503 with ``Retry-After``: the seconds to the
    next try, which the ``openai`` client waits before it retries (without it, it
    retried twice within 2 s, each a 503 again)."""
    chain = UnrecoverableChain(tiny_chat, stages=2, context=128)
    body = {"model": "tiny-chat", "messages": MSG, "max_tokens": 3}
    with serving(Engine(chain)) as server:
        chain.broken = True
        for _ in range(2):  # the one that fails the try, and one during the wait
            r = httpx2.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "stages_unavailable", r.text
            assert 1 <= int(r.headers["retry-after"]) <= 60, r.headers
        chain.broken = False
