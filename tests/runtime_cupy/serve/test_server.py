"""``python -m runtime_cupy serve`` against the official ``openai`` client on loopback.

One server (two stages of the default worker, of a tiny random model with SmolLM2's chat
template, a key from ``GGUF_PIPELINE_API_KEY``) serves every test here:

- chat and completions, whole and streamed, give the text of ``runtime_cupy.generate``
  (the same worker, prompt, stage count and sampling: greedy, and with a
  temperature and a seed), with usage and ``finish_reason``; stop strings cut it;
- four clients at once are all answered, each as it would be alone, started in the
  order the server logged their arrival and running together;
- a stage killed between two requests is started again and the next request succeeds;
- every bad request gets its 4xx and an OpenAI error object naming the field, a wrong
  or missing key gets 401, and ``/metrics`` counts all of it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from collections.abc import Iterator
from typing import Any

import httpx2
import openai
import pytest

from runtime_core.tokenizer import Tokenizer
from runtime_cupy import generate
from runtime_cupy.cli.serve import API_KEY_VARIABLE
from runtime_cupy.serve.prompts import chat_prompt
from runtime_cupy.serve.requests import MAX_CHOICES, Message
from runtime_cupy.workers import DEFAULT_WORKER
from tests.support.hygiene import wait_gone
from tests.support.servers import ServerProcess, idle, metrics, wait_for

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process

KEY = "test-key-5f1b"
AUTH = {"Authorization": f"Bearer {KEY}"}
STAGES = 2
WORKER = DEFAULT_WORKER  # what a user gets (the CPU worker); generate runs it too
CONTEXT = 256


@pytest.fixture(scope="module")
def server(tiny_chat: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {**os.environ, API_KEY_VARIABLE: KEY}
    args = ["--model", tiny_chat, "--stages", str(STAGES), "--worker", WORKER, "--port", "0",
            "--max-queue", "8"]  # fmt: skip
    s = ServerProcess([*args, "--context", str(CONTEXT)], log, env)
    try:
        s.wait_listening()
        s.wait_ready()
        yield s
    finally:
        pids = list(s.stage_pids().values())
        assert s.stop() == 143, s.log()  # 128 + SIGTERM
        assert not wait_gone(pids, 10.0), "stage processes outlived the server"


@pytest.fixture(autouse=True)
def settled(server: ServerProcess) -> Iterator[None]:
    """Every test leaves the server idle (so that what a run holds is not taken for a
    leftover)."""
    yield
    wait_for(lambda: idle(server.base_url, AUTH), 60.0, "the server to be idle")


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_chat: str) -> Tokenizer:
    return Tokenizer.from_gguf(tiny_chat)


def expected(model: str, ids: list[int], max_tokens: int, **sampling: Any) -> tuple[str, int]:
    """What ``runtime_cupy.generate`` (the server's worker) makes of ``ids``: text, tokens."""
    result = generate(model, ids, stages=STAGES, max_tokens=max_tokens, worker=WORKER, **sampling)
    assert result.outcome == "completed", result.fault
    return result.text, len(result.tokens)


def finish(tokens: int, max_tokens: int) -> str:
    return "length" if tokens >= max_tokens else "stop"


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]


