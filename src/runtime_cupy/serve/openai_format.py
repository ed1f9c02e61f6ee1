"""The response bodies and stream chunks of OpenAI's chat completions and (legacy)
completions APIs, as the official clients parse them.

A streamed answer is server-sent events: (a completion asked with ``echo``: its
prompt's text first, a chunk per choice) one ``data: <chunk JSON>`` event per piece of
text, a last chunk with the ``finish_reason``, a chunk with ``usage`` when the request
asked for it (``stream_options.include_usage``: every other chunk then carries
``"usage": null``, as OpenAI's do), then ``data: [DONE]``. An error after
the stream began is one ``data: {"error": ...}`` event before ``[DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from runtime_core.tokenizer import Tokenizer, read_text
from runtime_cupy.serve.events import Failed, Finished
from runtime_cupy.serve.jobs import Job
from runtime_cupy.serve.logprobs import TokenLogprob, chat_logprobs, completion_logprobs

DONE = b"data: [DONE]\n\n"


def event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False).encode("utf-8") + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def error_body(failed: Failed) -> dict[str, Any]:
    return {"error": {"message": failed.message, "type": failed.type, "param": None,
                      "code": failed.code}}  # fmt: skip


def _head(job: Job, model: str, obj: str) -> dict[str, Any]:
    return {"id": job.id, "object": obj, "created": job.created, "model": model}


def _chunk_head(job: Job, model: str, obj: str) -> dict[str, Any]:
    """A chunk's head: with ``stream_options.include_usage``, every chunk but the last
    carries ``"usage": null`` (OpenAI's API reference: "All other chunks will also
    include a usage field, but with a null value"), the last one the usage."""
    head = _head(job, model, obj)
    if job.prepared.request.include_usage:
        head["usage"] = None
    return head


# -- whole answers ------------------------------------------------------------------------


def _usage_of(dones: Sequence[Finished]) -> dict[str, int]:
    """A request's usage: its prompt once, every choice's tokens."""
    return usage(dones[0].prompt_tokens, sum(d.completion_tokens for d in dones))


def logprobs_of(
    job: Job, tokenizer: Tokenizer, entries: Sequence[TokenLogprob] | None
) -> dict[str, Any] | None:
    """A choice's or chunk's ``logprobs`` (``None`` where the request asked for none)."""
    if entries is None or job.prepared.request.logprobs is None:
        return None
    if job.prepared.request.endpoint == "chat":
        return chat_logprobs(tokenizer, entries)
    return completion_logprobs(tokenizer, entries)


def chat_response(
    job: Job, model: str, dones: Sequence[Finished], tokenizer: Tokenizer
) -> dict[str, Any]:
    """The whole answer: one choice per run (``dones`` in choice order)."""
    return {
        **_head(job, model, "chat.completion"),
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": done.text},
                "logprobs": logprobs_of(job, tokenizer, done.logprobs),
                "finish_reason": done.finish_reason,
            }
            for i, done in enumerate(dones)
        ],
        "usage": _usage_of(dones),
    }


def echoed(job: Job, tokenizer: Tokenizer) -> str:
    """What a completion's text starts with: its prompt's text where the request asked
    for ``echo`` (the prompt as the model read it: as given, a lone surrogate, which
    UTF-8 cannot hold, as U+FFFD; or its token ids' text), else nothing."""
    request = job.prepared.request
    if not request.echo:
        return ""
    if isinstance(request.prompt, str):
        return read_text(request.prompt)
    return tokenizer.decode(request.prompt)


def completion_response(
    job: Job, model: str, dones: Sequence[Finished], tokenizer: Tokenizer
) -> dict[str, Any]:
    prefix = echoed(job, tokenizer)
    return {
        **_head(job, model, "text_completion"),
        "choices": [
            {
                "index": i,
                "text": prefix + done.text,
                "logprobs": logprobs_of(job, tokenizer, done.logprobs),
                "finish_reason": done.finish_reason,
            }
            for i, done in enumerate(dones)
        ],
        "usage": _usage_of(dones),
    }


# -- chunks (``job``: the request's first choice, whose id every chunk carries) ---------------


def chat_chunk(
    job: Job,
    model: str,
    delta: dict[str, str],
    finish_reason: str | None = None,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        **_chunk_head(job, model, "chat.completion.chunk"),
        "choices": [
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        ],
    }


def completion_chunk(
    job: Job,
    model: str,
    text: str,
    finish_reason: str | None = None,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        **_chunk_head(job, model, "text_completion"),
        "choices": [
            {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        ],
    }


def usage_chunk(job: Job, model: str, dones: Sequence[Finished]) -> dict[str, Any]:
    obj = "chat.completion.chunk" if job.prepared.request.endpoint == "chat" else "text_completion"
    return {**_chunk_head(job, model, obj), "choices": [], "usage": _usage_of(dones)}


def piece_chunk(
    job: Job, model: str, text: str, index: int = 0, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A piece of a choice's text (``logprobs``: its tokens', ``logprobs_of``)."""
    if job.prepared.request.endpoint == "chat":
        return chat_chunk(job, model, {"content": text}, index=index, logprobs=logprobs)
    return completion_chunk(job, model, text, index=index, logprobs=logprobs)


def last_chunk(
    job: Job, model: str, done: Finished, index: int = 0, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A choice's end (``logprobs``: its tokens no piece carried)."""
    if job.prepared.request.endpoint == "chat":
        return chat_chunk(job, model, {}, done.finish_reason, index, logprobs)
    return completion_chunk(job, model, "", done.finish_reason, index, logprobs)
