"""An answer's text as it streams (``serve.text``), on SmolLM2's tokenizer: a stop
string is found at the token that ends it, also when it ends in whitespace, which the
text holds back until something follows (it may change once punctuation does); what
could begin a stop string is held back, the longest such end of any of them."""

from __future__ import annotations

import pytest

from runplan.models import resolve_model
from runtime_core.tokenizer import Tokenizer
from runtime_cupy.serve.text import Answer, StopStrings
from tests.fixtures.gguf_vocab import SPECS, write_vocab

#: What SmolLM2 says after "The capital of France is", one token a piece.
PIECES = (" Paris", ".", "\n", "\n", "The")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(resolve_model("smollm2-135m"))


def ids(tokenizer: Tokenizer) -> list[int]:
    out = []
    for piece in PIECES:
        (token,) = tokenizer.encode(piece, add_special=False, parse_special=False)
        out.append(token)
    return out


@pytest.mark.parametrize(
    ("stop", "tokens", "text"),
    [("\n", 3, " Paris."), (".\n", 3, " Paris"), ("\n\n", 4, " Paris."), ("\nT", 5, " Paris.\n")],
)
def test_a_stop_string_stops_the_answer_at_the_token_that_ends_it(
    tokenizer: Tokenizer, stop: str, tokens: int, text: str
) -> None:
    answer = Answer(tokenizer, [stop])
    pieces = []
    for token in ids(tokenizer):
        pieces.append(answer.push(token))
        if answer.stopped:
            break
    # (A stop ending in whitespace was found only once a later token was not: "\n"
    # after "The", or at the end of the run, which then said "length".)
    assert answer.stopped and answer.tokens == tokens
    assert answer.finish(None) == ""
    assert "".join(pieces) == answer.content == text


def test_whitespace_held_back_is_sent_once_something_follows(tokenizer: Tokenizer) -> None:
    answer = Answer(tokenizer, ["\nX"])
    pieces = [answer.push(token) for token in ids(tokenizer)]
    assert pieces == [" Paris", ".", "", "", "\n\nThe"]
    assert not answer.stopped and answer.content == "".join(PIECES)


def test_text_is_held_back_by_the_longest_start_of_any_stop_string() -> None:
    """ "zabc" ends with the start of both "abcd" (3 characters) and "cx" (1): all 3 are
    held, so "abcd" split as "zabc" and "d" is found and never sent."""
    stops = StopStrings(["abcd", "cx"])
    assert [stops.feed(piece) for piece in ("zabc", "d", "e")] == ["z", "", ""]
    assert stops.stopped and stops.flush() == ""


@pytest.mark.parametrize("text", ["' ' ?' Yes.", "x ' ' 's fine", "a  ' re here."])
def test_an_answer_on_a_vocabulary_that_cleans_up_spaces_is_its_whole_decode(
    tmp_path_factory: pytest.TempPathFactory, text: str
) -> None:
    """Llama 3's vocabulary cleans up spaces: "' ' ?' Yes." was sent as "'" and "'",
    the rest of the answer lost (a character shown changed under the clean-up)."""
    path = write_vocab(tmp_path_factory.mktemp("vocab") / "llama3.gguf", SPECS["bpe-llama3"])
    llama3 = Tokenizer.from_gguf(path)
    tokens = llama3.encode(text, add_special=False, parse_special=False)
    answer = Answer(llama3, [])
    pieces = [answer.push(token) for token in tokens]
    pieces.append(answer.finish(tokens))
    assert "".join(pieces) == answer.content == llama3.decode(tokens)


@pytest.fixture(scope="module")
def spm(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A SentencePiece vocabulary that adds a space prefix (Llama 2, Mistral, Phi-3)."""
    path = write_vocab(tmp_path_factory.mktemp("vocab") / "spm.gguf", SPECS["spm-llama"])
    return Tokenizer.from_gguf(path)


def continuation(spm: Tokenizer, prompt: str, answer: str) -> list[int]:
    whole = spm.encode(prompt + answer, add_special=False)
    start = spm.encode(prompt, add_special=False)
    assert whole[: len(start)] == start
    return whole[len(start) :]


def test_an_answer_goes_on_from_its_prompt_its_first_space_kept(spm: Tokenizer) -> None:
    """On a vocabulary with a space prefix, "The quick brown" then the tokens of " fox
    jumps" answered "fox jumps" (the first token decoded as a text's start): an echoed
    completion read "The quick brownfox jumps". llama.cpp's server sends each token's
    piece, the first one's space with it."""
    tokens = continuation(spm, "The quick brown", " fox jumps")
    answer = Answer(spm, [])
    pieces = [answer.push(token) for token in tokens]
    pieces.append(answer.finish(tokens))
    assert "".join(pieces) == answer.content == " fox jumps"
    assert pieces[0] == " fox"


def test_a_stop_string_may_begin_with_the_first_tokens_space(spm: Tokenizer) -> None:
    tokens = continuation(spm, "The quick brown", " fox jumps")
    answer = Answer(spm, [" fox"])
    pieces = [answer.push(token) for token in tokens]
    assert answer.stopped and answer.tokens == 1
    assert answer.finish(tokens) == "" and answer.content == "" and not any(pieces)
