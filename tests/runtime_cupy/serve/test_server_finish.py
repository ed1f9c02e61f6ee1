"""``finish_reason`` through the server, whole and streamed: "stop" for an answer that
ends on the model's end-of-sequence token before ``max_tokens``, "length" for one that
``max_tokens`` cuts. The model is a random-weight one whose EOS is the token it answers
first, greedily, to one prompt; to another it answers no EOS within ``max_tokens``."""

from __future__ import annotations

import openai
import pytest
from gguf import GGUFValueType

from runtime_cupy.serve.chain import WarmChain
from runtime_cupy.serve.engine import Engine
from runtime_cupy.workers import DEFAULT_WORKER
from runtime_sim import generate
from tests.fixtures.gguf_models import ModelShape, write_model
from tests.support.servers import serving

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process

SHAPE = ModelShape(n_layers=2, context_length=128)
ENDS = [5, 6, 7]  # answered EOS first
GOES_ON = [9, 10, 11, 12]  # answered no EOS within MAX_TOKENS
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The model whose EOS is its greedy first token after ``ENDS`` (the same weights:
    ``write_model`` is seeded)."""
    folder = tmp_path_factory.mktemp("finish")
    base = write_model(folder / "base.gguf", SHAPE)
    (first,) = generate(base, ENDS, max_tokens=1, worker=DEFAULT_WORKER).tokens
    eos = {"tokenizer.ggml.eos_token_id": (first, GGUFValueType.UINT32)}
    return str(write_model(folder / "eos.gguf", SHAPE, override_keys=eos))


def _finish(client: openai.OpenAI, prompt: list[int]) -> tuple[str, int, str | None]:
    """The whole answer's finish_reason and completion tokens, the stream's reason."""
    ask = {"model": "eos", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    whole = client.completions.create(**ask)  # type: ignore[call-overload]
    assert whole.usage is not None
    chunks = list(client.completions.create(**ask, stream=True))  # type: ignore[call-overload]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    return whole.choices[0].finish_reason, whole.usage.completion_tokens, reasons[-1]


def test_an_answer_ending_on_eos_is_stop_and_one_max_tokens_cuts_is_length(model: str) -> None:
    assert generate(model, ENDS, max_tokens=MAX_TOKENS, worker=DEFAULT_WORKER).tokens == ()
    assert len(generate(model, GOES_ON, max_tokens=MAX_TOKENS, worker=DEFAULT_WORKER).tokens) == (
        MAX_TOKENS
    )
    with serving(Engine(WarmChain(model, stages=2, context=64))) as server:
        client = server.client()
        assert _finish(client, ENDS) == ("stop", 0, "stop")
        assert _finish(client, GOES_ON) == ("length", MAX_TOKENS, "length")
