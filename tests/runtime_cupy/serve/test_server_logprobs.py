"""Log probabilities through the server, on 2 stages, read by the official ``openai``
client: chat's ``logprobs`` / ``top_logprobs`` and completions' ``logprobs``, whole and
streamed, for greedy and seeded sampling.

Each token's log probability is checked against the log-softmax, computed here with
``np.logaddexp.reduce`` in float64, of the raw logits the chain hands over for the same
prompt and settings (``WarmChain.generate``'s ``on_logits``); the alternatives are the
most likely tokens of their step, in order; the tokens' bytes spell the answer; a
stream carries the same entries as the whole answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from runtime_cupy.serve.chain import WarmChain
from runtime_cupy.serve.engine import Engine
from runtime_cupy.serve.prompts import chat_prompt
from runtime_cupy.serve.requests import Message
from tests.support.servers import InProcessServer, serving

pytestmark = pytest.mark.process

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def server(tiny_chat: str) -> Iterator[InProcessServer]:
    engine = Engine(WarmChain(tiny_chat, stages=2, context=128, logprobs=True))
    with serving(engine) as s:
        yield s


def _expected(
    server: InProcessServer, prompt: list[int], tokens: int, **sampling: Any
) -> tuple[list[int], list[np.ndarray]]:
    """The tokens and each step's log-softmax of the same run on the chain."""
    steps: list[np.ndarray] = []

    def keep(logits: np.ndarray) -> None:
        z = np.asarray(logits, np.float64)
        steps.append(z - np.logaddexp.reduce(z))

    run = server.engine.chain.generate(prompt, max_tokens=tokens, on_logits=keep, **sampling)
    return list(run.result.tokens), steps


def _chat_ids(server: InProcessServer) -> list[int]:
    messages = [Message(m["role"], m["content"]) for m in MESSAGES]
    return chat_prompt(server.engine.tokenizer, messages)


def _check_entry(entry: Any, step: np.ndarray, token_id: int, top: int) -> None:
    tokenizer_bytes = bytes(entry.bytes)
    assert entry.logprob == pytest.approx(step[token_id], abs=1e-9)
    assert entry.logprob <= 0
    order = sorted(range(step.size), key=lambda i: (-step[i], i))[:top]
    assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
        [step[i] for i in order], abs=1e-9
    )
    assert all(_token_bytes(t.token) == bytes(t.bytes) for t in entry.top_logprobs)
    assert _token_bytes(entry.token) == tokenizer_bytes


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0.0}, {"temperature": 1.1, "seed": 7}], ids=["greedy", "seeded"]
)
def test_chat_logprobs_are_the_raw_logits_log_softmax(
    server: InProcessServer, sampling: dict[str, Any]
) -> None:
    client = server.client()
    ask: dict[str, Any] = {
        "model": "tiny-chat",
        "messages": MESSAGES,
        "max_tokens": 10,
        "logprobs": True,
        "top_logprobs": 3,
        **sampling,
    }
    answer = client.chat.completions.create(**ask)
    choice = answer.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert answer.usage is not None and len(entries) == answer.usage.completion_tokens
    tokens, steps = _expected(server, _chat_ids(server), 10, **sampling)
    assert len(entries) == len(tokens) == len(steps)
    for entry, step, token in zip(entries, steps, tokens, strict=True):
        _check_entry(entry, step, token, 3)
    if sampling["temperature"] == 0.0:  # greedy: each token is its step's most likely
        assert all(e.token == e.top_logprobs[0].token for e in entries)
    text = b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace")
    assert text.startswith(choice.message.content or "")

    # Streamed: the same entries, spread over the chunks.
    stream = client.chat.completions.create(**ask, stream=True)
    streamed = [
        e
        for chunk in stream
        for c in chunk.choices
        if c.logprobs is not None and c.logprobs.content
        for e in c.logprobs.content
    ]
    assert [(e.token, e.logprob, [t.logprob for t in e.top_logprobs]) for e in streamed] == [
        (e.token, e.logprob, [t.logprob for t in e.top_logprobs]) for e in entries
    ]


def test_chat_without_logprobs_shows_none_and_top_0_shows_no_alternatives(
    server: InProcessServer,
) -> None:
    client = server.client()
    ask: dict[str, Any] = {"model": "tiny-chat", "messages": MESSAGES, "max_tokens": 4}
    plain = client.chat.completions.create(**ask, temperature=0)
    assert plain.choices[0].logprobs is None
    bare = client.chat.completions.create(**ask, temperature=0, logprobs=True)
    content = bare.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    assert all(e.top_logprobs == [] for e in content)
    assert bare.choices[0].message.content == plain.choices[0].message.content


