"""Text streamed as tokens arrive (``console.IncrementalText``) is the whole decode, piece
by piece: no character shown is ever taken back, on every generated vocabulary
(``tests.fixtures.gguf_vocab``), those whose decode cleans up spaces included."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime_core.console import IncrementalText
from runtime_core.tokenizer import Tokenizer
from tests.fixtures.gguf_vocab import SPECS, VocabSpec

#: Pieces whose joins the clean-up rewrites (a space before ``?!.,``, `` ' ``, ``'s``,
#: ``'m``, ``'re``, ``'ve``), and characters of several bytes a token may split.
POOL = [*"aZ09 \n.,!?'-", "é", "中", "😀", "\u3000", "'s", " '", "' ", "'m", "'re", "'ve",
        " the", "  ", "\n\n"]  # fmt: skip


def _streamed(tokenizer: Tokenizer, ids: list[int], *, continues: bool = False) -> str:
    text = IncrementalText(tokenizer, continues=continues)
    pieces = [text.push(token) for token in ids]
    rest = text.finish(tokenizer.decode(ids, continues=continues))
    assert rest is not None, f"a character shown changed: {pieces}"
    return "".join(pieces) + rest


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_streamed_text_is_the_decode_whatever_the_clean_up_rewrites(
    vocab_path: Callable[[VocabSpec], Path], name: str
) -> None:
    """On a vocabulary that cleans up spaces, "rock ' n ' roll" streamed "rock '" and
    then nothing (its decode is "rock'n'roll"): the space before the apostrophe was shown
    before the clean-up dropped it, and a served answer ended at "rock '"."""
    tokenizer = Tokenizer.from_gguf(vocab_path(SPECS[name]))
    rng = random.Random(0)
    texts = ["rock ' n ' roll", "it 's fine", "we 're here", "they 've gone", "I 'm", "a ' b"]
    texts += ["".join(rng.choice(POOL) for _ in range(rng.randint(1, 20))) for _ in range(150)]
    for text in texts:
        ids = tokenizer.encode(text, add_special=False, parse_special=False)
        assert _streamed(tokenizer, ids) == tokenizer.decode(ids), text


@pytest.mark.parametrize("name", sorted(SPECS))
def test_a_space_the_clean_up_keeps_for_now_is_not_shown_before_the_clean_up(
    vocab_path: Callable[[VocabSpec], Path], name: str
) -> None:
    """On a vocabulary that cleans up spaces, the clean-up ran over the text with its
    trailing whitespace: "' '" showed "'" (its trailing space cut after the clean-up had
    dropped the one before), then "' '?" was no longer "'" and more, and nothing more of
    "' '?' Yes." was shown."""
    tokenizer = Tokenizer.from_gguf(vocab_path(SPECS[name]))
    for text in ["' ' ?' Yes.", "' ' ?", "x ' ' 's", "a  ' re", "b   ' ve!"]:
        ids = tokenizer.encode(text, add_special=False, parse_special=False)
        assert _streamed(tokenizer, ids) == tokenizer.decode(ids), text


#: Single tokens the clean-up's rules are made of, for sequences drawn token by token.
PIECES = [" ", "  ", "'", "?", ".", ",", "!", "s", "m", "r", "e", "v", "t", "x", "\n", "é"]


@pytest.mark.parametrize("name", sorted(SPECS))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(picks=st.lists(st.integers(0, 10**6), max_size=14), continues=st.booleans())
def test_every_token_sequence_streams_its_whole_decode(
    vocab_path: Callable[[VocabSpec], Path], name: str, picks: list[int], continues: bool
) -> None:
    """Whatever tokens come (not only those an encode gives), what is streamed and then
    the rest at the end add up to the whole decode, a text's start or the continuation
    of a prompt (``continues``: the first token's space prefix kept)."""
    tokenizer = Tokenizer.from_gguf(vocab_path(SPECS[name]))
    pool = sorted({i for p in PIECES for i in tokenizer.encode(p, add_special=False)})
    ids = [pool[p % len(pool)] for p in picks]
    whole = tokenizer.decode(ids, continues=continues)
    assert _streamed(tokenizer, ids, continues=continues) == whole


class _Counting(Tokenizer):
    """A tokenizer that counts the tokens it is asked to decode."""

    decoded = 0

    def decode_bytes(self, ids: Iterable[int], **kwargs: Any) -> bytes:
        ids = list(ids)
        self.decoded += len(ids)
        return super().decode_bytes(ids, **kwargs)

    def token_bytes(self, token_id: int, *, special: bool = False) -> bytes:
        self.decoded += 1
        return super().token_bytes(token_id, special=special)


TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog, and it's fine. " * 60,
    # no ASCII between characters: firm ends between whole characters of other scripts
    # (Russian and Chinese text took each token's whole text so far: 2.7 s for 4000)
    "russian": "Съешь же ещё этих мягких французских булок, да выпей чаю. " * 60,
    "chinese": "我能吞下玻璃而不伤身体\uff0c天下没有不散的宴席。" * 60,
}


@pytest.mark.parametrize("language", sorted(TEXTS))
@pytest.mark.parametrize("name", ["bpe-llama3", "spm-llama"])
def test_each_token_is_decoded_once_however_long_the_text(
    vocab_path: Callable[[VocabSpec], Path], name: str, language: str
) -> None:
    """Each token decoded the whole text so far: 4000 tokens took 7.6 s."""
    text = TEXTS[language]
    counting = _Counting(Tokenizer.from_gguf(vocab_path(SPECS[name])).vocab)
    ids = counting.encode(text, add_special=False, parse_special=False)
    stream = IncrementalText(counting)
    streamed, loose = "", 0
    for token in ids:
        streamed += stream.push(token)
        loose = max(loose, len(stream._bytes) - stream._firm)  # what each push decodes
    assert counting.decoded <= 2 * len(ids), (counting.decoded, len(ids))
    assert loose < 64, loose  # never the whole text so far
    assert streamed + (stream.finish(counting.decode(ids)) or "") == counting.decode(ids)
