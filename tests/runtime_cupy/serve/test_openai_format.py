"""The stream chunks of ``serve.openai_format`` as OpenAI's API reference has them: with
``stream_options.include_usage``, every chunk carries ``usage``, null on all but the
last one (which holds the request's usage and no choices); without it, none does."""

from __future__ import annotations

from typing import Any

import pytest

from runtime_cupy.serve import openai_format as fmt
from runtime_cupy.serve.events import Finished
from runtime_cupy.serve.jobs import Job, Tally
from runtime_cupy.serve.prompts import Prepared
from runtime_cupy.serve.requests import CompletionRequest


def _job(endpoint: str, include_usage: bool) -> Job:
    request = CompletionRequest(
        endpoint=endpoint, model="m", prompt="Hi", stream=True, include_usage=include_usage
    )
    engine: Any = None
    return Job(engine, Prepared(request, (1, 2), 4, 0), 1, lambda event: None, Tally(1))


def _stream(job: Job) -> list[dict[str, Any]]:
    """Every chunk a streamed answer of ``job`` is made of, in order."""
    done = Finished("a b", "length", 2, 2)
    chunks = [fmt.chat_chunk(job, "m", {"role": "assistant", "content": ""})]
    chunks += [fmt.completion_chunk(job, "m", "Hi")]  # an echoed prompt's
    chunks += [fmt.piece_chunk(job, "m", "a b"), fmt.last_chunk(job, "m", done)]
    if job.prepared.request.include_usage:
        chunks.append(fmt.usage_chunk(job, "m", [done]))
    return chunks


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_with_include_usage_every_chunk_but_the_last_has_usage_null(endpoint: str) -> None:
    *chunks, last = _stream(_job(endpoint, include_usage=True))
    for chunk in chunks:
        assert "usage" in chunk and chunk["usage"] is None, chunk
    assert last["choices"] == []
    assert last["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_without_include_usage_no_chunk_has_usage(endpoint: str) -> None:
    for chunk in _stream(_job(endpoint, include_usage=False)):
        assert "usage" not in chunk, chunk
