"""Large prompts under the server, on uvicorn in this process over SmolLM2's tokenizer
(a warm chain that is never started: what is tested happens before any run), with a
tokenizer that reports when it tokenizes:

- ``GET /health`` is answered while a large prompt (within the size bound) is being
  tokenized: the body is parsed and the prompt tokenized off the event loop, and the
  tokenizer lets go of the interpreter while it merges;
- a prompt (or conversation) longer than the context can hold whatever its tokens is
  refused by its size, naming the limit, without being tokenized.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest

from runtime_core.tokenizer import Tokenizer
from runtime_cupy.serve.chain import WarmChain
from runtime_cupy.serve.engine import Engine
from tests.support.servers import InProcessServer

CONTEXT = 8192


class WatchedTokenizer:
    """A tokenizer that counts its ``encode`` calls and says when one runs."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.calls = 0
        self.entered = threading.Event()
        self.left = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        self.calls += 1
        self.entered.set()
        try:
            return self.inner.encode(text, **kwargs)
        finally:
            self.left.set()


@pytest.fixture(scope="module")
def served(smollm2_path: str) -> Iterator[tuple[InProcessServer, WatchedTokenizer]]:
    chain = WarmChain(smollm2_path, stages=1, context=CONTEXT)
    watched = WatchedTokenizer(chain.tokenizer)
    chain.tokenizer = watched  # type: ignore[assignment]
    server = InProcessServer(Engine(chain))  # not started: no stage runs
    try:
        yield server, watched
    finally:
        server.stop()


def _post(server: InProcessServer, path: str, body: dict[str, Any]) -> httpx2.Response:
    body = {"model": server.engine.model_names[0], **body}
    return httpx2.post(f"{server.base_url}{path}", json=body, timeout=120)


def test_health_answers_while_a_large_prompt_is_tokenized(
    served: tuple[InProcessServer, WatchedTokenizer],
) -> None:
    server, tok = served
    limit = CONTEXT * tok.longest_token_bytes
    text = "hello world " * (limit // 12)  # within the size bound, far past the context
    answers: list[httpx2.Response] = []
    body = {"prompt": text, "max_tokens": 1}
    asking = threading.Thread(target=lambda: answers.append(_post(server, "/v1/completions", body)))
    tok.entered.clear()
    tok.left.clear()
    asking.start()
    assert tok.entered.wait(60), "the prompt was never tokenized"
    # Ask again and again while it is tokenized (for seconds here): a loop held
    # by the tokenizer would answer once at most, before the merging began.
    answered = 0
    with httpx2.Client(base_url=server.base_url, timeout=60) as http:
        while not tok.left.is_set():
            health = http.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "starting"
            answered += not tok.left.is_set()
    assert answered >= 5, f"GET /health answered {answered} times while the prompt was tokenized"
    asking.join(120)
    error = answers[0].json()["error"]
    assert answers[0].status_code == 400 and error["code"] == "context_length_exceeded", error


@pytest.mark.parametrize("endpoint", ["completion", "chat"])
def test_a_prompt_too_large_for_the_context_is_refused_by_size_untokenized(
    served: tuple[InProcessServer, WatchedTokenizer], endpoint: str
) -> None:
    server, tok = served
    limit = CONTEXT * tok.longest_token_bytes
    text = "x" * (limit + 1)
    if endpoint == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}
    else:
        path, body = "/v1/completions", {"prompt": text}
    calls = tok.calls
    r = _post(server, path, body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded", error
    assert error["param"] == ("messages" if endpoint == "chat" else "prompt")
    assert f"over {limit} bytes" in error["message"] and f"{CONTEXT} tokens" in error["message"]
    assert tok.calls == calls, "the prompt was tokenized"
