"""Continuous batching through the server (issue 22): eight streaming chat requests
through the official ``openai`` client at once, on 2 and on 3 stages, each answered
exactly as the same request served alone (greedy and seeded), and the metrics saw
several runs in flight holding KV cache, all of it freed once they ended, and each
stage's batches: every row the eight runs sent through it, in fewer batches than their
records (runs shared them).

The last stage is held (SIGSTOP, with a heartbeat allowance longer than the hold) while
the eight are sent, and let go once the metrics show more than one run in flight: on a
fast host eight short answers can otherwise start and end between two scrapes."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import openai
import pytest
from attrs import frozen

from runplan.config import Timeouts
from runtime_cupy.serve.chain import WarmChain
from runtime_cupy.serve.engine import Engine
from tests.support.servers import idle, metrics, serving, wait_for

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


@frozen
class Answer:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int

    @property
    def fed_back(self) -> int:
        """Tokens that went back into the chain: each counted one, but the last of a
        ``length`` answer (the EOS that ended a ``stop`` answer is neither shown nor
        counted, and goes back into nothing)."""
        return self.completion_tokens - (self.finish_reason == "length")

    def records(self, chunk: int) -> int:
        """Records of this run through each stage: its prompt in chunks, each token fed
        back."""
        return -(-self.prompt_tokens // chunk) + self.fed_back


def _ask(client: openai.OpenAI, i: int) -> Answer:
    parts, finish, usage = [], "", None
    stream = client.chat.completions.create(**_request(i), stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        usage = chunk.usage or usage
    assert usage is not None and finish
    return Answer("".join(parts), finish, usage.prompt_tokens, usage.completion_tokens)


def _batches(seen: dict[str, float], stage: int) -> tuple[float, float, list[float]]:
    """A stage's batch-rows histogram: its count, its sum of rows, its buckets."""
    name = "gguf_pipeline_batch_rows"
    buckets = [v for k, v in seen.items() if k.startswith(f"{name}_bucket{{") and
               k.endswith(f",stage={stage}}}")]  # fmt: skip
    return (
        seen.get(f"{name}_count{{stage={stage}}}", 0),
        seen.get(f"{name}_sum{{stage={stage}}}", 0),
        buckets,
    )


@pytest.mark.parametrize("stages", [2, 3])
def test_eight_concurrent_streams_each_equal_their_request_alone(
    tiny_chat: str, stages: int
) -> None:
    # Heartbeats may pause for as long as the test holds the last stage.
    timeouts = Timeouts(heartbeat_ms=120_000)
    chain = WarmChain(tiny_chat, stages=stages, context=128, max_concurrent=8, timeouts=timeouts)
    engine = Engine(chain)
    with serving(engine) as server:
        client = server.client()
        alone = [_ask(client, i) for i in range(len(TOPICS))]
        wait_for(lambda: idle(server.base_url), 10.0, "the server to be idle")
        before = metrics(server.base_url)  # every run so far stopped: its batches reported
        answers: list[Answer | BaseException | None] = [None] * len(TOPICS)
        most = [0]
        gate = threading.Barrier(len(TOPICS) + 1)

        def ask(i: int) -> None:
            gate.wait()
            try:
                answers[i] = _ask(client, i)
            except BaseException as exc:
                answers[i] = exc

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(TOPICS))]
        kv_share = 0.0

        def several_in_flight() -> bool:
            nonlocal kv_share
            seen = metrics(server.base_url)
            most[0] = max(most[0], int(seen["gguf_pipeline_runs_in_flight"]))
            kv_share = max(kv_share, seen["gguf_pipeline_kv_cache_share{stage=0}"])
            # a run submitted is in flight before the chain's loop starts it and its
            # stages hold its KV cache: wait for both
            return most[0] > 1 and kv_share > 0

        last = chain.pids()[-1]
        os.kill(last, signal.SIGSTOP)  # no run can end until it is let go
        try:
            for t in threads:
                t.start()
            gate.wait()
            wait_for(several_in_flight, 60.0, "the metrics to show several runs in flight")
        finally:
            os.kill(last, signal.SIGCONT)
        for t in threads:
            t.join(120)
        assert answers == alone
        assert 0 < kv_share <= 1
        wait_for(lambda: idle(server.base_url), 10.0, "the server to be idle")
        after = metrics(server.base_url)
        assert after["gguf_pipeline_runs_in_flight"] == 0
        assert all(after[f"gguf_pipeline_kv_cache_bytes{{stage={i}}}"] == 0 for i in range(stages))
        rows = sum(a.prompt_tokens + a.fed_back for a in alone)
        records = sum(a.records(engine.chain.prefill_chunk) for a in alone)
        for i in range(stages):
            count_0, sum_0, _ = _batches(before, i)
            count, total, buckets = _batches(after, i)
            assert total - sum_0 == rows, (i, total, sum_0, rows)  # every row, once
            # Fewer batches than records: runs shared batches (a batch holds a record or
            # more, and no more rows than max_batch_rows).
            assert rows / engine.chain.template.max_batch_rows <= count - count_0 < records
            assert buckets == sorted(buckets) and buckets[-1] == count  # cumulative, +Inf