def test_chat_whole_and_streamed_is_generate_s_text(
    client: openai.OpenAI, tiny_chat: str, tokenizer: Tokenizer
) -> None:
    ids = chat_prompt(tokenizer, [Message(m["role"], m["content"]) for m in CHAT])
    text, n = expected(tiny_chat, ids, 12)
    whole = client.chat.completions.create(
        model="tiny-chat",
        messages=CHAT,
        max_tokens=12,
        temperature=0,
    )
    assert whole.object == "chat.completion"
    choice = whole.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == text
    assert choice.finish_reason == finish(n, 12)
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), n)
    assert whole.usage.total_tokens == len(ids) + n
    chunks = list(
        client.chat.completions.create(
            model="tiny-chat",
            messages=CHAT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == finish(n, 12) and set(reasons[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == n


def test_completions_with_a_seed_are_generate_s_text(
    client: openai.OpenAI, tiny_chat: str, tokenizer: Tokenizer
) -> None:
    prompt = "The quick brown fox"
    ids = tokenizer.encode(prompt, add_special=True, parse_special=True)
    sampling = {"temperature": 0.8, "top_p": 0.9, "seed": 1234}
    text, n = expected(tiny_chat, ids, 10, **sampling)
    whole = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=10, **sampling)
    assert whole.object == "text_completion"
    assert whole.choices[0].text == text
    assert whole.choices[0].finish_reason == finish(n, 10)
    assert whole.usage is not None and whole.usage.completion_tokens == n
    streamed = client.completions.create(
        model="tiny-chat",
        prompt=prompt,
        max_tokens=10,
        stream=True,
        **sampling,
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == finish(n, 10)
    # The same ids as a prompt of token ids.
    by_ids = client.completions.create(model="tiny-chat", prompt=ids, max_tokens=10, **sampling)
    assert by_ids.choices[0].text == text


def test_a_completion_with_echo_starts_with_its_prompt(
    client: openai.OpenAI, tokenizer: Tokenizer
) -> None:
    """``echo``: each choice's text is the prompt's (as given, or its token ids' text)
    and then what the same request without it answers, whole and streamed (the prompt a
    first chunk of each choice); the usage counts the same tokens."""
    prompt = "The quick brown fox"
    ask = {"model": "tiny-chat", "max_tokens": 6, "temperature": 0.8, "seed": 5, "n": 2}
    plain = client.completions.create(prompt=prompt, **ask)
    texts = [c.text for c in plain.choices]
    assert all(texts)
    whole = client.completions.create(prompt=prompt, echo=True, **ask)
    assert [c.text for c in whole.choices] == [prompt + t for t in texts]
    assert whole.usage == plain.usage
    chunks = list(client.completions.create(prompt=prompt, echo=True, stream=True, **ask))
    for i, text in enumerate(texts):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].text == prompt and mine[0].finish_reason is None
        assert "".join(m.text for m in mine) == prompt + text
    ids = tokenizer.encode(prompt, add_special=True, parse_special=True)
    by_ids = client.completions.create(prompt=ids, echo=True, **ask)
    assert [c.text for c in by_ids.choices] == [tokenizer.decode(ids) + t for t in texts]


def test_an_echoed_prompt_is_the_text_the_model_read(
    server: ServerProcess, tokenizer: Tokenizer
) -> None:
    """A prompt holding a lone surrogate (half an emoji: what a JavaScript client that
    cut a string sends; the openai client cannot send one) is echoed as the model read
    it, the surrogate as U+FFFD, whole and streamed (once a 500, and a stream cut
    short with no chunk)."""
    url = f"{server.base_url}/v1/completions"
    headers = {**AUTH, "Content-Type": "application/json"}
    ask = b'"model": "tiny-chat", "prompt": "Hello \\ud83c", "max_tokens": 2, "echo": true'
    read = "Hello \ufffd"
    assert tokenizer.encode("Hello \ud83c") == tokenizer.encode(read)
    r = httpx2.post(url, content=b"{" + ask + b"}", headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith(read), r.text
    with httpx2.stream(
        "POST", url, content=b"{" + ask + b', "stream": true}', headers=headers
    ) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]", lines
    first = json.loads(lines[0][len("data: ") :])
    assert first["choices"][0]["text"] == read, lines


def test_n_choices_are_n_runs_choice_i_seeded_seed_plus_i(client: openai.OpenAI) -> None:
    """``n`` choices, whole and streamed: choice ``i`` is what one choice of seed
    ``seed + i`` is (``prompts.choice_seed``), and the usage counts the prompt once and
    every choice's tokens."""
    sampling = {"temperature": 1.0, "seed": 77}
    alone = [
        client.completions.create(
            model="tiny-chat", prompt="Once upon", max_tokens=8, **{**sampling, "seed": 77 + i}
        )
        for i in range(3)
    ]
    whole = client.completions.create(model="tiny-chat", prompt="Once upon", max_tokens=8, n=3,
                                      **sampling)  # fmt: skip
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.text for c in whole.choices] == [a.choices[0].text for a in alone]
    assert len({c.text for c in whole.choices}) > 1  # each its own stream of samples
    assert whole.usage is not None and alone[0].usage is not None
    assert whole.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert whole.usage.completion_tokens == sum(
        a.usage.completion_tokens for a in alone if a.usage is not None
    )
    chunks = list(
        client.chat.completions.create(
            model="tiny-chat",
            messages=CHAT,
            max_tokens=8,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
            **sampling,
        )
    )
    chat_whole = client.chat.completions.create(
        model="tiny-chat", messages=CHAT, max_tokens=8, n=2, **sampling
    )
    assert len({c.id for c in chunks}) == 1
    for i, choice in enumerate(chat_whole.choices):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].delta.role == "assistant"
        assert "".join(m.delta.content or "" for m in mine) == choice.message.content
        assert [m.finish_reason for m in mine][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chat_whole.usage is not None
    assert chunks[-1].usage.completion_tokens == chat_whole.usage.completion_tokens


def test_a_stream_is_server_sent_events_ending_with_done(server: ServerProcess) -> None:
    body = {"model": "tiny-chat", "prompt": "Hello", "max_tokens": 4, "stream": True}
    with httpx2.stream(
        "POST", f"{server.base_url}/v1/completions", json=body, headers=AUTH
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert json.loads(line[len("data: ") :])["object"] == "text_completion"


def test_a_stop_string_cuts_the_answer(
    client: openai.OpenAI, tiny_chat: str, tokenizer: Tokenizer
) -> None:
    ids = tokenizer.encode("Once upon a time", add_special=True, parse_special=True)
    text, _ = expected(tiny_chat, ids, 16)
    assert len(text) > 4, text
    stop = text[2:4]
    cut = text[: text.index(stop)]
    whole = client.completions.create(
        model="tiny-chat", prompt=ids, max_tokens=16, temperature=0, stop=[stop, "\x00never"]
    )
    assert whole.choices[0].text == cut
    assert whole.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(
            model="tiny-chat", prompt=ids, max_tokens=16, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_four_clients_at_once_start_in_the_order_they_arrived_and_run_together(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    prompts = [f"Request number {i} says" for i in range(4)]
    alone = {
        p: client.completions.create(model="tiny-chat", prompt=p, max_tokens=8, temperature=0)
        .choices[0]
        .text
        for p in prompts
    }
    answers: dict[str, tuple[str, str]] = {}
    gate = threading.Barrier(4)

    def ask(prompt: str, stream: bool) -> None:
        gate.wait()
        if stream:
            chunks = list(client.completions.create(model="tiny-chat", prompt=prompt,
                          max_tokens=8, temperature=0, stream=True))  # fmt: skip
            answers[prompt] = (chunks[0].id, "".join(c.choices[0].text for c in chunks))
        else:
            r = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=8,
                                          temperature=0)  # fmt: skip
            answers[prompt] = (r.id, r.choices[0].text)

    threads = [threading.Thread(target=ask, args=(p, i % 2 == 0)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert {p: a[1] for p, a in answers.items()} == alone
    log = server.log()
    ids = [a[0] for a in answers.values()]
    events = [
        (m.group(2), m.group(1))
        for m in re.finditer(r"request #\d+ \((\S+)\) (queued|started|finished)", log)
        if m.group(1) in ids
    ]
    queued = [i for what, i in events if what == "queued"]
    started = [i for what, i in events if what == "started"]
    assert sorted(queued) == sorted(ids) and started == queued, events
    # Several runs at a time (continuous batching): some request started while another
    # ran.
    running, most = 0, 0
    for what, _ in events:
        running += {"started": 1, "finished": -1}.get(what, 0)
        most = max(most, running)
    assert most > 1, events


def test_a_stage_killed_between_requests_is_started_again(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    before = client.completions.create(
        model="tiny-chat", prompt="Again", max_tokens=6, temperature=0
    )
    pids = server.stage_pids()
    os.kill(pids[1], signal.SIGKILL)
    assert not wait_gone([pids[1]], 10.0)
    after = client.completions.create(
        model="tiny-chat", prompt="Again", max_tokens=6, temperature=0
    )
    assert after.choices[0].text == before.choices[0].text
    new = server.stage_pids()
    assert not set(new.values()) & set(pids.values())  # the whole chain started again
    server.wait_ready()
    assert metrics(server.base_url, AUTH)["gguf_pipeline_stage_restarts_total"] >= 1


def test_models_health_and_metrics(client: openai.OpenAI, server: ServerProcess) -> None:
    assert [m.id for m in client.models.list()] == ["tiny-chat"]
    assert client.models.retrieve("tiny-chat").owned_by == "gguf-pipeline"
    assert server.health() == 200
    before = metrics(server.base_url, AUTH)
    client.completions.create(model="tiny-chat", prompt="Count", max_tokens=3, temperature=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny-chat", prompt="Count", max_tokens=-3)
    after = metrics(server.base_url, AUTH)
    done = "gguf_pipeline_requests_total{endpoint=completion,outcome=completed}"
    bad = "gguf_pipeline_requests_total{endpoint=completion,outcome=rejected}"
    assert after[done] == before[done] + 1
    assert after[bad] == before[bad] + 1
    assert (
        after["gguf_pipeline_completion_tokens_total"]
        >= before["gguf_pipeline_completion_tokens_total"] + 1
    )
    ttft = "gguf_pipeline_time_to_first_token_seconds_count"
    assert after[ttft] == before[ttft] + 1
    assert "gguf_pipeline_time_per_output_token_seconds_count" in after
    assert after["gguf_pipeline_queue_length"] == 0
    assert after["gguf_pipeline_stages_ready"] == 1


def test_the_tokens_of_a_choice_its_client_left_count_as_generated(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    """``completion_tokens_total`` counts every token generated: a stream the client
    closes mid-way counts the tokens it was sent (they counted nowhere before, so
    tokens/s read from the counter fell whenever clients hung up)."""
    tokens = "gguf_pipeline_completion_tokens_total"
    cancelled = "gguf_pipeline_requests_total{endpoint=completion,outcome=cancelled}"
    before = metrics(server.base_url, AUTH)
    stream = client.completions.create(
        model="tiny-chat", prompt="Go on", max_tokens=CONTEXT - 8, temperature=0, stream=True
    )
    pieces = 0
    for chunk in stream:
        pieces += bool(chunk.choices and chunk.choices[0].text)
        if pieces == 6:
            break
    stream.close()
    assert pieces == 6, "the answer ended before the client left"
    wait_for(
        lambda: metrics(server.base_url, AUTH).get(cancelled, 0) > before.get(cancelled, 0),
        30.0,
        "the stream to count as cancelled",
    )
    after = metrics(server.base_url, AUTH)
    assert after[tokens] >= before[tokens] + pieces  # a piece is a token or more


def test_a_request_without_the_right_key_gets_401(server: ServerProcess) -> None:
    wrong = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.completions.create(model="tiny-chat", prompt="x", max_tokens=1)
    assert info.value.status_code == 401
    body = {"model": "tiny-chat", "prompt": "x"}
    for headers in ({}, {"Authorization": "Basic abc"}, {"Authorization": f"Bearer {KEY}x"}):
        r = httpx2.post(f"{server.base_url}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx2.get(f"{server.base_url}/v1/models").status_code == 401
    assert httpx2.get(f"{server.base_url}/health").status_code == 200  # no key needed


MSG = [{"role": "user", "content": "hi"}]
TOO_LONG = "word " * (CONTEXT + 10)


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny-chat", "messages": MSG, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny-chat", "prompt": "x", **fields}


def one(**message: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "x", **message}]


def nested(field: str, depth: int) -> bytes:
    """A chat body whose ``field`` is 0.5 inside ``depth`` arrays."""
    inner = b"[" * depth + b"0.5" + b"]" * depth
    return b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "%s": %s}' % (
        field.encode(),
        inner,
    )


BAD: list[tuple[str, Any, int, str | None]] = [
    # (endpoint, body (bytes: sent as they are), status, the param the error names)
    ("chat", b"{not json", 400, None),
    ("chat", b"[1, 2]", 400, None),
    ("chat", b'{"model": "tiny-chat", "messages": [], "max_tokens": NaN}', 400, None),
    ("chat", b"\xff\xfe", 400, None),
    ("chat", {"messages": MSG}, 400, "model"),
    ("chat", chat(model="gpt-4o"), 404, "model"),
    ("chat", {"model": "tiny-chat"}, 400, "messages"),
    ("chat", chat(messages="hi"), 400, "messages"),
    ("chat", chat(messages=one(role="robot")), 400, "messages[0].role"),
    ("chat", chat(messages=one(mood=1)), 400, "messages[0].mood"),
    ("chat", chat(messages=one(content=5)), 400, "messages[0].content"),
    ("chat", chat(max_tokens=-1), 400, "max_tokens"),
    ("chat", chat(max_tokens=0), 400, "max_tokens"),
    ("chat", chat(max_tokens="8"), 400, "max_tokens"),
    ("chat", chat(max_tokens=True), 400, "max_tokens"),
    ("chat", chat(max_tokens=10**12), 400, "max_tokens"),
    ("chat", chat(max_tokens=CONTEXT), 400, "max_tokens"),
    ("chat", chat(max_completion_tokens=CONTEXT), 400, "max_completion_tokens"),
    ("chat", chat(temperature=2.5), 400, "temperature"),
    ("chat", chat(temperature="hot"), 400, "temperature"),
    ("chat", chat(top_p=0), 400, "top_p"),
    ("chat", chat(top_k=-2), 400, "top_k"),
    ("chat", chat(seed=1.5), 400, "seed"),
    ("chat", chat(n=0), 400, "n"),
    ("chat", chat(n=MAX_CHOICES + 1), 400, "n"),
    ("chat", chat(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    ("chat", chat(stop=[""]), 400, "stop[0]"),
    ("chat", chat(stream="yes"), 400, "stream"),
    ("chat", chat(stream_options={"include_usage": True}), 400, "stream_options"),
    ("chat", chat(stream_options={}), 400, "stream_options"),  # without stream, as OpenAI
    ("chat", chat(presence_penalty=0.5), 400, "presence_penalty"),
    ("chat", chat(tools=[{"type": "function"}]), 400, "tools"),
    ("chat", chat(temprature=0.5), 400, "temprature"),
    ("chat", chat(messages=one(content=TOO_LONG)), 400, "messages"),
    ("completion", {"model": "tiny-chat"}, 400, "prompt"),
    ("completion", completion(prompt=TOO_LONG), 400, "prompt"),
    ("completion", completion(prompt=["a", "b"]), 400, "prompt"),
    ("completion", completion(prompt=[1, 10**9]), 400, "prompt[1]"),
    ("completion", completion(prompt=[1, -4]), 400, "prompt[1]"),
    ("completion", completion(prompt=""), 400, "prompt"),
    ("completion", completion(echo=True, logprobs=1), 400, "echo"),  # the prompt's: none
    ("completion", completion(echo="yes"), 400, "echo"),
    ("chat", chat(echo=True), 400, "echo"),  # a completion's field
    ("completion", completion(logprobs=6), 400, "logprobs"),
    ("completion", completion(logprobs=0), 400, "logprobs"),  # served without --logprobs
    ("chat", chat(logprobs=True), 400, "logprobs"),
    ("completion", completion(logprobs=True), 400, "logprobs"),
    ("chat", chat(logprobs=1), 400, "logprobs"),
    ("chat", chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("chat", chat(top_logprobs=2), 400, "top_logprobs"),
    ("completion", completion(messages=MSG), 400, "messages"),
    # Once 500s: a number past every float, a field named by a lone surrogate, nesting.
    ("chat", chat(temperature=10**400), 400, "temperature"),
    ("completion", completion(top_p=10**400), 400, "top_p"),
    ("completion", b'{"model": "tiny-chat", "prompt": "x", "\\ud800": 1}', 400, "\\ud800"),
    ("chat", nested("temperature", 961), 400, None),
    ("chat", nested("temperature", 962), 400, None),
]
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


@pytest.mark.parametrize(("endpoint", "body", "status", "param"), BAD)
def test_a_bad_request_gets_its_4xx_naming_the_field(
    server: ServerProcess, endpoint: str, body: Any, status: int, param: str | None
) -> None:
    url = server.base_url + PATHS[endpoint]
    if isinstance(body, bytes):
        r = httpx2.post(url, content=body, headers={**AUTH, "Content-Type": "application/json"})
    else:
        r = httpx2.post(url, json=body, headers=AUTH)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert param.split("[")[0].split(".")[0] in error["message"]
    assert "Traceback" not in r.text


@pytest.mark.parametrize(
    ("prompt", "where"),
    [([1, 10**9], "prompt[1]"), ([[1, 10**9]], "prompt[0][1]"), ([[1, -4]], "prompt[0][1]")],
)
def test_a_bad_token_id_is_named_where_the_body_has_it(
    server: ServerProcess, prompt: list[Any], where: str
) -> None:
    """In an array of one as in a flat one (once ``prompt[1]`` for ``[[1, 10**9]]``)."""
    r = httpx2.post(f"{server.base_url}/v1/completions", json=completion(prompt=prompt),
                    headers=AUTH)  # fmt: skip
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == where, error
    assert error["message"].startswith(f"{where} is "), error


def test_the_openai_client_gets_400s_for_what_were_500s(client: openai.OpenAI) -> None:
    for sampling in ({"temperature": 10**400}, {"top_p": -(10**400)}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny-chat", messages=MSG, **sampling)  # type: ignore[call-overload]
        body = info.value.body
        assert isinstance(body, dict) and body["param"] == next(iter(sampling)), body
    # (The client cannot send a lone surrogate at all: BAD sends one as raw HTTP.)


def test_the_rest_of_the_http_surface_is_4xx_too(server: ServerProcess) -> None:
    base = server.base_url
    assert httpx2.get(f"{base}/v1/nothing", headers=AUTH).status_code == 404
    slash = httpx2.post(f"{base}/v1/chat/completions/", json={}, headers=AUTH)  # once a 307
    assert slash.status_code == 404 and slash.json()["error"]["code"] == "not_found", slash
    wrong = httpx2.get(f"{base}/v1/completions", headers=AUTH)  # a 405 says what is allowed
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST", wrong.headers
    assert httpx2.get(f"{base}/v1/models/gpt-4o", headers=AUTH).status_code == 404
    huge = b'{"model": "tiny-chat", "prompt": "' + b"x" * (9 << 20) + b'"}'
    json_type = {**AUTH, "Content-Type": "application/json"}
    r = httpx2.post(f"{base}/v1/completions", content=huge, headers=json_type)
    assert r.status_code == 413 and "error" in r.json()


def test_a_body_a_web_page_could_send_unasked_is_415_and_json_is_served(
    server: ServerProcess,
) -> None:
    # A page in the user's browser may POST text/plain, form or multipart bodies, or a
    # body with no type (fetch of a Blob without one), to localhost without a CORS
    # preflight; as JSON they would run its requests.
    url = f"{server.base_url}/v1/completions"
    body = b'{"model": "tiny-chat", "prompt": "Say hi", "max_tokens": 1}'
    for kind in ("text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                 "multipart/form-data; boundary=x", None):  # fmt: skip
        headers = {**AUTH, **({"Content-Type": kind} if kind else {})}
        r = httpx2.post(url, content=body, headers=headers)
        error = r.json()["error"]
        assert r.status_code == 415 and error["code"] == "unsupported_media_type", r.text
        assert (kind.split(";")[0] if kind else "no Content-Type") in error["message"]
    for kind in ("application/json; charset=utf-8", "Application/JSON"):
        r = httpx2.post(url, content=body, headers={**AUTH, "Content-Type": kind})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text