def test_completion_logprobs_spell_the_text_with_offsets(server: InProcessServer) -> None:
    client = server.client()
    prompt = "The sea is"
    answer = client.completions.create(
        model="tiny-chat", prompt=prompt, max_tokens=8, temperature=0, logprobs=2
    )
    choice = answer.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    ids = server.engine.tokenizer.encode(prompt, add_special=True, parse_special=True)
    tokens, steps = _expected(server, ids, 8, temperature=0.0)
    assert len(lp.tokens) == len(tokens) == 8
    assert lp.token_logprobs == pytest.approx(
        [s[t] for s, t in zip(steps, tokens, strict=True)], abs=1e-9
    )
    for alternatives, step in zip(lp.top_logprobs, steps, strict=True):
        # two, always: byte tokens of part of a character once all read U+FFFD and
        # collided as keys (``bytes:\x..`` names them apart now)
        assert len(alternatives) == 2
        assert sorted(alternatives.values(), reverse=True) == pytest.approx(
            sorted(step)[::-1][:2], abs=1e-9
        )
    if choice.finish_reason == "length":  # no EOS: the tokens spell the text exactly
        spelled = b"".join(_token_bytes(name) for name in lp.tokens)
        assert spelled.decode("utf-8", "replace") == choice.text
    # Each token's text begins where the text of the tokens before it ends: their bytes
    # decoded (here by Python), an incomplete character at the end left out (a token
    # may end inside one: a random model's answer often does).
    data = [server.engine.tokenizer.token_bytes(t, special=True) for t in tokens]
    before = [b"".join(data[:i]).decode("utf-8", "replace").rstrip("\ufffd") for i in range(8)]
    assert lp.text_offset == [len(b) for b in before]
    chunks = list(
        client.completions.create(
            model="tiny-chat", prompt=prompt, max_tokens=8, temperature=0, logprobs=2, stream=True
        )
    )
    streamed = [
        o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset or []
    ]
    assert streamed == lp.text_offset  # counted once, at the engine, whole or streamed


def test_each_choice_has_its_own_entries_whole_and_streamed_and_a_stop_string_ends_them(
    server: InProcessServer,
) -> None:
    client = server.client()
    ask: dict[str, Any] = {
        "model": "tiny-chat",
        "messages": MESSAGES,
        "max_tokens": 12,
        "temperature": 1.1,
        "seed": 3,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 1,
    }
    whole = client.chat.completions.create(**ask)
    by_index = {c.index: c.logprobs.content for c in whole.choices}  # type: ignore[union-attr]
    assert set(by_index) == {0, 1}
    assert whole.usage is not None
    assert sum(len(v or []) for v in by_index.values()) == whole.usage.completion_tokens
    streamed: dict[int, list[Any]] = {0: [], 1: []}
    for chunk in client.chat.completions.create(**ask, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.content:
                streamed[c.index].extend(c.logprobs.content)
    for i in (0, 1):
        assert [(e.token, e.logprob) for e in streamed[i]] == [
            (e.token, e.logprob) for e in by_index[i] or []
        ]

    # A stop string from choice 0's text: its entries end with the token that completed
    # it, one per counted token, and spell the shown text first.
    text = whole.choices[0].message.content or ""
    if len(text) < 4:
        pytest.skip(f"choice 0 answered {text!r}: too short to cut")
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = client.chat.completions.create(**{**ask, "n": 1, "stop": [stop]})
    choice = cut.choices[0]
    entries = choice.logprobs.content or []  # type: ignore[union-attr]
    assert cut.usage is not None and len(entries) == cut.usage.completion_tokens
    assert choice.finish_reason == "stop"
    spelled = b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace")
    assert spelled.startswith(choice.message.content or "") and stop in spelled
    assert [e.logprob for e in entries] == [e.logprob for e in (by_index[0] or [])[: len(entries)]]


def _token_bytes(name: str) -> bytes:
    """The bytes a token's name in ``logprobs`` stands for (``bytes:\\x..``: those)."""
    if name.startswith("bytes:"):
        return bytes.fromhex(name.removeprefix("bytes:").replace("\\x", ""))
    return name.encode()
