"""Continuous batching through the server (issue 22): eight streaming chat requests
through the official ``openai`` client at once, on 2 and on 3 stages, each answered
exactly as the same request served alone (greedy and seeded), and the metrics saw
several runs in flight holding KV cache, all of it freed once they ended."""

from __future__ import annotations

import threading
from typing import Any

import openai
import pytest

from runtime_cupy.serve.chain import WarmChain
from runtime_cupy.serve.engine import Engine
from tests.support.servers import InProcessServer, idle, metrics, wait_for

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process

TOPICS = ["a story", "the sea", "a cat", "numbers", "rain", "a song", "bread", "stars"]


def _request(i: int) -> dict[str, Any]:
    """The ``i``-th request: greedy for even ``i``, seeded sampling for odd."""
    kwargs: dict[str, Any] = {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": f"Tell me about {TOPICS[i]}."}],
        "max_tokens": 8 + i,
        "stream": True,
    }
    if i % 2:
        kwargs |= {"temperature": 1.1, "seed": 100 + i}
    else:
        kwargs |= {"temperature": 0.0}
    return kwargs


def _ask(client: openai.OpenAI, i: int) -> str:
    parts = []
    for chunk in client.chat.completions.create(**_request(i)):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts)


@pytest.mark.parametrize("stages", [2, 3])
def test_eight_concurrent_streams_each_equal_their_request_alone(
    tiny_chat: str, stages: int
) -> None:
    engine = Engine(WarmChain(tiny_chat, stages=stages, context=128, max_concurrent=8))
    server = InProcessServer(engine)
    engine.start()
    try:
        assert engine.wait_started(120)
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
        alone = [_ask(client, i) for i in range(len(TOPICS))]
        answers: list[str | BaseException | None] = [None] * len(TOPICS)
        most = [0]
        gate = threading.Barrier(len(TOPICS) + 1)

        def ask(i: int) -> None:
            gate.wait()
            try:
                answers[i] = _ask(client, i)
            except BaseException as exc:
                answers[i] = exc

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(TOPICS))]
        for t in threads:
            t.start()
        gate.wait()
        kv_share = 0.0
        while any(t.is_alive() for t in threads):
            seen = metrics(server.base_url)
            most[0] = max(most[0], int(seen["gguf_pipeline_runs_in_flight"]))
            kv_share = max(kv_share, seen["gguf_pipeline_kv_cache_share{stage=0}"])
            for t in threads:
                t.join(0.01)
        assert answers == alone
        assert most[0] > 1, "the requests were never in flight together"
        assert 0 < kv_share <= 1
        wait_for(lambda: idle(server.base_url), 10.0, "the server to be idle")
        after = metrics(server.base_url)
        assert after["gguf_pipeline_runs_in_flight"] == 0
        assert all(after[f"gguf_pipeline_kv_cache_bytes{{stage={i}}}"] == 0 for i in range(stages))
    finally:
        server.stop()
